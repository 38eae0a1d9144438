"""Does `sweep_loader` pick the best DataLoader setting, and what does the sweep cost?

For each workload — a CPU-bound dataset (every sample busy-waits --sample-ms, like decoding) and an I/O-like one
(every sample sleeps --sample-ms, like a read from slow storage) — a DataLoader with the default settings
(num_workers=0) is

1. swept --sweeps times with `sweep_loader` at its default batches/warm-up (100 / 10) and --budget-s: wall time
   of each sweep and the setting it names best;
2. measured exhaustively: every first-round candidate (`candidate_settings` up to `worker_cap`, same cores), every
   setting a sweep tried (it goes past the cap when the workers mostly wait), and the --beyond worker counts, each
   rebuilt fresh and measured with `measure_loader` for --batches batches after --warmup, --repeats times in
   round-robin order
   (so that drift on a shared machine hits every setting alike); the median samples/s per setting, and the best.

The figure of merit is pick_rate / best_rate: the exhaustive median rate of the setting the sweep picked over the
best exhaustive median rate of all settings measured (1.0 = the sweep found the best setting, or one as fast).

With --trainer-ms T the ground truth is training, not the loader alone: the exhaustive measurement consumes each
batch with a T ms busy-wait in the main process (a CPU-bound training step, competing with the workers for the
cores), and the sweep is told the step (``trainer_ms_per_sample`` = T / batch size, as `stepscope dataloader
--against RUN.json` tells it) and ranks by the rate that step would reach.

    python bench/loader_sweep.py [--workloads cpu,io] [--sample-ms 1] [--batch-size 16] [--samples 20000]
                                 [--budget-s 120] [--sweeps 3] [--batches 300] [--warmup 20] [--repeats 3]
                                 [--beyond 4,8] [--trainer-ms 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from stepscope.analyses.loader import (
    LoaderSettings,
    SweepResult,
    candidate_settings,
    measure_loader,
    rebuild_loader,
    sweep_loader,
    worker_cap,
)
from stepscope.collectors.host import cgroup_cpu_quota, usable_cores


class BusyDataset(Dataset):
    """CPU-bound: every sample burns ``sample_ms`` of CPU in a busy-wait."""

    def __init__(self, n: int, sample_ms: float) -> None:
        self.n = n
        self.sample_s = sample_ms / 1e3

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        end = time.perf_counter() + self.sample_s
        while time.perf_counter() < end:
            pass
        return torch.full((64,), float(i)), i % 10


class SleepyDataset(BusyDataset):
    """I/O-like: every sample waits ``sample_ms`` without using the CPU."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        time.sleep(self.sample_s)
        return torch.full((64,), float(i)), i % 10


WORKLOADS = {"cpu": BusyDataset, "io": SleepyDataset}


