"""A/B comparison of training variants: each run's figures from its RunSummary, and the speedup with a confidence
interval. Pure functions over data: no processes, no files (running the variants: instrument/ab.py; the table:
report/ab.py).

The unit of evidence is a run, not a step: steps within a run share the run's luck (placement, allocator state,
clocks, a neighbour's load), so thousands of step times would claim a precision the runs do not have. Each run
gives one figure, its mean measured sec/step, and a variant has a handful of them (``--repeats``, 5 by default).

Why a studentized bootstrap (bootstrap-t) of the log sec/step: with 5 runs a plain percentile bootstrap of the
mean undercovers — its resampled means spread by sqrt((n-1)/n) of the true standard error and it has no notion of
the extra uncertainty of an estimated variance (Student's t), so at 95% it excludes a true ratio of 1 in 11-15% of
simulated experiments; BCa fixes skew, not that, and does no better. The bootstrap-t resamples the t statistic
itself, (resampled difference - observed) / resampled standard error, so the heavier tails that come from
estimating the noise from few runs are in its quantiles, while the skew of real run times is kept (unlike a plain
Welch interval). Working on log sec/step makes the ratio a difference of means and treats a run 2% slower the
same in both variants (run noise is multiplicative); the Welch standard error lets the variants be unequally
noisy. Simulated with 5 runs per variant and noise like real runs (3% log-normal, and 15% of runs 3-8% slower;
tests/test_ab.py), 2,400 experiments: 4.9% false positives at 95% (the nominal 5%), and a true 10% speedup found
in 86% of experiments.

With 2 runs of each variant, half of each variant's resamples repeat one run and have no spread, so more than 2.5%
of the t statistics are infinite: the interval is unbounded and none is given, with the reason. 3 runs per variant
are the least that bound it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from stepscope.summary import RunSummary

CONFIDENCE = 0.95
RESAMPLES = 10_000
SEED = 0  # the bootstrap is seeded: the same runs give the same interval
METHOD = "studentized bootstrap (bootstrap-t) of mean log sec/step, Welch standard error, resampled per variant"

FASTER, SLOWER, NO_DIFFERENCE, UNKNOWN = "faster", "slower", "no detectable difference", "unknown"
BATCH_TOLERANCE = 0.01  # batches closer than 1% are the same batch (a ragged last batch moves the mean a little)
# FSDP sharding strategies by the ZeRO stage each is (hybrid: within a node, replicated across nodes).
_ZERO = {
    "FULL_SHARD": "ZeRO-3",
    "SHARD_GRAD_OP": "ZeRO-2",
    "HYBRID_SHARD": "hybrid ZeRO-3",
    "_HYBRID_SHARD_ZERO2": "hybrid ZeRO-2",
    "NO_SHARD": "no shard",
}


@dataclass
class RunFigures:
    """One run of a variant, as its RunSummary measured it."""

    order: int  # position in the interleaved sequence of all runs, from 1
    exit_code: int
    exit_reason: str | None  # the summary's exit.reason: "stopped", "finished", "error", ...
    measured_steps: int
    sec_per_step: float | None  # mean measured step time, s (the slowest rank's with several)
    samples_per_s: float | None  # summed over ranks
    peak_mem_mb: float | None  # MiB: torch's max reserved, else NVML's device peak, else host peak RSS
    peak_mem_source: str | None  # "torch reserved", "gpu (nvml)" or "host rss"
    per_rank_batch: float | None  # samples per optimizer step on one rank (gradient accumulation included)
    global_batch: float | None  # per_rank_batch × world_size
    world_size: int
    backend: str  # "single process", "DDP", "FSDP ZeRO-3", "FSDP ZeRO-2", "torch.distributed" (no known wrapper)
    failure: str | None = None  # why the run is left out of the comparison; None when it is usable

    @property
    def usable(self) -> bool:
        return self.failure is None


@dataclass
class VariantResult:
    """A variant's runs and its figures over the usable ones."""

    name: str
    command: str
    env: dict[str, str]
    runs: list[RunFigures]
    usable_runs: int = 0
    sec_per_step: float | None = None  # median over usable runs, s
    sec_per_step_range: tuple[float, float] | None = None  # (fastest, slowest) usable run, s
    samples_per_s: float | None = None  # median over usable runs
    peak_mem_mb: float | None = None  # the highest peak of its usable runs, MiB: what must fit
    peak_mem_source: str | None = None
    per_rank_batch: float | None = None
    global_batch: float | None = None
    world_size: int | None = None
    backend: str | None = None


