"""The catalogue of fixes: each rule reads measured facts and, when they show its problem, returns a finding.

A rule is a small function from a ``Case`` (a run's summary with its runtime facts, and the script's lint) to a
``Finding`` or None, registered with its fixed text: id, title, mechanism (``why``), the change (``how``), its
cost (``config`` < ``code`` < ``infra``) and whether it changes numerics. An absent fact makes a rule silent,
never wrong: every check first asks whether what it rests on was measured.

``gain_bound`` is an upper bound on the step-time saving (0..1). Most come from Amdahl's law: a fix that only
speeds up the forward and backward passes cannot save more than their share of the step. Where no measured share
bounds a fix, the bound is None with the reason.

docs/fixes.md is generated from this catalogue (``python -m stepscope.doctor.rules > docs/fixes.md``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stepscope.analyses.loader import (
    WAITING_WORKERS_CPU,
    WAITING_WORKERS_MAX,
    LoaderSettings,
    waiting_workers,
    worker_cap,
)
from stepscope.collectors.stacks import describe_line
from stepscope.doctor.facts import cores_of, ranks_per_machine, threads_for_workers
from stepscope.doctor.lint import LintHit
from stepscope.doctor.verdict import (
    EXPLAINS,
    attributed_straggler,
    gpu_work_measured,
    group_shares,
    phase_group,
    rank_summary,
    workers_kept,
)
from stepscope.record import TOTAL
from stepscope.summary import COSTS, Epoch, Fix, LoaderInfo, RunSummary, Straggler

# Thresholds, as fractions of the measured step unless said otherwise.
MIN_DATA_SHARE = 0.05  # data_wait below this: loader fixes cannot gain enough to be worth listing
# Workers leave a wait of their own (each batch's hand-over from a worker): below this share of the step on a loader
# that has workers, more of them would not gain enough to be worth listing.
MORE_WORKERS_MIN_SHARE = 0.10
# Tensors in one batch from which their hand-over from the workers is worth a fix: measured on the 2-core VM
# (2026-11-28), a batch of 8 samples from a free stream through 1 worker took 1.4 ms as 2 batched tensors and 7.2 ms
# as 16 per-sample ones (0.04 ms without workers); with the file_system sharing strategy 0.9 and 3.9 ms.
MANY_TENSORS = 8
IO_MIN_DATA_SHARE = 0.30  # an idle process waits on storage only when waiting for data is much of its step
# Conservative (low) copy bandwidths, bytes/s, so that a copy's time bounds from above what saving it can gain.
CPU_COPY_BYTES_PER_S = 2e9
GPU_COPY_BYTES_PER_S = 2e11
MIN_GAIN = 0.02  # a fix bounded by a phase share below this is noise next to the rest of the step
MIN_COPY_SHARE = 0.01  # host-to-device copies: small shares still block the launch queue on a GPU
MIN_STALL_SHARE = 0.02  # epoch-start stalls below this share of epoch time are not worth a fix
BURSTY_MEDIAN = 0.2  # median fetch below this fraction of the mean ...
RESTART_TAIL_BATCHES = 20  # epochs this short put their first fetch (1 in 20 or more) in the fetch times' p95
BURSTY_P95 = 4.0  # ... and p95 above this multiple of the median: bimodal (buffer hits vs blocking on workers)
# A fetch past the batches the workers hold ready that waits this many times one the buffer served, and this much
# longer, waited for its batch to be made (a free loader's fetches are all its hand-over, alike)
BURST_WAIT_RATIO = 2.0
BURST_WAIT_MIN_MS = 0.5
MIN_HOST_SHARE = 0.30  # GPU idle outside data waits: launch-bound from here
AMPERE = (8, 0)
HEADROOM = 0.5  # peak memory below this share of the device: room to spare
ZERO3_FITS = 0.6  # params + grads + Adam states below this share of one device: one replica fits
ADAM_BYTES_PER_PARAM_BYTE = 4  # parameter, gradient and two Adam moments, all of the parameter's dtype


@dataclass
class Finding:
    """What a rule saw: the evidence, and the bound on the gain (None with a reason when it cannot be bounded)."""

    evidence: list[str]
    gain_bound: float | None
    gain_reason: str = ""
    how: str | None = None  # replaces the rule's generic ``how`` when the facts give the exact change
    basis: str = "step"  # what gain_bound is a share of: step time, or "wall" time outside the steps
    apply: str | None = None  # the `--apply FIX=VALUE` that makes the change, where it takes a measured value


@dataclass
class Case:
    """What the rules read: a run's summary (with ``facts``) and the findings of the script's lint."""

    summary: RunSummary
    lint: list[LintHit] = field(default_factory=list)

    @property
    def facts(self) -> dict[str, Any]:
        return self.summary.facts

    @functools.cached_property
    def groups(self) -> dict[str, float]:
        return group_shares(self.summary) if TOTAL in self.summary.phases else {}

    @functools.cached_property
    def kept(self) -> dict[str, float]:
        """Per group, the part of its share that is its own, not the main thread's wait for the cores this job's
        workers held (``workers_kept``; {} when none is charged to them)."""
        return workers_kept(self.summary, self.groups) if self.groups else {}

    @property
    def measured(self) -> bool:
        return self.summary.steps.measured > 0 and TOTAL in self.summary.phases

    @property
    def cuda(self) -> bool:
        return "device" in self.facts or self.summary.meta.timing == "cuda"

    def share(self, *phases: str) -> float:
        """Share of the step (0..1) spent in these phases: GPU time for GPU work when CUDA-timed."""
        total = 0.0
        for name in phases:
            stats = self.summary.phases.get(name)
            if stats is None or stats.nested:
                continue
            device_share = stats.gpu_work_share() if self.summary.meta.timing == "cuda" else None
            share = device_share if device_share is not None and name != "data_wait" else stats.share
            total += share * self.kept.get(phase_group(name) or "", 1.0)
        return min(total, 1.0)

    def ms(self, phase: str) -> float | None:
        stats = self.summary.phases.get(phase)
        return None if stats is None else stats.mean_ms

    def lines(self, kind: str) -> list[LintHit]:
        return [hit for hit in self.lint if hit.kind == kind]

    def models(self) -> list[dict[str, Any]]:
        return list(self.facts.get("models", []))

    def torch_flag(self, name: str) -> Any:
        return self.facts.get("torch", {}).get(name)

    def autocast(self) -> bool | None:
        """Whether autocast was on in the probed forward passes; None when they were not probed."""
        if "autocast" not in self.facts:
            return None
        return bool(self.facts["autocast"])

    def cores(self) -> float | None:
        """CPU cores this process may use: the cgroup quota when set, else its affinity; None when unknown."""
        return cores_of(self.facts)

    def local_ranks(self) -> int:
        """Ranks sharing this machine's cores (torchrun's LOCAL_WORLD_SIZE; 1 when not launched by it)."""
        return ranks_per_machine(self.facts)

    def signals(self) -> dict[str, str]:
        return {s["id"]: s.get("evidence", "") for s in self.summary.system.get("signals", [])}

    def loader_workers(self) -> int:
        """Loader worker processes per rank: the most of any loader iterated (one loads at a time)."""
        return max((x.num_workers for x in self.summary.loaders if x.batches > 0), default=0)

    def worker_cores(self) -> float:
        """Cores this rank's loader workers use: their sampled CPU (time run and time runnable waiting for a CPU),
        else a core each when not sampled. Idle workers (a loader whose items cost nothing) use next to none."""
        host = self.summary.system.get("host", {})
        used = host.get("workers_cpu_util_pct")
        if used is None:
            return float(self.loader_workers())
        return (used + (host.get("run_delay_workers_pct") or 0.0)) / 100

    def busy_workers(self) -> int:
        """Loader workers that used CPU, on average over the samples (rounded up: each is a core while it loads);
        0 when the workers' CPU was not sampled, so that an unmeasured worker never counts against the cores."""
        busy = self.summary.system.get("host", {}).get("workers_busy_avg")
        return 0 if not busy else min(math.ceil(busy - 0.05), self.loader_workers() or math.ceil(busy))


@dataclass(frozen=True)
class Rule:
    """One entry of the catalogue: fixed text, and the check that decides whether it applies."""

    id: str
    title: str
    why: str
    how: str
    cost: str
    changes_numerics: bool
    check: Callable[[Case], Finding | None]


CATALOGUE: list[Rule] = []
# Fixes whose problem distorts the shares the other fixes' bounds rest on (intra-op threads, or more computing loader
# workers than cores, fighting for the cores inflate every CPU phase and saturate the workers' CPUs): ranked first,
# whatever their bound, since the other bounds mean little until it is gone.
FIRST = ("host.threads", "loader.too_many_workers")  # in this order: beside both, fewer threads measured faster
# A fix bounded below this share of the step ranks after every fix that can save more, whatever its cost: a config
# knob that can save 3% is not the first thing to try beside a code change that can save 60%.
MATERIAL_GAIN = 0.05


def rule(
    id: str, title: str, why: str, how: str, cost: str, changes_numerics: bool = False
) -> Callable[[Callable[[Case], Finding | None]], Callable[[Case], Finding | None]]:
    """Register a check in the catalogue with its fixed text."""
    if cost not in COSTS:
        raise ValueError(f"rule {id}: cost must be one of {COSTS}, not {cost!r}")

    def register(check: Callable[[Case], Finding | None]) -> Callable[[Case], Finding | None]:
        CATALOGUE.append(Rule(id, title, why, how, cost, changes_numerics, check))
        return check

    return register


def pct(share: float) -> str:
    return f"{100 * share:.0f}%"


def _at(hits: list[LintHit]) -> list[str]:
    return [f"line {h.line}: {h.text}" for h in hits[:3]]


def _compute_bound(case: Case) -> float:
    return case.share("forward", "backward")


# -- loader ------------------------------------------------------------------------------------------------------


