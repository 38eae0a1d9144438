"""Scores a stepscope summary against a truth case's own timer (bench/truth.py).

:func:`own_figures` reads the script's own records over the measured window; :func:`expect` turns them and the
case's spec into an :class:`Expectation`; :func:`score_case` gives the five scores (right, wrong, or n/a), each
with the expected and the measured figures. The rules are written out in bench/truth.py's docstring.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from truth_spec import CaseSpec, StragglerSpec

RIGHT, WRONG, NA = "right", "wrong", "n/a"
SCORES = ("steps/s", "phases", "bound", "first fix", "invariants")
RATE_TOL = 0.05  # steps/s within ±5% of the script's own
PHASE_REL, PHASE_ABS = 0.15, 0.3  # a phase mean within ±15% or ±0.3 ms, whichever is larger
GROUPS = {
    "data_wait": "data",
    "h2d": "data",
    "forward": "compute",
    "backward": "compute",
    "comms": "comms",
    "optimizer": "optimizer",
    "zero_grad": "optimizer",
    "clip": "optimizer",
    "other": "host",
    "sync": "host",
}
STEP_PHASES = ("data_wait", "forward", "backward", "optimizer", "zero_grad")  # the spans the script times
# Fixes aimed at each kind of cause (the module docstring of bench/truth.py says why).
LOADER_FIXES = frozenset(
    {"loader.num_workers", "loader.io_bound", "loader.transform_bound", "loader.prefetch", "loader.batched_tensors"}
)
AIMED: dict[str, frozenset[str]] = {
    "data": LOADER_FIXES,
    "oversubscribed": frozenset({"loader.too_many_workers", "host.threads", "loader.transform_bound"}),
    "optimizer": frozenset({"optimizer.fused", "optimizer.foreach"}),
    "checkpoint": frozenset({"host.checkpoint_every_step"}),
    "log": frozenset({"host.log_every_step"}),
    "validation": frozenset({"eval.frequency"}),
    "epochs": frozenset({"loader.persistent_workers"}),  # workers started again at each epoch: their stalls
    "compute": frozenset(),  # sleeps and busy loops in forward/backward: no CPU fix in the catalogue shortens them
    "other": frozenset(),  # plain Python in the loop body: no catalogued fix
}
COST_ORDER = {"config": 0, "code": 1, "infra": 2}
SECONDARY_SHARE = 0.05  # a secondary cause this large may be fixed first (the doctor's own 5% line)
STRAGGLER_GAP = 0.10  # one rank's own time in a phase this far (share of the step) above the other's
NEUTRAL_GAIN = 0.05  # a first fix bounded below this is the doctor's "nothing else": neither aimed nor wrong


@dataclass
class OwnFigures:
    """The script's own figures over the measured window, for one rank."""

    rank: int
    steps: int
    wall_s: float
    val_s: float
    val_passes: int
    phases: dict[str, float]  # mean ms per step: the spans, and other = the rest of the step
    injected: dict[str, float]  # mean ms per step of each injected cost, as spent
    loader_wait: dict[str, float]  # mean data_wait ms per step, per Dataset class
    samples: float = 0.0  # mean training samples per step
    val_by_step: list[float] = field(default_factory=list)  # the window's steps: validation before each (s)
    backward_by_step: list[float] = field(default_factory=list)  # ... and its backward, the all-reduce inside (s)
    val_wait_s: float = 0.0  # its wait for another rank's validation, inside its backward (set_val_waits)

    @property
    def step_rate(self) -> float:
        return self.steps / (self.wall_s - self.val_s)

    @property
    def wall_rate(self) -> float:
        return self.steps / self.wall_s

    @property
    def step_ms(self) -> float:
        return sum(self.phases.values())


@dataclass
class PhaseCheck:
    """One injected cost's phase: expected mean (the script's own time for the phase's calls), injected part."""

    rank: int | None  # None: the single-rank summary's phases
    phase: str
    expected_ms: float
    injected_ms: float


