"""Host and device clocks.

Host work is timed with ``time.perf_counter_ns``. GPU work is timed with pairs of device events recorded on the
current stream around a phase; an event pair is read only once ``query()`` says the GPU has passed both, so
timing never waits on the device. Steps whose events are still in flight stay pending and are harvested at a
later step. The event source is a seam: ``CudaEvents`` in real runs, a fake in the CPU unit tests.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

Clock = Callable[[], int]
"""A monotonic clock returning nanoseconds."""

now_ns: Clock = time.perf_counter_ns


class DeviceEvent(Protocol):
    """The subset of ``torch.cuda.Event`` that device timing uses."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end: Any) -> float: ...  # milliseconds, as torch reports it


class EventSource(Protocol):
    """Makes device events, records them on the current stream, and can wait for the device once (outside the
    training loop)."""

    def new_event(self) -> DeviceEvent: ...

    def record(self, event: DeviceEvent) -> None: ...

    def synchronize(self) -> None: ...

    # True while every event so far was recorded on one stream, whose work completes in order: a step is then
    # complete once its last event is. An EventSource without it is asked about every event.
    single_stream: bool


class CudaEvents:
    """Timing events recorded on the current CUDA stream.

    ``Event.record()`` looks the stream up through ``torch.cuda.current_stream()``, which builds a new Python
    ``Stream`` per call (7.7 us of a 11 us record on an H100 host). Here the current stream is read with torch's
    C getters (~0.4 us) and its ``Stream`` object cached, so a record costs the driver call alone; if those
    getters are missing in some torch version, the public path is used.
    """

    def __init__(self) -> None:
        import torch

        self._torch = torch
        c = torch._C
        try:
            self._get_device = c._cuda_getDevice
            self._get_stream = c._cuda_getCurrentStream
            self._record = c._CudaEventBase.record
            self._fast = True
        except AttributeError:
            self._fast = False
        self._streams: dict[Any, Any] = {}

    @property
    def single_stream(self) -> bool:
        return self._fast and len(self._streams) <= 1  # the public path does not say which stream it used

    def new_event(self) -> DeviceEvent:
        return self._torch.cuda.Event(enable_timing=True)

    def record(self, event: DeviceEvent) -> None:
        if not self._fast:
            event.record()
            return
        key = self._get_stream(self._get_device())  # (stream_id, device_index, device_type)
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = self._torch.cuda.Stream(
                stream_id=key[0], device_index=key[1], device_type=key[2]
            )
        self._record(event, stream)

    def synchronize(self) -> None:
        self._torch.cuda.synchronize()


def cuda_available() -> bool:
    """True when torch can use a CUDA device here (imports torch; False on any error: no driver, a broken build)."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def cuda_in_use() -> bool:
    """True when this process has already initialised CUDA (a model or tensor is on a GPU).

    Checked without importing torch, so that a script that never touched torch pays nothing.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_available() and torch.cuda.is_initialized())
    except Exception:
        return False


Interval = tuple[str, DeviceEvent, DeviceEvent, int]  # (phase, start, end, when the host recorded the end: ns)

# A phase whose GPU work was done within this long of the host ending it: the GPU only followed the host there. Its
# span between events is then the host's time (an idle GPU waits between them), not work a faster GPU would cut.
FOLLOW_NS = 100_000
PROBE_EVERY = 4  # steps between two probed ones: a probe reads one more elapsed time per phase (~2-4 us each)
SYNC_PHASE = "sync"  # a host-device sync: once it returns, the GPU has done all the work queued before it


class Harvested(NamedTuple):
    """One step's device time, read once its events completed."""

    token: Any  # what ``close_step`` was given (the step's record)
    seconds: dict[str, float]  # device time per phase, s
    span_s: float  # from the step's first event to its last on the device's timeline: the GPU's time for the step
    # For a probed step (see DeviceTimer): device time per phase (s) of the phases whose lag behind the host at their
    # end was known, and of those in which the GPU only followed the host. None for a step not probed.
    judged_s: dict[str, float] | None = None
    followed_s: dict[str, float] | None = None