def loader_shares(case: Case) -> dict[int, float]:
    """Each loader's share of the step spent waiting on it (0..1, by index): the step's data_wait split by the
    time the training steps waited on each (fetches inside validation passes left out)."""
    loaders = [x for x in case.summary.loaders if x.batches > 0]
    total = sum(x.step_fetch_s for x in loaders)
    data = case.share("data_wait")
    return {x.index: data * x.step_fetch_s / total for x in loaders} if total > 0 else {}


@rule(
    "loader.num_workers",
    "Load batches in enough worker processes",
    "With num_workers=0 every batch is read, decoded and collated in the training process, between steps; with too "
    "few workers they cannot keep up. Either way the model waits for each batch.",
    "DataLoader(..., num_workers=N, persistent_workers=True) with N up to the cores you can spare per rank, or more "
    "when the fetch mostly waits.",
    "config",
)
def _loader_workers(case: Case) -> Finding | None:
    if not case.measured:
        return None
    shares = loader_shares(case)
    helped = [x for x in case.summary.loaders if shares.get(x.index, 0.0) > 0 and _more_workers_help(case, x)]
    if not helped:
        return None
    loader = max(helped, key=lambda x: shares[x.index])  # of those more workers can help, the one waited for most
    if loader.num_workers > 0:
        data = shares[loader.index]
        return _more_workers(case, loader, data) if data >= MORE_WORKERS_MIN_SHARE else None
    if shares[loader.index] < MIN_DATA_SHARE:
        return None  # no loader waited for long enough to be worth the workers (tiny batches: their hand-over)
    # Once one is, the advice (and `--apply`, which sets the count on every DataLoader) gives each loader without
    # workers its own: the bound is their waits together, the data share the verdict weighs
    # (a loader barely waited for, such as a validation loader whose first batch is fetched inside a step, is left
    # out: its share is noise beside the rest)
    idle = [x for x in helped if x.num_workers == 0 and (x is loader or shares[x.index] >= MIN_GAIN)]
    data = sum(shares[x.index] for x in idle)
    cores, local = case.cores(), case.local_ranks()
    waits = _fetch_waits(case)
    hint, workers = None, None
    swept = _swept_settings(case) or None
    if swept is not None and swept["num_workers"] == 0 and case.summary.dataloader.get("sweep_skipped"):
        swept = None  # cut short by its budget before more workers were tried: no verdict on them
    if swept is not None:  # the sweep measured the worker counts on this machine: its best is the advice
        if swept["num_workers"] == 0:
            return None  # no worker count was measured faster than none
        best = case.summary.dataloader["best"]
        gain = "" if best.get("gain") is None else f", {100 * best['gain']:+.0f}% over the current setting"
        if best.get("train_samples_per_s") is not None:  # ranked by the run's own step
            rate = f"{best['train_samples_per_s']:,.0f} samples/s of this run's step{gain}"
        else:
            rate = f"{best['samples_per_s']:,.0f} samples/s{gain}"
        hint = f"{LoaderSettings(**swept).snippet()} (the loader sweep's best: {rate})"
        workers = swept["num_workers"]
    elif waits:  # the fetch waits rather than computes: workers overlap the waits, using no core
        workers = waiting_workers(case.ms("data_wait"), case.ms(TOTAL) - case.ms("data_wait"))
        busy = _fetch_busy_pct(case)
        measured = "" if busy is None else f", measured alone it kept the training process busy {busy:.0f}% of the time"
        hint = (
            f"DataLoader(..., num_workers={workers}, persistent_workers=True) (the fetch mostly waits{measured}: "
            f"{workers} workers overlap {case.ms('data_wait'):.1f} ms of fetching with the rest of the step, using "
            "no core)"
        )
    elif cores:
        workers = worker_cap(cores, local)
        hint = (
            f"DataLoader(..., num_workers={workers}, persistent_workers=True) "
            f"({cores:g} usable cores, {local} rank(s) on this machine)"
        )
    # the loader waited for most first: the one to fix if only one is
    said = f"loader {loader.index} ({loader.dataset}) has num_workers=0"
    others = [f"loader {x.index} ({x.dataset})" for x in idle if x is not loader]
    if others:
        said += f", and so {'does' if len(others) == 1 else 'do'} {', '.join(others)}"
    whose = "" if len(shares) == 1 else " on them" if others else f" on loader {loader.index}"
    waited = f"data_wait{whose} is {pct(data)} of the step ({data * case.ms(TOTAL):.1f} ms of {case.ms(TOTAL):.1f} ms)"
    if others:
        waited += f", {pct(shares[loader.index])} on loader {loader.index}"
    evidence = [said, waited, *_at(case.lines("num_workers_zero"))]
    apply = None if workers is None else _workers_apply(loader, workers, swept)
    return Finding(evidence, data, "at most the time spent waiting for data", how=hint, apply=apply)


def _workers_apply(loader: LoaderInfo, workers: int, swept: dict[str, Any] | None) -> str:
    """The ``--apply`` argument for a worker fix with every setting its advice names, so that --verify and --apply
    measure the advice and not part of it: the count, persistent workers (a count alone starts them all again
    every epoch, which can cost more than the epoch's steps), and the prefetch and pinning of the sweep's best
    where it measured them."""
    parts = [f"loader.num_workers={workers}"]
    persistent = swept["persistent_workers"] if swept else True
    if persistent and not loader.persistent_workers:
        parts.append("loader.persistent_workers")
    if swept:
        prefetch = swept.get("prefetch_factor")
        if prefetch is not None and prefetch != (loader.prefetch_factor or 2):
            parts.append(f"loader.prefetch={prefetch}")
        if swept.get("pin_memory") and not loader.pin_memory:
            parts.append("loader.pin_memory")
    return ",".join(parts)


def _fetch_waits(case: Case) -> bool:
    """Whether the fetch of a loader without workers mostly waits rather than computes: the host samples' io_bound
    signal, or the loader ceiling's ``_fetch_busy_pct``."""
    return bool(case.signals().get("io_bound")) or _fetch_busy_pct(case) is not None


def _swept_settings(case: Case) -> dict[str, Any]:
    """The loader sweep's best settings ({} when no sweep ran)."""
    return (case.summary.dataloader.get("best") or {}).get("settings") or {}


def _workers_wait(case: Case) -> bool:
    """Whether the loader workers mostly wait (storage, a sleep) rather than compute: their CPU, with their wait for
    one, under ``WAITING_WORKERS_CPU`` of a core each, and the main thread never waited for cores they held."""
    host = case.summary.system.get("host", {})
    workers_cpu, workers = host.get("workers_cpu_util_pct"), host.get("workers_max")
    if workers_cpu is None or not workers or _held(case):
        return False
    return workers_cpu + (host.get("run_delay_workers_pct") or 0.0) < WAITING_WORKERS_CPU * 100 * workers


def _held(case: Case) -> float:
    """The share of the step the main thread waited for the cores this job's loader workers held (the verdict
    charges it to them)."""
    return sum(case.groups.get(g, 0.0) * (1.0 - kept) for g, kept in case.kept.items())


def _more_workers_help(case: Case, loader: LoaderInfo) -> bool:
    """Whether more workers for ``loader`` can shorten the step's wait for it: it has none and no other loader's
    workers fill the cores; or its workers mostly wait (more overlap more waits); or they compute and the cores
    have room for more (a core per worker, one for the training process) that the workers do not already hold;
    with workers, only when it was measured too slow for the step (``_cannot_keep_up``)."""
    cores, local = case.cores(), case.local_ranks()
    if loader.num_workers == 0:
        # the ranks' workers hold a core each that they keep busy for more than a quarter of the time
        return _fetch_waits(case) or not cores or math.ceil(case.worker_cores() * local - 0.25) < cores
    if not _cannot_keep_up(case, loader):
        return False  # a wait beside workers may be each batch's hand-over (a busy machine stretches it)
    if _workers_wait(case):
        return True
    return bool(cores) and not _held(case) and case.loader_workers() < worker_cap(cores, local)


def _cannot_keep_up(case: Case, loader: LoaderInfo) -> bool:
    """Whether ``loader``, which has workers, was measured too slow for the step: alone it delivers at most what
    training consumed (the loader ceiling), or the loader sweep measured more workers faster."""
    found = case.summary.dataloader
    if found.get("index", 0) != loader.index:
        return False
    return bool((found.get("against_training") or {}).get("input_bound")) or (
        _swept_settings(case).get("num_workers", 0) > loader.num_workers
    )


def _more_workers(case: Case, loader: LoaderInfo, data: float) -> Finding:
    """The fix for a loader whose workers cannot keep up: as many workers again as the wait asks for when they
    mostly wait (each delivers a batch every ``W × step`` ms; the rest of the step takes one every ``rest`` ms),
    else up to the cores."""
    step, waits = case.ms(TOTAL), _workers_wait(case)
    rest = max(step - data * step, 0.5)
    swept = _swept_settings(case)
    if swept.get("num_workers", 0) > loader.num_workers:
        workers = swept["num_workers"]
        why = "the loader sweep's best"
    elif waits:
        needed = math.ceil(loader.num_workers * step / rest)
        workers = min(max(needed, loader.num_workers + 1), max(WAITING_WORKERS_MAX, loader.num_workers + 1))
        why = f"its workers mostly wait: {workers} overlap more of the waits, using no core"
    else:
        workers = worker_cap(case.cores(), case.local_ranks())  # type: ignore[arg-type]
        why = f"{case.cores():g} usable cores, {case.local_ranks()} rank(s) on this machine"
    evidence = [
        f"loader {loader.index} ({loader.dataset}) has num_workers={loader.num_workers}, and the step still waits "
        f"for it: {pct(data)} of the step ({data * step:.1f} ms of {step:.1f} ms)",
    ]
    against = case.summary.dataloader.get("against_training") or {}
    if against.get("input_bound"):
        evidence.append(
            f"measured alone it delivers {against['loader_ceiling']:.1f} samples/s, only {against['headroom']:.2f}× "
            f"the {against['train_rate']:.1f} samples/s training consumed"
        )
    hint = f"DataLoader(..., num_workers={workers}, persistent_workers=True) ({why})"
    return Finding(
        evidence, data, "at most the time spent waiting for data", how=hint, apply=_workers_apply(loader, workers, None)
    )


