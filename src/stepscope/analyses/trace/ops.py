"""Top host operators of a trace, as torch's ``prof.key_averages()`` tables them: per name, the calls, the self CPU
time (the event's own duration minus its direct children's on the same thread), its share of all self time, and the
total time (children included). Vectorised over the event columns: no Python loop per event.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stepscope.analyses.trace.breakdown import PROFILER_STEP
from stepscope.analyses.trace.events import TraceEvents


@dataclass
class OpStat:
    """One host operator name over the whole trace: calls, self CPU (ms, % of all self time), total CPU (ms)."""

    name: str
    count: int
    self_ms: float
    self_pct: float
    total_ms: float


def _depths(ts: np.ndarray, end: np.ndarray, tid: np.ndarray) -> np.ndarray:
    """Nesting depth of each event (sorted by thread, start, longest first): how many earlier events of its thread
    are still open when it starts. Events must have a positive duration."""
    depth = np.empty(len(ts), dtype=np.int64)
    bounds = np.flatnonzero(np.r_[True, tid[1:] != tid[:-1], True])
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        closed = np.searchsorted(np.sort(end[lo:hi]), ts[lo:hi], side="right")  # ended at or before the start
        depth[lo:hi] = np.arange(hi - lo) - closed
    return np.maximum(depth, 0)


def parents(ts: np.ndarray, end: np.ndarray, tid: np.ndarray) -> np.ndarray:
    """Index of each host event's direct parent (the innermost event of the same thread that it is nested in), -1
    for roots and zero-length events (they hold nothing and take nothing from a parent)."""
    parent = np.full(len(ts), -1, dtype=np.int64)
    timed = np.flatnonzero(end > ts)
    if len(timed) < 2:
        return parent
    order = timed[np.lexsort((-end[timed], ts[timed], tid[timed]))]
    depth = _depths(ts[order], end[order], tid[order])
    by_depth = np.argsort(depth, kind="stable")  # positions grouped by depth, ascending within each
    starts = np.searchsorted(depth[by_depth], np.arange(depth.max() + 2))
    for d in range(1, int(depth.max()) + 1):
        above, here = by_depth[starts[d - 1] : starts[d]], by_depth[starts[d] : starts[d + 1]]
        # every event between a parent and its child in this order is a descendant of the parent (deeper), so the
        # parent is the last event one level up before the child
        at = np.searchsorted(above, here) - 1
        found = at >= 0
        parent[order[here[found]]] = order[above[at[found]]]
    return parent


def self_times(ts: np.ndarray, end: np.ndarray, parent: np.ndarray) -> np.ndarray:
    """Self time (µs) of each host event: its duration minus its direct children's (``parent``: `parents`). Events
    that overlap without nesting (clock rounding) cannot make a self time negative: it is clipped at 0."""
    dur = end - ts
    has = parent >= 0
    children = np.bincount(parent[has], weights=dur[has], minlength=len(ts))
    return np.maximum(dur - children, 0.0)


def top_ops(trace: TraceEvents, top: int) -> list[OpStat]:
    """The ``top`` host operator names by self time, over the whole trace and every thread (as ``key_averages()``).

    The tree holds CPU ops, user annotations and runtime calls; ProfilerStep ranges take part (their self time counts
    in the total that ``self_pct`` divides) but are not listed, their names being one per step."""
    cpu, runtime = trace.cpu, trace.runtime
    ts = np.concatenate([cpu["ts"], runtime["ts"]])
    if len(ts) == 0 or top <= 0:
        return []
    end = np.concatenate([cpu["end"], runtime["end"]])
    tid = np.concatenate([cpu["tid"], runtime["tid"]])
    name = np.concatenate([cpu["name"], runtime["name"]])
    parent = parents(ts, end, tid)
    own = self_times(ts, end, parent)
    total_self = float(own.sum())
    # torch merges an event into its parent when it is the parent's only child and has its name (an op re-entering
    # the dispatcher): one call, the parent's time. Self time summed over the name is the same either way.
    has = parent >= 0
    only_child = np.zeros(len(ts), bool)
    only_child[has] = np.bincount(parent[has], minlength=len(ts))[parent[has]] == 1
    merged = only_child & has & (name == name[np.maximum(parent, 0)])
    n = len(trace.names)
    counts = np.bincount(name[~merged], minlength=n)
    self_by_name = np.bincount(name, weights=own, minlength=n)
    total_by_name = np.bincount(name[~merged], weights=(end - ts)[~merged], minlength=n)
    listed = np.flatnonzero(counts)
    listed = listed[~np.fromiter((bool(PROFILER_STEP.search(trace.names[i])) for i in listed), bool, len(listed))]
    ranked = listed[np.argsort(-self_by_name[listed], kind="stable")][:top]
    share = 100 / total_self if total_self > 0 else 0.0
    own, total = self_by_name.tolist(), total_by_name.tolist()  # plain floats: JSON writers refuse numpy scalars
    return [
        OpStat(trace.names[i], int(counts[i]), own[i] / 1000, own[i] * share, total[i] / 1000) for i in ranked.tolist()
    ]
