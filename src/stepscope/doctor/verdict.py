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
When this job's threads waited for CPUs (the ``cpu_contention`` signal), the verdict says so first, with the
figures, and its confidence drops one step: the shares were measured on an oversubscribed machine. When what the
main thread waited for was the cores this job's own loader workers held (the signal's cause ``workers``), that
wait is the input pipeline's: it moves from the CPU-timed groups to ``data`` before the bound is chosen, and the
verdict cites it instead of calling the machine oversubscribed.

A job's verdict is the job's (``job_verdict``): when one rank's excess in a phase explains the time the other
ranks wait in collectives (their ``comms``), the job's step is that rank's, and so is the verdict, whatever the
average rank's shares say: the waiting ranks only wait for it. Its bound is that phase's group when the group leads
the straggler's step, else the group that does: a small excess on a step that every rank spends mostly elsewhere
is named, but is not the job's bound.
"""

from __future__ import annotations

from stepscope.collectors.signals import cpu_wait_pct
from stepscope.collectors.stacks import describe_line
from stepscope.doctor.facts import oversubscribed_threads
from stepscope.record import GROUPS, TOTAL, host_paced
from stepscope.summary import PhaseStats, RunSummary, Straggler, Verdict

MIN_STEPS = 3
MIN_SHARE = 0.40
HIGH_SHARE = 0.60
EXPLAINED = 1.25  # ceiling/training ratio up to 1.25x of 1/data_share: the loader's speed explains the wait
UNEXPLAINED = 1.5  # above 1.5x of it, while waiting for data: something else slows the loader inside training
TOP_LINE_SHARE = 0.10  # of a host phase's stack samples: a line named in the host verdict's evidence
MIN_RETRY_RATE = 0.05  # allocator retries per measured step from which memory pressure is the verdict
EXPLAINS = 0.5  # the waiting ranks' comms beyond the straggler's own covers this much of its excess: they wait for it
EXPLAINS_HIGH = 0.8  # ... and this much, with an excess of at least MIN_SHARE of the step: high confidence
FOLLOWED_LINE_SHARE = 0.05  # of the step: a host-paced phase's GPU time from which the host verdict cites it


def _host_share(phases: dict[str, PhaseStats], name: str) -> float:
    stats = phases.get(name)
    return 0.0 if stats is None or stats.nested else stats.share


def _device_share(phases: dict[str, PhaseStats], name: str) -> float:
    stats = phases.get(name)
    share = None if stats is None or stats.nested else stats.gpu_work_share()
    return 0.0 if share is None else share


def group_shares(summary: RunSummary) -> dict[str, float]:
    """Share of step time (0..1) per group, from host time, or GPU time where CUDA-timed."""
    phases = summary.phases
    data = sum(_host_share(phases, p) for p in GROUPS["data"])
    if summary.meta.timing != "cuda":
        shares = {group: sum(_host_share(phases, p) for p in names) for group, names in GROUPS.items()}
        shares["data"] = data
        return shares
    data *= _host_part(summary)  # of the GPU-paced step, as the device shares are
    compute = sum(_device_share(phases, p) for p in GROUPS["compute"])
    optimizer = sum(_device_share(phases, p) for p in GROUPS["optimizer"])
    comms = sum(_device_share(phases, p) for p in GROUPS["comms"])  # the compute stream waiting for collectives
    gpu_busy = sum(_device_share(phases, name) for name in phases if name != TOTAL and name not in GROUPS["data"])
    host = max(0.0, 1.0 - gpu_busy - data)
    return {"data": data, "compute": compute, "comms": comms, "optimizer": optimizer, "host": host}


def _host_part(summary: RunSummary) -> float:
    """The host's step time as a share of the step's pace (1 unless the host ran ahead of the GPU)."""
    host_ms, excess_ms = summary.phases[TOTAL].mean_ms, summary.throughput.gpu_excess_ms or 0.0
    return host_ms / (host_ms + excess_ms) if host_ms + excess_ms > 0 else 1.0


def _evidence(summary: RunSummary, group: str, share: float) -> list[str]:
    phases = summary.phases
    cuda = summary.meta.timing == "cuda" and group in ("compute", "optimizer")
    # GPU shares are of the GPU-paced step (the host's time plus the GPU's beyond it), host shares of the host's
    total_ms = phases[TOTAL].mean_ms + ((summary.throughput.gpu_excess_ms or 0.0) if cuda else 0.0)
    lines = []
    for name in GROUPS[group]:
        stats = phases.get(name)
        if stats is None or stats.nested:
            continue
        part = _device_share(phases, name) if cuda else stats.share
        ms = part * total_ms  # per measured step: a phase that ran in few steps has a mean above its share
        if part >= 0.05:
            clock = "GPU time" if cuda else "of the step"
            lines.append(f"{name} is {100 * part:.0f}% {clock} ({ms:.1f} ms of a {total_ms:.1f} ms step)")
    if group == "host" and summary.meta.timing == "cuda":
        lines.append(f"the GPU had no work for {100 * share:.0f}% of the step outside data waits")
        lines += _followed_lines(phases)
    syncs = summary.counters.get("host_syncs", 0.0)
    if group == "host" and syncs >= 1:
        lines.append(f"{syncs:.1f} host-device syncs per step")
    if group == "host":
        lines += _top_lines(summary)
    if not lines:
        lines.append(f"{group} phases together are {100 * share:.0f}% of the step")
    return lines


def _followed_lines(phases: dict[str, PhaseStats]) -> list[str]:
    """The phases whose GPU time was mostly the GPU waiting for the host's launches (``host_paced``)."""
    return [
        f"{name}: the GPU kept up with the host's launches ({100 * (stats.device_host_paced or 0.0):.0f}% of its "
        f"{stats.device_mean_ms or 0.0:.1f} ms of GPU time), so that time is the host's"
        for name, stats in host_paced(phases, FOLLOWED_LINE_SHARE)
    ]


