"""Late ranks: which rank the others wait for in their collectives, and what it was doing instead.

A collective ends on every rank at about the same time, once the last rank has arrived; a rank that arrives early
spends the difference waiting inside its communication kernel (NCCL) or its ``gloo:`` range (CPU), so its trace
looks comms-bound while the cause is on another rank. Here each rank's collectives are matched across ranks by name
and order of issue (every rank issues the same collectives in the same order), clocks are aligned on the collectives'
ends (the median difference per rank, so hosts whose clocks differ still compare), and at each collective the rank
that starts last is the late one: the others' time from their own start to its start is waiting.

Busy hosts deschedule a rank at a collective's end, so its end can come milliseconds after the others'. Such a
collective is still the same collective (it cannot end on any rank before every rank has started it), so the test of
a match is that causality, and a collective is left out only when its ends are apart by more than the job's own
noise (several times the median spread of the ends) and a fixed slack. Matches are refused as a whole only when most
collectives break causality (ranks traced over different steps, say).

What the late rank was doing: for each rank, the time from the end of its previous collective (else the start of
its step) to the start of this one is split into data loading, compute (computation kernels; on CPU-only traces ATen
ops) and host (the rest: Python, launches, waits). Data loading is the DataLoader spans that end after the previous
collective started and by this one's start, each counted whole: gloo records a collective's end on its own thread,
which a busy host can deschedule after it has woken the main thread, so the next batch may load before the
collective's recorded end, or partly so.
The part where the late rank exceeds the other ranks' median most is the cause.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from typing import Any

import numpy as np

from stepscope.analyses.trace import breakdown as bd
from stepscope.analyses.trace.events import TraceEvents

GLOO_COLLECTIVE = re.compile(r"^gloo:")
ATEN_OP = re.compile(r"^aten::")
END_SLACK_US = 100.0  # a collective's ends on the ranks, clocks aligned, agree within this plus 10% of its duration
END_NOISE_FACTOR = 4.0  # ... or within this many times the median spread of the ends (hosts descheduled at ends)
LATE_WAIT_SHARE_PCT = 50.0  # the others spend at least this share of their communication waiting for the rank
CAUSES = {"data": "data loading", "compute": "compute", "host": "host work (Python, launches, waits)"}


@dataclass
class RankCollectives:
    """One rank's collectives in order of start: name, absolute start and end (µs), and the parts of the time before
    each (µs since the end of the previous collective, else the step's start) spent on data, compute and host.

    Arrays only (about 50 bytes a collective): what the cross-rank step keeps of a rank once its trace is freed."""

    rank: int
    name: np.ndarray  # int32 per collective: its index in ``name_table``
    name_table: list[str]  # the distinct names of the rank's collectives
    start: np.ndarray
    end: np.ndarray
    before: dict[str, np.ndarray]  # "data", "compute", "host" -> µs per collective
    basis_us: float  # the rank's time basis: its kernel span, else (CPU-only) its steps or its trace
    steps: int
    kind: str  # "NCCL kernels" or "gloo ranges"


def _covered_before(intervals: tuple[np.ndarray, np.ndarray], t: np.ndarray) -> np.ndarray:
    """For each time in ``t``, how much of the disjoint sorted ``intervals`` lies before it (µs)."""
    starts, ends = intervals
    if len(starts) == 0:
        return np.zeros(len(t))
    cum = np.r_[0.0, np.cumsum(ends - starts)]
    started = np.searchsorted(starts, t, side="right")
    overshoot = np.where(started > 0, np.maximum(ends[np.maximum(started - 1, 0)] - t, 0.0), 0.0)
    return cum[started] - overshoot


def _ended_within(intervals: tuple[np.ndarray, np.ndarray], lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """For each (lo, hi], the whole length of the disjoint sorted ``intervals`` that end in it (µs): each interval
    counts once, where it ends."""
    starts, ends = intervals
    if len(starts) == 0:
        return np.zeros(len(lo))
    cum = np.r_[0.0, np.cumsum(ends - starts)]
    return cum[np.searchsorted(ends, hi, side="right")] - cum[np.searchsorted(ends, lo, side="right")]


def _within(intervals: tuple[np.ndarray, np.ndarray], lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return _covered_before(intervals, hi) - _covered_before(intervals, lo)


def rank_collectives(
    trace: TraceEvents,
    win: bd.Window,
    dev: bd.DeviceTime,
    loader: np.ndarray,
    basis_us: float,
    cut: tuple[float, float] | None,
) -> RankCollectives | None:
    """A rank's collectives (NCCL kernels, else ``gloo:`` host ranges) and what came before each; None without any.

    ``loader``: the rows of ``trace.cpu`` that are DataLoader spans; ``basis_us``: the time the rank's shares are of;
    ``cut``: keep only the collectives that start in it (the steps, when they are not ProfilerStep's window).
    """
    comm = dev.types == bd.COMMUNICATION
    cpu = trace.cpu
    if comm.any():
        kind = "NCCL kernels"
        ts, end, name = dev.ts[comm], dev.end[comm], dev.name[comm]
        compute = dev.by_type[bd.COMPUTATION]
    else:
        rows = trace.named(cpu["name"], GLOO_COLLECTIVE)
        if win.dropped_step and win.steps:
            rows &= cpu["ts"] < win.steps[-1][1]
        if not rows.any():
            return None
        kind = "gloo ranges"
        ts, end, name = cpu["ts"][rows], cpu["end"][rows], cpu["name"][rows]
        aten = (cpu["kind"] == 0) & trace.named(cpu["name"], ATEN_OP)
        compute = bd.merge(cpu["ts"][aten], cpu["end"][aten])
    if cut is not None:
        inside = (ts >= cut[0]) & (ts < cut[1])
        ts, end, name = ts[inside], end[inside], name[inside]
        if len(ts) == 0:
            return None
    order = np.argsort(ts, kind="stable")
    ts, end, name = ts[order], end[order], name[order]
    previous_end = np.r_[np.nan, np.maximum.accumulate(end)[:-1]]
    step_starts = np.array([s for s, _ in win.steps]) if win.steps else np.zeros(0)
    in_step = np.searchsorted(step_starts, ts, side="right") - 1
    step_start = np.where(in_step >= 0, step_starts[np.maximum(in_step, 0)] if len(step_starts) else np.nan, np.nan)
    # the first collective has no previous one: its step's start, when there are steps, opens the segment
    lo = np.where(np.isnan(previous_end), step_start, previous_end)
    known = ~np.isnan(lo) & (lo < ts)
    lo = np.where(known, lo, ts)
    # a batch counts whole toward the first collective that starts after it ends (see the module's doc)
    data_lo = np.where(known, np.r_[lo[:1], ts[:-1]], ts)
    data = bd.merge(cpu["ts"][loader], cpu["end"][loader])
    either = bd.merge(np.r_[data[0], compute[0]], np.r_[data[1], compute[1]])
    seg = ts - lo
    data_us, compute_us = _ended_within(data, data_lo, ts), _within(compute, lo, ts)
    before = {"data": data_us, "compute": compute_us, "host": seg - _within(either, lo, ts)}
    used, local = np.unique(name, return_inverse=True)
    table = [trace.names[i] for i in used.tolist()]
    origin = trace.origin_us
    return RankCollectives(
        trace.rank, local.astype(np.int32), table, ts + origin, end + origin, before, basis_us, len(win.steps), kind
    )


def median(values: np.ndarray, axis: int | None = None) -> Any:
    """``np.median(values, axis)``, the same figures (NaN where a slice holds one), without its NaN check, which
    imports numpy.ma (~10 ms of a small trace's ~0.2 s)."""
    ordered = np.sort(values, axis=axis)  # None sorts the flattened values
    axis = -1 if axis is None else axis
    n = ordered.shape[axis]
    if n == 0:
        return np.mean(ordered, axis=axis)  # NaN, with numpy's warning, as np.median gives
    middle = [n // 2] if n % 2 else [n // 2 - 1, n // 2]
    found = np.take(ordered, middle, axis=axis).mean(axis=axis)  # np.median's mean of the one or two middle values
    return np.where(np.isnan(np.take(ordered, -1, axis=axis)), np.nan, found)[()]  # a NaN sorts last


def _keys(ranks: list[RankCollectives]) -> list[np.ndarray]:
    """Per rank, a key per collective that is equal across ranks for the same name and occurrence of that name:
    (job-wide name id) << 32 | (how many of that name the rank issued before it)."""
    ids: dict[str, int] = {}
    keys = []
    for r in ranks:
        own = np.array([ids.setdefault(n, len(ids)) for n in r.name_table], dtype=np.int64)[r.name]
        order = np.argsort(own, kind="stable")
        grouped = own[order]
        occurrence = np.empty(len(own), dtype=np.int64)
        occurrence[order] = np.arange(len(own)) - np.searchsorted(grouped, grouped, side="left")
        keys.append(own << 32 | occurrence)
    return keys


def _matched(ranks: list[RankCollectives]) -> tuple[list[str], np.ndarray] | None:
    """For each collective every rank issued (same name, same occurrence), its index in each rank's arrays:
    rows are ranks, columns collectives in the first rank's order. None when nothing matches."""
    keys = _keys(ranks)
    common = keys[0]
    for other in keys[1:]:
        common = common[np.isin(common, other)]
    if len(common) == 0:
        return None
    index = np.empty((len(ranks), len(common)), dtype=np.int64)
    for row, own in enumerate(keys):
        order = np.argsort(own, kind="stable")  # keys are unique within a rank
        index[row] = order[np.searchsorted(own, common, sorter=order)]
    first = ranks[0]
    return [first.name_table[i] for i in first.name[index[0]].tolist()], index


def clock_offsets(end: np.ndarray) -> np.ndarray:
    """Each rank's clock against the first rank's (µs), from matched collectives' ends (rows ranks, columns
    collectives): the median over collectives of its end minus the ranks' median end, so one noisy rank (the first
    included) does not shift the others."""
    own = median(end - median(end, axis=0), axis=1)
    return own - own[0]


def _consistent(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, str | None]:
    """Which matched collectives (clocks aligned, rows ranks) are evidence, or a note when they cannot be compared.

    A collective cannot end on a rank before every rank has started it: where the last start comes after the first
    end (beyond the slack), the match is wrong, and when that is most of them the ranks are not comparable. Of the
    others, those whose ends are apart by more than the slack and `END_NOISE_FACTOR` times the median spread of the
    ends are left out: a host descheduled at a collective's end gives a few; noise that is everywhere is the job's."""
    duration = median(end - start, axis=0)
    slack = END_SLACK_US + 0.1 * duration
    causal = start.max(axis=0) <= end.min(axis=0) + slack
    apart = end.max(axis=0) - end.min(axis=0)
    if causal.sum() * 2 < len(causal):
        return causal, (
            f"the {len(causal)} collectives matched across ranks (by name and order) do not end together even with "
            f"the clocks aligned (up to {float(apart.max()) / 1000:.1f} ms apart; {int((~causal).sum())} end on a "
            "rank before another rank starts them): no late-rank analysis"
        )
    noise = END_NOISE_FACTOR * float(median(apart[causal]))
    return causal & (apart <= np.maximum(slack, noise)), None


def late_ranks(ranks: list[RankCollectives]) -> tuple[list[dict[str, Any]], str | None]:
    """The rank the others wait for at their collectives, when they wait for it at least half of their
    communication time: how late it is, what the others lose, and what it did instead (see the module's doc).

    Also a note when the collectives cannot be compared: a collective cannot end on a rank before every rank has
    started it, so when most matched collectives do (ranks traced over different steps, say) they are no evidence."""
    if len(ranks) < 2:
        return [], None
    matched = _matched(ranks)
    if matched is None:
        return [], None
    names, index = matched
    start = np.stack([r.start[i] for r, i in zip(ranks, index, strict=True)])
    end = np.stack([r.end[i] for r, i in zip(ranks, index, strict=True)])
    offset = clock_offsets(end)
    keep, note = _consistent(start - offset[:, None], end - offset[:, None])
    if note:
        return [], note
    names = [name for name, ok in zip(names, keep.tolist(), strict=True) if ok]
    index, start, end = index[:, keep], start[:, keep], end[:, keep]
    arrival = start - offset[:, None]
    last = np.argmax(arrival, axis=0)
    wait = np.clip(arrival.max(axis=0) - arrival, 0.0, end - start)  # a rank cannot wait longer than its collective
    comm = (end - start).sum(axis=1)
    late = int(np.bincount(last, weights=wait.sum(axis=0), minlength=len(ranks)).argmax())
    others = [i for i in range(len(ranks)) if i != late]
    waited = wait[others][:, last == late].sum(axis=1)  # µs each other rank waited for the late one
    share = 100 * float(waited.sum()) / float(comm[others].sum()) if comm[others].sum() > 0 else 0.0
    if share < LATE_WAIT_SHARE_PCT:
        return [], None
    slow = ranks[late]
    cols = last == late
    excess = {}
    for part in CAUSES:
        mine = slow.before[part][index[late][cols]]
        theirs = median(np.stack([ranks[i].before[part][index[i][cols]] for i in others]), axis=0)
        excess[part] = (float(mine.sum()), float(theirs.sum()))
    cause = max(excess, key=lambda part: excess[part][0] - excess[part][1])
    # the sums cover the collectives compared; when some were left out (ends apart), a step's worth is that share
    kept = float(keep.mean())
    per = max(slow.steps, 1) * kept
    unit = "per step" if slow.steps else "in the trace"
    lateness = arrival[late, cols] - median(arrival[others][:, cols], axis=0)
    wait_pct = statistics.fmean(
        100 * float(waited[j]) / kept / ranks[i].basis_us if ranks[i].basis_us > 0 else 0.0
        for j, i in enumerate(others)
    )
    mine_ms, theirs_ms = excess[cause][0] / 1000 / per, excess[cause][1] / 1000 / per
    waited_ms = float(median(waited)) / 1000 / per
    collective = names[int(np.flatnonzero(cols)[0])]
    evidence = [
        f"rank {slow.rank} starts {int(cols.sum())} of {len(names)} collectives last ({slow.kind}, e.g. "
        f"{collective[:60]}), {float(np.mean(lateness)) / 1000:.2f} ms after the other ranks' median on average",
        f"the other ranks wait {waited_ms:.2f} ms {unit} for it inside their collectives: {share:.0f}% of their "
        f"communication time, {wait_pct:.0f}% of their time",
        f"before those collectives rank {slow.rank} spends {mine_ms:.2f} ms {unit} on {CAUSES[cause]}, the other "
        f"ranks {theirs_ms:.2f} ms (median)",
    ]
    return [{
        "rank": slow.rank, "cause": cause, "collectives": len(names), "last_at": int(cols.sum()),
        "late_ms": float(np.mean(lateness)) / 1000, "waited_ms": waited_ms, "wait_share_pct": share,
        "wait_pct": wait_pct, "cause_ms": mine_ms, "others_cause_ms": theirs_ms, "unit": unit,
        "clock_offset_ms": {str(ranks[i].rank): float(offset[i]) / 1000 for i in range(len(ranks))},
        "evidence": evidence,
    }], None  # fmt: skip
