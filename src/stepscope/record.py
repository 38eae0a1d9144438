"""Step records, the recorder, and bounded streaming statistics.

A ``StepRecord`` is one training step as the host saw it (wall seconds per phase) plus, later, as the device saw
it. The ``Recorder`` skips warm-up, keeps a short window of recent steps for live metrics, and folds every
measured step into per-phase ``StreamingStats`` whose memory does not grow with run length.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any

import numpy as np

from stepscope.summary import PhaseStats, RunSummary, Steps, StepSeries, Throughput

PHASES = ("data_wait", "h2d", "forward", "backward", "comms", "clip", "optimizer", "zero_grad", "sync", "other")
"""Canonical phase names in step order; ``total`` is the whole step."""

GROUPS: dict[str, tuple[str, ...]] = {
    "data": ("data_wait", "h2d"),
    "compute": ("forward", "backward"),
    "comms": ("comms",),  # waiting in collectives: DDP's gradient all-reduce, explicit torch.distributed calls
    "optimizer": ("optimizer", "zero_grad", "clip"),
    "host": ("sync", "other"),
}
"""The canonical phases by what they spend time on (the verdict's groups)."""

DATA_PHASE = "data_wait"
EVAL_PHASE = "eval"  # validation between training steps: timed, but kept out of the training step's statistics
NO_STEP_MARK = "no step was closed"
OTHER_PHASE = "other"
# stepscope's own time outside every phase: its hooks' work before a phase begins and after one ends, and closing
# the step (its records and counters), which the next step holds. Without it, that time read as the script's in
# ``other``
OWN_PHASE = "stepscope"
TOTAL = "total"


def _not_streamed(*args: Any) -> None:
    """Where kept steps and passes go when the process keeps no step stream (see stream.py)."""
    return None


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
        # the histogram's counts, dense from bucket index ``_lowest`` (a run's values span a few hundred buckets)
        self._counts = np.zeros(0, dtype=np.int64)
        self._lowest = 0
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
        return len(self._exact) if self._exact is not None else self._counts.size + 1

    def add(self, value: float) -> None:
        """Add one sample."""
        self.extend(np.array([value], dtype=np.float64))

    def extend(self, values: np.ndarray) -> None:
        """Add many samples at once (vectorised: how the recorder folds steps in, off the hot path). A negative
        sample counts as 0."""
        values = np.asarray(values, dtype=np.float64)
        if values.size == 0:
            return
        low, high = float(values.min()), float(values.max())
        if low < 0.0:
            values = np.maximum(values, 0.0)
            low, high = 0.0, max(high, 0.0)
        self.count += int(values.size)
        self.total += float(values.sum())
        self.min = min(self.min, low)
        self.max = max(self.max, high)
        if self._exact is not None:
            self._exact.extend(values.tolist())
            if len(self._exact) > self.exact_limit:
                self._bucket(np.array(self._exact), self.min, self.max)
                self._exact = None
        else:
            self._bucket(values, low, high)

    def _bucket(self, values: np.ndarray, low: float, high: float) -> None:
        """Count ``values`` (>= 0, from ``low`` to ``high``) into the histogram."""
        if low <= 0.0:
            positive = values[values > 0.0]
            self._zeros += int(values.size - positive.size)
            if positive.size == 0:
                return
            values, low = positive, float(positive.min())
        log_gamma = self._log_gamma
        indices = np.ceil(np.log(values) / log_gamma).astype(np.int64)
        # The buckets from low to high, a bucket wider each way: numpy's log may round apart from math's.
        first, last = math.ceil(math.log(low) / log_gamma) - 1, math.ceil(math.log(high) / log_gamma) + 1
        counts, lowest = self._counts, self._lowest
        if counts.size == 0:
            counts, lowest = np.zeros(last - first + 1, dtype=np.int64), first
        elif first < lowest or last >= lowest + counts.size:
            start = min(first, lowest)
            grown = np.zeros(max(last, lowest + counts.size - 1) - start + 1, dtype=np.int64)
            grown[lowest - start : lowest - start + counts.size] = counts
            counts, lowest = grown, start
        # A count per bucket, no sort (np.unique's): the counts are dense
        counts += np.bincount(indices - lowest, minlength=counts.size)
        self._counts, self._lowest = counts, lowest

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
        # the first bucket whose cumulative count passes the rank
        position = int(np.searchsorted(np.cumsum(self._counts) + seen, rank, side="right"))
        if position == self._counts.size:
            return self.max
        estimate = 2 * self._gamma ** (self._lowest + position) / (self._gamma + 1)
        return min(max(estimate, self.min), self.max)


class SeriesBuilder:
    """Step times of the whole run in bounded memory: every step is kept until ``2 * points`` are held, then
    neighbours are merged in pairs (the stride doubles), so the series always spans the run with ``points`` to
    ``2 * points`` values, each the mean of ``stride`` consecutive steps."""

    def __init__(self, points: int = 512) -> None:
        if points < 1:
            raise ValueError(f"points must be at least 1, got {points}")
        self.points = points
        self.stride = 1
        self._sums_ns: list[int] = []
        self._pending_ns = 0
        self._pending = 0
        self.count = 0  # steps added

    def add(self, step_ns: int) -> None:
        """Add one step's wall time (ns)."""
        self._pending_ns += step_ns
        self._pending += 1
        self.count += 1
        if self._pending == self.stride:
            self._sums_ns.append(self._pending_ns)
            self._pending_ns = 0
            self._pending = 0
            if len(self._sums_ns) == 2 * self.points:
                sums = self._sums_ns
                self._sums_ns = [sums[i] + sums[i + 1] for i in range(0, len(sums), 2)]
                self.stride *= 2

    def add_late(self, at: int, extra_ns: int) -> None:
        """Add ``extra_ns`` to the step added ``at``-th (from 0), known only after it was added: the GPU's time for
        it beyond the host's, once its events completed."""
        point = at // self.stride
        if point < len(self._sums_ns):
            self._sums_ns[point] += extra_ns
        else:
            self._pending_ns += extra_ns

    def series(self) -> StepSeries | None:
        """The series so far (the last point may average fewer than ``stride`` steps); None before any step."""
        step_ms = [total / self.stride / 1e6 for total in self._sums_ns]
        if self._pending:
            step_ms.append(self._pending_ns / self._pending / 1e6)
        return StepSeries(stride=self.stride, step_ms=step_ms) if step_ms else None


MAX_PASS_STEPS = 4096  # passes whose step is kept (EvalPasses.steps)


@dataclass
class EvalPasses:
    """Validation passes between training steps, kept out of the step statistics and reported apart.

    A pass is one uninterrupted stretch of evaluation (``scope.phase("eval")``, or a run of forwards without
    gradients that ``stepscope run`` tells from training work). Its wall time is taken out of the step it fell in,
    so the step's phases and total describe training alone."""

    durations: StreamingStats = field(default_factory=StreamingStats)
    phases_ns: dict[str, int] = field(default_factory=dict)
    forwards: int = 0
    batches: int = 0
    on_add: Callable[[int, dict[str, int], int], None] = _not_streamed  # (wall ns, phases ns, batches)
    # the place in the step series of the step each pass fell in (the first MAX_PASS_STEPS passes): where another
    # rank of the job waited for it (instrument/merge.py)
    steps: list[int] = field(default_factory=list)

    def add(
        self, duration_ns: int, phases_ns: dict[str, int], forwards: int = 0, batches: int = 0, step_at: int = -1
    ) -> None:
        """One pass: its wall time (ns), the time of the phases inside it (ns), its forwards and batches, and the
        place in the step series of the step it fell in (-1: not known)."""
        self.on_add(duration_ns, phases_ns, batches)
        if step_at >= 0 and len(self.steps) < MAX_PASS_STEPS:
            self.steps.append(step_at)
        self.durations.add(duration_ns / 1e9)
        for name, ns in phases_ns.items():
            self.phases_ns[name] = self.phases_ns.get(name, 0) + ns
        self.forwards += forwards
        self.batches += batches

    def to_dict(self, wall_s: float) -> dict[str, Any]:
        """``RunSummary.eval``: passes, their time (s, and ms per pass), their share of the ``wall_s`` seconds of
        the measured window (at least the passes' own time), and the phases inside a pass (ms per pass); {}
        without a pass."""
        passes = self.durations.count
        if not passes:
            return {}
        eval_s = self.durations.total
        inside_ms = {name: ns / 1e6 / passes for name, ns in self.phases_ns.items() if ns > 0}
        inside_ms[OTHER_PHASE] = max(0.0, eval_s * 1e3 / passes - sum(inside_ms.values()))
        return {
            "passes": passes,
            "time_s": eval_s,
            "share_of_wall": eval_s / max(wall_s, eval_s) if eval_s > 0 else 0.0,
            "mean_ms": _ms(self.durations.mean),
            "median_ms": _ms(self.durations.quantile(0.5)),
            "max_ms": _ms(self.durations.max),
            "phases_ms": {name: inside_ms[name] for name in phase_order(list(inside_ms))},
            "forwards_per_pass": self.forwards / passes,
            "batches_per_pass": self.batches / passes,
            "steps": list(self.steps),
        }


@dataclass(slots=True)
class StepRecord:
    """One step as the host saw it (wall ns for the step and per phase), plus device seconds once harvested."""

    index: int
    step_ns: int
    phases_ns: dict[str, int]
    samples: int | None = None
    device_s: dict[str, float] | None = None
    end_ns: int = 0  # when it closed, on the scope's clock (CLOCK_MONOTONIC ns with the default clock); 0: not known
    gpu_excess_ns: int = 0  # what the step added to how far the GPU's finish lies beyond the host's (add_device)
    series_at: int = -1  # its place in the step series; -1 until kept


@dataclass
class PhaseTrack:
    """Statistics of one phase over the measured steps in which it ran."""

    host: StreamingStats
    device: StreamingStats


@dataclass
class Recorder:
    """Skips warm-up, keeps a window of recent steps for live metrics, folds measured steps into statistics.

    ``add`` is on the training loop's hot path, so it only appends; steps are folded into the streaming
    statistics in vectorised batches of ``fold_every`` steps, or when results are read (``fold()``).
    """

    warmup: int = 20
    window: int = 20
    exact_limit: int = 10_000
    fold_every: int = 256
    steps_seen: int = 0
    profiled: int = 0  # steps recorded by torch.profiler, left out of the statistics
    step_stats: StreamingStats = field(init=False)
    phases: dict[str, PhaseTrack] = field(default_factory=dict)
    nested: set[str] = field(default_factory=set)
    samples: int = 0
    sampled_steps: int = 0  # measured steps that reported a batch size
    warmup_samples: int = 0  # the same over the warm-up steps: the batch size when no measured step fetched one
    warmup_sampled_steps: int = 0
    gpu_excess_ns: int = 0  # over the measured steps: the GPU's time beyond the host's (StepRecord.gpu_excess_ns)
    # device time (s) per phase over the probed steps whose lag was known (DeviceTimer), and of it where the GPU only
    # followed the host
    judged_device_s: dict[str, float] = field(default_factory=dict)
    followed_device_s: dict[str, float] = field(default_factory=dict)
    _queued_ns: int = 0  # the host's time in the steps with device time so far: when it finished queueing them
    _gpu_done_ns: int = 0  # when the GPU finished them, on the same time line
    recent: deque[StepRecord] = field(init=False)
    series: SeriesBuilder = field(default_factory=SeriesBuilder)  # every timed step, warm-up and profiled too
    _unfolded: list[StepRecord] = field(default_factory=list)
    _unfolded_device: list[dict[str, float]] = field(default_factory=list)
    _held: list[tuple[StepRecord, bool]] = field(default_factory=list)  # (record, measured) awaiting release
    on_keep: Callable[[StepRecord, bool], None] = _not_streamed  # each step as it is kept: (record, measured)
    on_paced: Callable[[StepRecord, int], None] = _not_streamed  # a step's GPU time beyond the host's, once known

    def __post_init__(self) -> None:
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0 steps, got {self.warmup}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1 step, got {self.window}")
        self.step_stats = StreamingStats(self.exact_limit)
        self.recent = deque(maxlen=self.window)

    @property
    def paced_s(self) -> float:
        """The folded measured steps' time at their pace (s): the host's, plus the GPU's beyond it where the host
        ran ahead (``gpu_excess_ns``)."""
        return self.step_stats.total + self.gpu_excess_ns / 1e9

    @property
    def measuring(self) -> bool:
        """True once warm-up is over: the next step closed will be measured."""
        return self.steps_seen >= self.warmup

    @property
    def measured(self) -> int:
        held = sum(measured for _, measured in self._held) if self._held else 0  # read on the hot path
        return self.step_stats.count + len(self._unfolded) + held

    @property
    def held(self) -> bool:
        """True while a closed step waits for ``release``."""
        return bool(self._held)

    def add(self, record: StepRecord, hold: bool = False) -> bool:
        """Take one closed step; returns False (and keeps nothing) for a warm-up step. ``hold``: count the step now
        but keep its figures out of every statistic until ``release`` (its record may still change: a stretch cut
        out of it as validation that turns out to recur every step goes back in)."""
        measured = self.steps_seen >= self.warmup
        self.steps_seen += 1
        if hold:
            self._held.append((record, measured))
        else:
            self._keep(record, measured)
        return measured

    def release(self) -> list[StepRecord]:
        """Keep the held steps, as they are now; returns those that were measured."""
        held, self._held = self._held, []
        for record, measured in held:
            self._keep(record, measured)
        return [record for record, measured in held if measured]

    def _keep(self, record: StepRecord, measured: bool) -> None:
        self.on_keep(record, measured)
        record.series_at = self.series.count
        self.series.add(record.step_ns + record.gpu_excess_ns)
        if measured:
            self.recent.append(record)
            self._unfolded.append(record)
            if len(self._unfolded) >= self.fold_every:
                self.fold()
        elif record.samples is not None:
            self.warmup_samples += record.samples
            self.warmup_sampled_steps += 1

    def add_device(
        self,
        record: StepRecord,
        device_s: dict[str, float],
        span_s: float = 0.0,
        judged_s: dict[str, float] | None = None,
        followed_s: dict[str, float] | None = None,
    ) -> None:
        """Attach a step's device seconds once its events completed (possibly several steps later), with the GPU's
        span for the step (s, from its first event to its last) and, for a probed step, the device seconds of the
        phases whose lag behind the host was known and of those in which the GPU only followed the host
        (``Harvested.judged_s``, ``followed_s``).

        Where the host queues work faster than the GPU runs it (a loop that never waits for the GPU), the GPU's
        pace is the step's. Steps arrive here in order; the host and the GPU are modelled as a producer and a
        consumer on the steps' time line: the GPU starts a step once the host began queueing it and the GPU
        finished the one before. ``gpu_excess_ns`` is how far the GPU's finish then lies beyond the host's: the
        window's time the host clock missed. Each step's share of it (its change, which can be negative as the GPU
        catches up, but never below minus the step's host time) goes to the step's time in the series. A step
        queued as fast as its GPU work runs (a full launch queue) adds nothing: its host time is the pace."""
        record.device_s = device_s
        self._unfolded_device.append(device_s)
        if judged_s is not None and followed_s is not None:
            for phase, seconds in judged_s.items():
                self.judged_device_s[phase] = self.judged_device_s.get(phase, 0.0) + seconds
            for phase, seconds in followed_s.items():
                self.followed_device_s[phase] = self.followed_device_s.get(phase, 0.0) + seconds
        queued_from = self._queued_ns
        self._queued_ns += record.step_ns
        lag_before = max(0, self._gpu_done_ns - queued_from)
        self._gpu_done_ns = max(self._gpu_done_ns, queued_from) + round(span_s * 1e9)
        excess_ns = max(0, self._gpu_done_ns - self._queued_ns) - lag_before
        if excess_ns:
            record.gpu_excess_ns = excess_ns
            self.add_excess(record.series_at, excess_ns)
            self.on_paced(record, excess_ns)
        if len(self._unfolded_device) >= self.fold_every:
            self.fold()

    def add_excess(self, series_at: int, excess_ns: int) -> None:
        """A measured step's GPU time beyond the host's (``add_device``'s model, or read back from a stream), into
        the window's total and the step's point of the series (``series_at``, -1: none)."""
        self.gpu_excess_ns += excess_ns
        if series_at >= 0:
            self.series.add_late(series_at, excess_ns)

    def _track(self, phase: str) -> PhaseTrack:
        track = self.phases.get(phase)
        if track is None:
            track = self.phases[phase] = PhaseTrack(StreamingStats(self.exact_limit), StreamingStats(self.exact_limit))
        return track

    def fold(self) -> None:
        """Fold buffered steps into the statistics (vectorised per phase)."""
        records, self._unfolded = self._unfolded, []
        if records:
            # attrgetter and map: the loops over the records in C (a comprehension's frame costs more per record)
            step_ns = np.fromiter(map(attrgetter("step_ns"), records), dtype=np.float64, count=len(records))
            self.step_stats.extend(step_ns / 1e9)
            for phase, values in _columns(list(map(attrgetter("phases_ns"), records)), self.phases).items():
                self._track(phase).host.extend(np.array(values, dtype=np.float64) / 1e9)
            samples = [n for n in map(attrgetter("samples"), records) if n is not None]
            self.samples += sum(samples)
            self.sampled_steps += len(samples)
        device_steps, self._unfolded_device = self._unfolded_device, []
        for phase, values in _columns(device_steps, self.phases).items():
            self._track(phase).device.extend(np.array(values, dtype=np.float64))


def _columns(rows: list[dict[str, Any]], known: Container[str]) -> dict[str, list[Any]]:
    """Per-key values of ``rows`` (dicts), each key's in row order over the rows that hold it. Keys not ``known``
    come in the order the rows first hold them (the order new phases' statistics take). Most steps hold the same
    phases: a key every row holds is read in one C loop (itemgetter). Where every row holds as many keys as the first,
    all of them known, and each of those, the rows hold the same keys and no union of them all is made."""
    if rows:
        first = rows[0]
        if all(key in known for key in first) and set(map(len, rows)) == {len(first)}:
            try:
                return {key: list(map(itemgetter(key), rows)) for key in first}
            except KeyError:
                pass  # a row holds another key in place of one of the first's
    keys: Iterable[str] = set().union(*rows)
    if not all(key in known for key in keys):
        keys = dict.fromkeys(chain.from_iterable(rows))
    columns: dict[str, list[Any]] = {}
    for key in keys:
        try:
            columns[key] = list(map(itemgetter(key), rows))
        except KeyError:
            columns[key] = [row[key] for row in rows if key in row]
    return columns


def _ms(seconds: float) -> float:
    return seconds * 1e3


def phase_order(names: list[str]) -> list[str]:
    """Phase names in step order: canonical phases, then custom ones as first seen, then ``other``, then
    stepscope's own."""
    canonical = [p for p in PHASES if p in names and p != OTHER_PHASE]
    custom = [p for p in names if p not in PHASES and p not in (TOTAL, OWN_PHASE)]
    last = [p for p in (OTHER_PHASE, OWN_PHASE) if p in names]
    return [*canonical, *custom, *last]


HOST_AHEAD_SHARE = 0.05  # GPU time beyond the host's, as a share of the step, from which the summary says so


def summarize(recorder: Recorder, timing: str) -> RunSummary:
    """The statistics part of a RunSummary: steps, per-phase statistics, throughput (meta left default)."""
    recorder.fold()
    warmup = min(recorder.warmup, recorder.steps_seen)
    steps = Steps(warmup=warmup, measured=recorder.measured, profiled=recorder.profiled)
    summary = RunSummary(steps=steps, series=recorder.series.series())
    step = recorder.step_stats
    if step.count == 0:
        if recorder.steps_seen == 0:
            summary.notes.append(
                f"no measured steps: warm-up was {recorder.warmup} steps, and {NO_STEP_MARK}: "
                "scope.step() was never called."
            )
        else:
            summary.notes.append(
                f"no measured steps: warm-up was {recorder.warmup} steps and only {recorder.steps_seen} step(s) "
                "ran; run more steps or lower the warm-up."
            )
        return summary
    total_s = step.total
    # Where the host ran ahead of the GPU, the step's pace is the GPU's: the device share and the rates are over
    # the GPU-paced time (host time plus the GPU's time beyond it); the host phases keep their host shares.
    excess_s = recorder.gpu_excess_ns / 1e9  # 0 unless CUDA-timed
    paced_s = recorder.paced_s
    for name in phase_order(list(recorder.phases)):
        track = recorder.phases[name]
        stats = PhaseStats(
            mean_ms=_ms(track.host.mean),
            median_ms=_ms(track.host.quantile(0.5)),
            p95_ms=_ms(track.host.quantile(0.95)),
            share=track.host.total / total_s if total_s > 0 else 0.0,
            steps=track.host.count,
            nested=name in recorder.nested,
        )
        if timing == "cuda" and track.device.count:
            stats.device_mean_ms = _ms(track.device.mean)
            stats.device_median_ms = _ms(track.device.quantile(0.5))
            stats.device_p95_ms = _ms(track.device.quantile(0.95))
            # Device time of the steps harvested so far, scaled to all measured steps.
            stats.device_share = (track.device.mean * track.host.count) / paced_s if paced_s > 0 else 0.0
            judged_s = recorder.judged_device_s.get(name, 0.0)
            if judged_s > 0:
                stats.device_host_paced = min(1.0, recorder.followed_device_s.get(name, 0.0) / judged_s)
        summary.phases[name] = stats
    summary.phases[TOTAL] = PhaseStats(
        mean_ms=_ms(step.mean),
        median_ms=_ms(step.quantile(0.5)),
        p95_ms=_ms(step.quantile(0.95)),
        share=1.0,
        steps=step.count,
    )
    steps_per_s = step.count / paced_s if paced_s > 0 else None
    # Samples per step where a step reported them, at every step's pace: the steps that fetched are no sample of
    # the others' time (a loader cycled by itertools.cycle fetches in its first pass only, and those steps are the
    # slow ones: read as the rate of their own time, it was 15% low). Where that pass ended in the warm-up, no
    # measured step reported any, and the warm-up's batches are the steps' samples.
    if recorder.sampled_steps:
        samples_per_step: float | None = recorder.samples / recorder.sampled_steps
    elif recorder.warmup_sampled_steps:
        samples_per_step = recorder.warmup_samples / recorder.warmup_sampled_steps
    else:
        samples_per_step = None
    summary.throughput = Throughput(
        steps_per_s=steps_per_s,
        samples_per_s=None if samples_per_step is None or steps_per_s is None else samples_per_step * steps_per_s,
        step_time_ms=_ms(paced_s / step.count),
        gpu_excess_ms=_ms(excess_s / step.count) if excess_s > 0 else None,
    )
    summary.notes += _followed_notes(summary.phases)
    if excess_s > HOST_AHEAD_SHARE * paced_s:
        summary.notes.append(
            f"the host ran ahead of the GPU: it queued a step's work in {_ms(step.mean):.2f} ms and the GPU took "
            f"{_ms(paced_s / step.count):.2f} ms, so the step time and the rates are the GPU's pace (from its "
            "events, with no sync); the host's phase times are the time to queue the work."
        )
    return summary


FOLLOWED_NOTE_SHARE = 0.10  # of the step: a phase's GPU time from which the summary says the GPU followed the host


def host_paced(phases: dict[str, PhaseStats], min_share: float) -> list[tuple[str, PhaseStats]]:
    """The phases (not nested) whose GPU time is mostly the host's (``device_host_paced`` at least one half) and at
    least ``min_share`` of the step: the GPU had done their work by the time the host ended them."""
    return [
        (name, stats)
        for name, stats in phases.items()
        if not stats.nested and (stats.device_host_paced or 0.0) >= 0.5 and (stats.device_share or 0.0) >= min_share
    ]


def _followed_notes(phases: dict[str, PhaseStats]) -> list[str]:
    """A note per phase whose GPU time is mostly the host's (``host_paced``)."""
    return [
        f"{name}'s GPU time ({stats.device_mean_ms or 0.0:.2f} ms) is mostly the host's: in "
        f"{100 * (stats.device_host_paced or 0.0):.0f}% of it the GPU had done the phase's work by the time the host "
        "ended the phase, so it waited for the host's launches; the verdict counts that time as host time, not as GPU "
        "work."
        for name, stats in host_paced(phases, FOLLOWED_NOTE_SHARE)
    ]


def add_wall_rates(summary: RunSummary) -> None:
    """The rates over the measured wall window (validation and the time between steps included), beside the step
    rates: ``wall_steps_per_s`` and ``wall_samples_per_s``."""
    throughput, wall = summary.throughput, summary.wall
    if wall is None or wall.window_s <= 0:
        return
    throughput.wall_steps_per_s = summary.steps.measured / wall.window_s
    if throughput.samples_per_s is not None:
        throughput.wall_samples_per_s = throughput.samples_per_s * wall.steps_s / wall.window_s
