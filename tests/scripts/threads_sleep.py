"""A training loop whose every step sleeps --ms-per-thread milliseconds per torch intra-op thread (counting 2 at
most): with 2 threads a step takes twice as long as with 1, whatever the machine's load (sleeps need no core). A
known answer for a search of the thread count: `host.threads=1` halves the step."""

import argparse
import time

import torch
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=10_000)
    parser.add_argument("--ms-per-thread", type=float, default=8.0)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs, targets = torch.randn(8, 16), torch.randn(8, 4)
    for _ in range(args.iters):
        time.sleep(args.ms_per_thread * min(torch.get_num_threads(), 2) / 1000)
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


if __name__ == "__main__":
    main()
