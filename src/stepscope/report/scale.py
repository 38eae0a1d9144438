"""`stepscope scale`: read run summaries from files and folders, and print the scaling table.

Reading is the I/O half of the scaling report (the analysis is ``stepscope.analyses.scale``): a folder stands for
the ``*.json`` files directly in it, a file that cannot be read or has no value for the ``--by`` label is skipped
with one sentence. Output follows ``report.terminal``: rich tables, plain ASCII when not on a TTY, user text
(labels, phase names, file names) never read as markup.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import IO

from rich import box
from rich.markup import escape
from rich.table import Table

from stepscope.analyses.scale import FOLDER, ScaleError, ScaleGroup, ScaleReport, ScaleRun, Skipped, label_for
from stepscope.report.terminal import _ASCII_HEAD, _console, _fmt_ms, _plain
from stepscope.summary import RunSummary, SummaryError, summary_files


def _files(paths: list[str], skipped: list[Skipped]) -> list[Path]:
    """The summary files named by ``paths`` (a folder: its ``*.json``), each once, in the order given."""
    files, problems = summary_files(paths)
    skipped += [Skipped(path, why) for path, why in problems]
    return files


def _missing_label(by: str, path: Path, summary: RunSummary) -> str:
    if by == FOLDER:
        return f"{path} has no folder to name it by."
    command = summary.meta.command or "no command recorded"
    return (
        f"{path} has no {by} label: its command ({command}) has no --{by} VALUE or {by}=VALUE, and no folder or "
        f"file on its path is named {by}=VALUE."
    )


def read_runs(paths: list[str], by: str | None = None) -> tuple[list[ScaleRun], list[Skipped]]:
    """Load the summaries at ``paths`` (files or folders) with their ``by`` label (see ``label_for``); files that
    cannot be used are returned as skipped. Raises ScaleError when no file is found at all."""
    skipped: list[Skipped] = []
    files = _files(paths, skipped)
    if not files:
        raise ScaleError(f"no summary files found in {', '.join(paths) or 'the arguments'}", skipped)
    runs = []
    for path in files:
        try:
            summary = RunSummary.from_json(path)
        except SummaryError as error:
            skipped.append(Skipped(str(path), str(error)))
            continue
        label = None
        if by is not None:
            label = label_for(by, summary.meta.command, str(path.resolve()))
            if label is None:
                skipped.append(Skipped(str(path), _missing_label(by, path, summary)))
                continue
        runs.append(ScaleRun(source=str(path), summary=summary, label=label))
    return runs, skipped


def _table(ascii_only: bool) -> Table:
    # One space between columns: the scaling table has up to eleven and must fit a 110-column log.
    return Table(
        box=_ASCII_HEAD if ascii_only else box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0, 0, 1)
    )


def _fmt_rate(value: float) -> str:
    return f"{value:,.1f}"


def config_rows(group: ScaleGroup) -> tuple[list[str], list[list[str]]]:
    """The scaling table as text, one row per world size: repeats, batch per rank, samples/s (median and range),
    speedup, efficiency, step time, and time per epoch and energy per sample when any configuration has them.
    Returns (headers, rows); the terminal and the HTML page both show these."""
    epochs = any(c.epoch_s is not None for c in group.configs)
    energy = any(c.energy_per_sample_j is not None for c in group.configs)
    headers = ["ranks", "runs", "batch/rank", "samples/s", "range", "speedup", "efficiency", "step ms"]
    headers += ["epoch s"] * epochs + ["J/sample"] * energy
    rows = []
    for c in group.configs:
        rate = c.samples_per_s
        row = [
            str(c.world_size),
            str(len(c.sources)),
            f"{round(c.batch_per_rank, 1):g}",
            _fmt_rate(rate.median),
            "-" if len(c.sources) == 1 else f"{_fmt_rate(rate.low)}–{_fmt_rate(rate.high)}",
            f"{c.speedup:.2f}×",
            f"{100 * c.efficiency:.0f}%",
            _fmt_ms(c.step_ms),
        ]
        if epochs:
            row.append("-" if c.epoch_s is None else f"{c.epoch_s:,.1f}")
        if energy:
            row.append("-" if c.energy_per_sample_j is None else f"{c.energy_per_sample_j:.4g}")
        rows.append(row)
    return headers, rows


def config_table(group: ScaleGroup, ascii_only: bool = False) -> Table:
    """``config_rows`` as a terminal table."""
    headers, rows = config_rows(group)
    table = _table(ascii_only)
    for header in headers:
        table.add_column(header, justify="right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return table


def phase_table(group: ScaleGroup, ascii_only: bool = False) -> Table:
    """Per-rank ms per step of each phase (rows) at each world size (columns); the growing phase is marked."""
    names: list[str] = []
    for c in group.configs:
        names += [n for n in c.phases_ms if n not in names]
    table = _table(ascii_only)
    table.add_column("ms per step per rank")
    for c in group.configs:
        table.add_column(f"{c.world_size} rank{'s' * (c.world_size != 1)}", justify="right", no_wrap=True)
    table.add_column("")
    grows = group.growth.phase if group.growth else None
    for name in names:
        cells = [_fmt_ms(c.phases_ms.get(name, 0.0)) for c in group.configs]
        table.add_row(escape(name), *cells, "← grows" if name == grows else "")
    table.add_row("step", *[_fmt_ms(c.step_ms) for c in group.configs], "")
    return table


def scaling_words(group: ScaleGroup) -> str:
    """'weak scaling (same batch per rank: 16)' or 'strong scaling (same global batch: 64)'."""
    first = group.configs[0]
    if group.scaling == "weak":
        return f"weak scaling (same batch per rank: {round(first.batch_per_rank, 1):g})"
    return f"strong scaling (same global batch: {round(first.batch_per_rank * first.world_size, 1):g})"


def _heading(report: ScaleReport, group: ScaleGroup) -> str:
    runs = sum(len(c.sources) for c in group.configs)
    label = "" if group.label is None else f"{report.by}={group.label} · "
    return f"stepscope scale · {label}{runs} runs at {len(group.configs)} world sizes · {scaling_words(group)}"


def print_scale(report: ScaleReport, file: IO[str] | None = None) -> None:
    """Print each label's table, its per-phase table and findings, then the runs skipped and labels left out."""
    console = _console(file)
    say = functools.partial(console.print, markup=False)
    ascii_only = _plain(console)
    for i, group in enumerate(report.groups):
        if i:
            say("")
        say(_heading(report, group))
        console.print(config_table(group, ascii_only))
        console.print(phase_table(group, ascii_only))
        for line in group.findings:
            say(f"- {line}")
    for skip in report.skipped:
        say(f"skipped: {skip.reason}")
    for note in report.notes:
        say(f"note: {note}")
