"""LBFGS: optimizer.step(closure) runs forward and backward itself, several times per step.

The model's forward sleeps --fwd-ms so that forward time clearly dominates: it must be counted as forward (the
innermost phase), not as optimizer time.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn


class SlowMLP(nn.Module):
    def __init__(self, delay_ms: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.delay_s = delay_ms / 1000

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay_s)
        return self.net(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fwd-ms", type=float, default=3.0)
    parser.add_argument("--max-iter", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--iters", type=int, default=100_000)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    model = SlowMLP(args.fwd_ms)
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=args.max_iter, history_size=5)
    x = torch.randn(args.batch_size, 8)
    y = torch.randn(args.batch_size, 1)

    def closure():
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    for _ in range(args.iters):
        optimizer.step(closure)


if __name__ == "__main__":
    main()
