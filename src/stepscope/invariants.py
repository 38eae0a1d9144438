"""Invariants every summary's figures must hold, checked before a summary is shown or written.

A wrong headline figure is worse than none: it sends people after the wrong fix. These checks do not prove the
figures right, but each catches a whole class of wrong ones whatever loop shape produced it: time counted twice or
not at all, a share above the whole, ranks of one synchronous job that disagree about the job's clock, more
validation passes than steps, a fix aimed at a loader the figures do not point at. ``broken`` returns one sentence
per broken invariant; ``check`` stores them in ``RunSummary.invariants`` and adds a note, and never raises: a broken
invariant is reported, the run's figures are still written.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from stepscope.record import TOTAL
from stepscope.summary import LoaderInfo, RunSummary

BETWEEN_SHARE = 0.05  # of the wall window outside steps and passes: the step and wall rates then disagree
SHARE_SLACK = 0.005  # rounding of shares summed over phases
SUM_REL = 0.01  # the top-level phases' time per step against the step's
SYNC_REL = 0.10  # ranks of a synchronous job: wall time per step within 10% of each other
LOADER_TIE = 0.9  # a loader with at least this share of the busiest loader's fetch time is also a fair target
_MS_OF = re.compile(r"([\d,]+(?:\.\d+)?) ms of (?:a |the )?([\d,]+(?:\.\d+)?) ms")
_LOADER = re.compile(r"\bloader (\d+)\b")
_RANK = re.compile(r"^rank (\d+): ")
COMMS = "comms"


def broken(summary: RunSummary) -> list[str]:
    """One sentence per invariant the figures of ``summary`` (and of each of its ranks) break; [] when all hold."""
    found = _own(summary, "")
    for rank in summary.ranks:
        found += _own(rank, f"rank {rank.meta.rank}: ")
    if len(summary.ranks) > 1:
        found += _synchronous_ranks(summary.ranks)
    return found


def synchronous(ranks: list[RunSummary]) -> bool:
    """True when every rank waited in collectives (``comms``) in most of its measured steps: synchronous training,
    where no rank can run ahead of the others, so the ranks' wall time per step is the job's."""
    measured = [r for r in ranks if r.steps.measured]
    return len(measured) > 1 and all(
        COMMS in r.phases and 2 * r.phases[COMMS].steps >= r.steps.measured for r in measured
    )


def check(summary: RunSummary) -> RunSummary:
    """Store the broken invariants in ``summary.invariants`` with a note that asks for a report; returns it."""
    summary.invariants = broken(summary)
    if summary.invariants:
        note = (
            f"{len(summary.invariants)} figure(s) of this summary break stepscope's own invariants, so some figure "
            "here is wrong (please report it, with this summary): " + "; ".join(summary.invariants)
        )
        if note not in summary.notes:
            summary.notes.append(note)
    return summary


def between_note(summary: RunSummary) -> str | None:
    """A sentence when the step rate and the wall rate disagree by more than the validation passes explain: more
    than ``BETWEEN_SHARE`` of the measured window was in no step and no pass (None otherwise)."""
    wall, rates = summary.wall, summary.throughput
    if wall is None or wall.window_s <= 0 or wall.between_s <= BETWEEN_SHARE * wall.window_s:
        return None
    passes = f", validation passes {wall.eval_s:.2f} s" if wall.eval_s else ""
    return (
        f"the wall rate ({rates.wall_steps_per_s or 0:.2f} steps/s) is below the step rate "
        f"({rates.steps_per_s or 0:.2f} steps/s) by more than validation explains: of the {wall.window_s:.2f} s "
        f"measured, steps took {wall.steps_s:.2f} s{passes}, and {wall.between_s:.2f} s "
        f"({100 * wall.between_s / wall.window_s:.0f}%) were in no step (steps torch.profiler recorded, stepscope's "
        "checkpoint writes)"
    )


def _own(summary: RunSummary, who: str) -> list[str]:
    return [
        who + sentence
        for sentence in (
            *_shares(summary),
            *_phases_sum(summary),
            *_ms_of(summary),
            *_wall(summary),
            *_passes(summary),
            *_loader_named(summary),
        )
    ]


def _shares(summary: RunSummary) -> Iterable[str]:
    top = {name: s for name, s in summary.phases.items() if name != TOTAL and not s.nested}
    for name, stats in top.items():
        if stats.share > 1 + SHARE_SLACK:
            yield f"{name} is {100 * stats.share:.1f}% of the step, more than all of it"
    total = sum(s.share for s in top.values())
    if total > 1 + SHARE_SLACK:
        yield f"the phases' shares add up to {100 * total:.1f}% of the step, more than all of it"
    eval_share = summary.eval.get("share_of_wall")
    if eval_share is not None and eval_share > 1 + SHARE_SLACK:
        yield f"validation passes are {100 * eval_share:.1f}% of wall time, more than all of it"


def _phases_sum(summary: RunSummary) -> Iterable[str]:
    """The top-level phases' time per measured step adds up to the step (the merged job's phases are means over
    ranks of different steps, so only a single process's, or each rank's, are checked)."""
    step = summary.phases.get(TOTAL)
    if step is None or summary.cluster is not None or not step.steps:
        return
    per_step = sum(s.mean_ms * s.steps for n, s in summary.phases.items() if n != TOTAL and not s.nested) / step.steps
    if abs(per_step - step.mean_ms) > SUM_REL * step.mean_ms + 1e-3:
        yield f"the phases add up to {per_step:.3f} ms per step, not the step's {step.mean_ms:.3f} ms"


def _ms_of(summary: RunSummary) -> Iterable[str]:
    """Every "X ms of a Y ms step" in the verdict's and the fixes' evidence has X <= Y."""
    lines = [*summary.verdict.evidence, *(line for fix in summary.fixes for line in fix.evidence)]
    for line in lines:
        for part, whole in _MS_OF.findall(line):
            if float(part.replace(",", "")) > float(whole.replace(",", "")) * (1 + SHARE_SLACK):
                yield f"the evidence {line!r} gives a part larger than its whole"


def _wall(summary: RunSummary) -> Iterable[str]:
    """The measured window is accounted once: steps, passes and the time between them add up to it, none below
    zero, and the step rate is at least the wall rate."""
    wall, rates = summary.wall, summary.throughput
    if wall is None:
        return
    parts = wall.steps_s + wall.eval_s + wall.between_s
    if abs(parts - wall.window_s) > 1e-6 * max(wall.window_s, 1.0):
        yield f"the wall window ({wall.window_s:.6f} s) is not its parts' sum ({parts:.6f} s)"
    if wall.between_s < -1e-4 * wall.window_s:
        yield (
            f"steps ({wall.steps_s:.4f} s) and validation passes ({wall.eval_s:.4f} s) take more than the wall window "
            f"they fall in ({wall.window_s:.4f} s): time was counted twice"
        )
    if rates.steps_per_s and rates.wall_steps_per_s and rates.wall_steps_per_s > rates.steps_per_s * (1 + 1e-6):
        yield (
            f"the wall rate ({rates.wall_steps_per_s:.2f} steps/s) is above the step rate "
            f"({rates.steps_per_s:.2f} steps/s), though the wall window holds every step"
        )


def _passes(summary: RunSummary) -> Iterable[str]:
    passes = summary.eval.get("passes", 0)
    if passes and passes > summary.steps.measured:
        yield f"{passes} validation passes in {summary.steps.measured} measured steps: more passes than steps"


def _loader_named(summary: RunSummary) -> Iterable[str]:
    """A loader fix names the loader the figures point at: of the loaders like it (with workers, or without), the
    one the training steps waited on most (fetches inside validation passes left out). A line may name others after
    it (every loader without workers, which the fix gives workers to); the first it names is the one checked. A
    merged job's fix whose evidence says "rank R: loader N" is checked against rank R's own loaders."""
    by_rank = {r.meta.rank: r.loaders for r in summary.ranks}
    for fix in summary.fixes:
        if not fix.id.startswith("loader."):
            continue
        for line in fix.evidence:
            rank = _RANK.match(line)
            loaders = by_rank.get(int(rank.group(1)), summary.loaders) if rank else summary.loaders
            first = _LOADER.search(line)
            if first is None:
                continue
            index = int(first.group(1))
            wrong = _not_the_busiest(loaders, index)
            if wrong:
                yield f"fix {fix.id} names loader {index}, but the steps waited on another one more ({wrong})"


def _not_the_busiest(loaders: list[LoaderInfo], index: int) -> str | None:
    """The loaders like loader ``index`` with their wait (s) when another one was waited on clearly more; else None."""
    fed = [x for x in loaders if x.batches > 0]
    target = next((x for x in fed if x.index == index), None)
    if target is None or len(fed) < 2:
        return None
    alike = [x for x in fed if (x.num_workers == 0) == (target.num_workers == 0)]
    if target.step_fetch_s >= LOADER_TIE * max(x.step_fetch_s for x in alike):
        return None
    return ", ".join(f"loader {x.index} {x.step_fetch_s:.2f} s" for x in alike)


def _synchronous_ranks(ranks: list[RunSummary]) -> Iterable[str]:
    """The ranks of a synchronous job keep one clock: their wall time per step is equal (within ``SYNC_REL``)."""
    if not synchronous(ranks):
        return
    per_step = {
        r.meta.rank: r.wall.window_s / r.steps.measured * 1e3 for r in ranks if r.wall is not None and r.steps.measured
    }
    if len(per_step) < 2:
        return
    low, high = min(per_step.values()), max(per_step.values())
    if high - low > SYNC_REL * high:
        listed = ", ".join(f"rank {rank} {ms:.2f} ms" for rank, ms in sorted(per_step.items()))
        yield f"the ranks of this synchronous job disagree on its wall time per step ({listed})"
