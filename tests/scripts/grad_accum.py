"""Gradient accumulation: --accum micro-batches (forward + backward each) per optimizer step."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=1000)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    data = TensorDataset(torch.randn(512, 16), torch.randint(0, 4, (512,)))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.zero_grad()
    micro = 0
    for _ in range(args.epochs):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y) / args.accum
            loss.backward()
            micro += 1
            if micro % args.accum == 0:
                optimizer.step()
                optimizer.zero_grad()


if __name__ == "__main__":
    main()
