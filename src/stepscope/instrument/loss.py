"""Each measured step's loss, kept until the run ends without a sync or an allocation per step.

A loss on a device is added into a preallocated per-device buffer (one float32 slot a step) and read once at the
end, so that no step waits for the device. A CPU loss is read at once instead (no device to wait for): an in-place
add costs ~3 µs in a tight loop but ~24 µs inside a training step whose work has evicted torch's dispatch path from
the caches, a direct ``item`` several times less. Keeping the detached scalars instead left three small blocks of the
heap alive per step (the tensor, its storage and its data), which split the large holes the script's freed gradients
leave and made glibc fault a fresh 4 MB gradient in now and then: a perturbation of the program under measurement
(issue 27).
"""

from __future__ import annotations

import math
import sys
from typing import Any

from stepscope.summary import MAX_LOSS_STEPS, LossSeries


class LossBuffer:
    """Per-step loss sums (several backward passes in a step add up: micro-batches) for the first ``steps``
    measured steps: on the loss's own device, or read at once on the CPU."""

    def __init__(self, steps: int = MAX_LOSS_STEPS) -> None:
        self.steps = steps
        self._sums: dict[Any, Any] = {}  # device -> float32 tensor of ``steps`` slots
        self._host = [0.0] * steps  # CPU losses, read as they come
        self._seen = bytearray(steps)
        torch = sys.modules["torch"]
        self._item = torch._C.TensorBase.item  # the C method: stepscope's own .item() hook must not count this read

    def add(self, step: int, loss: Any) -> None:
        """Add a scalar loss tensor to measured step ``step`` (0-based; ignored from ``steps`` on): one in-place add
        on its device, queued like the script's own kernels."""
        if step >= self.steps:
            return
        self._seen[step] = 1
        if loss.is_cpu:
            self._host[step] += self._item(loss)
            return
        sums = self._sums.get(loss.device)
        if sums is None:
            sums = self._buffer(loss)
        loss = loss.detach()
        sums.select(0, step).add_(loss.reshape(()) if loss.dim() else loss)  # a reshape costs 5 µs here

    def prepare(self, loss: Any) -> None:
        """Make the buffer for ``loss``'s device before the measured steps (call it in the warm-up): its first
        allocation and first add can wait for the device (a new block from the driver; a kernel loaded on first
        use), which inside a measured step of a loop that never syncs was a 33 ms wait on an H200."""
        if not loss.is_cpu and loss.device not in self._sums:
            self._buffer(loss)

    def _buffer(self, loss: Any) -> Any:
        torch = sys.modules["torch"]
        sums = self._sums[loss.device] = torch.zeros(self.steps, dtype=torch.float32, device=loss.device)
        sums.select(0, 0).add_(loss.detach().reshape(())).zero_()  # the add's kernel is loaded now, not in a step
        return sums

    def series(self) -> LossSeries | None:
        """The kept steps and their losses (None where not finite), read with one transfer per device, which waits
        for that device once; None when no step kept a loss."""
        if not any(self._seen):
            return None
        totals = list(self._host)
        for sums in self._sums.values():
            for index, value in enumerate(sums.tolist()):
                totals[index] += value
        steps = [index for index in range(self.steps) if self._seen[index]]
        return LossSeries(steps, [totals[s] if math.isfinite(totals[s]) else None for s in steps])
