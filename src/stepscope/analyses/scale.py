"""Scaling analysis: how throughput, step phases and energy change with the number of ranks.

Pure functions over RunSummary (no I/O): runs are grouped into configurations, one per (label, world size);
several runs of a configuration are repeats, summarised by their median and range. Within a label, speedup and
parallel efficiency are measured against the smallest world size, and the phase that grows most per rank from the
smallest to the largest world size is named with its figures. A set of runs that cannot be compared raises
``ScaleError`` with the reason; a run that cannot be used on its own is skipped with a sentence (``Skipped``).
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from dataclasses import dataclass, field
from typing import Any

from stepscope.record import TOTAL, phase_order
from stepscope.summary import RunSummary

# Samples per step per rank (or globally) within this relative distance count as the same batch: a partial last
# batch or a step without a known batch size moves the measured ratio a little.
BATCH_TOLERANCE = 0.05
# A phase "grows" when its per-rank time rises by at least this share of the step at the largest world size
# (and by GROWTH_MIN_MS): smaller changes are within run-to-run noise.
GROWTH_MIN_SHARE = 0.05
GROWTH_MIN_MS = 0.1
# Repeats whose samples/s range exceeds this fraction of their median are called noisy.
NOISY_RANGE = 0.10
# Why a phase grows with the number of ranks, where the mechanism is known: said after the figures.
GROWTH_CAUSES = {
    "sync": "time in collectives outside backward (all-reduce, barriers), waiting for the slowest rank included",
    "backward": "DDP and FSDP overlap the gradient all-reduce (reduce-scatter) with backward, so waiting for it "
    "shows up there",
    "data_wait": "the input pipeline falls behind: more ranks share the machine's CPU cores and storage",
    "forward": "FSDP gathers sharded parameters in forward, and tensor parallelism communicates there",
    "optimizer": "sharded optimizers (ZeRO, FSDP) gather or scatter state around the step",
}
# `--by folder` names each run by the folder its summary file is in.
FOLDER = "folder"


class ScaleError(ValueError):
    """The runs cannot make a scaling report; the message says why. ``skipped`` lists the runs left out first."""

    def __init__(self, message: str, skipped: list[Skipped] | None = None) -> None:
        super().__init__(message)
        self.skipped = list(skipped or [])


@dataclass
class Skipped:
    """A run left out of the report and why."""

    source: str
    reason: str  # one sentence that names the source


@dataclass
class ScaleRun:
    """One run to compare: where it came from (a file name, for messages), its label, its summary."""

    source: str
    summary: RunSummary
    label: str | None = None


@dataclass
class Spread:
    """A figure over the repeats of one configuration: median, lowest and highest."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values))


@dataclass
class ScaleConfig:
    """One (label, world size): its repeats' figures. Times are per rank and per step unless named otherwise."""

    world_size: int
    sources: list[str]  # the repeats
    samples_per_s: Spread  # cluster total
    speedup: float  # median samples/s over the baseline's (the label's smallest world size)
    efficiency: float  # speedup / (world size / baseline world size), 0..1 (above 1: super-linear)
    batch_per_rank: float  # samples per step per rank (median over repeats)
    step_ms: float  # per-rank mean step time, median over repeats
    epoch_s: float | None  # median time of a complete epoch of the training loader, when recorded
    energy_per_sample_j: float | None  # GPU energy of all ranks / samples, when every rank's energy was collected
    phases_ms: dict[str, float] = field(default_factory=dict)  # top-level phase -> per-rank ms per step


@dataclass
class PhaseGrowth:
    """The phase whose per-rank time per step grows most from the smallest to the largest world size."""

    phase: str
    from_ms: float
    to_ms: float
    from_world: int
    to_world: int
    share: float  # of the step at to_world, 0..1


@dataclass
class ScaleGroup:
    """All configurations of one label (or of every run, without ``--by``), smallest world size first."""

    label: str | None
    scaling: str  # "weak" (per-rank batch fixed) or "strong" (global batch fixed)
    configs: list[ScaleConfig]
    growth: PhaseGrowth | None
    findings: list[str]  # sentences with figures: efficiency, the growing phase, energy, noisy repeats