@dataclass
class Expectation:
    """What stepscope should report for a case."""

    checks: list[PhaseCheck]
    val_passes: int  # validations in the measured window (0: none may be reported)
    bound_ok: list[str]  # acceptable bounds, the expected one first
    bound_why: str
    contention_ok: bool  # background load: the contention stated, with confidence lowered, also counts
    straggler: tuple[int, str] | None
    causes: dict[str, str]  # acceptable bound -> the kind of cause (a key of AIMED) its first fix should aim at
    fix_loaders: list[str]  # Dataset classes a loader fix may name (see ``expect``); empty: any
    fix_lines: dict[str, int]  # "checkpoint"/"log" -> the script line a host fix must name
    fix_rank: int | None  # the rank a fix aimed at the straggler's cause must name
    straggler_group: str | None
    secondary: dict[str, float] = field(default_factory=dict)  # injected causes with a fix: kind -> share
    step_rate: float = 0.0
    wall_rate: float = 0.0
    sample_rate: float = 0.0  # the job's: every rank's samples a step at the slowest rank's step rate
    restarting_loaders: list[str] = field(default_factory=list)  # with workers started again at each epoch


@dataclass
class Score:
    """One score of one case: right, wrong or n/a, with the figures behind it."""

    name: str
    status: str
    detail: str = ""


class TruthError(RuntimeError):
    """The script's own records do not cover the measured window: the case, not the product, is wrong."""


def own_figures(records: list[dict[str, Any]], warmup: int, measured: int, rank: int = 0) -> OwnFigures:
    """The measured window of the script's records: steps ``warmup+1 .. warmup+measured-1`` (1-based), whose
    intervals run from the end of the last warm-up step. The last measured step is left out: stepscope does its
    own work after it closes, inside the script's ``optimizer.step()`` call (the doctor's loader ceiling: 0.3 s
    for 20 batches of 12 ms), which the script's clock cannot tell from its own; one step fewer changes no mean."""
    if warmup < 1 or measured < 2 or len(records) < warmup + measured:
        raise TruthError(f"rank {rank}: {len(records)} own records, window needs {warmup + measured}")
    measured -= 1
    window = records[warmup : warmup + measured]
    wall_s = window[-1]["t"] - records[warmup - 1]["t"]
    sums: dict[str, float] = {}
    injected: dict[str, float] = {}
    prev_t = records[warmup - 1]["t"]
    for rec in window:
        interval = rec["t"] - prev_t - rec["val_s"]
        prev_t = rec["t"]
        spans = rec["spans"]
        for key, value in spans.items():
            sums[key] = sums.get(key, 0.0) + value
        sums["other"] = sums.get("other", 0.0) + interval - sum(spans.get(p, 0.0) for p in STEP_PHASES)
        for key, value in rec["injected"].items():
            injected[key] = injected.get(key, 0.0) + value
    per_step = {k: v * 1e3 / measured for k, v in sums.items()}
    return OwnFigures(
        rank=rank,
        steps=measured,
        wall_s=wall_s,
        val_s=sum(rec["val_s"] for rec in window),
        val_passes=sum(1 for rec in window if rec["val_s"] > 0),
        phases={p: per_step.get(p, 0.0) for p in (*STEP_PHASES, "other")},
        injected={k: v * 1e3 / measured for k, v in injected.items()},
        loader_wait={k.split(":", 1)[1]: v for k, v in per_step.items() if k.startswith("data_wait:")},
        samples=sum(rec.get("samples", 0) for rec in window) / measured,
        val_by_step=[rec["val_s"] for rec in window],
        backward_by_step=[rec["spans"].get("backward", 0.0) for rec in window],
    )


def set_val_waits(own: list[OwnFigures]) -> None:
    """Each rank's wait for another rank's longer validation: in the step after it, its backward's all-reduce waits
    beyond its usual (its median over the steps before which no rank validated), up to the difference in the
    validations. A rank whose own step is longer anyway (a straggler) waits for none of it: its extra work overlaps
    the other's validation, which then costs the job nothing."""
    steps = min(len(o.val_by_step) for o in own)
    most = [max(o.val_by_step[k] for o in own) for k in range(steps)]
    for o in own:
        usual = [o.backward_by_step[k] for k in range(steps) if most[k] == 0]
        if not usual:
            continue
        baseline = statistics.median(usual)
        o.val_wait_s = sum(
            min(most[k] - o.val_by_step[k], max(0.0, o.backward_by_step[k] - baseline))
            for k in range(steps)
            if most[k] > o.val_by_step[k]
        )


