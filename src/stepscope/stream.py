"""The step stream: every closed step of a measured process, in a file that survives the process.

A process writes its summary when it exits, and a checkpoint every ``--checkpoint-s``; a SIGKILL (the OOM killer),
``os._exit``, an abort or a segfault skips the exit and everything since the last checkpoint. So each measured
process also appends its steps, as they close, to a memory-mapped file in the run folder. A write is two struct
packs into shared memory (no system call, no fsync): the page cache keeps what was written whatever way the process
dies. ``stepscope run`` follows the streams while the command runs (live progress, steps that stopped coming) and
builds the summary of a process that left none from its stream, up to its last completed step.

The file (``stream-HOST-pidPID.steps``) is a header, then a ring of fixed-size records of int64 fields: kind
(warm-up step, measured step, validation pass), the step's index, when it was written (CLOCK_MONOTONIC ns), its wall
ns, its samples (-1: unknown), its layout, then the wall ns of each phase in the layout's order. A CUDA-timed step
whose GPU work outlasted the host's (a loop that never waits for the GPU) gets a second record once its events
complete, a few steps later: kind ``PACED``, the step's index, and in the wall field the GPU time it added beyond the
host's (``Recorder.add_device``), so that a reader paces the steps as the process's own summary does. A layout is the
tuple of phase names a step closed with (the dict's own order), numbered as first seen: a step is packed straight
from its dict's values, and a loop has a handful of layouts. The header holds the total of records written, a flag
the process sets once its final summary is written, and a JSON block: who the process is, and the layouts. The ring
keeps the last ``capacity`` records; a reader that falls further behind than that counts the records it missed.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import struct
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from time import monotonic_ns
from typing import Any

from stepscope.instrument.identity import host_label
from stepscope.record import (
    OTHER_PHASE,
    OWN_PHASE,
    PHASES,
    EvalPasses,
    Recorder,
    StepRecord,
    add_wall_rates,
    summarize,
)
from stepscope.summary import Meta, RunSummary, Steps, Wall

MAGIC = b"STEPSCP1"
VERSION = 2  # 2: PACED records (a reader of 1 would take them for steps)
READS = (1, 2)  # the versions this reader folds (1 has no PACED records)
HEADER_BYTES = 32768
FIELDS = 6  # kind, index, at_ns, wall_ns, samples, layout
SLOTS = 32  # phases a record holds at most
RECORD_BYTES = (FIELDS + SLOTS) * 8
_HEAD = struct.Struct("<8sIIqqI")  # magic, version, capacity, written, closed, meta length
_COUNT = struct.Struct("<q")
WRITTEN_AT, CLOSED_AT, META_AT = 16, 24, _HEAD.size
_BY_LENGTH = [struct.Struct(f"<{FIELDS + n}q") for n in range(SLOTS + 1)]  # a record with n phases
_WHOLE = _BY_LENGTH[SLOTS]
MAX_UNPACED = 4096  # measured steps a reader remembers while their PACED records may still come
CAPACITY = 8192  # records in the ring: 2.5 MB, minutes of steps for a reader that polls twice a second
MAX_LAYOUTS = 100  # past this many, a step is written in the fixed layout (its custom phases into ``other``)
SUFFIX = ".steps"

WARMUP, MEASURED, EVAL_PASS, PACED = 0, 1, 2, 3  # record kinds
FIXED_LAYOUT = (*PHASES, OWN_PHASE)  # layout 0: the fallback


class StreamError(Exception):
    """A stream file that cannot be read (not a stream, or a version this stepscope does not know)."""


def stream_name(hostname: str, pid: int) -> str:
    """The stream file of a process in a run folder: unique across the nodes and processes of a job."""
    return f"stream-{host_label(hostname)}-pid{pid}{SUFFIX}"


class StepStream:
    """Appends one process's closed steps and validation passes to its stream file.

    Args:
        path: the stream file (created, or replaced).
        meta: who the process is (rank, pid, hostname, launch_id, warmup, ...), stored in the header as JSON.
        capacity: records the ring holds.
    """

    def __init__(self, path: Path, meta: dict[str, Any], capacity: int = CAPACITY) -> None:
        # Unix time = CLOCK_MONOTONIC + this offset: when a record was written, in the host's calendar time
        self._meta = {**meta, "unix_offset_ns": time.time_ns() - time.monotonic_ns(), "layouts": [list(FIXED_LAYOUT)]}
        self._layouts: dict[tuple[str, ...], int] = {}
        self._capacity = capacity
        size = HEADER_BYTES + capacity * RECORD_BYTES
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._written = 0
        self._at = HEADER_BYTES  # where the next record goes
        self._last_at = size - RECORD_BYTES
        self._counts = memoryview(self._map)[:HEADER_BYTES].cast("q")  # the header's int64 fields
        _HEAD.pack_into(self._map, 0, MAGIC, VERSION, capacity, 0, 0, 0)
        self._write_meta()

    def _write_meta(self) -> None:
        raw = json.dumps(self._meta).encode()
        if META_AT + len(raw) > HEADER_BYTES:
            raise ValueError(f"the stream's header holds {HEADER_BYTES - META_AT} bytes of JSON, not {len(raw)}")
        self._map[META_AT : META_AT + len(raw)] = raw
        struct.pack_into("<I", self._map, META_AT - 4, len(raw))

    def _new_layout(self, names: tuple[str, ...]) -> int:
        """Number a layout first seen now; 0 (the fixed one) when the header has no room for more."""
        layouts = self._meta["layouts"]
        if len(layouts) >= MAX_LAYOUTS or len(names) > SLOTS:
            self._layouts[names] = 0
            return 0
        layouts.append(list(names))
        self._write_meta()  # before the first record that uses it
        self._layouts[names] = len(layouts) - 1
        return len(layouts) - 1

    def _append(
        self, kind: int, index: int, wall_ns: int, samples: int | None, phases_ns: dict[str, int], end_ns: int = 0
    ) -> None:
        names = tuple(phases_ns)
        layout = self._layouts.get(names)
        if layout is None:
            layout = self._new_layout(names)
        values = list(phases_ns.values()) if layout else _fixed(phases_ns)
        samples = -1 if samples is None else samples
        _BY_LENGTH[len(values)].pack_into(
            self._map, self._at, kind, index, end_ns or monotonic_ns(), wall_ns, samples, layout, *values
        )
        self._advance()

    def _advance(self) -> None:
        """The record is written: count it (after it, so a reader never sees half of one), and move on."""
        self._at = self._at + RECORD_BYTES if self._at < self._last_at else HEADER_BYTES
        self._written += 1
        self._counts[WRITTEN_AT // 8] = self._written

    def step(self, record: StepRecord, measured: bool) -> None:
        """One closed step, as the recorder keeps it (``_append``'s work, inlined for a known layout: once a step)."""
        phases_ns = record.phases_ns
        layout = self._layouts.get(tuple(phases_ns))
        if not layout:
            kind = MEASURED if measured else WARMUP
            self._append(kind, record.index, record.step_ns, record.samples, phases_ns, record.end_ns)
            return
        samples = record.samples
        _BY_LENGTH[len(phases_ns)].pack_into(
            self._map,
            self._at,
            MEASURED if measured else WARMUP,
            record.index,
            record.end_ns or monotonic_ns(),  # the scope's clock is CLOCK_MONOTONIC: no second reading
            record.step_ns,
            -1 if samples is None else samples,
            layout,
            *phases_ns.values(),
        )
        self._at = self._at + RECORD_BYTES if self._at < self._last_at else HEADER_BYTES
        self._written += 1
        self._counts[WRITTEN_AT // 8] = self._written

    def eval_pass(self, wall_ns: int, phases_ns: dict[str, int], batches: int) -> None:
        """One validation pass between steps: its wall ns, the phases inside it, its batches."""
        self._append(EVAL_PASS, 0, wall_ns, batches, phases_ns)

    def paced(self, record: StepRecord, excess_ns: int) -> None:
        """A kept step's GPU time beyond the host's (ns, negative as the GPU catches up), known once its events
        completed."""
        _BY_LENGTH[0].pack_into(self._map, self._at, PACED, record.index, monotonic_ns(), excess_ns, -1, 0)
        self._advance()

    def close(self) -> None:
        """The process wrote its final summary: readers stop waiting for it."""
        self._counts[CLOSED_AT // 8] = 1


def _fixed(phases_ns: dict[str, int]) -> list[int]:
    """A step's phases in the fixed layout: a custom phase's time goes into ``other``."""
    values = [phases_ns.get(name, 0) for name in FIXED_LAYOUT]
    values[FIXED_LAYOUT.index(OTHER_PHASE)] += sum(ns for name, ns in phases_ns.items() if name not in FIXED_LAYOUT)
    return values


class NoStream:
    """The stream of a process that keeps none (the library ``Scope``, a process not started by stepscope)."""

    def step(self, record: StepRecord, measured: bool) -> None:
        return None

    def eval_pass(self, wall_ns: int, phases_ns: dict[str, int], batches: int) -> None:
        return None

    def paced(self, record: StepRecord, excess_ns: int) -> None:
        return None

    def close(self) -> None:
        return None


NO_STREAM = NoStream()


class ProcessStream:
    """The stream of a process ``stepscope run`` measures, opened at its first kept step, so a process that never
    trains (a launcher, a loader worker, a compile worker) leaves no file; a process forked from it starts its own.

    Args:
        recorder: the scope's recorder (its kept steps are streamed).
        passes: the scope's validation passes.
        folder: the run folder.
        meta_of: who the process is, read when the stream opens (the rank is known by then).
    """

    def __init__(self, recorder: Recorder, passes: EvalPasses, folder: Path, meta_of: Callable[[], dict[str, Any]]):
        self._recorder = recorder
        self._passes = passes
        self._folder = folder
        self._meta_of = meta_of
        self._stream: StepStream | NoStream = NO_STREAM
        self._arm()
        arm = weakref.WeakMethod(self._arm)  # the registration outlives the scope: it must not keep it alive
        os.register_at_fork(after_in_child=lambda: (again := arm()) is not None and again())

    def _arm(self) -> None:
        self._stream = NO_STREAM
        self._recorder.on_keep = self._open_then_step
        self._recorder.on_paced = NO_STREAM.paced  # only a kept step, which opens the stream, is paced later
        self._passes.on_add = self._open_then_pass

    def _open(self) -> StepStream | NoStream:
        try:
            meta = self._meta_of()
            stream: StepStream | NoStream = StepStream(self._folder / stream_name(meta["hostname"], meta["pid"]), meta)
        except Exception as error:  # the summary at exit still comes: only what a kill would lose is at risk
            print(
                f"stepscope: the step stream could not open ({type(error).__name__}: {error}); a process killed "
                "before its exit keeps only its last checkpoint.",
                file=sys.stderr,
            )
            stream = NO_STREAM
        self._stream = stream
        self._recorder.on_keep = stream.step
        self._recorder.on_paced = stream.paced
        self._passes.on_add = stream.eval_pass
        return stream

    def _open_then_step(self, record: StepRecord, measured: bool) -> None:
        self._open().step(record, measured)

    def _open_then_pass(self, wall_ns: int, phases_ns: dict[str, int], batches: int) -> None:
        self._open().eval_pass(wall_ns, phases_ns, batches)

    def close(self) -> None:
        """The final summary is written (see ``StepStream.close``)."""
        self._stream.close()


@dataclass
class Row:
    """One record read back from a stream."""

    kind: int
    index: int
    at_ns: int  # when it was written (CLOCK_MONOTONIC ns of the writing host)
    wall_ns: int
    samples: int | None
    phases_ns: dict[str, int]


class StreamReader:
    """Reads a stream file while its process writes it, or after the process died."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as file:
                self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as error:
            raise StreamError(f"{path} cannot be read as a step stream: {error}") from error
        if len(self._map) < HEADER_BYTES:
            raise StreamError(f"{path} is not a step stream (shorter than its header)")
        magic, version, capacity, _, _, _ = _HEAD.unpack_from(self._map, 0)
        if magic != MAGIC or version not in READS:
            raise StreamError(f"{path} is not a step stream of this stepscope (version {VERSION})")
        self.capacity = capacity
        self.read = 0  # records consumed
        self.lost = 0  # records overwritten before they were read
        self.meta = self._read_meta()

    def _read_meta(self) -> dict[str, Any]:
        (length,) = struct.unpack_from("<I", self._map, META_AT - 4)
        try:
            return json.loads(bytes(self._map[META_AT : META_AT + length]))
        except ValueError as error:  # rewritten while read (a new phase): the next poll reads it whole
            raise StreamError(f"{self.path}'s header is being rewritten") from error

    @property
    def written(self) -> int:
        """Records the process has written so far."""
        return _COUNT.unpack_from(self._map, WRITTEN_AT)[0]

    @property
    def closed(self) -> bool:
        """True once the process wrote its final summary."""
        return _COUNT.unpack_from(self._map, CLOSED_AT)[0] == 1

    def rows(self) -> list[Row]:
        """The records written since the last call, oldest first."""
        written = self.written
        if written == self.read:
            return []
        try:
            self.meta = self._read_meta()  # the layouts of what is about to be read are in it
        except StreamError:
            return []
        start = max(self.read, written - self.capacity)
        raw = [
            _WHOLE.unpack_from(self._map, HEADER_BYTES + (i % self.capacity) * RECORD_BYTES)
            for i in range(start, written)
        ]
        # Records the writer overwrote while they were being read are dropped with those it overwrote before.
        intact = max(start, self.written - self.capacity)
        raw = raw[intact - start :]
        self.lost += intact - self.read
        self.read = written
        layouts = self.meta["layouts"]
        found = []
        for values in raw:
            if values[0] == PACED:  # no phases: the slots after its fields hold whatever the ring held there
                found.append(Row(PACED, values[1], values[2], values[3], None, {}))
                continue
            names = layouts[values[5]]
            phases = dict(zip(names, values[FIELDS : FIELDS + len(names)], strict=True))
            if values[5] == 0:  # the fixed layout holds every phase: the step had those with time in them
                phases = {name: ns for name, ns in phases.items() if ns}
            found.append(Row(values[0], values[1], values[2], values[3], values[4] if values[4] >= 0 else None, phases))
        return found


@dataclass
class Followed:
    """One process's stream, folded as it is read: the figures its summary would hold so far."""

    reader: StreamReader
    recorder: Recorder = field(default_factory=lambda: Recorder(warmup=0))
    passes: EvalPasses = field(default_factory=EvalPasses)
    warmup_steps: int = 0
    last_at_ns: int | None = None  # when the last record was written (CLOCK_MONOTONIC ns)
    window_ns: list[int] | None = None  # [start, end] of the measured steps and passes
    # CLOCK_MONOTONIC ns of this host when it last saw a new record: a remote stream's own clock is not ours
    seen_new_ns: int = field(default_factory=time.monotonic_ns)
    # the series point of each recent measured step, by index: where its PACED record's time goes
    series_at: dict[int, int] = field(default_factory=dict)

    @property
    def meta(self) -> dict[str, Any]:
        return self.reader.meta

    def poll(self) -> int:
        """Fold the records written since the last poll; returns how many."""
        rows = self.reader.rows()
        for row in rows:
            if row.kind == EVAL_PASS:
                self.passes.add(row.wall_ns, row.phases_ns, batches=row.samples or 0)
                if self.recorder.measured:
                    self._widen(row)
            elif row.kind == PACED:
                self.recorder.add_excess(self.series_at.pop(row.index, -1), row.wall_ns)
            else:
                record = StepRecord(row.index, row.wall_ns, row.phases_ns, row.samples)
                if row.kind == MEASURED:
                    self.recorder.add(record)
                    self._widen(row)
                    self.series_at[row.index] = record.series_at
                    if len(self.series_at) > MAX_UNPACED:
                        del self.series_at[next(iter(self.series_at))]  # the oldest: a step never paced
                else:
                    self.warmup_steps += 1
                    self.recorder.series.add(row.wall_ns)
            self.last_at_ns = row.at_ns
        if rows:
            self.seen_new_ns = time.monotonic_ns()
        return len(rows)

    def _widen(self, row: Row) -> None:
        start = row.at_ns - row.wall_ns
        if self.window_ns is None:
            self.window_ns = [start, row.at_ns]
        else:
            self.window_ns[1] = row.at_ns

    @property
    def last_written_s(self) -> float | None:
        """Unix time (s) of the last record read: the process was alive then."""
        if self.last_at_ns is None:
            return None
        return (self.last_at_ns + self.meta.get("unix_offset_ns", 0)) / 1e9

    @property
    def steps(self) -> int:
        """Steps closed so far, warm-up included."""
        return self.warmup_steps + self.recorder.measured

    def summary(self) -> RunSummary:
        """The summary the process would write now, from its stream alone: steps, phases, throughput (at the GPU's
        pace where the process found its GPU behind the host), wall window, validation passes and who it is (no
        system figures, no device time per phase: those are the process's own)."""
        summary = summarize(self.recorder, "host")
        summary.steps = Steps(warmup=self.warmup_steps, measured=self.recorder.measured)
        # The process's own Meta, as its header holds it; the figures here are its host time only.
        summary.meta = dataclasses.replace(
            Meta(**{f.name: self.meta[f.name] for f in dataclasses.fields(Meta) if f.name in self.meta}), timing="host"
        )
        if self.window_ns is not None and summary.steps.measured:
            window_s = (self.window_ns[1] - self.window_ns[0]) / 1e9
            steps_s = self.recorder.paced_s
            eval_s = self.passes.durations.total
            window_s = max(window_s, steps_s + eval_s)  # records written late (a step held for a pass) end later
            summary.wall = Wall(
                window_s=window_s, steps_s=steps_s, eval_s=eval_s, between_s=window_s - steps_s - eval_s
            )
            add_wall_rates(summary)
        summary.eval = self.passes.to_dict(wall_s=summary.wall.window_s if summary.wall else 0.0)
        if self.reader.lost:
            summary.notes.append(
                f"{self.reader.lost:,} step(s) of the stream were overwritten before they were read; the figures "
                "leave them out."
            )
        return summary


def find_streams(folder: Path) -> list[Path]:
    """The stream files in a run folder, by name."""
    return sorted(folder.glob(f"stream-*{SUFFIX}"))
