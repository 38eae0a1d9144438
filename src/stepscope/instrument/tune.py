"""``stepscope tune``: search the settings ``--apply`` can make by measuring them, and hand back the fastest
combination.

A bound is a guess and ``doctor --verify`` grades one fix; settings interact (loader workers and intra-op threads
share the cores), so a search must measure. The doctor's diagnosis names the plausible settings: its appliable
fixes, with the values around each advised one (worker counts on both sides of the core cap, intra-op threads,
prefetch), the optimizer's foreach/fused kernels where the optimizer shows, and the numerics-changing ones only
when allowed. Each round then measures every candidate against the best combination so far:

1. screening: interleaved runs of every candidate and the best so far, 2 runs each (of a quarter of the steps
   when a full run's steps would take over 30 s; else all of them, as start-up is most of a short run);
2. promotion: the third of the candidates that read fastest (at least one; none that read slower or no faster)
   run again at full length, ``repeats`` runs each, interleaved with the best so far (successive halving);
3. a candidate is kept only when ab's 95% interval says it is faster; the fastest of those joins the best.

The doctor runs again on the new best, because the bound moves, and the next round starts from its diagnosis. The
search ends when no candidate is faster, when none is left, or at the budget; a last A/B of the baseline against
the best gives the headline speedup with its interval, measured, not multiplied from the rounds.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from stepscope.analyses.ab import FASTER, NO_DIFFERENCE, SLOWER, ABResult, Comparison, Settings, VariantResult
from stepscope.collectors.malloc import PRELOADABLE, pooling_library
from stepscope.doctor.rules import CATALOGUE
from stepscope.instrument.ab import Variant, run_ab
from stepscope.instrument.apply import ALIASES, ApplyError, parse_fixes, worker_limit
from stepscope.instrument.launch import Target
from stepscope.instrument.verify import apply_argument, queue_steps
from stepscope.summary import RunSummary, describe_value

BASELINE = "baseline"
SCREEN_REPEATS = 2  # runs of each candidate and of the best so far when screening
# Screening runs measure a quarter of --steps (at least 20) when a full run's steps would take over SCREEN_FULL_S;
# below that a run is mostly its process start-up (3 s of torch imports), and fewer steps would save little
# time and measure noise (15 steps of 7 ms gave intervals of 0.2-4.5x).
SCREEN_STEP_SHARE = 0.25
MIN_SCREEN_STEPS = 20
SCREEN_FULL_S = 30.0
PROMOTE_SHARE = 1 / 3  # of the screened candidates, the fastest go on to full runs
MIN_SHARE = 0.05  # of the step: a phase below this makes no setting that acts on it plausible
SCREEN_LEAD = 1.02  # a screened candidate must read faster than the best so far by this ratio to go on

# What to write in the script (or its environment) to keep a setting without stepscope.
KEEP = {
    "loader.num_workers": "DataLoader(..., num_workers={value})",
    "loader.persistent_workers": "DataLoader(..., persistent_workers={value})",
    "loader.prefetch": "DataLoader(..., prefetch_factor={value})",
    "loader.pin_memory": "DataLoader(..., pin_memory={value})",
    "host.threads": "torch.set_num_threads({value}) before training (or OMP_NUM_THREADS={value} in the environment)",
    "malloc.mmap_threshold": "MALLOC_MMAP_THRESHOLD_={value} and MALLOC_TRIM_THRESHOLD_ at twice it in the "
    "environment (or LD_PRELOAD jemalloc or TCMalloc)",
    "malloc.allocator": "LD_PRELOAD of {value} in the environment (e.g. LD_PRELOAD=libjemalloc.so.2 for jemalloc)",
    "optimizer.foreach": "torch.optim.<Optimizer>(..., foreach={value})",
    "optimizer.fused": "torch.optim.<Optimizer>(..., fused={value})",
    "zero_grad.set_to_none": "optimizer.zero_grad(set_to_none={value})",
    "ddp.gradient_as_bucket_view": "DistributedDataParallel(..., gradient_as_bucket_view={value})",
    "ddp.find_unused_parameters": "DistributedDataParallel(..., find_unused_parameters={value})",
    "ddp.static_graph": "DistributedDataParallel(..., static_graph={value})",
    "precision.bf16": "with torch.autocast(device_type, dtype=torch.bfloat16): around the model's forward",
    "tf32": "torch.set_float32_matmul_precision('{value}')",
    "cudnn.benchmark": "torch.backends.cudnn.benchmark = {value}",
    "debug.anomaly": "torch.autograd.set_detect_anomaly({value}) (remove the call that turns it on)",
    "debug.deterministic": "torch.use_deterministic_algorithms({value}) (remove the call that turns it on)",
}


@dataclass
class Trial:
    """One candidate measured against the best combination so far."""

    round: int
    stage: str  # "screen" (2 runs a side), "confirm" (--repeats a side) or "more runs" (twice that, when unsure)
    candidate: str  # the setting(s) the trial adds to the best so far, as ``--apply`` takes them
    apply: list[str]  # every setting of the trial
    steps_per_s: float | None
    speedup: float | None  # against the best so far (> 1: faster)
    ci_low: float | None
    ci_high: float | None
    verdict: str
    kept: bool = False
    reason: str = ""


@dataclass
class LossComparison:
    """The loss of the same measured steps in one run of the baseline and one of the best combination (a seeded
    script sees the same batches in both): what the settings that change numerics did to training."""

    steps: list[int]
    baseline: list[float | None]
    tuned: list[float | None]
    numerics: list[str]  # the best's settings that change numerics ([] when none does)
    max_rel_diff: float | None  # the largest |tuned - baseline| / |baseline| over the steps where both are finite
    max_rel_diff_step: int | None
    last_rel_diff: float | None  # at the last step both runs measured


@dataclass
class TuneResult:
    """What the search measured and found; ``to_dict`` is the ``--json`` file."""

    baseline_steps_per_s: float | None
    trials: list[Trial] = field(default_factory=list)
    best_apply: list[str] = field(default_factory=list)
    best_steps_per_s: float | None = None
    speedup: float | None = None  # best against the baseline, from the last A/B
    ci_low: float | None = None
    ci_high: float | None = None
    keep: list[str] = field(default_factory=list)  # the code and environment changes that keep the best
    rounds: int = 0
    stopped: str | None = None  # why the search ended before it ran out of candidates
    notes: list[str] = field(default_factory=list)
    loss: LossComparison | None = None  # from the last A/B, when both sides' runs read their loss

    def to_dict(self) -> dict[str, Any]:
        return {
            "baseline": {"steps_per_s": self.baseline_steps_per_s},
            "trials": [asdict(t) for t in self.trials],
            "best": {
                "apply": self.best_apply,
                "speedup": self.speedup,
                "ci_low": self.ci_low,
                "ci_high": self.ci_high,
                "steps_per_s": self.best_steps_per_s,
                "loss": None if self.loss is None else asdict(self.loss),
            },
            "keep": self.keep,
            "rounds": self.rounds,
            "stopped": self.stopped,
            "notes": self.notes,
        }


# -- candidates ---------------------------------------------------------------------------------------------------


def _ids(argument: str) -> set[str]:
    """The fix ids a setting (one ``--apply`` argument, maybe several settings joined by commas) sets. Read from
    the names alone: parsing the values would read the machine's worker bound for every comparison."""
    return {ALIASES.get(name, name) for name in (part.partition("=")[0].strip() for part in argument.split(","))}


