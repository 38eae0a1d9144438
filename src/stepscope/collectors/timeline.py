"""A bounded timeline of a few series: at most ``max_points`` points however long the run.

Samples are averaged into buckets of ``stride`` samples; when the points reach ``max_points`` each pair of neighbours
is merged and the stride doubles. Memory stays O(max_points) and the timeline always spans the whole run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class Timeline:
    """Pairwise-decimating timeline of time (s) and named series; a series value may be missing (None)."""

    def __init__(self, series: Sequence[str], max_points: int = 300) -> None:
        if max_points < 2 or max_points % 2:
            raise ValueError(f"max_points must be an even number >= 2, got {max_points}")
        self.series = tuple(series)
        self.max_points = max_points
        self.stride = 1
        width = len(self.series) + 1  # time first
        self._points: list[list[float | None]] = []
        self._sums = [0.0] * width
        self._counts = [0] * width
        self._pending = 0

    def add(self, t_s: float, values: Sequence[float | None]) -> None:
        """One sample at ``t_s`` seconds; ``values`` in the order of ``series``."""
        sums, counts = self._sums, self._counts
        sums[0] += t_s
        counts[0] += 1
        for i, value in enumerate(values, 1):
            if value is not None:
                sums[i] += value
                counts[i] += 1
        self._pending += 1
        if self._pending == self.stride:
            self._points.append(self._flush())
            if len(self._points) == self.max_points:
                self._halve()

    def as_dict(self, digits: int = 3) -> dict[str, list[Any]]:
        """``{"t_s": [...], <series>: [...]}``, the partial last bucket included (so at most ``max_points``)."""
        points = list(self._points)
        if self._pending:
            points.append(self._peek())
        names = ("t_s", *self.series)
        return {name: [None if p[i] is None else round(p[i], digits) for p in points] for i, name in enumerate(names)}

    def _peek(self) -> list[float | None]:
        return [s / c if c else None for s, c in zip(self._sums, self._counts, strict=True)]

    def _flush(self) -> list[float | None]:
        point = self._peek()
        self._sums = [0.0] * len(self._sums)
        self._counts = [0] * len(self._counts)
        self._pending = 0
        return point

    def _halve(self) -> None:
        pairs = zip(self._points[::2], self._points[1::2], strict=True)
        self._points = [[_mean2(a, b) for a, b in zip(left, right, strict=True)] for left, right in pairs]
        self.stride *= 2


def _mean2(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return (a + b) / 2
