"""A training loop starved by its Dataset: every sample sleeps --sample-ms milliseconds in __getitem__.

--accum N accumulates gradients over N micro-batches per optimizer step."""

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


class SlowDataset(Dataset):
    def __init__(self, n: int, sample_ms: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)
        self.sample_s = sample_ms / 1000

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        time.sleep(self.sample_s)
        return self.x[i], self.y[i]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sample-ms", type=float, default=3.0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--persistent-workers", action="store_true")
    parser.add_argument("--num-samples", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=1000)
    parser.add_argument("--accum", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    loader = DataLoader(
        SlowDataset(args.num_samples, args.sample_ms),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.num_workers,
        persistent_workers=args.persistent_workers,
    )
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    micro = 0
    for _ in range(args.epochs):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y) / args.accum
            loss.backward()
            micro += 1
            if micro % args.accum == 0:
                optimizer.step()
                optimizer.zero_grad()
    print("slow_loader: done")


if __name__ == "__main__":
    main()
