"""DDP over gloo (torchrun) with find_unused_parameters=True although every parameter gets a gradient, and
gradient_as_bucket_view left at its default (False)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)), find_unused_parameters=True
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    try:
        for _ in range(100_000):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