def _fetch_busy_pct(case: Case) -> float | None:
    """How busy the training process was while it fetched batches alone (the doctor's loader ceiling, %), when the
    loader has no workers and that is under ``WAITING_WORKERS_CPU`` of a core: the fetch mostly waits (storage,
    network, a sleep) rather than computes. None otherwise, or when not measured. Unlike the host samples behind
    the ``io_bound`` signal this needs no run of several seconds, and waiting for a CPU counts as busy, so a
    computing loader on a busy machine is not mistaken for a waiting one."""
    measured = case.summary.dataloader.get("loader") or {}
    busy, settings = measured.get("busy_pct"), measured.get("settings") or {}
    if busy is None or settings.get("num_workers") != 0 or busy >= 100 * WAITING_WORKERS_CPU:
        return None
    return float(busy)


@rule(
    "loader.persistent_workers",
    "Keep the loader's workers alive between epochs",
    "Without persistent_workers every epoch starts new worker processes, which re-import and re-build the "
    "dataset before the first batch arrives: a stall at each epoch start.",
    "DataLoader(..., persistent_workers=True)",
    "config",
)
def _persistent_workers(case: Case) -> Finding | None:
    loaders = {x.index: x for x in case.summary.loaders if x.num_workers > 0 and not x.persistent_workers}
    epochs = [e for e in case.summary.epochs if e.loader in loaders and e.start_stall_ms is not None]
    later = [e for e in epochs if e.index > 0]  # the first start is paid once either way
    if not later:
        return None
    restarting = sorted({e.loader for e in later})
    # Each loader's stalls over its own epochs' time: loaders iterated side by side have epochs that overlap in
    # time, while their stalls each hold the steps up (summed over all their epochs, c029 of the truth generator's
    # seed 2030 read 13% for two loaders that each stalled a quarter of the time).
    share = sum(_stall_share([e for e in epochs if e.loader == index]) for index in restarting)
    short = [loaders[index] for index in restarting if _restarts_in_tail(case, loaders[index])]
    if short:
        # Epochs this short restart more than their first batch: the fresh workers' buffer starts empty, and each
        # fetch of the epoch waits on it. Those loaders' whole wait goes with persistent workers.
        share = max(share, case.share("data_wait") * _wait_fraction(case, short))
    share = min(share, case.share("data_wait"))
    if share < MIN_STALL_SHARE:
        return None
    stall_s = sum(e.start_stall_ms for e in later) / 1000  # type: ignore[misc]
    mean_ms = 1000 * stall_s / len(later)
    # The restarting loader the steps waited on most stands for them (a fix names the loader the figures point at)
    named = max((loaders[i] for i in restarting), key=lambda x: x.step_fetch_s)
    names = f"loader {named.index} ({named.dataset}, num_workers={named.num_workers})"
    if len(restarting) > 1:
        names += f" and {len(restarting) - 1} other loader(s)"
    evidence = [f"{len(later)} epoch restart(s) of {names} stalled {mean_ms:.0f} ms each before the first batch"]
    if short:
        batches = statistics.fmean(e.batches for e in epochs if e.loader in {x.index for x in short} and e.complete)
        evidence.append(
            f"epochs of {batches:.0f} batches: each fetch waits on workers started again, {pct(share)} of the step"
        )
    else:
        evidence.append(f"the stalls are {pct(share)} of the time spent in those epochs")
    return Finding(evidence, share, "at most the epoch-start stalls, or the whole wait of loaders with short epochs")


def _stall_share(epochs: list[Epoch]) -> float:
    """One loader's later epochs' start stalls over all its epochs' time (0..1)."""
    stall_s = sum(e.start_stall_ms for e in epochs if e.index > 0 and e.start_stall_ms is not None) / 1000
    time_s = sum(e.time_s for e in epochs)
    return stall_s / time_s if time_s > 0 else 0.0


def _wait_fraction(case: Case, loaders: list[LoaderInfo]) -> float:
    """The share of the steps' wait for data (0..1) that ``loaders`` took: their fetches and epoch starts, over
    every loader's."""

    def wait_s(x: LoaderInfo) -> float:
        stalls = sum(e.start_stall_ms or 0.0 for e in case.summary.epochs if e.loader == x.index) / 1000
        return x.step_fetch_s + stalls

    total = sum(wait_s(x) for x in case.summary.loaders)
    return sum(wait_s(x) for x in loaders) / total if total > 0 else 0.0


@rule(
    "loader.pin_memory",
    "Pin the loader's host memory",
    "A copy to the GPU from pageable memory goes through a staging buffer and blocks the host; from pinned memory "
    "it is a direct DMA that can overlap with compute.",
    "DataLoader(..., pin_memory=True) and batch.to('cuda', non_blocking=True)",
    "config",
)
def _pin_memory(case: Case) -> Finding | None:
    h2d = case.facts.get("h2d", {})
    unpinned = [x for x in case.summary.loaders if not x.pin_memory and x.batches > 0]
    share = case.share("h2d")
    if not h2d.get("to_cuda") or not unpinned or h2d.get("pinned_source", 0) > 0 or share < MIN_COPY_SHARE:
        return None
    evidence = [
        f"loader {unpinned[0].index} ({unpinned[0].dataset}) has pin_memory=False and its batches are copied to the "
        "GPU",
        f"h2d is {pct(share)} of the step" + ("" if case.ms("h2d") is None else f" ({case.ms('h2d'):.2f} ms)"),
    ]
    if h2d.get("non_blocking"):
        evidence.append("the copies ask for non_blocking=True, which pageable memory cannot honour")
    return Finding(evidence, share, "at most the time in host-to-device copies")


@rule(
    "h2d.non_blocking",
    "Copy pinned batches with non_blocking=True",
    "Pinned memory only pays off with an asynchronous copy: a blocking .to('cuda') waits for the transfer before "
    "the host launches the forward pass.",
    "batch = batch.to('cuda', non_blocking=True)",
    "code",
)
def _non_blocking(case: Case) -> Finding | None:
    h2d = case.facts.get("h2d", {})
    pinned = [x for x in case.summary.loaders if x.pin_memory and x.batches > 0]
    share = case.share("h2d")
    if not h2d.get("to_cuda") or not pinned or h2d.get("non_blocking") or share < MIN_COPY_SHARE:
        return None
    evidence = [
        f"loader {pinned[0].index} ({pinned[0].dataset}) pins memory, but {h2d['to_cuda']} copies to the GPU were "
        "blocking",
        f"h2d is {pct(share)} of the step",
    ]
    return Finding(evidence, share, "at most the time in host-to-device copies")


@rule(
    "loader.batched_tensors",
    "Collate each batch into a few tensors in the workers",
    "A batch crosses from a worker process tensor by tensor: each gets a shared-memory segment and a file "
    "descriptor of its own, and the training process maps each. A batch of per-sample tensors (images of different "
    "sizes, a target dict each) pays that many times over while the step waits.",
    "in collate_fn, stack per-sample tensors into batched ones (pad them, or concatenate with offsets) and split "
    "them after the fetch; torch.multiprocessing.set_sharing_strategy('file_system') roughly halves the cost of "
    "each tensor",
    "code",
)
def _batched_tensors(case: Case) -> Finding | None:
    if not case.measured:
        return None
    shares = loader_shares(case)
    many = [
        x
        for x in case.summary.loaders
        if x.num_workers > 0 and x.tensors_per_batch >= MANY_TENSORS and shares.get(x.index, 0.0) >= MIN_DATA_SHARE
    ]
    if not many:
        return None
    loader = max(many, key=lambda x: shares[x.index])
    share = shares[loader.index]
    evidence = [
        f"loader {loader.index} ({loader.dataset}, num_workers={loader.num_workers}): "
        f"{loader.tensors_per_batch} tensors a batch, each sent from its worker apart",
        f"data_wait on loader {loader.index} is {pct(share)} of the step "
        f"({share * case.ms(TOTAL):.1f} ms of {case.ms(TOTAL):.1f} ms)",
    ]
    return Finding(evidence, share, "at most the step's wait on the loader")


@rule(
    "loader.prefetch",
    "Prefetch deeper: the fetch times are bursty",
    "Most batches come straight from the prefetch buffer while some block on a worker: the buffer runs dry when "
    "a few slow batches arrive together, or when a step takes more batches at once than the workers hold ready "
    "(num_workers × prefetch_factor; gradient accumulation takes several). A deeper buffer (or more workers) "
    "absorbs the bursts.",
    "DataLoader(..., prefetch_factor=4) (default 2), or more workers",
    "config",
)
def _prefetch(case: Case) -> Finding | None:
    stats = case.summary.phases.get("data_wait")
    loaders = [x for x in case.summary.loaders if x.num_workers > 0 and x.batches > 0]
    data = case.share("data_wait")
    if stats is None or not loaders or data < MIN_DATA_SHARE:
        return None
    shares = loader_shares(case)
    bimodal = stats.median_ms < BURSTY_MEDIAN * stats.mean_ms and stats.p95_ms > BURSTY_P95 * max(stats.median_ms, 0.05)
    if not bimodal:
        return _burst_prefetch(case, loaders, shares)
    loader = max(loaders, key=lambda x: shares.get(x.index, 0.0))
    if _restarts_in_tail(case, loader):
        return None
    factor = loader.prefetch_factor or 2
    evidence = [
        f"data_wait median {stats.median_ms:.2f} ms but mean {stats.mean_ms:.1f} ms and p95 {stats.p95_ms:.1f} ms",
        f"loader {loader.index} ({loader.dataset}): {loader.num_workers} workers, prefetch_factor={factor}",
    ]
    cores = case.cores()
    full = cores is not None and loader.num_workers * case.local_ranks() >= cores  # no core for another worker
    how = f"DataLoader(..., prefetch_factor={max(4, 2 * factor)})" + ("" if full else " or more workers")
    return Finding(evidence, data, "at most the time spent waiting for data", how=how)


