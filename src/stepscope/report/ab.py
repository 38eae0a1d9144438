"""Terminal report of `stepscope ab`: one row per variant (backend, per-rank and global batch, sec/step with its
spread over runs, samples/s, peak memory), then each comparison with its interval and verdict in words, the
warnings, and the runs left out. Plain ASCII when the output is not a terminal (see terminal.py)."""

from __future__ import annotations

from typing import IO

from rich import box
from rich.markup import escape
from rich.table import Table

from stepscope.analyses.ab import FASTER, NO_DIFFERENCE, SLOWER, ABResult, Comparison, VariantResult
from stepscope.report.console import _ASCII_HEAD, _console, _plain
from stepscope.report.text import terminal_safe

_MEMORY_SOURCE = {"torch reserved": "gpu", "gpu (nvml)": "gpu", "host rss": "rss"}


def _step_time(variant: VariantResult) -> str:
    """Median sec/step, in ms below one second."""
    value = variant.sec_per_step
    if value is None:
        return "-"
    return f"{value * 1e3:.2f} ms" if value < 1 else f"{value:.3f} s"


def _spread(variant: VariantResult) -> str:
    """Slowest minus fastest run over the median, %."""
    if variant.sec_per_step is None or variant.sec_per_step_range is None:
        return "-"
    low, high = variant.sec_per_step_range
    return f"{100 * (high - low) / variant.sec_per_step:.1f}%"


def _batch(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value - round(value)) < 0.05 else f"{value:.1f}"


def _memory(variant: VariantResult) -> str:
    if variant.peak_mem_mb is None:
        return "-"
    return f"{variant.peak_mem_mb:,.0f} MiB {_MEMORY_SOURCE.get(variant.peak_mem_source or '', '')}".rstrip()


def variant_table(result: ABResult, ascii_only: bool = False) -> Table:
    """One row per variant: backend, ranks, batch per rank and global, median sec/step and its spread over runs,
    samples/s, peak memory, usable runs."""
    table = Table(
        box=_ASCII_HEAD if ascii_only else box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0, 0, 1)
    )
    table.add_column("variant", no_wrap=True)
    table.add_column("backend")
    headers = ("ranks", "batch/rank", "global batch", "sec/step", "spread", "samples/s", "peak mem", "runs")
    for header in headers:
        table.add_column(header, justify="right", no_wrap=True)
    for v in result.variants:
        rate = "-" if v.samples_per_s is None else f"{v.samples_per_s:,.1f}"
        table.add_row(
            escape(terminal_safe(v.name)), escape(terminal_safe(v.backend or "-")), str(v.world_size or "-"),
            _batch(v.per_rank_batch), _batch(v.global_batch), _step_time(v), _spread(v), rate, _memory(v),
            f"{v.usable_runs}/{len(v.runs)}",
        )  # fmt: skip
    return table


def comparison_line(comparison: Comparison) -> str:
    """``new vs base: 1.120x (95% CI 1.080–1.160, width from between runs): new is faster · samples/s ×1.12 ·
    peak mem ×0.98``."""
    c = comparison
    head = f"{c.candidate} vs {c.baseline}:"
    if c.speedup is None:
        return f"{head} no comparison ({c.reason})"
    if c.speedup_ci is None:
        return f"{head} {c.speedup:.3f}x, no interval: {c.reason}"
    low, high = c.speedup_ci
    words = {
        FASTER: f"{c.candidate} is faster",
        SLOWER: f"{c.candidate} is slower ({100 * (1 / c.speedup - 1):.1f}% more time per step)",
        NO_DIFFERENCE: "no detectable difference",
    }[c.verdict]
    ratios = [
        f" · {label} ×{value:.2f}"
        for label, value in (("samples/s", c.samples_per_s_ratio), ("peak mem", c.peak_mem_ratio))
        if value is not None
    ]
    interval = f"{100 * c.confidence:.0f}% CI {low:.3f}–{high:.3f}" + (
        f", width from {c.variance}" if c.variance else ""
    )
    return f"{head} {c.speedup:.3f}x ({interval}): {words}{''.join(ratios)}"


def measured_text(result: ABResult) -> str:
    """The steps the runs measured: "100 steps measured" when every usable run measured ``--steps``; else their
    range and the variants that measured fewer (their script ended first): "50–100 steps measured (--steps 100;
    fewer in b)"."""
    steps = result.settings.steps
    usable = {v.name: [r.measured_steps for r in v.runs if not r.failure] for v in result.variants}
    counts = sorted({n for runs in usable.values() for n in runs})
    if counts in ([], [steps]):
        return f"{steps} steps measured"
    short = ", ".join(name for name, runs in usable.items() if any(n < steps for n in runs))
    span = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"
    return f"{span} steps measured (--steps {steps}; fewer in {short})"


def print_ab(result: ABResult, file: IO[str] | None = None) -> None:
    """The variant table, the comparison lines, the warnings and the runs left out."""
    console = _console(file)

    def say(text: str) -> None:
        console.print(terminal_safe(text), markup=False)

    s = result.settings
    say(
        f"stepscope ab · {len(result.variants)} variants × {s.repeats} run{'s' if s.repeats > 1 else ''} "
        f"interleaved · {measured_text(result)} after {s.warmup} warm-up"
    )
    console.print(variant_table(result, ascii_only=_plain(console)))
    if result.comparisons:
        say(f"speedup = {result.variants[0].name}'s sec/step ÷ the variant's (> 1: faster); interval: {s.method}")
    for comparison in result.comparisons:
        say(comparison_line(comparison))
    for warning in result.warnings:
        say(f"warning: {warning}")
    for variant in result.variants:
        for run in variant.runs:
            if run.failure:
                say(f"run {run.order} ({variant.name}) left out: {run.failure}")
    if result.stopped:
        say(result.stopped)
