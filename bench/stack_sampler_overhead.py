"""Cost of the stack sampler (collectors/stacks.py) on a training step.

Two figures: the sampler thread's cost per sample (one ``sample()`` of a thread parked 40 frames deep in user
code, timed in the sampling thread), and the step-time ratio of a CPU MLP step with the sampler running at each
rate against none, in interleaved blocks of steps, with an A/A control (none against none).

    python bench/stack_sampler_overhead.py --rates 100 250 --blocks 40
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch
from torch import nn

from stepscope.collectors.stacks import StackSampler


def _deep(depth: int, ready: threading.Event, release: threading.Event) -> None:
    if depth:
        _deep(depth - 1, ready, release)
        return
    ready.set()
    release.wait()


def per_sample_us(samples: int = 2000, depth: int = 40) -> float:
    """Median µs of one sample of a thread parked ``depth`` user frames deep (in threading.Event.wait)."""
    ready, release = threading.Event(), threading.Event()
    thread = threading.Thread(target=_deep, args=(depth, ready, release), daemon=True)
    thread.start()
    ready.wait()
    sampler = StackSampler(thread.ident, lambda frame: "other")
    times = []
    for _ in range(samples):
        t0 = time.perf_counter_ns()
        sampler.sample()
        times.append(time.perf_counter_ns() - t0)
    release.set()
    thread.join()
    return statistics.median(times) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rates", type=float, nargs="+", default=[100.0, 250.0])
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--steps", type=int, default=30, help="steps per block")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256), nn.GELU(), nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))

    def block() -> float:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        return (time.perf_counter() - t0) / args.steps

    for _ in range(3):
        block()
    variants: list[float | None] = [None, None, *args.rates]  # two "off" variants: the A/A control
    times: dict[int, list[float]] = {i: [] for i in range(len(variants))}
    me = threading.get_ident()
    for _ in range(args.blocks):
        for i, rate in enumerate(variants):
            sampler = None if rate is None else StackSampler(me, lambda frame: "other", rate).start()
            times[i].append(block())
            if sampler is not None:
                sampler.stop()
    off = statistics.median(times[0])
    print(f"per sample (40 user frames deep): {per_sample_us():.1f} µs")
    print(f"step off: {off * 1e3:.3f} ms (median of {args.blocks} blocks of {args.steps} steps)")
    print(f"A/A control: {statistics.median(times[1]) / off:.4f}")
    for i, rate in enumerate(variants[2:], start=2):
        print(f"{rate:g} Hz: {statistics.median(times[i]) * 1e3:.3f} ms, ratio {statistics.median(times[i]) / off:.4f}")


if __name__ == "__main__":
    main()