def _top_lines(summary: RunSummary) -> list[str]:
    """The source line that took most of ``other`` and of ``sync`` (the stack sampler's hotspots), when one took
    at least TOP_LINE_SHARE of its phase."""
    lines = []
    for phase, rows in summary.hotspots.get("phases", {}).items():
        if phase in GROUPS["host"] and rows and rows[0]["share"] >= TOP_LINE_SHARE:
            lines.append(f"top line in {phase}: {describe_line(rows[0])} ({100 * rows[0]['share']:.0f}% of {phase})")
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
    side starving the other, else the phases'; for a multi-rank job whose ranks wait for one of them, that rank's
    (see the module docstring for the rules)."""
    verdict = pipeline_verdict(summary) or classify_phases(summary)
    if verdict.bound not in ("memory", "unknown", "inference", "training"):
        # allocator retries stall every rank; too few steps say nothing of ranks either
        verdict = job_verdict(summary) or verdict
    if verdict.bound != "unknown" and contention_line(summary) is not None:
        return _contended(summary, verdict)  # whatever decided it, the shares were measured on a busy machine
    return verdict


def phase_group(phase: str) -> str | None:
    """The verdict group a phase belongs to (None for a custom phase)."""
    return next((group for group, names in GROUPS.items() if phase in names), None)


def rank_summary(summary: RunSummary, rank: int) -> RunSummary | None:
    """Rank ``rank``'s own summary inside a merged one."""
    return next((r for r in summary.ranks if (r.meta.rank or 0) == rank), None)


def attributed_straggler(summary: RunSummary) -> Straggler | None:
    """The straggler of a merged summary when its excess explains the other ranks' waits in collectives: their
    comms time beyond the straggler's own is at least ``EXPLAINS`` of its excess. None otherwise (even ranks, a
    straggler nobody is seen waiting for, a custom phase, or a summary without its ranks)."""
    straggler = summary.cluster.straggler if summary.cluster else None
    if straggler is None or straggler.wait_ms is None or TOTAL not in summary.phases:
        return None
    if phase_group(straggler.phase) in (None, "comms") or rank_summary(summary, straggler.rank) is None:
        return None
    waited = straggler.wait_ms - (straggler.own_comms_ms or 0.0)
    return straggler if straggler.excess_ms > 0 and waited >= EXPLAINS * straggler.excess_ms else None


