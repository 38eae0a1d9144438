"""A seeded training loop that prints the loss it read after each optimizer step ("loss STEP VALUE"), so a test
can hold the loss stepscope kept for each measured step against the script's own reading."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=100_000)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.randn(64, 32)
    targets = torch.randint(0, 4, (64,))
    for step in range(args.iters):
        rows = slice(8 * (step % 8), 8 * (step % 8 + 1))
        loss = F.cross_entropy(model(data[rows]), targets[rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"loss {step} {loss.item()!r}", flush=True)


if __name__ == "__main__":
    main()