def _combined(best: list[str], candidate: str | None = None) -> list[str]:
    """The ``--apply`` arguments of ``best`` with ``candidate`` in place of the settings it is about; the other
    settings of an argument it overlaps stay (a worker count tried on top of workers-and-threads keeps the
    threads)."""
    if candidate is None:
        return list(best)
    ids = _ids(candidate)
    kept = [",".join(p for p in argument.split(",") if not _ids(p) & ids) for argument in best]
    return [argument for argument in kept if argument] + [candidate]


def _cores(summary: RunSummary) -> int:
    from stepscope.doctor.facts import cores_of, ranks_per_machine

    cores = cores_of(summary.facts) or 1
    return max(1, math.floor(cores / ranks_per_machine(summary.facts)))


def _share(summary: RunSummary, *phases: str) -> float:
    return sum(summary.phases[p].share for p in phases if p in summary.phases and not summary.phases[p].nested)


def _worker_values(summary: RunSummary, advised: int | None) -> list[int]:
    """Worker counts around the current and advised ones, on both sides of the core cap, within --apply's bound."""
    current = max((loader.num_workers for loader in summary.loaders), default=0)
    cores = _cores(summary)
    limit, _ = worker_limit()
    around = {max(1, current // 2), current * 2, cores - 1, cores, 2 * cores}
    if advised is not None:
        around |= {max(1, advised // 2), advised, advised * 2}
    return sorted(v for v in around if 1 <= v <= limit and v != current)


def _with_threads(workers: str, count: int, summary: RunSummary) -> str | None:
    """``workers`` with the intra-op threads that fit beside ``count`` workers, on a CPU where that is fewer threads
    than torch has (workers and threads share the cores: the pair can help where neither does alone)."""
    threads = summary.facts.get("threads", {}).get("torch_threads")
    fit = max(1, _cores(summary) - count)
    if not threads or summary.meta.device != "cpu" or fit >= threads:
        return None
    return f"{workers},host.threads={fit}"


def candidates(summary: RunSummary, best: list[str], allow_numerics: bool) -> list[str]:
    """The settings worth measuring on this diagnosis (``--apply`` arguments), without those already in ``best``.
    Worker counts carry persistent workers, as the doctor's worker fix does: a count alone restarts the workers
    every epoch."""
    found: list[str] = []
    advised_workers = None
    for fix in summary.fixes:
        argument = apply_argument(fix)
        if argument is None or (fix.changes_numerics and not allow_numerics):
            continue
        fixes = parse_fixes([argument])
        if fixes[0]["id"] == "loader.num_workers":
            advised_workers = int(fixes[0]["value"])
        found.append(argument)
    threads = summary.facts.get("threads", {}).get("torch_threads")
    on_cpu = summary.meta.device == "cpu"
    cores = _cores(summary)
    on_data = summary.loaders and (_share(summary, "data_wait") >= MIN_SHARE or advised_workers is not None)
    if on_data:
        for n in _worker_values(summary, advised_workers):
            workers = f"loader.num_workers={n},loader.persistent_workers"
            found += [workers, *filter(None, [_with_threads(workers, n, summary)])]
        if any(loader.num_workers for loader in summary.loaders):  # prefetching needs workers to fetch ahead
            found.append("loader.prefetch=4")
    if threads and on_cpu:  # CPU ops run on the intra-op threads; a GPU's do not
        found += [f"host.threads={n}" for n in sorted({1, max(1, cores // 2), cores}) if n != threads]
    if _share(summary, "optimizer") >= MIN_SHARE:
        found += ["optimizer.foreach", "optimizer.fused"]
    if any(fix.id == "host.malloc_churn" for fix in summary.fixes):  # a pooling allocator, beside glibc's thresholds
        found += [f"malloc.allocator={name}" for name in PRELOADABLE if pooling_library(name)]
    if not on_cpu:
        found.append("cudnn.benchmark")
        if allow_numerics:
            found += ["tf32", "precision.bf16"]
    elif allow_numerics and _share(summary, "forward", "backward") >= MIN_SHARE:
        found.append("precision.bf16")
    out: list[str] = []
    for argument in found:
        if argument in out or argument in best or _refused(argument, best):
            continue
        out.append(argument)
    return out


def _refused(argument: str, best: list[str]) -> bool:
    """Whether ``--apply`` refuses ``argument`` beside the best so far (fused with foreach, a bound passed)."""
    try:
        parse_fixes(_combined(best, argument))
    except ApplyError:
        return True
    return False


# -- the search ---------------------------------------------------------------------------------------------------


@dataclass
class Search:
    """What ``tune`` runs: the command, the run settings, the budget; ``diagnose`` runs the doctor once on a
    combination (``--apply`` arguments) and returns its summary."""

    target: Target
    settings: Settings  # full runs: repeats, steps, warmup
    budget_s: float
    allow_numerics: bool
    diagnose: Callable[[list[str]], RunSummary]
    run_timeout_s: float | None = None
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)
    runner: Callable[..., ABResult] = run_ab  # runs an A/B of variants (run_ab's signature)
    started: float = field(default_factory=time.monotonic)
    run_s: float = 0.0  # a full run's duration so far (s): the last A/B of the best is kept inside the budget

    def left_s(self, reserve: bool = True) -> float:
        """Seconds of the budget left to the search; with ``reserve``, less the last A/B's (2 × repeats runs)."""
        kept = 2 * self.settings.repeats * self.run_s if reserve else 0.0
        return self.budget_s - (time.monotonic() - self.started) - kept

    def variant(self, name: str, arguments: list[str]) -> Variant:
        return Variant(name, " ".join(self.target.argv), {}, self.target, parse_fixes(arguments))

    def ab(self, variants: list[Variant], settings: Settings, reserve: bool = True) -> ABResult:
        """Run ``variants`` interleaved within what is left of the budget; full runs update ``run_s``. The warm-up
        drains the batches more workers fetch ahead, as ``doctor --verify``'s does."""
        started = time.monotonic()
        queued = queue_steps([fix for variant in variants for fix in variant.apply])
        result = self.runner(
            variants,
            dataclasses.replace(settings, warmup=max(settings.warmup, queued)),
            log=lambda line: self.log("  " + line),
            budget_s=max(self.left_s(reserve), 1e-3),
            run_timeout_s=self.run_timeout_s,
        )
        runs = sum(len(v.runs) for v in result.variants)
        if settings.steps == self.settings.steps and runs:
            self.run_s = max(self.run_s, (time.monotonic() - started) / runs)
        return result


def _steps_per_s(variant: VariantResult | None) -> float | None:
    return None if variant is None or not variant.sec_per_step else 1 / variant.sec_per_step


def _trial(round_: int, stage: str, candidate: str, best: list[str], result: ABResult) -> Trial:
    comparison: Comparison | None = next((c for c in result.comparisons if c.candidate == candidate), None)
    variant = next((v for v in result.variants if v.name == candidate), None)
    low, high = comparison.speedup_ci if comparison and comparison.speedup_ci else (None, None)
    return Trial(
        round=round_,
        stage=stage,
        candidate=candidate,
        apply=_combined(best, candidate),
        steps_per_s=_steps_per_s(variant),
        speedup=comparison.speedup if comparison else None,
        ci_low=low,
        ci_high=high,
        verdict=comparison.verdict if comparison else "not run",
        reason="" if comparison else "not run (budget)",
    )


def _worse(verdict: str) -> str:
    """A rejected trial's reason, against the best so far."""
    return {SLOWER: "slower", NO_DIFFERENCE: "no faster"}.get(verdict, verdict)


def screen_steps(settings: Settings, summary: RunSummary) -> int:
    """Steps each screening run measures: all of ``settings.steps`` when they take under SCREEN_FULL_S at the
    doctor's step time, else a quarter of them (at least MIN_SCREEN_STEPS)."""
    step_ms = summary.throughput.step_time_ms if summary.throughput else None
    if step_ms is not None and settings.steps * step_ms / 1e3 < SCREEN_FULL_S:
        return settings.steps
    return min(settings.steps, max(MIN_SCREEN_STEPS, round(settings.steps * SCREEN_STEP_SHARE)))


def _simplest(faster: list[Trial]) -> Trial:
    """Of the trials measured faster (fastest first), the one with the fewest settings among those as fast as the
    fastest within its interval: a setting that adds nothing measurable is not one to keep."""
    fastest = faster[0]
    tied = [t for t in faster if (t.speedup or 0.0) >= (fastest.ci_low or 0.0)]
    return min(tied, key=lambda t: (len(parse_fixes([t.candidate])), -(t.speedup or 0.0)))


def _runners_up(trials: list[Trial], winner: Trial) -> list[str]:
    """The round's settings that read faster than the best so far but were not kept (behind the fastest third when
    screened, or faster and beaten in full runs)."""
    behind = [t for t in trials if t.reason == "behind the fastest third"]
    beaten = [t for t in trials if t.stage != "screen" and t.verdict == FASTER]
    return sorted({t.candidate for t in behind + beaten} - {winner.candidate})


def _batches(screened: list[Trial]) -> list[list[Trial]]:
    """The screened candidates that read faster than the best so far, fastest first, in thirds of the screened
    (at least one each): the first third goes to full runs, the next only when none of those measures faster.
    The others are rejected with the reason."""
    ahead = [t for t in screened if t.verdict != SLOWER and (t.speedup or 0.0) > SCREEN_LEAD]
    ahead.sort(key=lambda t: -(t.speedup or 0.0))
    size = max(1, math.ceil(len(screened) * PROMOTE_SHARE))
    for trial in screened:
        if not trial.reason:
            trial.reason = "behind the fastest third" if trial in ahead else _worse(trial.verdict)
    return [ahead[i : i + size] for i in range(0, len(ahead), size)]


def search(plan: Search, summary: RunSummary) -> TuneResult:
    """Tune from the doctor's ``summary`` of the unmodified script; see the module docstring."""
    from stepscope.instrument.launch import stop_requested

    result = TuneResult(baseline_steps_per_s=summary.throughput.steps_per_s if summary.throughput else None)
    best: list[str] = []
    threads = summary.facts.get("threads", {}).get("torch_threads")
    tried = {f"host.threads={threads}"}  # the script's own thread count is the baseline's: measured already
    headline: Trial | None = None  # the kept trial of round 1, measured against the baseline itself
    headline_loss: LossComparison | None = None  # the loss of its A/B's runs, side by side
    waiting: list[str] = []  # runners-up of a kept knob, tried again once another knob is kept
    retried: set[str] = set()  # the doctor's fixes measured a second time, on a later best
    screen = dataclasses.replace(plan.settings, repeats=SCREEN_REPEATS, steps=screen_steps(plan.settings, summary))
    while True:
        if best:
            # A fix of the doctor's that read no faster while another cause bound the step is measured once more
            # when the doctor still advises it on the new best: the bound has moved (anomaly mode left on read
            # 0.93x behind an unparallelised loader, and was never tried once the loader was fixed).
            advised = {apply_argument(fix) for fix in summary.fixes} - {None}
            for candidate in sorted((tried & advised) - retried - set(best)):
                tried.discard(candidate)
                retried.add(candidate)
        found = [c for c in candidates(summary, best, plan.allow_numerics) if c not in tried]
        if stop_requested():
            result.stopped = "the search was stopped; the best so far is what was kept."
            break
        if not found:
            result.notes.append(f"round {result.rounds + 1}: no setting left to try on this diagnosis.")
            break
        if plan.left_s() <= 0:
            result.stopped = f"the budget of {plan.budget_s:.3g} s ran out; the best so far is what was kept."
            break
        result.rounds += 1
        round_ = result.rounds
        tried.update(found)
        base = plan.variant(BASELINE if not best else "best", best)
        batches, screened = [found], []
        if len(found) > 1:  # successive halving: one candidate goes straight to full runs
            plan.log(f"stepscope tune: round {round_}: screening {len(found)} setting(s): {', '.join(found)}")
            screened_ab = plan.ab([base] + [plan.variant(c, _combined(best, c)) for c in found], screen)
            screened = [_trial(round_, "screen", c, best, screened_ab) for c in found]
            result.trials += screened
            ranked = _batches(screened)
            batches = [[t.candidate for t in batch] for batch in ranked]
            if screened_ab.stopped:
                result.stopped = screened_ab.stopped
                break
            if not batches:
                result.notes.append(f"round {round_}: no setting read faster than the best so far when screened.")
                break
        confirmed, faster, stopped = [], [], None
        for promoted in batches:  # the next third only when none of the one before measured faster
            for trial in screened:
                if trial.candidate in promoted:
                    trial.reason = "promoted"
            if plan.left_s() <= 0:  # an A/B started now would run one run and compare nothing
                stopped = (
                    f"the budget of {plan.budget_s:.3g} s ran out before the full runs of {', '.join(promoted)}; "
                    "a longer --budget-s measures them."
                )
                break
            plan.log(f"stepscope tune: round {round_}: full runs of {', '.join(promoted)}")
            # Each of k settings compared at 1 - 0.05/k: the chance that any of them reads faster by luck stays 5%.
            family = dataclasses.replace(plan.settings, confidence=1 - (1 - plan.settings.confidence) / len(promoted))
            confirm_ab = plan.ab([base] + [plan.variant(c, _combined(best, c)) for c in promoted], family)
            batch_confirmed = [_trial(round_, "confirm", c, best, confirm_ab) for c in promoted]
            stopped = confirm_ab.stopped
            unsure = [t for t in batch_confirmed if t.verdict == NO_DIFFERENCE and (t.speedup or 0.0) > SCREEN_LEAD]
            if unsure and not any(t.verdict == FASTER for t in batch_confirmed) and not stopped and plan.left_s() > 0:
                # Successive halving's last step: the survivor that read faster without proof gets twice the runs.
                lead = max(unsure, key=lambda t: t.speedup or 0.0)
                lead.reason = "unsure: more runs"
                plan.log(f"stepscope tune: round {round_}: {2 * plan.settings.repeats} more runs of {lead.candidate}")
                more = dataclasses.replace(plan.settings, repeats=2 * plan.settings.repeats)
                again_ab = plan.ab([base, plan.variant(lead.candidate, _combined(best, lead.candidate))], more)
                batch_confirmed.append(_trial(round_, "more runs", lead.candidate, best, again_ab))
                stopped = again_ab.stopped
            confirmed += batch_confirmed
            faster = sorted((t for t in batch_confirmed if t.verdict == FASTER), key=lambda t: -(t.speedup or 0.0))
            if faster or stopped or plan.left_s() <= 0:
                break
        result.trials += confirmed
        for trial in confirmed:
            if not faster or trial is not _simplest(faster):
                kept_other = "faster; a faster one kept"
                trial.reason = trial.reason or (kept_other if trial.verdict == FASTER else _worse(trial.verdict))
        if not faster:
            if stopped:
                result.stopped = stopped
            else:
                result.notes.append(f"round {round_}: no setting measured faster than the best so far in full runs.")
            break
        winner = _simplest(faster)
        winner.kept, winner.reason = True, "kept"
        if not best:
            headline = winner  # from the last batch's full runs: the doubled runs' A/B, or the batch's own
            headline_loss = _loss_of(again_ab if winner.stage == "more runs" else confirm_ab, winner)
        best = _combined(best, winner.candidate)
        # What read faster but lost to the winner is tried again on top of it. One that sets the winner's own knob
        # (another worker count) just lost in the same setting: it is tried again once another knob has changed,
        # since the bound may have moved back to it.
        knob = _ids(winner.candidate)
        for candidate in [c for c in waiting if not _ids(c) & knob]:
            tried.discard(candidate)
            waiting.remove(candidate)
        for candidate in _runners_up(screened + confirmed, winner):
            if _ids(candidate) & knob:
                waiting.append(candidate)
            else:
                tried.discard(candidate)
        plan.log(f"stepscope tune: kept {winner.candidate} ({winner.speedup:.2f}x); the doctor runs again on it")
        if stopped or plan.left_s() <= 0:
            result.stopped = stopped or f"the budget of {plan.budget_s:.3g} s ran out after round {round_}."
            break
        summary = plan.diagnose(best)
    result.best_apply = best
    result.keep = keep_lines(best)
    if headline is not None and headline.apply == best:  # one kept setting: its own A/B was against the baseline
        result.best_steps_per_s = headline.steps_per_s
        result.speedup, result.ci_low, result.ci_high = headline.speedup, headline.ci_low, headline.ci_high
        result.loss = headline_loss
    elif best:
        _measure_best(plan, result)
    return result


def _measure_best(plan: Search, result: TuneResult) -> None:
    """The headline: the best against the baseline in its own interleaved A/B (speedups of the rounds were each
    against a different best, and their product carries no interval). The search left it its share of the budget."""
    plan.log(f"stepscope tune: the best ({', '.join(result.best_apply)}) against the baseline")
    final = plan.ab([plan.variant(BASELINE, []), plan.variant("best", result.best_apply)], plan.settings, False)
    comparison = final.comparisons[0] if final.comparisons else None
    result.baseline_steps_per_s = _steps_per_s(final.variants[0]) or result.baseline_steps_per_s
    result.best_steps_per_s = _steps_per_s(final.variants[1])
    if comparison is not None:
        result.speedup = comparison.speedup
        if comparison.speedup_ci is not None:
            result.ci_low, result.ci_high = comparison.speedup_ci
        if comparison.verdict != FASTER:
            result.notes.append(
                f"the best combination read {comparison.verdict} against the baseline in the last A/B: the gains "
                "of its rounds did not add up"
            )
    if final.stopped:
        result.notes.append(f"the last A/B: {final.stopped}")
    if len(final.variants) == 2:
        result.loss = compare_loss(final.variants[0], final.variants[1], result.best_apply)


def _loss_of(result: ABResult, trial: Trial) -> LossComparison | None:
    """The loss side by side from the A/B that measured ``trial`` against the best so far (its first variant)."""
    tuned = next((v for v in result.variants if v.name == trial.candidate), None)
    return None if tuned is None or not result.variants else compare_loss(result.variants[0], tuned, trial.apply)


NUMERICS = frozenset(rule.id for rule in CATALOGUE if rule.changes_numerics)


def compare_loss(baseline: VariantResult, tuned: VariantResult, apply: list[str]) -> LossComparison | None:
    """The loss of the steps both sides measured, from the first usable run of each that read its loss; None
    when either has none."""
    sides = [next((run.loss for run in v.runs if run.usable and run.loss is not None), None) for v in (baseline, tuned)]
    if sides[0] is None or sides[1] is None:
        return None
    by_step = [dict(zip(side.steps, side.values, strict=True)) for side in sides]
    steps = sorted(set(by_step[0]) & set(by_step[1]))
    if not steps:
        return None
    diffs = {
        step: abs(by_step[1][step] - by_step[0][step]) / abs(by_step[0][step])
        for step in steps
        if by_step[0][step] and by_step[1][step] is not None
    }
    worst = max(diffs, key=diffs.__getitem__, default=None)
    return LossComparison(
        steps=steps,
        baseline=[by_step[0][s] for s in steps],
        tuned=[by_step[1][s] for s in steps],
        numerics=[a for a in apply if _ids(a) & NUMERICS],
        max_rel_diff=None if worst is None else diffs[worst],
        max_rel_diff_step=worst,
        last_rel_diff=diffs.get(steps[-1]),
    )


# -- doctor --verify: the neighbours of an advised value that measured no faster ----------------------------------

COUNT_KNOBS = ("loader.num_workers", "loader.prefetch", "host.threads")


def neighbours(argument: str, summary: RunSummary) -> list[str]:
    """The values around the count a fix's ``argument`` sets (its first setting), each with the settings the
    argument carries; for worker counts also each with the threads that fit beside it. [] for other fixes."""
    head, *carried = argument.split(",")
    fix = parse_fixes([head])[0]
    value = fix["value"]
    if fix["id"] == "loader.num_workers":
        values = [n for n in _worker_values(summary, value) if n != value]
    elif fix["id"] == "host.threads":
        values = sorted({1, max(1, value // 2), value * 2, _cores(summary)} - {value})
    elif fix["id"] == "loader.prefetch":
        values = sorted({max(1, value // 2), value * 2} - {value})
    else:
        return []
    found = []
    for n in values:
        tried = ",".join([f"{fix['id']}={n}", *carried])
        found.append(tried)
        if fix["id"] == "loader.num_workers" and not any(c.startswith("host.threads") for c in carried):
            found += filter(None, [_with_threads(tried, n, summary)])
    return [a for a in found if not _refused(a, [])]


def verify_neighbours(
    target: Target,
    summary: RunSummary,
    settings: Settings,
    budget_s: float,
    runner: Callable[..., ABResult] = run_ab,
    run_timeout_s: float | None = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> None:
    """For each verified count fix whose advised value measured no faster or slower, measure its neighbouring
    values against the baseline (one A/B each, within ``budget_s`` in all), so that the flag comes with what does
    work: ``measured["neighbours"]`` and a note name the fastest neighbour measured faster, or say none was."""
    plan = Search(
        target, settings, budget_s, False, lambda _: summary, run_timeout_s=run_timeout_s, log=log, runner=runner
    )
    for index, fix in enumerate(summary.fixes):
        measured = fix.measured
        if not measured or measured["verdict"] == FASTER or plan.left_s(reserve=False) <= 0:
            continue
        applied = str(measured["applied"])
        if parse_fixes([applied])[0]["id"] not in COUNT_KNOBS or not (tries := neighbours(applied, summary)):
            continue
        log(f"stepscope doctor --verify: {applied} measured {measured['verdict']}; trying {', '.join(tries)}")
        result = plan.ab([plan.variant(BASELINE, [])] + [plan.variant(t, [t]) for t in tries], settings, False)
        rows = [_trial(0, "neighbour", t, [], result) for t in tries]
        measured = {**measured, "neighbours": [
            {"applied": r.candidate, "speedup": r.speedup, "ci_low": r.ci_low, "ci_high": r.ci_high,
             "verdict": r.verdict} for r in rows
        ]}  # fmt: skip
        faster = sorted((r for r in rows if r.verdict == FASTER), key=lambda r: -(r.speedup or 0.0))
        if faster:
            best = faster[0]
            interval = f"({best.ci_low:.2f}-{best.ci_high:.2f})"
            summary.notes.append(
                f"--verify: {fix.id} at its advised value ({applied}) measured {measured['verdict']}; "
                f"{best.candidate} measured {best.speedup:.2f}x {interval} faster: use that."
            )
        else:
            summary.notes.append(
                f"--verify: {fix.id}: none of the values around its advice ({', '.join(tries)}) measured faster either."
            )
        summary.fixes[index] = dataclasses.replace(fix, measured=measured)
        if result.stopped:
            summary.notes.append(f"--verify: {result.stopped}")
            break


def keep_lines(arguments: list[str]) -> list[str]:
    """How to keep each setting without stepscope: the code or environment change, one line each."""
    lines = []
    for fix in parse_fixes(arguments):
        value = fix["value"]
        word = describe_value(value) if isinstance(value, bool) else str(value)
        shown = {"on": "True", "off": "False"}.get(word, word)
        lines.append(KEEP[fix["id"]].format(value=shown))
    return lines


def run_line(arguments: list[str], command: list[str]) -> str:
    """The ``stepscope run --apply ...`` line that runs the script with the best settings."""
    import shlex

    applied = " ".join(f"--apply {shlex.quote(a)}" for a in arguments)
    return " ".join(part for part in ("stepscope run", applied, shlex.join(command)) if part)
