"""A loop with code after optimizer.step() (a scheduler step and a log line): the tail of each iteration.

Prints "tail N" once iteration N's code after the step has run, and "step_tail: done" when its loop ends.
"""

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

    model = nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1000)
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    for i in range(args.iters):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        scheduler.step()
        print(f"tail {i}", flush=True)
    print("step_tail: done", flush=True)


if __name__ == "__main__":
    main()