def _burst_prefetch(case: Case, loaders: list[LoaderInfo], shares: dict[int, float]) -> Finding | None:
    """``loader.prefetch`` for loaders a step takes more batches from at once than their workers hold ready, whose
    fetches past those waited for batches to be made: measurably longer than the fetches the buffer served (a free
    loader's are all its hand-over, and a deeper buffer saves nothing). The per-step data_wait sums a step's fetches,
    so such bursts do not show as bimodal step times."""
    bursts: dict[int, tuple[float, float, float]] = {}  # index: (share of the step, burst ms, ready ms)
    for x in loaders:
        ready = x.batches - x.eval_batches - x.burst_fetches
        if not x.burst_fetches or ready <= 0 or x.step_fetch_s <= 0:
            continue
        burst_ms = 1e3 * x.burst_fetch_s / x.burst_fetches
        ready_ms = 1e3 * max(x.step_fetch_s - x.burst_fetch_s, 0.0) / ready
        share = shares.get(x.index, 0.0) * x.burst_fetch_s / x.step_fetch_s
        if burst_ms >= BURST_WAIT_RATIO * ready_ms + BURST_WAIT_MIN_MS and share >= MIN_GAIN:
            bursts[x.index] = (share, burst_ms, ready_ms)
    share = sum(b[0] for b in bursts.values())
    if share < MIN_DATA_SHARE:
        return None
    loader = max((x for x in loaders if x.index in bursts), key=lambda x: bursts[x.index][0])
    _, burst_ms, ready_ms = bursts[loader.index]
    steps = case.summary.steps.warmup + case.summary.steps.measured
    per_step = (loader.batches - loader.eval_batches) / max(steps, 1)
    factor = loader.prefetch_factor or 2
    deeper = max(math.ceil(per_step / loader.num_workers), 2 * factor)
    evidence = [
        f"loader {loader.index} ({loader.dataset}): a step takes {per_step:.1f} batches from it at once, and its "
        f"{loader.num_workers} worker(s) hold {loader.num_workers * factor} ready (prefetch_factor={factor}): "
        f"a fetch past those waited {burst_ms:.1f} ms, one the buffer served {ready_ms:.1f} ms",
        f"the waits past the buffer are {pct(share)} of the step ({share * case.ms(TOTAL):.1f} ms of "
        f"{case.ms(TOTAL):.1f} ms)",
    ]
    how = f"DataLoader(..., prefetch_factor={deeper}) for each loader a step takes several batches from"
    return Finding(evidence, share, "at most the waits past the buffer", how=how, apply=f"loader.prefetch={deeper}")


def _restarts_in_tail(case: Case, loader: LoaderInfo) -> bool:
    """Whether ``loader``'s slowest fetches may be its epochs' first: it starts its workers again at every epoch,
    and an epoch is short enough (≤ 20 batches) for first fetches to reach the p95. A deeper buffer starts empty with
    every new iterator: such bursts are ``loader.persistent_workers``'s."""
    if loader.persistent_workers:
        return False
    complete = [e for e in case.summary.epochs if e.loader == loader.index and e.complete and e.batches]
    return bool(complete) and statistics.fmean(e.batches for e in complete) <= RESTART_TAIL_BATCHES


@rule(
    "loader.too_many_workers",
    "Use no more loader workers than cores",
    "Workers beyond the cores this process may use (affinity, cgroup quota) only time-share the same CPUs, "
    "and each holds its own copy of the dataset's memory.",
    "DataLoader(..., num_workers=N) with N × ranks per machine ≤ usable cores",
    "config",
)
def _too_many_workers(case: Case) -> Finding | None:
    threads = case.facts.get("threads", {})
    cores, world = case.cores(), case.local_ranks()
    if not cores:
        return None
    busy = [x for x in case.summary.loaders if x.num_workers * world > cores]
    # Workers the main thread waited for the cores of (the verdict charged that to them) compute, even when each
    # one idles between batches waiting for its turn to hand its batch over.
    held = _held(case)
    if _workers_wait(case):
        return None  # the workers mostly wait (I/O), not for a CPU: more of them than cores overlaps the waits
    if not busy:
        return None
    loader = busy[0]
    limit = "cgroup quota" if threads.get("cpu_quota") else "usable cores"
    evidence = [
        f"loader {loader.index} ({loader.dataset}): {loader.num_workers} workers × {world} rank(s) "
        f"for {cores:g} {limit}"
    ]
    contention = case.signals().get("cpu_contention")
    if contention:
        evidence.append(contention)
    if held:
        evidence.append(f"the main thread waited for the cores they held {pct(held)} of the step")
        return Finding(evidence, held, "at most the main thread's wait for the cores the workers held")
    return Finding(evidence, None, "oversubscription costs depend on the scheduler: not measurable from shares")


@rule(
    "loader.transform_bound",
    "Take work off the loader's CPUs",
    "The workers' CPUs are saturated: decoding and augmentation, not storage, limit the input pipeline, so more "
    "workers than cores cannot help.",
    "Cache decoded/pre-processed samples, move augmentation to the GPU (e.g. batched tensor ops), or use a "
    "cheaper decoder",
    "code",
)
def _transform_bound(case: Case) -> Finding | None:
    evidence = case.signals().get("transform_bound")
    data = case.share("data_wait")
    if evidence is None or data < MIN_DATA_SHARE:
        return None
    lines = [evidence, f"data_wait is {pct(data)} of the step"]
    shares = loader_shares(case)
    working = [x for x in case.summary.loaders if x.num_workers > 0 and shares.get(x.index, 0.0) > 0]
    if working:  # the workers' transforms: those of the loader with workers the step waits on most
        loader = max(working, key=lambda x: shares[x.index])
        lines.insert(0, f"loader {loader.index} ({loader.dataset}): {loader.num_workers} workers")
    return Finding(lines, data, "at most the time waiting for data")


@rule(
    "loader.io_bound",
    "The input pipeline waits on storage",
    "Neither the GPU nor the loader's CPUs are busy while the model waits for data: reads from disk or network "
    "are the limit.",
    "Stage the data on local NVMe, pack it into larger shards (WebDataset, tar, Arrow), or add I/O parallelism",
    "infra",
)
def _io_bound(case: Case) -> Finding | None:
    evidence = case.signals().get("io_bound")
    data = case.share("data_wait")
    # The signal says the training process and its workers were mostly idle; that points at storage only when
    # the process idled waiting for data. Idle in a sleeping forward, with a worker's hand-over showing as a small
    # data_wait, it does not.
    if evidence is None or data < IO_MIN_DATA_SHARE:
        return None
    return Finding([evidence, f"data_wait is {pct(data)} of the step"], data, "at most the time waiting for data")


# -- free knobs ------------------------------------------------------------------------------------------------


def _capability(case: Case) -> tuple[int, int] | None:
    device = case.facts.get("device")
    return None if device is None else tuple(device["capability"])  # type: ignore[return-value]


def _fp32_model(case: Case) -> bool:
    models = case.models()
    return bool(models) and all(set(m.get("dtypes", {})) <= {"float32"} for m in models)


@rule(
    "tf32",
    "Allow TF32 for float32 matmuls",
    "On Ampere and newer GPUs, float32 matmuls and convolutions can run on tensor cores in TF32 (10-bit mantissa) "
    "at several times the speed; PyTorch keeps full float32 for matmuls unless asked.",
    'torch.set_float32_matmul_precision("high")  (and torch.backends.cudnn.allow_tf32 = True, the default)',
    "config",
    changes_numerics=True,
)
def _tf32(case: Case) -> Finding | None:
    capability = _capability(case)
    if capability is None or capability < AMPERE or case.autocast() is not False or not _fp32_model(case):
        return None
    if case.torch_flag("matmul_precision") != "highest" or case.torch_flag("cuda_matmul_tf32"):
        return None
    share = _compute_bound(case)
    evidence = [
        f"GPU compute capability {capability[0]}.{capability[1]}, float32 parameters, no autocast",
        'float32 matmul precision is "highest" (TF32 off)',
        *_at(case.lines("tf32_off")),
    ]
    return Finding(evidence, share, "at most the forward and backward time")


def _shapes_by_model(case: Case) -> dict[str | None, list[list[int]]]:
    """The distinct input shapes seen by each model (a GAN's generator and discriminator each have their own)."""
    shapes: dict[str | None, list[list[int]]] = {}
    for entry in case.facts.get("inputs", []):
        seen = shapes.setdefault(entry.get("model"), [])
        if entry["shape"] not in seen:
            seen.append(entry["shape"])
    return shapes


@rule(
    "cudnn.benchmark",
    "Let cuDNN pick the fastest convolution algorithms",
    "With fixed input shapes, cudnn.benchmark times the candidate algorithms once per shape and keeps the fastest; "
    "without it cuDNN uses a heuristic choice.",
    "torch.backends.cudnn.benchmark = True",
    "config",
)
def _cudnn_benchmark(case: Case) -> Finding | None:
    convs = sum(m.get("convs", 0) for m in case.models())
    shapes = _shapes_by_model(case)
    if not case.cuda or not convs or case.torch_flag("cudnn_benchmark") is not False or not shapes:
        return None
    if any(len(seen) != 1 for seen in shapes.values()):
        return None
    fixed = ", ".join(str(seen[0]) for seen in shapes.values())
    evidence = [
        f"{convs} convolution layer(s), fixed input shape(s) {fixed} in the probed steps",
        "torch.backends.cudnn.benchmark is False",
    ]
    return Finding(evidence, _compute_bound(case), "at most the forward and backward time")


