"""The per-phase table of a RunSummary, in the style of a profile_step report.

rich renders it: on a terminal with colour and a Unicode rule, in plain ASCII text (no colour) when the output is
not a TTY or ``CI`` is set, so logs stay readable. User text (commands, phase names) is printed verbatim, never
read as rich markup.
"""

from __future__ import annotations

import math
import statistics
import textwrap
from typing import IO

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from stepscope.record import TOTAL
from stepscope.report.console import _ASCII_HEAD, _console, _plain
from stepscope.report.text import RANK_ROWS, outliers, terminal_safe
from stepscope.summary import Fix, RunSummary, describe_value


def _fmt_ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def phase_table(summary: RunSummary, ascii_only: bool = False) -> Table:
    """The phase | mean | median | p95 | share table (plus GPU columns when CUDA-timed)."""
    cuda = summary.meta.timing == "cuda"
    table = Table(box=_ASCII_HEAD if ascii_only else box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("phase")
    for header in ("mean ms", "median ms", "p95 ms", "share"):
        table.add_column(header, justify="right")
    if cuda:
        table.add_column("gpu mean ms", justify="right")
        table.add_column("gpu share", justify="right")
    for name, stats in summary.phases.items():
        label = escape(terminal_safe(f"  {name}" if stats.nested else name))
        row = [
            label,
            _fmt_ms(stats.mean_ms),
            _fmt_ms(stats.median_ms),
            _fmt_ms(stats.p95_ms),
            f"{100 * stats.share:.1f}%",
        ]
        if cuda:
            row.append(_fmt_ms(stats.device_mean_ms))
            row.append("-" if stats.device_share is None else f"{100 * stats.device_share:.1f}%")
        table.add_row(*row, end_section=name == list(summary.phases)[-2] if TOTAL in summary.phases else False)
    return table


HOTSPOT_MIN_SHARE = 0.10  # of a phase's stack samples: lines below this stay out of the terminal summary


def hotspot_lines(summary: RunSummary, per_phase: int = 2) -> list[str]:
    """The sampled source lines that took at least HOTSPOT_MIN_SHARE of a phase, at most ``per_phase`` per phase:
    ``other 58%: train.py:42 torch.save(state, path) [torch.serialization.save] 81%``."""
    from stepscope.collectors.stacks import describe_line

    hot = summary.hotspots
    lines = []
    for phase, rows in hot.get("phases", {}).items():
        stats = summary.phases.get(phase)
        label = phase if stats is None else f"{phase} {100 * stats.share:.0f}%"
        for row in [r for r in rows if r["share"] >= HOTSPOT_MIN_SHARE][:per_phase]:
            lines.append(f"{label}: {describe_line(row)} {100 * row['share']:.0f}%")
    if lines and "rank" in hot:
        lines.insert(0, f"source lines of rank {hot['rank']}:")
    return lines


def throughput_line(summary: RunSummary) -> str:
    """One line: the step rate (steps/s, samples/s in training steps alone), how many steps were measured and
    skipped; ``wall_line`` gives the wall rate beside it."""
    t = summary.throughput
    parts = []
    if t.steps_per_s is not None:
        parts.append(f"{t.steps_per_s:.2f} steps/s")
    if t.samples_per_s is not None:
        parts.append(f"{t.samples_per_s:.1f} samples/s")
    if t.tflops is not None:
        achieved = f"{t.tflops:.1f} TFLOP/s" if t.tflops >= 1 else f"{t.tflops * 1e3:.3g} GFLOP/s"
        mfu = f" = MFU {100 * t.mfu:.1f}% of {t.mfu_peak}" if t.mfu is not None else ""
        parts.append(f"{achieved} model{mfu}")
    rate = ", ".join(parts) or "no rate"
    profiled = f", {summary.steps.profiled} profiled left out" if summary.steps.profiled else ""
    return f"throughput: {rate} over {summary.steps.measured} measured steps (warm-up {summary.steps.warmup}{profiled})"


OVERHEAD_SHOWN = 0.01  # of the step: below it, stepscope's own cost is in the JSON only


def overhead_line(summary: RunSummary) -> str | None:
    """stepscope's own cost per step and what it went to, when it is above 1% of the step; None otherwise."""
    own = summary.overhead
    if own is None or own.share is None or own.share <= OVERHEAD_SHOWN:
        return None
    threads = "" if own.threads_us_per_step is None else f", its threads {own.threads_us_per_step:,.0f} µs"
    return (
        f"stepscope's own cost: {own.us_per_step:,.0f} µs a step ({own.share:.1%} of the step, measured in the run): "
        f"its hooks {own.hooks_us_per_step:,.0f} µs{threads}"
    )


def wall_line(summary: RunSummary) -> str | None:
    """The wall rate and where the measured window went, when it differs from the step rate by more than rounding
    (validation passes, time in no step); None when the window is the steps."""
    t, wall = summary.throughput, summary.wall
    if wall is None or wall.window_s <= 0 or t.wall_steps_per_s is None or wall.steps_s >= 0.995 * wall.window_s:
        return None
    rates = [f"{t.wall_steps_per_s:.2f} steps/s"]
    if t.wall_samples_per_s is not None:
        rates.append(f"{t.wall_samples_per_s:.1f} samples/s")
    parts = [f"training steps {100 * wall.steps_s / wall.window_s:.0f}%"]
    if wall.eval_s:
        parts.append(f"validation {100 * wall.eval_s / wall.window_s:.0f}%")
    if wall.between_s >= 0.005 * wall.window_s:
        parts.append(f"between steps {100 * wall.between_s / wall.window_s:.0f}%")
    return f"wall rate: {', '.join(rates)} over the {wall.window_s:.2f} s measured ({', '.join(parts)})"


def eval_line(summary: RunSummary) -> str | None:
    """One line on the validation passes kept out of the step statistics, or None without any."""
    passes = summary.eval
    if not passes:
        return None
    inside = ", ".join(f"{name} {ms:.1f}" for name, ms in passes["phases_ms"].items() if ms >= 0.05)
    return (
        f"eval: {passes['passes']} validation pass(es) between steps, mean {passes['mean_ms']:.1f} ms "
        f"({inside} ms), {100 * passes['share_of_wall']:.0f}% of wall time; kept out of the step figures"
    )


def shown_ranks(summary: RunSummary) -> list[RunSummary]:
    """The ranks a table shows: all of them up to ``RANK_ROWS``, else the straggler and the ranks farthest from
    the job's median in any phase (in synchronous training every rank's step time is the job's: the outliers are
    in the phases), in rank order."""
    ranks = summary.ranks
    if len(ranks) <= RANK_ROWS:
        return ranks
    names = [n for n in summary.phases if n != TOTAL]
    medians = {n: statistics.median(r.phases[n].mean_ms for r in ranks if n in r.phases) for n in names}

    def distance(rank: RunSummary) -> float:
        if summary.cluster and summary.cluster.straggler and rank.meta.rank == summary.cluster.straggler.rank:
            return math.inf
        return max((abs(rank.phases[n].mean_ms - medians[n]) for n in names if n in rank.phases), default=0.0)

    return outliers(ranks, distance, lambda r: r.meta.rank or 0)


def rank_table(summary: RunSummary, ascii_only: bool = False) -> Table:
    """One row per rank (of a larger job, the ``RANK_ROWS`` of ``shown_ranks``): its node when the job spans
    several, step time, each phase's mean, samples/s."""
    names = [n for n in summary.phases if n != TOTAL]
    nodes = bool(summary.cluster and summary.cluster.nodes)
    table = Table(box=_ASCII_HEAD if ascii_only else box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("rank")
    if nodes:
        table.add_column("node", no_wrap=True)
    table.add_column("step ms", justify="right")
    for name in names:
        table.add_column(f"{escape(terminal_safe(name))} ms", justify="right")
    table.add_column("samples/s", justify="right")
    for rank in shown_ranks(summary):
        phases = rank.phases
        row = [str(rank.meta.rank if rank.meta.rank is not None else "?")]
        if nodes:
            row.append(escape(terminal_safe(rank.meta.node)))
        row.append(_fmt_ms(phases[TOTAL].mean_ms) if TOTAL in phases else "-")
        row += [_fmt_ms(phases[n].mean_ms) if n in phases else "-" for n in names]
        rate = rank.throughput.samples_per_s
        row.append("-" if rate is None else f"{rate:.1f}")
        table.add_row(*row)
    return table


def node_table(summary: RunSummary, ascii_only: bool = False) -> Table:
    """One row per node of a multi-node job: its ranks, samples/s, mean step and comms time."""
    table = Table(box=_ASCII_HEAD if ascii_only else box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for header in ("node", "ranks", "samples/s", "step ms", "comms ms"):
        table.add_column(header, justify="left" if header in ("node", "ranks") else "right", no_wrap=True)
    for row in summary.cluster.nodes if summary.cluster else []:
        rate, step, comms = row["samples_per_s"], row["step_ms"], row.get("comms_ms")
        table.add_row(
            escape(terminal_safe(row["node"])),
            rank_list(row["ranks"]),
            "-" if rate is None else f"{rate:.1f}",
            "-" if step is None else _fmt_ms(step),
            "-" if comms is None else _fmt_ms(comms),
        )
    return table


def rank_list(ranks: list[int]) -> str:
    """``0-3, 8`` for [0, 1, 2, 3, 8]: runs of consecutive ranks as ranges."""
    parts, ordered = [], sorted(ranks)
    start = prev = ordered[0]
    for rank in [*ordered[1:], None]:
        if rank is not None and rank == prev + 1:
            prev = rank
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if rank is not None:
            start = prev = rank
    return ", ".join(parts)


def exit_line(summary: RunSummary) -> str | None:
    """How the measured command ended, in words."""
    end = summary.exit
    if end is None:
        return None
    code = "" if end.code is None else f" (exit code {end.code})"
    if end.cause_rank is not None and end.reason not in ("stopped", "finished"):
        # Several ranks failed: the first in time is the cause, the others' errors follow from it.
        after = [
            str(r.meta.rank)
            for r in summary.ranks
            if r.exit
            and r.meta.rank != end.cause_rank
            and (r.exit.hung or r.exit.reason not in ("finished", "stopped"))
        ]
        then = f"; rank {', '.join(after)} failed after it" if after else ""
        return f"the run failed: first {end.error}{then}{code}; the figures are from the steps before the failure"
    if end.reason == "stopped":
        return f"stopped after {summary.steps.measured} measured steps{code}; --no-stop lets the script finish"
    if end.reason == "error":
        return f"the script failed: {end.error}{code}; the figures are from the steps before the failure"
    if end.reason == "killed":
        return f"the script was {end.error}{code}"
    if end.reason in ("terminated", "interrupted"):
        return f"the run was {end.reason}{code}; the figures are from the steps before it ended"
    return f"the script finished{code}"


def pipeline_line(pipeline: dict) -> str:
    """A PipelineMonitor's figures in one line: ``pipeline: thru 12.1/s · inference capacity 18.5/s · ...``."""

    def rate(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}/s"

    wait = pipeline.get("dispatch_wait_s")
    pool = pipeline.get("pool")  # null in summaries written before pool_put refused NaN
    return (
        f"pipeline: thru {rate(pipeline.get('thru'))} · inference capacity {rate(pipeline.get('infer_capacity'))} · "
        f"training capacity {rate(pipeline.get('train_capacity'))} · wait "
        f"{'-' if wait is None else f'{wait * 1e3:.0f} ms'}/step · pool {'-' if pool is None else f'{pool:.0f}'} · "
        f"bottleneck {pipeline.get('bottleneck', 'unknown')}"
    )


def trace_lines(trace: dict) -> list[str]:
    """The trace highlights of a summary in a few lines: per rank the GPU's idle/compute/non-compute shares (or the
    CPU-only ATen share) and its bound, then the trace's verdict and the rank the others wait for, with its cause."""

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}%"

    lines = []
    for rank in trace.get("ranks", []):
        if rank.get("cpu"):
            figures = f"ATen ops {pct(rank['cpu'].get('computation_pct'))} of the main thread (CPU-only trace)"
        else:
            idle = rank.get("idle_breakdown") or {}
            figures = (
                f"GPU idle {pct(rank.get('idle_pct'))} (host wait {pct(idle.get('host_wait_pct'))}), compute "
                f"{pct(rank.get('compute_pct'))}, non-compute {pct(rank.get('non_compute_pct'))}"
            )
        lines.append(f"trace: rank {rank['rank']}: {figures} · bound {rank['verdict']['bound']}")
    verdict = trace.get("verdict") or {}
    if lines and verdict.get("evidence"):
        lines.append(f"trace verdict: {verdict['bound']} ({'; '.join(verdict['evidence'])})")
    if lines:
        from stepscope.doctor.verdict import late_rank_lines

        lines += [f"trace late rank: {line}" for line in late_rank_lines(trace)]
    return lines


def split_contention(evidence: list[str]) -> tuple[str | None, list[str]]:
    """The verdict's "machine is oversubscribed" line (without that prefix), if any, and the other evidence."""
    from stepscope.doctor.verdict import OVERSUBSCRIBED

    line = next((e for e in evidence if e.startswith(OVERSUBSCRIBED)), None)
    rest = [e for e in evidence if e is not line]
    return (None if line is None else line.removeprefix(OVERSUBSCRIBED)), rest


def applied_line(summary: RunSummary) -> str | None:
    """``--apply``: each requested fix, where it applied or why not, in one line (None when none was asked for)."""
    if not summary.applied:
        return None
    parts = []
    for fix in summary.applied:
        name = f"{fix['id']}={describe_value(fix.get('value'))}"
        if fix.get("applied"):
            extra = [fix["where"]] + ([f"not at {fix['why']}"] if fix.get("why") else [])
            extra += [f"ignored the script's {what}" for what in fix.get("ignored", [])]
            parts.append(f"{name} ({'; '.join(extra)})")
        else:
            parts.append(f"{name} NOT applied ({fix.get('why')})")
    return "applied: " + ", ".join(parts)


def print_summary(summary: RunSummary, file: IO[str] | None = None, verdict_line: bool = True) -> None:
    """Print the phase table, throughput, verdict and notes of a summary (and its ranks, for several)."""
    console = _console(file)
    timing = "CUDA events (gpu columns) + host clock" if summary.meta.timing == "cuda" else "host clock"
    console.print(
        terminal_safe(f"stepscope · {summary.meta.command or 'run'} · {summary.meta.device} · timing: {timing}"),
        markup=False,
    )
    line = applied_line(summary)
    if line:
        console.print(terminal_safe(line), markup=False)
    if summary.phases:
        console.print(phase_table(summary, ascii_only=_plain(console)))
        for line in hotspot_lines(summary):
            console.print(terminal_safe(line), markup=False)
        console.print(terminal_safe(throughput_line(summary)), markup=False)
        for line in (wall_line(summary), eval_line(summary)):
            if line:
                console.print(terminal_safe(line), markup=False)
        verdict = summary.verdict
        contention, rest = split_contention(verdict.evidence)
        evidence = f" ({'; '.join(rest)})" if rest else ""
        if verdict_line:
            console.print(
                terminal_safe(f"bound: {verdict.bound} [confidence {verdict.confidence}]{evidence}"), markup=False
            )
            if contention:
                console.print(terminal_safe(f"contention: {contention}"), markup=False)
    line = overhead_line(summary)
    if line:
        console.print(terminal_safe(line), markup=False)
    if summary.pipeline:
        console.print(terminal_safe(pipeline_line(summary.pipeline)), markup=False)
    for line in trace_lines(summary.trace):
        console.print(terminal_safe(line), markup=False)
    if summary.ranks:
        cluster = summary.cluster
        world = cluster.world_size if cluster else "?"
        shown = len(shown_ranks(summary))
        slowest = f"; the {shown} farthest from the median shown" if shown < len(summary.ranks) else ""
        missing = f"; missing: {rank_list(cluster.missing_ranks)}" if cluster and cluster.missing_ranks else ""
        console.print(f"ranks: {len(summary.ranks)} of {world} reported{missing}{slowest}", markup=False)
        console.print(rank_table(summary, ascii_only=_plain(console)))
        if cluster and cluster.nodes:
            console.print(f"nodes: {len(cluster.nodes)}", markup=False)
            console.print(node_table(summary, ascii_only=_plain(console)))
        if cluster and cluster.straggler:
            s = cluster.straggler
            where = f" on {s.node}" if s.node else ""
            line = (
                f"straggler: rank {s.rank}{where}, {s.phase} +{s.excess_ms:.1f} ms over the median of the other ranks"
            )
            console.print(terminal_safe(line), markup=False)
    line = exit_line(summary)
    if line:
        console.print(terminal_safe(line), markup=False)
    for note in summary.notes:
        console.print(terminal_safe(f"note: {note}"), markup=False)


def _param_section(console: Console, title: str, items: list[dict], ascii_only: bool) -> None:
    """One row per tensor (module, name, numel), grouped by module; a module's totals on its first row."""
    console.print(f"{title} ({len(items)} tensor(s), {sum(i['numel'] for i in items):,} parameters)", markup=False)
    if not items:
        console.print("  (none)", markup=False)
        return
    table = Table(box=_ASCII_HEAD if ascii_only else box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for header, justify in (("module", "left"), ("tensor", "left"), ("numel", "right"), ("module total", "right")):
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    by_module: dict[str, list[dict]] = {}
    for item in items:
        by_module.setdefault(item["module"] or "(top level)", []).append(item)
    for module, group in by_module.items():
        total = f"{len(group)} tensor(s), {sum(i['numel'] for i in group):,}"
        for row, item in enumerate(group):
            name = item["name"]
            if item.get("aliases"):
                name += f" (also {', '.join(item['aliases'])})"
            if item.get("reached_steps") is not None:
                name += f" [reached in {item['reached_steps']} pass(es)]"
            table.add_row(
                escape(terminal_safe(module)),
                escape(terminal_safe(name)),
                f"{item['numel']:,}",
                total if row == 0 else "",
            )
    console.print(table)


def print_params(result: dict, summary: RunSummary, include_zero_grad: bool, file: IO[str] | None = None) -> None:
    """Print the parameter audit of `stepscope params`: UNUSED, (ZERO-GRAD,) FROZEN, then the tip."""
    from stepscope.analyses.params import ParamAudit, ParamInfo

    console = _console(file)
    ascii_only = _plain(console)
    line = exit_line(summary)
    if not result.get("models"):
        console.print("stepscope params: no model with parameters was called; there is nothing to audit.", markup=False)
        if line:
            console.print(terminal_safe(line), markup=False)
        return
    ranks = f", union over {len(result['ranks'])} ranks" if "ranks" in result else ""
    wrapped = f" (in {' in '.join(result['wrapped_in'])})" if result.get("wrapped_in") else ""
    console.print(
        f"stepscope params · {result['model']}{wrapped} · {result['steps']} backward pass(es) audited · "
        f"{result['total_count']} parameter tensor(s), {result['used_count']} used{ranks}",
        markup=False,
    )
    if result["steps"] == 0:
        console.print(
            "no backward pass happened, so unused parameters cannot be told apart from used ones: only FROZEN is "
            "listed. Run the script's training loop (stepscope params stops it after --steps backward passes).",
            markup=False,
        )
    else:
        _param_section(console, "UNUSED", result["unused"], ascii_only)
        if result["conditional"]:
            _param_section(console, "CONDITIONAL (reached in some passes only)", result["conditional"], ascii_only)
        if include_zero_grad:
            _param_section(console, "ZERO-GRAD", result["zero_grad"], ascii_only)
    _param_section(console, "FROZEN", result["frozen"], ascii_only)
    lists = {k: [ParamInfo(**i) for i in result[k]] for k in ("unused", "zero_grad", "frozen", "conditional")}
    audit = ParamAudit(
        result["model"], result["steps"], result["used_count"], **lists, ddp_find_unused=result["ddp_find_unused"]
    )
    console.print(terminal_safe(f"tip: {audit.advice}"), markup=False)
    ddp = {True: "sets find_unused_parameters=True", False: "sets find_unused_parameters=False"}
    wrapped = ddp.get(result["ddp_find_unused"], "does not wrap this model in DistributedDataParallel")
    console.print(terminal_safe(f"DDP: the script {wrapped}."), markup=False)
    for other in result["models"][1:]:
        console.print(
            f"also audited: {other['model']} ({other['total_count']} tensors): {len(other['unused'])} unused, "
            f"{len(other['frozen'])} frozen",
            markup=False,
        )
    if line and summary.exit and summary.exit.reason != "stopped":
        console.print(terminal_safe(line), markup=False)


def gain_text(fix: Fix) -> str:
    """A fix's gain bound in words: "≤ 42%" of the step, or "?" when it cannot be bounded."""
    return "?" if fix.gain_bound is None else f"≤ {100 * fix.gain_bound:.0f}%"


def measured_text(fix: Fix) -> str:
    """A verified fix's measured speedup in words: "1.84x (1.52-2.23) faster", "no detectable difference (0.97-1.04)";
    "" when it was not verified."""
    m = fix.measured
    if m is None:
        return ""
    interval = f" ({m['ci_low']:.2f}-{m['ci_high']:.2f})" if m.get("ci_low") is not None else ""
    if m["verdict"] in ("faster", "slower"):
        return f"{m['speedup']:.2f}x{interval} {m['verdict']}"
    speedup = f"{m['speedup']:.2f}x, " if m.get("speedup") is not None else ""
    return f"{speedup}{m['verdict']}{interval}"


def fix_table(summary: RunSummary, ascii_only: bool = False) -> Table:
    """One row per ranked fix: rank, id, title, cost, gain bound, the measured speedup (``--verify``), whether it
    changes numerics."""
    verified = any(fix.measured for fix in summary.fixes)
    table = Table(box=_ASCII_HEAD if ascii_only else box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for header, justify in (("#", "right"), ("fix", "left"), ("", "left"), ("cost", "left"), ("gain", "right")):
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    if verified:
        table.add_column("measured (95% interval)", justify="left")
    table.add_column("numerics", justify="left")
    for rank, fix in enumerate(summary.fixes, 1):
        numerics = "changes" if fix.changes_numerics else ""
        row = [str(rank), fix.id, escape(terminal_safe(fix.title)), fix.cost, gain_text(fix)]
        row += [escape(terminal_safe(measured_text(fix)))] if verified else []
        table.add_row(*row, numerics)
    return table


def print_doctor(summary: RunSummary, file: IO[str] | None = None) -> None:
    """Print `stepscope doctor`'s report: the run's phase table, the verdict with its evidence, the ranked
    fixes, and each fix's mechanism, evidence and change."""
    console = _console(file)
    print_summary(summary, file=console.file, verdict_line=False)
    verdict = summary.verdict
    console.print(f"\nverdict: {verdict.bound} (confidence {verdict.confidence})", markup=False)
    for line in verdict.evidence:
        console.print(terminal_safe(f"  - {line}"), markup=False)
    if not summary.fixes:
        console.print("\nno fix applies to what was measured.", markup=False)
        return
    if any(fix.measured for fix in summary.fixes):
        heading = "fixes, measured gains first (--verify), then by the time each can save for its cost (under 5% last):"
    else:
        heading = "fixes, by the most time each can save for its cost (under 5% last):"
    console.print(f"\n{heading}", markup=False)
    console.print(fix_table(summary, ascii_only=_plain(console)))
    for rank, fix in enumerate(summary.fixes, 1):
        gain = f"{gain_text(fix)} of {fix.gain_basis} time" if fix.gain_bound is not None else "gain not bounded"
        console.print(f"\n{rank}. {terminal_safe(fix.title)} [{fix.id} · {fix.cost} · {gain}]", markup=False)
        lines = [f"why: {fix.why}", *(f"seen: {line}" for line in fix.evidence), f"how: {fix.how}"]
        if fix.gain_reason:
            lines.append(f"bound: {fix.gain_reason}")
        if fix.measured is not None:
            runs = fix.measured["runs"]
            lines.append(
                f"measured: {measured_text(fix)} with --apply {fix.measured['applied']} ({runs[1]} runs against "
                f"{runs[0]} of the baseline, interleaved)"
            )
            if fix.measured.get("flag"):
                lines.append(f"flag: {fix.measured['flag']}")
        if fix.changes_numerics:
            lines.append("note: this changes the numerics of training; check the loss curve.")
        for line in lines:  # wrapped lines stay indented under their label
            for part in textwrap.wrap(terminal_safe(line), width=max(40, console.width - 3), subsequent_indent="  "):
                console.print("   " + part, markup=False)


def _settings_text(settings: dict | None) -> str:
    if not settings:
        return "-"
    text = f"workers={settings['num_workers']}"
    if settings["num_workers"] > 0:
        text += f" prefetch={settings['prefetch_factor'] or 2}"
    return text + (" pinned" if settings["pin_memory"] else "")


def print_loader(result: dict, summary: RunSummary, file: IO[str] | None = None) -> None:
    """Print `stepscope dataloader`'s report: the loader's ceiling and fetch times, per-rank figures, the
    comparison with training, and the sweep table with the best setting."""
    console = _console(file)

    def say(text: str) -> None:
        console.print(terminal_safe(text), markup=False)

    loader = result.get("loader")
    ranks = result.get("ranks", [])
    head = ranks[0] if ranks else {}
    size = "" if head.get("dataset_length") is None else f", {head['dataset_length']:,} samples"
    built = f" of {head['built']} built" if head.get("built", 1) > 1 else ""
    say(
        f"stepscope dataloader · {summary.meta.command or 'script'} · loader {head.get('index', '?')}{built} "
        f"({head.get('dataset', '?')}{size})"
    )
    for rank in ranks:
        if "error" in rank:
            say(f"rank {rank['rank']}: the loader could not be measured: {rank['error']}")
    if loader is None:
        line = exit_line(summary)
        if line and summary.exit and summary.exit.reason != "stopped":  # stepscope stopped it: nothing to tell
            say(line)
        for note in summary.notes:
            say(f"note: {note}")
        return
    fetch = loader["fetch_ms"]
    h2d = "" if loader["h2d_ms"] is None else f" · copy to device {loader['h2d_ms']:.3f} ms (device time)"
    say(
        f"fetch per batch: mean {fetch['mean']:.3f} ms, median {fetch['median']:.3f} ms, p95 {fetch['p95']:.3f} ms{h2d}"
    )
    rate = loader["samples_per_s"]
    rate_text = (
        f"{rate:,.1f} samples/s ({loader['batches_per_s']:,.2f} batches/s)"
        if rate
        else (f"{loader['batches_per_s']:,.2f} batches/s")
    )
    say(
        f"ceiling: {rate_text} over {loader['batches']} batches after {loader['warmup']} warm-up; "
        f"start-up {loader['startup_s']:.2f} s (iter() to the first batch)"
    )
    say(f"what it means: {loader['meaning']}")
    for note in loader["notes"]:
        say(f"note: {note}")
    if len(ranks) > 1 and "rank_samples_per_s" in result:
        spread = result["rank_samples_per_s"]
        say(
            f"ranks: {len(ranks)} · samples/s per rank min {spread['min']:,.1f} / mean {spread['mean']:,.1f} / "
            f"max {spread['max']:,.1f} · cluster ceiling {result['cluster_samples_per_s']:,.1f} samples/s, "
            f"{result['cluster_sync_samples_per_s']:,.1f} for synchronous training (ranks × the slowest)"
        )
    against = result.get("against_training")
    if against:
        verdict = "the input pipeline is the bottleneck" if against["input_bound"] else "the input pipeline keeps up"
        say(
            f"against training: training consumed {against['train_rate']:,.1f} samples/s, the loader alone gives "
            f"{against['loader_ceiling']:,.1f} ({against['headroom']:.2f}×): {verdict}"
        )
    if "sweep" not in result:
        return
    trainer_ms = result.get("trainer_ms_per_sample")
    table = Table(box=_ASCII_HEAD if _plain(console) else box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for header, justify in (
        ("setting", "left"),
        ("samples/s", "right"),
        *((("training samples/s", "right"),) if trainer_ms is not None else ()),
        ("start-up s", "right"),
        ("peak RSS MB", "right"),
        ("workers CPU %", "right"),
        ("", "left"),
    ):
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    current = loader["settings"]
    for trial in result["sweep"]:
        note = trial["error"] or trial.get("incomplete") or ("" if trial["safe"] else "too much memory")
        if trial["settings"] == current:
            note = (note + " (current)").strip()
        training = trial.get("train_samples_per_s")
        table.add_row(
            _settings_text(trial["settings"]),
            "-" if trial["samples_per_s"] is None else f"{trial['samples_per_s']:,.1f}",
            *(("-" if training is None else f"{training:,.1f}",) if trainer_ms is not None else ()),
            "-" if trial["startup_s"] is None else f"{trial['startup_s']:.2f}",
            "-" if trial["peak_rss_mb"] is None else f"{trial['peak_rss_mb']:,.0f}",
            "-" if trial["workers_cpu_pct"] is None else f"{trial['workers_cpu_pct']:.0f}",
            escape(note),
        )
    if trainer_ms is not None:
        say(
            f"sweep (fastest training first: the run against spends {trainer_ms:.3f} ms per sample besides waiting "
            "for data; with num_workers=0 the loading adds to that, workers overlap it):"
        )
    else:
        say("sweep (fastest first):")
    console.print(table)
    best = result.get("best")
    if best:
        rate = "training samples/s" if trainer_ms is not None else "samples/s"
        gain = "" if best["gain"] is None else f" ({100 * best['gain']:+.0f}% {rate} over the current setting)"
        if trainer_ms is not None:
            gain += " — the fewest workers within 2% of the fastest: past them the step sets the pace"
        say(f"best: {best.get('snippet') or best['settings']}{gain}")
    for skipped in result.get("sweep_skipped", []):
        say(f"not tried: {skipped}")
    for note in result.get("sweep_notes", []):
        say(f"note: {note}")
