"""What does `stepscope run` add to each step of an unmodified CPU training script?

Runs bench/workloads/cpu_train.py with a short and a long step count, under plain python and under
`stepscope run --no-stop --warmup 0` (every step instrumented and measured), interleaved. Per-step time is
(T_long - T_short) / (N_long - N_short) from whole-process wall times, which cancels start-up (interpreter,
torch import, stepscope's launch and merge). Reports the median over repeats and the overhead. Target (issue 3):
<= 3%.

    python bench/run_overhead.py [--repeats 5] [--short 200] [--long 1200] [--json out/run_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "bench" / "workloads" / "cpu_train.py"


def wall_s(command: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    return time.perf_counter() - t0


def command(under_stepscope: bool, steps: int) -> list[str]:
    script = [str(WORKLOAD), "--steps", str(steps)]
    if under_stepscope:
        return [sys.executable, "-m", "stepscope.cli", "run", "--no-stop", "--warmup", "0", *script]
    return [sys.executable, *script]


def main() -> None:
    parser = argparse.ArgumentParser(description="stepscope run: per-step overhead on a CPU training script")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--short", type=int, default=200)
    parser.add_argument("--long", type=int, default=1200)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    per_step: dict[str, list[float]] = {"plain": [], "stepscope": []}
    startup: dict[str, list[float]] = {"plain": [], "stepscope": []}
    for repeat in range(args.repeats):
        variants = [("plain", False), ("stepscope", True)]
        for name, under in variants if repeat % 2 == 0 else variants[::-1]:
            short = wall_s(command(under, args.short))
            long = wall_s(command(under, args.long))
            step = (long - short) / (args.long - args.short)
            per_step[name].append(step)
            startup[name].append(short - args.short * step)
    plain, instrumented = statistics.median(per_step["plain"]), statistics.median(per_step["stepscope"])
    ratios = [b / a for a, b in zip(per_step["plain"], per_step["stepscope"], strict=True)]
    result = {
        "repeats": args.repeats,
        "steps": [args.short, args.long],
        "plain_ms_per_step": plain * 1e3,
        "stepscope_ms_per_step": instrumented * 1e3,
        "overhead_pct": 100 * (statistics.median(ratios) - 1),
        "overhead_pct_per_repeat": [100 * (r - 1) for r in ratios],
        "startup_s": {k: statistics.median(v) for k, v in startup.items()},
    }
    print(
        f"per step: plain {plain * 1e3:.3f} ms, under stepscope run {instrumented * 1e3:.3f} ms; overhead "
        f"{result['overhead_pct']:+.2f}% (median of {args.repeats} paired repeats: "
        f"{', '.join(f'{x:+.1f}%' for x in result['overhead_pct_per_repeat'])})"
    )
    print(f"start-up: plain {result['startup_s']['plain']:.2f} s, stepscope {result['startup_s']['stepscope']:.2f} s")
    print(f"  {'PASS' if result['overhead_pct'] <= 3 else 'MISS'}  <= 3% per step")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