@dataclass
class ScaleReport:
    """The scaling table: one group per label; runs skipped and labels left out, each with a sentence."""

    by: str | None
    groups: list[ScaleGroup]
    skipped: list[Skipped] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready form (what ``stepscope scale --json`` writes)."""
        return dataclasses.asdict(self)


@dataclass
class _Figures:
    """What one run contributes to its configuration."""

    source: str
    world_size: int
    samples_per_s: float
    batch_per_rank: float
    device: str
    step_ms: float
    epoch_s: float | None
    energy_per_sample_j: float | None
    phases_ms: dict[str, float]


def ranks_word(n: int) -> str:
    """'1 rank', '8 ranks'."""
    return f"{n} rank" if n == 1 else f"{n} ranks"


def label_for(by: str, command: str, path: str) -> str | None:
    """The value of label ``by`` for a run, or None when the run does not say.

    ``folder`` is the name of the folder that holds the summary file. Any other key is looked up first in the
    run's command line (``--KEY VALUE``, ``--KEY=VALUE`` or ``KEY=VALUE``; ``-`` and ``_`` in the key are the same),
    then in the file's path (a folder or file name ``KEY=VALUE``, as in ``runs/strategy=fsdp/ws8.json``).
    """
    parts = [p for p in re.split(r"[\\/]", path) if p]
    if by == FOLDER:
        return parts[-2] if len(parts) >= 2 else None
    key = by.lstrip("-").replace("_", "-")
    words = command.split()
    for i, word in enumerate(words):
        name, eq, value = word.lstrip("-").partition("=")
        if name.replace("_", "-") != key:
            continue
        if eq and value:
            return value
        if word.startswith("-") and not eq and i + 1 < len(words) and not words[i + 1].startswith("-"):
            return words[i + 1]
    for part in reversed(parts):
        name, eq, value = part.removesuffix(".json").partition("=")
        if eq and value and name.replace("_", "-") == key:
            return value
    return None


def run_problem(summary: RunSummary) -> str | None:
    """Why a run cannot be used in a scaling report (a sentence without a subject), or None when it can."""
    world = summary.world_size
    if world > 1 and not summary.ranks:
        rank = "?" if summary.meta.rank is None else summary.meta.rank
        return (
            f"is one rank's summary (rank {rank} of {world}); give the merged summary that "
            "`stepscope run --json` writes for the whole run"
        )
    if summary.cluster is not None and len(summary.cluster.ranks_reported) < world:
        return (
            f"has figures from {len(summary.cluster.ranks_reported)} of its {world} ranks (the others wrote no "
            "summary), so its samples/s would undercount the cluster"
        )
    if summary.steps.measured == 0 or TOTAL not in summary.phases:
        return "has no measured steps"
    if not summary.throughput.samples_per_s or summary.batch_per_rank is None:
        return (
            "has no samples/s (no batch size was known: `stepscope run --batch-size N` gives it when the script "
            "has no DataLoader)"
        )
    return None


def _parts(summary: RunSummary) -> list[RunSummary]:
    """The per-rank summaries of a run (the run itself for a single process)."""
    return summary.ranks or [summary]


def _phases_ms(summary: RunSummary) -> dict[str, float]:
    """Per-rank time of each top-level phase per measured step (share × mean step: steps where the phase did not
    run count as 0), averaged over the ranks. Nested phases are inside another phase's time and are left out."""
    parts = _parts(summary)
    names: list[str] = []
    for r in parts:
        names += [n for n, p in r.phases.items() if n not in names and n != TOTAL and not p.nested]
    totals = [r.phases[TOTAL].mean_ms if TOTAL in r.phases else 0.0 for r in parts]
    return {
        name: statistics.fmean(
            r.phases[name].share * total if name in r.phases else 0.0 for r, total in zip(parts, totals, strict=True)
        )
        for name in names
    }


def _epoch_s(summary: RunSummary) -> float | None:
    """Median time of the complete epochs of the loader that delivered the most samples (the training loader)."""
    epochs = summary.epochs
    if summary.loaders:
        train = max(summary.loaders, key=lambda loader: loader.samples).index
        epochs = [e for e in epochs if e.loader == train]
    times = [e.time_s for e in epochs if e.complete]
    return statistics.median(times) if times else None


def _energy_per_sample_j(summary: RunSummary) -> float | None:
    """All ranks' GPU energy over all their samples, when every rank's energy per sample was collected."""
    total_j = samples = 0.0
    for r in _parts(summary):
        energy = r.system.get("energy") or {}
        joules, per_sample = energy.get("total_j"), energy.get("per_sample_j")
        if not joules or not per_sample:
            return None
        total_j += joules
        samples += joules / per_sample
    return total_j / samples


def _device_kind(summary: RunSummary) -> str:
    """'cpu', or the GPU model without its index ('cuda (NVIDIA H100 80GB HBM3)'): ranks run on different indices."""
    return re.sub(r"^cuda:\d+", "cuda", summary.meta.device)


