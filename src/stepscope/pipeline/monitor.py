"""PipelineMonitor: both sides of an asynchronous inference→training pipeline, over a sliding window.

Engines produce samples into a pool; a trainer takes batches from it. The monitor measures each side as if the
other were infinitely fast — inference capacity I from engine time inside the slot, training capacity T from step
time without the dispatch wait — and the realised throughput on what training consumed, then names which side
starves the other (verdict.py).

Every method is safe from any thread and holds the monitor's lock only to add to a bucket, never while user work
runs: ``infer()`` reads the clock on entry and on exit and records at exit. The monitor's clock never runs
backwards (a clock that does is clamped), so an odd clock cannot make a negative duration, and an ``infer()`` that
is never closed records nothing. ``PipelineMonitor(enabled=False)`` (or ``STEPSCOPE=0``) is ``NULL_PIPELINE``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stepscope.pipeline.verdict import decide
from stepscope.pipeline.window import Totals, Window
from stepscope.record import GROUPS

log = logging.getLogger("stepscope")

WAITS_KEPT = 1024  # dispatch waits remembered between two training steps (a trainer that never steps: the last)
HISTORY_POINTS = 512  # the history keeps at most this many points: when full, every other one goes
DATA_PHASES = GROUPS["data"]
COMPUTE_PHASES = GROUPS["compute"] + GROUPS["optimizer"]  # what a training step computes, against fetching data


@dataclass
class PipelineSnapshot:
    """Both sides of the pipeline over the last ``window_s`` seconds. Rates in samples/s, times in s; a figure
    with nothing to compute it from is None."""

    window_s: float
    slots: int
    infer_capacity: float | None = None  # I: per-slot rate (samples / engine time) × slots
    train_capacity: float | None = None  # T: samples / step time, dispatch wait excluded
    thru: float | None = None  # samples consumed by training per second
    inflow: float | None = None  # samples entering the pool per second
    infer_batch_time_s: float | None = None  # mean engine call, measured inside the slot
    dispatch_wait_s: float | None = None  # mean wait for samples per training step
    pool: float = 0.0  # samples in the pool now
    pool_trend: float | None = None  # change of the pool, samples/s (inflow - consumption)
    slot_busy: float | None = None  # engine time / (slots × window), 0..1
    infer_calls: int = 0  # engine calls that succeeded, in the window
    infer_errors: int = 0  # engine calls that raised, in the window
    train_steps: int = 0  # timed training steps in the window
    samples_in: float = 0.0  # since the start
    samples_out: float = 0.0  # since the start
    bottleneck: str = "unknown"  # "inference" | "training" | "balanced" | "unknown"
    confidence: str = "low"
    training_side: str | None = None  # "data" | "compute", with a linked Scope
    evidence: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _count(value: Any) -> bool:
    """Whether ``value`` is a finite number >= 0 (a sample count or a duration); bools are not numbers here."""
    if type(value) is int or type(value) is float:  # the usual case, decided in one comparison
        return 0 <= value < math.inf
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


class _Timed:
    """One ``infer()`` or ``dispatch_wait()`` region: a context manager, also ``async with``."""

    __slots__ = ("_end", "_monitor", "_t0", "samples")

    def __init__(self, monitor: PipelineMonitor, end: Callable[[float, _Timed, bool], None], samples: float) -> None:
        self._monitor = monitor
        self._end = end
        self._t0 = 0.0
        self.samples = samples  # may be set inside the block: `with mon.infer() as call: ...; call.samples = n`

    def __enter__(self) -> _Timed:
        self._t0 = self._monitor._clock()  # no lock on entry: the exit clamps a clock that stepped back
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> bool:
        self._end(self._t0, self, exc_type is None)
        return False

    async def __aenter__(self) -> _Timed:
        return self.__enter__()

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> bool:
        return self.__exit__(exc_type, exc, tb)


class PipelineMonitor:
    """Measures an asynchronous inference→training pipeline: capacities, throughput, dispatch wait, pool.

    ``slots``: engine calls that can run at once (engines × concurrent calls per engine). ``window_s``: the
    sliding window (s). ``scope``: a Scope whose measured steps become training steps (step time minus the dispatch
    wait inside it; batch size from ``scope.step(batch_size=...)``), whose metrics gain the pipeline's, and whose
    summary carries the snapshot. ``tolerance``: capacities within this fraction (0..1) are balanced.
    """

    enabled = True

    def __new__(cls, *args: Any, enabled: bool = True, **kwargs: Any) -> Any:
        from stepscope.scope import env_enabled

        if not env_enabled(enabled):
            return NULL_PIPELINE
        return super().__new__(cls)

    def __init__(
        self,
        slots: int,
        window_s: float = 10.0,
        scope: Any = None,
        tolerance: float = 0.10,
        *,
        enabled: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be a positive int (engines × concurrent calls per engine), got {slots!r}")
        if not 0 <= tolerance < 1:
            raise ValueError(f"tolerance must be a fraction in [0, 1), got {tolerance!r}")
        self.slots = slots
        self.tolerance = tolerance
        self._window = Window(window_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._latest = -math.inf
        self._first_t: float | None = None
        self._last_t = -math.inf
        self._samples_in = 0.0
        self._samples_out = 0.0
        self._takes_seen = False
        self._level: float | None = None  # the pool's size as reported (pool_level), instead of counting
        self._levels: deque[tuple[float, float]] = deque()
        self._last_step_t: float | None = None
        # Dispatch waits since the last training step: (start, end, inside a data phase of the linked Scope).
        self._waits: deque[tuple[float, float, bool]] = deque(maxlen=WAITS_KEPT)
        self._history: list[dict[str, float | None]] = []
        self._history_every_s = window_s / 10
        self._next_history_t = math.inf
        self._linked = False
        self._scope_phases: dict[str, Any] = {}
        self._ignored: set[str] = set()  # the calls already warned about a bad value
        if scope is not None and getattr(scope, "enabled", False):
            scope._attach(self)
            self._linked = True
            self._scope_phases = scope._phases

    # -- the clock ----------------------------------------------------------------------------------------------

    def _tick(self, t: float | None = None) -> float:
        """The monitor's time (s): the clock (or ``t``, a reading of it), never earlier than a time already used.
        Called with the lock held."""
        if t is None:
            t = self._clock()
        if t < self._latest:
            return self._latest
        self._latest = t
        return t

    def _now(self) -> float:
        with self._lock:
            return self._tick()

    def _bucket(self, t: float) -> Totals:
        """The bucket for an event at ``t``; called with the lock held."""
        if self._first_t is None:
            self._first_t = t
            self._next_history_t = t + self._history_every_s
        t = max(t, self._first_t)
        self._last_t = max(self._last_t, t)
        return self._window.at(t)

    # -- inference side -----------------------------------------------------------------------------------------

    def infer(self, batch_size: float = 0) -> _Timed:
        """Time one engine call, inside the slot (after the semaphore is acquired, so slot wait is excluded):
        ``with mon.infer(batch_size=n): out = engine.generate(batch)`` (also ``async with``). A call that raises is
        counted in ``infer_errors`` and left out of the capacity. Set ``.samples`` on the returned object inside
        the block when the count is known only then. Counts and times must be finite numbers >= 0: a call with
        another value (negative, NaN, inf) is ignored here as in every method, with one warning per method."""
        return _Timed(self, self._end_infer, batch_size)

    def _end_infer(self, t0: float, call: _Timed, ok: bool) -> None:
        t1 = self._clock()  # the duration is on the raw clock: a clamped end would stretch it
        if not self._valid("infer", samples=call.samples):
            return
        with self._lock:
            now = self._tick(t1)
            self._add_infer(now, t1 - t0, call.samples, ok)
        self._maybe_history(now)

    def record_infer(self, duration_s: float, samples: float, ok: bool = True, ended_ago_s: float = 0.0) -> None:
        """Record an engine call timed elsewhere (another process or machine): ``duration_s`` inside the slot,
        ``samples`` produced, ended ``ended_ago_s`` seconds before this call (the Ray adapter reports in batches)."""
        if not self._valid("record_infer", duration_s=duration_s, samples=samples, ended_ago_s=ended_ago_s):
            return
        with self._lock:
            now = self._tick()
            self._add_infer(now - max(ended_ago_s, 0.0), duration_s, samples, ok)
        self._maybe_history(now)

    def _add_infer(self, ended: float, duration_s: float, samples: float, ok: bool) -> None:
        bucket = self._bucket(ended)
        duration_s = max(duration_s, 0.0)
        bucket.busy_s += duration_s
        if not ok:
            bucket.infer_errors += 1
        elif duration_s > 0 and samples > 0:  # zero time (a clock that stepped back) cannot give a rate
            bucket.infer_samples += samples
            bucket.infer_s += duration_s
            bucket.infer_calls += 1

    # -- the pool -----------------------------------------------------------------------------------------------

    def pool_put(self, samples: float) -> None:
        """``samples`` entered the pool."""
        if not self._valid("pool_put", samples=samples):
            return
        with self._lock:
            now = self._tick()
            self._bucket(now).put += samples
            self._samples_in += samples
        self._maybe_history(now)

    def pool_take(self, samples: float) -> None:
        """Training took ``samples`` from the pool: the realised throughput counts these."""
        if not self._valid("pool_take", samples=samples):
            return
        with self._lock:
            now = self._tick()
            self._bucket(now).taken += samples
            self._samples_out += samples
            self._takes_seen = True
        self._maybe_history(now)

    def pool_level(self, samples: float) -> None:
        """The pool's size as read from the pool itself (a queue's ``qsize()``): used instead of puts − takes."""
        if not self._valid("pool_level", samples=samples):
            return
        with self._lock:
            now = self._tick()
            self._bucket(now)
            self._level = samples
            levels = self._levels
            levels.append((now, samples))
            while len(levels) > 1 and levels[1][0] <= now - self._window.window_s:
                levels.popleft()

    # -- training side ------------------------------------------------------------------------------------------

    def dispatch_wait(self) -> _Timed:
        """Time the trainer's wait for enough samples: ``with mon.dispatch_wait(): batch = pool.take(k)``."""
        return _Timed(self, self._end_wait, 0)

    def _end_wait(self, t0: float, call: _Timed, ok: bool) -> None:
        t1 = self._clock()
        in_data = self._in_data_phase()
        with self._lock:
            now = self._tick(t1)
            wait_s = max(t1 - t0, 0.0)
            bucket = self._bucket(now)
            bucket.wait_s += wait_s
            bucket.waits += 1
            self._waits.append((now - wait_s, now, in_data))
        self._maybe_history(now)

    def _in_data_phase(self) -> bool:
        """Whether a data phase (``data_wait``, ``h2d``) of the linked Scope is open: a wait inside one is not data
        loading. A wait inside ``scope.data(...)``'s fetch is not seen; it matters little, as a training-bound
        trainer (where data against compute is read) barely waits."""
        phases = self._scope_phases
        return any(phase._starts for name in DATA_PHASES if (phase := phases.get(name)) is not None)

    def _waited(self, start: float, end: float) -> tuple[float, float]:
        """Wait time (s) within ``[start, end]``, all and inside data phases; forgets the waits. Lock held."""
        total = in_data = 0.0
        for wait_start, wait_end, data in self._waits:
            overlap = max(min(wait_end, end) - max(wait_start, start), 0.0)
            total += overlap
            in_data += overlap if data else 0.0
        self._waits.clear()
        return total, in_data

    def train_step(self, batch_size: float, step_time: float | None = None) -> None:
        """One training step of ``batch_size`` samples taking ``step_time`` seconds without the dispatch wait; by
        default the time since the previous ``train_step`` minus the waits in between (the first step then only
        starts the clock). With a linked Scope its steps are recorded instead, and this call is ignored."""
        if self._linked:
            log.warning("stepscope: PipelineMonitor.train_step ignored: the linked Scope's steps are recorded.")
            return
        if not self._valid("train_step", batch_size=batch_size, step_time=0.0 if step_time is None else step_time):
            return
        with self._lock:
            now = self._tick()
            last, self._last_step_t = self._last_step_t, now
            wait_s, _ = self._waited(-math.inf if last is None else last, now)
            if step_time is None and last is not None:
                step_time = now - last - wait_s
            if step_time is not None:
                self._add_step(now, batch_size, step_time, wait_s, 0.0, 0.0)
        self._maybe_history(now)

    def _scope_step(self, step_ns: int, phases_ns: dict[str, int], samples: int | None) -> None:
        """A measured step of the linked Scope (called by the Scope after it closes the step): its time and data
        phases without the dispatch waits inside them (waits of earlier, warm-up steps are not this step's)."""
        data_s = sum(phases_ns.get(p, 0) for p in DATA_PHASES) / 1e9
        compute_s = sum(phases_ns.get(p, 0) for p in COMPUTE_PHASES) / 1e9
        step_s = step_ns / 1e9
        with self._lock:
            now = self._tick()
            wait_s, wait_in_data_s = self._waited(now - step_s, now)
            data_s = max(data_s - wait_in_data_s, 0.0)
            self._add_step(now, samples or 0, step_s - wait_s, wait_s, data_s, compute_s)
        self._maybe_history(now)

    def _add_step(
        self, now: float, samples: float, step_s: float, wait_s: float, data_s: float, compute_s: float
    ) -> None:
        bucket = self._bucket(now)
        if step_s > 0 and samples > 0:
            bucket.train_samples += samples
            bucket.train_s += step_s
            bucket.train_steps += 1
            bucket.step_wait_s += wait_s
            bucket.data_s += data_s
            bucket.compute_s += compute_s

    def _valid(self, call: str, **figures: Any) -> bool:
        """Whether every figure is a finite number >= 0. A call with one that is not (a negative count, NaN, inf)
        is ignored, with one warning per method: it would turn every rate negative or NaN."""
        if all(_count(value) for value in figures.values()):
            return True
        if call not in self._ignored:
            self._ignored.add(call)
            bad = ", ".join(f"{name}={value!r:.40}" for name, value in figures.items() if not _count(value))
            log.warning(
                "stepscope: PipelineMonitor.%s(%s) ignored: sample counts and times are finite numbers >= 0 "
                "(further such calls are ignored without a word).", call, bad,
            )  # fmt: skip
        return False

    # -- reading ------------------------------------------------------------------------------------------------

    def _figures(self, now: float) -> tuple[PipelineSnapshot, Totals]:
        """The snapshot's figures over the window ending at ``now`` (without the verdict), and the window's sums."""
        with self._lock:
            totals, start = self._window.totals(now)
            first = self._first_t
            level = self._level
            levels = list(self._levels)
            samples_in, samples_out, takes_seen = self._samples_in, self._samples_out, self._takes_seen
        span = now - max(start, first) if first is not None else 0.0
        snap = PipelineSnapshot(window_s=self._window.window_s, slots=self.slots)
        if totals.infer_s > 0:
            snap.infer_capacity = totals.infer_samples / totals.infer_s * self.slots
            snap.infer_batch_time_s = totals.infer_s / totals.infer_calls
        if totals.train_s > 0:
            snap.train_capacity = totals.train_samples / totals.train_s
        if totals.train_steps:  # the waits inside the steps counted (not those of warm-up steps)
            snap.dispatch_wait_s = totals.step_wait_s / totals.train_steps
        elif totals.waits:
            snap.dispatch_wait_s = totals.wait_s / totals.waits
        if span > 0:
            snap.inflow = totals.put / span
            snap.thru = (totals.taken if takes_seen else totals.train_samples) / span
            snap.slot_busy = min(totals.busy_s / (self.slots * span), 1.0)
        if level is not None:
            snap.pool = level
            if len(levels) > 1 and levels[-1][0] > levels[0][0]:
                snap.pool_trend = (levels[-1][1] - levels[0][1]) / (levels[-1][0] - levels[0][0])
        else:
            snap.pool = max(samples_in - samples_out, 0.0)
            if span > 0 and (totals.put or totals.taken):
                snap.pool_trend = (totals.put - totals.taken) / span
        snap.infer_calls, snap.infer_errors, snap.train_steps = (
            totals.infer_calls,
            totals.infer_errors,
            totals.train_steps,
        )
        snap.samples_in, snap.samples_out = samples_in, samples_out
        return snap, totals

    def snapshot(self) -> PipelineSnapshot:
        """Both sides over the last window, with the bottleneck and its evidence."""
        return self._snapshot(self._now())

    def _snapshot(self, now: float) -> PipelineSnapshot:
        snap, totals = self._figures(now)
        busy = totals.step_wait_s + totals.train_s
        wait_share = totals.step_wait_s / busy if busy > 0 else None
        verdict = decide(snap, self.tolerance, wait_share, totals.data_s, totals.compute_s)
        snap.bottleneck, snap.confidence = verdict.bottleneck, verdict.confidence
        snap.training_side, snap.evidence = verdict.training_side, verdict.evidence
        return snap

    def _maybe_history(self, now: float) -> None:
        if now < self._next_history_t:
            return
        snap, _ = self._figures(now)
        point = {
            "t_s": now - (now if self._first_t is None else self._first_t),
            "infer_capacity": snap.infer_capacity,
            "train_capacity": snap.train_capacity,
            "thru": snap.thru,
            "inflow": snap.inflow,
            "pool": snap.pool,
        }
        with self._lock:
            if now < self._next_history_t:  # another thread took this point
                return
            self._history.append(point)
            if len(self._history) >= HISTORY_POINTS:
                self._history = self._history[::2]
                self._history_every_s *= 2
            self._next_history_t = now + self._history_every_s

    def history(self) -> list[dict[str, float | None]]:
        """Points of I, T, thru, inflow and pool over the run (``t_s`` from the first event), at most 512: every
        ``window_s / 10`` seconds, the interval doubling whenever the history fills."""
        with self._lock:
            return list(self._history)

    def metrics(self) -> dict[str, float]:
        """The pipeline's ``perf/`` metrics for sinks (those with a value): ``perf/thru``, ``perf/inflow``,
        ``perf/infer_capacity``, ``perf/pipeline_train_capacity`` (samples/s), ``perf/infer_batch_time``,
        ``perf/dispatch_wait`` (s), ``perf/pool`` (samples), ``perf/pool_trend`` (samples/s), ``perf/infer_errors``."""
        snap, _ = self._figures(self._now())
        values = {
            "perf/thru": snap.thru,
            "perf/inflow": snap.inflow,
            "perf/infer_capacity": snap.infer_capacity,
            "perf/pipeline_train_capacity": snap.train_capacity,
            "perf/infer_batch_time": snap.infer_batch_time_s,
            "perf/dispatch_wait": snap.dispatch_wait_s,
            "perf/pool": snap.pool,
            "perf/pool_trend": snap.pool_trend,
            "perf/infer_errors": snap.infer_errors,
        }
        return {name: float(value) for name, value in values.items() if value is not None}

    def postfix(self) -> str:
        """A progress-bar string: ``thru=12.1, I=18.5, T=13.2, wait=0.1s, pool=24``."""
        snap, _ = self._figures(self._now())
        return (
            f"thru={_fmt(snap.thru)}, I={_fmt(snap.infer_capacity)}, T={_fmt(snap.train_capacity)}, "
            f"wait={_fmt(snap.dispatch_wait_s)}s, pool={snap.pool:.0f}"
        )

    def to_summary(self) -> dict[str, Any]:
        """The snapshot and the history, as the ``pipeline`` field of a RunSummary (docs/pipeline.md). The window
        ends at the last event, not now: a summary is written after the pipeline stopped, and the idle time since
        would read as a slowdown."""
        with self._lock:
            last = self._last_t
        now = self._now()
        return {**self._snapshot(last if last > -math.inf else now).to_dict(), "history": self.history()}


