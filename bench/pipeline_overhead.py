"""What does PipelineMonitor cost? Time per call of each recording method, contention, snapshot cost, memory.

- µs per call, single thread, of `with mon.infer()`, `pool_put`, `pool_take`, `with mon.dispatch_wait()`,
  `train_step`, against an empty `with` block (`contextlib.nullcontext`) and the disabled monitor (NULL_PIPELINE);
- the same `with mon.infer()` from --threads threads at once (the lock's contention), per call;
- µs per `snapshot()` and `postfix()` with a full window;
- memory: tracemalloc's peak while recording 10^4 and 10^6 events (it must not grow with the count: the window is
  100 buckets).

Medians of --repeats runs of --calls calls each. The figures are per call; an engine call or a training step takes
milliseconds, so the overhead is their ratio.

    python bench/pipeline_overhead.py [--calls 200000] [--repeats 5] [--threads 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import threading
import time
import tracemalloc
from collections.abc import Callable

from stepscope.pipeline import NULL_PIPELINE, PipelineMonitor


def per_call_us(body: Callable[[int], None], calls: int, repeats: int) -> float:
    """Median over ``repeats`` of the µs per call of ``body(calls)`` (which makes ``calls`` calls)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        body(calls)
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def infer_loop(mon) -> Callable[[int], None]:
    def body(calls: int) -> None:
        for _ in range(calls):
            with mon.infer(batch_size=8):
                pass

    return body


def null_context(calls: int) -> None:
    for _ in range(calls):
        with contextlib.nullcontext():
            pass


def method_loop(method: Callable[..., None], *args: float) -> Callable[[int], None]:
    def body(calls: int) -> None:
        for _ in range(calls):
            method(*args)

    return body


def wait_loop(mon) -> Callable[[int], None]:
    def body(calls: int) -> None:
        for _ in range(calls):
            with mon.dispatch_wait():
                pass

    return body


def threaded_us(threads: int, calls: int, repeats: int, monitored: bool = True) -> float:
    """µs per `with mon.infer()` (or an empty `with` block) when ``threads`` threads run at once (wall time / all
    calls)."""
    times = []
    for _ in range(repeats):
        body = infer_loop(PipelineMonitor(slots=threads)) if monitored else null_context
        workers = [threading.Thread(target=body, args=(calls // threads,)) for _ in range(threads)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        times.append((time.perf_counter() - t0) / (calls // threads * threads) * 1e6)
    return statistics.median(times)


def peak_kib(events: int) -> float:
    """tracemalloc peak (KiB) while recording ``events`` engine calls and pool moves over a 10 s window, on a fake
    clock that advances 1 ms per event (so the events span many windows)."""
    t = [0.0]

    def clock() -> float:
        t[0] += 0.001
        return t[0]

    tracemalloc.start()
    mon = PipelineMonitor(slots=4, window_s=10.0, clock=clock)
    for _ in range(events):
        mon.record_infer(0.01, 8)
        mon.pool_put(8)
    mon.snapshot()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--json")
    args = parser.parse_args()
    calls, repeats = args.calls, args.repeats

    mon = PipelineMonitor(slots=8)
    results = {
        "empty with (nullcontext)": per_call_us(null_context, calls, repeats),
        "with NULL_PIPELINE.infer()": per_call_us(infer_loop(NULL_PIPELINE), calls, repeats),
        "with mon.infer()": per_call_us(infer_loop(mon), calls, repeats),
        "mon.pool_put(n)": per_call_us(method_loop(mon.pool_put, 8), calls, repeats),
        "mon.pool_take(n)": per_call_us(method_loop(mon.pool_take, 8), calls, repeats),
        "with mon.dispatch_wait()": per_call_us(wait_loop(mon), calls, repeats),
        "mon.train_step(n)": per_call_us(method_loop(mon.train_step, 8), calls, repeats),
        f"empty with from {args.threads} threads": threaded_us(args.threads, calls, repeats, monitored=False),
        f"with mon.infer() from {args.threads} threads": threaded_us(args.threads, calls, repeats),
        "mon.snapshot()": per_call_us(lambda n: [mon.snapshot() for _ in range(n)], 2_000, repeats),
        "mon.postfix()": per_call_us(lambda n: [mon.postfix() for _ in range(n)], 2_000, repeats),
    }
    memory = {f"{events:,} events": peak_kib(events) for events in (10_000, 1_000_000)}

    print(f"{platform.processor() or platform.machine()}, Python {platform.python_version()}")
    print(f"{'operation':44} {'µs/call':>9}")
    for name, us in results.items():
        print(f"{name:44} {us:9.2f}")
    print("tracemalloc peak while recording:")
    for name, kib in memory.items():
        print(f"  {name:20} {kib:8.1f} KiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"us_per_call": results, "peak_kib": memory}, f, indent=2)


if __name__ == "__main__":
    main()
