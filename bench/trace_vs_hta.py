"""`stepscope trace` against Holistic Trace Analysis (HTA 0.5.0): wall time, peak memory and agreement, side by side.

For each input, each tool runs as a fresh child process (import time included), --reps times, alternating
HTA / stepscope so that drift on a shared machine hits both alike:

- HTA (in its own venv, made by bench/hta_reference.py's `ensure_venv` when missing): bench/trace_vs_hta_child.py,
  i.e. ``TraceAnalysis(trace_dir=DIR)``, ``get_temporal_breakdown``, ``get_idle_time_breakdown`` per rank,
  ``get_comm_comp_overlap`` and ``get_gpu_kernel_breakdown``, all with ``visualize=False``;
- stepscope: the whole CLI, ``python -m stepscope trace DIR --json OUT`` (PYTHONPATH=src).

Wall time is `time.perf_counter` around spawning and reaping the child. Peak memory is the larger of two lower
bounds of the process tree's peak: the largest sum of RSS over the child and all its descendants (e.g. either
tool's per-rank parser processes), sampled every --sample-ms from /proc, and the kernel's exact peak of the
largest single process (``ru_maxrss`` from ``os.wait4``: the child or a descendant it reaped), which a sample can
miss. For a single process the second is exact. Both tools run under the same address-space cap
(RLIMIT_AS, --mem-cap-gib) and time limit (--timeout-s); a run that exceeds either is reported as such, and a tool
that failed on an input is not run on it again.

Inputs: the larger real single-rank traces of tests/data/traces/hta, each alone in a folder (a symlink), and the
2-rank folder trace_filter; then synthetic traces of about --synthetic-mb MB uncompressed, built by replicating
--synthetic-source with bench/replicate_trace.py (written under --work, reused when already there). Figures
(idle, compute, non-compute, overlap per rank) are compared and any difference over 0.5 pp printed.

    python bench/trace_vs_hta.py [--quick] [--reps 5] [--reps-synthetic 3] [--synthetic-mb 50,200,1000]
                                 [--timeout-s 900] [--mem-cap-gib 16] [--doc docs/benchmarks.md | --no-doc]

--quick: the real traces only, one repetition, no doc (unless --doc is given). --from-json RAW: write the report
of a run saved earlier (its raw results, --json) without measuring again.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import math
import os
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
import replicate_trace  # noqa: E402
from hta_reference import ensure_venv, machine, venv_versions  # noqa: E402

HTA_CHILD = BENCH / "trace_vs_hta_child.py"
REAL = [  # (label, path relative to the traces root: a file is run alone, a folder as a multi-rank job)
    ("nccl_parser_config", "nccl_parser_config/nccl_data.json.gz"),
    ("ns_resolution_trace", "ns_resolution_trace/rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz"),
    ("negative_queue_length_values_check", "negative_queue_length_values_check/rank0.json.gz"),
    ("trace_diff/test", "trace_diff/test/test.json.gz"),
    ("trace_diff/control", "trace_diff/control/control.json.gz"),
    ("mtia_trace_single_rank", "mtia_trace_single_rank/mtia_rank_0.json.gz"),
    ("df_index_resolver", "df_index_resolver/df_index_resolver.json.gz"),
    ("trace_filter (2 ranks)", "trace_filter"),
]
SYNTH_SOURCE = "negative_queue_length_values_check/rank0.json.gz"
FIGURES = ("idle_pct", "compute_pct", "non_compute_pct", "overlap_pct")
TOLERANCE_PP = 0.5
PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class Input:
    """One measured job: the folder both tools are given, and its size."""

    label: str
    trace_dir: Path
    files: list[Path]
    compressed_mb: float
    uncompressed_mb: float
    synthetic: bool = False
    replicas: int = 0


@dataclass
class Run:
    """One child process: how long, how much memory, how it ended, and (first good run) the figures it reported."""

    tool: str
    wall_s: float
    peak_rss_mb: float  # max(sampled peak of the tree's summed RSS, maxrss_mb)
    sampled_mb: float  # sampled peak of the process tree's summed RSS
    maxrss_mb: float  # ru_maxrss from wait4: the largest single process (child or a reaped descendant)
    cpu_s: float  # user + system CPU time of the child and its reaped descendants (wait4)
    rc: int
    timed_out: bool = False
    error: str = ""
    figures: dict[str, dict[str, float | None]] = field(default_factory=dict)
    events: int | None = None
    detail: dict[str, float | None] = field(default_factory=dict)  # the child's own timings
    load1: float = 0.0  # 1-minute load average when it started

    @property
    def ok(self) -> bool:
        """Finished in time, exit 0, and produced figures."""
        return not self.timed_out and self.rc == 0 and not self.error


# ---------------------------------------------------------------- measuring


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (every thread's), from /proc."""
    kids: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as fh:
                    kids += [int(x) for x in fh.read().split()]
            except OSError:
                pass
    except OSError:
        pass
    return kids