@rule(
    "cudnn.benchmark_varying",
    "Turn cudnn.benchmark off: the input shapes vary",
    "cudnn.benchmark re-times every convolution algorithm for each new input shape; with shapes that keep changing "
    "the autotuning runs again and again inside the training steps.",
    "torch.backends.cudnn.benchmark = False (or pad/bucket inputs to a few fixed shapes)",
    "config",
)
def _cudnn_varying(case: Case) -> Finding | None:
    convs = sum(m.get("convs", 0) for m in case.models())
    varying = {model: seen for model, seen in _shapes_by_model(case).items() if len(seen) > 1}
    if not case.cuda or not convs or case.torch_flag("cudnn_benchmark") is not True or not varying:
        return None
    model, seen = next(iter(varying.items()))
    listed = ", ".join(str(shape) for shape in seen[:3])
    who = f"{model}: " if model else ""
    evidence = [f"{who}{len(seen)} input shapes in the probed steps ({listed})", *_at(case.lines("cudnn_benchmark_on"))]
    return Finding(evidence, _compute_bound(case), "at most the forward and backward time")


@rule(
    "channels_last",
    "Use channels_last for the conv net under mixed precision",
    "Tensor-core convolution kernels want NHWC; with NCHW tensors cuDNN inserts a transpose around every convolution.",
    "model = model.to(memory_format=torch.channels_last); x = x.to('cuda', memory_format=torch.channels_last)",
    "code",
)
def _channels_last(case: Case) -> Finding | None:
    convs = sum(m.get("convs", 0) for m in case.models())
    inputs = [s for s in case.facts.get("inputs", []) if "channels_last" in s]
    if not case.cuda or not convs or not case.autocast() or not inputs or any(s["channels_last"] for s in inputs):
        return None
    evidence = [f"{convs} convolution layer(s) under autocast {case.facts['autocast']}", "4-D inputs are NCHW"]
    return Finding(evidence, _compute_bound(case), "at most the forward and backward time")


@rule(
    "zero_grad.set_to_none",
    "Drop gradients instead of zeroing them",
    "zero_grad(set_to_none=False) writes zeros into every gradient each step (one kernel or memset per "
    "parameter) and the next backward then adds into them, instead of writing them fresh.",
    "optimizer.zero_grad()  (set_to_none=True is the default)",
    "config",
)
def _set_to_none(case: Case) -> Finding | None:
    share = case.share("zero_grad")
    if case.facts.get("zero_grad", {}).get("set_to_none") is not False or (case.measured and share < MIN_GAIN):
        return None
    evidence = ["zero_grad was called with set_to_none=False", *_at(case.lines("zero_grad_keep"))]
    if case.ms("zero_grad") is not None:
        evidence.append(f"zero_grad takes {case.ms('zero_grad'):.2f} ms per step ({pct(share)})")
    return Finding(evidence, share, "at most the zero_grad time (the backward's accumulation is not timed apart)")


@rule(
    "debug.anomaly",
    "Turn off autograd anomaly detection",
    "Anomaly mode records a Python stack trace for every autograd node in forward and checks every backward "
    "output for NaN: a debugging tool that slows both passes several times.",
    "remove torch.autograd.set_detect_anomaly(True) / detect_anomaly() from training runs",
    "config",
)
def _anomaly(case: Case) -> Finding | None:
    runtime = case.torch_flag("anomaly")
    hits = case.lines("anomaly")
    if runtime is False or (runtime is None and not hits):
        return None
    evidence = ["anomaly detection was on during the measured steps" if runtime else "the script enables it"]
    evidence += _at(hits)
    share = _compute_bound(case) if case.measured else None
    return Finding(evidence, share, "at most the forward and backward time" if share is not None else "no steps")


@rule(
    "debug.profiler",
    "Stop the profiler that runs during training",
    "An autograd profiler left running records every operator call, which costs host time on each one.",
    "profile only a few steps (torch.profiler.schedule), or remove the profiler from the training run",
    "config",
)
def _profiler(case: Case) -> Finding | None:
    if not case.torch_flag("profiler"):
        return None
    evidence = ["a torch profiler was recording during the measured steps", *_at(case.lines("profiler"))]
    return Finding(evidence, None, "its cost is spread over every operator; no phase share isolates it")


@rule(
    "debug.gradcheck",
    "Keep gradcheck out of the training script",
    "gradcheck evaluates the function many times in float64 with finite differences: a test, not training.",
    "move gradcheck/gradgradcheck calls into the test suite",
    "code",
)
def _gradcheck(case: Case) -> Finding | None:
    hits = case.lines("gradcheck")
    if not hits:
        return None
    return Finding(_at(hits), None, "its cost depends on where it runs; not timed as a phase")


@rule(
    "debug.deterministic",
    "Allow non-deterministic kernels",
    "Deterministic mode forbids the fastest kernels for some operations (scatter/index_add, some convolution "
    "algorithms): runs become bit-reproducible at the price of speed.",
    "torch.use_deterministic_algorithms(False) and torch.backends.cudnn.deterministic = False outside "
    "reproducibility runs",
    "config",
    changes_numerics=True,
)
def _deterministic(case: Case) -> Finding | None:
    on = [n for n in ("deterministic_algorithms", "cudnn_deterministic") if case.torch_flag(n)]
    if not case.cuda or not on:
        return None
    evidence = [f"{' and '.join(on)} on", *_at(case.lines("deterministic"))]
    return Finding(evidence, _compute_bound(case), "at most the forward and backward time")


# -- precision and kernels -------------------------------------------------------------------------------------


@rule(
    "precision.bf16",
    "Train in bfloat16 mixed precision",
    "This GPU runs bfloat16 matmuls on tensor cores at many times its float32 rate and halves activation "
    "memory; bfloat16 needs no loss scaling.",
    "with torch.autocast('cuda', dtype=torch.bfloat16): loss = model(x) ...",
    "code",
    changes_numerics=True,
)
def _bf16(case: Case) -> Finding | None:
    device, capability = case.facts.get("device"), _capability(case)
    # is_bf16_supported() counts emulation on older GPUs: only Ampere and newer have bf16 tensor cores
    if device is None or capability is None or capability < AMPERE or not device.get("bf16"):
        return None
    if case.autocast() is not False or not _fp32_model(case):
        return None
    evidence = [f"{device['name']} supports bfloat16; the model trains in float32 with no autocast"]
    return Finding(evidence, _compute_bound(case), "at most the forward and backward time")


@rule(
    "sdpa.math",
    "Give attention inputs a fused kernel",
    "scaled_dot_product_attention falls back to its math kernel (materialising the full attention matrix) when no "
    "fused kernel (flash, memory-efficient, cuDNN) accepts the inputs: float32 inputs, an unsupported mask or "
    "head dimension.",
    "run attention in bf16/fp16 (autocast), use is_causal=True instead of a dense causal mask, keep head_dim a "
    "multiple of 8 and ≤ 256",
    "code",
)
def _sdpa(case: Case) -> Finding | None:
    slow = [c for c in case.facts.get("sdpa", []) if not (c["flash"] or c["efficient"] or c["cudnn"])]
    if not slow:
        return None
    call = slow[0]
    reasons = []
    if call["dtype"] == "float32":
        reasons.append("float32 inputs")
    if call["mask"]:
        reasons.append("an explicit attention mask")
    if call["head_dim"] % 8 or call["head_dim"] > 256:
        reasons.append(f"head_dim {call['head_dim']}")
    evidence = [f"no fused attention kernel accepts the inputs ({', '.join(reasons) or 'see SDPA debug warnings'})"]
    return Finding(evidence, _compute_bound(case), "at most the forward and backward time")


@rule(
    "compile.recompile_limit",
    "torch.compile gave up recompiling a function",
    "A compiled function that keeps recompiling (changing shapes, Python values, dtypes) hits the recompile "
    "limit; from then on it runs eagerly, uncompiled.",
    'find the cause with TORCH_LOGS="recompiles"; mark dynamic dimensions (torch._dynamo.mark_dynamic) or '
    "compile with dynamic=True",
    "code",
)
def _recompile_limit(case: Case) -> Finding | None:
    hits = case.facts.get("dynamo", {}).get("recompile_limit_hits", 0)
    if not hits:
        return None
    return Finding([f"{hits} function(s) hit the recompile limit"], None, "the eager fallback is not timed apart")


@rule(
    "compile.graph_breaks",
    "Remove torch.compile's graph breaks",
    "Each graph break splits the compiled region: Python runs between the pieces and fusion stops at the boundaries.",
    'list them with TORCH_LOGS="graph_breaks" and rewrite the breaking code (prints, .item(), data-dependent '
    "control flow)",
    "code",
)
def _graph_breaks(case: Case) -> Finding | None:
    breaks = case.facts.get("dynamo", {}).get("graph_breaks", {})
    if not breaks:
        return None
    top = sorted(breaks.items(), key=lambda item: -item[1])[:3]
    evidence = [f"{sum(breaks.values())} graph break(s)", *[f"{n}× {reason}" for reason, n in top]]
    return Finding(evidence, None, "the cost of a break depends on what it splits; not timed apart")


# -- memory and speed -----------------------------------------------------------------------------------------


def _memory_use(case: Case) -> float | None:
    device = case.facts.get("device")
    if device is None or not device.get("total_mb"):
        return None
    return device["peak_allocated_mb"] / device["total_mb"]


@rule(
    "memory.checkpointing",
    "Checkpoint fewer activations: memory is to spare",
    "Activation checkpointing recomputes the checkpointed forward during backward to save memory; with memory "
    "left over, that recomputation is time spent for nothing.",
    "checkpoint fewer layers (or none) until peak memory nears the device's capacity",
    "code",
)
def _checkpointing(case: Case) -> Finding | None:
    calls = case.summary.counters.get("checkpoint_calls", 0)
    used = _memory_use(case)
    if not calls or used is None or used >= HEADROOM:
        return None
    evidence = [f"{calls:.0f} checkpointed region(s) per step", f"peak memory is {pct(used)} of the device"]
    share = case.share("forward")
    return Finding(evidence, share, "at most one forward pass of recomputation")


