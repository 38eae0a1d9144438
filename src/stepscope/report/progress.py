"""A run's progress while it runs, from its step streams: a live status line on a terminal, a plain line every few
seconds in a log (Slurm output files, CI), or nothing.

One line says: the measured steps so far (k/N), the job's steps/s and samples/s, a small bar of where the step's
time goes, the bound so far and its confidence, the slowest rank when there are several, and any process that
stopped closing steps. It is built from what the streams hold (host time), with the same merge and rules as the
final report, so the line converges to the report's figures.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from stepscope.doctor.verdict import classify, group_shares
from stepscope.instrument import PROGRESS_MODES
from stepscope.instrument.follow import NO_PROGRESS, Follow, Progress
from stepscope.instrument.merge import merge
from stepscope.summary import RunSummary

PLAIN_EVERY_S = 5.0  # a log line this often at most
LIVE_REFRESH_S = 1.0  # the live line's figures are rebuilt this often (it redraws more often)
BAR_CHARS = 20
# one letter per verdict group in the phase bar, in step order
BAR_LETTERS = {"data": "d", "compute": "c", "comms": "m", "optimizer": "o", "host": "h"}


def progress_line(follow: Follow) -> str:
    """The status of the followed run in one line, e.g. ``step 120/200 · 95.3 steps/s · 3,050 samples/s ·
    [dddcccccccccoooohhhh] data 14% compute 46% ... · bound so far: compute (medium)``."""
    elapsed_s = (time.monotonic_ns() - follow.started_ns) / 1e9
    ranks = follow.summaries()
    if not ranks:
        return f"stepscope: {elapsed_s:.0f} s, waiting for the first step"
    parts = [f"stepscope: {elapsed_s:.0f} s", _steps(follow, ranks)]
    measured = [r for r in ranks if r.steps.measured]
    if measured:
        job = merge(measured)
        rates = job.throughput
        if rates.steps_per_s:
            parts.append(f"{rates.steps_per_s:.1f} steps/s")
        if rates.samples_per_s:
            parts.append(f"{rates.samples_per_s:,.0f} samples/s")
        shares = group_shares(job)
        parts.append(_bar(shares))
        verdict = classify(job)
        parts.append(f"bound so far: {verdict.bound} ({verdict.confidence})")
        if len(measured) > 1:
            slowest = max(measured, key=lambda r: r.throughput.step_time_ms or 0.0)
            parts.append(f"slowest: rank {slowest.meta.rank} ({slowest.throughput.step_time_ms or 0:.1f} ms/step)")
    for stall in follow.stalled():
        parts.append(stall.describe())
    return " · ".join(parts)


def _steps(follow: Follow, ranks: list[RunSummary]) -> str:
    """``step k/N`` of the slowest process (measured steps of the requested ones), or its warm-up."""
    metas = [f.meta for f in follow.streams.values()]
    slowest = min(ranks, key=lambda r: (r.steps.measured, r.steps.warmup))
    warmup = next((m.get("warmup") for m in metas if m.get("warmup") is not None), None)
    target = next((m.get("steps") for m in metas if m.get("steps") is not None), None)
    if not slowest.steps.measured and warmup:
        return f"warm-up {slowest.steps.warmup}/{warmup}"
    return f"step {slowest.steps.measured}" + (f"/{target}" if target else "")


def _bar(shares: dict[str, float]) -> str:
    """A small bar of the step's time by group, and the groups' shares, e.g. ``[ddddcccccccccoooohhh] data 20% ...``."""
    cells = ""
    for group, letter in BAR_LETTERS.items():
        cells += letter * round(shares.get(group, 0.0) * BAR_CHARS)
    cells = cells[:BAR_CHARS].ljust(BAR_CHARS, ".")
    named = " ".join(f"{group} {shares[group]:.0%}" for group in BAR_LETTERS if shares.get(group, 0.0) >= 0.005)
    return f"[{cells}] {named}"


class PlainProgress:
    """A progress line every ``every_s`` seconds (no faster), for logs."""

    def __init__(self, file: TextIO | None = None, every_s: float = PLAIN_EVERY_S) -> None:
        self._file = file
        self._every_s = every_s
        self._last = time.monotonic()

    def update(self, follow: Follow) -> None:
        now = time.monotonic()
        if now - self._last >= self._every_s:
            self._last = now
            print(progress_line(follow), file=self._file or sys.stderr, flush=True)

    def close(self, follow: Follow) -> None:
        return None


class LiveProgress:
    """A status line redrawn in place on a terminal (rich), gone once the run ends: the report follows."""

    def __init__(self, file: TextIO | None = None) -> None:
        from rich.console import Console
        from rich.live import Live

        self._live: Any = Live(console=Console(file=file or sys.stderr), transient=True, auto_refresh=False)
        self._last = 0.0
        self._started = False

    def update(self, follow: Follow) -> None:
        now = time.monotonic()
        if now - self._last < LIVE_REFRESH_S:
            return
        self._last = now
        from rich.text import Text

        if not self._started:
            self._live.start()
            self._started = True
        self._live.update(Text(progress_line(follow), overflow="ellipsis", no_wrap=True), refresh=True)

    def close(self, follow: Follow) -> None:
        if self._started:
            self._live.stop()


def make_progress(mode: str, file: TextIO | None = None) -> Progress:
    """The display for ``--progress MODE``: ``auto`` is live on a terminal and plain otherwise."""
    stream = file or sys.stderr
    if mode == "auto":
        mode = "live" if stream.isatty() else "plain"
    if mode == "live":
        return LiveProgress(file)
    if mode == "plain":
        return PlainProgress(file)
    if mode == "none":
        return NO_PROGRESS
    raise ValueError(f"--progress must be one of {', '.join(PROGRESS_MODES)}, got {mode!r}")
