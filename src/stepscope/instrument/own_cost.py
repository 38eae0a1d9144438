"""stepscope's own cost in a run, measured in the run itself (``summary.overhead``).

Two parts, over the measured window, per measured step:
- its hook handlers: every tracker event (a fetch, a forward, a backward, an optimizer step, a read-back, the step's
  close) reads the clock on entry and on exit, and the sum of those spans is stepscope's time in the step;
- its own threads (named ``stepscope-``: the system and stack samplers, the checkpoints, the sinks): their on-CPU
  time from ``/proc/self/task/<tid>/schedstat``, a CPU the job shares with its training thread and its loader.

Not in it: the wrappers' own Python frames around torch's entry points when no event follows (an inner module's
call, a ``.item()`` inside the optimizer: a fraction of a microsecond each in a tight loop, but ~40 a step on
bench/workloads/cpu_train.py cost 35-60 µs a step there, 1.1-1.8% of a 3.4 ms step, which is why the figure reads
low by about that). ``bench/run_overhead.py`` holds the figure against interleaved plain runs of the same steps, and
times the wrappers passing straight through apart.
"""

from __future__ import annotations

import os
import threading

from stepscope.collectors.host import parse_on_cpu
from stepscope.summary import Overhead

OWN_THREAD_PREFIX = "stepscope-"
_HOOKS = "measured in this run: the clock at the entry and exit of each of stepscope's hook handlers"
_REST = "over the measured steps; the wrappers' own frames around torch calls that open no event are not counted"
HOW = f"{_HOOKS}, and the on-CPU time of its own threads (schedstat), {_REST}"
HOW_NO_THREADS = f"{_HOOKS} (its threads' CPU is not measured here: no /proc/self/task/<tid>/schedstat), {_REST}"


def own_threads_cpu_ns() -> dict[int, int] | None:
    """The on-CPU time so far (ns) of each live stepscope thread, by native thread id; None where the kernel does
    not report it (no procfs schedstat: macOS, kernels without schedstats)."""
    if not os.path.exists("/proc/thread-self/schedstat"):
        return None
    found: dict[int, int] = {}
    threads = [t.native_id for t in threading.enumerate() if t.name.startswith(OWN_THREAD_PREFIX) and t.native_id]
    for tid in threads:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                found[tid] = parse_on_cpu(f.read())
        except (OSError, ValueError, IndexError):
            continue  # it ended between the listing and the read: its time since the last snapshot is lost
    return found


def threads_cpu_between(start: dict[int, int] | None, end: dict[int, int] | None) -> int | None:
    """The on-CPU ns of stepscope's threads between two snapshots: a thread alive at both, the difference; one
    started since, all of its time. None when either snapshot is missing."""
    if start is None or end is None:
        return None
    return sum(ns - start.get(tid, 0) for tid, ns in end.items())


def overhead(hook_ns: int, threads_ns: int | None, steps: int, step_ms: float | None) -> Overhead | None:
    """stepscope's cost per measured step (µs) and as a share of the mean step; None before a measured step."""
    if steps <= 0:
        return None
    hooks_us = hook_ns / steps / 1e3
    threads_us = None if threads_ns is None else threads_ns / steps / 1e3
    us = hooks_us + (threads_us or 0.0)
    share = us / (step_ms * 1e3) if step_ms else None
    return Overhead(
        us_per_step=round(us, 2),
        share=None if share is None else round(share, 5),
        hooks_us_per_step=round(hooks_us, 2),
        threads_us_per_step=None if threads_us is None else round(threads_us, 2),
        how=HOW if threads_ns is not None else HOW_NO_THREADS,
    )