@dataclass
class Comparison:
    """A candidate variant against the baseline (the first variant)."""

    baseline: str
    candidate: str
    speedup: float | None  # baseline sec/step / candidate sec/step (geometric means over runs): > 1, candidate faster
    speedup_ci: tuple[float, float] | None  # the interval at ``confidence``; None with ``reason``
    faster: str | None  # the variant that is faster with confidence; None when it cannot be told
    verdict: str  # the candidate is "faster", "slower", "no detectable difference", or "unknown" (no interval)
    reason: str | None = None  # why there is no interval
    confidence: float = CONFIDENCE
    runs: tuple[int, int] = (0, 0)  # usable runs of (baseline, candidate)
    samples_per_s_ratio: float | None = None  # candidate / baseline median samples/s
    peak_mem_ratio: float | None = None  # candidate / baseline peak memory


@dataclass
class Settings:
    """How the A/B was run and analysed."""

    repeats: int  # runs of each variant, interleaved
    steps: int  # measured steps per run
    warmup: int  # steps skipped before measuring, per run
    confidence: float = CONFIDENCE
    resamples: int = RESAMPLES
    seed: int = SEED
    method: str = METHOD


@dataclass
class ABResult:
    """Everything an A/B measured and concluded; ``to_dict`` is the ``--json`` file."""

    settings: Settings
    variants: list[VariantResult]
    comparisons: list[Comparison]
    warnings: list[str] = field(default_factory=list)
    stopped: str | None = None  # why the A/B ended before its last run (interrupted)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "settings": asdict(self.settings),
            "variants": [asdict(v) for v in self.variants],
            "comparison": asdict(self.comparisons[0]) if self.comparisons else None,
        }
        if len(self.variants) > 2:
            data["comparisons"] = [asdict(c) for c in self.comparisons]
        data["warnings"] = self.warnings
        data["stopped"] = self.stopped
        return data


# -- one run ----------------------------------------------------------------------------------------------------


def run_figures(summary: RunSummary, exit_code: int, order: int) -> RunFigures:
    """The figures of one run from its (merged) summary and the command's exit code."""
    ranks = summary.ranks or [summary]
    world = summary.world_size
    step_ms = summary.throughput.step_time_ms
    batch = summary.batch_per_rank
    per_rank = None if batch is None else round(batch, 3)
    peak, source = _peak_memory(ranks)
    measured = summary.steps.measured
    return RunFigures(
        order=order,
        exit_code=exit_code,
        exit_reason=summary.exit.reason if summary.exit else None,
        measured_steps=measured,
        sec_per_step=None if step_ms is None else step_ms / 1000,
        samples_per_s=summary.throughput.samples_per_s,
        peak_mem_mb=peak,
        peak_mem_source=source,
        per_rank_batch=per_rank,
        global_batch=None if per_rank is None else per_rank * world,
        world_size=world,
        backend=backend(summary, world),
        failure=_failure(summary, exit_code),
    )


def _failure(summary: RunSummary, exit_code: int) -> str | None:
    if exit_code != 0:
        error = summary.exit.error if summary.exit else None
        return f"exited with code {exit_code}" + (f": {error}" if error else "")
    if not summary.steps.measured or summary.throughput.step_time_ms is None:
        if summary.steps.warmup:
            return f"no measured step: it ended after {summary.steps.warmup} warm-up steps (lower --warmup)"
        return "no measured step" + (f": {summary.notes[0]}" if summary.notes else "")
    return None


def _peak_memory(ranks: list[RunSummary]) -> tuple[float | None, str | None]:
    """The highest peak over the ranks. torch's max reserved is this process's own memory (NVML's device peak
    also counts the CUDA context and any other process on the device), so it comes first."""
    found: list[tuple[float, str]] = []
    for rank in ranks:
        system = rank.system
        reserved = system.get("memory", {}).get("max_reserved_mb")
        devices = [d["mem_peak_mb"] for d in system.get("gpu", {}).get("devices", []) if d.get("mem_peak_mb")]
        rss = system.get("host", {}).get("peak_rss_mb")
        if reserved is not None:
            found.append((reserved, "torch reserved"))
        elif devices:
            found.append((max(devices), "gpu (nvml)"))
        elif rss is not None:
            found.append((rss, "host rss"))
    if not found:
        return None, None
    return max(found)