def tree_rss(pid: int) -> int:
    """Summed resident set size (bytes) of ``pid`` and all its descendants."""
    total, stack, seen = 0, [pid], set()
    while stack:
        p = stack.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/statm") as fh:
                total += int(fh.read().split()[1]) * PAGE
        except (OSError, IndexError, ValueError):
            continue
        stack += _children(p)
    return total


class TreeSampler(threading.Thread):
    """Samples `tree_rss` of a process every ``interval`` s until stopped; keeps the peak."""

    def __init__(self, pid: int, interval: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval, self.peak = pid, interval, 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, tree_rss(self.pid))
            self.done.wait(self.interval)

    def stop(self) -> int:
        """Stop sampling; the peak in bytes."""
        self.done.set()
        self.join()
        return self.peak


def _cap(mem_cap: int) -> Any:
    """preexec_fn: the address-space cap, inherited by the child's own children."""

    def apply() -> None:
        if mem_cap > 0:
            resource.setrlimit(resource.RLIMIT_AS, (mem_cap, mem_cap))

    return apply


def run_child(
    cmd: list[str], cwd: Path, env: dict[str, str], timeout_s: float, mem_cap: int, sample_s: float, log: Path
) -> tuple[float, int, int, float, int, bool]:
    """Run ``cmd`` to its end: (wall s, sampled peak tree RSS bytes, ru_maxrss bytes, CPU s, exit code, timed out)."""
    with open(log, "wb") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_cap(mem_cap),
        )  # fmt: skip
        sampler = TreeSampler(proc.pid, sample_s)
        sampler.start()
        timed_out = threading.Event()

        def kill() -> None:
            timed_out.set()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the child's own session: it and its workers only

        timer = threading.Timer(timeout_s, kill)
        timer.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        timer.cancel()
        peak = sampler.stop()
        proc.returncode = os.waitstatus_to_exitcode(status)
        with contextlib.suppress(ProcessLookupError, PermissionError):  # workers left behind by a killed child
            os.killpg(proc.pid, signal.SIGKILL)
    cpu = usage.ru_utime + usage.ru_stime
    return wall, peak, usage.ru_maxrss * 1024, cpu, proc.returncode, timed_out.is_set()


def _tail(log: Path, n: int = 1) -> str:
    """Last non-empty line(s) of a child's output."""
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    return " | ".join(lines[-n:])[:300]


