"""Trains --fail-at optimizer steps, then raises RuntimeError("boom at step N")."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-at", type=int, default=7)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    data = TensorDataset(torch.randn(512, 16), torch.randint(0, 4, (512,)))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    step = 0
    while True:
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            step += 1
            if step == args.fail_at:
                raise RuntimeError(f"boom at step {step}")


if __name__ == "__main__":
    main()
