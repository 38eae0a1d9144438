"""Forward passes under torch.no_grad only (an evaluation script): no backward pass ever happens."""

import argparse
import sys

import torch
from torch import nn


class Evaluated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.stem.requires_grad_(False)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.stem(x)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--exit-code", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Evaluated().eval()
    x = torch.randn(8, 8)
    with torch.no_grad():
        for _ in range(5):
            model(x)
    print("params_no_backward: done")
    sys.exit(args.exit_code)


if __name__ == "__main__":
    main()
