"""Step records, the recorder, and bounded streaming statistics.

A ``StepRecord`` is one training step as the host saw it (wall seconds per phase) plus, later, as the device saw
it. The ``Recorder`` skips warm-up, keeps a short window of recent steps for live metrics, and folds every
measured step into per-phase ``StreamingStats`` whose memory does not grow with run length.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from stepscope.summary import PhaseStats, RunSummary, Steps, Throughput

PHASES = ("data_wait", "h2d", "forward", "backward", "clip", "optimizer", "zero_grad", "sync", "other")
"""Canonical phase names in step order; ``total`` is the whole step."""

DATA_PHASE = "data_wait"
OTHER_PHASE = "other"
TOTAL = "total"


class StreamingStats:
    """Count, sum, min and max exactly; quantiles exact for the first ``exact_limit`` values, then approximate.

    Past ``exact_limit`` values the samples move into a logarithmic histogram (the DDSketch construction): bucket
    ``i`` holds values in ``(g**(i-1), g**i]`` with ``g = (1+a)/(1-a)``, and a quantile is reported as the bucket's
    centre ``2*g**i/(g+1)``. Every reported quantile is then within relative error ``a`` (``rel_err``, default 1%)
    of a true sample of the same rank, and memory is bounded by the number of buckets spanning the value range
    (about 1,600 buckets for 1 ns .. 1 day at 1%), whatever the number of samples.
    """

    def __init__(self, exact_limit: int = 10_000, rel_err: float = 0.01) -> None:
        if exact_limit < 1:
            raise ValueError(f"exact_limit must be at least 1, got {exact_limit}")
        if not 0 < rel_err < 1:
            raise ValueError(f"rel_err must be between 0 and 1, got {rel_err}")
        self.exact_limit = exact_limit
        self.rel_err = rel_err
        self._gamma = (1 + rel_err) / (1 - rel_err)
        self._log_gamma = math.log(self._gamma)
        self._exact: list[float] | None = []
        self._buckets: dict[int, int] = {}
        self._zeros = 0
        self.count = 0
        self.total = 0.0
        self.min = math.inf
        self.max = -math.inf

    @property
    def exact(self) -> bool:
        """True while quantiles are computed from every stored sample."""
        return self._exact is not None

    @property
    def stored_values(self) -> int:
        """Samples or buckets held in memory (the memory bound the class promises)."""
        return len(self._exact) if self._exact is not None else len(self._buckets) + 1

    def add(self, value: float) -> None:
        value = max(value, 0.0)
        self.count += 1
        self.total += value
        self.min = min(self.min, value)
        self.max = max(self.max, value)
        if self._exact is not None:
            self._exact.append(value)
            if len(self._exact) > self.exact_limit:
                for v in self._exact:
                    self._bucket(v)
                self._exact = None
        else:
            self._bucket(value)

    def _bucket(self, value: float) -> None:
        if value <= 0.0:
            self._zeros += 1
            return
        index = math.ceil(math.log(value) / self._log_gamma)
        self._buckets[index] = self._buckets.get(index, 0) + 1

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan

    def quantile(self, q: float) -> float:
        """The q-quantile (0 <= q <= 1); exact values use linear interpolation (numpy's default)."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be between 0 and 1, got {q}")
        if self.count == 0:
            return math.nan
        if self._exact is not None:
            return float(np.quantile(self._exact, q))
        rank = q * (self.count - 1)
        seen = self._zeros
        if rank < seen:
            return 0.0
        for index in sorted(self._buckets):
            seen += self._buckets[index]
            if rank < seen:
                estimate = 2 * self._gamma**index / (self._gamma + 1)
                return min(max(estimate, self.min), self.max)
        return self.max


@dataclass
class StepRecord:
    """One step: host wall seconds for the step and per phase, samples, and device seconds once harvested."""

    index: int
    step_s: float
    phases_s: dict[str, float]
    samples: int | None = None
    device_s: dict[str, float] | None = None


@dataclass
class PhaseTrack:
    """Statistics of one phase over the measured steps in which it ran."""

    host: StreamingStats
    device: StreamingStats
    nested: bool = False


@dataclass
class Recorder:
    """Skips warm-up, folds measured steps into streaming statistics, keeps a window for live metrics."""

    warmup: int = 20
    window: int = 20
    exact_limit: int = 10_000
    steps_seen: int = 0
    step_stats: StreamingStats = field(init=False)
    phases: dict[str, PhaseTrack] = field(default_factory=dict)
    samples: int = 0
    sampled_step_s: float = 0.0
    recent: deque[StepRecord] = field(init=False)

    def __post_init__(self) -> None:
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0 steps, got {self.warmup}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1 step, got {self.window}")
        self.step_stats = StreamingStats(self.exact_limit)
        self.recent = deque(maxlen=self.window)

    @property
    def measuring(self) -> bool:
        """True once warm-up is over: the next step closed will be measured."""
        return self.steps_seen >= self.warmup

    @property
    def measured(self) -> int:
        return self.step_stats.count

    def _track(self, phase: str) -> PhaseTrack:
        track = self.phases.get(phase)
        if track is None:
            track = self.phases[phase] = PhaseTrack(StreamingStats(self.exact_limit), StreamingStats(self.exact_limit))
        return track

    def add(self, record: StepRecord, nested: frozenset[str] | set[str] = frozenset()) -> bool:
        """Fold one closed step in; returns False (and keeps nothing) for a warm-up step."""
        measured = self.measuring
        self.steps_seen += 1
        if not measured:
            return False
        self.step_stats.add(record.step_s)
        for phase, seconds in record.phases_s.items():
            track = self._track(phase)
            track.host.add(seconds)
            if phase in nested:
                track.nested = True
        if record.samples is not None:
            self.samples += record.samples
            self.sampled_step_s += record.step_s
        self.recent.append(record)
        return True

    def add_device(self, record: StepRecord, device_s: dict[str, float]) -> None:
        """Attach a step's device seconds once its events completed (possibly several steps later)."""
        record.device_s = device_s
        for phase, seconds in device_s.items():
            self._track(phase).device.add(seconds)


def _ms(seconds: float) -> float:
    return seconds * 1e3


def _phase_order(names: list[str]) -> list[str]:
    canonical = [p for p in PHASES if p in names and p != OTHER_PHASE]
    custom = [p for p in names if p not in PHASES and p != TOTAL]
    return [*canonical, *custom, *([OTHER_PHASE] if OTHER_PHASE in names else [])]


def summarize(recorder: Recorder, timing: str) -> RunSummary:
    """The statistics part of a RunSummary: steps, per-phase statistics, throughput (meta left default)."""
    summary = RunSummary(steps=Steps(warmup=min(recorder.warmup, recorder.steps_seen), measured=recorder.measured))
    step = recorder.step_stats
    if step.count == 0:
        summary.notes.append(
            f"no measured steps: warm-up was {recorder.warmup} steps and {recorder.steps_seen} step(s) ran; "
            "run more steps or lower the warm-up."
        )
        return summary
    total_s = step.total
    for name in _phase_order(list(recorder.phases)):
        track = recorder.phases[name]
        stats = PhaseStats(
            mean_ms=_ms(track.host.mean),
            median_ms=_ms(track.host.quantile(0.5)),
            p95_ms=_ms(track.host.quantile(0.95)),
            share=track.host.total / total_s if total_s > 0 else 0.0,
            steps=track.host.count,
            nested=track.nested,
        )
        if timing == "cuda" and track.device.count:
            stats.device_mean_ms = _ms(track.device.mean)
            stats.device_median_ms = _ms(track.device.quantile(0.5))
            stats.device_p95_ms = _ms(track.device.quantile(0.95))
            # Device time of the steps harvested so far, scaled to all measured steps.
            stats.device_share = (track.device.mean * track.host.count) / total_s if total_s > 0 else 0.0
        summary.phases[name] = stats
    summary.phases[TOTAL] = PhaseStats(
        mean_ms=_ms(step.mean),
        median_ms=_ms(step.quantile(0.5)),
        p95_ms=_ms(step.quantile(0.95)),
        share=1.0,
        steps=step.count,
    )
    summary.throughput = Throughput(
        steps_per_s=step.count / total_s if total_s > 0 else None,
        samples_per_s=recorder.samples / recorder.sampled_step_s if recorder.sampled_step_s > 0 else None,
        step_time_ms=_ms(step.mean),
    )
    return summary
