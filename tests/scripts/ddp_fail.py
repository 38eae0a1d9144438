"""DDP over gloo under torchrun, where one rank fails at a known step: it raises, or it hangs.

    --how raise   rank --fail-rank raises RuntimeError("rank R failed at step N") after N optimizer steps
    --how hang    rank --fail-rank blocks in hang_here() (time.sleep) after N steps; the other ranks wait for it in
                  DDP's gradient all-reduce until the process group's --pg-timeout-s runs out

Every sample sleeps --sample-ms in __getitem__ (the same on every rank), so no rank is slower than another.
Rank R prints "FAILING rank R pid P" just before it fails.
"""

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class SleepyDataset(Dataset):
    def __init__(self, n: int, sample_ms: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)
        self.sample_s = sample_ms / 1000

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        time.sleep(self.sample_s)
        return self.x[i], self.y[i]


def hang_here() -> None:
    time.sleep(1e6)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--how", choices=("raise", "hang"), required=True)
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--fail-at", type=int, default=12)
    parser.add_argument("--sample-ms", type=float, default=0.5)
    parser.add_argument("--pg-timeout-s", type=float, default=5.0)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = SleepyDataset(4096, args.sample_ms)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler, drop_last=True)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step, (x, y) in enumerate(loader, start=1):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if rank == args.fail_rank and step == args.fail_at:
            print(f"FAILING rank {rank} pid {os.getpid()}", flush=True)
            if args.how == "raise":
                raise RuntimeError(f"rank {rank} failed at step {step}")
            hang_here()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
