"""Scope: the user-facing recorder of a training loop, and the null object it becomes when disabled.

``Scope(enabled=False)`` (or ``STEPSCOPE=0`` in the environment) returns ``NULL_SCOPE``: ``phase()`` hands back
one shared no-op context manager, ``data()`` returns the iterable itself, ``step()`` does nothing, so a disabled
scope costs one method call per phase and allocates nothing.

An enabled scope times host work with the clock and, once CUDA is in use, brackets each phase with device events
that are read only after they complete (see clock.py): it never synchronises inside the loop. Any error inside
stepscope is logged once and stops measurement; the training loop goes on.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import numbers
import os
import platform
import reprlib
import socket
import sys
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from threading import get_ident
from typing import Any, TypeVar

from stepscope.clock import (
    HOST_ONLY,
    Clock,
    CudaEvents,
    DeviceTimer,
    EventSource,
    HostOnly,
    cuda_available,
    cuda_in_use,
    now_ns,
)
from stepscope.instrument.profile import NO_RANGES, NoRanges, NsysRange, NsysWindow, Profiler, ProfileWindow, Ranges
from stepscope.invariants import between_note, check
from stepscope.record import (
    DATA_PHASE,
    EVAL_PHASE,
    OTHER_PHASE,
    OWN_PHASE,
    TOTAL,
    EvalPasses,
    Recorder,
    StepRecord,
    add_wall_rates,
    summarize,
)
from stepscope.sinks.base import NO_SINKS, Sink, SinkSet
from stepscope.summary import Meta, RunSummary, Wall

log = logging.getLogger("stepscope")

T = TypeVar("T")

TIMINGS = ("auto", "host", "cuda")


def check_phase_name(name: object) -> str:
    """``name`` if it can name a phase: a non-blank string other than ``other``, ``total`` and ``stepscope``
    (which stepscope computes itself). Anything else raises at the call, naming the value, so a summary never
    holds a key that its JSON cannot (a number, None, a tuple) or a row with no name."""
    if not isinstance(name, str):
        raise TypeError(f"Scope.phase() takes a string name, not {type(name).__name__} {reprlib.repr(name)}")
    if not name.strip():
        raise ValueError(f"Scope.phase() needs a non-blank name, not {name!r}")
    if name in (OTHER_PHASE, TOTAL, OWN_PHASE):
        raise ValueError(f"Scope.phase({name!r}): {name!r} is computed by stepscope; choose another name")
    return name


def env_enabled(enabled: bool) -> bool:
    """``STEPSCOPE=1``/``0`` in the environment overrides the ``enabled`` argument."""
    value = os.environ.get("STEPSCOPE", "").strip().lower()
    if value in ("0", "false", "off", "no"):
        return False
    if value in ("1", "true", "on", "yes"):
        return True
    return bool(enabled)


class _NullPhase:
    """The shared no-op context manager a disabled scope hands out."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


NULL_PHASE = _NullPhase()


class NullScope:
    """A disabled Scope: same methods, no work, no allocation."""

    enabled = False

    def phase(self, name: str) -> _NullPhase:
        return NULL_PHASE

    def data(self, iterable: Iterable[T]) -> Iterable[T]:
        return iterable

    def step(self, batch_size: int | None = None) -> None:
        return None

    def metrics(self) -> dict[str, float]:
        return {}

    def postfix(self) -> str:
        return ""

    def summary(self) -> RunSummary:
        return RunSummary(notes=["stepscope was disabled: nothing was measured."])

    def print_table(self, file: Any = None) -> None:
        return None

    def close(self) -> None:
        return None


NULL_SCOPE = NullScope()


class _NoCollectors:
    """The system sampler of a Scope that samples nothing (``system_interval_s=None``, or before measuring)."""

    def peek(self, steps: int | None = None, samples: int | None = None) -> dict[str, Any]:
        return {}

    def stop(self, steps: int | None = None, samples: int | None = None) -> dict[str, Any]:
        return {}

    def snapshot(self) -> dict[str, float]:
        return {}

    def hotspots(self, phases: dict[str, Any]) -> dict[str, Any]:
        return {}


NO_COLLECTORS = _NoCollectors()


class _HostPhase:
    """A reusable context manager timing one named phase with the host clock; re-entrant via its stack: a phase
    entered while it is already open is part of the open one, and only the outermost is counted."""

    __slots__ = ("_clock", "_name", "_scope", "_starts")

    def __init__(self, scope: Scope, name: str) -> None:
        self._scope = scope
        self._name = name
        self._clock = scope._clock
        self._starts: list[int] = []

    def __enter__(self) -> None:
        t0 = self._clock()
        scope = self._scope
        if scope._step_start_ns is None:
            scope._step_start_ns = t0
        scope._depth += 1
        self._starts.append(t0)

    def __exit__(self, *exc: object) -> bool:
        t1 = self._clock()
        scope = self._scope
        try:
            starts = self._starts
            elapsed = t1 - starts.pop()
            scope._depth -= 1
            if not starts:  # an inner entry of a phase still open is inside the outer one's time already
                # Scope._add, inline: the one call a phase's exit would make
                current = scope._current
                name = self._name
                current[name] = current.get(name, 0) + elapsed
                if scope._depth:
                    scope._recorder.nested.add(name)
                else:
                    scope._claimed_ns += elapsed
        except Exception as error:
            scope._fail(error)
        return False


