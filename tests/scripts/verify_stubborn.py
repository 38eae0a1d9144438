"""A data-bound training script for `doctor --verify` signal tests: every sample sleeps 2 ms in a loader without
workers (so the doctor advises workers, which --verify measures). Each run records itself in FOLDER (see
stubborn.py); the third run (verify's second) starts a child of its own and hangs before training."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from stubborn import record
from torch.utils.data import DataLoader, Dataset


class SleepyDataset(Dataset):
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(0.002)
        return torch.randn(16)


def main() -> None:
    folder = Path(sys.argv[1])
    run = record(folder, grandchild=len(list(folder.glob("run-*.status"))) >= 2)
    if run >= 3:
        time.sleep(600)
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for batch in DataLoader(SleepyDataset(), batch_size=4):
        loss = model(batch).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    main()
