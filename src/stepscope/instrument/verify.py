"""``stepscope doctor --verify``: apply the doctor's top fixes to the unmodified script and measure what each gains.

A fix's ``gain_bound`` is an upper bound from the measured shares (Amdahl), not a gain: the waiting a fix removes
may reappear elsewhere (a second bottleneck, contention for the same cores). Where ``--apply`` can make the change
at runtime, the gain is measured instead: the baseline and each fix run interleaved (baseline, fix 1, fix 2,
baseline, ...) ``repeats`` times each, exactly as ``stepscope ab`` runs variants, and each fix is compared with the
baseline by ab's statistics (speedup with its 95% interval; "faster", "slower" or "no detectable difference").

The verified fixes are then ranked by what they gained: those measured faster first, by measured speedup; then the
fixes not verified, in the doctor's order; then those measured to gain nothing or to slow the run. A fix measured
slower, or faster than its own bound allows, is flagged: the doctor's reasoning was wrong there, and says so.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from stepscope.analyses.ab import FASTER, SLOWER, ABResult, Comparison, Settings
from stepscope.instrument.ab import Variant, run_ab
from stepscope.instrument.apply import APPLIABLE, ApplyError, parse_fixes
from stepscope.instrument.launch import Target
from stepscope.summary import Fix, RunSummary

BASELINE = "baseline"


@dataclass
class VerifyPlan:
    """Which fixes will be verified (each with its ``--apply`` argument), and why the others will not."""

    chosen: list[tuple[Fix, str]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # one sentence per fix left out


def apply_argument(fix: Fix) -> str | None:
    """The ``--apply`` argument that makes ``fix`` at runtime: the rule's own (with the value its evidence
    recommends), else the catalogue id where ``--apply`` has a default direction; None when it cannot."""
    if fix.apply:
        return fix.apply
    appliable = APPLIABLE.get(fix.id)
    return fix.id if appliable is not None and appliable.default is not None else None


def plan(fixes: list[Fix], top: int, allow_numerics: bool) -> VerifyPlan:
    """The first ``top`` fixes (in the doctor's order) that ``--apply`` can make; numerics-changing ones only with
    ``allow_numerics``."""
    chosen = VerifyPlan()
    for fix in fixes:
        if len(chosen.chosen) == top:
            break
        argument = apply_argument(fix)
        if argument is None:
            chosen.skipped.append(f"{fix.id} is not verified: it is a {fix.cost} change --apply cannot make at runtime")
        elif fix.changes_numerics and not allow_numerics:
            chosen.skipped.append(f"{fix.id} is not verified: it changes numerics (--allow-numerics verifies it)")
        elif (refused := _refused(argument)) is not None:  # a value past this machine's bound (workers, say)
            chosen.skipped.append(f"{fix.id} is not verified: {refused}")
        else:
            chosen.chosen.append((fix, argument))
    return chosen


def _refused(argument: str) -> str | None:
    """Why ``--apply`` would refuse ``argument`` on this machine, or None when it takes it."""
    try:
        parse_fixes([argument])
    except ApplyError as error:
        return str(error)
    return None


def queue_steps(applied: list[dict[str, object]]) -> int:
    """Warm-up steps that drain the batches more loader workers fetch ahead (workers x prefetch_factor, torch's
    default 2) before measuring: counted, they would make a worker fix look faster than its workers can be.
    ``applied``: the variants' parsed ``--apply`` fixes ({id, value})."""
    workers = [int(str(f["value"])) for f in applied if f["id"] == "loader.num_workers"]
    return max((2 * n + 2 for n in workers), default=0)


def largest_speedup(fix: Fix) -> float | None:
    """The speedup the fix's bound allows: saving a share ``b`` of the step is at most ``1 / (1 - b)``; None when
    unbounded or bounded on wall time (a pass outside the steps, which the step time does not show)."""
    if fix.gain_bound is None or fix.gain_basis != "step":
        return None
    return float("inf") if fix.gain_bound >= 1 else 1 / (1 - fix.gain_bound)


def _measured(comparison: Comparison, argument: str, fix: Fix) -> dict[str, object]:
    low, high = comparison.speedup_ci if comparison.speedup_ci is not None else (None, None)
    measured: dict[str, object] = {
        "speedup": comparison.speedup,
        "ci_low": low,
        "ci_high": high,
        "runs": list(comparison.runs),
        "verdict": comparison.verdict,
        "applied": argument,
        "flag": None,
    }
    most = largest_speedup(fix)
    if comparison.verdict == SLOWER:
        measured["flag"] = (
            f"measured slower ({comparison.speedup:.2f}x): the doctor expected a gain of up to "
            f"{_bound_text(fix)}; its reasoning was wrong for this run"
        )
    elif low is not None and most is not None and low > most * 1.02:
        measured["flag"] = (
            f"measured {low:.2f}x or more, beyond the {most:.2f}x its bound ({_bound_text(fix)}) allows: the bound "
            "was too low, so the doctor's shares missed where the time went"
        )
    elif comparison.reason:
        measured["flag"] = comparison.reason
    return measured


def _bound_text(fix: Fix) -> str:
    return "an unknown amount" if fix.gain_bound is None else f"{100 * fix.gain_bound:.0f}% of the step"


def rerank(fixes: list[Fix]) -> list[Fix]:
    """Fixes measured faster first, by measured speedup; then the unverified, in the doctor's order; then those
    that measured no gain or a loss (slower last)."""

    def key(item: tuple[int, Fix]) -> tuple[int, float, int]:
        position, fix = item
        m = fix.measured
        if m is None:
            return (1, 0.0, position)
        if m["verdict"] == FASTER:
            return (0, -float(m["speedup"] or 0.0), position)
        return (3 if m["verdict"] == SLOWER else 2, 0.0, position)

    return [fix for _, fix in sorted(enumerate(fixes), key=key)]


def verify(
    target: Target,
    summary: RunSummary,
    chosen: VerifyPlan,
    settings: Settings,
    budget_s: float | None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
    run_timeout_s: float | None = None,
) -> ABResult | None:
    """Run the baseline and each chosen fix interleaved and put each fix's ``measured`` figures into ``summary``'s
    fixes, re-ranked; the plan's skipped fixes and any flag go into its notes. Returns the A/B result (None when no
    fix could be verified). Each run's time limit: ``run_ab``'s."""
    summary.notes += chosen.skipped
    if not chosen.chosen:
        summary.notes.append("--verify: none of the ranked fixes can be applied at runtime; nothing was measured.")
        return None
    command = " ".join(target.argv)
    variants = [Variant(BASELINE, command, {}, target)]
    variants += [Variant(fix.id, command, {}, target, parse_fixes([arg])) for fix, arg in chosen.chosen]
    applied = [f for variant in variants for f in variant.apply]
    settings = dataclasses.replace(settings, warmup=max(settings.warmup, queue_steps(applied)))
    log(
        f"stepscope doctor --verify: {len(variants)} variants ({', '.join(v.name for v in variants)}) x "
        f"{settings.repeats} interleaved runs of {settings.steps} steps"
    )
    result = run_ab(variants, settings, log=log, budget_s=budget_s, run_timeout_s=run_timeout_s)
    by_id = {c.candidate: c for c in result.comparisons}
    for fix, argument in chosen.chosen:
        comparison = by_id.get(fix.id)
        if comparison is None:
            continue
        measured = _measured(comparison, argument, fix)
        if measured["flag"] and comparison.verdict in (SLOWER, FASTER):
            summary.notes.append(f"--verify: {fix.id} {measured['flag']}.")
        index = summary.fixes.index(fix)
        summary.fixes[index] = dataclasses.replace(fix, measured=measured)
    summary.fixes = rerank(summary.fixes)
    if result.stopped:
        summary.notes.append(f"--verify: {result.stopped}")
    for variant in result.variants:
        if variant.usable_runs == 0 and variant.runs:
            failures = {run.failure for run in variant.runs if run.failure}
            summary.notes.append(f"--verify: {variant.name} has no usable run ({'; '.join(sorted(failures))}).")
    return result