def measure(tool: str, inp: Input, a: argparse.Namespace, hta_py: Path) -> Run:
    """One run of ``tool`` on ``inp``, in a fresh temp folder as cwd."""
    with tempfile.TemporaryDirectory(prefix=f"tvh_{tool}_") as tmp:
        out = Path(tmp) / "out.json"
        log = Path(tmp) / "log.txt"
        env = dict(os.environ)
        if tool == "hta":
            cmd = [str(hta_py), str(HTA_CHILD), "--trace-dir", str(inp.trace_dir), "--out", str(out)]
            env.pop("PYTHONPATH", None)
        else:
            cmd = [sys.executable, "-m", "stepscope", "trace", str(inp.trace_dir), "--json", str(out)]
            env["PYTHONPATH"] = str(REPO / "src")
            # Bytecode as an installed package has it (pip compiles HTA's at install): written by the untimed first
            # run into the work folder, read by the timed ones. Compiling the sources every run costs ~50 ms.
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = str(a.work / "pycache")
        load1 = os.getloadavg()[0]
        cap = int(a.mem_cap_gib * 2**30)
        wall, peak, maxrss, cpu, rc, timed_out = run_child(
            cmd, Path(tmp), env, a.timeout_s, cap, a.sample_ms / 1000, log
        )
        run = Run(tool, wall, max(peak, maxrss) / 1e6, peak / 1e6, maxrss / 1e6, cpu, rc, timed_out, load1=load1)
        if timed_out:
            run.error = f"did not finish within {a.timeout_s:.0f} s"
        elif not out.exists():
            run.error = f"exit {rc}: {_tail(log)}"
        elif tool == "hta":
            res = json.loads(out.read_text())
            run.figures = res.get("ranks", {})
            run.detail = {k: res.get(k) for k in ("import_s", "load_s", "analyses_s")}
            if res.get("errors"):
                run.error = "; ".join(f"{k}: {v}" for k, v in res["errors"].items())[:400]
        else:
            res = json.loads(out.read_text())
            run.figures = {str(r["rank"]): {k: r.get(k) for k in FIGURES} for r in res.get("ranks", [])}
            run.events = sum(f.get("events", 0) for f in res.get("files", []))
            run.detail = {"read_s": sum(f.get("read_s", 0.0) for f in res.get("files", []))}
            bad = [f"{f['path']}: {f['reason']}" for f in res.get("files", []) if not f.get("ok")]
            if bad or rc != 0:
                run.error = f"exit {rc}; " + "; ".join(bad)
        if not timed_out and ("MemoryError" in run.error or "Cannot allocate" in run.error or rc in (-9, 137)):
            run.error += f" (address-space cap {a.mem_cap_gib:g} GiB)"
    return run


# ---------------------------------------------------------------- inputs


def traces_root() -> Path:
    """HTA's test traces in the repository (tests/data/traces/hta)."""
    return REPO / "tests" / "data" / "traces" / "hta"  # HTA's test traces, kept in the repository


def uncompressed_bytes(path: Path) -> int:
    """Decompressed size of a (possibly gzip) file, streamed."""
    with open(path, "rb") as fh:
        if fh.read(2) != b"\x1f\x8b":
            return path.stat().st_size
        fh.seek(0)
        total, inflate = 0, zlib.decompressobj(wbits=31)
        while raw := fh.read(1 << 20):
            while raw:
                total += len(inflate.decompress(raw))
                raw = inflate.unused_data if inflate.eof else b""
                if inflate.eof:
                    inflate = zlib.decompressobj(wbits=31)
        return total


def _warm(files: list[Path]) -> None:
    """Read the files once so that both tools find them in the page cache."""
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(8 << 20):
                pass


def real_inputs(root: Path, work: Path) -> list[Input]:
    """The real traces: a single file is symlinked alone into a folder (HTA takes folders); folders as they are."""
    inputs = []
    for label, rel in REAL:
        src = root / rel
        if not src.exists():
            print(f"skipping {label}: {src} not found", file=sys.stderr)
            continue
        if src.is_dir():
            folder = src
            files = sorted(p for p in src.iterdir() if p.is_file() and p.name.endswith((".json", ".json.gz")))
        else:
            folder = work / "inputs" / label.replace("/", "__")
            folder.mkdir(parents=True, exist_ok=True)
            link = folder / src.name
            if not link.is_symlink():
                link.symlink_to(src)
            files = [src]
        comp = sum(f.stat().st_size for f in files) / 1e6
        unc = sum(uncompressed_bytes(f) for f in files) / 1e6
        inputs.append(Input(label, folder, files, comp, unc))
    return inputs


