"""DDP over gloo, launched by torchrun: a DistributedSampler per rank, and one slow rank.

Every sample sleeps --sample-ms in __getitem__; on rank --slow-rank (or, on a multi-node job, the process with
local rank --slow-local-rank) it sleeps --extra-ms more, so that rank is the straggler and the time it loses is
spent in data_wait (and its loader ceiling is the lower one). With --slurm it is one task of ``srun`` (no
torchrun): its rank and world size come from SLURM_PROCID/SLURM_NTASKS, as Slurm job scripts do it.
"ddp: rank N trained" is printed only after the last epoch. With --side-forwards N, rank --side-rank runs N
forwards without gradients of a second model after every optimizer step (a metric), each sleeping --side-ms.
With --val-every N, rank --val-rank alone validates every N steps: --val-batches batches of a loader whose samples
each sleep --val-ms / batch size, as scripts that evaluate on rank 0 only do; the other ranks wait for it in the
next step's all-reduce.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sleepy import Sleepy
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sample-ms", type=float, default=0.5)
    parser.add_argument("--extra-ms", type=float, default=1.25)
    parser.add_argument("--slow-rank", type=int, default=1)
    parser.add_argument("--slow-local-rank", type=int, default=None)
    parser.add_argument("--slurm", action="store_true")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--side-forwards", type=int, default=0)
    parser.add_argument("--side-ms", type=float, default=1.0)
    parser.add_argument("--side-rank", type=int, default=1)
    parser.add_argument("--val-every", type=int, default=0)
    parser.add_argument("--val-batches", type=int, default=4)
    parser.add_argument("--val-ms", type=float, default=8.0, help="per validation batch")
    parser.add_argument("--val-rank", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    if args.slurm:
        env_rank, env_world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
        dist.init_process_group("gloo", rank=env_rank, world_size=env_world)
        local_rank = int(os.environ["SLURM_LOCALID"])
    else:
        dist.init_process_group("gloo")
        local_rank = int(os.environ["LOCAL_RANK"])
    rank, world = dist.get_rank(), dist.get_world_size()
    slow = local_rank == args.slow_local_rank if args.slow_local_rank is not None else rank == args.slow_rank
    if slow:
        print(f"ddp: slow rank {rank}", flush=True)
    sample_ms = args.sample_ms + (args.extra_ms if slow else 0.0)
    dataset = SleepyDataset(args.samples, sample_ms)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    metric = Sleepy(args.side_ms)  # a second model, off DDP
    side_forwards = args.side_forwards if rank == args.side_rank else 0

    def side_work(x: torch.Tensor) -> None:
        with torch.no_grad():
            for _ in range(side_forwards):
                metric(x)

    val_set = SleepyDataset(args.batch_size * args.val_batches, args.val_ms / args.batch_size)
    val_loader = DataLoader(val_set, batch_size=args.batch_size)

    def validate() -> None:
        model.eval()
        with torch.no_grad():
            for x, _ in val_loader:
                model.module(x)  # the inner model: DDP's forward outside training would sync buffers
        model.train()

    step = 0

    try:
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                side_work(x)
                step += 1
                if args.val_every and step % args.val_every == 0 and rank == args.val_rank:
                    validate()
        print(f"ddp: rank {rank} trained", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
