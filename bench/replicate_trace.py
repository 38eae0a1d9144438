"""Build a larger Kineto trace by replicating a real one: its events repeated N times, back to back, streamed to gzip.

Replica k (0-based) is the source's events with every ``ts`` shifted by k x the period (the span of the replicated
events plus the median gap between ProfilerSteps, rounded up to a whole µs), the ids that link events
(``correlation``, ``External id``, flow ``id``) shifted by k x (largest such id + 1), ``Ev Idx`` / ``Profiler Event
Index`` / ``Python id`` / ``Python parent id`` likewise, and ``ProfilerStep#N`` renumbered N + k x (steps in the
source). Metadata events (``ph: M``), the ``Trace`` span (its ``dur`` stretched over the whole result) and instant
events (``Record Window End`` moved to the new end) are written once. The header and trailer (``distributedInfo``,
``deviceProperties``, ...) are kept as they are, and so is Kineto's text layout: the substitutions are made on the
source's own text, so the result has the source's bytes per event and every event kind it has.

Only the source (tens of MB) is held in memory; replicas are written one at a time.

    python bench/replicate_trace.py SOURCE.json.gz OUT.json.gz --replicas N
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

SEP = b"\n  },\n  {"  # between two events in Kineto's layout
_ARRAY = re.compile(rb'"traceEvents"\s*:\s*\[')
_LINKED = ("correlation", "External id", "id")  # one id space: a flow's id is its launch's correlation
_INDEXES = ("Ev Idx", "Profiler Event Index")
_PYTHON = ("Python id", "Python parent id")
_STEP = re.compile(r"ProfilerStep#(\d+)")


@dataclass
class Source:
    """A parsed source trace: its text around the event array, the events to replicate and the ones kept once."""

    head: bytes  # up to and including the array's '['
    tail: bytes  # from the array's ']' to the end
    replicated: bytes  # the replicated events' text, joined by ``SEP`` (without the outer braces)
    once: list[dict[str, Any]]
    period_us: int
    offsets: dict[str, int]  # key -> shift per replica
    step_shift: int
    span: tuple[float, float]  # first start, last end of the replicated events
    events_per_replica: int


def _max_of(events: list[dict[str, Any]], keys: tuple[str, ...]) -> int:
    """Largest integer value of ``keys`` at the top level or in ``args`` of the events (0 if none)."""
    best = 0
    for e in events:
        for where in (e, e.get("args") or {}):
            for k in keys:
                v = where.get(k)
                if isinstance(v, int) and not isinstance(v, bool) and v > best:
                    best = v
    return best


def _event_texts(body: bytes, count: int) -> list[bytes] | None:
    """The array's events as text (without outer braces) when the file has Kineto's layout, else None."""
    body = body.strip()
    if not (body.startswith(b"{") and body.endswith(b"}")):
        return None
    pieces = body[1:-1].split(SEP)
    if len(pieces) != count:
        return None
    return pieces


def load_source(path: Path) -> Source:
    """Read and classify the source trace's events; the period and id offsets for the replicas."""
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    doc = orjson.loads(raw)
    events: list[dict[str, Any]] = doc["traceEvents"]
    m = _ARRAY.search(raw)
    if m is None:
        raise ValueError(f"{path}: no traceEvents array")
    end = raw.rindex(b"]")
    head, body, tail = raw[: m.end()], raw[m.end() : end], raw[end:]
    if orjson.loads(head + tail).get("traceEvents") != []:
        raise ValueError(f"{path}: traceEvents is not the last array of the file")
    texts = _event_texts(body, len(events))
    if texts is None:  # not Kineto's layout: write the events compactly instead
        texts = [orjson.dumps(e)[1:-1] for e in events]
    once_kinds = {"M", "i", "I"}
    rep_idx = [i for i, e in enumerate(events) if e.get("ph") not in once_kinds and e.get("cat") != "Trace"]
    once = [e for e in events if e.get("ph") in once_kinds or e.get("cat") == "Trace"]
    rep = [events[i] for i in rep_idx]
    starts = [float(e["ts"]) for e in rep if "ts" in e]
    ends = [float(e["ts"]) + float(e.get("dur", 0) or 0) for e in rep if "ts" in e]
    steps = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]), int(mm.group(1)))
        for e in rep
        if e.get("ph") == "X" and (mm := _STEP.fullmatch(str(e.get("name", "")))) and "dur" in e
    )
    steps = [s for s in steps if s[1] > s[0]]
    gaps = [b[0] - a[1] for a, b in itertools.pairwise(steps) if b[0] >= a[1]]
    gap = statistics.median(gaps) if gaps else 0.0
    numbers = {s[2] for s in steps}
    step_shift = (max(numbers) - min(numbers) + 1) if numbers else 0
    linked = _max_of(rep, _LINKED) + 1
    offsets = {k: linked for k in _LINKED}
    offsets.update({k: _max_of(rep, _INDEXES) + 1 for k in _INDEXES})
    offsets.update({k: _max_of(rep, _PYTHON) + 1 for k in _PYTHON})
    span = (min(starts), max(ends))
    period = int(-(-(span[1] - span[0] + gap) // 1))
    return Source(
        head=head,
        tail=tail,
        replicated=SEP.join(texts[i] for i in rep_idx),
        once=once,
        period_us=period,
        offsets=offsets,
        step_shift=step_shift,
        span=span,
        events_per_replica=len(rep),
    )


def _shifter(src: Source, k: int) -> Callable[[re.Match[bytes]], bytes]:
    """The substitution for replica ``k``: shifted timestamps, ids and step numbers."""
    dt = k * src.period_us

    def sub(m: re.Match[bytes]) -> bytes:
        if m.group(1) is not None:  # ProfilerStep#N
            return b"ProfilerStep#" + str(int(m.group(1)) + k * src.step_shift).encode()
        key, num = m.group(2), m.group(3)
        if key == b"ts":
            whole, dot, frac = num.partition(b".")
            return b'"ts": ' + str(int(whole) + dt).encode() + dot + frac
        value = int(num)
        if value < 0:  # -1: no link
            return m.group(0)
        return b'"' + key + b'": ' + str(value + k * src.offsets[key.decode()]).encode()

    return sub


def _pattern(src: Source) -> re.Pattern[bytes]:
    """Everything a replica changes: step names, ``"ts": N`` and the offset keys' integer values."""
    keys = b"|".join(re.escape(k.encode()) for k in ["ts", *src.offsets])
    return re.compile(rb'ProfilerStep#(\d+)|"(' + keys + rb')": ?(-?\d+(?:\.\d+)?)')


def write_replicated(src: Source, out: Path, replicas: int, level: int = 6) -> int:
    """Write ``replicas`` copies of the source's events to ``out`` (gzip); returns the uncompressed bytes."""
    pat = _pattern(src)
    total_end = src.span[0] + (replicas - 1) * src.period_us + (src.span[1] - src.span[0])
    once: list[bytes] = []
    for e in src.once:
        e = dict(e)
        if e.get("cat") == "Trace" and "ts" in e:
            e["dur"] = int(-(-(total_end - float(e["ts"])) // 1))
        elif e.get("name") == "Record Window End":
            e["ts"] = int(-(-total_end // 1))
        once.append(orjson.dumps(e)[1:-1])
    out.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with gzip.open(out, "wb", compresslevel=level) as fh:

        def put(b: bytes) -> None:
            nonlocal written
            fh.write(b)
            written += len(b)

        put(src.head + b"\n  {")
        for k in range(replicas):
            put((SEP if k else b"") + (pat.sub(_shifter(src, k), src.replicated) if k else src.replicated))
        for text in once:
            put(SEP + text)
        put(b"\n  }\n  " + src.tail)
    return written


def main() -> int:
    """Command line: SOURCE OUT --replicas N."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--replicas", type=int, required=True)
    ap.add_argument("--level", type=int, default=6, help="gzip level (default 6)")
    a = ap.parse_args()
    src = load_source(a.source)
    n = write_replicated(src, a.out, a.replicas, a.level)
    print(
        f"{a.out}: {a.replicas} x {src.events_per_replica:,} events + {len(src.once)} once, "
        f"{n / 1e6:.1f} MB uncompressed, {a.out.stat().st_size / 1e6:.1f} MB gzip, period {src.period_us} µs"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
