"""Following a run's step streams from outside its processes: while it runs, and after they died.

``stepscope run`` (and ``stepscope watch``, from anywhere the run folder can be read) polls every stream in the
folder about twice a second. What it reads gives the live progress, tells a process that stopped closing steps
(no step for ``hang_after`` times its median step), and, once the command has ended, the summary of each process
that left none (SIGKILL, ``os._exit``, an abort, a segfault) or only a checkpoint: built from its stream up to its
last completed step, over the checkpoint's other figures when there is one. See stream.py for the file.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from stepscope.instrument import HANG_AFTER, MIN_HANG_S
from stepscope.invariants import check
from stepscope.stream import Followed, StreamError, StreamReader, find_streams
from stepscope.summary import Exit, RunSummary, is_final, read_summaries

POLL_S = 0.5


class Progress(Protocol):
    """What shows a run's progress: told after every poll, closed when the run ends."""

    def update(self, follow: Follow) -> None: ...

    def close(self, follow: Follow) -> None: ...


class NoProgress:
    """Shows nothing (``--progress none``; the runs of ab, verify and tune)."""

    def update(self, follow: Follow) -> None:
        return None

    def close(self, follow: Follow) -> None:
        return None


NO_PROGRESS = NoProgress()


@dataclass
class Stall:
    """A process that closed no step for much longer than its steps take."""

    rank: int | None
    pid: int | None
    hostname: str
    steps: int  # steps it closed (warm-up included)
    quiet_s: float  # since its last step (s)
    median_step_ms: float
    waits: str | None = None  # where it waits, from its last checkpoint (``exit.hung``), once one found it there

    def describe(self) -> str:
        """E.g. "rank 1 (pid 4242) has closed no step for 41.0 s after step 412 (its median step: 10.3 ms), waiting
        in torch.distributed.distributed_c10d.all_reduce at train.py:42"."""
        who = f"rank {self.rank}" if self.rank is not None else "the process"
        pid = f" (pid {self.pid})" if self.pid is not None else ""
        waits = f", waiting {self.waits}" if self.waits else ""
        return (
            f"{who}{pid} has closed no step for {self.quiet_s:.1f} s after step {self.steps} "
            f"(its median step: {self.median_step_ms:.1f} ms){waits}"
        )


