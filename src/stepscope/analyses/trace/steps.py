"""Step boundaries for traces without ``ProfilerStep`` ranges (a profiler run without a schedule, or ``prof.step()``
never called): other markers that repeat once per training iteration.

In order of trust: stepscope's own ranges (``stepscope/step``, else ``stepscope/optimizer``: a step ends at the
optimizer step, so it occurs once per step even with gradient accumulation), a user ``record_function`` that repeats
once per iteration, and torch's ``Optimizer.step#...`` range (one per ``optimizer.step()`` call). ``n`` marks give
``n - 1`` steps, each from one mark's start to the next's: a step is then everything between two marks, whatever
part of the iteration the mark itself covers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from stepscope.analyses.trace.events import CPU_KINDS, TraceEvents
from stepscope.instrument import RANGE_PREFIX

OPTIMIZER_STEP = re.compile(r"^Optimizer\.step#")
STEPSCOPE_MARKS = (RANGE_PREFIX + "step", RANGE_PREFIX + "optimizer")
# annotations that repeat for other reasons than the iteration: torch's own ranges, loader fetches, collectives
NOT_A_STEP = re.compile(r"ProfilerStep|^" + re.escape(RANGE_PREFIX) + r"|DataLoader|^Optimizer\.|^gloo:|^nccl:|^##")
COVERING_SHARE = 0.5  # without Optimizer.step to confirm the count, a user range must cover this much of its span


@dataclass
class StepMarks:
    """Steps (µs, start to next start) found from a marker other than ProfilerStep, and the marker's name."""

    source: str  # "stepscope/step", "stepscope/optimizer", "record_function <name>" or "Optimizer.step"
    steps: list[tuple[float, float]]


def _periods(starts: np.ndarray) -> list[tuple[float, float]]:
    starts = np.sort(starts)
    return list(zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True))


def _user_mark(trace: TraceEvents, optimizer_steps: int) -> tuple[str, np.ndarray] | None:
    """The user annotation that repeats once per iteration: disjoint occurrences, as many as Optimizer.step calls
    when there are any (else covering at least half its span); the one covering the most time wins."""
    cpu = trace.cpu
    rows = (cpu["kind"] == CPU_KINDS["user_annotation"]) & ~trace.named(cpu["name"], NOT_A_STEP)
    counts = np.bincount(cpu["name"][rows], minlength=len(trace.names))
    best: tuple[float, str, np.ndarray] | None = None
    for name in np.flatnonzero(counts >= 2):
        if optimizer_steps >= 2 and counts[name] != optimizer_steps:
            continue
        on = rows & (cpu["name"] == name)
        order = np.argsort(cpu["ts"][on], kind="stable")
        ts, end = cpu["ts"][on][order], cpu["end"][on][order]
        if (ts[1:] < end[:-1]).any():  # nested in itself or overlapping: not once per iteration
            continue
        span = float(end[-1] - ts[0])
        covered = float((end - ts).sum()) / span if span > 0 else 0.0
        if optimizer_steps < 2 and covered < COVERING_SHARE:
            continue
        if best is None or covered > best[0]:
            best = (covered, trace.names[name], ts)
    return None if best is None else (best[1], best[2])


def step_marks(trace: TraceEvents) -> StepMarks | None:
    """Steps from the first marker that repeats (see the module's docstring); None when no marker repeats."""
    cpu = trace.cpu
    index = {name: i for i, name in enumerate(trace.names) if name in STEPSCOPE_MARKS}
    for mark in STEPSCOPE_MARKS:
        if mark in index and (starts := cpu["ts"][cpu["name"] == index[mark]]).size >= 2:
            return StepMarks(mark, _periods(starts))
    optimizer = trace.named(cpu["name"], OPTIMIZER_STEP)
    optimizer_steps = int(optimizer.sum())
    if (user := _user_mark(trace, optimizer_steps)) is not None:
        return StepMarks(f"record_function {user[0]}", _periods(user[1]))
    if optimizer_steps >= 2:
        return StepMarks("Optimizer.step", _periods(cpu["ts"][optimizer]))
    return None
