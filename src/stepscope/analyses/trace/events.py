"""The events of one trace that the analyses need, as compact numpy columns (about 40 bytes an event).

Reading keeps GPU activity (kernels, memory copies and sets), the runtime calls that launched it (linked by
``correlation``), CPU ops and user annotations (``ProfilerStep#N``, DataLoader spans, stepscope's phase ranges),
and drops the rest (Python stack events, flow arrows, counters, metadata), so memory follows the GPU activity, not
the trace's size.
"""

from __future__ import annotations

import array
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import msgspec
import numpy as np
import orjson

from stepscope.analyses.trace.shares import json_bytes, read_in_shares
from stepscope.analyses.trace.stream import TraceFile, TraceReadError, iter_decoded

# Device events are the ones Kineto gives a stream: kernels, memory copies and sets, and waits on the GPU.
DEVICE_KINDS = {"kernel": 0, "gpu_memcpy": 1, "memcpy": 1, "gpu_memset": 2, "memset": 2, "cuda_sync": 3}
DEVICE_KINDS["mtia_ccp_events"] = 4  # MTIA's device activity
OTHER_DEVICE_KIND = 5
SYNC_NAMES = {"Event Sync", "Context Sync"}  # device-level syncs, written on stream -1
CPU_KINDS = {"cpu_op": 0, "user_annotation": 1, "operator": 0}
HOST_KEPT = {*CPU_KINDS, "gpu_user_annotation"}  # the categories kept without a stream or a correlation
SHARED_MIN_BYTES = 64 << 20  # JSON bytes from which two processes read a trace: below, the second one's memory
# (~60-100 MB of RSS, counted twice for the libraries both map) is more than a small trace needs
_FILE_RANK = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)


@dataclass
class Columns:
    """Growable typed columns for one event kind; `freeze` turns them into numpy arrays."""

    names: tuple[str, ...]
    codes: str
    data: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        self.data = {name: array.array(code) for name, code in zip(self.names, self.codes, strict=True)}

    def freeze(self) -> dict[str, np.ndarray]:
        return {
            name: np.frombuffer(column, dtype=column.typecode) if len(column) else np.zeros(0, column.typecode)
            for name, column in self.data.items()
        }


@dataclass
class TraceEvents:
    """One rank's events as columns. Times are whole µs since the trace's first kept event (float64).

    Timestamps are rounded as HTA rounds them (start up, end down) whenever the trace has sub-µs timestamps: Kineto's
    ns-resolution traces otherwise show back-to-back kernels overlapping by a fraction of a µs.
    """

    path: Path
    rank: int
    rank_source: str  # "distributedInfo", "file name" or "default"
    meta: dict[str, Any]
    names: list[str]  # interned event names; columns hold indices into it
    device: dict[str, np.ndarray]  # ts, end, stream, name, kind (DEVICE_KINDS), correlation
    runtime: dict[str, np.ndarray]  # host events with a correlation (the launches): ts, end, tid, name, correlation
    cpu: dict[str, np.ndarray]  # CPU ops and user annotations: ts, end, tid, name, kind (CPU_KINDS)
    gpu_annotations: dict[str, np.ndarray]  # ts, end, stream, name
    events: int  # every event in the file, kept or not
    bytes_read: int
    origin_us: float  # the absolute timestamp subtracted from every ts
    device_type: str  # "cuda", "rocm", "mtia", "cpu"
    rounded: bool  # sub-µs timestamps were rounded

    def named(self, column: np.ndarray, pattern: re.Pattern[str]) -> np.ndarray:
        """Which rows of a name column match ``pattern`` (each interned name tested once, then a lookup per row)."""
        matches = np.fromiter((bool(pattern.search(name)) for name in self.names), dtype=bool, count=len(self.names))
        return matches[column]


def _int(value: Any, default: int = -1) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