class _EvalPhase(_HostPhase):
    """``scope.phase("eval")``: a validation pass. Its wall time is taken out of the step it falls in and the
    phases inside it (a ``scope.data(val_loader)`` fetch, a forward) are its own, so the step statistics describe
    training alone; the passes are reported apart (``RunSummary.eval``)."""

    __slots__ = ()

    def __enter__(self) -> None:
        t0 = self._clock()
        self._starts.append(t0)
        if len(self._starts) == 1:  # a nested eval phase is part of the outer pass
            self._scope._begin_eval(t0)

    def __exit__(self, *exc: object) -> bool:
        t1 = self._clock()
        try:
            self._starts.pop()
            if not self._starts:
                self._scope._end_eval(t1)
        except Exception as error:
            self._scope._fail(error)
        return False


@dataclass(slots=True)
class _EvalWindow:
    """What an open validation pass set aside: the step's own accumulators, restored when the pass ends."""

    start_ns: int
    current: dict[str, int]
    claimed_ns: int
    depth: int
    device: Any
    step_start_ns: int | None


@dataclass(slots=True)
class _Pass:
    """A measured stretch cut out of a step as validation, not yet counted as a pass: the step's phase time inside
    it (``claimed_ns`` of it at the top level) and its wall time (ns)."""

    wall_ns: int
    phases_ns: dict[str, int]
    claimed_ns: int
    forwards: int
    batches: int


def _absorb(record: StepRecord, passes: list[_Pass]) -> None:
    """Put stretches cut out of ``record``'s step back into it: they were step work after all."""
    phases = record.phases_ns
    for stretch in passes:
        record.step_ns += stretch.wall_ns
        for name, ns in stretch.phases_ns.items():
            phases[name] = phases.get(name, 0) + ns
        phases[OTHER_PHASE] = phases.get(OTHER_PHASE, 0) + max(stretch.wall_ns - stretch.claimed_ns, 0)


class _CudaPhase(_HostPhase):
    """A phase also bracketed by device events on the current stream (read later, never waited on)."""

    __slots__ = ("_events",)

    def __init__(self, scope: Scope, name: str) -> None:
        super().__init__(scope, name)
        self._events: list[Any] = []

    def __enter__(self) -> None:
        super().__enter__()
        if len(self._starts) > 1:  # re-entered while open: the outer entry's events time it
            self._events.append(None)
            return
        try:
            self._events.append(self._scope._device.start())
        except Exception as error:
            self._events.append(None)
            self._scope._fail(error)

    def __exit__(self, *exc: object) -> bool:
        try:
            start = self._events.pop()
            if start is not None:
                self._scope._device.stop(self._name, start)
        except Exception as error:
            self._scope._fail(error)
        return super().__exit__(*exc)


class _Marked:
    """Makes a phase also a named profiler/NVTX range (only while capturing: ranges cost a little)."""

    __slots__ = ()
    _scope: Scope
    _name: str

    def __enter__(self) -> None:
        self._scope._ranges.push(self._name)
        super().__enter__()  # type: ignore[misc]

    def __exit__(self, *exc: object) -> bool:
        result = super().__exit__(*exc)  # type: ignore[misc]
        self._scope._ranges.pop()
        return result


class _MarkedHostPhase(_Marked, _HostPhase):
    __slots__ = ()


class _MarkedCudaPhase(_Marked, _CudaPhase):
    __slots__ = ()


class _TimedIterable:
    """Wraps an iterable so that time spent inside its ``__next__`` is the ``data_wait`` phase."""

    def __init__(self, scope: Scope, iterable: Iterable[Any]) -> None:
        self._scope = scope
        self._iterable = iterable

    def __len__(self) -> int:
        return len(self._iterable)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        scope = self._scope
        clock = scope._clock
        iterator = iter(self._iterable)
        if get_ident() != scope._thread and not scope._claim("data"):
            yield from iterator  # iterated on another thread: its fetches are not the training loop's wait
            return
        while True:
            t0 = clock()
            if scope._step_start_ns is None:
                scope._step_start_ns = t0
            try:
                item = next(iterator)
            except StopIteration:
                # The fetch that ends an epoch (worker shutdown) still cost the next step time.
                scope._add(DATA_PHASE, clock() - t0)
                return
            scope._add(DATA_PHASE, clock() - t0)
            yield item


class _MarkedIterable(_TimedIterable):
    """A timed iterable whose fetches are also ``stepscope/data_wait`` profiler/NVTX ranges."""

    def __iter__(self) -> Iterator[Any]:
        ranges = self._scope._ranges
        timed = super().__iter__()
        while True:
            ranges.push(DATA_PHASE)
            try:
                item = next(timed)
            except StopIteration:
                return
            finally:
                ranges.pop()
            yield item


# the generator frames a timed fetch runs in: while one is on the stack, the loop waits for data
_FETCH_CODES = frozenset({_TimedIterable.__iter__.__code__, _MarkedIterable.__iter__.__code__})