@rule(
    "memory.batch_size",
    "Use the free memory for a larger micro-batch",
    "Peak memory is far below the device's capacity: a larger micro-batch (or fewer accumulation steps) gives "
    "the GPU bigger kernels per launch. It changes the optimisation (tune the learning rate with it).",
    "raise the per-device batch size until peak memory is ~80% of the device",
    "config",
    changes_numerics=True,
)
def _batch_size(case: Case) -> Finding | None:
    used = _memory_use(case)
    if used is None or used >= HEADROOM / 2 or case.share("data_wait") >= 0.3:
        return None
    evidence = [f"peak memory is {pct(used)} of the device"]
    return Finding(evidence, None, "the speed-up of a larger batch depends on kernel efficiency: measure it (ab)")


@rule(
    "memory.alloc_retries",
    "Stop the CUDA allocator from flushing its cache",
    "When the caching allocator cannot find a free block it frees its whole cache and retries, synchronising "
    "the device: fragmentation or memory pressure.",
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or a smaller batch",
    "config",
)
def _alloc_retries(case: Case) -> Finding | None:
    retries = case.facts.get("device", {}).get("alloc_retries", 0)
    if not retries:
        return None
    return Finding([f"{retries} allocator retries (cache flushes)"], None, "the flushes are not timed apart")


# -- host ---------------------------------------------------------------------------------------------------------


@rule(
    "host.sync",
    "Stop reading GPU values every step",
    "Each .item(), .cpu() or print of a CUDA tensor waits until the GPU has finished all queued work, so the "
    "host cannot queue the next kernels ahead: the GPU idles while Python catches up.",
    "accumulate metrics on the GPU and read them every N steps (or log the tensor and read it later)",
    "code",
)
def _host_sync(case: Case) -> Finding | None:
    syncs = case.summary.counters.get("host_syncs", 0.0)
    items = case.summary.counters.get("item_calls", 0.0)
    hits = case.lines("loop_sync")
    if case.cuda:
        if syncs < 1:
            return None
        share = case.groups.get("host", 0.0)
        evidence = [f"{syncs:.1f} host-device syncs per step", f"the GPU had no work for {pct(share)} of the step"]
        return Finding(evidence + _at(hits), share, "at most the time the GPU had no work outside data waits")
    if items < 1 or not hits:
        return None
    # On the CPU a scalar read waits for nothing; it is listed because the same code stalls a GPU every step.
    evidence = [f"{items:.1f} .item()/.tolist() calls per step in the script", *_at(hits)]
    why = (
        "on this CPU run a scalar read waits for no device, so it cannot be bounded here; on a GPU it stalls each step"
    )
    return Finding(evidence, None, why)


@rule(
    "host.launch_bound",
    "Cut Python and launch overhead between kernels",
    "The GPU is idle for much of the step outside data waits: the host cannot launch kernels as fast as the GPU "
    "runs them (many small ops, Python between them).",
    "torch.compile(model) to fuse small ops, CUDA graphs (torch.compile(mode='reduce-overhead')), or larger "
    "batches per launch",
    "code",
)
def _launch_bound(case: Case) -> Finding | None:
    if case.summary.meta.timing != "cuda" or not case.measured:
        return None
    share = case.groups.get("host", 0.0)
    signal = None if gpu_work_measured(case.summary) else case.signals().get("launch_bound")
    if share < MIN_HOST_SHARE and signal is None:
        return None
    evidence = [f"the GPU had no work for {pct(share)} of the step outside data waits"]
    if signal:
        evidence.append(signal)
    return Finding(evidence, share, "at most the time the GPU had no work")