def synthetic_inputs(root: Path, work: Path, sizes_mb: list[float], only: str = "") -> list[Input]:
    """Replicas of SYNTH_SOURCE of about ``sizes_mb`` MB uncompressed (built once, reused from ``work``).

    Only those whose label contains ``only`` are built.
    """
    source_path = root / SYNTH_SOURCE
    src_mb = uncompressed_bytes(source_path) / 1e6
    src: replicate_trace.Source | None = None
    inputs = []
    for target in sizes_mb:
        n = max(2, round(target / src_mb))
        label = f"synthetic {n}x negative_queue"
        if only not in label:
            continue
        folder = work / "synthetic" / f"x{n}"
        path = folder / "rank0.json.gz"
        meta_path = folder.parent / f"{folder.name}.meta.json"  # not in the folder: both tools read every *.json
        key = {"source": str(source_path), "replicas": n, "generator": _file_hash(BENCH / "replicate_trace.py")}
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        if not path.exists() or {k: meta.get(k) for k in key} != key:
            src = src or replicate_trace.load_source(source_path)
            t0 = time.perf_counter()
            written = replicate_trace.write_replicated(src, path, n)
            meta = {**key, "uncompressed_bytes": written, "events": n * src.events_per_replica + len(src.once)}
            meta_path.write_text(json.dumps(meta))
            print(f"built {path}: {written / 1e6:.0f} MB in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        comp = path.stat().st_size / 1e6
        inputs.append(Input(label, folder, [path], comp, meta["uncompressed_bytes"] / 1e6, True, n))
    return inputs


def _file_hash(path: Path) -> str:
    """Short content hash of a file."""
    return hashlib.sha1(path.read_bytes()).hexdigest()[:12]


# ---------------------------------------------------------------- figures


def _median(values: list[float]) -> float | None:
    """Median, None for no values."""
    return statistics.median(values) if values else None


def summarize(inp: Input, runs: list[Run]) -> dict[str, Any]:
    """Medians per tool over the good runs, ratios, events, and disagreements between the tools' figures."""
    row: dict[str, Any] = {"input": asdict(inp) | {"trace_dir": str(inp.trace_dir), "files": list(map(str, inp.files))}}
    for tool in ("hta", "stepscope"):
        mine = [r for r in runs if r.tool == tool]
        good = [r for r in mine if r.ok]
        row[tool] = {
            "runs": len(mine),
            "good": len(good),
            "wall_s": _median([r.wall_s for r in good]),
            "cpu_s": _median([r.cpu_s for r in good]),
            "peak_rss_mb": _median([r.peak_rss_mb for r in good]),
            "maxrss_mb": _median([r.maxrss_mb for r in good]),
            "walls": [round(r.wall_s, 3) for r in mine],
            "peaks": [round(r.peak_rss_mb, 1) for r in mine],
            "failed_at": [round(mine[0].wall_s, 1), round(mine[0].peak_rss_mb)] if mine and not good else None,
            "error": next((r.error for r in mine if r.error), ""),
            "figures": next((r.figures for r in mine if r.figures), {}),
        }
    row["events"] = next((r.events for r in runs if r.tool == "stepscope" and r.events), None)
    h, s = row["hta"], row["stepscope"]
    row["speedup"] = h["wall_s"] / s["wall_s"] if h["wall_s"] and s["wall_s"] else None
    row["cpu_ratio"] = h["cpu_s"] / s["cpu_s"] if h["cpu_s"] and s["cpu_s"] else None
    row["rss_ratio"] = s["peak_rss_mb"] / h["peak_rss_mb"] if h["peak_rss_mb"] and s["peak_rss_mb"] else None
    row["disagreements"] = disagreements(h["figures"], s["figures"])
    return row


def disagreements(hta: dict[str, dict], ss: dict[str, dict]) -> list[str]:
    """Every figure that differs by more than TOLERANCE_PP, or is present in one tool only, per rank."""
    out = []
    if not hta or not ss:
        return out
    for rank in sorted(set(hta) | set(ss), key=lambda r: int(r)):
        if rank not in hta or rank not in ss:
            out.append(f"rank {rank}: only in {'HTA' if rank in hta else 'stepscope'}")
            continue
        for k in FIGURES:
            x, y = hta[rank].get(k), ss[rank].get(k)
            if x is None and y is None:
                continue
            if x is None or y is None:
                out.append(f"rank {rank} {k}: HTA {x}, stepscope {y}")
            elif abs(x - y) > TOLERANCE_PP:
                out.append(f"rank {rank} {k}: HTA {x:.2f}, stepscope {y:.2f} ({y - x:+.2f} pp)")
    return out


def memory_series(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Peak RSS against uncompressed size for the synthetic source and its replicas (smallest first)."""
    src_label = next(label for label, rel in REAL if rel == SYNTH_SOURCE)
    pts = [r for r in rows if r["input"]["label"] == src_label or r["input"]["synthetic"]]
    pts.sort(key=lambda r: r["input"]["uncompressed_mb"])
    series = []
    for r in pts:
        series.append({
            "label": r["input"]["label"], "mb": r["input"]["uncompressed_mb"], "events": r["events"],
            "stepscope_mb": r["stepscope"]["peak_rss_mb"], "hta_mb": r["hta"]["peak_rss_mb"],
            "hta_error": r["hta"]["error"],
        })  # fmt: skip
    return series


def growth(series: list[dict[str, Any]], tool: str) -> dict[str, float] | None:
    """Log-log slope of peak RSS against trace size (first to last point), and the RSS added per GB of trace."""
    pts = [(p["mb"], p[f"{tool}_mb"]) for p in series if p[f"{tool}_mb"]]
    if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
        return None
    (x0, y0), (x1, y1) = pts[0], pts[-1]
    return {
        "loglog_slope": math.log(y1 / y0) / math.log(x1 / x0),
        "mb_per_gb": (y1 - y0) / (x1 - x0) * 1000,
        "from_mb": x0,
        "to_mb": x1,
    }


# ---------------------------------------------------------------- output


def _f(x: float | None, fmt: str) -> str:
    """Format a number, '—' for None."""
    return "—" if x is None else format(x, fmt)


def _cell(tool: dict[str, Any], key: str, fmt: str) -> str:
    """A tool's median, or for a tool that never finished the error, and the time / memory when it stopped."""
    if tool["good"]:
        return _f(tool[key], fmt)
    if not tool.get("failed_at"):
        return "—"
    wall, rss = tool["failed_at"]
    return f"✗ {tool['error'][:70]}" if key == "wall_s" else f"({rss:,} MB after {wall:g} s)"


def results_table(rows: list[dict[str, Any]]) -> list[str]:
    """The per-input Markdown table."""
    out = [
        "| input | MB gz / MB json | events | HTA wall s | stepscope wall s | speed-up | CPU-time ratio "
        "| HTA peak RSS MB | stepscope peak RSS MB | RSS stepscope/HTA |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        i, h, s = r["input"], r["hta"], r["stepscope"]
        hta_wall, ss_wall = (_cell(t, "wall_s", ".2f") for t in (h, s))
        hta_rss, ss_rss = (_cell(t, "peak_rss_mb", ",.0f") for t in (h, s))
        out.append(
            f"| {i['label']} | {i['compressed_mb']:.1f} / {i['uncompressed_mb']:.1f} | "
            f"{_f(r['events'], ',')} | {hta_wall} | {ss_wall} | "
            f"{_f(r['speedup'], '.1f')}{'×' if r['speedup'] else ''} | "
            f"{_f(r.get('cpu_ratio'), '.1f')}{'×' if r.get('cpu_ratio') else ''} | {hta_rss} | {ss_rss} | "
            f"{_f(r['rss_ratio'], '.2f')} |"
        )
    return out


def series_table(series: list[dict[str, Any]]) -> list[str]:
    """The memory-vs-size Markdown table."""
    out = [
        "| trace | MB json | events | stepscope peak RSS MB | RSS / trace size | HTA peak RSS MB | RSS / trace size |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in series:
        s, h = p["stepscope_mb"], p["hta_mb"]
        hta = f"{h:,.0f} | {h / p['mb']:.2f}" if h else f"✗ {p['hta_error'][:60]} | —"
        out.append(
            f"| {p['label']} | {p['mb']:,.0f} | {_f(p['events'], ',')} | {_f(s, ',.0f')} | "
            f"{_f(s / p['mb'] if s else None, '.2f')} | {hta} |"
        )
    return out


def targets(rows: list[dict[str, Any]], series: list[dict[str, Any]]) -> list[str]:
    """One line per target of the issue, with what this run measured."""
    both = [r for r in rows if r["speedup"] is not None]
    speed_ok = [r for r in both if r["speedup"] >= 5]
    rss_ok = [r for r in rows if r["rss_ratio"] is not None and r["rss_ratio"] <= 1]
    hta_failed = [r["input"]["label"] for r in rows if r["hta"]["runs"] and not r["hta"]["good"]]
    lines = []
    if both:
        lo = min(both, key=lambda r: r["speedup"])
        lines.append(
            f"- wall time ≥ 5× faster than HTA: {len(speed_ok)} of {len(both)} inputs where both finished "
            f"(lowest {lo['speedup']:.1f}× on {lo['input']['label']}, median "
            f"{statistics.median(r['speedup'] for r in both):.1f}×)"
        )
        lines.append(f"- peak RSS ≤ HTA's: {len(rss_ok)} of {len(both)} inputs where both finished")
    if hta_failed:
        lines.append(f"- HTA did not finish on: {', '.join(hta_failed)} (stepscope results still shown)")
    for tool, name in (("stepscope", "stepscope"), ("hta", "HTA")):
        g = growth(series, tool)
        if g:
            lines.append(
                f"- {name} memory vs trace size, {g['from_mb']:.0f} → {g['to_mb']:.0f} MB: log-log slope "
                f"{g['loglog_slope']:.2f} (1 = linear), {g['mb_per_gb']:.0f} MB of RSS added per GB of trace"
            )
    return lines


def report(rows: list[dict[str, Any]], ctx: dict[str, Any]) -> str:
    """The whole Markdown section."""
    series = memory_series(rows)
    m = ctx["machine"]
    lines = [
        f"## Trace analysis vs HTA 0.5 ({ctx['date']}, {m['cpu_count']}-core {m['processor']}, "
        f"{ctx['mem_gib']:.0f} GiB, Python {m['python']})",
        "",
        f"`{ctx['command']}` ({ctx['started']}–{ctx['finished']} UTC; load average at the start "
        f"{ctx['load_start']}, at the end {ctx['load_end']}; 1-minute load when each run started: "
        f"{ctx['load_min']:.2f}–{ctx['load_max']:.2f}). HTA {ctx['hta_version']} with pandas "
        f"{ctx['pandas_version']} in its own venv; stepscope from this working tree (trace analyser files "
        f"{ctx['src_hash']}, commit {ctx['commit']}).",
        "",
        "Method: each tool runs as a fresh child process per measurement, so interpreter start and imports are "
        f"included, {ctx['reps']} times per real trace and {ctx['reps_synthetic']} per synthetic one, alternating "
        "HTA / stepscope; medians. HTA: `TraceAnalysis(trace_dir)` + `get_temporal_breakdown` + "
        "`get_idle_time_breakdown` (each rank) + `get_comm_comp_overlap` + `get_gpu_kernel_breakdown`, "
        "`visualize=False` (bench/trace_vs_hta_child.py). stepscope: the whole CLI, `python -m stepscope trace DIR "
        "--json OUT`. Wall: `perf_counter` around spawning and reaping the child. Peak RSS, the same method for "
        "both: the larger of the peak sum of RSS over the child's process tree (child and all descendants, so "
        f"either tool's per-rank parser processes count), sampled every {ctx['sample_ms']:g} ms from /proc, and "
        "the kernel's exact peak of the largest single process (`ru_maxrss` from `os.wait4`), which a sample can "
        "miss. Both tools run under an "
        f"address-space cap of {ctx['mem_cap_gib']:g} GiB (RLIMIT_AS) and a {ctx['timeout_s']:.0f} s limit. Files "
        "are read once beforehand so that both find them in the page cache. A single-file trace is given to both "
        "tools as a folder holding only a symlink to it.",
        "",
        *results_table(rows),
        "",
    ]
    if series:
        lines += [
            f"Memory against trace size: `{SYNTH_SOURCE}` ({series[0]['mb']:.0f} MB) and copies of it made by "
            "`bench/replicate_trace.py` (its events repeated back to back, timestamps shifted by the period, "
            "correlation / External id / flow ids offset, ProfilerStep#N renumbered, Kineto's layout kept; gzip).",
            "",
            *series_table(series),
            "",
        ]
    lines += ["Targets:", "", *targets(rows, series), ""]
    dis = [(r["input"]["label"], d) for r in rows for d in r["disagreements"]]
    checked = sum(1 for r in rows if r["hta"]["figures"] and r["stepscope"]["figures"])
    if dis:
        lines += [f"Figures differing by more than {TOLERANCE_PP} pp (idle, compute, non-compute, overlap):", ""]
        lines += [f"- {label}: {d}" for label, d in dis]
    else:
        lines.append(
            f"Idle, compute, non-compute and overlap % agree within {TOLERANCE_PP} pp on every rank of the "
            f"{checked} inputs where both tools finished."
        )
    lines.append("")
    return "\n".join(_wrap(line) for line in lines)


def _wrap(line: str, width: int = 116) -> str:
    """Paragraphs and bullets wrapped like the rest of docs/benchmarks.md; headings and table rows as they are."""
    if line.startswith(("|", "#")) or len(line) <= width:
        return line
    indent = "  " if line.startswith("- ") else ""
    return textwrap.fill(line, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def print_row(r: dict[str, Any]) -> None:
    """One progress line per input (stderr)."""
    h, s = r["hta"], r["stepscope"]
    print(
        f"  HTA walls {h['walls']} peaks {h['peaks']} {h['error'][:100]}\n"
        f"  stepscope walls {s['walls']} peaks {s['peaks']} {s['error'][:100]}\n"
        f"  speed-up {_f(r['speedup'], '.1f')} (CPU time {_f(r['cpu_ratio'], '.1f')})  "
        f"RSS ratio {_f(r['rss_ratio'], '.2f')}  "
        f"disagreements {r['disagreements'] or 'none'}",
        file=sys.stderr,
        flush=True,
    )


def _git(*args: str) -> str:
    """Output of a git command in the repo ('' on failure)."""
    p = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    return p.stdout.strip() if p.returncode == 0 else ""


def src_hash() -> str:
    """Short hash of the trace analyser's source files, as measured (the working tree may be ahead of HEAD)."""
    h = hashlib.sha1()
    for p in sorted((REPO / "src" / "stepscope" / "analyses" / "trace").glob("*.py")):
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def measure_all(a: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Build the inputs, run both tools on each; the per-input rows and the run's context."""
    started = datetime.datetime.now(datetime.timezone.utc)
    hash_start = src_hash()
    load_start = "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    print(f"load average at start: {load_start} ({os.cpu_count()} cores)", file=sys.stderr)
    hta_py = ensure_venv(a.venv.absolute())
    hta_version, pandas_version = venv_versions(hta_py)
    root = a.traces.resolve()
    a.work.mkdir(parents=True, exist_ok=True)
    inputs = real_inputs(root, a.work)
    if a.reps_synthetic > 0:
        sizes = [float(x) for x in a.synthetic_mb.split(",") if x.strip()]
        inputs += synthetic_inputs(root, a.work, sizes, a.only)
    inputs = [i for i in inputs if a.only in i.label]

    # one untimed run of each tool on the smallest input: the first start of an interpreter reads its files cold
    smallest = min(inputs, key=lambda i: i.uncompressed_mb)
    for tool in ("hta", "stepscope"):
        measure(tool, smallest, a, hta_py)

    rows: list[dict[str, Any]] = []
    loads: list[float] = []
    for n, inp in enumerate(inputs, 1):
        reps = a.reps_synthetic if inp.synthetic else a.reps
        print(f"[{n}/{len(inputs)}] {inp.label}: {inp.uncompressed_mb:.1f} MB, {reps} reps", file=sys.stderr)
        _warm(inp.files)
        runs: list[Run] = []
        failed: set[str] = set()
        for _ in range(reps):
            for tool in ("hta", "stepscope"):
                if tool in failed:
                    continue
                run = measure(tool, inp, a, hta_py)
                runs.append(run)
                loads.append(run.load1)
                print(
                    f"  {tool:9s} {run.wall_s:8.2f} s (cpu {run.cpu_s:.2f}) {run.peak_rss_mb:8.0f} MB "
                    f"(sampled {run.sampled_mb:.0f}, maxrss {run.maxrss_mb:.0f}) load {run.load1:.2f} "
                    f"{run.error[:100]}",
                    file=sys.stderr,
                    flush=True,
                )
                if not run.ok and (run.timed_out or not run.figures):
                    failed.add(tool)  # did not finish: no point in repeating it
        row = summarize(inp, runs)
        row["runs"] = [asdict(r) for r in runs]
        rows.append(row)
        print_row(row)

    finished = datetime.datetime.now(datetime.timezone.utc)
    ctx = {
        "date": started.date().isoformat(),
        "started": started.strftime("%H:%M"),
        "finished": finished.strftime("%H:%M"),
        "machine": machine(),
        "mem_gib": os.sysconf("SC_PHYS_PAGES") * PAGE / 2**30,
        "command": "python bench/trace_vs_hta.py " + shlex.join(sys.argv[1:]),
        "load_start": load_start,
        "load_end": "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg()),
        "load_min": min(loads, default=0.0),
        "load_max": max(loads, default=0.0),
        "hta_version": hta_version,
        "pandas_version": pandas_version,
        "src_hash": hash_start if src_hash() == hash_start else f"{hash_start}, changed to {src_hash()} during the run",
        "commit": _git("rev-parse", "--short", "HEAD") + (" + changes" if _git("status", "-s", "src") else ""),
        "reps": a.reps,
        "reps_synthetic": a.reps_synthetic,
        "sample_ms": a.sample_ms,
        "mem_cap_gib": a.mem_cap_gib,
        "timeout_s": a.timeout_s,
    }
    return rows, ctx


def main() -> int:
    """Measure (or load a saved run with --from-json), print, write the raw JSON and the doc section."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="real traces only, one repetition, no doc")
    ap.add_argument("--reps", type=int, default=5, help="repetitions per real trace (default 5)")
    ap.add_argument("--reps-synthetic", type=int, default=3, help="repetitions per synthetic trace (default 3)")
    ap.add_argument("--synthetic-mb", default="50,200,1000", help="approximate uncompressed sizes, MB")
    ap.add_argument("--only", default="", help="only inputs whose label contains this")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per run, either tool (default 900)")
    ap.add_argument("--mem-cap-gib", type=float, default=16.0, help="RLIMIT_AS of either tool's child (default 16)")
    ap.add_argument("--sample-ms", type=float, default=20.0, help="RSS sampling interval (default 20)")
    ap.add_argument("--venv", type=Path, default=REPO / ".venv-hta")
    ap.add_argument("--traces", type=Path, default=traces_root())
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "stepscope_trace_vs_hta")
    ap.add_argument("--json", type=Path, help="raw results (default WORK/results.json)")
    ap.add_argument("--from-json", type=Path, help="measure nothing: report the run saved in this raw-results file")
    ap.add_argument("--doc", type=Path, help="append the section here (default docs/benchmarks.md, not in --quick)")
    ap.add_argument("--no-doc", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.reps, a.reps_synthetic = 1, 0
    doc = None if a.no_doc else (a.doc or (None if a.quick else REPO / "docs" / "benchmarks.md"))

    if a.from_json:
        saved = json.loads(a.from_json.read_text())
        rows, ctx = saved["rows"], saved["context"]
    else:
        rows, ctx = measure_all(a)
        out_json = a.json or a.work / "results.json"
        out_json.write_text(json.dumps({"context": ctx, "rows": rows}, indent=1, default=str) + "\n")
        print(f"raw results: {out_json}", file=sys.stderr)
    section = report(rows, ctx)
    print("\n" + section)
    if doc is not None:
        text = doc.read_text() if doc.exists() else "# Benchmarks\n"
        doc.write_text(text.rstrip("\n") + "\n\n" + section)
        print(f"appended to {doc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
