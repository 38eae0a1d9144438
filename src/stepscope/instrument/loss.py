"""Each measured step's loss, kept where it was computed until the run ends.

The loss a backward begins from is added into a preallocated per-device buffer (one float32 slot a step), so that no
step waits for the device and no step leaves an allocation behind. Keeping the detached scalars instead left three
small blocks of the heap alive per step (the tensor, its storage and its data), which split the large holes the
script's freed gradients leave and made glibc fault a fresh 4 MB gradient in now and then: a perturbation of the
program under measurement (issue 27).
"""

from __future__ import annotations

import math
import sys
from typing import Any

from stepscope.summary import MAX_LOSS_STEPS, LossSeries


class LossBuffer:
    """Per-step loss sums (several backward passes in a step add up: micro-batches) for the first ``steps``
    measured steps, on the loss's own device."""

    def __init__(self, steps: int = MAX_LOSS_STEPS) -> None:
        self.steps = steps
        self._sums: dict[Any, Any] = {}  # device -> float32 tensor of ``steps`` slots
        self._seen = bytearray(steps)

    def add(self, step: int, loss: Any) -> None:
        """Add a scalar loss tensor to measured step ``step`` (0-based; ignored from ``steps`` on): one in-place add
        on its device, queued like the script's own kernels."""
        if step >= self.steps:
            return
        sums = self._sums.get(loss.device)
        if sums is None:
            torch = sys.modules["torch"]
            sums = self._sums[loss.device] = torch.zeros(self.steps, dtype=torch.float32, device=loss.device)
        sums.select(0, step).add_(loss.detach().reshape(()))
        self._seen[step] = 1

    def series(self) -> LossSeries | None:
        """The kept steps and their losses (None where not finite), read with one transfer per device, which waits
        for that device once; None when no step kept a loss."""
        if not any(self._seen):
            return None
        totals = [0.0] * self.steps
        for sums in self._sums.values():
            for index, value in enumerate(sums.tolist()):
                totals[index] += value
        steps = [index for index in range(self.steps) if self._seen[index]]
        return LossSeries(steps, [totals[s] if math.isfinite(totals[s]) else None for s in steps])
