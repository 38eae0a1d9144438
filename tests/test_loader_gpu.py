"""measure_loader with real CUDA copies. Skipped without a GPU; run on a GPU machine (``pytest -m gpu``) and record
the result in docs/gpu-validation.md."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from stepscope import measure_loader

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


class Images(Dataset):
    """Ready-made 3x128x128 float32 images: no per-sample work, so the copy is the only cost of note."""

    def __init__(self, n: int = 64) -> None:
        self.x = torch.randn(n, 3, 128, 128)
        self.y = torch.arange(n)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def _h2d_ms(pin_memory: bool) -> float:
    # 32 x 3 x 128 x 128 x 4 bytes = 6.3 MB per batch: ~0.3 ms pinned at ~20 GB/s, more from pageable memory.
    loader = DataLoader(Images(640), batch_size=32, pin_memory=pin_memory)
    result = measure_loader(loader, batches=15, warmup=3, device="cuda")
    assert result.h2d_ms is not None and result.h2d_ms > 0, result
    assert result.settings is not None and result.settings.pin_memory is pin_memory
    assert result.samples_per_s is not None and result.samples_per_s > 0
    return result.h2d_ms


def test_pinned_copies_are_timed_and_not_slower_than_pageable_ones():
    torch.zeros(1, device="cuda")  # CUDA context outside the measurement
    pageable = min(_h2d_ms(pin_memory=False) for _ in range(3))
    pinned = min(_h2d_ms(pin_memory=True) for _ in range(3))
    # Sanity only: pinned, non-blocking copies go straight to the copy engine and are usually ~2x faster than staged
    # pageable ones; "not slower by much" leaves room for a GPU whose pageable path is unusually good.
    assert pinned <= 1.25 * pageable, (pinned, pageable)