class Scope:
    """Times the phases of a training loop without perturbing it.

    Args:
        enabled: False returns the null object ``NULL_SCOPE`` (``STEPSCOPE=1/0`` overrides).
        warmup: steps to run before measuring (compile, allocator and cuDNN warm-up), >= 0.
        window: steps in the window behind ``metrics()`` and ``postfix()``.
        timing: "auto" (CUDA events once CUDA is in use when measuring starts), "host", or "cuda".
        exact_limit: steps kept exactly for quantiles; past it, quantiles have <= 1% relative error.
        sinks: where ``metrics()`` goes every ``log_every`` measured steps (``stepscope.sinks``: JsonlSink, ...);
            a sink that fails warns once and is dropped. ``close()`` (or interpreter exit) closes them.
        log_every: write to the sinks every this many measured steps, >= 1.
        flops_per_step: model FLOPs of one step (``stepscope.analyses.flops.count_flops``): adds ``perf/tflops``
            and, with ``peak_tflops`` (the GPU's dense peak for the training dtype), ``perf/mfu``.
        system_interval_s: seconds between samples of host CPU/memory and GPU utilisation, clocks, power and energy
            (NVML), from the last warm-up step until ``close()``; 0.05 (20 Hz) at the fastest; None samples
            nothing. At 1 s the sampler thread costs ~0.1% of one core (docs/benchmarks.md).
        stack_sample_hz: also sample the training thread's stack this often while the system sampler runs, naming
            the source lines of ``other``, ``sync`` and ``data_wait`` time (``RunSummary.hotspots``); None (the
            default) samples no stacks and costs nothing. At ``DEFAULT_STACK_HZ`` (100) for 2 s, then about 20 Hz
            (collectors/stacks.py), it costs ~0.5% of a step on a 2-core VM once slowed down (docs/benchmarks.md).
        profile: record a few steps with torch.profiler (`ProfileWindow`: schedule counted from the first measured
            step, one ``rank<R>.step<A>-<B>.pt.trace.json.gz`` per rank and window); phases become
            ``stepscope/<phase>`` ranges in the trace.
        nvtx: also mark phases as NVTX ranges (for Nsight Systems; needs CUDA).
        nsys_window: `NsysWindow` or ``"START:STOP"``: cudaProfilerStart/Stop around those steps (0-based, warm-up
            included), for ``nsys profile --capture-range=cudaProfilerApi``.
        clock: nanosecond clock (a seam for tests); events: device event source (a seam for tests).
    """

    enabled = True

    def __new__(cls, enabled: bool = True, *args: Any, **kwargs: Any) -> Any:
        if not env_enabled(enabled):
            return NULL_SCOPE
        return super().__new__(cls)

    def __init__(
        self,
        enabled: bool = True,
        warmup: int = 20,
        window: int = 20,
        timing: str = "auto",
        exact_limit: int = 10_000,
        sinks: Iterable[Sink] | None = None,
        log_every: int = 1,
        flops_per_step: int | None = None,
        peak_tflops: float | None = None,
        system_interval_s: float | None = 1.0,
        stack_sample_hz: float | None = None,
        profile: ProfileWindow | None = None,
        nvtx: bool = False,
        nsys_window: NsysWindow | str | None = None,
        clock: Clock = now_ns,
        events: EventSource | None = None,
    ) -> None:
        if timing not in TIMINGS:
            raise ValueError(f"timing must be one of {TIMINGS}, got {timing!r}")
        if log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {log_every}")
        self.flops_per_step = flops_per_step
        self.peak_tflops = peak_tflops
        self._sinks = SinkSet(sinks) if sinks else NO_SINKS
        self._log_every = log_every
        # A null object on the step path when nothing is logged: no test per step.
        self._log_step = self._write_sinks if self._sinks else _no_log
        if self._sinks:
            weakref.finalize(self, self._sinks.close)  # closed at interpreter exit if never closed
        if system_interval_s is not None:
            from stepscope.collectors.sampler import check_interval

            system_interval_s = check_interval(system_interval_s)
            _import_host_collector()
        self._system_interval_s = system_interval_s
        if stack_sample_hz is not None:
            from stepscope.collectors.stacks import check_rate

            stack_sample_hz = check_rate(stack_sample_hz)
        self._stack_sample_hz = stack_sample_hz
        # which phase is open at a stack sample's instant; the auto-instrumentation's tracker replaces it
        self._phase_of: Any = self._phase_at
        self._collectors: Any = NO_COLLECTORS
        if timing == "cuda" and events is None and not cuda_available():
            raise ValueError("timing='cuda' needs a CUDA device, and torch sees none: use timing='auto' or 'host'.")
        self._recorder = Recorder(warmup=warmup, window=window, exact_limit=exact_limit)
        self._clock = clock
        self._timing = timing
        self._events = events
        self._device: HostOnly | DeviceTimer = HOST_ONLY
        self._timing_used = "host"
        self._phases: dict[str, _HostPhase] = {}
        self._phase_type: type[_HostPhase] = _HostPhase
        self._iterable_type: type[_TimedIterable] = _TimedIterable
        self._step_start_ns: int | None = None
        # The thread whose phases and steps are recorded: the first to use the scope. Another thread's calls are
        # ignored (a phase there would overlap the loop's and count its time twice), with one warning and a note.
        self._thread: int | None = None
        self._one_thread = True  # False: any thread's calls count (`enabled_scope`: the hooks sort threads out)
        self._ignored: dict[str, list[Any]] = {}  # kind of ignored call -> [calls, why the first was ignored]
        self._depth = 0
        self._current: dict[str, int] = {}
        self._claimed_ns = 0
        self._failed: str | None = None
        self._eval = EvalPasses()
        self._eval_window: _EvalWindow | None = None
        # Stretches cut out of the open step as validation whose fate waits on the next step (``_end_eval``'s
        # ``tentative``), and the closed step held back with its own until then.
        self._side: list[_Pass] = []
        self._held: tuple[StepRecord, list[_Pass]] | None = None
        self._cut_ns = 0  # wall time of passes cut out of the open step after it began
        self._window: list[int] | None = None  # [start, end] (ns) of the measured wall window
        self._pipeline: Any = None  # a linked PipelineMonitor
        self._started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self._capture(profile, nvtx, nsys_window)
        if self._recorder.measuring:
            self._start_measuring()
        _SCOPES.add(self)

    # -- the loop-facing API ------------------------------------------------------------------------------------

    def phase(self, name: str) -> _HostPhase:
        """A context manager timing ``name`` (canonical: data_wait, h2d, forward, backward, clip, optimizer,
        zero_grad, sync; any other non-blank string but ``other`` and ``total`` is a custom phase; a name that is
        not a string, blank, ``other`` or ``total`` raises TypeError or ValueError naming it). Phases may nest; a
        nested phase's time stays in its parent's share and is reported separately. A phase entered while it is
        already open is part of the open one (counted once). A phase whose body raises still closes. Only the
        thread that first used the scope is timed: a phase opened on another thread is a no-op (one warning, and a
        note in the summary)."""
        if get_ident() != self._thread and not self._claim("phase"):
            return NULL_PHASE  # type: ignore[return-value]
        try:  # costs nothing unless it raises (3.11+); a name is checked once, when first seen (_new_phase)
            return self._phases.get(name) or self._new_phase(name)
        except TypeError:
            check_phase_name(name)  # an unhashable name (a list): say which
            raise

    def _phase_any_thread(self, name: str) -> _HostPhase:
        """``phase`` without the thread rule, for a scope driven by stepscope's own hooks (`enabled_scope`)."""
        try:
            return self._phases.get(name) or self._new_phase(name)
        except TypeError:
            check_phase_name(name)
            raise

    def _new_phase(self, name: str) -> _HostPhase:
        check_phase_name(name)
        kind = _EvalPhase if name == EVAL_PHASE else self._phase_type
        phase = self._phases[name] = kind(self, name)
        return phase

    def data(self, iterable: Iterable[T]) -> Iterable[T]:
        """Iterate ``iterable`` (a DataLoader, say), timing each fetch as the ``data_wait`` phase."""
        return self._iterable_type(self, iterable)

    def step(self, batch_size: int | None = None) -> None:
        """Close the current step; ``batch_size`` (samples, a finite number >= 0) enables samples/s. A negative,
        NaN, infinite or non-numeric batch size is dropped (the step counts without samples), with one warning and
        a note in the summary; so is a step closed from another thread than the scope's."""
        t1 = self._clock()
        if get_ident() != self._thread and not self._claim("step"):
            return
        self._record_step(t1, batch_size)
        if self._step_start_ns == t1 and not self._depth:  # not where a trace export or a pass moved the start
            self._add_own(self._clock() - t1)  # closing the step: the next step holds it as stepscope's time

    def _add_own(self, ns: int) -> None:
        """``ns`` of stepscope's own time outside every phase (its hooks' work): the current step's ``stepscope``
        phase, no longer ``other``."""
        if ns > 0:
            current = self._current
            current[OWN_PHASE] = current.get(OWN_PHASE, 0) + ns
            self._claimed_ns += ns

    def _step_any_thread(self, batch_size: int | None = None) -> None:
        """``step`` without the thread rule, for a scope driven by stepscope's own hooks (`enabled_scope`)."""
        self._record_step(self._clock(), batch_size)

    def _record_step(self, t1: int, batch_size: int | None) -> None:
        if batch_size is not None and not (type(batch_size) is int and batch_size >= 0):
            batch_size = self._checked_batch(batch_size)
        try:
            self._close_step(t1, batch_size)
        except Exception as error:
            self._fail(error)

    # -- reading results ----------------------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """Live metrics over the last ``window`` measured steps, in seconds and samples/s.

        ``perf/step_time`` (s), ``perf/data_time`` (s in data_wait), ``perf/compute_time`` (s: device time of
        every other top-level phase when CUDA-timed, counted over the window's harvested steps; host step time
        minus data time otherwise), ``perf/train_capacity`` (samples/s = batch / step time, when batch size is
        known). With the system sampler running, also its latest readings: ``sys/cpu_util`` and
        ``sys/workers_cpu_util`` (% of one core), ``sys/gpu_util`` (%), ``sys/power_w`` (W), ``sys/sm_clock_ratio``
        and the others of docs/collectors.md, each when measured. With a linked PipelineMonitor, its ``perf/``
        figures (docs/pipeline.md). During warm-up only the pipeline's figures.
        """
        recent = self._recorder.recent
        if not recent:  # warming up: only a linked pipeline's figures, which do not wait for measured steps
            return self._pipeline.metrics() if self._pipeline is not None else {}
        n = len(recent)
        step_s = sum(r.step_ns for r in recent) / n / 1e9
        data_s = sum(r.phases_ns.get(DATA_PHASE, 0) for r in recent) / n / 1e9
        out = {"perf/step_time": step_s, "perf/data_time": data_s}
        if self._timing_used == "cuda":
            harvested = [r.device_s for r in recent if r.device_s is not None]
            if harvested:
                nested = self._recorder.nested
                compute = [sum(s for p, s in d.items() if p != DATA_PHASE and p not in nested) for d in harvested]
                out["perf/compute_time"] = sum(compute) / len(compute)
        else:
            out["perf/compute_time"] = step_s - data_s
        sampled = [r for r in recent if r.samples is not None]
        sampled_s = sum(r.step_ns for r in sampled) / 1e9
        if sampled and sampled_s > 0:
            out["perf/train_capacity"] = sum(r.samples or 0 for r in sampled) / sampled_s
        if self.flops_per_step and step_s > 0:
            out["perf/tflops"] = self.flops_per_step / step_s / 1e12
            if self.peak_tflops:
                out["perf/mfu"] = out["perf/tflops"] / self.peak_tflops
        out.update(self._collectors.snapshot())
        if self._pipeline is not None:
            out.update(self._pipeline.metrics())
        return out

    def postfix(self) -> str:
        """A short progress-bar string, e.g. ``step=412ms data=31% thru=77.6/s``."""
        recorder = self._recorder
        if not recorder.measuring or not recorder.recent:
            return f"warm-up {min(recorder.steps_seen, recorder.warmup)}/{recorder.warmup}"
        m = self.metrics()
        step_s = m["perf/step_time"]
        data_pct = 100 * m["perf/data_time"] / step_s if step_s > 0 else 0.0
        capacity = m.get("perf/train_capacity")
        if capacity is not None:
            thru = f"thru={capacity:.1f}/s"
        else:
            thru = f"thru={1 / step_s:.2f} step/s" if step_s > 0 else "thru=-"
        return f"step={step_s * 1e3:.0f}ms data={data_pct:.0f}% {thru}"

    def summary(self, drain: bool = True) -> RunSummary:
        """The RunSummary of the measured steps. With ``drain`` (the default) it reads outstanding device events,
        synchronising once if any are still in flight: call it after the loop. ``drain=False`` never waits (for
        checkpoints inside the loop): steps still in flight then lack device time."""
        try:
            if drain:  # the run is over: no next step will show that the held step's stretch recurs
                self._settle_held(recurs=False)
            harvested = self._device.drain() if drain else self._device.harvest()
            for done in harvested:
                self._recorder.add_device(done.token, done.seconds, done.span_s, done.judged_s, done.followed_s)
        except Exception as error:
            self._fail(error)
        summary = summarize(self._recorder, self._timing_used)
        summary.meta = self._meta()
        summary.wall = self._wall() if summary.steps.measured else None
        add_wall_rates(summary)
        throughput = summary.throughput
        if self.flops_per_step and throughput.step_time_ms:
            throughput.flops_per_step = self.flops_per_step
            throughput.tflops = self.flops_per_step / (throughput.step_time_ms / 1e3) / 1e12
            if self.peak_tflops:
                throughput.mfu = throughput.tflops / self.peak_tflops
        recorder = self._recorder
        try:
            summary.system = self._collectors.peek(
                steps=recorder.measured + recorder.profiled, samples=recorder.samples or None
            )
            summary.hotspots = self._collectors.hotspots(summary.phases)
        except Exception as error:
            summary.notes.append(f"the system figures could not be read ({type(error).__name__}: {error})")
        if self._device.dropped_steps:
            summary.notes.append(
                f"device time missing for {self._device.dropped_steps} step(s) whose events never completed."
            )
        summary.eval = self._eval.to_dict(wall_s=summary.wall.window_s if summary.wall else recorder.step_stats.total)
        if self._pipeline is not None:
            summary.pipeline = self._pipeline.to_summary()
        from stepscope.doctor.verdict import classify

        summary.verdict = classify(summary)  # the same rules as the CLI's: one place decides
        if self._failed:
            summary.notes.append(f"measurement stopped early after an internal error: {self._failed}")
        for calls, why in list(self._ignored.values()):
            summary.notes.append(f"ignored {calls:,} call(s) like {why}")
        note = between_note(summary)
        if note:
            summary.notes.append(note)
        return check(summary)

    def print_table(self, file: Any = None) -> None:
        """Print the per-phase table of ``summary()`` (rich on a terminal, plain text otherwise)."""
        from stepscope.report.terminal import print_summary

        print_summary(self.summary(), file=file)

    @classmethod
    def from_config(cls, config: Any, key: str = "debug.enable_perf_metrics", **kwargs: Any) -> Any:
        """A Scope switched on by ``key`` in ``config`` (a dict, a dataclass, an OmegaConf/argparse-style object;
        dotted keys go down nested levels), or ``NULL_SCOPE`` when it is false or absent. ``STEPSCOPE=1/0`` in the
        environment overrides the config. Other keyword arguments go to ``Scope``."""
        return cls(_config_flag(config, key), **kwargs)

    def close(self) -> None:
        """Stop the system sampler and close the sinks (its thread is a daemon: a scope never closed does not keep
        the process alive; sinks are closed at interpreter exit). ``summary()`` still works after it, with the
        figures up to the close."""
        self._sinks.close()
        self._log_step = _no_log
        self._on_step = _no_step
        for capture in (self._profiler, self._nsys):
            if capture is not None:
                try:
                    capture.stop()
                except Exception as error:
                    self._fail(error)
        collectors, self._collectors = self._collectors, NO_COLLECTORS
        try:
            recorder = self._recorder  # the sampler ran through the profiled steps as well
            final = collectors.stop(steps=recorder.measured + recorder.profiled, samples=recorder.samples or None)
        except Exception as error:
            self._fail(error)
            return
        self._collectors = _Closed(final, collectors.hotspots)

    # -- internals ----------------------------------------------------------------------------------------------

    def _attach(self, monitor: Any) -> None:
        """Link a PipelineMonitor: each measured step becomes one of its training steps (before the sinks write,
        so they see it), and its figures join ``metrics()`` and ``summary()``."""
        self._pipeline = monitor
        recorder, log_step = self._recorder, self._log_step

        def log(index: int) -> None:
            record = recorder.recent[-1]
            monitor._scope_step(record.step_ns, record.phases_ns, record.samples)
            log_step(index)

        self._log_step = log

    def _write_sinks(self, step: int) -> None:
        if step % self._log_every == 0:
            self._sinks.write(step, self.metrics())

    def _add(self, name: str, elapsed_ns: int) -> None:
        current = self._current
        current[name] = current.get(name, 0) + elapsed_ns
        if self._depth == 0:
            self._claimed_ns += elapsed_ns
        else:
            self._recorder.nested.add(name)

    def _close_step(self, t1: int, batch_size: int | None) -> None:
        t0 = self._step_start_ns
        self._step_start_ns = t1
        cut, self._cut_ns = self._cut_ns, 0
        side = self._side
        if side:  # a fresh list only after a step that cut a stretch out (most steps cut none)
            self._side = []
        if t0 is None:
            # The first step closed before any phase or fetch began: its start is unknown, so it is not timed.
            self._count_passes(side)
            self._recorder.steps_seen += 1
            return
        phases_ns = self._current
        other = t1 - t0 - self._claimed_ns
        phases_ns[OTHER_PHASE] = other if other > 0 else 0
        record = StepRecord(self._recorder.steps_seen, t1 - t0, phases_ns, batch_size, end_ns=t1)
        self._current = {}
        self._claimed_ns = 0
        recorder = self._recorder
        if self._on_step(recorder.steps_seen + 1):  # recorded by torch.profiler: its overhead is in the times
            self._count_passes(side)
            self._settle_held(recurs=False)
            recorder.steps_seen += 1
            recorder.profiled += 1
            recorder.series.add(record.step_ns)
            self._device.discard_step()
            self._step_start_ns = self._clock()  # the profiler's step() (a trace export) is not the next step's time
            return
        if self._held is not None and self._settle_held(recurs=bool(side)):
            _absorb(record, side)  # this step's stretch recurs too: it stays in the step
            side = []
        if recorder.add(record, hold=bool(side) and recorder.measuring):
            self._widen(t0 - cut, t1)
            device = self._device
            device.close_step(record)
            if device.pending_steps:
                for done in device.harvest():
                    recorder.add_device(done.token, done.seconds, done.span_s, done.judged_s, done.followed_s)
            if side:
                self._held = (record, side)  # validation, or step work if the next step cuts out a stretch too
            else:
                self._log_step(record.index)
        elif recorder.measuring:
            self._start_measuring()
        elif recorder.steps_seen == recorder.warmup - 1:
            self._start_sampler()  # the last warm-up step begins: what starting it costs is in no measured step

    def _settle_held(self, recurs: bool) -> bool:
        """Decide the held step's stretches now that the next step closed: when that step cut out a stretch too
        (``recurs``), work that recurs every step is step work, whatever its grad mode, and goes back into both
        steps (True); otherwise they were validation passes. Either way the held step joins the statistics."""
        if self._held is None:
            return False
        (record, passes), self._held = self._held, None
        if recurs:
            _absorb(record, passes)
        else:
            self._count_passes(passes, self._recorder.series.count)  # the held step is kept next, there
        for done in self._recorder.release():
            self._log_step(done.index)
        return recurs

    def _count_passes(self, passes: list[_Pass], step_at: int = -1) -> None:
        """The stretches cut out of the step at ``step_at`` in the series (-1: a step the series does not hold) are
        validation passes."""
        for stretch in passes:
            self._eval.add(stretch.wall_ns, stretch.phases_ns, stretch.forwards, stretch.batches, step_at)

    def _widen(self, start_ns: int, end_ns: int) -> None:
        """Stretch the measured wall window to cover ``start_ns``..``end_ns``."""
        window = self._window
        if window is None:
            self._window = [start_ns, end_ns]
        else:  # compared inline: builtins.min/max calls cost more on this per-step path
            if start_ns < window[0]:
                window[0] = start_ns
            if end_ns > window[1]:
                window[1] = end_ns

    def _wall(self) -> Wall | None:
        """Where the measured window's wall time went: training steps, validation passes, neither (s). Where the
        host ran ahead of the GPU, the GPU's time beyond the host's is in the steps and the window: the window ends
        when the GPU finished the last step, not when the host queued it."""
        if self._window is None:
            return None
        steps_s = self._recorder.paced_s
        window_s = (self._window[1] - self._window[0]) / 1e9 + self._recorder.gpu_excess_ns / 1e9
        eval_s = self._eval.durations.total
        between_s = window_s - steps_s - eval_s
        if -1e-6 < between_s < 0:  # float sums of integer nanoseconds
            between_s = 0.0
        return Wall(window_s=window_s, steps_s=steps_s, eval_s=eval_s, between_s=between_s)

    def _begin_eval(self, t0: int) -> None:
        """A validation pass begins at ``t0``: from now on phase time is the pass's, not the step's."""
        window = _EvalWindow(t0, self._current, self._claimed_ns, self._depth, self._device, self._step_start_ns)
        self._eval_window = window
        self._current, self._claimed_ns, self._depth = {}, 0, 0
        self._device = HOST_ONLY  # the pass's GPU work is not the step's: no device events for it

    def _end_eval(
        self,
        t1: int,
        keep: bool = True,
        forwards: int = 0,
        batches: int = 0,
        tentative: bool = False,
        moved: dict[str, int] | None = None,
        moved_start_ns: int | None = None,
        resumes: bool = False,
    ) -> None:
        """The pass that began at ``_begin_eval`` ends at ``t1``: the step gets its accumulators back, less the
        pass's wall time. ``keep=False``: it was training work after all (a frozen teacher's forward without
        gradients), so its phases go back into the step. ``moved`` (phase -> ns, from ``moved_start_ns`` on) is
        time added to the step before the pass began that was the pass's (its loader's first fetch): it moves into
        the pass, whose wall time then starts there. ``tentative``: a pass inferred from the script's events (not
        declared with ``phase("eval")``) counts as one only if the next step cuts out no stretch of its own; if it
        does, the work recurs every step and goes back into both steps (``_settle_held``). ``resumes``: a tentative
        pass that goes on the one cut out just before it in this step, with nothing but its own fetch between: one
        pass, not two."""
        window, self._eval_window = self._eval_window, None
        if window is None:
            return
        inside, claimed_inside = self._current, self._claimed_ns
        self._current, self._claimed_ns, self._depth, self._device = (
            window.current,
            window.claimed_ns,
            window.depth,
            window.device,
        )
        if not keep:
            for name, ns in inside.items():
                self._current[name] = self._current.get(name, 0) + ns
            self._claimed_ns += claimed_inside
            return
        start_ns = window.start_ns
        wall_ns = t1 - start_ns
        if moved and moved_start_ns is not None:
            for name, ns in moved.items():
                self._current[name] = self._current.get(name, 0) - ns
                inside[name] = inside.get(name, 0) + ns
                self._claimed_ns -= ns
                claimed_inside += ns
            # The pass takes the moved time itself, not the stretch from the first moved fetch on: the step may have
            # claimed time in that stretch (another fetch, stepscope's own), and cutting it too would leave the step
            # shorter than its phases (a loaded machine stretches the hooks there by milliseconds).
            wall_ns += sum(moved.values())
            start_ns = min(start_ns, moved_start_ns)
        if window.step_start_ns is not None:
            self._step_start_ns = window.step_start_ns + wall_ns
            self._cut_ns += wall_ns
        elif self._step_start_ns is not None:
            self._step_start_ns = None  # set inside the pass: the step begins at its first phase after it
        if not self._recorder.measuring:
            return
        self._widen(start_ns, t1)
        if tentative and resumes and self._side:
            last = self._side[-1]
            last.wall_ns += wall_ns
            for name, ns in inside.items():
                last.phases_ns[name] = last.phases_ns.get(name, 0) + ns
            last.claimed_ns += claimed_inside
            last.forwards += forwards
            last.batches += batches
        elif tentative:
            self._side.append(_Pass(wall_ns, inside, claimed_inside, forwards, batches))
        else:  # the open step's place: after the held step's, if one waits
            step_at = self._recorder.series.count + (self._held is not None)
            self._eval.add(wall_ns, inside, forwards, batches, step_at)

    def _capture(self, profile: ProfileWindow | None, nvtx: bool, nsys_window: NsysWindow | str | None) -> None:
        """Set up the profiler window, phase ranges and Nsight window; each is absent (a no-op) unless asked for."""
        self._profiler: Profiler | None = Profiler(profile) if profile is not None else None
        self._nsys: NsysRange | None = None
        if nsys_window is not None:
            window = NsysWindow.parse(nsys_window) if isinstance(nsys_window, str) else nsys_window
            self._nsys = NsysRange(window)
            self._nsys.at_step(0)
        self._ranges: Ranges | NoRanges = NO_RANGES
        if profile is not None or nvtx:
            self._ranges = Ranges(record_function=profile is not None, nvtx=nvtx)
            self._phase_type = _MarkedHostPhase
            self._iterable_type = _MarkedIterable
        self._on_step = self._nsys.at_step if self._nsys is not None else _no_step

    def _start_profiler(self) -> None:
        profiler = self._profiler
        assert profiler is not None
        profiler.start(self._recorder.steps_seen)
        nsys = self._nsys

        def on_step(step: int) -> bool:
            if nsys is not None:
                nsys.at_step(step)
            return profiler.step()

        self._on_step = on_step

    def _start_measuring(self) -> None:
        """Pick device timing when the first measured step begins: by then the model is where it will run."""
        use_cuda = self._timing == "cuda" or (self._timing == "auto" and (self._events is not None or cuda_in_use()))
        if use_cuda:
            self._device = DeviceTimer(self._events or CudaEvents(), clock=self._clock)
            self._timing_used = "cuda"
            self._phase_type = _MarkedCudaPhase if self._phase_type is _MarkedHostPhase else _CudaPhase
            self._phases = {}
        if self._profiler is not None:
            self._start_profiler()
        if self._collectors is NO_COLLECTORS:
            self._start_sampler()  # no warm-up step was left to start it in

    def _start_sampler(self) -> None:
        """Start the system sampler, as the last warm-up step begins (or, with fewer than two warm-up steps, as
        measuring begins): a thread start, and NVML's on a GPU machine, cost up to tens of ms, which a measured step
        must not carry. Nothing is subtracted from any step: a step's time is what a timer in the script reads."""
        if self._system_interval_s is not None:
            from stepscope.collectors import start_collectors

            devices = [sys.modules["torch"].cuda.current_device()] if cuda_in_use() else []
            self._collectors = start_collectors(
                self._system_interval_s, devices=devices, stack_sample_hz=self._stack_sample_hz, phase_of=self._phase_of
            )
            # A scope dropped without close() must not leave its sampler running (the thread holds no reference
            # to the scope, so the scope can be collected).
            weakref.finalize(self, self._collectors.stop)

    def _phase_at(self, frame: Any) -> str | None:
        """The phase open while the training thread runs ``frame`` (read by the stack sampler's thread): data_wait
        inside a timed fetch, else the innermost open phase (the one begun last), else other. Read from the
        phases' own start stacks, so the loop pays nothing for it."""
        if self._failed:
            return None
        while frame is not None:
            if frame.f_code in _FETCH_CODES:
                return DATA_PHASE
            frame = frame.f_back
        latest, name = -1, OTHER_PHASE
        for phase in list(self._phases.values()):
            starts = phase._starts
            if starts:
                try:
                    if starts[-1] > latest:
                        latest, name = starts[-1], phase._name
                except IndexError:  # closed on the training thread meanwhile
                    continue
        return name

    def _claim(self, call: str) -> bool:
        """On a thread other than the scope's (the slow path): the first thread to use the scope becomes its
        thread (True); any other one is refused (False), with one warning."""
        thread = get_ident()
        if self._thread is None or not self._one_thread:
            self._thread = thread
            return True
        if thread == self._thread:
            return True
        self._ignore(
            "thread",
            f"scope.{call}() on a thread other than the one the scope times: a Scope records one training loop, and "
            "phases from two threads would overlap and be counted twice (use one Scope per thread)",
        )
        return False

    def _checked_batch(self, batch_size: Any) -> float | None:
        """``batch_size`` as a sample count, or None (with one warning) when it is not a finite number >= 0."""
        number = isinstance(batch_size, numbers.Real) and not isinstance(batch_size, bool)
        if number and math.isfinite(batch_size) and batch_size >= 0:
            return int(batch_size) if isinstance(batch_size, numbers.Integral) else float(batch_size)
        self._ignore(
            "batch_size",
            f"scope.step(batch_size={batch_size!r:.40}): a batch size is a finite number of samples >= 0, so the "
            "step counts without samples",
        )
        return None

    def _ignore(self, kind: str, why: str) -> None:
        """Count an ignored call of ``kind``; warn (saying ``why``) the first time."""
        seen = self._ignored.get(kind)
        if seen is None:
            log.warning("stepscope: ignored %s.", why)
            self._ignored[kind] = [1, why]
        else:
            seen[0] += 1

    def _fail(self, error: BaseException) -> None:
        """Stop measuring after an internal error; the training loop must go on."""
        if self._failed is None:
            self._failed = f"{type(error).__name__}: {error}"
            log.warning("stepscope stopped measuring after an internal error (%s); training continues.", self._failed)
        self._device = HOST_ONLY
        self.phase = NULL_SCOPE.phase  # type: ignore[method-assign]
        self.data = NULL_SCOPE.data  # type: ignore[method-assign]
        self.step = NULL_SCOPE.step  # type: ignore[method-assign]

    def _meta(self) -> Meta:
        from stepscope import __version__

        torch = sys.modules.get("torch")
        return Meta(
            stepscope_version=__version__,
            torch_version=getattr(torch, "__version__", None),
            device=_device_name(self._timing_used),
            timing=self._timing_used,
            started_at=self._started_at,
            command=" ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv and sys.argv[0] else "",
            hostname=socket.gethostname(),
            python_version=platform.python_version(),
        )


