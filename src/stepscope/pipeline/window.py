"""Sliding-window sums in constant memory and O(1) per event.

Events are added into time buckets of ``window_s / BUCKETS`` seconds; the window is the last ``BUCKETS`` buckets,
so its edge is exact to one bucket (1% of the window) whatever the event rate, and memory never grows with it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, fields

BUCKETS = 100


@dataclass(slots=True)
class Totals:
    """Sums over a stretch of time: what both sides of the pipeline did."""

    infer_samples: float = 0.0
    infer_s: float = 0.0  # engine time of the calls that succeeded
    infer_calls: int = 0  # that succeeded
    infer_errors: int = 0
    busy_s: float = 0.0  # engine time of every call, failed ones too
    train_samples: float = 0.0
    train_s: float = 0.0  # step time with the dispatch wait taken out
    train_steps: int = 0
    step_wait_s: float = 0.0  # the dispatch waits inside those steps
    data_s: float = 0.0  # of train_s, in data fetch and transfer (from a linked Scope's phases)
    compute_s: float = 0.0  # of train_s, in forward, backward and the optimizer (from a linked Scope)
    wait_s: float = 0.0
    waits: int = 0
    put: float = 0.0
    taken: float = 0.0

    def add(self, other: Totals) -> None:
        for f in _FIELDS:
            setattr(self, f, getattr(self, f) + getattr(other, f))


_FIELDS = tuple(f.name for f in fields(Totals))


class Window:
    """Totals of the last ``window_s`` seconds, kept in ``BUCKETS`` buckets of ``window_s / BUCKETS`` seconds.

    Not thread-safe by itself: the monitor holds its lock around ``at`` and ``totals``, never around user work.
    """

    def __init__(self, window_s: float) -> None:
        if not (math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"window_s must be a positive number of seconds, got {window_s!r}")
        self.window_s = window_s
        self.bucket_s = window_s / BUCKETS
        self._buckets: deque[tuple[int, Totals]] = deque()

    def at(self, t: float) -> Totals:
        """The bucket holding time ``t`` (s), to add an event into. Events come mostly in time order; one reported
        late (an engine on another machine) goes into its own time's bucket, and one older than the window into a
        bucket that is dropped."""
        index = int(t // self.bucket_s)
        buckets = self._buckets
        if buckets and buckets[-1][0] == index:
            return buckets[-1][1]
        if not buckets or index > buckets[-1][0]:
            totals = Totals()
            buckets.append((index, totals))
            while buckets[0][0] <= index - BUCKETS:
                buckets.popleft()
            return totals
        return self._earlier(index)

    def _earlier(self, index: int) -> Totals:
        buckets = self._buckets
        totals = Totals()
        if index <= buckets[-1][0] - BUCKETS:  # already out of the window
            return totals
        for position in range(len(buckets) - 1, -1, -1):
            held = buckets[position][0]
            if held == index:
                return buckets[position][1]
            if held < index:
                buckets.insert(position + 1, (index, totals))
                return totals
        buckets.appendleft((index, totals))
        return totals

    def totals(self, now: float) -> tuple[Totals, float]:
        """The sums over the window ending at ``now`` (s), and the time (s) at which that window starts."""
        first = int(now // self.bucket_s) - BUCKETS + 1
        out = Totals()
        for index, totals in self._buckets:
            if index >= first:
                out.add(totals)
        return out, first * self.bucket_s
