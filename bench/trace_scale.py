"""`stepscope trace` on a folder of many ranks: wall time, peak memory and read throughput at 8, 64 and 256 ranks.

Each rank is a copy of one real trace (default: tests/data/traces/hta/nccl_parser_config, 9.8 MB of JSON, NCCL kernels)
whose ``distributedInfo.rank`` is set to the rank, written as two gzip members: the rank's own header, then the
source's events compressed once and shared by every copy (gzip readers read members one after the other). Folders
go under --work (default /tmp/stepscope-trace-scale), reused when already there.

Each measurement is the whole CLI in a fresh child, ``python -m stepscope trace DIR --json OUT`` (PYTHONPATH=src),
timed and sampled like bench/trace_vs_hta.py: peak RSS is the larger of the sampled peak of the process tree's summed
RSS (the CLI and its reader processes) and the kernel's peak of its largest process. Ranks, events, MB (of JSON,
decompressed) and reader processes come from the JSON's ``read``; MB/s here is over the whole CLI's wall time.

    python bench/trace_scale.py [--ranks 8,64,256] [--reps 1] [--source TRACE.json.gz] [--work DIR]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
from trace_vs_hta import run_child, traces_root  # noqa: E402

_EVENTS = re.compile(rb'"traceEvents"\s*:\s*\[')
_RANK = re.compile(rb'("distributedInfo"\s*:\s*\{[^{}]*?"rank"\s*:\s*)\d+')


def write_ranks(source: Path, folder: Path, ranks: int) -> int:
    """``ranks`` copies of ``source`` in ``folder`` (rank<k>.json.gz), each with its own rank; returns the JSON bytes
    of one copy. Reused when the folder already holds them."""
    raw = gzip.decompress(source.read_bytes()) if source.suffix == ".gz" else source.read_bytes()
    match = _EVENTS.search(raw)
    if match is None or not _RANK.search(raw, 0, match.start()):
        raise SystemExit(f"{source}: needs distributedInfo.rank before traceEvents")
    head, body = raw[: match.end()], raw[match.end() :]
    done = folder / ".complete"
    if done.exists() and done.read_text() == f"{source}:{ranks}":
        return len(raw)
    folder.mkdir(parents=True, exist_ok=True)
    shared = gzip.compress(body, compresslevel=6)
    for k in range(ranks):
        own = _RANK.sub(lambda m, k=k: m.group(1) + str(k).encode(), head, count=1)
        (folder / f"rank{k}.json.gz").write_bytes(gzip.compress(own) + shared)
    done.write_text(f"{source}:{ranks}")
    return len(raw)


def measure(folder: Path, out: Path) -> dict[str, float]:
    """One run of the CLI on ``folder``: wall s, peak RSS MB, and the read figures of its JSON."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    cmd = [sys.executable, "-m", "stepscope", "trace", str(folder), "--json", str(out)]
    log = out.with_suffix(".log")
    wall, tree, largest, cpu, rc, timed_out = run_child(cmd, REPO, env, 1800, 0, 0.05, log)
    if rc != 0 or timed_out:
        raise SystemExit(f"{' '.join(cmd)} failed (rc {rc}, timed out {timed_out}); see {log}")
    read = json.loads(out.read_text())["read"]
    return {
        "wall_s": wall, "cpu_s": cpu, "peak_rss_mb": max(tree, largest) / 1e6, "largest_process_mb": largest / 1e6,
        "ranks": read["ranks"], "events": read["events"], "mb": read["mb"], "mb_per_s": read["mb"] / wall,
        "processes": read["processes"],
    }  # fmt: skip


def main() -> int:
    """Command line: see the module's doc."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="8,64,256")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--source", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "stepscope-trace-scale")
    a = ap.parse_args()
    source = a.source or traces_root() / "nccl_parser_config" / "nccl_data.json.gz"
    print("| ranks | MB json | events | processes | wall s | CPU s | MB/s | peak RSS MB | largest process MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in (int(x) for x in a.ranks.split(",")):
        folder = a.work / f"ranks{n}"
        write_ranks(source, folder, n)
        runs = [measure(folder, a.work / f"ranks{n}-{rep}.json") for rep in range(a.reps)]
        best = min(runs, key=lambda r: r["wall_s"])
        peak = statistics.median(r["peak_rss_mb"] for r in runs)
        print(
            f"| {n} | {best['mb']:,.0f} | {best['events']:,} | {best['processes']} | {best['wall_s']:.1f} | "
            f"{best['cpu_s']:.1f} | "
            f"{best['mb_per_s']:.0f} | {peak:,.0f} | {best['largest_process_mb']:,.0f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
