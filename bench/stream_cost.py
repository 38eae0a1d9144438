"""What does the step stream cost a training step? (issue 26: <= 1 us per step)

A step reaches the stream through the recorder: ``Recorder.add`` keeps the step and calls ``on_keep``. This times a
loop that builds each step's record as the scope does (seven phases; every 50th step without a data wait, another
layout; warm-up steps, then measured ones) and adds it, with the stream's writer as ``on_keep`` against the default
no-op, interleaved in one process (machine drift hits both alike). The ring wraps many times
(capacity 8,192 records), as in a long run. Reported: the median over --repeats of the per-step difference, and the
spread; plus the cost of reading a full ring back (what `stepscope run` and `watch` do twice a second).

    python bench/stream_cost.py [--repeats 15] [--steps 100000] [--json out/stream_cost.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

from stepscope.record import Recorder, StepRecord
from stepscope.stream import CAPACITY, Followed, StepStream, StreamReader


def _time_adds(steps: int, stream: StepStream | None) -> float:
    """Seconds per step of a loop that builds each step's record, as the scope does, and adds it to a recorder."""
    recorder = Recorder(warmup=20, fold_every=1 << 30)  # folding is the same either way: keep it out of the loop
    if stream is not None:
        recorder.on_keep = stream.step
    add = recorder.add
    start = time.perf_counter_ns()
    for i in range(steps):
        phases = {"data_wait": 300_000} if i % 50 else {}  # every 50th step has no data wait: another layout
        phases["forward"] = 1_000_000 + i
        phases["backward"] = 2_000_000
        phases["optimizer"] = 500_000
        phases["zero_grad"] = 10_000
        phases["other"] = 20_000 + i % 7
        phases["stepscope"] = 30_000
        add(StepRecord(i, 3_860_000 + i, phases, 128, end_ns=1 + i))  # the scope has its clock reading already
    return (time.perf_counter_ns() - start) / 1e9 / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="stepscope-stream-bench-"))
    meta = {"pid": 1, "hostname": "bench", "rank": 0, "launch_id": "bench"}
    extra_us = []
    for repeat in range(args.repeats):
        stream = StepStream(folder / f"r{repeat}.steps", meta)
        if repeat % 2:  # the order alternates too
            streamed_s = _time_adds(args.steps, stream)
            plain_s = _time_adds(args.steps, None)
        else:
            plain_s = _time_adds(args.steps, None)
            streamed_s = _time_adds(args.steps, stream)
        extra_us.append((streamed_s - plain_s) * 1e6)
        plain_us = plain_s * 1e6
    # Reading back: a full ring, as a reader that polls every half second finds it after 8,192 steps.
    reader = Followed(StreamReader(folder / "r0.steps"))
    start = time.perf_counter()
    read = reader.poll()
    read_s = time.perf_counter() - start
    found = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}",
        "steps_per_repeat": args.steps,
        "repeats": args.repeats,
        "loop_step_us_without_stream": round(plain_us, 3),
        "stream_us_per_step_median": round(statistics.median(extra_us), 3),
        "stream_us_per_step_min": round(min(extra_us), 3),
        "stream_us_per_step_max": round(max(extra_us), 3),
        "read_back_records": read,
        "read_back_ms": round(read_s * 1e3, 2),
        "read_back_us_per_record": round(read_s / max(read, 1) * 1e6, 2),
        "ring_capacity": CAPACITY,
    }
    print(json.dumps(found, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(found, indent=2) + "\n")


if __name__ == "__main__":
    main()