def _checked_phases(spec: CaseSpec, rank: int) -> list[str]:
    """The phases an injected cost lands in, on ``rank``."""
    phases = []
    if any(ld.cost for ld in spec.loaders) or spec.cause == "oversubscribed":
        phases.append("data_wait")
    if spec.forward or spec.side:
        phases.append("forward")
    if spec.backward:
        phases.append("backward")
    if spec.optimizer:
        phases.append("optimizer")
    s = spec.straggler
    rank_only = s is not None and s.phase in ("checkpoint", "log")  # rank s.rank alone saves or logs
    if spec.other or ((spec.checkpoint_mb or spec.log) and (not rank_only or s.rank == rank)):
        phases.append("other")
    if s is not None and s.cost is not None and s.rank == rank and s.phase not in phases:
        phases.append(s.phase)
    return phases


def _job_phases(own: list[OwnFigures]) -> dict[str, float]:
    """The job's own time per phase: the mean over ranks, but backward the least of the ranks' (the timer around
    ``loss.backward()`` also holds DDP's all-reduce, where a rank waits for the others; the rank that came last
    waited least)."""
    phases = {p: sum(o.phases[p] for o in own) / len(own) for p in own[0].phases}
    phases["backward"] = min(o.phases["backward"] for o in own)
    return phases


def _groups(phases: dict[str, float]) -> list[tuple[str, float]]:
    """The verdict groups' own time per step, largest first."""
    totals: dict[str, float] = {}
    for phase, ms in phases.items():
        group = GROUPS[phase]
        totals[group] = totals.get(group, 0.0) + ms
    return sorted(totals.items(), key=lambda kv: -kv[1])


def _rank_gaps(own: list[OwnFigures], step: float) -> dict[str, tuple[int, float]]:
    """Phases (backward aside) in which one rank's own time exceeds the other's by ≥ 10% of the step: a real
    straggler, injected or made by load (a loaded core stretches even a sleep's wake-ups): phase -> (rank, ms)."""
    gaps = {}
    for phase in own[0].phases:
        if phase == "backward" or len(own) < 2:
            continue
        slow = max(own, key=lambda o: o.phases[phase])
        gap = slow.phases[phase] - min(o.phases[phase] for o in own)
        if gap >= STRAGGLER_GAP * step:
            gaps[phase] = (slow.rank, gap)
    return gaps


def _shown_straggler(spec: CaseSpec, own: list[OwnFigures]) -> StragglerSpec | None:
    """The case's straggler, unless a slow rank's loader was hidden (its prefetcher threads fetch beside the steps;
    itertools.cycle replays the batches of its first pass, fetched in the warm-up): its training thread then waits
    for data no longer than the other rank's (by less than STRAGGLER_GAP of its step), and there is no straggler to
    find."""
    s = spec.straggler
    if s is None or s.phase != "data_wait":
        return s
    lead = next(o for o in own if o.rank == s.rank)
    excess = lead.phases["data_wait"] - min(o.phases["data_wait"] for o in own)
    return s if excess >= STRAGGLER_GAP * lead.step_ms else None


def _bound(spec: CaseSpec, own: list[OwnFigures]) -> tuple[list[str], str]:
    """Acceptable bounds, the expected one first: the straggler's phase group; else the group with the largest own
    time (also `balanced` when it is under 45% of the step, and the runner-up within 15% of it); and for 2 ranks
    the group of any phase where one rank's own time is ≥ 10% of the step above the other's."""
    phases = _job_phases(own)
    step = sum(phases.values())
    s = _shown_straggler(spec, own)
    if s is not None:
        # The job's step is the straggler's: its excess is the bound while its group leads that step (or nothing
        # holds 45% of it), else the group that does, as in a case without a straggler.
        phase = "other" if s.phase in ("checkpoint", "log") else s.phase
        lead = next(o for o in own if o.rank == s.rank)
        (g1, t1), *rest = _groups(lead.phases)
        own_step = sum(lead.phases.values())
        ok, why = [GROUPS[phase]], f"rank {s.rank}'s excess in {phase}"
        if g1 != GROUPS[phase] and t1 >= 0.45 * own_step:
            t_s = dict(rest).get(GROUPS[phase], 0.0)
            why = f"rank {s.rank}'s own step (the job's) is {t1 / own_step:.0%} {g1}, {ok[0]} {t_s:.1f} ms with {why}"
            ok = [g1, *ok] if t_s >= 0.85 * t1 else [g1]
    else:
        ranked = _groups(phases)
        (g1, t1), (g2, t2) = ranked[0], ranked[1]
        ok = [g1]
        if t1 / step < 0.45:
            ok.append("balanced")
        if t2 >= 0.85 * t1:
            ok.append(g2)
        why = "own group times per step: " + ", ".join(f"{g} {t:.1f} ms ({t / step:.0%})" for g, t in ranked[:3])
        if spec.cause == "oversubscribed" and "data" not in ok:
            # The script's own timers hold the main thread's wait for the cores its workers took: that wait is
            # the input pipeline's (issue 24), whichever phase it fell in.
            ok.insert(0, "data")
            why += "; the job's own workers hold the cores: the wait is data's"
    for phase, (rank, gap) in _rank_gaps(own, step).items():
        why += f"; rank {rank}'s own {phase} {gap:.1f} ms above the other's"
        if GROUPS[phase] not in ok:
            ok.append(GROUPS[phase])
    return ok, why


