"""Trains forever, sleeping --sleep-ms per step; prints "READY <pid>" once --ready-after steps are done."""

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sleep-ms", type=float, default=5.0)
    parser.add_argument("--ready-after", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(args.batch_size, 16)
    y = torch.randint(0, 4, (args.batch_size,))
    step = 0
    while True:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        time.sleep(args.sleep_ms / 1000)
        step += 1
        if step == args.ready_after:
            print(f"READY {os.getpid()}", flush=True)


if __name__ == "__main__":
    main()