def backend(summary: RunSummary, world: int) -> str:
    """The data-parallel strategy in words, from the models' wrappers in ``facts`` (rank 0's) and the world size:
    a process group with no known wrapper is "torch.distributed"."""
    models = (summary.ranks[0] if summary.ranks else summary).facts.get("models", [])
    name = None
    for model in models:
        wrapper = model.get("wrapper")
        if wrapper == "ddp":
            name = "DDP"
        elif wrapper == "fsdp":
            strategy = (model.get("fsdp") or {}).get("sharding_strategy")
            name = f"FSDP {_ZERO[strategy]}" if strategy in _ZERO else "FSDP"
        elif wrapper == "dp":
            name = "DataParallel"
        if name:
            break
    return name or ("torch.distributed" if world > 1 else "single process")


# -- a variant over its runs ------------------------------------------------------------------------------------


def variant_result(name: str, command: str, env: dict[str, str], runs: list[RunFigures]) -> VariantResult:
    """A variant's figures over its usable runs: median sec/step and samples/s, the highest peak memory."""
    result = VariantResult(name=name, command=command, env=env, runs=runs)
    usable = [r for r in runs if r.usable]
    result.usable_runs = len(usable)
    if not usable:
        return result
    times = [r.sec_per_step for r in usable if r.sec_per_step is not None]
    result.sec_per_step = statistics.median(times)
    result.sec_per_step_range = (min(times), max(times))
    result.samples_per_s = _median([r.samples_per_s for r in usable])
    peaks = [(r.peak_mem_mb, r.peak_mem_source) for r in usable if r.peak_mem_mb is not None]
    if peaks:
        result.peak_mem_mb, result.peak_mem_source = max(peaks)
    result.per_rank_batch = _median([r.per_rank_batch for r in usable])
    result.global_batch = _median([r.global_batch for r in usable])
    result.world_size = statistics.mode(r.world_size for r in usable)
    result.backend = statistics.mode(r.backend for r in usable)
    return result


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def batch_warnings(variants: list[VariantResult]) -> list[str]:
    """Sentences when the variants' batches differ or are unknown: sec/step of different batches is no comparison."""
    measured = [v for v in variants if v.usable_runs]
    unknown = [v.name for v in measured if v.per_rank_batch is None]
    warnings = []
    if unknown:
        warnings.append(
            f"batch size unknown for {', '.join(unknown)} (no DataLoader batch was seen): whether the comparison "
            "pins the batch could not be checked."
        )
    for label, key in (("per-rank batch", "per_rank_batch"), ("global batch", "global_batch")):
        known = [(v.name, getattr(v, key)) for v in measured if getattr(v, key) is not None]
        values = [value for _, value in known]
        if values and max(values) - min(values) > BATCH_TOLERANCE * max(values):
            listed = ", ".join(f"{name} {_batch_text(value)}" for name, value in known)
            warnings.append(
                f"the variants' {label} differs ({listed}): a comparison must pin the batch, or sec/step measures "
                "the batch size, not the change."
            )
    return warnings


def _batch_text(value: float) -> str:
    return f"{value:.0f}" if abs(value - round(value)) < 0.05 else f"{value:.1f}"


# -- the comparison ---------------------------------------------------------------------------------------------


@dataclass
class Interval:
    """The speedup of the candidate over the baseline and its confidence interval."""

    speedup: float | None  # baseline / candidate sec/step, ratio of geometric means
    ci: tuple[float, float] | None
    reason: str | None  # why there is no interval


