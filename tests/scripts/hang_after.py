"""Trains --steps optimizer steps (each sample sleeps 1 ms), then blocks forever in wait_for_bytes(): a socket recv
nobody answers, inside C, where no Python signal handler runs. Prints "HANGING <pid>" just before it blocks."""

import argparse
import os
import socket
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


class SleepyDataset(Dataset):
    def __len__(self) -> int:
        return 1024

    def __getitem__(self, i: int):
        time.sleep(0.001)
        return torch.ones(16) * i, i % 4


def wait_for_bytes() -> None:
    mine, _theirs = socket.socketpair()
    print(f"HANGING {os.getpid()}", flush=True)
    mine.recv(1024)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step, (x, y) in enumerate(DataLoader(SleepyDataset(), batch_size=4), start=1):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        if step == args.steps:
            wait_for_bytes()


if __name__ == "__main__":
    main()