def _figures(run: ScaleRun) -> _Figures:
    summary = run.summary
    batch = summary.batch_per_rank
    assert batch is not None and summary.throughput.samples_per_s  # run_problem ruled both out
    return _Figures(
        source=run.source,
        world_size=summary.world_size,
        samples_per_s=summary.throughput.samples_per_s,
        batch_per_rank=batch,
        device=_device_kind(summary),
        step_ms=statistics.fmean(r.phases[TOTAL].mean_ms for r in _parts(summary) if TOTAL in r.phases),
        epoch_s=_epoch_s(summary),
        energy_per_sample_j=_energy_per_sample_j(summary),
        phases_ms=_phases_ms(summary),
    )


def _median_or_none(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _config(world: int, runs: list[_Figures], baseline: ScaleConfig | None, phases: list[str]) -> ScaleConfig:
    """One configuration's repeats; ``baseline`` is the label's smallest world size (None: this is it). Every
    configuration of a label lists the same ``phases``: 0 ms where a phase did not run (no sync on one rank)."""
    rate = Spread.of([r.samples_per_s for r in runs])
    base_world, base_rate = (
        (world, rate.median) if baseline is None else (baseline.world_size, baseline.samples_per_s.median)
    )
    speedup = rate.median / base_rate
    return ScaleConfig(
        world_size=world,
        sources=[r.source for r in runs],
        samples_per_s=rate,
        speedup=speedup,
        efficiency=speedup * base_world / world,
        batch_per_rank=statistics.median(r.batch_per_rank for r in runs),
        step_ms=statistics.median(r.step_ms for r in runs),
        epoch_s=_median_or_none([r.epoch_s for r in runs]),
        energy_per_sample_j=_median_or_none([r.energy_per_sample_j for r in runs]),
        phases_ms={n: statistics.median(r.phases_ms.get(n, 0.0) for r in runs) for n in phases},
    )


def _close(values: list[float]) -> bool:
    middle = statistics.median(values)
    return all(abs(v - middle) <= BATCH_TOLERANCE * middle for v in values)


def _scaling(label: str, runs: list[_Figures]) -> str:
    """'weak' when every run has the same per-rank batch, 'strong' when the same global batch; else ScaleError."""
    if _close([r.batch_per_rank for r in runs]):
        return "weak"
    if _close([r.batch_per_rank * r.world_size for r in runs]):
        return "strong"
    seen = sorted({(r.world_size, round(r.batch_per_rank, 1)) for r in runs})
    listed = ", ".join(f"{batch:g} at {ranks_word(world)}" for world, batch in seen)
    raise ScaleError(
        f"{label} are not comparable: their samples per step per rank are {listed}, so neither the per-rank batch "
        "(weak scaling) nor the global batch (strong scaling) is the same; compare runs of one batch setting, or "
        "tell the settings apart with --by"
    )


def growing_phase(configs: list[ScaleConfig]) -> PhaseGrowth | None:
    """The phase whose per-rank ms per step grows most from the first (smallest) to the last configuration, when
    it grows by at least GROWTH_MIN_SHARE of the last configuration's step and GROWTH_MIN_MS; else None."""
    first, last = configs[0], configs[-1]
    names = list(first.phases_ms) + [n for n in last.phases_ms if n not in first.phases_ms]
    if not names:
        return None
    growth = {n: last.phases_ms.get(n, 0.0) - first.phases_ms.get(n, 0.0) for n in names}
    phase = max(names, key=lambda n: growth[n])
    if growth[phase] < max(GROWTH_MIN_SHARE * last.step_ms, GROWTH_MIN_MS):
        return None
    to_ms = last.phases_ms.get(phase, 0.0)
    return PhaseGrowth(
        phase=phase,
        from_ms=first.phases_ms.get(phase, 0.0),
        to_ms=to_ms,
        from_world=first.world_size,
        to_world=last.world_size,
        share=to_ms / last.step_ms if last.step_ms else 0.0,
    )


def _growth_sentence(growth: PhaseGrowth | None, configs: list[ScaleConfig]) -> str:
    first, last = configs[0], configs[-1]
    if growth is None:
        return (
            f"no phase grows by more than {100 * GROWTH_MIN_SHARE:.0f}% of the step from {ranks_word(first.world_size)}"
            f" to {ranks_word(last.world_size)} (step {first.step_ms:.1f} ms → {last.step_ms:.1f} ms per rank)."
        )
    cause = GROWTH_CAUSES.get(growth.phase)
    return (
        f"{growth.phase} grows from {growth.from_ms:.1f} ms at {ranks_word(growth.from_world)} to "
        f"{growth.to_ms:.1f} ms at {ranks_word(growth.to_world)}: {100 * growth.share:.0f}% of the step "
        f"({first.step_ms:.1f} ms → {last.step_ms:.1f} ms per rank)" + (f"; {cause}." if cause else ".")
    )


def _findings(configs: list[ScaleConfig], growth: PhaseGrowth | None) -> list[str]:
    """Sentences with figures: efficiency at the largest world size, the growing phase, energy, noisy repeats."""
    first, last = configs[0], configs[-1]
    lines = [
        f"{ranks_word(last.world_size)} give {last.speedup:.2f}× the samples/s of {ranks_word(first.world_size)} "
        f"({last.samples_per_s.median:,.1f} vs {first.samples_per_s.median:,.1f}): "
        f"{100 * last.efficiency:.0f}% parallel efficiency.",
        _growth_sentence(growth, configs),
    ]
    if first.energy_per_sample_j and last.energy_per_sample_j:
        change = last.energy_per_sample_j / first.energy_per_sample_j - 1
        lines.append(
            f"energy per sample goes from {first.energy_per_sample_j:.4g} J at {ranks_word(first.world_size)} to "
            f"{last.energy_per_sample_j:.4g} J at {ranks_word(last.world_size)} ({100 * change:+.0f}%)."
        )
    for config in configs:
        rate = config.samples_per_s
        if rate.median and (rate.high - rate.low) > NOISY_RANGE * rate.median:
            lines.append(
                f"repeats at {ranks_word(config.world_size)} vary: {rate.low:,.1f}–{rate.high:,.1f} samples/s "
                f"({100 * (rate.high - rate.low) / rate.median:.0f}% of the median); more repeats would firm up "
                "the figures."
            )
    return lines


def _group(label: str | None, runs: list[_Figures]) -> ScaleGroup:
    """The configurations of one label (at least two world sizes), checked for comparability."""
    name = "the runs" if label is None else f"the runs labelled {label!r}"
    devices = sorted({r.device for r in runs})
    if len(devices) > 1:
        raise ScaleError(f"{name} ran on different devices ({', '.join(devices)}); compare one kind at a time")
    scaling = _scaling(name, runs)
    by_world: dict[int, list[_Figures]] = {}
    for r in runs:
        by_world.setdefault(r.world_size, []).append(r)
    phases = phase_order(list(dict.fromkeys(n for r in runs for n in r.phases_ms)))
    worlds = sorted(by_world)
    base = _config(worlds[0], by_world[worlds[0]], None, phases)
    configs = [base, *(_config(w, by_world[w], base, phases) for w in worlds[1:])]
    growth = growing_phase(configs)
    return ScaleGroup(label=label, scaling=scaling, configs=configs, growth=growth, findings=_findings(configs, growth))


def analyze_scale(runs: list[ScaleRun], by: str | None = None, skipped: list[Skipped] | None = None) -> ScaleReport:
    """Group ``runs`` by (label, world size) and compare each label's world sizes.

    Runs that cannot be used (``run_problem``) are added to ``skipped`` (the files a reader already left out);
    labels with a single world size are left out with a note. Raises ScaleError when no label has two world sizes
    left to compare, or when a label's runs are not comparable (different batches, different devices).
    """
    skipped = list(skipped or [])
    if not runs and not skipped:
        raise ScaleError("no summaries were given")
    usable: dict[str | None, list[_Figures]] = {}
    for run in runs:
        problem = run_problem(run.summary)
        if problem:
            skipped.append(Skipped(run.source, f"{run.source} {problem}."))
        else:
            usable.setdefault(run.label, []).append(_figures(run))
    if not usable:
        raise ScaleError(f"none of the {len(skipped)} summaries can be used", skipped)
    groups, alone = [], []
    for label, group_runs in usable.items():
        worlds = sorted({r.world_size for r in group_runs})
        if len(worlds) < 2:
            alone.append((label, worlds[0], len(group_runs)))
            continue
        try:
            groups.append(_group(label, group_runs))
        except ScaleError as error:
            raise ScaleError(str(error), skipped) from None
    if not groups:
        if by is None:
            _, world, count = alone[0]
            reason = f"every usable run ({count}) has world size {world}"
        else:
            reason = "no label has two (" + "; ".join(f"{label!r}: {world} only" for label, world, _ in alone) + ")"
        raise ScaleError(f"a scaling report needs runs of at least two world sizes to compare, and {reason}", skipped)
    notes = [
        f"label {label!r} is left out: its {count} run(s) all have world size {world}, nothing to compare."
        for label, world, count in alone
    ]
    return ScaleReport(by=by, groups=groups, skipped=skipped, notes=notes)