def _cause(spec: CaseSpec, lead: OwnFigures, group: str) -> str:
    """The kind of cause (a key of AIMED) behind a verdict group."""
    if group == "data":
        return "oversubscribed" if spec.cause == "oversubscribed" else "data"
    if group == "host":
        host = {k: lead.injected.get(k, 0.0) for k in ("other", "checkpoint", "log")}
        return max(host, key=lambda k: host[k])
    return group


def _injected_causes(spec: CaseSpec, own: OwnFigures, ranks: list[OwnFigures]) -> dict[str, float]:
    """The injected causes with a catalogued fix that are large enough to be fixed first, and their share (of the
    ``own`` rank's step; validation: of wall time, the rank that validated most's, for the others wait for it). The
    primary is among them; the scorer skips it."""
    step = own.step_ms
    out = {}
    if own.phases["data_wait"] / step >= SECONDARY_SHARE and any(ld.cost for ld in spec.loaders):
        out["data"] = own.phases["data_wait"] / step
    if own.phases["optimizer"] / step >= SECONDARY_SHARE and spec.optimizer:
        out["optimizer"] = own.phases["optimizer"] / step
    for kind in ("checkpoint", "log"):
        if own.injected.get(kind, 0.0) / step >= SECONDARY_SHARE:
            out[kind] = own.injected[kind] / step
    if spec.val and any(o.val_s > 0 for o in ranks):
        out["validation"] = max(o.val_s / o.wall_s for o in ranks)
    if (
        spec.epoch_batches
        and any(ld.workers for ld in spec.loaders)
        and own.phases["data_wait"] / step >= SECONDARY_SHARE
    ):
        out["epochs"] = own.phases["data_wait"] / step  # at most: the restarts' stalls are part of the wait
    if spec.cause == "oversubscribed":  # injected on purpose, whichever group the verdict then names
        out["oversubscribed"] = own.phases["data_wait"] / step
    return out


