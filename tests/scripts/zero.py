"""Data-parallel training with ZeroRedundancyOptimizer (gloo, CPU): its step runs each rank's local Adam step,
then broadcasts the updated parameters. Launched by torchrun."""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=100_000)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    torch.set_num_threads(1)

    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    try:
        for _ in range(args.iters):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
