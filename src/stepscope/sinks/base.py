"""The Sink protocol and the fan-out that keeps one failing sink from touching the others or the training run."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import Protocol

log = logging.getLogger("stepscope")


class Sink(Protocol):
    """A destination for per-step metrics: ``write`` for each logged step, ``close`` once at the end."""

    def write(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class SinkSet:
    """Several sinks written in turn. A sink that raises is named in one warning and dropped; the rest go on."""

    def __init__(self, sinks: Iterable[Sink]) -> None:
        self._sinks = list(sinks)
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
        name = type(sink).__name__
        self.dropped.append(f"{name}: {type(error).__name__}: {error}")
        log.warning("stepscope: the %s sink %s (%s: %s).", name, what, type(error).__name__, error)


NO_SINKS = SinkSet([])
