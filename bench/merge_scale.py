"""How `stepscope merge` scales with the job: wall time and peak memory to merge N rank summaries (N up to 1,024).

The rank files are copies of one real rank summary (a `stepscope run` of examples/plain_train.py, or --template),
each given its own rank, node (8 ranks per host), pid and job, with its phase times jittered and one rank's loader
10 ms slower, so the merge does its real work: reading and checking every file, the per-rank and per-node tables,
the straggler search, and writing the merged summary. Each size is merged by a fresh `stepscope merge` process;
its peak RSS comes from the kernel (wait4), so the figures include the interpreter and its imports (the baseline:
a 1-rank merge).

    python bench/merge_scale.py [--sizes 1 64 256 1024] [--template RANK.json] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

from stepscope.summary import RunSummary

ROOT = Path(__file__).resolve().parent.parent


def template(path: str | None, work: Path) -> RunSummary:
    """A real rank summary: the given file's (its first rank, for a merged one), else a fresh run's."""
    if path is None:
        out = work / "template.json"
        subprocess.run(
            [sys.executable, "-m", "stepscope", "run", "--warmup", "10", "--steps", "200", "--json", str(out),
             str(ROOT / "examples" / "plain_train.py")],
            check=True, capture_output=True,
        )  # fmt: skip
        path = str(out)
    summary = RunSummary.from_json(path)
    return summary.ranks[0] if summary.ranks else summary


def write_job(base: RunSummary, world: int, folder: Path, seed: int = 0) -> int:
    """``world`` rank files of one job in ``folder``; returns their total size in bytes."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    text = base.to_json()
    total = 0
    for r in range(world):
        rank = RunSummary.from_dict(orjson.loads(text))
        meta = rank.meta
        meta.rank, meta.local_rank, meta.world_size = r, r % 8, world
        meta.hostname, meta.node_rank, meta.pid = f"gpu{r // 8:04d}", r // 8, 10_000 + r
        meta.job_id = "slurm:1.0"
        for stats in rank.phases.values():
            stats.mean_ms *= 1 + rng.uniform(-0.02, 0.02)
        if r == world - 1 and "data_wait" in rank.phases:
            rank.phases["data_wait"].mean_ms += 10.0
        path = folder / f"rank{r:05d}-{meta.hostname}-pid{meta.pid}.json"
        rank.to_json(path)
        total += path.stat().st_size
    return total


def merge_once(folder: Path, out: Path) -> tuple[float, float]:
    """(wall s, peak RSS MiB) of one `stepscope merge FOLDER --json OUT` process."""
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "stepscope", "merge", str(folder), "--json", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"merge of {folder} failed: {proc.stderr.read().decode() if proc.stderr else ''}")
    return wall, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 64, 256, 1024])
    parser.add_argument("--template", help="a rank summary (or a merged one: its first rank) to replicate")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="stepscope-merge-bench-") as tmp:
        work = Path(tmp)
        base = template(args.template, work)
        print(f"template rank summary: {len(base.to_json()):,} bytes of JSON")
        print(f"{'ranks':>6} {'input MB':>9} {'wall s (median)':>16} {'peak RSS MiB':>13} {'output MB':>10}")
        for world in args.sizes:
            folder = work / f"job{world}"
            size = write_job(base, world, folder)
            out = work / f"merged{world}.json"
            runs = [merge_once(folder, out) for _ in range(args.repeats)]
            wall = statistics.median(w for w, _ in runs)
            rss = max(m for _, m in runs)
            print(f"{world:>6} {size / 1e6:>9.1f} {wall:>16.2f} {rss:>13.0f} {out.stat().st_size / 1e6:>10.1f}")


if __name__ == "__main__":
    main()
