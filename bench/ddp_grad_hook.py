"""What does the comms split cost per DDP parameter? (stepscope run's post-accumulate-grad hook)

One process, gloo with world size 1: the same DDP model's backward timed with stepscope's hooks installed and
removed, interleaved (medians of --repeats rounds of --iters backward passes). The model has --params small
parameter tensors, so the per-parameter hook cost dominates the difference; the result is reported per
parameter and per backward pass.

    python bench/ddp_grad_hook.py [--params 200] [--iters 200] [--repeats 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from stepscope.instrument.hooks import install
from stepscope.instrument.tracker import RunConfig, Tracker
from stepscope.scope import enabled_scope


def backward_us(model: nn.Module, x: torch.Tensor, iters: int) -> float:
    """Mean wall time of forward + backward (us)."""
    start = time.perf_counter()
    for _ in range(iters):
        model(x).sum().backward()
    return (time.perf_counter() - start) / iters * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=int, default=200)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)

    def mlp() -> nn.Module:
        return nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(args.params)])

    x = torch.randn(2, 4)
    plain = DistributedDataParallel(mlp())  # wrapped before stepscope's hooks: no gradient hook on its parameters
    tracker = Tracker(enabled_scope(warmup=0), RunConfig(out_dir="", stop=False))
    uninstall = install(tracker)
    hooked = DistributedDataParallel(mlp())  # the same shapes, each parameter with stepscope's gradient hook
    plain_us, hooked_us = [], []
    for _ in range(args.repeats):
        plain_us.append(backward_us(plain, x, args.iters))
        hooked_us.append(backward_us(hooked, x, args.iters))
    uninstall()
    dist.destroy_process_group()
    base, with_hooks = statistics.median(plain_us), statistics.median(hooked_us)
    print(f"{args.params} parameters: forward+backward {base:.0f} us without the hook, {with_hooks:.0f} us with it")
    print(f"difference {with_hooks - base:.0f} us per pass, {(with_hooks - base) / args.params:.2f} us per parameter")


if __name__ == "__main__":
    main()
