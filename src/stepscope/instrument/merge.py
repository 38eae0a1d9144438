"""Merge the per-rank summaries of one run into one, and name the straggler.

Pure functions over RunSummary: no collectives, so a rank that died cannot make merging hang — its file is
simply missing, and the merged summary says so.

Merged figures: each phase's time per measured step is the mean over ranks (``_merge_phase``; p95 is the largest
rank's p95). A synchronous job's rates are the job's (``job_throughput``): every rank's samples per step over the
slowest rank's step, and over the slowest rank's wall time per step, never a sum of per-rank rates that each leave
out different things; ranks that wait for nobody (no collectives) add their rates up. Loaders, counters and runtime
facts are the lowest rank's; ``system`` holds every rank's signals (each rank keeps its own system figures).
``cluster.phases`` gives each phase's per-rank mean as min/mean/max. ``find_straggler`` names the rank that holds
the others up, and the ranks that wait for it in collectives. ``first_failure`` names the rank whose failure came
first in time (the cause; the others' errors, a peer's closed connection or a collective's timeout, follow from it).
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
from typing import Any

from stepscope.invariants import synchronous
from stepscope.record import TOTAL, phase_order
from stepscope.summary import Cluster, Exit, PhaseStats, RunSummary, Steps, Straggler, Throughput

STRAGGLER_MIN = 0.05
VALIDATION_WAIT_MIN = 0.02  # of a rank's step time: a smaller wait for other ranks' validation stays in its steps
STRAGGLER_SHARE = 0.5  # of the largest difference between ranks: a phase that differs less is not the cause
COMMS = "comms"
EXIT_SEVERITY = ("finished", "stopped", "running", "interrupted", "terminated", "killed", "error")
FAILED = ("running", "interrupted", "terminated", "killed", "error")  # running: only a checkpoint survived


def _rank(summary: RunSummary) -> int:
    return summary.meta.rank if summary.meta.rank is not None else 0


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def _merge_phase(ranks: list[RunSummary], name: str, measured: int) -> PhaseStats:
    """One phase of the job: its time per measured step is the mean of the ranks' (a rank that did not run it adds
    0), over the steps in which any rank ran it. A phase that ran in 8 steps of
    one rank and 1 of the other (a cycled loader's first pass) is not the mean of the two means over 1 step: the
    job's phases add up to its step."""
    stats = [r.phases[name] for r in ranks if name in r.phases]
    per_step_ms = statistics.fmean(
        r.phases[name].mean_ms * r.phases[name].steps / max(r.steps.measured, 1) if name in r.phases else 0.0
        for r in ranks
    )
    steps = min(max(s.steps for s in stats), measured) or 1
    return PhaseStats(
        mean_ms=per_step_ms * max(measured, 1) / steps,
        median_ms=statistics.fmean(s.median_ms for s in stats),
        p95_ms=max(s.p95_ms for s in stats),
        share=statistics.fmean(r.phases[name].share if name in r.phases else 0.0 for r in ranks),
        steps=steps,
        nested=any(s.nested for s in stats),
        device_mean_ms=_mean([s.device_mean_ms for s in stats]),
        device_median_ms=_mean([s.device_median_ms for s in stats]),
        device_p95_ms=max((s.device_p95_ms for s in stats if s.device_p95_ms is not None), default=None),
        device_share=_mean([s.device_share for s in stats]),
        device_host_paced=_mean([s.device_host_paced for s in stats]),
    )


def phase_ms(summary: RunSummary, name: str) -> float:
    """A phase's time per measured step (ms; 0 when it did not run): GPU time for work launched on a CUDA-timed
    run, where the host only sees launches (and, for ``comms`` on NCCL, the compute stream's wait for the
    all-reduce), host time for the wait for data. A phase that ran in some steps only is spread over all of them
    (its ``mean_ms`` is over its own steps): a rank that reads its loss every 10 steps is not 9 ms slower in
    ``sync`` than one that reads it every step for 1 ms."""
    stats = summary.phases.get(name)
    if stats is None:
        return 0.0
    total = summary.phases.get(TOTAL)
    spread = stats.steps / total.steps if total is not None and total.steps else 1.0
    if summary.meta.timing == "cuda" and name != "data_wait" and stats.device_mean_ms is not None:
        return stats.device_mean_ms * spread
    return stats.mean_ms * spread


def find_straggler(ranks: list[RunSummary]) -> Straggler | None:
    """The rank that holds the others up and the phase where it does, or None when the ranks are even.

    In synchronous training every rank waits for the slowest at the next collective (DDP's all-reduce at the end
    of backward, an explicit all_reduce), so the fast ranks show the same excess later in the step, as ``comms``.
    The cause is therefore the earliest phase in step order, other than ``comms`` (the waiting itself), where the
    ranks differ by more than ``STRAGGLER_MIN`` of the step (and 0.1 ms) and by at least ``STRAGGLER_SHARE`` of the
    largest such difference: a later phase where the fast ranks wait (a backward holding DDP's all-reduce when
    comms is not split out) differs by no more than its cause, while a busy machine stretching one rank's loading by
    2 ms must not be named over a 10 ms forward on the other. The straggler is the slowest rank in that phase, and
    its excess is measured against the median of the other ranks. The waiting ranks are those whose
    comms time per step exceeds the straggler's own by that same margin (the straggler pays the collectives' own
    cost too, but waits for nobody).
    """
    measured = [r for r in ranks if TOTAL in r.phases]
    if len(measured) < 2:
        return None
    step_ms = statistics.fmean(r.phases[TOTAL].mean_ms for r in measured)
    margin = max(STRAGGLER_MIN * step_ms, 0.1)
    names: list[str] = []
    for r in measured:
        names += [n for n in r.phases if n not in names and n not in (TOTAL, COMMS) and not r.phases[n].nested]
    spreads = {name: [phase_ms(r, name) for r in measured] for name in phase_order(names)}
    widest = max((max(v) - min(v) for v in spreads.values()), default=0.0)
    for name, values in spreads.items():
        if max(values) - min(values) >= max(margin, STRAGGLER_SHARE * widest):
            slowest = max(range(len(measured)), key=lambda i: values[i])
            others = values[:slowest] + values[slowest + 1 :]
            straggler = Straggler(
                rank=_rank(measured[slowest]), phase=name, excess_ms=values[slowest] - statistics.median(others)
            )
            if any(COMMS in r.phases for r in measured):
                own = phase_ms(measured[slowest], COMMS)
                waiting = {_rank(r): phase_ms(r, COMMS) for r in measured if phase_ms(r, COMMS) - own >= margin}
                waiting.pop(straggler.rank, None)
                straggler.own_comms_ms = own
                straggler.waiting_ranks = sorted(waiting)
                straggler.wait_ms = statistics.median(waiting.values()) if waiting else None
            return straggler
    return None


def _failure(summary: RunSummary) -> tuple[bool, float, int] | None:
    """How a rank failed, as a sort key, or None when it did not: (whether it waited in a collective, when its
    failure began in Unix seconds — the last step before a stall, else the error or signal —, steps measured)."""
    end = summary.exit
    if end is None:
        return None
    hung = end.hung
    if hung is None and end.reason not in FAILED:
        return None
    times = [t for t in (hung.get("since") if hung else None, end.at) if isinstance(t, (int, float))]
    waiting = bool(hung and hung.get("collective"))
    return waiting, min(times, default=math.inf), summary.steps.measured


def first_failure(ranks: list[RunSummary]) -> RunSummary | None:
    """The rank whose failure is the cause: the first in time. A rank stalled in a collective waits for another rank,
    so it comes after every rank that failed otherwise (stalled elsewhere, raised, was killed); among equals the
    earlier failure, then the rank that measured fewer steps (it stopped first). None when no rank failed."""
    failed = [(key, _rank(r), r) for r in ranks if (key := _failure(r)) is not None]
    return min(failed, key=lambda found: found[:2])[2] if failed else None


def describe_failure(summary: RunSummary) -> str:
    """A rank's failure in words: ``rank 1 hung in all_reduce at train.py:42 after 12 steps`` or ``rank 1:
    RuntimeError: ...``."""
    end = summary.exit or Exit()
    hung = end.hung
    if hung is None:
        return f"rank {_rank(summary)}: {end.error or end.reason}"
    text = f"rank {_rank(summary)} hung"
    if hung.get("calls"):
        text += f" in {hung['calls']}"
    if hung.get("where"):
        file, _, line = str(hung["where"]).rpartition(":")
        text += f" at {os.path.basename(file)}:{line}"
        if hung.get("code"):
            text += f" ({hung['code']})"
    if hung.get("steps") is not None:
        text += f" after {hung['steps']} steps"
    return text


def _failure_exit(ranks: list[RunSummary], exits: list[Exit]) -> tuple[Exit, list[str]]:
    """The merged exit (the most severe reason; the error, time and rank of the first failure) and a note per
    failure that followed it."""
    worst = max(exits, key=lambda e: EXIT_SEVERITY.index(e.reason) if e.reason in EXIT_SEVERITY else 0)
    cause = first_failure(ranks)
    if cause is None:
        return worst, []
    end = cause.exit or Exit()
    merged = dataclasses.replace(worst, error=describe_failure(cause), at=end.at, hung=end.hung)
    merged.cause_rank = _rank(cause)
    notes = []
    if end.hung is not None and end.hung.get("stack"):
        notes.append(f"{describe_failure(cause)}; its stack, innermost first: {' < '.join(end.hung['stack'])}")
    cause_at = _failure(cause)[1]  # type: ignore[index]
    for r in ranks:
        key = _failure(r)
        if r is cause or key is None:
            continue
        later = f" {key[1] - cause_at:.1f} s later" if math.isfinite(key[1]) and math.isfinite(cause_at) else ""
        notes.append(f"{describe_failure(r)} (followed rank {_rank(cause)}'s failure{later})")
    return merged, notes


def _rank_signals(ranks: list[RunSummary]) -> list[dict[str, str]]:
    """Every rank's system signals (launch-bound, transform-bound, ...), each evidence naming its rank; the full
    system figures stay in each rank's summary."""
    return [
        {"id": signal["id"], "evidence": f"rank {_rank(r)}: {signal.get('evidence', '')}"}
        for r in ranks
        for signal in r.system.get("signals", [])
    ]


def _hotspots(ranks: list[RunSummary], straggler: Straggler | None) -> dict[str, Any]:
    """The source lines of the rank the others wait for (the straggler, else the lowest rank), with its ``rank``;
    every rank's own stay in its summary under ``ranks``."""
    chosen = next((r for r in ranks if straggler is not None and _rank(r) == straggler.rank), ranks[0])
    return {**chosen.hotspots, "rank": _rank(chosen)} if chosen.hotspots else {}


def node_table(ranks: list[RunSummary]) -> list[dict[str, Any]]:
    """One row per node, in rank order, when the ranks ran on more than one (else []): its ranks, their summed
    samples/s, their mean step time and mean ``comms`` time (ms; None without that phase). In synchronous training
    every node's step is the job's step; a node whose ranks wait less in collectives than the others' is the one
    they wait for."""
    by_node: dict[str, list[RunSummary]] = {}
    for r in ranks:
        by_node.setdefault(r.meta.node, []).append(r)
    if len(by_node) < 2:
        return []
    rows = []
    for node, members in by_node.items():
        steps = [r.phases[TOTAL].mean_ms for r in members if TOTAL in r.phases]
        rates = [r.throughput.samples_per_s for r in members if r.throughput.samples_per_s is not None]
        comms = [phase_ms(r, COMMS) for r in members if COMMS in r.phases]
        rows.append(
            {
                "node": node,
                "ranks": [_rank(r) for r in members],
                "samples_per_s": sum(rates) if rates else None,
                "step_ms": statistics.fmean(steps) if steps else None,
                "comms_ms": statistics.fmean(comms) if comms else None,
            }
        )
    return sorted(rows, key=lambda row: min(row["ranks"]))


def _missing_note(ranks: list[RunSummary], missing: list[int]) -> str:
    listed = ", ".join(map(str, missing))
    if len({r.meta.node for r in ranks}) == 1 and ranks[0].meta.node_rank is not None:
        # One node of a multi-node job: the other nodes' ranks are elsewhere, not dead.
        return (
            f"rank(s) {listed} are not in this summary: they ran on the job's other nodes (or died before writing). "
            "Its cluster figures are this node's; `stepscope merge` of every node's summary gives the job's."
        )
    return (
        f"rank(s) {listed} wrote no summary (the process died or was killed before it could); the figures are from "
        "the other ranks."
    )


def job_throughput(ranks: list[RunSummary]) -> Throughput:
    """The job's rates from its ranks. Synchronous: the step rate is one over the slowest rank's mean step and the
    wall rate one over the slowest rank's wall time per step (the job's clock), each times every rank's samples per
    step. Otherwise (ranks that do not wait for each other) the ranks' rates add up."""
    timed = [r for r in ranks if r.throughput.step_time_ms]
    if not timed:
        return Throughput()
    batches = [r.throughput.samples_per_s / r.throughput.steps_per_s for r in timed if _sampled(r)]
    walls = [r.wall.window_s / r.steps.measured for r in timed if r.wall and r.wall.window_s > 0 and r.steps.measured]
    step_ms = max(r.throughput.step_time_ms or 0.0 for r in timed)
    if synchronous(timed):
        steps_per_s = 1e3 / step_ms
        wall_steps = 1.0 / max(walls) if len(walls) == len(timed) else None
        return Throughput(
            steps_per_s=steps_per_s,
            samples_per_s=sum(batches) * steps_per_s if batches else None,
            wall_steps_per_s=wall_steps,
            wall_samples_per_s=sum(batches) * wall_steps if batches and wall_steps else None,
            step_time_ms=step_ms,
        )
    rates = [r.throughput.samples_per_s for r in timed if r.throughput.samples_per_s is not None]
    wall_rates = [r.throughput.wall_samples_per_s for r in timed if r.throughput.wall_samples_per_s is not None]
    wall_steps_list = [r.throughput.wall_steps_per_s for r in timed if r.throughput.wall_steps_per_s is not None]
    return Throughput(
        steps_per_s=min(r.throughput.steps_per_s or math.inf for r in timed),
        samples_per_s=sum(rates) if rates else None,
        wall_steps_per_s=min(wall_steps_list) if len(wall_steps_list) == len(timed) else None,
        wall_samples_per_s=sum(wall_rates) if len(wall_rates) == len(rates) and wall_rates else None,
        step_time_ms=step_ms,
    )


def _clock_rank(ranks: list[RunSummary]) -> RunSummary | None:
    """The rank with the longest wall time per step: its window is the job's clock."""
    timed = [r for r in ranks if r.wall is not None and r.steps.measured]
    return max(timed, key=lambda r: r.wall.window_s / r.steps.measured) if timed else None  # type: ignore[union-attr]


def _job_eval(ranks: list[RunSummary], clock: RunSummary | None) -> dict[str, Any]:
    """The job's validation passes: those of ``clock``, the rank whose window is the job's clock, else of the lowest
    rank that validated ({} when none did; every rank keeps its own)."""
    chosen = clock if clock is not None and clock.eval else next((r for r in ranks if r.eval), None)
    return {**chosen.eval, "rank": _rank(chosen)} if chosen is not None else {}


def _comms_s(summary: RunSummary) -> float:
    """A rank's host time in collectives over its measured steps (s)."""
    comms = summary.phases.get(COMMS)
    return comms.mean_ms * comms.steps / 1e3 if comms is not None else 0.0


def _unusual_comms_s(summary: RunSummary) -> float:
    """A rank's host time in collectives beyond its usual step's (the median's), over its measured steps (s): what
    waits that fell in a few steps added. Where the summaries do not say in which steps the passes fell."""
    comms = summary.phases.get(COMMS)
    return max(0.0, comms.mean_ms - comms.median_ms) * comms.steps / 1e3 if comms is not None else 0.0


def _waits_in_pass_steps(summary: RunSummary, validating: RunSummary) -> float | None:
    """How much longer ``summary``'s steps were than its usual step (the median of the others) in the steps where
    ``validating``'s passes fell (s), from both step series; None where they cannot say (no pass steps, series of
    different strides). Measured per step: noise in other steps, a straggler's excess that overlaps the
    validation, waits for a straggler every step, none of them is taken for a wait for validation."""
    mine, theirs = summary.series, validating.series
    pass_steps = (validating.eval or {}).get("steps") or []
    if mine is None or theirs is None or not pass_steps or mine.stride != theirs.stride:
        return None
    points = {step // mine.stride for step in pass_steps}
    usual = [ms for at, ms in enumerate(mine.step_ms) if at not in points]
    if not usual:
        return None
    median_ms = statistics.median(usual)
    excess_ms = sum(max(0.0, mine.step_ms[at] - median_ms) for at in points if at < len(mine.step_ms))
    return excess_ms * mine.stride / 1e3


def validation_waits(ranks: list[RunSummary]) -> list[RunSummary]:
    """A synchronous job's ranks, each with the time it waited in collectives for another rank's validation moved
    out of its steps into its validation time (``wall.eval_s``), with a note.

    Validation is cut out of the steps of the rank that runs it (passes in at most half its steps); a rank that
    validates less (rank 0 alone validates, or holds more batches) waits for the difference in its next step's
    collective, and that wait is the job's validation, not its step. The wait is measured in the steps where the
    passes fell: how much longer the rank's steps were there than its usual step (``_waits_in_pass_steps``), at
    most its time in collectives and at most the difference in validation time. Not the rank's collectives beyond
    the least any rank spent in them: a straggler spends least, and waits for the other's validation all the same
    where the validation outlasts its excess; a rank that waits for a validating straggler every step would have
    those waits taken for validation. Summaries that do not say where the passes fell fall back on the rank's
    collectives beyond its usual step's (the median's), which noise in other steps makes err either way. Without
    this, a job whose rank 0 alone validates reads the others' waits as its step: the step rate ~half the truth,
    and a straggler in whatever rank 0's steps do most.
    Host time in ``comms`` only: where the host does not block in the collective (NCCL), the wait shows in the
    phase that next waits for the GPU, and stays there."""
    timed = [r for r in ranks if r.wall is not None and r.steps.measured and TOTAL in r.phases]
    if len(timed) < 2 or not synchronous(timed):
        return ranks
    validating = max(timed, key=lambda r: r.wall.eval_s)  # type: ignore[union-attr]
    passes = (validating.eval or {}).get("passes") or 0
    if not 0 < passes <= validating.steps.measured / 2:
        # Validation recurs now and then. A stretch cut out of most steps is one the recurrence rule missed (issue
        # 24's side work): nothing says the other ranks wait for a validation.
        return ranks
    out = []
    for r in ranks:
        wait_s = 0.0
        if r in timed and r is not validating:
            measured = _waits_in_pass_steps(r, validating)
            waited = min(measured, _comms_s(r)) if measured is not None else _unusual_comms_s(r)
            wait_s = min(validating.wall.eval_s - r.wall.eval_s, waited)  # type: ignore[union-attr]
        if wait_s <= VALIDATION_WAIT_MIN * r.wall.steps_s:  # type: ignore[union-attr]
            out.append(r)
            continue
        out.append(_without_wait(r, wait_s, _rank(validating)))
    return out


def _without_wait(summary: RunSummary, wait_s: float, validating: int) -> RunSummary:
    """``summary`` with ``wait_s`` of its ``comms`` (waiting for rank ``validating``'s validation) out of its
    steps and in its validation time. Means and shares move exactly; a phase's median and p95 stay as measured
    (the wait fell in a few steps, which the percentiles cannot be corrected for without them)."""
    measured = summary.steps.measured
    wait_ms = wait_s * 1e3 / measured  # per measured step
    total = summary.phases[TOTAL]
    step_ms = total.mean_ms - wait_ms
    scale = total.mean_ms / step_ms
    phases = {}
    for name, stats in summary.phases.items():
        moved = dataclasses.replace(
            stats,
            share=stats.share * scale,
            device_share=stats.device_share * scale if stats.device_share is not None else None,
        )
        if name == COMMS:
            moved.mean_ms -= wait_s * 1e3 / stats.steps
            moved.share = (stats.share * total.mean_ms - wait_ms) / step_ms
        elif name == TOTAL:
            moved.mean_ms, moved.share = step_ms, 1.0
        phases[name] = moved
    rates = summary.throughput
    throughput = dataclasses.replace(
        rates,
        steps_per_s=1e3 / step_ms,
        samples_per_s=rates.samples_per_s * scale if rates.samples_per_s is not None else None,
        step_time_ms=step_ms,
    )
    wall = dataclasses.replace(
        summary.wall,  # type: ignore[arg-type]
        steps_s=summary.wall.steps_s - wait_s,  # type: ignore[union-attr]
        eval_s=summary.wall.eval_s + wait_s,  # type: ignore[union-attr]
    )
    note = (
        f"waited {wait_ms:.1f} ms a step ({wait_s:.2f} s in all) in collectives for rank {validating}'s "
        "validation, which it ran longer: counted as validation time, not step time"
    )
    return dataclasses.replace(summary, phases=phases, throughput=throughput, wall=wall, notes=[*summary.notes, note])


def _sampled(summary: RunSummary) -> bool:
    return bool(summary.throughput.samples_per_s and summary.throughput.steps_per_s)


def merge(ranks: list[RunSummary], expected_world: int | None = None) -> RunSummary:
    """One summary for the run: per-rank summaries in ``ranks``, cluster figures in ``cluster``."""
    if not ranks:
        raise ValueError("no rank summaries to merge")
    ranks = sorted(ranks, key=_rank)
    if len(ranks) == 1 and (expected_world or 1) == 1:
        return ranks[0]
    ranks = validation_waits(ranks)
    first = ranks[0]
    world = expected_world or max((r.meta.world_size or 0 for r in ranks), default=0) or len(ranks)
    names: list[str] = []
    for r in ranks:
        names += [n for n in r.phases if n not in names]
    measured = min(r.steps.measured for r in ranks)
    phases = {n: _merge_phase(ranks, n, measured) for n in names}
    throughput = job_throughput(ranks)
    clock = _clock_rank(ranks)
    cluster = Cluster(
        world_size=world,
        ranks_reported=[_rank(r) for r in ranks],
        samples_per_s=throughput.samples_per_s,
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
        missing_ranks=sorted(set(range(world)) - {_rank(r) for r in ranks}),
        nodes=node_table(ranks),
    )
    if cluster.straggler is not None and cluster.nodes:
        cluster.straggler.node = next(r.meta.node for r in ranks if _rank(r) == cluster.straggler.rank)
    notes = [f"rank {_rank(r)}: {note}" for r in ranks for note in r.notes]
    if cluster.missing_ranks:
        notes.append(_missing_note(ranks, cluster.missing_ranks))
    exits = [r.exit or Exit() for r in ranks]
    worst, failure_notes = _failure_exit(ranks, exits)
    notes += failure_notes
    if worst.hung is not None and cluster.straggler is not None and cluster.straggler.rank != worst.cause_rank:
        # The ranks that waited for a hung rank are not its stragglers: the job's problem is the hang.
        cluster.straggler = None
    one_node = not cluster.nodes
    meta = dataclasses.replace(
        first.meta,
        rank=None,
        local_rank=None,
        world_size=world,
        pid=None,
        hostname=first.meta.hostname if one_node else f"{len(cluster.nodes)} nodes",
        node_rank=first.meta.node_rank if one_node else None,
        launch_id=first.meta.launch_id if len({r.meta.launch_id for r in ranks}) == 1 else None,
    )
    return RunSummary(
        steps=Steps(
            warmup=max(r.steps.warmup for r in ranks),
            measured=measured,
            profiled=max(r.steps.profiled for r in ranks),
            boundary=first.steps.boundary,
        ),
        phases=phases,
        throughput=throughput,
        wall=clock.wall if clock is not None else None,
        eval=_job_eval(ranks, clock),
        # the job pays the costliest rank's share: a synchronous job runs at its slowest rank's pace
        overhead=max(
            (r.overhead for r in ranks if r.overhead is not None and r.overhead.share is not None),
            key=lambda o: o.share or 0.0,
            default=None,
        ),
        meta=meta,
        notes=notes,
        ranks=ranks,
        loaders=first.loaders,
        epochs=first.epochs,
        counters=first.counters,
        facts=first.facts,
        applied=first.applied,
        system={"signals": _rank_signals(ranks)},
        hotspots=_hotspots(ranks, cluster.straggler),
        exit=worst,
        cluster=cluster,
    )
