"""Inference only: iterates a DataLoader and calls the model under no_grad; never backward, never a step."""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    data = TensorDataset(torch.randn(args.batch_size * args.batches, 16))
    loader = DataLoader(data, batch_size=args.batch_size)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    seen = 0
    with torch.no_grad():
        for _ in range(args.epochs):
            for (x,) in loader:
                model(x)
                seen += 1
    print(f"no_step: {seen} batches")


if __name__ == "__main__":
    main()
