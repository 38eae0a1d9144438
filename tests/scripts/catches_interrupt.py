"""Trains with --sleep-ms per step; the first Ctrl-C is caught ("CAUGHT") and training goes on, the next one ends
the script. Prints "READY <pid>" after --ready-after steps and "AGAIN" --ready-after steps after the catch."""

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
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    step, caught_at = 0, None
    while True:
        try:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            time.sleep(args.sleep_ms / 1000)
            step += 1
        except KeyboardInterrupt:
            if caught_at is not None:
                raise
            caught_at = step
            print("CAUGHT", flush=True)
        if step == args.ready_after:
            print(f"READY {os.getpid()}", flush=True)
        if caught_at is not None and step == caught_at + args.ready_after:
            print("AGAIN", flush=True)


if __name__ == "__main__":
    main()
