"""Merge the per-rank summaries of one run into one, and name the straggler.

Pure functions over RunSummary: no collectives, so a rank that died cannot make merging hang — its file is
simply missing, and the merged summary says so.

Merged figures: each phase statistic is the mean over ranks of that rank's statistic (p95 is the largest rank's
p95); cluster samples/s is the sum over ranks; steps/s is the slowest rank's. ``cluster.phases`` gives each
phase's per-rank mean as min/mean/max. The straggler is found in the phase whose per-rank means spread most:
the rank with the largest mean there, by how much it exceeds the median rank. A spread under ``STRAGGLER_MIN``
of the step (or under 0.1 ms) is noise, and no straggler is named.
"""

from __future__ import annotations

import dataclasses
import statistics

from stepscope.record import TOTAL
from stepscope.summary import Cluster, Exit, PhaseStats, RunSummary, Steps, Straggler, Throughput

STRAGGLER_MIN = 0.05
EXIT_SEVERITY = ("finished", "stopped", "running", "interrupted", "terminated", "error")


def _rank(summary: RunSummary) -> int:
    return summary.meta.rank if summary.meta.rank is not None else 0


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def _merge_phase(stats: list[PhaseStats]) -> PhaseStats:
    return PhaseStats(
        mean_ms=statistics.fmean(s.mean_ms for s in stats),
        median_ms=statistics.fmean(s.median_ms for s in stats),
        p95_ms=max(s.p95_ms for s in stats),
        share=statistics.fmean(s.share for s in stats),
        steps=min(s.steps for s in stats),
        nested=any(s.nested for s in stats),
        device_mean_ms=_mean([s.device_mean_ms for s in stats]),
        device_median_ms=_mean([s.device_median_ms for s in stats]),
        device_p95_ms=max((s.device_p95_ms for s in stats if s.device_p95_ms is not None), default=None),
        device_share=_mean([s.device_share for s in stats]),
    )


def find_straggler(ranks: list[RunSummary]) -> Straggler | None:
    """The rank that is slow and the phase that makes it slow, or None when the ranks are even."""
    measured = [r for r in ranks if TOTAL in r.phases]
    if len(measured) < 2:
        return None
    step_ms = statistics.fmean(r.phases[TOTAL].mean_ms for r in measured)
    names = {name for r in measured for name in r.phases if name != TOTAL}
    best: tuple[float, str] | None = None
    for name in sorted(names):
        values = [r.phases[name].mean_ms if name in r.phases else 0.0 for r in measured]
        spread = max(values) - min(values)
        if best is None or spread > best[0]:
            best = (spread, name)
    if best is None or best[0] < max(STRAGGLER_MIN * step_ms, 0.1):
        return None
    phase = best[1]
    values = [r.phases[phase].mean_ms if phase in r.phases else 0.0 for r in measured]
    slowest = max(range(len(measured)), key=lambda i: values[i])
    return Straggler(rank=_rank(measured[slowest]), phase=phase, excess_ms=values[slowest] - statistics.median(values))


def merge(ranks: list[RunSummary], expected_world: int | None = None) -> RunSummary:
    """One summary for the run: per-rank summaries in ``ranks``, cluster figures in ``cluster``."""
    if not ranks:
        raise ValueError("no rank summaries to merge")
    ranks = sorted(ranks, key=_rank)
    if len(ranks) == 1 and (expected_world or 1) == 1:
        return ranks[0]
    first = ranks[0]
    world = expected_world or max((r.meta.world_size or 0 for r in ranks), default=0) or len(ranks)
    names: list[str] = []
    for r in ranks:
        names += [n for n in r.phases if n not in names]
    phases = {n: _merge_phase([r.phases[n] for r in ranks if n in r.phases]) for n in names}
    rates = [r.throughput.samples_per_s for r in ranks]
    step_rates = [r.throughput.steps_per_s for r in ranks if r.throughput.steps_per_s is not None]
    step_times = [r.throughput.step_time_ms for r in ranks if r.throughput.step_time_ms is not None]
    cluster_rate = sum(x for x in rates if x is not None) if any(x is not None for x in rates) else None
    cluster = Cluster(
        world_size=world,
        ranks_reported=[_rank(r) for r in ranks],
        samples_per_s=cluster_rate,
        phases={
            n: {
                "min_ms": min(v),
                "mean_ms": statistics.fmean(v),
                "max_ms": max(v),
            }
            for n in names
            for v in [[r.phases[n].mean_ms for r in ranks if n in r.phases]]
        },
        straggler=find_straggler(ranks),
    )
    notes = [f"rank {_rank(r)}: {note}" for r in ranks for note in r.notes]
    missing = sorted(set(range(world)) - set(cluster.ranks_reported))
    if missing:
        notes.append(
            f"rank(s) {', '.join(map(str, missing))} wrote no summary (the process died or was killed before "
            "it could); the figures are from the other ranks."
        )
    exits = [r.exit or Exit() for r in ranks]
    worst = max(exits, key=lambda e: EXIT_SEVERITY.index(e.reason) if e.reason in EXIT_SEVERITY else 0)
    meta = dataclasses.replace(first.meta, rank=None, local_rank=None, world_size=world)
    return RunSummary(
        steps=Steps(
            warmup=max(r.steps.warmup for r in ranks),
            measured=min(r.steps.measured for r in ranks),
            boundary=first.steps.boundary,
        ),
        phases=phases,
        throughput=Throughput(
            steps_per_s=min(step_rates) if step_rates else None,
            samples_per_s=cluster_rate,
            step_time_ms=max(step_times) if step_times else None,
        ),
        meta=meta,
        notes=notes,
        ranks=ranks,
        loaders=first.loaders,
        epochs=first.epochs,
        counters=first.counters,
        exit=worst,
        cluster=cluster,
    )
