"""Explicit collectives in a training loop, launched by torchrun over gloo: no DDP.

Each step averages the gradients with ``dist.all_reduce`` (one async, waited with ``Work.wait``) and ends with
``dist.barrier()``. Rank --slow-rank sleeps --sleep-ms between backward and the all-reduce (host time outside
every phase, so ``other``), and every other rank waits that long in the collectives: ``comms``.
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sleep-ms", type=float, default=10.0)
    parser.add_argument("--slow-rank", type=int, default=1)
    parser.add_argument("--steps", type=int, default=100_000)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    try:
        for _ in range(args.steps):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            if rank == args.slow_rank:
                time.sleep(args.sleep_ms / 1000)
            first, *rest = [p.grad for p in model.parameters()]
            work = dist.all_reduce(first, async_op=True)
            for grad in rest:
                dist.all_reduce(grad)
            work.wait()
            for p in model.parameters():
                p.grad /= world
            optimizer.step()
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