class HostOnly:
    """The device timer used on CPU and during warm-up: records nothing, harvests nothing."""

    pending_steps = 0
    dropped_steps = 0

    def start(self) -> None:
        return None

    def stop(self, phase: str, start: Any) -> None:
        return None

    def close_step(self, token: Any) -> None:
        return None

    def discard_step(self) -> None:
        return None

    def harvest(self) -> list[Harvested]:
        return []

    def drain(self) -> list[Harvested]:
        return []


HOST_ONLY = HostOnly()


class DeviceTimer:
    """Device time per phase from event pairs, harvested without ever blocking the host.

    ``start``/``stop`` bracket a phase; ``close_step(token)`` hands the step's event pairs to the pending queue;
    ``harvest()`` returns a ``Harvested`` (token, {phase: seconds}, the step's span on the device) for the oldest
    pending steps whose events have all completed, and recycles their events. The span runs from the step's first
    event to its last: where the host queues work faster than the GPU runs it (a loop that never waits for the
    GPU), the span, not the host's time, is the step's pace. ``drain()`` synchronises once and harvests everything:
    call it only outside the training loop. At most ``max_pending_steps`` steps wait; beyond that the oldest is
    dropped (and counted), which bounds memory if events never complete.

    Where the host is the slow side, an idle GPU waits between a phase's two events for the host to launch the
    phase's work, and the span reads the host's time as the GPU's. So every ``PROBE_EVERY``-th step is probed for
    how far the GPU lay behind the host at each phase's end. The events' times after the step's first, against the
    host clock read at each record, give every lag but one constant, which is bounded by what is known of one
    event: the end of a ``sync`` phase (the GPU had done the work before it when the sync returned), or, on one
    stream, the step's last event when it had completed by the time ``harvest`` ran within ``FOLLOW_NS`` of its
    record. A step with neither is not probed. A phase whose end the GPU reached within ``FOLLOW_NS`` of the host
    only followed it (``Harvested.followed_s``); one that ended further behind than that, whatever the constant, did
    GPU work the host waited for or ran ahead of; both are ``judged_s``. No query or wait is added.
    """

    def __init__(self, source: EventSource, max_pending_steps: int = 256, clock: Clock = now_ns) -> None:
        self._source = source
        self._clock = clock
        self._pool: list[DeviceEvent] = []
        self._intervals: list[Interval] = []
        # (token, intervals, first event, last event, when the host recorded the first and the last: ns)
        self._pending: deque[tuple[Any, list[Interval], DeviceEvent | None, DeviceEvent | None, int, int]] = deque()
        self._first: DeviceEvent | None = None  # the current step's first and last recorded events
        self._last: DeviceEvent | None = None
        self._first_ns = 0
        self._last_ns = 0
        self._max_pending = max_pending_steps
        self._since_probe = PROBE_EVERY - 1  # the first harvested step is probed
        self.dropped_steps = 0

    @property
    def pending_steps(self) -> int:
        return len(self._pending)

    def _event(self) -> DeviceEvent:
        event = self._pool.pop() if self._pool else self._source.new_event()
        self._source.record(event)
        self._last_ns = self._clock()
        if self._first is None:
            self._first = event
            self._first_ns = self._last_ns
        self._last = event
        return event

    def start(self) -> DeviceEvent:
        return self._event()

    def stop(self, phase: str, start: DeviceEvent) -> None:
        end = self._event()
        self._intervals.append((phase, start, end, self._last_ns))

    def close_step(self, token: Any) -> None:
        first, last, self._first, self._last = self._first, self._last, None, None
        if not self._intervals:
            return
        self._pending.append((token, self._intervals, first, last, self._first_ns, self._last_ns))
        self._intervals = []
        if len(self._pending) > self._max_pending:
            _, intervals, *_ = self._pending.popleft()
            self._recycle(intervals)
            self.dropped_steps += 1

    def discard_step(self) -> None:
        """Forget the current step's events (a step left out of the statistics); they are reused."""
        self._recycle(self._intervals)
        self._intervals = []
        self._first = self._last = None

    def _recycle(self, intervals: list[Interval]) -> None:
        for _, start, end, _ in intervals:
            self._pool.append(start)
            self._pool.append(end)

    def harvest(self) -> list[Harvested]:
        pending = self._pending
        completed = []
        # Steps are harvested oldest first and the scan stops at the first step still in flight: a stream
        # completes its work in order, so this costs O(completed + 1) queries however far the host runs ahead.
        # A later step that completes first (another stream) simply waits for the older one; nothing is lost.
        # On one stream the step's last event stands for all of them: one query a step, not two per phase.
        single_stream = getattr(self._source, "single_stream", False)
        while pending:
            last = pending[0][3]
            if single_stream and last is not None:
                if not last.query():
                    break
            elif not all(end.query() and start.query() for _, start, end, _ in reversed(pending[0][1])):
                break
            completed.append(pending.popleft())
        if not completed:
            return []
        now = self._clock()  # after every query above: each completed step's last event was done by now
        done = []
        for token, intervals, first, last, first_ns, last_ns in completed:
            # first and last are among the intervals' events (a phase left open at the step's close is the one
            # exception: its start is then recorded, and so complete, before the intervals' last end)
            span_ms = 0.0 if first is None or last is None or first is last else first.elapsed_time(last)
            span_s = max(span_ms / 1e3, 0.0)
            self._since_probe += 1
            harvested_in_time = now - last_ns <= FOLLOW_NS
            if (
                single_stream
                and span_ms
                and self._since_probe >= PROBE_EVERY
                and (harvested_in_time or any(phase == SYNC_PHASE for phase, *_ in intervals))
            ):
                self._since_probe = 0
                # the GPU reached the last event at most now - last_ns after the host recorded it
                last_behind_ns = (now - last_ns) - (span_ms * 1e6 - (last_ns - first_ns))
                probe = _probe(intervals, first, first_ns, last_behind_ns if harvested_in_time else None)
                done.append(Harvested(token, probe[0], span_s, probe[1], probe[2]))
            else:
                done.append(Harvested(token, _device_seconds(intervals), span_s))
            self._recycle(intervals)
        return done

    def drain(self) -> list[Harvested]:
        if self._pending:
            self._source.synchronize()
        return self.harvest()


