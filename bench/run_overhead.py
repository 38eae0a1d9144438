"""What does `stepscope run` add to each step of an unmodified CPU training script?

Three figures for bench/workloads/cpu_train.py:
  paired   in one process, blocks of 10 steps alternating with stepscope run's hooks installed and removed (the
           very hooks and tracker of `stepscope run`, every step measured), timed with the thread's CPU clock;
           median, p10 and min over blocks, with an A/A control (plain against plain): the primary figure. A third
           kind of block has the same hooks on a tracker that stopped, so that every wrapper passes straight through:
           what wrapping torch's entry points costs by itself.
  loop     the script's own timer over steps 50..N, run plainly and under `stepscope run --no-stop --warmup 0`;
  wall     (T_long - T_short) / (N_long - N_short) of whole-process wall times, which cancels start-up.
Both process-level figures come with an A/A control (plain against plain): on a shared 2-core VM it moves by
several percent, so they bound gross regressions only.
Target (issue 3): <= 3% per step. Each estimator is printed beside the run's own figure (summary.overhead, issue
27): its hook handlers' time and its threads' CPU, measured in the run.

    python bench/run_overhead.py [--repeats 9] [--short 200] [--long 1000] [--json out/run_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "bench" / "workloads" / "cpu_train.py"


def timed_run(command: list[str]) -> tuple[float, float, float | None]:
    """(whole-process wall seconds, the script's own loop seconds per step, and under stepscope the run's
    self-measured cost in seconds per step: summary.overhead)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as folder:
        summary = Path(folder) / "s.json"
        if command[1:4] == ["-m", "stepscope.cli", "run"]:
            command = [*command[:4], "--json", str(summary), *command[4:]]
        t0 = time.perf_counter()
        done = subprocess.run(command, check=True, env=env, capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - t0
        own = json.loads(summary.read_text())["overhead"]["us_per_step"] / 1e6 if summary.exists() else None
    loop = next(line for line in done.stdout.splitlines() if line.startswith("loop_ms_per_step"))
    return wall, float(loop.split()[1]) / 1e3, own


def command(variant: str, steps: int, width: int) -> list[str]:
    script = [str(WORKLOAD), "--steps", str(steps), "--width", str(width)]
    if variant == "stepscope":
        return [sys.executable, "-m", "stepscope.cli", "run", "--no-stop", "--warmup", "0", *script]
    return [sys.executable, *script]


def paired(blocks: int, block_steps: int, width: int) -> dict[str, dict[str, float]]:
    """Per-step CPU time (ms) of alternating in-process blocks: plain, with stepscope run's hooks, plain again.

    Timed with the thread's CPU clock, which leaves out time the VM or other processes take; each block gives
    one mean step time, summarised as median, p10 and min over blocks (noise only ever adds time).
    """
    sys.path[:0] = [str(WORKLOAD.parent), str(ROOT / "src")]
    from cpu_train import make, step

    from stepscope.instrument.hooks import install
    from stepscope.instrument.tracker import RunConfig, Tracker
    from stepscope.scope import enabled_scope

    loader, model, criterion, optimizer = make(steps=blocks * block_steps * 4 + 100, width=width)
    batches = iter(loader)
    for _ in range(50):
        step(next(batches), model, criterion, optimizer)
    per_block: dict[str, list[float]] = {"plain": [], "stepscope": [], "pass_through": [], "plain_again": []}
    tracker = Tracker(enabled_scope(warmup=0), RunConfig(out_dir="", stop=False))
    # The same hooks on a tracker that stopped: every wrapper passes straight through (what wrapping torch's entry
    # points costs by itself, the floor of this design)
    stopped = Tracker(enabled_scope(warmup=0, system_interval_s=None), RunConfig(out_dir="", stop=False))
    stopped.stop_tracking()
    hooked = {"stepscope": tracker, "pass_through": stopped}
    for block in range(blocks):
        order = list(per_block)
        for variant in order if block % 2 == 0 else order[::-1]:
            uninstall = install(hooked[variant]) if variant in hooked else None
            used = optimizer
            if uninstall is not None:
                # stepscope hooks an optimizer's step when it is built, as under `stepscope run`: build this block's
                # under the hooks, from the plain one's state (an optimizer built before install() is not timed, and
                # the step would then close at the next fetch instead)
                used = type(optimizer)(model.parameters(), lr=1e-3)
                used.load_state_dict(optimizer.state_dict())
            t0 = time.thread_time()
            for _ in range(block_steps):
                step(next(batches), model, criterion, used)
            per_block[variant].append((time.thread_time() - t0) / block_steps * 1e3)
            if uninstall:
                uninstall()
    figures: dict[str, dict[str, float]] = {
        variant: {
            "median": statistics.median(ms),
            "p10": statistics.quantiles(ms, n=10)[0],
            "min": min(ms),
        }
        for variant, ms in per_block.items()
    }
    # What the run measured of itself over its own blocks (summary.overhead): the hooks' part, as the paired
    # figure leaves out the sampler thread (the main thread's CPU clock).
    own = tracker.summary().overhead
    figures["self_measured_us"] = {"hooks": own.hooks_us_per_step, "threads": own.threads_us_per_step or 0.0}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description="stepscope run: per-step overhead on a CPU training script")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--short", type=int, default=200)
    parser.add_argument("--long", type=int, default=1000)
    parser.add_argument("--blocks", type=int, default=300, help="paired in-process blocks of 10 steps")
    parser.add_argument("--skip-process", action="store_true", help="only the paired in-process figure")
    parser.add_argument("--width", type=int, default=256, help="model width (256: ~3.5 ms steps, 512: ~10 ms)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    blocks = paired(args.blocks, 10, args.width)
    paired_pct = {
        stat: {
            v: 100 * (blocks[v][stat] / blocks["plain"][stat] - 1) for v in ("stepscope", "pass_through", "plain_again")
        }
        for stat in ("median", "p10", "min")
    }
    for stat, pct in paired_pct.items():
        print(
            f"paired {stat:6s}: plain {blocks['plain'][stat]:.3f} ms/step, stepscope {blocks['stepscope'][stat]:.3f}"
            f" ms/step: {pct['stepscope']:+.2f}%; wrappers passing through {pct['pass_through']:+.2f}% (A/A control "
            f"{pct['plain_again']:+.2f}%)"
        )
    print(f"  {'PASS' if paired_pct['median']['stepscope'] <= 3 else 'MISS'}  <= 3% per step (paired median)")
    paired_us = (blocks["stepscope"]["median"] - blocks["plain"]["median"]) * 1e3
    own = blocks.pop("self_measured_us")
    print(
        f"self-measured (summary.overhead, hooks): {own['hooks']:.1f} us/step against the paired median's "
        f"{paired_us:.1f} us/step: {own['hooks'] / paired_us if paired_us > 0 else float('nan'):.2f}x "
        f"(its threads: {own['threads']:.1f} us/step more, on their own CPU clocks)"
    )
    if args.skip_process:
        if args.json:
            Path(args.json).write_text(json.dumps({"paired_ms_per_step": blocks, "paired_pct": paired_pct}, indent=2))
        return

    variants = ["plain", "stepscope", "plain_again"]
    loop: dict[str, list[float]] = {v: [] for v in variants}
    wall: dict[str, list[float]] = {v: [] for v in variants}
    own: list[float] = []
    for repeat in range(args.repeats):
        for variant in variants if repeat % 2 == 0 else variants[::-1]:
            short_wall, _, _ = timed_run(command(variant.removesuffix("_again"), args.short, args.width))
            long_wall, long_loop, long_own = timed_run(command(variant.removesuffix("_again"), args.long, args.width))
            loop[variant].append(long_loop)
            wall[variant].append((long_wall - short_wall) / (args.long - args.short))
            if long_own is not None:
                own.append(long_own)

    def ratio(figures: dict[str, list[float]], a: str, b: str) -> float:
        return statistics.median(y / x for x, y in zip(figures[a], figures[b], strict=True))

    result = {
        "paired_ms_per_step": blocks,
        "paired_pct": paired_pct,
        "repeats": args.repeats,
        "steps": [args.short, args.long],
        "loop_ms_per_step": {v: statistics.median(loop[v]) * 1e3 for v in variants},
        "loop_overhead_pct": 100 * (ratio(loop, "plain", "stepscope") - 1),
        "loop_aa_pct": 100 * (ratio(loop, "plain", "plain_again") - 1),
        "wall_ms_per_step": {v: statistics.median(wall[v]) * 1e3 for v in variants},
        "wall_overhead_pct": 100 * (ratio(wall, "plain", "stepscope") - 1),
        "wall_aa_pct": 100 * (ratio(wall, "plain", "plain_again") - 1),
        "self_measured_us_per_step": statistics.median(own) * 1e6,
    }
    ms = result["loop_ms_per_step"]
    print(
        f"loop (script's own timer): plain {ms['plain']:.3f} ms/step, stepscope run {ms['stepscope']:.3f} ms/step: "
        f"{result['loop_overhead_pct']:+.2f}% (A/A control {result['loop_aa_pct']:+.2f}%)"
    )
    ms = result["wall_ms_per_step"]
    print(
        f"wall (long - short runs):  plain {ms['plain']:.3f} ms/step, stepscope run {ms['stepscope']:.3f} ms/step: "
        f"{result['wall_overhead_pct']:+.2f}% (A/A control {result['wall_aa_pct']:+.2f}%)"
    )
    loop_us = (result["loop_ms_per_step"]["stepscope"] - result["loop_ms_per_step"]["plain"]) * 1e3
    print(
        f"self-measured (summary.overhead of the long runs): {result['self_measured_us_per_step']:.1f} us/step "
        f"against the loop's {loop_us:.1f} us/step"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
