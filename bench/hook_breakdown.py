"""Where stepscope's hook time goes, handler by handler, in a real run of a script.

``summary.overhead.hooks_us_per_step`` is one figure (the clock at each handler's entry and exit). This script is
run *as* the measured script and runs the real one inside the same process, with every handler of the tracker and
the main calls inside them (device events, their harvest, the loss buffer, the recorder, the step stream) timed
apart over the measured window:

    stepscope run --warmup 10 --steps 1500 --sample-hz 0 bench/hook_breakdown.py SCRIPT ARGS

It prints a table (µs per measured step for each handler and inner call, calls per step, the slowest call) and,
with ``HOOK_BREAKDOWN_JSON=PATH``, writes it as JSON. ``--micro`` instead times the single calls the handlers make
(clock reads, and on CUDA: event creation, record, query, elapsed_time, the loss buffer's add) in a tight loop.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import runpy
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

clock = time.perf_counter_ns


class Timers:
    """Per-name time (ns), call counts and the slowest call, counting from the measured window's start."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.worst: dict[str, int] = {}
        self.depth = 0  # handlers open: a handler called by another is counted as an inner call

    def reset(self) -> None:
        self.ns.clear()
        self.calls.clear()
        self.worst.clear()

    def add(self, name: str, ns: int) -> None:
        self.ns[name] = self.ns.get(name, 0) + ns
        self.calls[name] = self.calls.get(name, 0) + 1
        self.worst[name] = max(self.worst.get(name, 0), ns)


TIMERS = Timers()


def timed_handler(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def handler(*args: Any, **kwargs: Any) -> Any:
        outer = TIMERS.depth == 0
        TIMERS.depth += 1
        start = clock()
        try:
            return method(*args, **kwargs)
        finally:
            TIMERS.depth -= 1
            TIMERS.add(("handler " if outer else "nested ") + name, clock() - start)

    return handler


def timed_inner(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def inner(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return method(*args, **kwargs)
        finally:
            TIMERS.add("  in " + name, clock() - start)

    return inner


def install() -> None:
    """Wrap the tracker's handlers and the inner calls."""
    from stepscope.clock import CudaEvents, DeviceTimer
    from stepscope.instrument import tracker as tracker_module
    from stepscope.instrument.evaluation import EvalDetector
    from stepscope.instrument.loss import LossBuffer
    from stepscope.record import Recorder
    from stepscope.scope import Scope
    from stepscope.stream import ProcessStream, StepStream

    cls = tracker_module.Tracker
    for name, value in list(vars(cls).items()):
        if callable(value) and hasattr(value, "__wrapped__"):  # the _guarded handlers
            setattr(cls, name, timed_handler(name, value))
    for owner, names in (
        (CudaEvents, ("new_event", "record")),
        (DeviceTimer, ("harvest",)),
        (LossBuffer, ("add",)),
        (Recorder, ("add", "add_device", "release", "fold")),
        (ProcessStream, ("step",)),
        (StepStream, ("step",)),
        (Scope, ("_close_step", "_settle_held")),
        (EvalDetector, ("fetch_begin", "fetch_end", "forward", "training", "step_closed")),
        (cls, ("_probe", "_count_flops", "_close_segment", "_open_segment", "close_step", "_enter", "_exit")),
    ):
        for name in names:
            if hasattr(owner, name):
                setattr(owner, name, timed_inner(f"{owner.__name__}.{name}", getattr(owner, name)))
    begin = cls._begin_measuring

    def begin_measuring(self: Any) -> None:
        begin(self)
        TIMERS.reset()
        self._breakdown_hook_ns_at = self.hook_ns

    cls._begin_measuring = begin_measuring


def report() -> None:
    from stepscope.instrument.bootstrap import _state  # the process's tracker, made when torch was imported

    tracker = _state.get("tracker")
    steps = tracker.scope._recorder.measured if tracker is not None else 0
    if not steps:
        print("hook_breakdown: no measured step", file=sys.stderr)
        return
    hook_ns = tracker.hook_ns - getattr(tracker, "_breakdown_hook_ns_at", 0)
    rows = sorted(TIMERS.ns, key=lambda n: (not n.startswith("handler"), -TIMERS.ns[n]))
    table = {
        name: {
            "us_per_step": TIMERS.ns[name] / steps / 1e3,
            "calls_per_step": TIMERS.calls[name] / steps,
            "worst_us": TIMERS.worst[name] / 1e3,
        }
        for name in rows
    }
    handlers_us = sum(v["us_per_step"] for k, v in table.items() if k.startswith("handler"))
    print(f"\nhook_breakdown: {steps} measured steps; stepscope's hook_ns {hook_ns / steps / 1e3:.1f} µs a step, "
          f"the handlers timed here {handlers_us:.1f} µs a step", file=sys.stderr)  # fmt: skip
    print(f"{'':44} {'µs/step':>9} {'calls/step':>10} {'worst µs':>10}", file=sys.stderr)
    for name, row in table.items():
        cells = f"{row['us_per_step']:9.1f} {row['calls_per_step']:10.2f} {row['worst_us']:10.1f}"
        print(f"{name:44} {cells}", file=sys.stderr)
    out = os.environ.get("HOOK_BREAKDOWN_JSON")
    if out:
        with open(out, "w") as f:
            json.dump({"steps": steps, "hook_us_per_step": hook_ns / steps / 1e3, "rows": table}, f, indent=1)


def micro(n: int = 5000) -> None:
    """The handlers' single calls, each ``n`` times in a loop: median and p99, µs."""
    import torch

    def bench(name: str, call: Callable[[], Any]) -> None:
        times = []
        for _ in range(n):
            start = clock()
            call()
            times.append(clock() - start)
        times.sort()
        print(f"{name:40} median {statistics.median(times) / 1e3:8.2f} µs   p99 {times[int(n * 0.99)] / 1e3:8.2f} µs")

    bench("time.perf_counter_ns", clock)
    if not torch.cuda.is_available():
        print("no CUDA: clock reads only")
        return
    from stepscope.clock import CudaEvents

    source = CudaEvents()
    torch.cuda.init()
    events = [source.new_event() for _ in range(4)]
    bench("torch.cuda.Event(enable_timing=True)", source.new_event)
    bench("CudaEvents.record (fast path)", lambda: source.record(events[0]))
    bench("Event.record() (public path)", events[1].record)
    torch.cuda.synchronize()
    bench("Event.query() (complete)", events[0].query)
    source.record(events[2])
    source.record(events[3])
    torch.cuda.synchronize()
    bench("Event.elapsed_time", lambda: events[2].elapsed_time(events[3]))
    sums = torch.zeros(64, device="cuda")
    loss = torch.ones((), device="cuda")
    bench("loss buffer add (select + add_)", lambda: sums.select(0, 3).add_(loss))
    torch.cuda.synchronize()
    bench("torch.cuda.current_stream()", torch.cuda.current_stream)
    host = torch.ones(256, 1024).pin_memory()
    bench("Tensor.is_pinned", host.is_pinned)
    # The same record and query while the GPU is busy with a queue of real work, as inside a training step.
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(200):
        a @ a
    bench("CudaEvents.record, GPU busy", lambda: source.record(events[0]))
    bench("Event.query(), GPU busy", events[1].query)
    torch.cuda.synchronize()


def main() -> None:
    if sys.argv[1:2] == ["--micro"]:
        micro()
        return
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    install()
    atexit.register(report)
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
