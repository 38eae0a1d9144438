"""A small CPU training loop that glibc's malloc makes fault its memory in again every step: zero_grad() frees the
4 MB gradients of its 1024-wide layers, glibc gives them back to the kernel, and the next backward faults a thousand
pages in. Prints its own minor page faults per step ("faults_per_step X") after 20 steps of warm-up.

glibc's mmap threshold is pinned at its starting value (128 KB) unless the environment sets the thresholds (as
`--apply malloc.mmap_threshold` does): left to itself, glibc raises it after the first large free by an amount that
depends on what the process freed before, and the churn varied from run to run (380-910 faults a step in five
identical runs, and 42 in one), which is the bug this script stands for but no ground truth for a test."""

import argparse
import ctypes
import os
import resource

import torch
from torch import nn

M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=100)
    args = parser.parse_args()
    if not {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} & set(os.environ):
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 128 * 1024)  # pinned: see above
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