def job_verdict(summary: RunSummary) -> Verdict | None:
    """The verdict of a job whose ranks wait for one straggler: the verdict of the straggler's own step, which is
    the job's step (the others wait for it). When the group of its slow phase leads that step, the verdict cites
    both sides (its excess, the others' comms) and then the straggler's own lines; when another group leads it (a
    2 ms loading excess on a step that is 60% host work on every rank), the straggler's own verdict is the job's,
    and the straggler is named after its lines. None when no straggler explains the waits."""
    straggler = attributed_straggler(summary)
    if straggler is None:
        return None
    group = phase_group(straggler.phase)
    assert group is not None and straggler.wait_ms is not None  # attributed_straggler checked both
    step_ms = summary.phases[TOTAL].mean_ms
    share = straggler.excess_ms / step_ms if step_ms > 0 else 0.0
    waiting = straggler.waiting_ranks
    if len(waiting) == 1:
        who = f"rank {waiting[0]} waits"
    else:
        who = f"ranks {', '.join(map(str, waiting))} wait" if len(waiting) <= 8 else f"{len(waiting):,} ranks wait"
    median = "" if len(waiting) == 1 else " (median)"
    own = "" if not straggler.own_comms_ms else f", against {straggler.own_comms_ms:.1f} ms on rank {straggler.rank}"
    where = f" on {straggler.node}" if straggler.node else ""
    both_sides = [
        f"rank {straggler.rank}'s {straggler.phase}{where} is {straggler.excess_ms:.1f} ms above the other ranks' "
        f"median ({100 * share:.0f}% of the {step_ms:.1f} ms job step)",
        f"{who} {straggler.wait_ms:.1f} ms per step{median} in comms for it{own}",
    ]
    slow = rank_summary(summary, straggler.rank)
    assert slow is not None
    pace = _own_pace(slow)
    own_lines = [f"rank {straggler.rank}: {line}" for line in pace.evidence]
    if pace.bound in ("balanced", "unknown"):  # no bound by share: the excess decides if its group leads the step
        shares = _work_shares(slow)
        leads = max(shares, key=shares.__getitem__) == group
    else:
        leads = pace.bound == group
    if not leads:
        return Verdict(pace.bound, pace.confidence, [*own_lines, *both_sides])
    waited = straggler.wait_ms - (straggler.own_comms_ms or 0.0)
    strong = waited >= EXPLAINS_HIGH * straggler.excess_ms and share >= MIN_SHARE
    return Verdict(group, "high" if strong else "medium", both_sides + (own_lines if pace.bound == group else []))


def _work_shares(summary: RunSummary) -> dict[str, float]:
    """A straggler's group shares without comms: its comms are its all-reduce and its own waits for the others
    (under load, each rank waits in turn), never what makes its step the slowest."""
    return {group: share for group, share in group_shares(summary).items() if group != "comms"}


def _own_pace(straggler: RunSummary) -> Verdict:
    """The straggler's own step verdict, with the largest other group where comms leads it."""
    pace = classify_phases(straggler)
    if pace.bound != "comms":
        return pace
    shares = _work_shares(straggler)
    group = max(shares, key=shares.__getitem__)
    if shares[group] < MIN_SHARE:
        return Verdict("balanced", "medium", [_balanced_line(shares, "no part of the step but comms")])
    return Verdict(group, "medium", _evidence(straggler, group, shares[group]))


def _balanced_line(shares: dict[str, float], subject: str) -> str:
    """``subject`` reaches no bound's share, and the groups' shares, largest first."""
    parts = ", ".join(f"{g} {100 * s:.0f}%" for g, s in sorted(shares.items(), key=lambda i: -i[1]))
    return f"{subject} reaches {100 * MIN_SHARE:.0f}%: {parts}"


def classify_phases(summary: RunSummary) -> Verdict:
    """The bound, confidence and evidence for a summary's phases."""
    measured = summary.steps.measured
    if measured < MIN_STEPS or TOTAL not in summary.phases:
        return Verdict("unknown", "low", [f"only {measured} measured step(s); at least {MIN_STEPS} are needed"])
    measured_shares = shares = group_shares(summary)
    lead = []
    charge = workers_charge(summary, shares)
    if charge is not None:
        shares, line = charge
        lead.append(line)
    group, share = max(shares.items(), key=lambda item: item[1])
    if share < MIN_SHARE:
        return Verdict("balanced", "medium", [*lead, _balanced_line(shares, "no part of the step")])
    confidence = "high" if share >= HIGH_SHARE else "medium"
    evidence = lead + _evidence(summary, group, measured_shares[group])
    return refine(summary, Verdict(group, confidence, evidence))


