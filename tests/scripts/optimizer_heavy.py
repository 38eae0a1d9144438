"""A loop whose optimizer step dominates: a custom Optimizer subclass that sleeps --opt-ms in step()."""

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn


class SlowSGD(torch.optim.Optimizer):
    def __init__(self, params, lr: float, delay_ms: float) -> None:
        super().__init__(params, {"lr": lr})
        self.delay_s = delay_ms / 1000

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        time.sleep(self.delay_s)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
        return loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--opt-ms", type=float, default=20.0)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=100_000)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = SlowSGD(model.parameters(), lr=0.05, delay_ms=args.opt_ms)
    x = torch.randn(args.batch_size, 16)
    y = torch.randint(0, 4, (args.batch_size,))
    for _ in range(args.iters):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()


if __name__ == "__main__":
    main()
