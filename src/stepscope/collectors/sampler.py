"""Collectors: one background thread that samples its sources at a fixed rate and folds the readings.

The training thread touches the collectors only through ``snapshot()`` (a lock-free read of the latest readings)
and ``stop()``. Each sample reads every source outside the lock, then folds the flat readings into streaming
statistics and the bounded timeline under it, so memory stays bounded however long the run. A source that raises
is dropped with a note and the others go on; nothing raised in the thread reaches the training loop.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from stepscope.collectors.memory import device_memory
from stepscope.collectors.signals import derive_signals
from stepscope.collectors.stacks import NO_STACKS, NoStacks, StackSampler, hotspots
from stepscope.collectors.stats import KeyStats, Stats, copy_stats, fold
from stepscope.collectors.timeline import Timeline

log = logging.getLogger("stepscope")

MIN_INTERVAL_S = 0.05  # 20 Hz: faster sampling costs more than it tells about a training step
TIMELINE_POINTS = 300
STOP_WAIT_S = 2.0  # beyond one interval, for a final sample stuck in a driver call
# The first second is sampled at least this often: the signals need 3 samples, and a doctor run of 40 short steps
# lasts under half a second (at 4 Hz it had 1 sample and no contention, transform- or IO-bound signal at all).
FAST_START_S = 1.0
FAST_INTERVAL_S = 0.1

# timeline series name -> the snapshot reading it follows
TIMELINE_SERIES = {
    "cpu_util_pct": "sys/cpu_util",
    "workers_cpu_util_pct": "sys/workers_cpu_util",
    "gpu_util_pct": "sys/gpu_util",
    "sm_clock_ratio": "sys/sm_clock_ratio",
    "power_w": "sys/power_w",
}


# stats, samples, duration (s), timeline, device memory: what a system dict is built from
_Frozen = tuple[dict[str, KeyStats], int, float, dict[str, list[Any]], dict[str, Any]]


class Source(Protocol):
    """One kind of reading. ``read`` returns flat readings: ``sys/...`` names go to ``snapshot()`` as well."""

    name: str  # its section of the system dict: "host", "gpu"
    notes: list[str]

    def start(self, now_s: float) -> None: ...  # baselines for the first interval
    def read(self, now_s: float) -> dict[str, float]: ...
    def section(self, stats: Stats) -> dict[str, Any]: ...
    def close(self) -> None: ...


def check_interval(interval_s: float) -> float:
    """``interval_s`` as a float; ValueError unless 0.05 s (20 Hz) <= interval_s < infinity."""
    interval = float(interval_s)
    if not math.isfinite(interval) or interval <= 0:
        raise ValueError(f"interval_s must be a positive number of seconds, got {interval_s!r}")
    if interval < MIN_INTERVAL_S:
        raise ValueError(
            f"interval_s={interval_s!r} samples at {1 / interval:.0f} Hz; the collectors sample at most at "
            f"{1 / MIN_INTERVAL_S:.0f} Hz (interval_s >= {MIN_INTERVAL_S})"
        )
    return interval


class Collectors:
    """Samples ``sources`` every ``interval_s`` seconds on one daemon thread, once ``start()`` is called.

    Args:
        sources: the readers (host, GPU); one that raises in ``start`` is left out with a note.
        interval_s: seconds between samples, >= 0.05 (20 Hz).
        devices: CUDA indices in use, for the device-memory figures read at ``stop``.
        sections: system-dict sections to report when no source fills them (e.g. an unavailable GPU).
        notes: notes from setting up, carried into the system dict.
        stacks: the training thread's stack sampler (collectors/stacks.py), started and stopped with the others;
            its figures are ``hotspots()``, not part of the system dict.
        clock: monotonic seconds (a seam for tests, which call ``sample()`` themselves instead of starting).
    """

    def __init__(
        self,
        sources: Sequence[Source],
        interval_s: float = 1.0,
        devices: Sequence[int] = (),
        sections: dict[str, dict[str, Any]] | None = None,
        notes: Sequence[str] = (),
        clock: Callable[[], float] = time.monotonic,
        stacks: StackSampler | NoStacks = NO_STACKS,
    ) -> None:
        self.interval_s = check_interval(interval_s)
        self._stacks = stacks
        self._devices = list(devices)
        self._sections = dict(sections or {})
        self._notes = list(notes)
        self._clock = clock
        # Re-entrant: a stop from inside a sample (a dropped Scope's finalizer, run by a collection that an allocation
        # in the fold set off) takes the figures on the thread that holds it (_finish)
        self._lock = threading.RLock()
        self._stop_lock = threading.Lock()  # two threads may call stop() at once (the loop's end and an atexit hook)
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._stats: dict[str, KeyStats] = {}
        self._timeline = Timeline(tuple(TIMELINE_SERIES), TIMELINE_POINTS)
        self._latest: dict[str, float] = {}
        self._samples = 0
        self._t0 = clock()
        self._t_last = self._t0
        self._frozen: _Frozen | None = None  # the figures taken at stop()
        self._sources: list[Source] = []
        self._dropped: list[Source] = []
        for source in sources:
            try:
                source.start(self._t0)
                self._sources.append(source)
            except Exception as error:
                self._notes.append(f"the {source.name} collector could not start ({type(error).__name__}: {error}).")
                _close(source)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> Collectors:
        """Start the sampling thread (a daemon: it never keeps the process alive)."""
        if self._thread is None and self._frozen is None:
            self._thread = threading.Thread(target=self._run, name="stepscope-collectors", daemon=True)
            self._thread.start()
            self._stacks.start()
        return self

    def sample(self) -> None:
        """Take one sample now: what the thread does every interval (tests with a fake clock call it directly)."""
        now = self._clock()
        readings: dict[str, float] = {}
        for source in list(self._sources):
            try:
                readings.update(source.read(now))
            except Exception as error:
                self._drop(source, now, error)
        values = [readings.get(key) for key in TIMELINE_SERIES.values()]
        with self._lock:
            if self._frozen is not None:
                return  # stop() gave up waiting for this sample: the summary is already taken
            fold(self._stats, readings)
            self._timeline.add(now - self._t0, values)
            self._samples += 1
            self._t_last = now
        self._latest = {key: value for key, value in readings.items() if key.startswith("sys/")}

    def snapshot(self) -> dict[str, float]:
        """The latest readings for per-step sinks: ``sys/cpu_util`` and ``sys/workers_cpu_util`` (% of one core),
        ``sys/system_cpu_util`` (% of all cores), ``sys/rss_mb`` (process tree), ``sys/mem_available_mb``,
        ``sys/gpu_util`` (%), ``sys/sm_clock_ratio`` (0..1), ``sys/power_w`` (W, summed over devices),
        ``sys/gpu_mem_used_mb``, ``sys/gpu_temp_c``; a key is absent when it is not measured. Never blocks."""
        return dict(self._latest)

    def peek(self, steps: int | None = None, samples: int | None = None) -> dict[str, Any]:
        """The system dict of the samples so far, while sampling goes on (for checkpoints written mid-run)."""
        try:
            if self._frozen is not None:
                return self._build(self._frozen, steps, samples)
            return self._build(self._take(), steps, samples)
        except Exception as error:
            return self._failed(error)

    def stop(self, steps: int | None = None, samples: int | None = None) -> dict[str, Any]:
        """Stop sampling (joins the thread, waiting at most one interval + 2 s) and return the system dict.

        ``steps`` and ``samples`` (training samples, not readings) done while the collectors ran give energy per
        step and per sample. Idempotent: later calls return the same figures (energy divided by their arguments).
        """
        try:
            with self._stop_lock:
                if self._frozen is None:
                    self._finish()
            assert self._frozen is not None
            return self._build(self._frozen, steps, samples)
        except Exception as error:
            return self._failed(error)

    def hotspots(self, phases: dict[str, Any]) -> dict[str, Any]:
        """The summary's ``hotspots`` from the stack samples so far and the run's ``phases`` ({} when off)."""
        try:
            return hotspots(self._stacks.table(), phases)
        except Exception as error:
            log.warning("stepscope: the stack samples could not be read (%s: %s).", type(error).__name__, error)
            return {}

    # -- internals ----------------------------------------------------------------------------------------------

    def _interval_at(self, now: float) -> float:
        """Seconds to the next sample: ``FAST_INTERVAL_S`` at most during the first ``FAST_START_S``."""
        if now - self._t0 < FAST_START_S:
            return min(self.interval_s, FAST_INTERVAL_S)
        return self.interval_s

    def _run(self) -> None:
        try:
            interval = self.interval_s
            next_t = self._t0 + self._interval_at(self._t0)
            while not self._stop_event.wait(max(0.0, next_t - self._clock())):
                self.sample()
                next_t += self._interval_at(next_t)
                now = self._clock()
                if next_t < now:  # fell behind (a suspended process, a slow driver call): do not catch up in a burst
                    next_t = now + self._interval_at(now)
            if self._frozen is not None:  # stopped from inside a sample (_finish): nobody else closes the sources
                for source in self._sources:
                    _close(source)
            elif self._clock() - self._t_last >= interval / 4:
                self.sample()  # the last partial interval: short runs would otherwise lose most of their figures
        except Exception as error:
            self._notes.append(f"the sampler stopped after an error ({type(error).__name__}: {error}).")
            log.warning("stepscope: the system sampler stopped (%s); training continues.", error)

    def _drop(self, source: Source, now: float, error: Exception) -> None:
        self._sources.remove(source)
        self._dropped.append(source)
        self._notes.append(
            f"the {source.name} collector stopped at {now - self._t0:.1f} s after an error "
            f"({type(error).__name__}: {error}); its figures cover the samples before."
        )
        _close(source)

    def _finish(self) -> None:
        self._stop_event.set()
        self._stacks.stop()
        thread = self._thread
        if thread is threading.current_thread():
            # Stopped from inside a sample: a Scope dropped without close() is collected by whichever thread's
            # allocation runs the garbage collector, and its finalizer stops its sampler, here. The thread ends once
            # this sample returns, and closes the sources itself (_run).
            self._frozen = self._take()
            return
        if thread is not None:
            thread.join(self.interval_s + STOP_WAIT_S)
            if thread.is_alive():
                self._notes.append(
                    f"the sampler did not stop within {self.interval_s + STOP_WAIT_S:.1f} s; "
                    "figures end at its last complete sample."
                )
        self._frozen = self._take()
        if thread is None or not thread.is_alive():  # a thread stuck in a driver call may still use its sources
            for source in self._sources:
                _close(source)

    def _take(self) -> _Frozen:
        """A consistent copy of the figures so far, and device memory read now."""
        with self._lock:
            taken = copy_stats(self._stats), self._samples, self._t_last - self._t0, self._timeline.as_dict()
        return (*taken, self._memory())

    def _failed(self, error: Exception) -> dict[str, Any]:
        # A bug here must not break the user's run either.
        log.warning("stepscope: the system collectors failed (%s: %s).", type(error).__name__, error)
        return {"interval_s": self.interval_s, "samples": 0, "notes": [f"the collectors failed: {error}"]}

    def _memory(self) -> dict[str, Any]:
        try:
            return device_memory(self._devices)
        except Exception as error:
            self._notes.append(f"device memory could not be read ({type(error).__name__}: {error}).")
            return {}

    def _build(self, frozen: _Frozen, steps: int | None, samples: int | None) -> dict[str, Any]:
        stats, n, duration, timeline, memory = frozen
        system: dict[str, Any] = {
            "interval_s": self.interval_s,
            "samples": n,
            "duration_s": round(duration, 3),
            "host": {},
            "gpu": {"available": False, "reason": None, "devices": []},
            **self._sections,
        }
        notes = list(self._notes)
        for source in self._sources + self._dropped:
            system[source.name] = source.section(stats)
            notes += source.notes
        system["memory"] = memory
        system["energy"] = _energy(system["gpu"], steps, samples)
        system["timeline"] = timeline
        system["signals"] = derive_signals(system)
        system["notes"] = notes
        return system


def _energy(gpu: dict[str, Any], steps: int | None, samples: int | None) -> dict[str, Any]:
    """Total GPU energy (J) and per step / per sample, when every device's energy is known; {} otherwise."""
    devices = gpu.get("devices") or []
    energies = [d.get("energy_j") for d in devices]
    if not devices or None in energies:
        return {}
    total = float(sum(energies))  # type: ignore[arg-type]
    return {
        "total_j": round(total, 1),
        "per_step_j": round(total / steps, 3) if steps else None,
        "per_sample_j": round(total / samples, 4) if samples else None,
    }


def _close(source: Source) -> None:
    try:
        source.close()
    except Exception as error:
        log.debug("stepscope: closing the %s collector failed: %s", source.name, error)
