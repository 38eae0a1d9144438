"""A plain CPU training script for overhead benchmarks: DataLoader over in-memory tensors, a small MLP built from
several modules, AdamW, gradient clipping, and a loss.item() per step (as most scripts log). Run as a script it
prints its own loop time per step after 50 steps of warm-up ("loop_ms_per_step X"), a figure free of process
start-up; bench/run_overhead.py also imports ``make`` and ``step`` to time steps in-process.

    python bench/workloads/cpu_train.py --steps 500
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def make(
    steps: int, batch_size: int = 64, width: int = 256
) -> tuple[DataLoader, nn.Module, nn.Module, torch.optim.Optimizer]:
    """The loader, model, loss and optimizer of the workload (``width`` scales the compute per step)."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    samples = steps * batch_size
    data = TensorDataset(torch.randn(samples, width), torch.randint(0, 10, (samples,)))
    loader = DataLoader(data, batch_size=batch_size, shuffle=True)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()) for _ in range(4)]
    model = nn.Sequential(*blocks, nn.Linear(width, 10))
    return loader, model, nn.CrossEntropyLoss(), torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(batch: tuple[torch.Tensor, torch.Tensor], model: nn.Module, criterion: nn.Module, optimizer) -> float:
    """One training step; returns the loss (a host read, as most scripts log)."""
    x, y = batch
    loss = criterion(model(x), y)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    loader, model, criterion, optimizer = make(args.steps, args.batch_size, args.width)
    total, started = 0.0, 0.0
    for i, batch in enumerate(loader):
        if i == 50:
            started = time.perf_counter()
        total += step(batch, model, criterion, optimizer)
    print(f"mean loss {total / args.steps:.4f}")
    print(f"loop_ms_per_step {(time.perf_counter() - started) / (args.steps - 50) * 1e3:.4f}")


if __name__ == "__main__":
    main()