def busy_wait(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def training_rate(loader: Any, batches: int, warmup: int, trainer_ms: float) -> float:
    """Samples/s of a loop that spends ``trainer_ms`` of CPU on each batch in this process (the training step's
    stand-in), over ``batches`` batches after ``warmup``; new epochs start when the data runs out."""
    iterator = iter(loader)
    seen, samples, started = 0, 0, 0.0
    while seen < warmup + batches:
        try:
            x, _ = next(iterator)
        except StopIteration:
            iterator = iter(loader)
            continue
        if seen == warmup:
            started = time.perf_counter()
        if seen >= warmup:
            samples += len(x)
        busy_wait(trainer_ms / 1e3)
        seen += 1
    elapsed = time.perf_counter() - started
    del iterator
    return samples / elapsed


def label(settings: LoaderSettings) -> str:
    if settings.num_workers == 0:
        return f"workers=0{' pin' if settings.pin_memory else ''}"
    return f"workers={settings.num_workers} prefetch={settings.prefetch_factor}{' pin' if settings.pin_memory else ''}"


def key(settings: LoaderSettings) -> tuple[int, int, bool]:
    return settings.num_workers, settings.prefetch_factor or 2, settings.pin_memory


def bench_workload(name: str, args: argparse.Namespace, cores: int) -> dict[str, Any]:
    dataset = WORKLOADS[name](args.samples, args.sample_ms)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
    true_rate = 1e3 / args.sample_ms  # samples/s of one process doing the work and nothing else
    step = f", a training step of {args.trainer_ms:g} ms per batch" if args.trainer_ms else ""
    print(f"\n== {name}: {type(dataset).__name__}, {args.sample_ms:g} ms/sample, batch {args.batch_size}{step} "
          f"(one process: at most {true_rate:,.0f} samples/s) ==", flush=True)  # fmt: skip

    sweeps = []
    sweep_runs: list[SweepResult] = []
    for i in range(args.sweeps):
        started = time.perf_counter()
        trainer = args.trainer_ms / args.batch_size if args.trainer_ms else None
        sweep = sweep_loader(loader, budget_s=args.budget_s, cores=cores, trainer_ms_per_sample=trainer)
        wall = time.perf_counter() - started
        sweep_runs.append(sweep)
        pick = sweep.best.settings if sweep.best is not None else None
        sweeps.append(
            {
                "wall_s": wall,
                "pick": None if pick is None else label(pick),
                "pick_key": None if pick is None else key(pick),
                "pick_sweep_rate": None
                if sweep.best is None
                else (sweep.best.train_samples_per_s if trainer else sweep.best.samples_per_s),
                "gain": sweep.gain,
                "trials": {label(t.settings): t.samples_per_s for t in sweep.trials},
                "skipped": len(sweep.skipped),
                "errors": [t.error for t in sweep.trials if t.error],
            }
        )
        print(
            f"sweep {i + 1}: {wall:.1f} s wall, pick {sweeps[-1]['pick']} "
            f"({sweeps[-1]['pick_sweep_rate'] or 0:,.0f} samples/s in the sweep, gain {sweep.gain or 0:+.0%}), "
            f"{len(sweep.trials)} trials, {len(sweep.skipped)} skipped",
            flush=True,
        )

    current = LoaderSettings(0, None, False, False)
    # Every setting any sweep tried (it goes past the cores when workers wait), the first-round candidates, and
    # the --beyond worker counts: the exhaustive search measures all of them.
    tried = [t.settings for run in sweep_runs for t in run.trials]
    settings_all: list[LoaderSettings] = []
    for settings in [
        *candidate_settings(current, worker_cap(cores), torch.cuda.is_available()),
        *tried,
        *(LoaderSettings(int(w), 2, False, True) for w in filter(None, args.beyond.split(","))),
    ]:
        if all(key(settings) != key(seen) for seen in settings_all):
            settings_all.append(settings)
    rates: dict[tuple[int, int, bool], list[float]] = {key(s): [] for s in settings_all}
    started = time.perf_counter()
    for _ in range(args.repeats):
        for settings in settings_all:
            rebuilt = rebuild_loader(loader, settings)
            if args.trainer_ms:
                rate = training_rate(rebuilt, args.batches, args.warmup, args.trainer_ms)
            else:
                rate = measure_loader(rebuilt, batches=args.batches, warmup=args.warmup).samples_per_s or 0.0
            rates[key(settings)].append(rate)
    exhaustive_wall = time.perf_counter() - started
    medians = {k: statistics.median(v) for k, v in rates.items()}
    best_key = max(medians, key=lambda k: medians[k])
    best_rate = medians[best_key]
    swept = {key(s) for s in tried}
    names = {key(s): label(s) + ("" if key(s) in swept else " (no sweep tried it)") for s in settings_all}
    print(f"exhaustive ({args.repeats} x {args.batches} batches per setting, {exhaustive_wall:.0f} s):")
    for k in sorted(medians, key=lambda k: -medians[k]):
        spread = f"{min(rates[k]):,.0f}–{max(rates[k]):,.0f}"
        print(f"  {names[k]:<42} median {medians[k]:>9,.0f} samples/s  (runs {spread})  {medians[k] / best_rate:.3f}")
    for run in sweeps:
        run["pick_rate"] = medians.get(run["pick_key"]) if run["pick_key"] is not None else None
        run["pick_over_best"] = None if run["pick_rate"] is None else run["pick_rate"] / best_rate
    ratios = [run["pick_over_best"] for run in sweeps if run["pick_over_best"] is not None]
    print(
        f"best: {names[best_key]} {best_rate:,.0f} samples/s; sweep picks: "
        + ", ".join(f"{r['pick']} ({r['pick_over_best']:.3f})" for r in sweeps if r["pick_over_best"] is not None)
        + f"; sweep wall median {statistics.median(r['wall_s'] for r in sweeps):.1f} s",
        flush=True,
    )
    return {
        "workload": name,
        "dataset": type(dataset).__name__,
        "sample_ms": args.sample_ms,
        "batch_size": args.batch_size,
        "trainer_ms": args.trainer_ms,
        "sweeps": [{k: v for k, v in s.items() if k != "pick_key"} for s in sweeps],
        "exhaustive": {names[k]: {"median": medians[k], "runs": rates[k]} for k in medians},
        "exhaustive_wall_s": exhaustive_wall,
        "best": names[best_key],
        "best_rate": best_rate,
        "pick_over_best_median": statistics.median(ratios) if ratios else None,
        "pick_over_best_min": min(ratios) if ratios else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="cpu,io", help="comma-separated: cpu, io")
    parser.add_argument("--sample-ms", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--samples", type=int, default=20_000, help="dataset size (enough for every measurement)")
    parser.add_argument("--budget-s", type=float, default=120.0, help="sweep budget (sweep_loader's default)")
    parser.add_argument("--sweeps", type=int, default=3, help="sweeps per workload")
    parser.add_argument("--batches", type=int, default=300, help="exhaustive: batches per measurement")
    parser.add_argument("--warmup", type=int, default=20, help="exhaustive: warm-up batches per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="exhaustive: measurements per setting")
    parser.add_argument(
        "--beyond", default="4,8", help="exhaustive: also these worker counts (prefetch 2); '' for none"
    )
    parser.add_argument(
        "--trainer-ms", type=float, default=0.0, help="a CPU-bound training step of this many ms per batch (0: none)"
    )
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # More workers than cores (--beyond) is the point of that comparison: torch's advice against it is noise here.
    warnings.filterwarnings("ignore", message=".*worker processes in total.*")
    quota = cgroup_cpu_quota()
    cores = max(1, int(quota) if quota else usable_cores())
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, {cores} usable cores "
        f"({os.cpu_count()} CPUs), CUDA {'yes' if torch.cuda.is_available() else 'no'}",
        flush=True,
    )
    needed = (args.warmup + args.batches) * args.batch_size
    if args.samples < needed:
        print(f"--samples must be at least (warmup + batches) x batch size = {needed}", file=sys.stderr)
        return 2
    results = [bench_workload(name, args, cores) for name in args.workloads.split(",")]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cores": cores, "args": vars(args), "workloads": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
