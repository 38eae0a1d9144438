"""Trace highlights: the compact, JSON-ready digest of a `TraceAnalysis` that a RunSummary carries (``trace``).

Per rank the headline figures (steps, step time, kernel span, idle/compute/non-compute, the idle breakdown, overlap,
exposed communication, data loading, the CPU-only share, stepscope's phases, the top kernels, notes, the verdict),
then the stragglers, the job's verdict, the warnings and the files that could not be read, with their reasons.
The full analysis stays ``stepscope trace DIR --json``'s.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from stepscope.analyses.trace.analyze import RankTrace, TraceAnalysis, analyze_trace
from stepscope.analyses.trace.events import trace_files

TOP_KERNELS = 5
NAME_MAX = 200  # kernel names longer than this (C++ templates) are cut, as HTA's own tables cut them
DIGITS = 3  # figures are rounded to 1 µs / 0.001 percentage points
MTIME_SLACK_S = 1.0  # file times lag the clock by a tick: a file this much older than the run still counts as its own
FIGURES = ("step_ms", "kernel_span_ms", "idle_pct", "compute_pct", "non_compute_pct", "overlap_pct",
           "exposed_comm_pct")  # fmt: skip


def highlights(analysis: TraceAnalysis, folder: str | Path, top: int = TOP_KERNELS) -> dict[str, Any]:
    """The summary's ``trace``: ``analysis`` of the traces in ``folder``, reduced to its headline figures (paths
    relative to ``folder``, ``top`` kernels per rank, figures rounded)."""
    root = Path(folder).resolve()
    return {
        "folder": str(root),
        "files": sum(1 for f in analysis.files if f.ok),
        "verdict": dataclasses.asdict(analysis.verdict),
        "ranks": [_rank(r, root, top) for r in analysis.ranks],
        "stragglers": [{**_rounded(s), "job": _relative(s["job"], root)} for s in analysis.stragglers],
        "late_ranks": [{**_rounded(s), "job": _relative(s["job"], root)} for s in analysis.late_ranks],
        "warnings": list(analysis.warnings),
        "skipped": [{"file": _relative(f.path, root), "reason": f.reason} for f in analysis.files if not f.ok],
    }


def _rank(r: RankTrace, root: Path, top: int) -> dict[str, Any]:
    return {
        "rank": r.rank,
        "job": _relative(r.job, root),
        "file": Path(r.file).name,
        "device_type": r.device_type,
        "steps": r.steps,
        "step_source": r.step_source,
        "trace_ms": _round(r.trace_ms),
        **{name: _round(getattr(r, name)) for name in FIGURES},
        "idle_breakdown": _rounded(r.idle_breakdown),
        "data_loading": _rounded(dataclasses.asdict(r.data_loading)) if r.data_loading else None,
        "cpu": _rounded({k: v for k, v in dataclasses.asdict(r.cpu).items() if k != "thread"}) if r.cpu else None,
        "phases_ms": _rounded(r.phases_ms),
        "top_ops": [_rounded(dataclasses.asdict(op)) | {"name": _cut(op.name)} for op in r.top_ops[:top]],
        "top_kernels": [
            {
                "name": _cut(k.name),
                "type": k.type,
                "count": k.count,
                "total_ms": _round(k.total_us / 1000),
                "pct": _round(k.pct),
            }
            for k in r.top_kernels[:top]
        ],
        "notes": list(r.notes),
        "verdict": dataclasses.asdict(r.verdict),
    }


def trace_highlights(folder: str | Path, since: float | None = None) -> tuple[dict[str, Any], str | None]:
    """Analyse the traces in ``folder`` for a summary: ``(highlights, None)``, or ``({}, note)`` with one sentence
    saying why there is nothing to show (no trace written, nothing readable, an error). Never raises.

    ``since`` (a ``time.time()``) marks a run's own capture: only files written from then on count, so that traces
    an earlier run left in the folder are not mixed in (those left out are named in a warning).
    """
    folder = Path(folder)
    try:
        files = trace_files([folder]) if folder.exists() else []
        older = [f for f in files if since is not None and _mtime(f) < since - MTIME_SLACK_S]
        files = [f for f in files if f not in older]
        if not files:
            if since is None:
                return {}, f"No trace file (.json, .json.gz) in {folder}, so the summary has no trace highlights."
            earlier = f"; {len(older)} older file(s) there were left out" if older else ""
            return {}, (
                f"The run wrote no trace to {folder} (it ended before the profiler's window, --trace-window, recorded "
                f"a step{earlier}), so the summary has no trace highlights."
            )
        analysis = analyze_trace(files, top=TOP_KERNELS)
        if older:
            names = ", ".join(_relative(str(f), folder.resolve()) for f in older[:3]) + (
                ", ..." if len(older) > 3 else ""
            )
            analysis.warnings.append(f"{len(older)} trace file(s) older than this run were left out: {names}")
        if not analysis.ranks:
            reasons = "; ".join(f"{Path(f.path).name}: {f.reason}" for f in analysis.files if not f.ok)
            return {}, f"The traces in {folder} could not be analysed ({reasons or 'no rank found'})."
        return highlights(analysis, folder), None
    except Exception as error:  # a summary without highlights, never a lost run
        return {}, f"The traces in {folder} could not be analysed ({type(error).__name__}: {error})."


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _relative(path: str, root: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(root))
    except (ValueError, OSError):
        return str(path)


def _cut(name: str) -> str:
    return name if len(name) <= NAME_MAX else name[: NAME_MAX - 1] + "…"


def _round(value: Any) -> Any:
    return round(value, DIGITS) if isinstance(value, float) else value


def _rounded(data: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if data is None else {key: _round(value) for key, value in data.items()}