class _Collector:
    def __init__(self) -> None:
        self.names: list[str] = []
        self.index: dict[str, int] = {}
        self.device = Columns(("ts", "dur", "stream", "name", "kind", "correlation"), "ddqiiq")
        self.runtime = Columns(("ts", "dur", "tid", "name", "correlation"), "ddqiq")
        self.cpu = Columns(("ts", "dur", "tid", "name", "kind"), "ddqii")
        self.gpu_annotations = Columns(("ts", "dur", "stream", "name"), "ddqi")
        self.categories: set[str] = set()
        self.fractional = False  # any timestamp not a whole µs (or missing): HTA then rounds them all
        self._kinds: dict[str, _Kind] = {}

    def merge(self, run: _Collector) -> None:
        """Append the events of ``run`` (sorted on its own) as if they had been added here."""
        names = array.array("i", map(self.name, run.names))  # interned in the order the run met them, as `add` does
        for mine, theirs in zip(self.columns(), run.columns(), strict=True):
            for key, column in mine.data.items():
                values = theirs.data[key]
                if key == "name" and len(values):
                    values = array.array("i", np.asarray(names)[np.frombuffer(values, dtype=np.intc)].tobytes())
                column.extend(values)
        self.categories |= run.categories
        self.fractional |= run.fractional

    def columns(self) -> tuple[Columns, ...]:
        return self.device, self.runtime, self.cpu, self.gpu_annotations

    def name(self, text: str) -> int:
        found = self.index.get(text)
        if found is None:
            found = self.index[text] = len(self.names)
            self.names.append(text)
        return found

    def add(self, batch: list[Event]) -> None:
        # One pass in Python, ~0.5 µs an event: each column's append bound once a batch, names interned inline and
        # each category's handling looked up once, since method lookups and calls are most of the loop's time.
        dev_ts, dev_dur, dev_stream, dev_name, dev_kind, dev_corr = (c.append for c in self.device.data.values())
        rt_ts, rt_dur, rt_tid, rt_name, rt_corr = (c.append for c in self.runtime.data.values())
        cpu_ts, cpu_dur, cpu_tid, cpu_name, cpu_kind = (c.append for c in self.cpu.data.values())
        ann_ts, ann_dur, ann_stream, ann_name = (c.append for c in self.gpu_annotations.data.values())
        index, intern, kinds, categories = self.index, self.name, self._kinds, self.categories
        for event in batch:
            ts = event.ts
            if type(ts) is not int:
                self.fractional = True
            if type(event) is not Complete:
                continue
            cat = event.cat
            dur = event.dur
            if type(cat) is not str or dur is None or ts is None or cat == "Trace":
                continue
            kind = kinds.get(cat)
            if kind is None:
                kind = kinds[cat] = _Kind(cat)
            args = event.args
            if args is None:
                stream = correlation = -1
            else:
                stream, correlation = args.stream, args.correlation
                if type(stream) is not int:
                    stream = -1 if stream is None else _int(stream)
                if type(correlation) is not int:
                    correlation = -1 if correlation is None else _int(correlation)
            name = event.name
            if type(name) is not str:
                name = str(name)
            if stream == -1 and correlation == -1 and not kind.host_kept and name not in SYNC_NAMES:
                continue  # Python stack events and the like: most of a with_stack trace, and nothing reads them
            try:
                ts, dur = float(ts), float(dur)
            except (TypeError, ValueError):
                continue
            code = index.get(name)
            if code is None:
                code = intern(name)
            if kind.annotation:
                ann_ts(ts)
                ann_dur(dur)
                ann_stream(tid if type(tid := event.tid) is int else _int(tid))
                ann_name(code)
            elif stream != -1 or name in SYNC_NAMES:
                categories.add(kind.lowered)
                dev_ts(ts)
                dev_dur(dur)
                dev_stream(stream)
                dev_name(code)
                dev_kind(kind.device)
                dev_corr(correlation)
            elif correlation != -1:
                categories.add(kind.lowered)
                rt_ts(ts)
                rt_dur(dur)
                rt_tid(tid if type(tid := event.tid) is int else _int(tid))
                rt_name(code)
                rt_corr(correlation)
            elif kind.cpu is not None:
                cpu_ts(ts)
                cpu_dur(dur)
                cpu_tid(tid if type(tid := event.tid) is int else _int(tid))
                cpu_name(code)
                cpu_kind(kind.cpu)


class _Kind:
    """How `_Collector.add` treats an event category (worked out once per category a trace uses)."""

    __slots__ = ("annotation", "cpu", "device", "host_kept", "lowered")

    def __init__(self, cat: str) -> None:
        self.lowered = cat.lower()
        self.host_kept = self.lowered in HOST_KEPT
        self.annotation = self.lowered == "gpu_user_annotation"
        self.device = DEVICE_KINDS.get(self.lowered, OTHER_DEVICE_KIND)
        self.cpu = CPU_KINDS.get(self.lowered)


# gc=False: millions of these are made and dropped while reading, and they never form cycles; tracked by the cyclic
# collector, they would make its passes (and the parse) ~1.5x slower.
class Args(msgspec.Struct, gc=False):
    """The two ``args`` an analysis needs; msgspec skips the others without building them."""

    stream: Any = None
    correlation: Any = None


class Event(msgspec.Struct, gc=False, tag_field="ph"):
    """An event of a trace, decoded straight from JSON (~3x faster than dicts). Of any but a complete one only the
    timestamp is read (one that is not a whole µs makes the trace's times rounded): msgspec skips the rest without
    building it, a third of the decoding time on traces whose flows, instants or metadata are many."""

    ts: Any = None


class Complete(Event, tag="X"):
    """A complete event (``"ph": "X"``): kernels, copies, runtime calls, CPU ops and annotations, with the fields an
    analysis needs."""

    cat: Any = None
    name: Any = ""
    dur: Any = None
    tid: Any = None
    args: Args | None = None


# The Trace Event Format's other phases, one struct each (msgspec tells a union's structs by their tag). An event of
# another phase, or without one, fails the union: its run is decoded again by the generic decoder (`decode_events`).
_SKIPPED = [msgspec.defstruct(f"Phase{ord(ph)}", [], bases=(Event,), tag=ph) for ph in "BEiICbneSTpFstfPNODMVvRc()"]
_DECODER = msgspec.json.Decoder(list[Union[(Complete, *_SKIPPED)]])  # a union built from a list


