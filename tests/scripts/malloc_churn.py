"""A small CPU training loop that glibc's malloc makes fault its memory in again every step: zero_grad() frees the
4 MB gradients of its 1024-wide layers, glibc gives the freed top of its heap back to the kernel, and the next
backward faults a thousand pages in. Prints its own minor page faults per step ("faults_per_step X") after 20 steps
of warm-up."""

import argparse
import resource

import torch
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=100)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 1024), torch.randint(0, 10, (64,))
    faults = 0
    for step in range(args.iters):
        if step == 20:
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    print(f"faults_per_step {faults / (args.iters - 20):.1f}", flush=True)


if __name__ == "__main__":
    main()
