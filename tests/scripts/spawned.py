"""DDP over gloo with its ranks started by torch.multiprocessing.spawn (no launcher): the environment names no rank,
each rank destroys its process group before it exits, and the script's own process trains nothing.

Each step sleeps --step-ms (the ranks' work) on a batch of 8; --port is the rendezvous port.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def train(rank: int, world: int, port: int, step_ms: float) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = DistributedDataParallel(nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(8 * 400, 16), torch.randint(0, 4, (8 * 400,)))
    for x, y in DataLoader(data, batch_size=8, sampler=DistributedSampler(data, world, rank)):
        time.sleep(step_ms / 1e3)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--step-ms", type=float, default=5.0)
    args = parser.parse_args()
    mp.spawn(train, args=(2, args.port, args.step_ms), nprocs=2)


if __name__ == "__main__":
    main()
