"""A small CPU training loop whose input pipeline is deliberately slow, instrumented with stepscope.Scope.

Each sample costs --sample-ms milliseconds to load (a sleep standing in for decode/augment), so with the default
batch of 16 and no loader workers the step waits ~16 x 2 ms = 32 ms for data while the MLP computes in ~1 ms:
the table should show data_wait dominating the step.

    python examples/slow_loader.py [--steps 60] [--warmup 10] [--num-workers 0] [--json out/summary.json]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from stepscope import Scope


class SlowDataset(Dataset):
    """Random features and labels; each __getitem__ takes `sample_ms` milliseconds."""

    def __init__(self, size: int, features: int, sample_ms: float) -> None:
        self.size = size
        self.features = features
        self.sample_s = sample_ms / 1e3

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.sample_s)
        generator = torch.Generator().manual_seed(index)
        return torch.randn(self.features, generator=generator), torch.tensor(index % 10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="measured steps")
    parser.add_argument("--warmup", type=int, default=10, help="warm-up steps")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--sample-ms", type=float, default=2.0, help="load time per sample (ms)")
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--json", help="write the RunSummary here")
    args = parser.parse_args()

    torch.manual_seed(0)
    total_steps = args.warmup + args.steps
    dataset = SlowDataset(total_steps * args.batch_size, features=64, sample_ms=args.sample_ms)
    loader = DataLoader(dataset, batch_size=args.batch_size, num_workers=args.num_workers)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    scope = Scope(enabled=True, warmup=args.warmup)
    for x, y in scope.data(loader):
        with scope.phase("forward"):
            loss = nn.functional.cross_entropy(model(x), y)
        with scope.phase("backward"):
            loss.backward()
        with scope.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        scope.step(batch_size=x.shape[0])

    scope.print_table()
    if args.json:
        scope.summary().to_json(args.json)
        print(f"summary written to {args.json}")


if __name__ == "__main__":
    main()
