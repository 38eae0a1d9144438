"""Verdict v1: which part of the step is the bottleneck, from the measured phase shares.

The phases fall into groups — data (``data_wait``, ``h2d``), compute (``forward``, ``backward``), optimizer
(``optimizer``, ``zero_grad``, ``clip``) and host (``sync``, ``other``: Python between phases and host syncs).
The group with the largest share of step time is the bound when it holds at least ``MIN_SHARE`` of the step;
confidence is high from ``HIGH_SHARE`` on. When no group reaches ``MIN_SHARE`` the step is ``balanced``.

With CUDA timing the host clock only sees kernel launches, so compute and optimizer use the phases' GPU time,
and host is the time the GPU was given nothing to do that was not spent waiting for data. Fewer than
``MIN_STEPS`` measured steps give ``unknown``: too little evidence.

The shares are then checked against what else was measured (``refine``): allocator retries make the verdict
``memory``; GPU utilisation that reads high while the SM clock or power is low turns ``compute`` into ``host``
(a trickle of tiny kernels); the loader workers' CPU says whether a data-bound step is transform- or IO-bound.
"""

from __future__ import annotations

from stepscope.doctor.facts import oversubscribed_threads
from stepscope.record import GROUPS, TOTAL
from stepscope.summary import PhaseStats, RunSummary, Verdict

MIN_STEPS = 3
MIN_SHARE = 0.40
HIGH_SHARE = 0.60
EXPLAINED = 1.25  # ceiling/training ratio up to 1.25x of 1/data_share: the loader's speed explains the wait
UNEXPLAINED = 1.5  # above 1.5x of it, while waiting for data: something else slows the loader inside training
MIN_RETRY_RATE = 0.05  # allocator retries per measured step from which memory pressure is the verdict


def _host_share(phases: dict[str, PhaseStats], name: str) -> float:
    stats = phases.get(name)
    return 0.0 if stats is None or stats.nested else stats.share


def _device_share(phases: dict[str, PhaseStats], name: str) -> float:
    stats = phases.get(name)
    return 0.0 if stats is None or stats.nested or stats.device_share is None else stats.device_share


def group_shares(summary: RunSummary) -> dict[str, float]:
    """Share of step time (0..1) per group, from host time, or GPU time where CUDA-timed."""
    phases = summary.phases
    data = sum(_host_share(phases, p) for p in GROUPS["data"])
    if summary.meta.timing != "cuda":
        shares = {group: sum(_host_share(phases, p) for p in names) for group, names in GROUPS.items()}
        shares["data"] = data
        return shares
    compute = sum(_device_share(phases, p) for p in GROUPS["compute"])
    optimizer = sum(_device_share(phases, p) for p in GROUPS["optimizer"])
    gpu_busy = sum(_device_share(phases, name) for name in phases if name != TOTAL and name not in GROUPS["data"])
    return {"data": data, "compute": compute, "optimizer": optimizer, "host": max(0.0, 1.0 - gpu_busy - data)}


def _evidence(summary: RunSummary, group: str, share: float) -> list[str]:
    phases = summary.phases
    total_ms = phases[TOTAL].mean_ms
    cuda = summary.meta.timing == "cuda" and group in ("compute", "optimizer")
    lines = []
    for name in GROUPS[group]:
        stats = phases.get(name)
        if stats is None or stats.nested:
            continue
        ms = stats.device_mean_ms if cuda and stats.device_mean_ms is not None else stats.mean_ms
        part = _device_share(phases, name) if cuda else stats.share
        if part >= 0.05:
            clock = "GPU time" if cuda else "of the step"
            lines.append(f"{name} is {100 * part:.0f}% {clock} ({ms:.1f} ms of a {total_ms:.1f} ms step)")
    if group == "host" and summary.meta.timing == "cuda":
        lines.append(f"the GPU had no work for {100 * share:.0f}% of the step outside data waits")
    syncs = summary.counters.get("host_syncs", 0.0)
    if group == "host" and syncs >= 1:
        lines.append(f"{syncs:.1f} host-device syncs per step")
    if not lines:
        lines.append(f"{group} phases together are {100 * share:.0f}% of the step")
    return lines


def pipeline_verdict(summary: RunSummary) -> Verdict | None:
    """An inference→training pipeline's bound (``summary.pipeline``, from a PipelineMonitor) when one side starves
    the other: it outranks the phase shares, in which a trainer starved by its engines reads as data-bound. Its
    evidence already says what dominates a training step, with the dispatch wait taken out. None when balanced or
    unknown."""
    pipeline = summary.pipeline
    bound = pipeline.get("bottleneck")
    if bound not in ("inference", "training"):
        return None
    return Verdict(bound, pipeline.get("confidence", "low"), list(pipeline.get("evidence", [])))