@rule(
    "host.threads",
    "Use no more CPU threads than cores",
    "More intra-op threads than the cores this process may use (cgroup quota, affinity), counting the DataLoader "
    "worker processes that share those cores, make the threads preempt each other: CPU ops get slower, not faster, "
    "and the workers load more slowly.",
    "torch.set_num_threads(N) or OMP_NUM_THREADS=N with N ≤ usable cores ÷ ranks per machine − loader workers "
    "(at least 1)",
    "config",
)
def _threads(case: Case) -> Finding | None:
    threads = case.facts.get("threads")
    workers = case.busy_workers()
    crowded = threads_for_workers(case.facts, workers) if threads else None
    if not threads or crowded is None:
        return None
    torch_threads, fit, cores = crowded
    quota = threads.get("cpu_quota")
    local = case.local_ranks()
    what = f"cgroup quota of {quota:g} cores" if quota else f"{cores:g} usable cores"
    evidence = [f"{torch_threads} torch threads × {local} rank(s) for a {what}"]
    if workers:
        evidence.append(f"beside {workers} busy loader worker process(es) per rank, each a core while it loads")
    env = threads.get("env", {})
    if env:
        evidence.append("set in the environment: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    contention = case.signals().get("cpu_contention")
    if contention:
        evidence.append(contention)
    how = f"torch.set_num_threads({fit}) (or OMP_NUM_THREADS)"
    why = "oversubscription costs depend on the scheduler; ranked first: every CPU phase's share is inflated by it"
    return Finding(evidence, None, why, how=how, apply=f"host.threads={fit}")


MIN_CHURN_SHARE = 0.03  # of the step: page faults that cost less are not worth a setting


@rule(
    "host.malloc_churn",
    "Keep freed memory in the process instead of faulting it in again every step",
    "glibc's malloc gives large freed blocks (activations, gradients) back to the kernel, and the next step faults "
    "every page of them in again: a trap into the kernel and a zeroed page each. Its thresholds move with what the "
    "process freed before, so the same script churns in one run and not in the next.",
    "MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=67108864 in the environment (glibc), or LD_PRELOAD a "
    "pooling allocator (libjemalloc.so.2, libtcmalloc.so.4), as PyTorch's CPU performance guide advises",
    "config",
)
def _malloc_churn(case: Case) -> Finding | None:
    malloc = case.facts.get("malloc") or {}
    per_step, us = malloc.get("faults_per_step"), malloc.get("us_per_fault")
    total = case.summary.phases.get(TOTAL)
    step_ms = total.mean_ms if total is not None else None
    if malloc.get("allocator") != "glibc" or malloc.get("tuned") or not per_step or not us or not step_ms:
        return None
    share = min(per_step * us / 1e3 / step_ms, 1.0)
    if share < MIN_CHURN_SHARE:
        return None
    evidence = [
        f"{per_step:,.0f} minor page faults a step in the training process, {us:.1f} µs each measured here (a "
        f"256 KB block mapped, written and unmapped): {pct(share)} of the step"
    ]
    return Finding(
        evidence, share, "at most the time its page faults take at the cost measured here",
        apply="malloc.mmap_threshold",
    )  # fmt: skip


# -- host time by source line (RunSummary.hotspots, from the stack sampler) ---------------------------------------

MIN_HOT_SAMPLES = 5  # stack samples on a line before a rule trusts it
MIN_HOT_SHARE = 0.05  # of the step: a line below this is not worth a code change
_SAVE = re.compile(r"^_?save(_\w+)?$|_save$")  # torch.save, save_checkpoint, save_file, trainer.save
_LOG_MODULES = ("logging.", "tqdm.", "wandb.", "mlflow.", "tensorboardX.", "torch.utils.tensorboard.", "aim.")
_LOG_CODE = re.compile(
    r"\bprint\(|\bsys\.std(out|err)\.write\(|\.add_(scalar|scalars|histogram|image|text)\(|\bwandb\.log\(|"
    r"\b(log|logger|logging|LOG|LOGGER)\.(debug|info|warning|error|critical|exception|log)\(|\btqdm\.write\("
)
_DATA = re.compile(r"collate|transform|augment|preprocess|tokeni[sz]e|decode|__getitem__|load_(image|sample|item)")
_DATA_MODULES = ("torchvision.transforms.", "PIL.", "cv2.", "albumentations.", "torchaudio.transforms.")


def _last(name: str | None) -> str:
    return (name or "").rsplit(".", 1)[-1]


Match = Callable[[dict[str, Any]], bool]


def _hot_lines(case: Case, matches: dict[str, Match]) -> Finding | None:
    """A finding from the sampled lines that ``matches[phase]`` accepts, when together they take at least
    MIN_HOT_SHARE of the step; its bound is their share of the step (host time)."""
    found: list[tuple[str, dict[str, Any], float]] = []
    for phase, match in matches.items():
        stats = case.summary.phases.get(phase)
        if stats is None or stats.nested or not case.measured:
            continue
        for row in case.summary.hotspots.get("phases", {}).get(phase, []):
            if row.get("samples", 0) >= MIN_HOT_SAMPLES and match(row):
                found.append((phase, row, row["share"] * stats.share))
    share = sum(step_share for _, _, step_share in found)
    if share < MIN_HOT_SHARE:
        return None
    found.sort(key=lambda item: -item[2])
    evidence = [
        f"{phase}: {describe_line(row)} is {pct(row['share'])} of {phase}, {pct(step_share)} of the step "
        f"({row['ms_per_step']:.1f} ms per step, {row['samples']} stack samples)"
        for phase, row, step_share in found[:3]
    ]
    return Finding(evidence, share, "at most the step time the sampled lines took")


@rule(
    "host.checkpoint_every_step",
    "Save checkpoints less often, or asynchronously",
    "Serialising the model and writing it out blocks the training loop for as long as the write takes; done every "
    "step, that time is added to every step.",
    "save every N steps or minutes (if step % N == 0), or in the background (torch.distributed.checkpoint.async_save, "
    "or a thread writing a copy of the state_dict)",
    "code",
)
def _checkpoint_every_step(case: Case) -> Finding | None:
    def saves(row: dict[str, Any]) -> bool:
        return bool(_SAVE.search(_last(row.get("calls"))) or _SAVE.search(_last(row.get("function"))))

    return _hot_lines(case, {"other": saves})


@rule(
    "host.log_every_step",
    "Log every N steps, not every step",
    "Formatting and writing metrics (print, logging, progress bars, TensorBoard/W&B scalars) runs in the training "
    "loop between steps; done every step, its host time is added to every step (and reading a CUDA tensor to log "
    "it waits for the GPU).",
    "log every N steps (if step % N == 0), accumulating the values in between",
    "code",
)
def _log_every_step(case: Case) -> Finding | None:
    def logs(row: dict[str, Any]) -> bool:
        calls = row.get("calls") or ""
        return calls.startswith(_LOG_MODULES) or bool(_LOG_CODE.search(row.get("code") or ""))

    return _hot_lines(case, {"other": logs, "sync": logs})


@rule(
    "host.data_in_loop",
    "Move Python data work into the Dataset and the DataLoader workers",
    "Data preparation written in the training loop runs on the training thread between steps instead of beside "
    "them in worker processes. (A Dataset run by a DataLoader without workers is loader.num_workers' to fix.)",
    "do it in Dataset.__getitem__ or collate_fn and load with DataLoader(..., num_workers=N)",
    "code",
)
def _data_in_loop(case: Case) -> Finding | None:
    def in_loop(row: dict[str, Any]) -> bool:
        calls = row.get("calls") or ""
        return bool(_DATA.search(row.get("function") or "") or _DATA.search(_last(calls))) or calls.startswith(
            _DATA_MODULES
        )

    return _hot_lines(case, {"other": in_loop})


# -- distributed and optimizer ---------------------------------------------------------------------------------


def _ddp(case: Case) -> dict[str, Any] | None:
    return next((m["ddp"] for m in case.models() if "ddp" in m), None)


@rule(
    "ddp.find_unused_parameters",
    "Turn off find_unused_parameters: every parameter gets a gradient",
    "With find_unused_parameters=True, DDP traverses the autograd graph after every forward to find parameters "
    "that will get no gradient; the audit found none.",
    "DistributedDataParallel(model, ..., find_unused_parameters=False)",
    "config",
)
def _find_unused(case: Case) -> Finding | None:
    ddp = _ddp(case)
    audits = case.summary.params
    if ddp is None or not ddp["find_unused_parameters"] or not audits or not audits[0].get("steps"):
        return None  # no backward pass audited: nothing is known about unused parameters
    if any(a.get("unused") or a.get("conditional") for a in audits):
        return None
    evidence = [
        "find_unused_parameters=True",
        f"the parameter audit over {audits[0].get('steps', 1)} backward pass(es) found no parameter without a gradient",
        *_at(case.lines("find_unused_parameters")),
    ]
    return Finding(evidence, case.share("forward"), "at most the forward time (the graph walk ends the forward)")


@rule(
    "ddp.gradient_as_bucket_view",
    "Let gradients live in DDP's communication buckets",
    "By default DDP copies every gradient into its all-reduce buckets and back; gradient_as_bucket_view=True "
    "makes the gradients views of the buckets, saving the copies and their memory.",
    "DistributedDataParallel(model, ..., gradient_as_bucket_view=True)",
    "config",
)
def _bucket_view(case: Case) -> Finding | None:
    ddp = _ddp(case)
    if ddp is None or ddp["gradient_as_bucket_view"]:
        return None
    evidence = [f"gradient_as_bucket_view=False (bucket_cap_mb={ddp['bucket_cap_mb']:g})"]
    bound, why = case.share("backward"), "at most the backward time, where the copies happen"
    params = sum(m.get("params") or 0 for m in case.models() if "ddp" in m)
    step_ms = case.ms(TOTAL)
    if params and step_ms:
        # Two copies of every gradient (into the buckets and back), at most 4 bytes a value, at a low bandwidth.
        speed = GPU_COPY_BYTES_PER_S if case.summary.meta.timing == "cuda" else CPU_COPY_BYTES_PER_S
        copies = 2 * 4 * params / speed * 1e3 / step_ms
        if copies < bound:
            bound, why = copies, f"at most copying {params:,} gradients twice per step"
            evidence.append(f"{params:,} parameters: two gradient copies take at most {copies * step_ms:.3f} ms")
    return None if bound < MIN_GAIN else Finding(evidence, bound, why)


@rule(
    "fsdp.prefetch",
    "Prefetch FSDP's parameter all-gathers",
    "Without prefetching, FSDP gathers each unit's parameters only when it is needed, so communication and "
    "compute alternate instead of overlapping.",
    "FSDP(model, backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=True)",
    "config",
)
def _fsdp_prefetch(case: Case) -> Finding | None:
    fsdp = next((m["fsdp"] for m in case.models() if "fsdp" in m), None)
    if fsdp is None or (fsdp["backward_prefetch"] and fsdp["forward_prefetch"]):
        return None
    evidence = [f"backward_prefetch={fsdp['backward_prefetch']}, forward_prefetch={fsdp['forward_prefetch']}"]
    return Finding(evidence, case.share("forward", "backward"), "at most the forward and backward time")


@rule(
    "fsdp.full_shard_fits",
    "Shard less: one replica fits on a GPU",
    "Full sharding (ZeRO-3) all-gathers the parameters in every forward and backward; when parameters, "
    "gradients and optimizer states fit on one device, ZeRO-2 (SHARD_GRAD_OP) or DDP skip those gathers.",
    "FSDP(model, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP), or DDP",
    "config",
)
def _full_shard_fits(case: Case) -> Finding | None:
    fsdp = next((m for m in case.models() if "fsdp" in m), None)
    device = case.facts.get("device")
    if fsdp is None or device is None or fsdp["fsdp"]["sharding_strategy"] != "FULL_SHARD":
        return None
    world = case.summary.world_size
    replica_mb = fsdp["param_mb"] * world * ADAM_BYTES_PER_PARAM_BYTE  # param_mb is this rank's shard
    if replica_mb > ZERO3_FITS * device["total_mb"]:
        return None
    evidence = [f"an unsharded replica needs ~{replica_mb / 1024:.1f} GiB of {device['total_mb'] / 1024:.0f} GiB"]
    return Finding(evidence, case.share("forward", "backward"), "at most the forward and backward time")


@rule(
    "optimizer.fused",
    "Use the fused optimizer kernel",
    "The default optimizer step runs the update as a chain of separate ops: on CPU tensors a Python loop over "
    "parameters, on GPUs several multi-tensor (foreach) launches; the fused kernel updates all of them in one pass.",
    "torch.optim.AdamW(params, ..., fused=True)",
    "config",
)
def _fused(case: Case) -> Finding | None:
    candidates = [o for o in case.facts.get("optimizers", []) if o["has_fused"] and not o["fused"]]
    share = case.share("optimizer")
    if not candidates or not case.measured or share < MIN_GAIN:
        return None
    opt = candidates[0]
    how = f"torch.optim.{opt['type']}(params, ..., fused=True)"
    mode = "foreach" if opt["foreach"] else "per-parameter loop" if opt["device"] == "cpu" else "default (foreach)"
    evidence = [
        f"{opt['type']} over {opt['params']} parameter tensors on {opt['device']}, {mode} implementation",
        f"optimizer.step is {pct(share)} of the step ({case.ms('optimizer') or 0:.2f} ms)",
    ]
    return Finding(evidence, share, "at most the optimizer step's time", how=how)


@rule(
    "optimizer.foreach",
    "Use the foreach optimizer implementation",
    "Without foreach the optimizer updates parameters one by one in Python; foreach batches the math over all "
    "parameters in a few multi-tensor ops.",
    "torch.optim.<Optimizer>(params, ..., foreach=True)",
    "config",
)
def _foreach(case: Case) -> Finding | None:
    def loops(o: dict[str, Any]) -> bool:  # foreach off, or left to the default, which loops on CPU tensors
        return o["foreach"] is False or (o["foreach"] is None and o["device"] == "cpu")

    candidates = [o for o in case.facts.get("optimizers", []) if o["has_foreach"] and not o["has_fused"] and loops(o)]
    share = case.share("optimizer")
    if not candidates or not case.measured or share < MIN_GAIN:
        return None
    opt = candidates[0]
    evidence = [f"{opt['type']} over {opt['params']} parameter tensors runs its per-parameter loop"]
    how = f"torch.optim.{opt['type']}(..., foreach=True)"
    return Finding(evidence, share, "at most the optimizer step's time", how=how)


# -- validation passes (RunSummary.eval: kept out of the step) ---------------------------------------------------

MIN_EVAL_SHARE = 0.10  # validation below this share of wall time is not worth trading away


@rule(
    "eval.frequency",
    "Validate less often, or on a subset",
    "Validation passes between training steps take wall time in which nothing trains; they are kept out of the step "
    "figures, so no step-time fix shortens them.",
    "run the validation loop every N× more steps, or on a fixed subset of the validation set (and without "
    "gradients: torch.no_grad()/inference_mode())",
    "config",
)
def _eval_frequency(case: Case) -> Finding | None:
    passes = case.summary.eval
    if not passes or passes["share_of_wall"] < MIN_EVAL_SHARE:
        return None
    per_steps = case.summary.steps.measured / passes["passes"]
    evidence = [
        f"{passes['passes']} validation pass(es) of {passes['mean_ms']:.1f} ms (mean) took "
        f"{pct(passes['share_of_wall'])} of wall time, one every {per_steps:.0f} training steps",
        f"a pass runs {passes['forwards_per_pass']:.0f} forward(s) over {passes['batches_per_pass']:.0f} batch(es)",
    ]
    return Finding(evidence, passes["share_of_wall"], "at most the wall time the validation passes took", basis="wall")


# -- measurement hygiene ---------------------------------------------------------------------------------------


@rule(
    "hygiene.compile_in_window",
    "Measure after torch.compile has finished compiling",
    "Graphs were compiled during the measured steps, so the step times include compilation: the figures "
    "overstate the steady-state step.",
    "stepscope doctor --warmup N with N past the last compilation (or precompile with example inputs)",
    "config",
)
def _compile_in_window(case: Case) -> Finding | None:
    graphs = case.facts.get("dynamo", {}).get("graphs_in_window")
    if not graphs:
        return None
    total = case.summary.phases.get(TOTAL)
    evidence = [f"{graphs} graph(s) compiled during the measured steps"]
    if total is not None:
        evidence.append(f"step time p95 {total.p95_ms:.1f} ms against a median of {total.median_ms:.1f} ms")
    return Finding(evidence, None, "a measurement fix: it changes the figures, not the training")


@rule(
    "hygiene.warmup",
    "Skip more warm-up steps before measuring",
    "The first steps pay for allocator growth, cuDNN autotuning and lazy initialisation; measured with too little "
    "warm-up they inflate the mean.",
    "stepscope doctor --warmup 20 (or more)",
    "config",
)
def _warmup(case: Case) -> Finding | None:
    total = case.summary.phases.get(TOTAL)
    if total is None or case.summary.steps.warmup >= 5 or total.p95_ms < 3 * total.median_ms:
        return None
    if any(e.index > 0 for e in case.summary.epochs):
        return None  # epoch restarts explain periodic slow steps as well as a short warm-up would
    if not _slow_start(case.summary):
        return None  # slow steps spread over the run (a busy machine, periodic work): not what warm-up cures
    evidence = [
        f"only {case.summary.steps.warmup} warm-up step(s)",
        f"step time p95 {total.p95_ms:.1f} ms against a median of {total.median_ms:.1f} ms",
    ]
    return Finding(evidence, None, "a measurement fix: it changes the figures, not the training")


WARM_STEPS = 3  # the first measured steps that a too-short warm-up leaves slow


def _slow_start(summary: RunSummary) -> bool:
    """Whether the slow steps are the first measured ones (what a too-short warm-up leaves), from the step-time
    series; True when the series cannot tell (absent, or merged: steps averaged in pairs)."""
    series = summary.series
    if series is None or series.stride != 1:
        return True
    measured = series.step_ms[summary.steps.warmup :]
    if len(measured) < 2 * WARM_STEPS:
        return True
    first, rest = measured[:WARM_STEPS], sorted(measured[WARM_STEPS:])
    return max(first) >= 3 * rest[len(rest) // 2]


# -- ranking --------------------------------------------------------------------------------------------------


def diagnose(case: Case) -> tuple[list[Fix], list[str]]:
    """Every fix whose rule applies, ranked: fixes bounded below ``MATERIAL_GAIN`` of the step last; fixes whose
    problem distorts the other measurements (``FIRST``, never demoted) first; then the largest gain for the cost,
    the share of the wall window the bound can save over what the cost takes (unbounded last; ``_rank_key``).
    Returns the fixes and a note for each rule that failed on unexpected facts (the others still run). For a
    multi-rank job whose ranks wait for one straggler, the fixes and their bounds are the job's (``job_fixes``)."""
    fixes, notes = findings(case)
    straggler = attributed_straggler(case.summary)
    if straggler is not None:
        fixes, more = job_fixes(case, straggler, fixes)
        notes += more
    in_steps = _steps_share(case.summary)
    fixes.sort(key=lambda fix: _rank_key(fix, in_steps))
    return fixes, notes


# A wall-time fix (validate less often) trades away work the job chose to do, so its bound (every pass gone) is
# never the gain: it ranks by its smallest step, validating half as often, which saves half the passes' time.
WALL_TRADE_STEP = 0.5


def _steps_share(summary: RunSummary) -> float:
    """The share of the measured wall window inside training steps (1 when not measured)."""
    wall = summary.wall
    return wall.steps_s / wall.window_s if wall is not None and wall.window_s > 0 else 1.0


# What each cost takes, in units of a config change: the gain a fix is ranked by is its bound over this. A code
# change is a few times the work of a flag (and a review); infrastructure (storage, a new machine) far more. So a
# config knob that can save 6% ranks after a code change that can save 54%, and before one that can save 15%.
COST_WEIGHT = {"config": 1.0, "code": 3.0, "infra": 10.0}


def _rank_key(fix: Fix, in_steps: float) -> tuple[bool, int, bool, float, int]:
    """Gain for the cost, on one scale: the share of the wall window the bound can save (a step-time bound saves
    its share of the steps' part of the window, ``in_steps``) over ``COST_WEIGHT``. Unbounded fixes come after
    the bounded ones, cheapest first."""
    minor = fix.id not in FIRST and fix.gain_bound is not None and fix.gain_bound < MATERIAL_GAIN
    bound = fix.gain_bound or 0.0
    wall_gain = WALL_TRADE_STEP * bound if fix.gain_basis == "wall" else in_steps * bound
    worth = wall_gain / COST_WEIGHT[fix.cost]
    first = FIRST.index(fix.id) if fix.id in FIRST else len(FIRST)
    return minor, first, fix.gain_bound is None, -worth, COSTS.index(fix.cost)


def _saved_ms(fix: Fix, summary: RunSummary) -> float | None:
    """What a fix can save per step on the summary it was found on (ms), from its gain bound."""
    return None if fix.gain_bound is None else fix.gain_bound * summary.phases[TOTAL].mean_ms


def job_fixes(case: Case, straggler: Straggler, job_wide: list[Fix]) -> tuple[list[Fix], list[str]]:
    """The fixes of a job whose ranks wait for ``straggler``, bounded by the job's step time.

    The job's step is the straggler's (the others wait for it), so a fix gains the job only what it saves on the
    straggler's step: the rules run on that rank's own summary, loaders and facts. A fix that saves the straggler
    more than it saves the median other rank, by at least ``EXPLAINS`` of the straggler's excess, is aimed at
    the cause and gains the job at most that excess (then another rank sets the pace). A fix found only in the
    job-wide view (``job_wide``), not on the straggler, has no bound on the job's gain."""
    summary = case.summary
    rank, phase, excess_ms = straggler.rank, straggler.phase, straggler.excess_ms
    job_ms = summary.phases[TOTAL].mean_ms
    slow = rank_summary(summary, rank)
    if slow is None or TOTAL not in slow.phases or job_ms <= 0:
        return job_wide, []
    slow_fixes, notes = findings(Case(slow, case.lint))
    others = [r for r in summary.ranks if r is not slow and TOTAL in r.phases]
    saved_elsewhere = [{f.id: _saved_ms(f, r) or 0.0 for f in findings(Case(r, case.lint))[0]} for r in others]
    fixes = []
    for fix in slow_fixes:
        evidence = [f"rank {rank}: {line}" for line in fix.evidence]
        saved = _saved_ms(fix, slow)
        if saved is None or fix.gain_basis != "step":  # unbounded, or a share of wall time: no step to compare
            fixes.append(dataclasses.replace(fix, evidence=evidence))
            continue
        elsewhere = statistics.median(s.get(fix.id, 0.0) for s in saved_elsewhere) if saved_elsewhere else 0.0
        if saved - elsewhere >= EXPLAINS * excess_ms:
            gain_ms = min(saved, excess_ms)
            evidence.append(
                f"the other ranks wait for rank {rank}'s {phase}: fixing it saves the job at most its "
                f"{excess_ms:.1f} ms excess ({pct(excess_ms / job_ms)} of the {job_ms:.1f} ms job step)"
            )
            reason = f"at most rank {rank}'s excess in {phase}, which the other ranks wait for"
        else:
            gain_ms = saved
            reason = f"{fix.gain_reason}, on rank {rank}, whose step the other ranks wait for"
        bound = round(max(0.0, min(1.0, gain_ms / job_ms)), 4)
        fixes.append(dataclasses.replace(fix, evidence=evidence, gain_bound=bound, gain_reason=reason))
    found = {f.id for f in fixes}
    reason = f"not found on rank {rank}, whose step the other ranks wait for: no bound on what it gains the job"
    fixes += [dataclasses.replace(f, gain_bound=None, gain_reason=reason) for f in job_wide if f.id not in found]
    return fixes, [f"rank {rank}: {note}" for note in notes]


def findings(case: Case) -> tuple[list[Fix], list[str]]:
    """Every fix whose rule applies to ``case`` (unranked), bounded on its own summary's step, and a note for each
    rule that failed on unexpected facts."""
    fixes: list[Fix] = []
    notes: list[str] = []
    for entry in CATALOGUE:
        try:
            finding = entry.check(case)
        except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as error:
            notes.append(f"rule {entry.id} could not read the facts ({type(error).__name__}: {error})")
            continue
        if finding is None:
            continue
        bound = None if finding.gain_bound is None else round(max(0.0, min(1.0, finding.gain_bound)), 4)
        fixes.append(
            Fix(
                id=entry.id,
                title=entry.title,
                why=entry.why,
                evidence=finding.evidence,
                how=finding.how or entry.how,
                cost=entry.cost,
                gain_bound=bound,
                gain_reason=finding.gain_reason,
                changes_numerics=entry.changes_numerics,
                gain_basis=finding.basis,
                apply=finding.apply,
            )
        )
    return fixes, notes


def catalogue_markdown() -> str:
    """docs/fixes.md: every fix id with its mechanism, change, cost and numerics, from the catalogue."""
    lines = [
        "# Fix catalogue",
        "",
        "Generated from `stepscope/doctor/rules.py` (`python -m stepscope.doctor.rules > docs/fixes.md`); do not edit",
        "by hand. `stepscope doctor` ranks the fixes that apply by gain for the cost: `gain_bound` (an upper bound",
        "on the step-time saving from the measured shares, Amdahl, or a measured ceiling) over what the cost takes",
        "(`config` 1, `code` 3, `infra` 10). A rule whose facts were not measured stays silent.",
        "",
        "| id | fix | cost | changes numerics |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{r.id}` | {r.title} | {r.cost} | {'yes' if r.changes_numerics else 'no'} |" for r in CATALOGUE]
    for r in CATALOGUE:
        numerics = " **Changes numerics.**" if r.changes_numerics else ""
        lines += [
            "",
            f"## `{r.id}`: {r.title}",
            "",
            f"**Why.** {r.why}",
            "",
            f"**How.** {r.how}",
            "",
            f"**Cost:** {r.cost}.{numerics}",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(catalogue_markdown(), end="")