class _NullTimed:
    """The shared no-op region of a disabled monitor (``samples`` may be set, and is dropped)."""

    __slots__ = ()

    def __enter__(self) -> _NullTimed:
        return self

    def __exit__(self, *exc: object) -> bool:
        return False

    async def __aenter__(self) -> _NullTimed:
        return self

    async def __aexit__(self, *exc: object) -> bool:
        return False

    @property
    def samples(self) -> float:
        return 0

    @samples.setter
    def samples(self, value: float) -> None:
        return None


NULL_TIMED = _NullTimed()


class NullPipeline:
    """A disabled PipelineMonitor: same methods, no work, no allocation."""

    enabled = False

    def infer(self, batch_size: float = 0) -> _NullTimed:
        return NULL_TIMED

    def dispatch_wait(self) -> _NullTimed:
        return NULL_TIMED

    def record_infer(self, duration_s: float, samples: float, ok: bool = True, ended_ago_s: float = 0.0) -> None:
        return None

    def pool_put(self, samples: float) -> None:
        return None

    def pool_take(self, samples: float) -> None:
        return None

    def pool_level(self, samples: float) -> None:
        return None

    def train_step(self, batch_size: float, step_time: float | None = None) -> None:
        return None

    def snapshot(self) -> None:
        return None

    def history(self) -> list[dict[str, float | None]]:
        return []

    def metrics(self) -> dict[str, float]:
        return {}

    def postfix(self) -> str:
        return ""

    def to_summary(self) -> dict[str, Any]:
        return {}


NULL_PIPELINE = NullPipeline()