def speedup_interval(
    baseline_s: Sequence[float],
    candidate_s: Sequence[float],
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> Interval:
    """Speedup (baseline sec/step over candidate sec/step, > 1: the candidate is faster) with a studentized
    bootstrap interval over the runs' sec/step (see the module's docstring for why this method)."""
    base, cand = np.log(np.asarray(baseline_s, float)), np.log(np.asarray(candidate_s, float))
    if not (base.size and cand.size):
        return Interval(None, None, "a variant has no usable run")
    theta = float(base.mean() - cand.mean())  # log of the speedup
    speedup = math.exp(theta)
    if min(len(base), len(cand)) < 2:
        return Interval(
            speedup,
            None,
            f"an interval needs at least 2 usable runs of each variant (got {len(base)} and {len(cand)}): "
            "one run says nothing about the run-to-run spread",
        )
    if np.ptp(base) == 0 and np.ptp(cand) == 0:
        return Interval(speedup, (speedup, speedup), None)  # no spread at all: every resample gives this ratio
    se = _welch_se(base[None, :], cand[None, :])[0]
    rng = np.random.default_rng(seed)
    base_r = base[rng.integers(0, len(base), (resamples, len(base)))]
    cand_r = cand[rng.integers(0, len(cand), (resamples, len(cand)))]
    shift = base_r.mean(axis=1) - cand_r.mean(axis=1) - theta
    flat = (np.ptp(base_r, axis=1) == 0) & (np.ptp(cand_r, axis=1) == 0)
    # A resample without spread has no standard error: its t is infinite (0 when it also has no shift).
    t = np.where(shift == 0, 0.0, np.copysign(np.inf, shift))
    np.divide(shift, _welch_se(base_r, cand_r), out=t, where=~flat)
    t.sort()
    alpha = 1 - confidence
    t_low, t_high = t[math.floor(alpha / 2 * resamples)], t[math.ceil((1 - alpha / 2) * resamples) - 1]
    low, high = theta - t_high * se, theta - t_low * se
    if not (math.isfinite(low) and math.isfinite(high)) or max(abs(low), abs(high)) > 700:
        return Interval(
            speedup,
            None,
            f"too few runs to bound the interval ({len(base)} and {len(cand)}): too many bootstrap resamples "
            "repeat a single run and have no spread; 3 or more runs per variant bound it",
        )
    return Interval(speedup, (math.exp(low), math.exp(high)), None)


def _welch_se(base: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """Standard error of the difference of means, row by row, each variant with its own variance."""
    return np.sqrt(base.var(axis=1, ddof=1) / base.shape[1] + cand.var(axis=1, ddof=1) / cand.shape[1])


def compare(
    baseline: VariantResult,
    candidate: VariantResult,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> Comparison:
    """The candidate against the baseline: speedup, its interval, and the verdict in words."""
    times = [[r.sec_per_step for r in v.runs if r.usable and r.sec_per_step is not None] for v in (baseline, candidate)]
    interval = speedup_interval(times[0], times[1], confidence, resamples, seed)
    verdict, faster = UNKNOWN, None
    if interval.ci is not None:
        low, high = interval.ci
        if low > 1:
            verdict, faster = FASTER, candidate.name
        elif high < 1:
            verdict, faster = SLOWER, baseline.name
        else:
            verdict = NO_DIFFERENCE
    return Comparison(
        baseline=baseline.name,
        candidate=candidate.name,
        speedup=interval.speedup,
        speedup_ci=interval.ci,
        faster=faster,
        verdict=verdict,
        reason=interval.reason,
        confidence=confidence,
        runs=(len(times[0]), len(times[1])),
        samples_per_s_ratio=_ratio(candidate.samples_per_s, baseline.samples_per_s),
        peak_mem_ratio=_ratio(candidate.peak_mem_mb, baseline.peak_mem_mb),
    )


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def ab_result(settings: Settings, variants: list[VariantResult], stopped: str | None = None) -> ABResult:
    """Every candidate against the first variant, and the batch warnings."""
    s = settings
    comparisons = [compare(variants[0], v, s.confidence, s.resamples, s.seed) for v in variants[1:]]
    return ABResult(settings, variants, comparisons, batch_warnings(variants), stopped)


# -- the outcome ------------------------------------------------------------------------------------------------


def slower_beyond(comparison: Comparison, pct: float) -> bool:
    """True when the candidate is slower than the baseline by more than ``pct`` percent with confidence: the whole
    interval lies beyond it (candidate sec/step > baseline × (1 + pct/100))."""
    return comparison.speedup_ci is not None and comparison.speedup_ci[1] < 1 / (1 + pct / 100)


def exit_status(result: ABResult, fail_if_slower: float | None) -> tuple[int, list[str]]:
    """The command's exit code and the sentences that explain a non-zero one (or a gate that could not judge):
    1 when a variant has no usable run or a candidate is slower than ``fail_if_slower`` percent with confidence,
    130 when the A/B was interrupted."""
    sentences = []
    for variant in result.variants:
        if not variant.usable_runs:
            reasons = sorted({r.failure for r in variant.runs if r.failure})
            why = f": {'; '.join(reasons)}" if reasons else ""
            sentences.append(f"variant {variant.name} has no usable run{why}.")
    code = 1 if sentences else 0
    if fail_if_slower is not None:
        for comparison in result.comparisons:
            if slower_beyond(comparison, fail_if_slower):
                low, high = (1 / x - 1 for x in comparison.speedup_ci[::-1])
                sentences.append(
                    f"{comparison.candidate} is slower than {comparison.baseline} by more than {fail_if_slower:g}% "
                    f"({100 * low:.1f}% to {100 * high:.1f}% slower at {100 * comparison.confidence:.0f}% "
                    "confidence): failing the gate."
                )
                code = 1
            elif comparison.speedup_ci is None and comparison.runs[0] and comparison.runs[1]:
                sentences.append(
                    f"--fail-if-slower could not judge {comparison.candidate}: {comparison.reason or 'no interval'}."
                )
    if result.stopped:
        sentences.append(result.stopped)
        code = 130
    return code, sentences