def _no_log(step: int) -> None:
    return None


def _no_step(step: int) -> bool:
    return False


def _config_flag(config: Any, key: str) -> bool:
    """The boolean at dotted ``key`` in a nested dict / attribute config; False when any level is missing."""
    value = config
    for part in key.split("."):
        if isinstance(value, dict) or (hasattr(value, "get") and not hasattr(value, part)):
            value = value.get(part)
        else:
            value = getattr(value, part, None)
        if value is None:
            return False
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


class _Closed:
    """The sampler's final figures, after ``Scope.close()``."""

    def __init__(self, system: dict[str, Any], hotspots: Any = NO_COLLECTORS.hotspots) -> None:
        self._system = system
        self.hotspots = hotspots

    def peek(self, steps: int | None = None, samples: int | None = None) -> dict[str, Any]:
        return self._system

    stop = peek

    def snapshot(self) -> dict[str, float]:
        return {}


# Every enabled Scope of this process, for `stepscope run` to say what a script's own Scope timed (``script_scopes``).
_SCOPES: weakref.WeakSet[Scope] = weakref.WeakSet()


def script_scopes(own: Scope) -> list[Scope]:
    """The live Scopes of this process other than ``own`` (the one `stepscope run` drives): the script's own."""
    return [scope for scope in list(_SCOPES) if scope is not own]


