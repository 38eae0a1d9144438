"""Terminal report of `stepscope trace`: per-rank breakdown, top kernels, stragglers, verdict, unreadable files."""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Iterator
from typing import IO

from stepscope.analyses.trace.analyze import RankTrace, TraceAnalysis, job_verdict
from stepscope.report.text import RANK_ROWS, Column, Grid, outliers, plain_output, plain_table, terminal_safe


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"


def outlying_ranks(ranks: list[RankTrace], named: set[int]) -> list[RankTrace]:
    """All ranks up to ``RANK_ROWS``; beyond, the ``named`` ones (stragglers, late ranks) and those farthest from
    the job's median step time (in % of it) or idle share (in points), in rank order."""
    if len(ranks) <= RANK_ROWS:
        return ranks

    def median(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None

    step, idle = median([r.step_ms for r in ranks]), median([r.idle_pct for r in ranks])

    def distance(r: RankTrace) -> float:
        if r.rank in named:
            return math.inf
        off = [abs(r.idle_pct - idle) if r.idle_pct is not None and idle is not None else 0.0]
        if r.step_ms is not None and step:
            off.append(100 * abs(r.step_ms - step) / step)
        return max(off)

    return outliers(ranks, distance, lambda r: r.rank)


RANK_COLUMNS = [
    Column(name, right=name not in ("rank", "bound"))
    for name in ("rank", "steps", "step ms", "span ms", "idle%", "comp%", "noncomp%", "hostwait%", "kernwait%",
                 "overlap%", "data ms", "bound")
]  # fmt: skip
KERNEL_COLUMNS = [Column("kernel", right=False, max_width=50), Column("type", right=False)] + [
    Column(name) for name in ("calls", "total ms", "mean µs", "% kernel time")
]
OPS_COLUMNS = [Column("operator", right=False, max_width=50)] + [
    Column(name) for name in ("calls", "self ms", "self %", "total ms")
]


def rank_breakdown(ranks: list[RankTrace]) -> Grid:
    """One row per rank: step, kernel span, idle/compute/non-compute, idle causes, overlap, data loading, verdict."""
    rows = []
    for r in ranks:
        idle = r.idle_breakdown or {}
        rows.append([
            str(r.rank), str(r.steps), _ms(r.step_ms), _ms(r.kernel_span_ms), _pct(r.idle_pct), _pct(r.compute_pct),
            _pct(r.non_compute_pct), _pct(idle.get("host_wait_pct")), _pct(idle.get("kernel_wait_pct")),
            _pct(r.overlap_pct), _ms(r.data_loading.per_step_ms if r.data_loading else None), r.verdict.bound,
        ])  # fmt: skip
    return Grid(RANK_COLUMNS, rows)


def kernel_table(rank: RankTrace) -> Grid:
    """The rank's top kernels by total device time."""
    rows = [
        [k.name, k.type, f"{k.count:,}", f"{k.total_us / 1000:,.2f}", f"{k.mean_us:,.1f}", f"{k.pct:.1f}"]
        for k in rank.top_kernels
    ]
    return Grid(KERNEL_COLUMNS, rows)


def ops_table(rank: RankTrace) -> Grid:
    """The rank's top host operators by self CPU time, as ``key_averages()`` tables them."""
    rows = [
        [op.name, f"{op.count:,}", f"{op.self_ms:,.2f}", f"{op.self_pct:.1f}", f"{op.total_ms:,.2f}"]
        for op in rank.top_ops
    ]
    return Grid(OPS_COLUMNS, rows)


def print_trace(analysis: TraceAnalysis, top_ranks: int = 1, file: IO[str] | None = None) -> None:
    """Print the analysis: what was read and how fast, rank table, the first ranks' top kernels, CPU-only shares,
    stragglers, verdict, errors.

    To a log or a file (and under ``CI``) the report is plain text that rich would print the same, written here
    without importing rich (~30 ms of a small trace's ~0.2 s), unless a table is one rich lays out otherwise."""
    out = file or sys.stdout
    items = list(report_items(analysis, top_ranks))
    if plain_output(out) and (text := _plain_text(items)) is not None:
        out.write(text)
        return
    from rich.markup import escape

    from stepscope.report.console import _console, _plain, grid_table

    console = _console(out)
    for item in items:
        console.print(grid_table(item, _plain(console)) if isinstance(item, Grid) else escape(terminal_safe(item)))


def _plain_text(items: list[str | Grid]) -> str | None:
    """The report as plain text, or None when a table is not one `plain_table` writes as rich would."""
    parts = []
    for item in items:
        text = plain_table(item) if isinstance(item, Grid) else terminal_safe(item) + "\n"
        if text is None:
            return None
        parts.append(text)
    return "".join(parts)


def report_items(analysis: TraceAnalysis, top_ranks: int) -> Iterator[str | Grid]:
    """The report in order: lines of text (as written, one each) and tables."""
    for status in analysis.files:
        if not status.ok:
            yield f"skipped {status.path}: {status.reason}"
    for warning in analysis.warnings:
        yield f"warning: {warning}"
    if read := analysis.read:
        yield (
            f"read {read['files']:,} file(s), {read['ranks']:,} rank(s) analysed: {read['events']:,} events, "
            f"{read['mb']:,.1f} MB of JSON in {read['seconds']:.2f} s ({read['mb_per_s']:,.0f} MB/s, "
            f"{read['processes']} process(es))"
        )
    if not analysis.ranks:
        yield "nothing could be analysed"
        return
    jobs = sorted({r.job for r in analysis.ranks})
    for job in jobs:
        ranks = [r for r in analysis.ranks if r.job == job]
        files = ", ".join(sorted({r.file.rsplit("/", 1)[-1] for r in ranks}))
        yield ""
        yield f"stepscope trace · {job} · {len(ranks)} rank(s) · {files[:200]}"
        named = {s["rank"] for s in (*analysis.stragglers, *analysis.late_ranks) if s["job"] == job}
        shown = outlying_ranks(ranks, named)
        if len(shown) < len(ranks):
            yield f"the {len(shown)} of {len(ranks)} ranks that stand out (late, straggling, farthest from the median):"
        yield rank_breakdown(shown)
        for r in ranks[:top_ranks]:
            if r.top_kernels:
                yield f"top kernels, rank {r.rank}:"
                yield kernel_table(r)
            if r.cpu is not None:
                yield (
                    f"rank {r.rank} (CPU only): ATen ops {r.cpu.computation_pct:.1f}%, other {r.cpu.other_pct:.1f}% "
                    f"of {r.cpu.basis_ms:,.1f} ms on thread {r.cpu.thread}"
                )
            if r.top_ops:
                yield f"top operators, rank {r.rank} (self CPU time, whole trace):"
                yield ops_table(r)
            if r.phases_ms:
                phases = ", ".join(f"{name} {ms:.2f}" for name, ms in r.phases_ms.items())
                yield f"rank {r.rank} stepscope phases, ms per step: {phases}"
            for note in r.notes:
                yield f"rank {r.rank}: {note}"
        for s in (s for s in analysis.stragglers if s["job"] == job):
            yield (
                f"straggler: rank {s['rank']}, {s['step_ms']:.2f} ms per step, {s['slower_pct']:.0f}% over the other "
                f"ranks' median ({s['median_step_ms']:.2f} ms); {s['why']}"
            )
        late = [s for s in analysis.late_ranks if s["job"] == job]
        for s in late:
            yield (
                f"late rank: {s['rank']}, the others wait {s['waited_ms']:.2f} ms {s['unit']} for it in collectives "
                f"({s['wait_share_pct']:.0f}% of their communication); cause: {s['cause']}"
            )
        verdict = ranks[0].verdict if len(ranks) == 1 else job_verdict(ranks, late)
        yield f"bound: {verdict.bound} [confidence {verdict.confidence}]"
        for line in verdict.evidence:
            yield f"  {line}"