def _device_seconds(intervals: list[Interval]) -> dict[str, float]:
    seconds: dict[str, float] = {}
    for phase, start, end, _ in intervals:
        seconds[phase] = seconds.get(phase, 0.0) + start.elapsed_time(end) / 1e3
    return seconds


def _probe(
    intervals: list[Interval], first: DeviceEvent, first_ns: int, last_behind_ns: float | None
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """A step's device time per phase (s), and that of the phases whose lag behind the host at their end is known
    (judged) and of those among them that the GPU only followed (see DeviceTimer).

    An end's lag is a constant plus its time after ``first`` on the GPU less its time on the host (its relative
    lag). The constant is at most ``last_behind_ns`` (None: unknown) and at most minus a sync end's relative lag
    (the GPU was not behind there), and at least minus the smallest relative lag (it is never negative)."""
    seconds: dict[str, float] = {}
    ends = []
    for phase, start, end, end_ns in intervals:
        device_s = start.elapsed_time(end) / 1e3
        seconds[phase] = seconds.get(phase, 0.0) + device_s
        ends.append((phase, device_s, first.elapsed_time(end) * 1e6 - (end_ns - first_ns)))
    bounds = [-lag for phase, _, lag in ends if phase == SYNC_PHASE]
    if last_behind_ns is not None:
        bounds.append(last_behind_ns)
    most = min(bounds)
    least = -min(0.0, *(lag for _, _, lag in ends))
    judged: dict[str, float] = {}
    followed: dict[str, float] = {}
    for phase, device_s, lag in ends:
        if most + lag <= FOLLOW_NS:
            followed[phase] = followed.get(phase, 0.0) + device_s
        elif least + lag <= FOLLOW_NS:
            continue  # somewhere between: not known
        judged[phase] = judged.get(phase, 0.0) + device_s
    return seconds, judged, followed
