"""Ray adapter: engines as Ray actors, timed inside the actor, reported to a PipelineMonitor in batches.

``RayReporter(monitor)`` starts one small collector actor. ``reporter.timed(EngineClass, "generate")`` returns a
subclass whose ``generate`` is timed inside the actor (the engine's own time, without Ray's queueing or transfer);
each actor buffers its timings and pushes them to the collector every ``flush_s`` seconds in one fire-and-forget
call, so no engine call waits on a round trip. The reporter's thread drains the collector every ``poll_s`` seconds
into ``monitor.record_infer`` with each call's age, so late reports land in the right part of the window. A
report's time in transit (seconds when Ray's processes are short of CPU) is read from the wall clocks at both ends,
which are one clock on one machine and agree within milliseconds across synchronised machines. A pool
that is a Ray queue (or anything with ``qsize()``) is read on the same beat as ``monitor.pool_level``.

Ray is an optional extra (``pip install 'stepscope[ray]'``). stepscope's failures here never stop the pipeline: a
collector that cannot be reached loses timings (said once in the log), the engine call itself goes on.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from stepscope.pipeline.monitor import PipelineMonitor

log = logging.getLogger("stepscope")

Record = tuple[float, float, bool, float]  # (engine s, samples, ok, end time on the sender's monotonic clock)

# A report longer in transit than this is taken for a wall clock set apart from the sender's, and counted as instant.
TRANSIT_MAX_S = 60.0


def _transit_s(sent_wall: float) -> float:
    """Seconds since ``sent_wall`` (the sender's ``time.time()``), or 0 when the clocks disagree past belief."""
    transit_s = time.time() - sent_wall
    return transit_s if 0.0 <= transit_s <= TRANSIT_MAX_S else 0.0


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError("stepscope.pipeline.ray needs Ray: pip install 'stepscope[ray]'") from None
    return ray


class _Collector:
    """The actor engines report to: it keeps what arrived, stamped on its own clock, until the reporter drains it."""

    def __init__(self) -> None:
        self._records: list[Record] = []

    def report(self, records: list[Record], sent_at: float, sent_wall: float) -> None:
        # Ages measured on the sender's monotonic clock, moved onto this one, plus the time the report took to come.
        arrived = time.monotonic() - _transit_s(sent_wall)
        self._records += [(seconds, samples, ok, arrived - (sent_at - end)) for seconds, samples, ok, end in records]

    def drain(self) -> tuple[list[Record], float]:
        """Records since the last drain, with the age (s) of each call's end instead of its time, and the wall
        time (``time.time()``) the ages were taken at."""
        now = time.monotonic()
        out = [(seconds, samples, ok, now - end) for seconds, samples, ok, end in self._records]
        self._records = []
        return out, time.time()


class _Outbox:
    """Inside an engine actor: timings buffered and pushed to the collector every ``flush_s`` seconds."""

    def __init__(self, collector_name: str, namespace: str | None, flush_s: float) -> None:
        self._collector_name = collector_name
        self._namespace = namespace
        self._flush_s = flush_s
        self._lock = threading.Lock()
        self._records: list[Record] = []
        self._collector: Any = None
        self._failed = False
        threading.Thread(target=self._run, name="stepscope-ray-outbox", daemon=True).start()

    def add(self, seconds: float, samples: float, ok: bool) -> None:
        with self._lock:
            self._records.append((seconds, samples, ok, time.monotonic()))

    def _run(self) -> None:
        while True:
            time.sleep(self._flush_s)
            self.flush()

    def flush(self) -> None:
        with self._lock:
            records, self._records = self._records, []
        if not records or self._failed:
            return
        try:
            if self._collector is None:
                self._collector = _ray().get_actor(self._collector_name, namespace=self._namespace)
            self._collector.report.remote(records, time.monotonic(), time.time())
        except Exception as error:  # the engine must go on: only the timings are lost
            self._failed = True
            log.warning("stepscope: engine timings cannot reach the pipeline monitor (%s); they are dropped.", error)


def _count(result: Any) -> float:
    try:
        return float(len(result))
    except TypeError:
        return 0.0


def _timed_method(method: Callable[..., Any], samples: Callable[[Any], float], outbox: Callable[[Any], _Outbox]) -> Any:
    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def timed_async(self: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                result = await method(self, *args, **kwargs)
            except BaseException:
                outbox(self).add(time.perf_counter() - t0, 0.0, False)
                raise
            outbox(self).add(time.perf_counter() - t0, samples(result), True)
            return result

        return timed_async

    @functools.wraps(method)
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            result = method(self, *args, **kwargs)
        except BaseException:
            outbox(self).add(time.perf_counter() - t0, 0.0, False)
            raise
        outbox(self).add(time.perf_counter() - t0, samples(result), True)
        return result

    return timed


class RayReporter:
    """Carries engine-call timings from Ray actors to ``monitor``; see the module docstring.

    ``pool``: a ``ray.util.queue.Queue`` (or any object with ``qsize()``) read every ``poll_s`` seconds as the
    pool's size. ``engines_fill_pool``: the engines put their own results into the pool, so each successful call's
    samples also count as entering it (``pool_put``); leave it False when the driver puts results in and calls
    ``monitor.pool_put`` itself.
    """

    def __init__(
        self,
        monitor: PipelineMonitor,
        pool: Any = None,
        engines_fill_pool: bool = False,
        poll_s: float = 0.5,
        flush_s: float = 0.5,
    ) -> None:
        ray = _ray()
        if not ray.is_initialized():
            raise RuntimeError("RayReporter needs a running Ray: call ray.init() first.")
        if poll_s <= 0 or flush_s <= 0:
            raise ValueError(f"poll_s and flush_s must be positive seconds, got {poll_s} and {flush_s}")
        self.monitor = monitor
        self.pool = pool
        self.engines_fill_pool = engines_fill_pool
        self.flush_s = flush_s
        self._poll_s = poll_s
        self.name = f"stepscope-pipeline-{uuid.uuid4().hex[:12]}"
        self.namespace = ray.get_runtime_context().namespace
        self._collector = ray.remote(num_cpus=0)(_Collector).options(name=self.name).remote()
        self._stop = threading.Event()
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="stepscope-ray-reporter", daemon=True)
        self._thread.start()

    def timed(self, engine: type, method: str = "generate", samples: Callable[[Any], float] = _count) -> type:
        """A subclass of ``engine`` (a plain class: apply ``ray.remote`` to the result) whose ``method`` is timed
        inside the actor. ``samples(result)`` counts the samples a call produced (default ``len(result)``)."""
        if not isinstance(engine, type):
            raise TypeError(
                f"RayReporter.timed takes the engine's plain class, got {type(engine).__name__}: pass the class "
                "before @ray.remote and apply ray.remote to what timed() returns."
            )
        original = getattr(engine, method, None)
        if not callable(original):
            raise AttributeError(f"{engine.__name__} has no method {method!r} to time.")
        name, namespace, flush_s = self.name, self.namespace, self.flush_s

        def outbox(instance: Any) -> _Outbox:
            box = instance.__dict__.get("_stepscope_outbox")
            if box is None:
                box = instance.__dict__["_stepscope_outbox"] = _Outbox(name, namespace, flush_s)
            return box

        return type(engine.__name__, (engine,), {method: _timed_method(original, samples, outbox)})

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            self.poll()

    def poll(self) -> None:
        """Move the collected timings (and the pool's size) into the monitor now."""
        if self._failed:
            return
        ray = _ray()
        try:
            records, drained_wall = ray.get(self._collector.drain.remote(), timeout=30)
            transit_s = _transit_s(drained_wall)
            monitor = self.monitor
            for seconds, samples, ok, age_s in records:
                monitor.record_infer(seconds, samples, ok, ended_ago_s=age_s + transit_s)
                if ok and self.engines_fill_pool:
                    monitor.pool_put(samples)
            if self.pool is not None:
                monitor.pool_level(self.pool.qsize())
        except Exception as error:  # never the pipeline's problem: stop reporting, say so once
            self._failed = True
            log.warning("stepscope: the Ray pipeline reporter stopped (%s: %s).", type(error).__name__, error)

    def close(self) -> None:
        """Stop polling after a last drain (the engines' last ``flush_s`` of timings may not have arrived: wait
        that long after the last call to have them), then remove the collector actor."""
        self._stop.set()
        self._thread.join()
        self.poll()
        try:
            _ray().kill(self._collector)
        except Exception as error:
            log.debug("stepscope: could not remove the collector actor: %s", error)