class Follow:
    """The step streams of one run's processes, read as they are written.

    Args:
        folder: the run folder the processes write into.
        launch_id: only streams of this launch (a shared ``--out`` folder holds other runs' too); None: those of
            ``jobs``, or of the newest stream's job.
        progress: shown after each poll.
        hang_after: a process is stalled after this many of its median steps without one ...
        min_hang_s: ... and at least this many seconds.
    """

    def __init__(
        self,
        folder: Path,
        launch_id: str | None = None,
        progress: Progress = NO_PROGRESS,
        hang_after: float = HANG_AFTER,
        min_hang_s: float = MIN_HANG_S,
        jobs: set[str | None] | None = None,
    ) -> None:
        self.folder = folder
        self.min_hang_s = min_hang_s
        self.jobs = jobs  # with no launch id: the streams of these jobs (``job_key``); None: the newest stream's
        self.launch_id = launch_id
        self.job: str | None = None  # without a launch id: the job of the newest stream, once one is found
        self.progress = progress
        self.hang_after = hang_after
        self.started_ns = time.monotonic_ns()
        self.streams: dict[Path, Followed] = {}
        self.stalls: dict[tuple[str, int | None], Stall] = {}  # the longest stall of each process, by (host, pid)
        self._skipped: set[Path] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def poll(self) -> None:
        """Read what every stream wrote since the last poll (new streams too), and note stalls."""
        with self.lock:
            paths = [p for p in find_streams(self.folder) if p not in self.streams and p not in self._skipped]
            for path in sorted(paths, key=_modified, reverse=True):
                try:
                    reader = StreamReader(path)
                except StreamError:
                    continue  # being created: the next poll reads it
                if not self._belongs(reader.meta):
                    self._skipped.add(path)
                    continue
                self.streams[path] = Followed(reader)
            for followed in self.streams.values():
                followed.poll()
                self._note_stall(followed)

    def _belongs(self, meta: dict[str, Any]) -> bool:
        """Whether a stream is this run's: its launch's, or (following a folder) the job of the newest stream, whose
        nodes each ran a `stepscope run` of their own."""
        if self.launch_id is not None:
            return meta.get("launch_id") == self.launch_id
        job = job_key(meta)
        if self.jobs is not None:
            return job in self.jobs
        if self.job is None:
            self.job = job
        return job == self.job

    def _note_stall(self, followed: Followed) -> None:
        """Keep the longest stall seen of each process (a stall only grows while it lasts)."""
        stall = self._stall(followed)
        if stall is None:
            return
        key = (stall.hostname, stall.pid)
        longest = self.stalls.get(key)
        if longest is None or stall.quiet_s >= longest.quiet_s:
            self.stalls[key] = stall

    def _stall(self, followed: Followed) -> Stall | None:
        """The process's stall now: no step for ``hang_after`` of its median steps (and ``min_hang_s``)."""
        if followed.reader.closed or not followed.recorder.measured:
            return None
        followed.recorder.fold()
        median_s = followed.recorder.step_stats.quantile(0.5)
        quiet_s = (time.monotonic_ns() - followed.seen_new_ns) / 1e9
        if quiet_s < max(self.min_hang_s, self.hang_after * median_s):
            return None
        meta = followed.meta
        hostname, pid = meta.get("hostname", ""), meta.get("pid")
        return Stall(
            meta.get("rank"), pid, hostname, followed.steps, quiet_s, median_s * 1e3, waits=self._waits(hostname, pid)
        )

    def _waits(self, hostname: str, pid: int | None) -> str | None:
        """Where a stalled process waits, as its last checkpoint found it (after ``--checkpoint-s`` without a step),
        e.g. "in torch.distributed.distributed_c10d.all_reduce at train.py:42"; None before a checkpoint saw it."""
        written, _ = read_summaries(
            self.folder.glob(f"rank*-pid{pid}.json"), lambda s: s.meta.hostname == hostname and s.exit is not None
        )
        for summary in written:
            hung = summary.exit.hung
            if hung and hung.get("where"):
                calls = f"in {hung['calls']} " if hung.get("calls") else ""
                return f"{calls}at {hung['where']}"
        return None

    def stalled(self) -> list[Stall]:
        """The processes stalled now."""
        with self.lock:
            return [stall for followed in self.streams.values() if (stall := self._stall(followed)) is not None]

    def summaries(self) -> list[RunSummary]:
        """Each followed process's summary so far, from its stream alone."""
        with self.lock:
            return [followed.summary() for followed in self.streams.values() if followed.steps]

    def start(self) -> None:
        """Poll from a daemon thread until ``stop``."""
        self._thread = threading.Thread(target=self._run, name="stepscope-follow", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop polling, read what is left, and close the progress display."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        try:
            self.poll()
        finally:
            self.progress.close(self)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.poll()
                self.progress.update(self)
            except Exception as error:  # never the run's problem: what the streams hold is read again at the end
                print(f"stepscope: following the steps stopped ({type(error).__name__}: {error}).", file=sys.stderr)
                return


def job_key(meta: dict[str, Any]) -> str | None:
    """What tells a stream's job apart: the scheduler's or launcher's job id, else the `stepscope run` that started
    it."""
    return meta.get("job_id") or meta.get("launch_id")


def _modified(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _ending(code: int | None, launcher: bool, rank: int | None, ended: bool) -> tuple[str, str]:
    """(exit reason, what happened) of a process that wrote no final summary, from the command's exit code (None:
    not known, to a watch or a merge; ``ended``: the process is known to have ended); a killed one's reads on from
    "the process was"."""
    if code is None and not ended:  # a merge of a folder: its job may still run (as a checkpoint's "running")
        return "running", "the process wrote no final summary (it may still be running, or it died without its exit)"
    if code is None:
        return "error", "the process ended without writing its summary (killed, or it left with os._exit)"
    if launcher:
        who = f"rank {rank}" if rank is not None else "a process of the command"
        return "error", f"{who} ended without writing its summary (the command exited with code {code})"
    if code > 128:
        try:
            name = signal.Signals(code - 128).name
        except ValueError:
            name = f"signal {code - 128}"
        return "killed", f"killed by {name}"
    return "error", f"the process left with code {code} without writing its summary (os._exit, or a native crash)"


def complete(
    summaries: list[RunSummary], follow: Follow, code: int | None, launcher: bool, ended: bool = True
) -> list[RunSummary]:
    """``summaries`` with every followed process that wrote no final summary (none, or only a checkpoint) given one
    from its stream, up to its last completed step (see ``_ending`` for ``code`` and ``ended``)."""
    by_process = {(s.meta.hostname, s.meta.pid): s for s in summaries}
    completed = list(summaries)
    for followed in list(follow.streams.values()):
        meta = followed.meta
        had = by_process.get((meta.get("hostname", ""), meta.get("pid")))
        if (had is not None and is_final(had)) or not followed.steps:
            continue
        rebuilt = from_stream(followed, had, code, launcher, ended)
        if had is not None:
            completed[completed.index(had)] = rebuilt
        else:
            completed.append(rebuilt)
    return completed


def from_stream(
    followed: Followed, checkpoint: RunSummary | None, code: int | None, launcher: bool, ended: bool = True
) -> RunSummary:
    """The summary of a process that died before writing its own: the step figures from its stream; with a
    checkpoint, its other figures (system, loaders, where it waited) from there."""
    streamed = followed.summary()
    summary = streamed
    if checkpoint is not None:
        summary = dataclasses.replace(
            checkpoint,
            steps=streamed.steps,
            phases=_with_device_figures(streamed.phases, checkpoint.phases),
            throughput=dataclasses.replace(
                streamed.throughput,
                flops_per_step=checkpoint.throughput.flops_per_step,
                mfu_peak=checkpoint.throughput.mfu_peak,
            ),
            series=streamed.series,
            wall=streamed.wall,
            eval=streamed.eval or checkpoint.eval,
            notes=[*checkpoint.notes, *streamed.notes],
        )
    reason, how = _ending(code, launcher, followed.meta.get("rank"), ended)
    last = f"{how} after step {followed.steps}"
    hung = checkpoint.exit.hung if checkpoint is not None else None
    # When it was last seen alive: it failed after that, and before a step would have closed (a merged run orders
    # its ranks' failures by this time to name the first).
    summary.exit = Exit(reason=reason, code=code, error=last, hung=hung, at=followed.last_written_s)
    kept = f"its {summary.steps.measured} measured step(s)" + (
        f" (its last checkpoint had {checkpoint.steps.measured})" if checkpoint is not None else ", host time only"
    )
    said = f"the process was {last}" if reason == "killed" else last
    summary.notes.append(f"from the step stream: {said}; the figures are {kept}.")
    return check(summary)


def _with_device_figures(phases: dict[str, Any], checkpointed: dict[str, Any]) -> dict[str, Any]:
    """The stream's phases, with the device times the checkpoint had (the stream holds host time only)."""
    merged = {}
    for name, stats in phases.items():
        old = checkpointed.get(name)
        if old is not None and old.device_mean_ms is not None:
            stats = dataclasses.replace(
                stats,
                device_mean_ms=old.device_mean_ms,
                device_median_ms=old.device_median_ms,
                device_p95_ms=old.device_p95_ms,
                device_share=old.device_share,
                device_host_paced=old.device_host_paced,
            )
        merged[name] = stats
    return merged


def stall_notes(follow: Follow) -> list[str]:
    """What the run's summary says of its stalls: the processes still stalled when the command ended (hung), and
    the longest pause of each other one that stalled and went on."""
    stalled = follow.stalled()
    notes = [f"hung: {stall.describe()} when the command ended." for stall in stalled]
    hung = {(stall.hostname, stall.pid) for stall in stalled}
    for key, stall in follow.stalls.items():
        if key not in hung:
            notes.append(f"stalled, then went on: {stall.describe()}, then closed steps again.")
    return notes
