"""Terminal report of `stepscope tune`: the doctor's verdict on the script as it is, one row per trial (round,
stage, setting, steps/s, speedup against the best so far with its interval, kept or why not), then the best
combination against the baseline and how to keep it. Plain ASCII when the output is not a terminal."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import IO

from rich import box
from rich.markup import escape
from rich.table import Table

from stepscope.instrument.tune import LossComparison, TuneResult, run_line
from stepscope.report.console import _ASCII_HEAD, _console, _plain
from stepscope.report.text import terminal_safe
from stepscope.summary import RunSummary


def number_text(value: float | None, digits: int = 2) -> str:
    """A figure with thousands separators, or "-" when unknown."""
    return "-" if value is None else f"{value:,.{digits}f}"


def interval_text(low: float | None, high: float | None) -> str:
    """An interval as "1.20–1.62", or "-" when there is none."""
    return "-" if low is None or high is None else f"{low:.2f}–{high:.2f}"


def trial_table(result: TuneResult, ascii_only: bool = False) -> Table:
    """One row per trial, in the order they ran; the setting last, whole (it is what ``--apply`` takes)."""
    table = Table(
        box=_ASCII_HEAD if ascii_only else box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0, 0, 1)
    )
    table.add_column("round", justify="right", no_wrap=True)
    table.add_column("stage", no_wrap=True)
    for header in ("steps/s", "speedup", "95% CI"):
        table.add_column(header, justify="right", no_wrap=True)
    table.add_column("outcome", no_wrap=True)
    table.add_column("setting", overflow="fold")
    for t in result.trials:
        table.add_row(
            str(t.round), t.stage, number_text(t.steps_per_s), "-" if t.speedup is None else f"{t.speedup:.2f}x",
            interval_text(t.ci_low, t.ci_high), escape(terminal_safe(t.reason or t.verdict)),
            escape(terminal_safe(t.candidate)),
        )  # fmt: skip
    return table


def print_tune(result: TuneResult | None, summary: RunSummary, command: list[str], file: IO[str] | None = None) -> None:
    """The verdict on the script as it is, the trials, the best combination with its measured speedup, and the
    exact lines that keep it."""
    console = _console(file)

    def say(text: str) -> None:
        console.print(terminal_safe(text), markup=False)

    verdict = summary.verdict
    say(f"stepscope tune · as it is: {verdict.bound} bound ({verdict.confidence} confidence)")
    for note in summary.notes:
        say(f"note: {note}")
    if result is None:
        say("nothing was searched.")
        return
    baseline = number_text(result.baseline_steps_per_s)
    say(f"baseline: {baseline} steps/s · {result.rounds} round(s) · speedup: against the best so far (> 1: faster) "
        "· kept: the fastest whose 95% interval lies above 1 in full runs")  # fmt: skip
    if result.trials:
        console.print(trial_table(result, ascii_only=_plain(console)))
    for note in result.notes:
        say(f"note: {note}")
    if result.stopped:
        say(result.stopped)
    if not result.best_apply:
        say("best: the script as it is; no setting measured faster.")
        return
    say(
        f"best: {', '.join(result.best_apply)} · {number_text(result.best_steps_per_s)} steps/s · "
        f"{number_text(result.speedup)}x the baseline (95% CI {interval_text(result.ci_low, result.ci_high)})"
    )
    say(f"run it:  {run_line(result.best_apply, command)}")
    say("keep it in the script:")
    for line in result.keep:
        say(f"  {line}")
    if result.loss is not None and result.loss.numerics:
        say(loss_headline(result.loss))
        for line in loss_rows(result.loss):
            say(f"  {line}")


def percent_text(value: float | None) -> str:
    """A relative difference as "0.42%", or "-" when unknown."""
    return "-" if value is None else f"{value * 100:.2g}%"


def loss_headline(loss: LossComparison) -> str:
    """What the settings that change numerics did to the loss, in one line."""
    worst = "" if loss.max_rel_diff_step is None else f" (measured step {loss.max_rel_diff_step})"
    return (
        f"loss of the same steps ({', '.join(loss.numerics)} changes numerics): largest difference "
        f"{percent_text(loss.max_rel_diff)}{worst}, at the last step {percent_text(loss.last_rel_diff)}"
    )


def loss_rows(loss: LossComparison, edge: int = 3) -> list[str]:
    """The first and last ``edge`` steps side by side, baseline then tuned, as aligned text."""

    def row(i: int) -> str:
        return f"{loss.steps[i]:>6} {_loss_text(loss.baseline[i]):>12} {_loss_text(loss.tuned[i]):>12}"

    count = len(loss.steps)
    head = f"{'step':>6} {'baseline':>12} {'tuned':>12}"
    if count <= 2 * edge:
        return [head, *map(row, range(count))]
    return [head, *map(row, range(edge)), f"{'...':>6}", *map(row, range(count - edge, count))]


def _loss_text(value: float | None) -> str:
    return "not finite" if value is None else f"{value:.6g}"


@contextlib.contextmanager
def progress(budget_s: float, started: float, file: IO[str] | None = None) -> Iterator[Callable[[str], None]]:
    """A ``log`` for the search. On a terminal: the round lines stay, and one live status line below them shows the
    latest run and the time spent of the budget. Elsewhere (a log file, CI): every line as it comes."""
    file = file or sys.stderr
    if not (hasattr(file, "isatty") and file.isatty()):
        yield lambda line: print(terminal_safe(line), file=file, flush=True)
        return
    from rich.console import Console

    console = Console(file=file, highlight=False)
    with console.status("stepscope tune: starting") as status:

        def log(line: str) -> None:
            spent = time.monotonic() - started
            if line.startswith("stepscope tune:"):
                console.print(terminal_safe(line), markup=False)
            status.update(escape(terminal_safe(f"{line.strip()} · {spent:.0f} s of {budget_s:g} s")))

        yield log
