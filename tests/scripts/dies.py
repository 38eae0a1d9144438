"""Trains optimizer steps of a small model (each sleeping --step-ms), printing "step N" (steps done) after each,
then dies at --at without running its exit handlers: --how exit (os._exit(4)), kill (SIGKILL to itself, as the OOM
killer sends), segv (a real segmentation fault: reading address 0) or abort (SIGABRT). With --rank R under torchrun,
only that rank dies; the others run on into their next collective. --how none trains --steps steps, or for
--seconds, and ends."""

import argparse
import ctypes
import os
import signal
import time

import torch
import torch.nn.functional as F
from torch import nn


def die(how: str) -> None:
    if how == "exit":
        os._exit(4)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "segv":
        ctypes.string_at(0)
    if how == "abort":
        os.abort()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--how", choices=("exit", "kill", "segv", "abort", "none"), default="none")
    parser.add_argument("--at", type=int, default=40)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--step-ms", type=float, default=2.0)
    parser.add_argument("--rank", type=int, default=None)
    parser.add_argument("--seconds", type=float, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    distributed = "RANK" in os.environ
    if distributed:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
    else:
        rank = None
    model = nn.Linear(16, 4)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    end = None if args.seconds is None else time.monotonic() + args.seconds
    for step in range(1, args.steps + 1):
        if end is not None and time.monotonic() > end:
            break
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        time.sleep(args.step_ms / 1000)
        print(f"step {step}", flush=True)
        if step == args.at and (args.rank is None or args.rank == rank):
            die(args.how)


if __name__ == "__main__":
    main()
