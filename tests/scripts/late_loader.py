"""DDP over gloo, launched by torchrun, where one rank's input is slow: the late rank at the collectives.

The dataset yields whole batches (``batch_size=None``, ``num_workers=0``), and on rank --slow-rank each
``__getitem__`` sleeps --batch-ms, once per batch; the other ranks' batches cost nothing. So that rank reaches
DDP's gradient all-reduce --batch-ms late every step, the other ranks wait for it inside the collective, and the
cause, seen from that rank, is data loading. It trains until stepscope stops it (--steps) or --epochs run out.
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset


class Batches(Dataset):
    """``n`` batches of 16 samples; each ``__getitem__`` sleeps ``batch_ms`` before returning one."""

    def __init__(self, n: int, batch_ms: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, 16, generator=g)
        self.y = torch.randint(0, 4, (n, 16), generator=g)
        self.batch_s = batch_ms / 1000

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if self.batch_s:
            time.sleep(self.batch_s)
        return self.x[i], self.y[i]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-ms", type=float, default=15.0)
    parser.add_argument("--slow-rank", type=int, default=1)
    parser.add_argument("--batches", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=1000)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = DataLoader(Batches(args.batches, args.batch_ms if rank == args.slow_rank else 0.0), batch_size=None)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    try:
        for _ in range(args.epochs):
            for x, y in loader:
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
        print(f"late_loader: rank {rank} trained", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
