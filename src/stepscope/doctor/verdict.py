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

from stepscope.record import TOTAL
from stepscope.summary import PhaseStats, RunSummary, Verdict

GROUPS: dict[str, tuple[str, ...]] = {
    "data": ("data_wait", "h2d"),
    "compute": ("forward", "backward"),
    "optimizer": ("optimizer", "zero_grad", "clip"),
    "host": ("sync", "other"),
}
MIN_STEPS = 3
MIN_SHARE = 0.40
HIGH_SHARE = 0.60
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


def classify(summary: RunSummary) -> Verdict:
    """The bound, confidence and evidence for a summary's phases (see the module docstring for the rules)."""
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
        ratio = against["headroom"]
        if against["input_bound"]:
            extra.append(
                f"the loader alone delivers {against['loader_ceiling']:.1f} samples/s, only {ratio:.2f}× the "
                f"{against['train_rate']:.1f} samples/s training consumed: the input pipeline is the bottleneck"
            )
            if verdict.bound == "balanced":
                return Verdict("data", "medium", extra + verdict.evidence)
        elif verdict.bound == "data":
            extra.append(
                f"yet the loader alone delivers {ratio:.1f}× what training consumed: the waiting is not the loader's "
                "speed (a loader rebuilt each epoch, worker start-up, contention for CPUs)"
            )
    if "throttled" in signals:
        extra.append(signals["throttled"])
    threads = summary.facts.get("threads", {})
    cores = threads.get("cpu_quota") or threads.get("cores")
    used = threads.get("torch_threads", 0) * (threads.get("local_ranks") or 1)
    if cores and used > cores + 0.5 and verdict.bound in ("compute", "optimizer", "host"):
        extra.append(f"{used} torch threads across this machine's ranks compete for {cores:g} usable cores")
    straggler = summary.cluster.straggler if summary.cluster else None
    if straggler is not None:
        extra.append(
            f"rank {straggler.rank} is the straggler: its {straggler.phase} is {straggler.excess_ms:.1f} ms above "
            "the median of the other ranks"
        )
    return Verdict(verdict.bound, verdict.confidence, verdict.evidence + extra)
