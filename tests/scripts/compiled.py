"""A torch.compile'd model: the first steps compile (slow), later ones run the compiled graph."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--iters", type=int, default=100_000)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    model = torch.compile(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(args.batch_size, 16)
    y = torch.randint(0, 4, (args.batch_size,))
    for _ in range(args.iters):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()


if __name__ == "__main__":
    main()
