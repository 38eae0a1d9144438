"""A loop that sets what the doctor's runtime facts should see: CPU autocast (bfloat16), activation
checkpointing, zero_grad(set_to_none=False), a running torch profiler when --profile is given, and two input
shapes when --vary-shapes is given."""

import argparse
import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x).mean(dim=(2, 3))
        h = checkpoint(self.block, h, use_reentrant=False)
        return self.head(h)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--vary-shapes", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, foreach=False)
    profiler = torch.profiler.profile() if args.profile else contextlib.nullcontext()
    with profiler:
        for i in range(100_000):
            side = 8 + (i % 2) * 4 if args.vary_shapes else 8
            x, y = torch.randn(4, 3, side, side), torch.randint(0, 4, (4,))
            optimizer.zero_grad(set_to_none=False)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x).float(), y)
            loss.backward()
            optimizer.step()


if __name__ == "__main__":
    main()
