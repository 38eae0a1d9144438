"""Trains with --sleep-ms per step; the first Ctrl-C is caught ("CAUGHT") and training goes on, the next one ends
the script. Prints "READY <pid>" after --ready-after steps and "AGAIN" --ready-after steps after the catch."""

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch import nn


def train(model: nn.Module, optimizer: torch.optim.Optimizer, args: argparse.Namespace, state: dict) -> None:
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    while True:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        time.sleep(args.sleep_ms / 1000)
        state["step"] += 1
        if state["step"] == args.ready_after:
            print(f"READY {os.getpid()}", flush=True)
        if state["caught_at"] is not None and state["step"] == state["caught_at"] + args.ready_after:
            print("AGAIN", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sleep-ms", type=float, default=5.0)
    parser.add_argument("--ready-after", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    state = {"step": 0, "caught_at": None}
    while True:
        try:  # the whole loop: a signal is handled wherever the script happens to be, its back-edge included
            train(model, optimizer, args, state)
        except KeyboardInterrupt:
            if state["caught_at"] is not None:
                raise
            state["caught_at"] = state["step"]
            print("CAUGHT", flush=True)


if __name__ == "__main__":
    main()