def expect(spec: CaseSpec, own: list[OwnFigures], script_line: dict[str, int | None]) -> Expectation:
    """The expectation of a case from its spec and its own figures (one per rank)."""
    lead = own[0]
    if spec.straggler is not None:
        lead = next(o for o in own if o.rank == spec.straggler.rank)
    # A rank that validates less waits for the difference in its next step's all-reduce (inside its own timer of
    # backward): the job's validation, not its step (docs/run.md). Measured: see set_val_waits.
    checks = []
    for o in own:
        for phase in _checked_phases(spec, o.rank):
            injected = sum(v for k, v in o.injected.items() if _label_phase(k) == phase)
            expected = o.phases[phase]
            if phase == "backward":
                expected -= o.val_wait_s * 1e3 / o.steps
            checks.append(PhaseCheck(o.rank if spec.ranks > 1 else None, phase, expected, injected))
    bound_ok, why = _bound(spec, own)
    causes = {g: _cause(spec, lead, g) for g in bound_ok if g != "balanced"}
    causes["balanced"] = causes[bound_ok[0]]
    s = _shown_straggler(spec, own)
    straggler = None
    if s is not None:
        straggler = (s.rank, "other" if s.phase in ("checkpoint", "log") else s.phase)
    # The loader a fix must name is the injected cause's: of the loaders given a cost (and loader 0, which carries
    # a data straggler's), the one the script waited on most. A free loader's wait is its workers' hand-over,
    # which a loaded machine stretches: not an injected cost, except where each batch is per-sample tensors, whose
    # hand-over from a worker is a cost of the batch's form (several ms a batch).
    injected = {ld.name for ld in spec.loaders if ld.cost or (spec.batch_form == "samples" and ld.workers)}
    if s is not None and s.phase == "data_wait" and spec.loaders:
        injected.add(spec.loaders[0].name)
    waits = {
        name: max(o.loader_wait.get(name, 0.0) for o in own)
        for name in own[0].loader_wait
        if not injected or name in injected
    }
    step_rate = min(o.steps / (o.wall_s - o.val_s - o.val_wait_s) for o in own)
    passes = [o.val_passes for o in own]  # rank 0 alone validating: its passes are the job's
    secondary = _injected_causes(spec, lead, own)
    return Expectation(
        checks=checks,
        val_passes=max(passes) if spec.val and spec.val.only_rank is not None else min(passes),
        bound_ok=bound_ok,
        bound_why=why,
        contention_ok=spec.bg_load > 0,
        straggler=straggler,
        causes=causes,
        fix_loaders=_fix_loaders(spec, waits),
        fix_lines={k: v for k, v in script_line.items() if v is not None},
        fix_rank=s.rank if s is not None else None,
        straggler_group=GROUPS[straggler[1]] if straggler is not None else None,
        secondary=secondary,
        step_rate=step_rate,
        wall_rate=min(o.wall_rate for o in own),
        sample_rate=sum(o.samples for o in own) * step_rate,
        restarting_loaders=[ld.name for ld in spec.loaders if ld.workers] if spec.epoch_batches else [],
    )


def _fix_loaders(spec: CaseSpec, waits: dict[str, float]) -> list[str]:
    """The loaders a loader fix may name: of those with an injected cost, the one the script waited on most; and,
    when that one has workers, also the most waited-on one without workers. Beside busy loops a loader with workers
    is waited on for each batch's hand-over, which the load stretches (a cheap one's wait can exceed a costlier
    loader's without workers); workers for the loader that has none remove an injected cost."""
    if not waits:
        return []
    workers = {ld.name: ld.workers for ld in spec.loaders}
    names = [max(waits, key=lambda k: waits[k])]
    without = {k: v for k, v in waits.items() if not workers.get(k) and v > 0}
    if workers.get(names[0]) and without:
        names.append(max(without, key=lambda k: without[k]))
    return names


def _label_phase(label: str) -> str:
    """The phase an injected cost's label lands in."""
    if label.startswith("data_wait"):
        return "data_wait"
    return {"side": "forward", "checkpoint": "other", "log": "other"}.get(label, label)


def _within(measured: float, expected: float, rel: float, floor: float = 0.0) -> bool:
    return abs(measured - expected) <= max(rel * abs(expected), floor)


