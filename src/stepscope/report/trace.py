"""Terminal report of `stepscope trace`: per-rank breakdown, top kernels, stragglers, verdict, unreadable files."""

from __future__ import annotations

import math
import statistics
from typing import IO

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from stepscope.analyses.trace.analyze import RankTrace, TraceAnalysis, job_verdict
from stepscope.report.console import _ASCII_HEAD, RANK_ROWS, _console, _plain, outliers, terminal_safe


def _text(value: object) -> str:
    """A string from the trace (a file name, a kernel, a reason) for one console line: no control characters, no
    rich markup."""
    return escape(terminal_safe(value))


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


def rank_breakdown(ranks: list[RankTrace], ascii_only: bool = False) -> Table:
    """One row per rank: step, kernel span, idle/compute/non-compute, idle causes, overlap, data loading, verdict."""
    table = Table(
        box=_ASCII_HEAD if ascii_only else box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0, 0, 1)
    )
    columns = ("rank", "steps", "step ms", "span ms", "idle%", "comp%", "noncomp%", "hostwait%", "kernwait%",
               "overlap%", "data ms", "bound")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column in ("rank", "bound") else "right", no_wrap=True)
    for r in ranks:
        idle = r.idle_breakdown or {}
        table.add_row(
            str(r.rank), str(r.steps), _ms(r.step_ms), _ms(r.kernel_span_ms), _pct(r.idle_pct), _pct(r.compute_pct),
            _pct(r.non_compute_pct), _pct(idle.get("host_wait_pct")), _pct(idle.get("kernel_wait_pct")),
            _pct(r.overlap_pct), _ms(r.data_loading.per_step_ms if r.data_loading else None), r.verdict.bound,
        )  # fmt: skip
    return table


def kernel_table(rank: RankTrace, ascii_only: bool = False) -> Table:
    """The rank's top kernels by total device time."""
    table = Table(
        box=_ASCII_HEAD if ascii_only else box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0, 0, 1)
    )
    table.add_column("kernel", no_wrap=True, max_width=50, overflow="ellipsis")
    for column in ("type", "calls", "total ms", "mean µs", "% kernel time"):
        table.add_column(column, justify="left" if column == "type" else "right", no_wrap=True)
    for k in rank.top_kernels:
        table.add_row(_text(k.name), k.type, f"{k.count:,}", f"{k.total_us / 1000:,.2f}", f"{k.mean_us:,.1f}",
                      f"{k.pct:.1f}")  # fmt: skip
    return table


def ops_table(rank: RankTrace, ascii_only: bool = False) -> Table:
    """The rank's top host operators by self CPU time, as ``key_averages()`` tables them."""
    table = Table(
        box=_ASCII_HEAD if ascii_only else box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0, 0, 1)
    )
    table.add_column("operator", no_wrap=True, max_width=50, overflow="ellipsis")
    for column in ("calls", "self ms", "self %", "total ms"):
        table.add_column(column, justify="right", no_wrap=True)
    for op in rank.top_ops:
        table.add_row(_text(op.name), f"{op.count:,}", f"{op.self_ms:,.2f}", f"{op.self_pct:.1f}",
                      f"{op.total_ms:,.2f}")  # fmt: skip
    return table


def print_trace(analysis: TraceAnalysis, top_ranks: int = 1, file: IO[str] | None = None) -> None:
    """Print the analysis: what was read and how fast, rank table, the first ranks' top kernels, CPU-only shares,
    stragglers, verdict, errors."""
    console: Console = _console(file)
    plain = _plain(console)
    for status in analysis.files:
        if not status.ok:
            console.print(f"skipped {_text(status.path)}: {_text(status.reason)}")
    for warning in analysis.warnings:
        console.print(f"warning: {_text(warning)}")
    if read := analysis.read:
        console.print(
            f"read {read['files']:,} file(s), {read['ranks']:,} rank(s) analysed: {read['events']:,} events, "
            f"{read['mb']:,.1f} MB of JSON in {read['seconds']:.2f} s ({read['mb_per_s']:,.0f} MB/s, "
            f"{read['processes']} process(es))"
        )
    if not analysis.ranks:
        console.print("nothing could be analysed")
        return
    jobs = sorted({r.job for r in analysis.ranks})
    for job in jobs:
        ranks = [r for r in analysis.ranks if r.job == job]
        files = ", ".join(sorted({r.file.rsplit("/", 1)[-1] for r in ranks}))
        console.print(f"\nstepscope trace · {_text(job)} · {len(ranks)} rank(s) · {_text(files[:200])}")
        named = {s["rank"] for s in (*analysis.stragglers, *analysis.late_ranks) if s["job"] == job}
        shown = outlying_ranks(ranks, named)
        if len(shown) < len(ranks):
            console.print(
                f"the {len(shown)} of {len(ranks)} ranks that stand out (late, straggling, farthest from the median):"
            )
        console.print(rank_breakdown(shown, plain))
        for r in ranks[:top_ranks]:
            if r.top_kernels:
                console.print(f"top kernels, rank {r.rank}:")
                console.print(kernel_table(r, plain))
            if r.cpu is not None:
                console.print(
                    f"rank {r.rank} (CPU only): ATen ops {r.cpu.computation_pct:.1f}%, other {r.cpu.other_pct:.1f}% "
                    f"of {r.cpu.basis_ms:,.1f} ms on thread {r.cpu.thread}"
                )
            if r.top_ops:
                console.print(f"top operators, rank {r.rank} (self CPU time, whole trace):")
                console.print(ops_table(r, plain))
            if r.phases_ms:
                phases = ", ".join(f"{name} {ms:.2f}" for name, ms in r.phases_ms.items())
                console.print(f"rank {r.rank} stepscope phases, ms per step: {_text(phases)}")
            for note in r.notes:
                console.print(f"rank {r.rank}: {_text(note)}")
        for s in (s for s in analysis.stragglers if s["job"] == job):
            console.print(
                f"straggler: rank {s['rank']}, {s['step_ms']:.2f} ms per step, {s['slower_pct']:.0f}% over the other "
                f"ranks' median ({s['median_step_ms']:.2f} ms); {_text(s['why'])}"
            )
        late = [s for s in analysis.late_ranks if s["job"] == job]
        for s in late:
            console.print(
                f"late rank: {s['rank']}, the others wait {s['waited_ms']:.2f} ms {s['unit']} for it in collectives "
                f"({s['wait_share_pct']:.0f}% of their communication); cause: {_text(s['cause'])}"
            )
        verdict = ranks[0].verdict if len(ranks) == 1 else job_verdict(ranks, late)
        console.print(_text(f"bound: {verdict.bound} [confidence {verdict.confidence}]"))
        for line in verdict.evidence:
            console.print(f"  {_text(line)}")