def workers_charge(summary: RunSummary, shares: dict[str, float]) -> tuple[dict[str, float], str] | None:
    """``shares`` with the workers' part of the main thread's wait for a CPU moved to ``data`` (when
    ``charged_to_workers``), and the sentence that says so; None otherwise.

    The wait is the main thread's run delay beyond the latency of its wake-ups (``cpu_wait_pct``) in % of wall
    time, taken as that share of the step (a step's wall time is nearly all of the run's). The cores it waited for
    ran this job's workers and other processes; the workers' part is their share of the CPU the two used. It
    inflated the groups timed on the host clock (with CUDA timing only ``host``: the GPU idling while the main
    thread waited), so it leaves them in proportion to their shares, never more than they hold."""
    kept = workers_kept(summary, shares)
    if not kept:
        return None
    moved = sum(shares.get(g, 0.0) * (1.0 - k) for g, k in kept.items())
    charged = {g: s * kept.get(g, 1.0) for g, s in shares.items()}
    charged["data"] = shares.get("data", 0.0) + moved
    host = summary.system.get("host", {})
    wait, workers = cpu_wait_pct(host, "main_thread"), host.get("workers_cpu_util_pct") or 0.0
    part = workers / (workers + (host.get("others_cpu_util_pct") or 0.0))
    return charged, _charge_line(host, wait or 0.0, part, charged)


def workers_kept(summary: RunSummary, shares: dict[str, float] | None = None) -> dict[str, float]:
    """Per inflated group, the part (0..1) of its share that is its own once the main thread's wait for the cores
    this job's workers held is taken out (``workers_charge``); {} when nothing is charged to the workers. The rules
    bound their fixes with it: a phase's time spent waiting for a CPU is no fix's to save."""
    shares = group_shares(summary) if shares is None else shares
    host = summary.system.get("host", {})
    wait, workers = cpu_wait_pct(host, "main_thread"), host.get("workers_cpu_util_pct") or 0.0
    if wait is None or workers <= 0 or not charged_to_workers(summary):
        return {}
    part = workers / (workers + (host.get("others_cpu_util_pct") or 0.0))
    inflated = ("host",) if summary.meta.timing == "cuda" else CPU_BOUNDS
    held = sum(shares.get(g, 0.0) for g in inflated)
    moved = min(wait / 100.0 * part, held)
    if moved <= 0:
        return {}
    return {g: 1.0 - moved / held for g in inflated}


def charged_to_workers(summary: RunSummary) -> bool:
    """The cpu_contention signal found the main thread waiting for the cores this job's loader workers held (cause
    ``workers``), and its intra-op threads fit the cores: more of them than cores would keep the main thread waiting
    without any worker, so its wait would not be the input pipeline's alone."""
    signal = _contention_signal(summary)
    workers = signal is not None and signal.get("cause") == "workers"
    return workers and oversubscribed_threads(summary.facts) is None


def _charge_line(host: dict, wait: float, part: float, charged: dict[str, float]) -> str:
    """The sentence for ``workers_charge``: the main thread's wait, who held the cores, the shares it leaves."""
    per_wait = host.get("run_delay_main_thread_per_wait_us")
    waits = "" if per_wait is None else f" ({per_wait:.0f} µs per wait, {wait:.0f}% beyond the latency of waking up)"
    cores = host.get("cpu_quota") or host.get("cores") or 1
    ranked = sorted(((g, s) for g, s in charged.items() if g != "data" and s >= 0.005), key=lambda item: -item[1])
    shares = ", ".join([f"data {100 * charged['data']:.0f}% of the step", *(f"{g} {100 * s:.0f}%" for g, s in ranked)])
    return (
        f"the main thread waited for a CPU {host['run_delay_main_thread_pct']:.0f}% of wall time{waits} while this "
        f"job's {host.get('workers_max')} loader worker(s) used {host.get('workers_cpu_util_pct') or 0.0:.0f}% CPU "
        f"of its {cores:g} usable core(s) and other processes {host.get('others_cpu_util_pct') or 0.0:.0f}%: the "
        f"workers' part of that wait ({100 * part:.0f}%, by the CPU they used) is the input pipeline's, which makes "
        f"{shares}"
    )


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