def _rank_rows(summary: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {r["meta"]["rank"]: r for r in summary.get("ranks") or [] if r.get("meta", {}).get("rank") is not None}


def _phase_ms(row: dict[str, Any], phase: str) -> float:
    """A phase's time per measured step (ms), as the script's own figures are: ``mean_ms`` is over the steps in
    which the phase ran (a cycled loader's data_wait: its first pass only)."""
    stats = row.get("phases", {}).get(phase)
    if not stats:
        return 0.0
    measured = (row.get("steps") or {}).get("measured") or stats["steps"]
    return float(stats["mean_ms"]) * stats["steps"] / max(measured, 1)


def _last_step_factors(summary: dict[str, Any]) -> tuple[float, float]:
    """How much the last measured step moves the summary's step rate and wall rate, from the slowest rank's series:
    (rate over the measured steps but the last) / (rate over all of them), for the step and for the wall window.
    The script's own window leaves that step out (see ``own_figures``), and on a loaded machine one step can be
    several times the mean. (1, 1) without a series of single steps."""
    rows = list(_rank_rows(summary).values()) or [summary]
    row = max(rows, key=lambda r: ((r.get("phases") or {}).get("total") or {}).get("mean_ms", 0.0))
    series, steps = row.get("series") or {}, row.get("steps") or {}
    warmup, measured = steps.get("warmup") or 0, steps.get("measured") or 0
    points = series.get("step_ms") or []
    if series.get("stride") != 1 or measured < 2 or len(points) < warmup + measured:
        return 1.0, 1.0
    window = points[warmup : warmup + measured]
    step = (sum(window) / measured) / (sum(window[:-1]) / (measured - 1))
    wall_s = (row.get("wall") or {}).get("window_s") or 0.0
    if wall_s * 1e3 <= window[-1]:
        return step, 1.0
    return step, (wall_s / measured) / ((wall_s - window[-1] / 1e3) / (measured - 1))


def score_rate(summary: dict[str, Any], exp: Expectation) -> Score:
    """Score 1: the step rate, the sample rate (and the wall rate, when the summary has one) within ±5% of the
    script's own, over the same steps (the summary's rates moved by what its last measured step weighs in them)."""
    thr = dict(summary.get("throughput") or {})
    step_factor, wall_factor = _last_step_factors(summary)
    for key, factor in (
        ("steps_per_s", step_factor),
        ("samples_per_s", step_factor),
        ("wall_steps_per_s", wall_factor),
    ):
        if thr.get(key) is not None:
            thr[key] *= factor
    got = thr.get("steps_per_s")
    problems = []
    if got is None or not _within(got, exp.step_rate, RATE_TOL):
        problems.append(f"steps_per_s {got} vs own {exp.step_rate:.2f}")
    samples = thr.get("samples_per_s")
    if exp.sample_rate and (samples is None or not _within(samples, exp.sample_rate, RATE_TOL)):
        problems.append(f"samples_per_s {samples} vs own {exp.sample_rate:.1f}")
    wall = thr.get("wall_steps_per_s")
    if wall is not None and not _within(wall, exp.wall_rate, RATE_TOL):
        problems.append(f"wall_steps_per_s {wall:.2f} vs own {exp.wall_rate:.2f}")
    shown = f"steps/s {got if got is None else round(got, 2)} vs own {exp.step_rate:.2f}"
    shown += f"; samples/s {samples if samples is None else round(samples, 1)} vs own {exp.sample_rate:.1f}"
    if wall is not None:
        shown += f"; wall {wall:.2f} vs own {exp.wall_rate:.2f}"
    return Score("steps/s", WRONG if problems else RIGHT, "; ".join(problems) or shown)


def score_phases(summary: dict[str, Any], exp: Expectation) -> Score:
    """Score 2: each injected cost in its phase (±15% or 0.3 ms), the validation passes counted (±1) and no
    side work taken for validation, the straggler's rank and phase named."""
    rows = _rank_rows(summary)
    problems, shown = [], []
    for check in exp.checks:
        row = summary if check.rank is None else rows.get(check.rank, {})
        got = _phase_ms(row, check.phase)
        if check.rank is not None and check.phase == "backward":
            got += _phase_ms(row, "comms")  # the script's backward span holds DDP's all-reduce wait
        where = check.phase if check.rank is None else f"rank {check.rank} {check.phase}"
        text = f"{where} {got:.2f} ms vs own {check.expected_ms:.2f} (injected {check.injected_ms:.2f})"
        shown.append(text)
        if not _within(got, check.expected_ms, PHASE_REL, PHASE_ABS):
            problems.append(text)
    passes = int((summary.get("eval") or {}).get("passes") or 0)
    per_rank = [int((r.get("eval") or {}).get("passes") or 0) for _, r in sorted(rows.items())]
    ranks_said = f" (the ranks' rows: {per_rank})" if per_rank else ""
    shown.append(f"eval passes {passes} vs own {exp.val_passes}{ranks_said}")
    if exp.val_passes and abs(passes - exp.val_passes) > 1:
        problems.append(f"eval passes {passes} vs own {exp.val_passes}{ranks_said}")
    elif not exp.val_passes and passes:
        problems.append(f"eval passes {passes}, but no validation ran in the window (side work taken for it?)")
    if exp.straggler is not None:
        got_s = (summary.get("cluster") or {}).get("straggler") or {}
        named = (got_s.get("rank"), got_s.get("phase"))
        shown.append(f"straggler {named}")
        if named != exp.straggler:
            problems.append(f"straggler {named} vs rank {exp.straggler[0]} {exp.straggler[1]}")
    return Score("phases", WRONG if problems else RIGHT, "; ".join(problems) or "; ".join(shown))


def score_bound(summary: dict[str, Any], exp: Expectation) -> Score:
    """Score 3: the bound is the primary cause's group (or the contention stated, confidence lowered)."""
    verdict = summary.get("verdict") or {}
    bound, confidence = verdict.get("bound"), verdict.get("confidence")
    text = f"bound {bound} ({confidence}) vs {'/'.join(exp.bound_ok)}: {exp.bound_why}"
    if bound in exp.bound_ok:
        return Score("bound", RIGHT, text)
    stated = any("the machine is oversubscribed" in e for e in verdict.get("evidence") or [])
    if exp.contention_ok and stated and confidence != "high":
        return Score("bound", RIGHT, text + " (contention stated)")
    return Score("bound", WRONG, text)


def _aimed_kind(fix: dict[str, Any], kinds: list[str]) -> str | None:
    """The first of ``kinds`` whose catalogued fixes include ``fix``."""
    return next((k for k in kinds if fix["id"] in AIMED.get(k, frozenset())), None)


def _names(fix: dict[str, Any], exp: Expectation, kind: str, rank_needed: bool, script: str) -> list[str]:
    """What an aimed fix's evidence fails to name: the loader, the script line, the straggler rank."""
    text = " ".join(fix.get("evidence") or [])
    missing = []
    loaders = exp.restarting_loaders if fix["id"] == "loader.persistent_workers" else exp.fix_loaders
    if fix["id"].startswith("loader.") and loaders and not any(name in text for name in loaders):
        missing.append(f"loader {' or '.join(loaders)}")
    line = exp.fix_lines.get(kind)
    if line is not None and fix["id"].startswith("host.") and f"{script}:{line}" not in text:
        missing.append(f"line {script}:{line}")
    if rank_needed and exp.fix_rank is not None and f"rank {exp.fix_rank}" not in text:
        missing.append(f"rank {exp.fix_rank}")
    return missing


def score_fix(summary: dict[str, Any], exp: Expectation, script: str) -> Score:
    """Score 4: the first fix aims at the cause of the (accepted) bound, or of another accepted bound, naming its
    loader, line or rank; or at a secondary injected cause that the cheapest-first ranking puts before it; with no
    catalogued fix for the cause, it aims at nothing that was not injected."""
    fixes = summary.get("fixes") or []
    bound = (summary.get("verdict") or {}).get("bound")
    group = bound if bound in exp.causes else exp.bound_ok[0]
    cause = exp.causes[group]
    aimed = AIMED.get(cause, frozenset())
    if cause == "data" and "epochs" in exp.secondary:  # the epochs' restarts are part of the data wait
        aimed |= AIMED["epochs"]
    if "oversubscribed" in exp.secondary:
        # The case's own workers holding the cores is its injected cause, whichever group the load then inflates
        # most (a busy optimizer under 4 busy processes a core): their count is a first fix.
        aimed |= AIMED["oversubscribed"]
    text = f"fixes {[f['id'] for f in fixes[:3]]}; cause {cause} wants {sorted(aimed) or 'none'}"
    if not fixes:
        return Score("first fix", WRONG if aimed else RIGHT, text)
    first = fixes[0]
    gain = first.get("gain_bound")
    if first["id"] in aimed:
        rank_needed = group == exp.straggler_group
        missing = _names(first, exp, cause, rank_needed, script)
        text += f"; evidence misses {missing}" if missing else ""
        return Score("first fix", WRONG if missing else RIGHT, text)
    for other in exp.bound_ok:
        # The cause of another accepted bound (a straggler's injected phase beside a data wait as large): the
        # doctor ranks their fixes by their bounds, whichever group the verdict named
        other_cause = exp.causes.get(other)
        if other_cause is not None and other_cause != cause and first["id"] in AIMED.get(other_cause, frozenset()):
            missing = _names(first, exp, other_cause, other == exp.straggler_group, script)
            text += f" (first aims at the accepted bound {other}'s cause)"
            return Score(
                "first fix", WRONG if missing else RIGHT, text + (f"; evidence misses {missing}" * bool(missing))
            )
    kind = _aimed_kind(first, [k for k in exp.secondary if k != cause])
    if kind is not None:
        missing = _names(first, exp, kind, False, script)
        primary = next((f for f in fixes if f["id"] in aimed), None)
        cheaper = primary is not None and COST_ORDER[first["cost"]] < COST_ORDER[primary["cost"]]
        if missing:
            return Score("first fix", WRONG, text + f"; aims at the secondary {kind}, evidence misses {missing}")
        if not aimed or cheaper:
            return Score("first fix", RIGHT, text + f" (first aims at the injected {kind})")
        return Score("first fix", WRONG, text + f"; first aims at the secondary {kind}")
    if gain is not None and gain < NEUTRAL_GAIN:
        return Score("first fix", WRONG if aimed else RIGHT, text + f" (first bounded at {gain:.0%})")
    return Score("first fix", WRONG, text + f"; {first['id']} aims at nothing injected")


def _invariants_of(row: dict[str, Any], who: str) -> list[str]:
    """Shares ≤ 100%, phase time per measured step ≤ the step mean, top-level phases adding up to it (1%)."""
    phases = row.get("phases") or {}
    total = phases.get("total")
    if not total:
        return [f"{who}: no total"]
    step, measured = total["mean_ms"], max(total.get("steps") or 1, 1)
    broken = []
    for name, p in phases.items():
        if p["share"] > 1.005:
            broken.append(f"{who}: {name} share {p['share']:.3f} > 1")
        per_step = p["mean_ms"] * p["steps"] / measured
        if name != "total" and per_step > step * 1.005 + 0.01:
            broken.append(f"{who}: {name} {per_step:.2f} ms a step > step {step:.2f}")
    top = sum(p["mean_ms"] * p["steps"] for n, p in phases.items() if n != "total" and not p["nested"]) / measured
    if abs(top - step) > 0.01 * step + 0.01:
        broken.append(f"{who}: top-level phases add up to {top:.2f} ms, step {step:.2f}")
    return broken


def _wall_per_step_ms(row: dict[str, Any]) -> float | None:
    """A rank's measured wall window per measured step (ms), None without a window."""
    wall, measured = row.get("wall"), (row.get("steps") or {}).get("measured")
    return wall["window_s"] * 1e3 / measured if wall and wall.get("window_s") and measured else None


def score_invariants(summary: dict[str, Any]) -> Score:
    """Score 5: the invariants above on the summary and each rank, synchronous ranks' wall time per step equal
    (10%), no more validation passes than steps, and nothing in the product's own ``invariants``."""
    broken = _invariants_of(summary, "job")
    rows = _rank_rows(summary)
    for rank, row in sorted(rows.items()):
        broken += _invariants_of(row, f"rank {rank}")
    # Issue 24's invariant: the ranks of a synchronous job have equal wall time per step. Their step means may
    # differ by what each spends in validation passes (a rank that validates faster waits for the other in its next
    # step's collective), so they are compared only where a summary has no wall window.
    walls = [_wall_per_step_ms(row) for row in rows.values()]
    if walls and None not in walls:
        if len(walls) > 1 and max(walls) > 1.10 * min(walls):  # type: ignore[type-var, operator]
            broken.append(f"rank wall times per step differ: {[round(w, 2) for w in walls]}")  # type: ignore[arg-type]
    else:
        steps = [row["phases"]["total"]["mean_ms"] for row in rows.values() if row.get("phases", {}).get("total")]
        if len(steps) > 1 and max(steps) > 1.10 * min(steps):
            broken.append(f"rank step means differ: {[round(s, 2) for s in steps]}")
    passes = int((summary.get("eval") or {}).get("passes") or 0)
    if passes > (summary.get("steps") or {}).get("measured", 0):
        broken.append(f"{passes} validation passes > measured steps")
    broken += [f"product: {s}" for s in summary.get("invariants") or []]
    return Score("invariants", WRONG if broken else RIGHT, "; ".join(broken) or "all hold")


def score_case(summary: dict[str, Any], exp: Expectation, script: str) -> list[Score]:
    """The five scores of a case."""
    return [
        score_rate(summary, exp),
        score_phases(summary, exp),
        score_bound(summary, exp),
        score_fix(summary, exp, script),
        score_invariants(summary),
    ]


def failed_run(reason: str) -> list[Score]:
    """Every score wrong: the run left no summary to score."""
    return [Score(name, WRONG, reason) for name in SCORES]


def expectation_dict(exp: Expectation) -> dict[str, Any]:
    return asdict(exp)
