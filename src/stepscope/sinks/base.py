"""The Sink protocol and the fan-out that keeps one failing sink from touching the others or the training run."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Iterable
from typing import Protocol

log = logging.getLogger("stepscope")


class Sink(Protocol):
    """A destination for per-step metrics: ``write`` for each logged step, ``close`` once at the end."""

    def write(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class Background:
    """A sink written from its own thread, so that a slow or unreachable server never stalls a training step.

    Writes queue up (at most ``capacity`` steps; beyond that the newest are counted and dropped); an error in the
    thread is raised by the next ``write``, so `SinkSet` drops the sink as it would an inline one. ``close`` waits
    up to ``close_timeout_s`` for the queue to empty.
    """

    def __init__(self, sink: Sink, capacity: int = 1000, close_timeout_s: float = 30.0) -> None:
        self.sink = sink
        self.error: Exception | None = None
        self.overflow = 0  # steps dropped because the queue was full
        self._queue: queue.Queue[tuple[int, dict[str, float]] | None] = queue.Queue(capacity)
        self._close_timeout_s = close_timeout_s
        self._thread = threading.Thread(target=self._run, name=f"stepscope-{type(sink).__name__}", daemon=True)
        self._thread.start()

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Queue the step's metrics; raises the error the writer thread met, if any."""
        if self.error is not None:
            raise self.error
        try:
            self._queue.put_nowait((step, dict(metrics)))
        except queue.Full:
            self.overflow += 1

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if self.error is None:
                try:
                    self.sink.write(*item)
                except Exception as error:  # reported by the next write, from the training thread
                    self.error = error

    def close(self) -> None:
        """Let the queued steps be written (up to the timeout), then close the sink."""
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=self._close_timeout_s)
        self._thread.join(self._close_timeout_s)
        name = type(self.sink).__name__
        if self._thread.is_alive():
            log.warning(
                "stepscope: the %s sink was still writing after %.0f s; left behind.", name, self._close_timeout_s
            )
            return
        if self.overflow:
            log.warning("stepscope: the %s sink fell behind; %d step(s) were not logged.", name, self.overflow)
        self.sink.close()
        if self.error is not None:
            raise self.error


class SinkSet:
    """Several sinks written in turn. A sink that raises is named in one warning and dropped; the rest go on."""

    def __init__(self, sinks: Iterable[Sink]) -> None:
        # sinks that talk to a server (``background = True``) write from a thread of their own
        self._sinks: list[Sink] = [Background(s) if getattr(s, "background", False) else s for s in sinks]
        self.dropped: list[str] = []  # "JsonlSink: OSError: [Errno 28] No space left on device", one per sink

    def __bool__(self) -> bool:
        return bool(self._sinks)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Write ``metrics`` of ``step`` to every sink still alive."""
        for sink in list(self._sinks):
            try:
                sink.write(step, metrics)
            except Exception as error:
                self._drop(sink, error)

    def close(self) -> None:
        """Close every sink (each once); errors are reported, not raised."""
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            try:
                sink.close()
            except Exception as error:
                self._report(sink, error, "could not be closed")

    def _drop(self, sink: Sink, error: Exception) -> None:
        self._sinks.remove(sink)
        self._report(sink, error, "failed and is dropped; training continues and the other sinks keep logging")
        with contextlib.suppress(Exception):  # already reported as failing
            sink.close()

    def _report(self, sink: Sink, error: Exception, what: str) -> None:
        name = type(getattr(sink, "sink", sink)).__name__
        self.dropped.append(f"{name}: {type(error).__name__}: {error}")
        log.warning("stepscope: the %s sink %s (%s: %s).", name, what, type(error).__name__, error)


NO_SINKS = SinkSet([])