def classify(summary: RunSummary) -> Verdict:
    """The bound, confidence and evidence for a summary: the pipeline's bound when a PipelineMonitor found one
    side starving the other, else the phases' (see the module docstring for the rules)."""
    return pipeline_verdict(summary) or classify_phases(summary)


def classify_phases(summary: RunSummary) -> Verdict:
    """The bound, confidence and evidence for a summary's phases."""
    measured = summary.steps.measured
    if measured < MIN_STEPS or TOTAL not in summary.phases:
        return Verdict("unknown", "low", [f"only {measured} measured step(s); at least {MIN_STEPS} are needed"])
    shares = group_shares(summary)
    group, share = max(shares.items(), key=lambda item: item[1])
    if share < MIN_SHARE:
        parts = ", ".join(f"{g} {100 * s:.0f}%" for g, s in sorted(shares.items(), key=lambda i: -i[1]))
        return Verdict("balanced", "medium", [f"no part of the step reaches {100 * MIN_SHARE:.0f}%: {parts}"])
    confidence = "high" if share >= HIGH_SHARE else "medium"
    return refine(summary, Verdict(group, confidence, _evidence(summary, group, share)))


def _ceiling_evidence(summary: RunSummary, against: dict) -> list[str]:
    """What the loader's ceiling says next to the training rate.

    A loader whose batches are fetched in turn with the step (no workers, or workers that cannot get ahead) gives
    a ceiling of about 1/d times the training rate, d being the data_wait share: that ratio means the loader's own
    speed explains the wait. A ceiling far above it while the step waits for data means something else makes the
    loader slow inside training (workers restarted each epoch, CPUs shared with the training process)."""
    ratio = against["headroom"]
    if against["input_bound"]:
        return [
            f"the loader alone delivers {against['loader_ceiling']:.1f} samples/s, only {ratio:.2f}× the "
            f"{against['train_rate']:.1f} samples/s training consumed: the input pipeline is the bottleneck"
        ]
    stats = summary.phases.get("data_wait")
    data = 0.0 if stats is None or stats.nested else stats.share
    if data < MIN_SHARE:
        return []
    expected = 1 / data
    if ratio <= EXPLAINED * expected:
        return [
            f"the loader alone delivers {ratio:.2f}× what training consumed, as a loader that waits {100 * data:.0f}% "
            "of the step would: its own speed explains the wait"
        ]
    if ratio > UNEXPLAINED * expected:
        return [
            f"yet the loader alone delivers {ratio:.1f}× what training consumed, more than its {100 * data:.0f}% "
            "wait explains: inside training something else slows it (workers restarted each epoch, CPUs shared "
            "with the training process)"
        ]
    return []


def refine(summary: RunSummary, verdict: Verdict) -> Verdict:
    """Correct or support a phase-share verdict with the system samples and runtime facts, when measured."""
    signals = {s["id"]: s.get("evidence", "") for s in summary.system.get("signals", [])}
    device = summary.facts.get("device", {})
    retries = device.get("alloc_retries", 0)
    measured = max(summary.steps.measured, 1)
    if retries and retries / measured >= MIN_RETRY_RATE:
        evidence = [f"{retries} CUDA allocator retries (cache flushes with a device sync) in {measured} steps"]
        if device.get("total_mb"):
            evidence.append(f"peak memory {device['peak_reserved_mb']:.0f} of {device['total_mb']:.0f} MB reserved")
        return Verdict("memory", "medium", evidence + verdict.evidence)
    if verdict.bound == "compute" and "launch_bound" in signals:
        return Verdict("host", "medium", [signals["launch_bound"], *verdict.evidence])
    extra = [signals[name] for name in ("transform_bound", "io_bound") if verdict.bound == "data" and name in signals]
    against = summary.dataloader.get("against_training")
    if against is not None:
        extra += _ceiling_evidence(summary, against)
        if against["input_bound"] and verdict.bound == "balanced":
            return Verdict("data", "medium", extra + verdict.evidence)
    if "throttled" in signals:
        extra.append(signals["throttled"])
    crowded = oversubscribed_threads(summary.facts)
    if crowded is not None and verdict.bound in ("compute", "optimizer", "host"):
        used, cores = crowded
        extra.append(f"{used} torch threads across this machine's ranks compete for {cores:g} usable cores")
    straggler = summary.cluster.straggler if summary.cluster else None
    if straggler is not None:
        extra.append(
            f"rank {straggler.rank} is the straggler: its {straggler.phase} is {straggler.excess_ms:.1f} ms above "
            "the median of the other ranks"
        )
    return Verdict(verdict.bound, verdict.confidence, verdict.evidence + extra)
