"""Merge the per-rank summaries of one run into one, and name the straggler.

Pure functions over RunSummary: no collectives, so a rank that died cannot make merging hang — its file is
simply missing, and the merged summary says so.

Merged figures: each phase statistic is the mean over ranks of that rank's statistic (p95 is the largest rank's
p95); cluster samples/s is the sum over ranks; steps/s is the slowest rank's. Loaders, counters and runtime facts
are the lowest rank's; ``system`` holds every rank's signals (each rank keeps its own system figures).
``cluster.phases`` gives each phase's per-rank mean as min/mean/max. ``find_straggler`` names the rank that holds
the others up.
"""

from __future__ import annotations

import dataclasses
import statistics

from stepscope.record import TOTAL, phase_order
from stepscope.summary import Cluster, Exit, PhaseStats, RunSummary, Steps, Straggler, Throughput

STRAGGLER_MIN = 0.05
EXIT_SEVERITY = ("finished", "stopped", "running", "interrupted", "terminated", "killed", "error")


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
    """The rank that holds the others up and the phase where it does, or None when the ranks are even.

    In synchronous training every rank waits for the slowest at the next collective (DDP's all-reduce inside
    backward, an explicit all_reduce), so the fast ranks show the same excess later in the step, as waiting.
    The cause is therefore the earliest phase, in step order, where the ranks differ by more than
    ``STRAGGLER_MIN`` of the step (and 0.1 ms); the straggler is the slowest rank in that phase, and its excess is
    measured against the median of the other ranks.
    """
    measured = [r for r in ranks if TOTAL in r.phases]
    if len(measured) < 2:
        return None
    step_ms = statistics.fmean(r.phases[TOTAL].mean_ms for r in measured)
    names: list[str] = []
    for r in measured:
        names += [n for n in r.phases if n not in names and n != TOTAL and not r.phases[n].nested]
    for name in phase_order(names):
        values = [r.phases[name].mean_ms if name in r.phases else 0.0 for r in measured]
        if max(values) - min(values) >= max(STRAGGLER_MIN * step_ms, 0.1):
            slowest = max(range(len(measured)), key=lambda i: values[i])
            others = values[:slowest] + values[slowest + 1 :]
            return Straggler(
                rank=_rank(measured[slowest]), phase=name, excess_ms=values[slowest] - statistics.median(others)
            )
    return None


def _rank_signals(ranks: list[RunSummary]) -> list[dict[str, str]]:
    """Every rank's system signals (launch-bound, transform-bound, ...), each evidence naming its rank; the full
    system figures stay in each rank's summary."""
    return [
        {"id": signal["id"], "evidence": f"rank {_rank(r)}: {signal.get('evidence', '')}"}
        for r in ranks
        for signal in r.system.get("signals", [])
    ]


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
            profiled=max(r.steps.profiled for r in ranks),
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
        facts=first.facts,
        system={"signals": _rank_signals(ranks)},
        exit=worst,
        cluster=cluster,
    )