def decode_events(run: bytes) -> list[Event]:
    """A JSON array of events → `Complete` events and other `Event`s. Items that do not fit (not objects, an
    unknown phase, ``args`` not an object) send the array through the generic decoder instead, keeping what can be
    read; malformed JSON raises ValueError, and JSON nested past the decoders' depth limit (about 1,000 levels)
    `TraceReadError`."""
    try:
        return _DECODER.decode(run)
    except msgspec.ValidationError:
        return [_from_dict(item) for item in orjson.loads(run) if type(item) is dict]
    except RecursionError:  # msgspec's depth guard: Python's recursion limit (orjson stops at 1,024 levels)
        limit = sys.getrecursionlimit()
        raise TraceReadError(f"an event nests JSON deeper than the decoder reads (~{limit:,} levels)") from None


def _run_columns(batch: list[Event]) -> _Collector:
    """One run of events sorted on its own, to be merged (`_Collector.merge`)."""
    run = _Collector()
    run.add(batch)
    return run


def _from_dict(item: dict[str, Any]) -> Event:
    if item.get("ph") != "X":
        return Event(item.get("ts"))
    args = item.get("args")
    return Complete(
        ts=item.get("ts"), cat=item.get("cat"), name=item.get("name", ""), dur=item.get("dur"), tid=item.get("tid"),
        args=Args(args.get("stream"), args.get("correlation")) if isinstance(args, dict) else None,
    )  # fmt: skip


def rank_of(path: Path, meta: dict[str, Any]) -> tuple[int, str]:
    """The trace's rank: ``distributedInfo.rank``, else a ``rank<N>`` in the file name, else 0 (as HTA does)."""
    info = meta.get("distributedInfo")
    if isinstance(info, dict) and (rank := _int(info.get("rank"), -1)) >= 0:
        return rank, "distributedInfo"
    if match := _FILE_RANK.search(path.name):
        return int(match.group(1)), "file name"
    return 0, "default"


def _device_type(meta: dict[str, Any], categories: set[str]) -> str:
    names = " ".join(str(d.get("name", "")) for d in meta.get("deviceProperties") or [] if isinstance(d, dict))
    if any(c.startswith("mtia") for c in categories) or "ARTEMIS" in names or "MTIA" in names:
        return "mtia"
    if "AMD" in names or "Radeon" in names or "Instinct" in names:
        return "rocm"
    return "cuda" if categories & set(DEVICE_KINDS) else "cpu"


def _finish(columns: Columns, rounded: bool) -> dict[str, np.ndarray]:
    """Freeze one event kind, with ``end`` in place of ``dur`` (rounded like HTA when the trace has sub-µs times)."""
    frozen = columns.freeze()
    ts, dur = frozen.pop("ts"), frozen.pop("dur")
    end = ts + dur
    if rounded:
        ts, end = np.ceil(ts), np.floor(end)
    return {"ts": ts, "end": end, **frozen}


def read_trace(path: str | Path, processes: int = 1) -> TraceEvents:
    """Read one Kineto trace into columns. Raises `TraceReadError` (or OSError) with the reason when it cannot.

    ``processes`` > 1: a trace of at least `SHARED_MIN_BYTES` of JSON is read by two processes (see `shares`).
    """
    path = Path(path)
    trace, collector = TraceFile(path), _Collector()
    shared = processes > 1 and json_bytes(path) >= SHARED_MIN_BYTES
    if not (shared and read_in_shares(path, trace, decode_events, _run_columns, collector.merge)):
        trace, collector = TraceFile(path), _Collector()  # what a failed shared read merged is dropped
        for batch in iter_decoded(path, decode_events, trace):
            collector.add(batch)
    kinds = ("device", "runtime", "cpu", "gpu_annotations")
    columns = {kind: _finish(getattr(collector, kind), collector.fractional) for kind in kinds}
    starts = [c["ts"].min() for c in columns.values() if len(c["ts"])]
    origin = float(min(starts)) if starts else 0.0
    for c in columns.values():  # whole µs below 2**53: subtracting is exact
        c["ts"] -= origin
        c["end"] -= origin
    rank, source = rank_of(path, trace.meta)
    return TraceEvents(
        path=path,
        rank=rank,
        rank_source=source,
        meta=trace.meta,
        names=collector.names,
        events=trace.events,
        bytes_read=trace.bytes_read,
        origin_us=origin,
        device_type=_device_type(trace.meta, collector.categories),
        rounded=collector.fractional,
        **columns,
    )


def trace_files(paths: Iterable[str | Path]) -> list[Path]:
    """The trace files named, folders expanded to their ``*.json`` / ``*.json.gz`` files (sorted, recursive)."""
    found: list[Path] = []
    for item in map(Path, paths):
        if item.is_dir():
            found += sorted(p for p in item.rglob("*") if p.is_file() and p.name.endswith((".json", ".json.gz")))
        else:
            found.append(item)
    return found
