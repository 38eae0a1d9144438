"""Streaming statistics of flat readings: one small record per reading name, folded once per sample."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(slots=True)
class KeyStats:
    """Count, sum, min, max and last value of one reading over the samples that had it."""

    n: int
    total: float
    lo: float
    hi: float
    last: float

    @property
    def mean(self) -> float:
        return self.total / self.n


Stats = Mapping[str, KeyStats]


def fold(stats: dict[str, KeyStats], readings: Mapping[str, float]) -> None:
    """Add one sample's readings to ``stats`` in place."""
    for key, value in readings.items():
        s = stats.get(key)
        if s is None:
            stats[key] = KeyStats(1, value, value, value, value)
            continue
        s.n += 1
        s.total += value
        s.last = value
        if value < s.lo:
            s.lo = value
        elif value > s.hi:
            s.hi = value


def copy_stats(stats: Stats) -> dict[str, KeyStats]:
    """A frozen copy, so that a summary built from it cannot change under a sampler still running."""
    return {key: KeyStats(s.n, s.total, s.lo, s.hi, s.last) for key, s in stats.items()}


def mean(stats: Stats, key: str) -> float | None:
    s = stats.get(key)
    return None if s is None else s.mean


def high(stats: Stats, key: str) -> float | None:
    s = stats.get(key)
    return None if s is None else s.hi


def low(stats: Stats, key: str) -> float | None:
    s = stats.get(key)
    return None if s is None else s.lo


def rounded(value: float | None, digits: int = 1) -> float | None:
    """``round`` that passes None through (figures in the system dict are rounded for reading, not for precision)."""
    return None if value is None else round(float(value), digits)
