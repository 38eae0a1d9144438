"""A/B comparison of training variants: each run's figures from its RunSummary, and the speedup with a confidence
interval. Pure functions over data: no processes, no files (running the variants: instrument/ab.py; the table:
report/ab.py).

What the noise is. A run's mean sec/step wanders for two reasons: run-level luck that every step of the run shares
(placement, allocator state, clocks, a neighbour's load), and step-level noise that averages out over the run's
~100 steps (a slow fetch, a GC pause; often autocorrelated). Steps alone overstate precision when run-level luck
dominates; the steps still tell how much of a run's figure is step noise, which 2-3 runs alone estimate poorly.

The method. Each run gives the log of its mean sec/step (the run's throughput, stalls included) and, from its own
measured steps, the variance of that figure: the steps cut into floor(sqrt(n)) contiguous blocks (batch means),
so that autocorrelated steps count once per block, not once per step. The log speedup is the difference of the
variants' mean log run figures, and its variance is estimated twice:

- between runs: the spread of the run figures, pooled over both variants (run noise is multiplicative, so on a log
  scale both variants share it), with runs - 2 degrees of freedom: a Student t interval, exact when run-level
  luck dominates whatever the steps say;
- within runs: the blocked step variances, with far more degrees of freedom: the floor no set of runs can beat.

When the runs spread more than their steps explain, the between-run interval is used (run-level luck is there,
and only the runs measure it). When they agree as well as their steps allow or better, the within-run variance is
used (the runs agreeing by luck no longer make the interval too narrow), with a Student t quantile of
min(df_between², df_within) degrees of freedom: the fewer the runs, the less a run-level effect hiding under the
step noise can be ruled out. Under normal noise that choice keeps the worst false-positive rate over every mix of
run- and step-level noise at 5.0-5.1% (nominal 5%); plain z there would reach 7.5% with 2 runs per variant.

Why not a bootstrap: resampling 2-3 runs per variant cannot see their spread (one 3-run resample in 9 is a single
run three times), so the studentized bootstrap this replaces gave intervals like 0.03-134 at 3 runs and none at 2,
and a percentile bootstrap over runs then blocks undercovers (it spreads by sqrt((k-1)/k) of the run-level error
and has no Student t correction). Why not pairs of interleaved runs: differences of A,B pairs leave 1-2 degrees of
freedom with 2-3 runs (t quantiles 12.7, 4.3); interleaving already puts a drift on both variants alike.

What the steps buy, and what they cannot: most of the power at 2-3 runs comes from pooling the runs' spread over
both variants (2-4 degrees of freedom instead of a bootstrap's or Welch's 1-2). While run-level luck may be
anywhere from none to most of the noise, no rule of this kind (the steps' variance when the runs agree within c
times it, else the runs') that keeps 5% false positives over every mix was narrower on average than the runs' own
t interval (c from 1 to 3, 2 and 3 runs per variant, normal noise). The steps give the floor and the degrees of
freedom above, and with run noise absent they cost a little width (a 1.05x on 3 runs of 100 noisy steps: found
in 59% of A/Bs, 60% from the runs alone).

Simulated (tests/test_ab.py; 1,000 seeded A/Bs per case, 100 steps per run): false positives at 95% with 3 (and
2) runs per variant: run-level noise dominating (3% log-normal runs, 15% of runs 3-8% slower, 2% steps) 4.6%
(5.1%); step-level dominating (0.2% runs, 20% steps) 1.9% (0.7%); autocorrelated steps (AR 0.7, 20%) 3.1% (1.5%);
run and step noise equal 4.4% (3.9%). A true 1.3x is found with 3 runs per variant in 100, 100, 99.7 and 100% of
those A/Bs (with 2 runs: 93, 100, 80 and 94%).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from stepscope.summary import LossSeries, RunSummary

CONFIDENCE = 0.95
METHOD = (
    "t interval on mean log sec/step over runs; variance: the runs' spread pooled over variants (t, runs - 2 df), "
    "or, when the runs agree as well as their own steps allow, the steps' variance in blocks (batch means)"
)

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
    # Measured step times, s, from the series of the rank that sets sec/step: each the mean of step_stride steps.
    step_s: list[float] = field(default_factory=list)
    step_stride: int = 1
    loss: LossSeries | None = None  # each measured step's loss (the first rank's that has one)

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
    variance: str | None = None  # what the interval's width rests on: "between runs" or "within runs (steps)"


@dataclass
class Settings:
    """How the A/B was run and analysed."""

    repeats: int  # runs of each variant, interleaved
    steps: int  # measured steps per run
    warmup: int  # steps skipped before measuring, per run
    confidence: float = CONFIDENCE
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
    step_s, stride = measured_step_times(ranks)
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
        step_s=step_s,
        step_stride=stride,
        loss=next((r.loss for r in ranks if r.loss is not None), None),
    )


def measured_step_times(ranks: list[RunSummary]) -> tuple[list[float], int]:
    """The measured points of one rank's step series, s, and how many steps each averages: the points wholly after
    the warm-up and within the steps the run timed. With several ranks, the series of the slowest rank (the highest
    mean step time): the rank whose mean is the run's sec/step, so the spread belongs to the figure it qualifies
    (a per-step maximum over ranks would add the noise of a maximum and need the ranks' series aligned).
    ([], 1) without a series (a summary from before schema 3)."""
    timed = [r for r in ranks if r.series is not None and r.throughput.step_time_ms is not None]
    if not timed:
        return [], 1
    rank = max(timed, key=lambda r: r.throughput.step_time_ms)
    series, steps = rank.series, rank.steps
    end = steps.warmup + steps.measured + steps.profiled
    points = series.step_ms[: end // series.stride]  # a last point cut short by the run's end is left out
    first = -(-steps.warmup // series.stride)  # the first point that starts at or after the warm-up
    return [ms / 1000 for ms in points[first:]], series.stride


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
    variance: str | None = None  # the variance the interval rests on: "between runs" or "within runs (steps)"


def within_run_variance(step_s: Sequence[float]) -> tuple[float, int] | None:
    """Variance of the log of a run's mean step time (unitless: relative variance) estimated from its own steps, and
    its degrees of freedom: the steps cut into floor(sqrt(n)) contiguous blocks of floor(sqrt(n)) steps, the
    variance of the block means over the blocks (batch means; steps left over at the end are left out of the
    variance, not of the mean). Blocks make autocorrelated steps count once per block. None below 2 blocks."""
    steps = np.asarray(step_s, float)
    length = math.isqrt(steps.size)
    blocks = steps.size // length if length else 0
    if blocks < 2:
        return None
    means = steps[: blocks * length].reshape(blocks, length).mean(axis=1)
    return float(means.var(ddof=1) / blocks / steps.mean() ** 2), blocks - 1


def speedup_interval(
    baseline_s: Sequence[float],
    candidate_s: Sequence[float],
    baseline_steps: Sequence[Sequence[float]] = (),
    candidate_steps: Sequence[Sequence[float]] = (),
    confidence: float = CONFIDENCE,
) -> Interval:
    """Speedup (baseline sec/step over candidate sec/step, > 1: the candidate is faster) with its interval, from each
    run's mean sec/step and, when every run has them, each run's measured step times in s (see the module's
    docstring for the method and why)."""
    base, cand = np.log(np.asarray(baseline_s, float)), np.log(np.asarray(candidate_s, float))
    if not (base.size and cand.size):
        return Interval(None, None, "a variant has no usable run")
    log_speedup = float(base.mean() - cand.mean())
    speedup = math.exp(log_speedup)
    if min(base.size, cand.size) < 2:
        return Interval(
            speedup,
            None,
            f"an interval needs at least 2 usable runs of each variant (got {base.size} and {cand.size}): "
            "one run says nothing about the run-to-run spread",
        )
    df_between = base.size + cand.size - 2
    pooled = (((base - base.mean()) ** 2).sum() + ((cand - cand.mean()) ** 2).sum()) / df_between
    variance, df, source = float(pooled * (1 / base.size + 1 / cand.size)), df_between, "between runs"
    within = _within_variance(baseline_steps, base.size, candidate_steps, cand.size)
    if within is not None and within[0] >= variance:
        variance, df, source = within[0], min(df_between**2, within[1]), "within runs (steps)"
    if variance == 0:
        return Interval(speedup, (speedup, speedup), None, source)  # no spread at all, between runs or within
    half = t_quantile(confidence, df) * math.sqrt(variance)
    return Interval(speedup, (math.exp(log_speedup - half), math.exp(log_speedup + half)), None, source)


def _within_variance(
    baseline_steps: Sequence[Sequence[float]],
    base_runs: int,
    candidate_steps: Sequence[Sequence[float]],
    cand_runs: int,
) -> tuple[float, int] | None:
    """Variance of the difference of the variants' mean log run figures from the runs' own steps, and its
    Welch-Satterthwaite degrees of freedom (floored); None unless every run of both variants has one."""
    parts = []
    for runs, count in ((baseline_steps, base_runs), (candidate_steps, cand_runs)):
        if len(runs) != count:
            return None
        for step_s in runs:
            run = within_run_variance(step_s)
            if run is None:
                return None
            parts.append((run[0] / count**2, run[1]))
    total = sum(v for v, _ in parts)
    spread = sum(v * v / df for v, df in parts)
    return total, (math.floor(total * total / spread) if spread else _DF_NORMAL)


_DF_NORMAL = 1000  # degrees of freedom beyond which Student's t is the normal distribution (quantiles within 0.1%)


def t_quantile(confidence: float, df: int) -> float:
    """The two-sided Student t quantile q with P(|T| < q) = ``confidence`` for ``df`` degrees of freedom (at least 1;
    the normal's beyond 1000), by bisection on the exact CDF for whole degrees of freedom."""
    if df >= _DF_NORMAL:
        return statistics.NormalDist().inv_cdf((1 + confidence) / 2)
    low, high = 0.0, 1.0
    while _t_within(high, df) < confidence:
        high *= 2
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if _t_within(mid, df) < confidence else (low, mid)
        if high - low < 1e-12 * high:
            break
    return (low + high) / 2


def _t_within(q: float, df: int) -> float:
    """P(|T| < q) for Student's t with ``df`` whole degrees of freedom (Abramowitz & Stegun 26.7.3)."""
    theta = math.atan(q / math.sqrt(df))
    cos2 = math.cos(theta) ** 2
    if df % 2:  # odd: (2/pi)(theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...))
        term = total = 1.0
        for k in range(1, (df - 1) // 2):
            term *= 2 * k / (2 * k + 1) * cos2
            total += term
        tail = math.sin(theta) * math.cos(theta) * total if df > 1 else 0.0
        return 2 / math.pi * (theta + tail)
    term = total = 1.0  # even: sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...)
    for k in range(1, df // 2):
        term *= (2 * k - 1) / (2 * k) * cos2
        total += term
    return math.sin(theta) * total


def compare(baseline: VariantResult, candidate: VariantResult, confidence: float = CONFIDENCE) -> Comparison:
    """The candidate against the baseline: speedup, its interval, and the verdict in words."""
    usable = [[r for r in v.runs if r.usable and r.sec_per_step is not None] for v in (baseline, candidate)]
    interval = speedup_interval(
        [r.sec_per_step for r in usable[0]],
        [r.sec_per_step for r in usable[1]],
        [r.step_s for r in usable[0]],
        [r.step_s for r in usable[1]],
        confidence,
    )
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
        runs=(len(usable[0]), len(usable[1])),
        samples_per_s_ratio=_ratio(candidate.samples_per_s, baseline.samples_per_s),
        peak_mem_ratio=_ratio(candidate.peak_mem_mb, baseline.peak_mem_mb),
        variance=interval.variance,
    )


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def ab_result(settings: Settings, variants: list[VariantResult], stopped: str | None = None) -> ABResult:
    """Every candidate against the first variant, and the batch warnings."""
    s = settings
    comparisons = [compare(variants[0], v, s.confidence) for v in variants[1:]]
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