def gpu_work_measured(summary: RunSummary) -> bool:
    """True when the probed steps show the compute phases' GPU time mostly as work the GPU ran behind the host
    (``device_host_paced`` below one half): the GPU was measured busy with the step's work, which outranks the
    ``launch_bound`` signal's reading of power and clocks (float32 matmuls without TF32 keep an H200 busy at a
    third of its power limit)."""
    shares = [
        (stats.device_share, stats.device_host_paced)
        for name in GROUPS["compute"]
        if (stats := summary.phases.get(name)) is not None
        and stats.device_host_paced is not None
        and stats.device_share
    ]
    total = sum(share for share, _ in shares)
    return total > 0 and sum(share * (1.0 - paced) for share, paced in shares) >= 0.5 * total


NOT_LAUNCH_BOUND = (
    "the GPU's events show it behind the host's launches at the compute phases' ends: the step waits for GPU work, "
    "not for launches, whatever NVML's power and clock readings suggest"
)


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
        if not gpu_work_measured(summary):
            return Verdict("host", "medium", [signals["launch_bound"], *verdict.evidence])
        verdict = Verdict(verdict.bound, verdict.confidence, [*verdict.evidence, NOT_LAUNCH_BOUND])
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
            f"rank {straggler.rank}{f' on {straggler.node}' if straggler.node else ''} is the straggler: its "
            f"{straggler.phase} is {straggler.excess_ms:.1f} ms above "
            "the median of the other ranks"
        )
    extra += late_rank_lines(summary.trace)
    return Verdict(verdict.bound, verdict.confidence, verdict.evidence + extra)


LATE_CAUSES = {"data": "data loading", "compute": "compute", "host": "host work (Python, launches, waits)"}


def late_rank_lines(trace: dict) -> list[str]:
    """What a run's traces say of the rank the others wait for at their collectives (``trace["late_ranks"]``: the
    trace highlights' late ranks, figures in ms): a sentence per late rank with its cause, [] when they name none."""
    lines = []
    for late in trace.get("late_ranks") or []:
        unit, cause = late.get("unit", "per step"), late.get("cause", "")
        job = "" if late.get("job") in (None, "", ".") else f"in {late['job']}, "
        lines.append(
            f"{job}rank {late['rank']} arrives last at {late['last_at']} of {late['collectives']} collectives in the "
            f"traces, on average {late['late_ms']:.2f} ms after the others; they wait {late['waited_ms']:.2f} ms "
            f"{unit} for it ({late['wait_share_pct']:.0f}% of their communication time), while it spends "
            f"{late['cause_ms']:.2f} ms {unit} on {LATE_CAUSES.get(cause, cause)} against their "
            f"{late['others_cause_ms']:.2f} ms"
        )
    return lines


LOWER = {"high": "medium", "medium": "low", "low": "low"}
OVERSUBSCRIBED = "the machine is oversubscribed: "  # how the contention line starts (reports pick it out by it)
CPU_BOUNDS = ("compute", "optimizer", "host")  # groups timed on the host clock that waiting for a CPU inflates


def _contention_signal(summary: RunSummary) -> dict | None:
    return next((s for s in summary.system.get("signals", []) if s.get("id") == "cpu_contention"), None)


def contention_line(summary: RunSummary) -> str | None:
    """The line "the machine is oversubscribed: …" with the measured run delay, when the cpu_contention signal is
    there; None otherwise, and None when the wait is charged to this job's own loader workers (``workers_charge``
    moves it to the input pipeline instead)."""
    signal = _contention_signal(summary)
    if signal is None or charged_to_workers(summary):
        return None
    return OVERSUBSCRIBED + signal.get("evidence", "")


def _contended(summary: RunSummary, verdict: Verdict) -> Verdict:
    """A verdict measured while this job's threads waited for CPUs: it says so first and is less sure. A host-timed
    compute, optimizer or host share then includes that wait: the step's CPU phases ran slower than they would on
    a free machine."""
    evidence = [contention_line(summary) or ""]
    host = summary.system.get("host", {})
    delay = host.get("run_delay_process_pct")
    cpu_timed = summary.meta.timing != "cuda" or verdict.bound == "host"
    if verdict.bound in CPU_BOUNDS and cpu_timed and delay is not None:
        evidence.append(
            f"the {verdict.bound} share includes that wait: the process's threads were runnable but not running "
            f"{delay:.0f}% of wall time (summed over threads), so on a free machine that share would be smaller"
        )
    return Verdict(verdict.bound, LOWER.get(verdict.confidence, "low"), evidence + verdict.evidence)