def own_scope_note(scope: Scope) -> str:
    """Why a script's own Scope's phases and batch sizes are not in `stepscope run`'s figures, naming them."""
    names = [name for name in scope._phases if name != EVAL_PHASE]
    timed = f"phase(s) {', '.join(repr(n) for n in names[:6])}" if names else "no phase"
    return (
        f"the script's own Scope timed {timed} over {scope._recorder.steps_seen} step(s) of its own: under "
        "`stepscope run` they stay in that Scope's summary(), not in these figures, which time the step from "
        "torch's hooks (the work inside those phases is here in forward, backward, optimizer or other). Run the "
        "script without `stepscope run` to see them in its own summary."
    )


def enabled_scope(**kwargs: Any) -> Scope:
    """An enabled Scope whatever ``STEPSCOPE`` says: the one ``stepscope run`` builds for a script it was asked to
    measure (the variable still governs any Scope the script makes itself). Its phases and steps count from any
    thread: hooks drive it, and the tracker decides which thread's events are the loop's."""
    scope = object.__new__(Scope)
    scope.__init__(**kwargs)
    scope._one_thread = False
    scope.phase = scope._phase_any_thread  # type: ignore[method-assign]
    scope.step = scope._step_any_thread  # type: ignore[method-assign]
    return scope


def _import_host_collector() -> None:
    """Import the host collector (psutil: ~10 ms) as the Scope is built, not inside a step: with fewer than two
    warm-up steps the sampler starts inside the first measured step, and nothing is subtracted from it."""
    with contextlib.suppress(ImportError):  # start_collectors says which figures are missing and why
        import stepscope.collectors.host  # noqa: F401


def _device_name(timing: str) -> str:
    if timing != "cuda":
        return "cpu"
    torch = sys.modules.get("torch")
    try:
        index = torch.cuda.current_device()  # type: ignore[union-attr]
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"  # type: ignore[union-attr]
    except Exception:
        return "cuda"
