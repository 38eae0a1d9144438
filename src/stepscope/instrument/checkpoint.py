"""Checkpoints on time: the summary so far every ``--checkpoint-s`` seconds, and where a stalled process waits.

A rank blocked in a collective closes no step, so a checkpoint written at step boundaries never comes, and the
SIGKILL that ends such a rank (torchrun's, after its SIGTERM went unanswered) loses its figures. A daemon thread
therefore writes a checkpoint whenever ``--checkpoint-s`` seconds passed without one. When it finds that no step
closed since its previous look, it records where the training thread is (its Python stack, read with
``sys._current_frames()``: no ptrace, no signal): the innermost line of the user's code, the library function that
line called, and whether that is a torch.distributed collective. The record goes into the summary's
``exit.hung``, so the merged report can say "rank 1 hung in time.sleep at train.py:42", and is dropped as soon as a
step closes again.

Consistency: the recorder is changed only when a step closes, so the thread reads the figures while holding a lock
that ``close_step`` takes too (an uncontended acquire per step). The step that closes while a checkpoint is being
written waits for it; that can only happen after a stall of a whole interval.
"""

from __future__ import annotations

import linecache
import sys
import threading
import time
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

from stepscope.collectors.stacks import OWN, USER, CodeKinds, qualified_name

STACK_LINES = 8  # user frames kept in a stall's stack, innermost first
# A stall inside these phases of a multi-rank run waits for the other ranks (collectives run inside them).
PEER_WAIT_PHASES = frozenset({"forward", "backward", "comms", "optimizer", "sync"})
STOP_WAIT_S = 5.0  # the exit waits this long at most for a checkpoint being written


def _ranks() -> int:
    """The world size of torch.distributed's default group (1 when there is none)."""
    dist = sys.modules.get("torch.distributed")
    try:
        return dist.get_world_size() if dist is not None and dist.is_available() and dist.is_initialized() else 1
    except Exception:
        return 1


def where_blocked(frame: FrameType | None, kinds: CodeKinds) -> dict[str, Any]:
    """Where a thread whose innermost frame is ``frame`` is: ``where`` (file:line of the innermost user line),
    ``code`` (that source line), ``calls`` (the library function it called, e.g.
    ``torch.distributed.distributed_c10d.all_reduce``), ``collective`` (whether a torch.distributed function is on
    the stack) and ``stack`` (up to ``STACK_LINES`` user frames as ``file:line function``, innermost first)."""
    # Read the chain first: classifying a file stats it (the GIL is released) and the frames could move on.
    chain: list[tuple[CodeType, int, str]] = []
    while frame is not None:
        chain.append((frame.f_code, frame.f_lineno, qualified_name(frame)))
        frame = frame.f_back
    found: dict[str, Any] = {"where": None, "code": None, "calls": None, "collective": False, "stack": []}
    called: str | None = None
    for code, line, name in chain:
        if name.startswith("torch.distributed.") and not name.startswith("torch.distributed.elastic."):
            found["collective"] = True
        kind = kinds.kind(code)
        if kind != USER:
            # The innermost library function wins for a collective (all_reduce, not the logger's wrapper around it);
            # otherwise the outermost one, the function the user's line called.
            if kind != OWN and not (called and called.startswith("torch.distributed.")):
                called = name
            continue
        if found["where"] is None:
            found["where"] = f"{code.co_filename}:{line}"
            found["code"] = linecache.getline(code.co_filename, line).strip() or None
            found["calls"] = called
        if len(found["stack"]) < STACK_LINES:
            found["stack"].append(f"{code.co_filename}:{line} {code.co_qualname}")
    if found["where"] is None:
        found["calls"] = called
    return found


class Checkpoints:
    """Writes checkpoints on time from a daemon thread and notices a training thread that stopped closing steps.

    Args:
        tracker: the process's Tracker (its scope's recorder counts the steps closed).
        write: writes the summary so far (called under ``lock``, from this thread or at a step boundary).
        interval_s: seconds between checkpoints (``--checkpoint-s``).
        thread_id: the training thread's ``threading.get_ident()``.
    """

    def __init__(self, tracker: Any, write: Callable[[], None], interval_s: float, thread_id: int) -> None:
        self.lock = threading.RLock()
        self._tracker = tracker
        self._write = write
        self._interval_s = interval_s
        self._thread_id = thread_id
        self._kinds = CodeKinds()
        self._stop = threading.Event()
        self._last_write = time.monotonic()
        self._steps = -1
        self._progress_at = time.monotonic()
        self._stall: dict[str, Any] | None = None
        self._started_at = time.time()
        self._thread = threading.Thread(target=self._run, name="stepscope-checkpoints", daemon=True)

    def start(self) -> None:
        """Guard the tracker's step close with the lock, and start the thread."""
        close = self._tracker.close_step

        def close_step() -> None:
            with self.lock:
                close()

        self._tracker.close_step = close_step
        self._thread.start()

    def on_step(self) -> None:
        """A checkpoint due at a step boundary (the tracker's ``on_checkpoint``)."""
        with self.lock:
            self._last_write = time.monotonic()
            self._write()

    def stall(self) -> dict[str, Any] | None:
        """Where the training thread waits, while no step has closed since a checkpoint found it there."""
        stall = self._stall
        if stall is None or self._steps_closed() != self._steps:
            return None
        return dict(stall)

    def stop(self) -> None:
        """No checkpoint after this returns (the final summary is about to be written)."""
        self._stop.set()
        if self.lock.acquire(timeout=STOP_WAIT_S):  # a checkpoint being written finishes first
            self.lock.release()

    def _steps_closed(self) -> int:
        return self._tracker.scope._recorder.steps_seen

    def _watching(self) -> bool:
        tracker = self._tracker
        # After the requested steps the hooks stop closing steps on purpose (a loader ceiling, the stop): no stall.
        return tracker.active and not tracker.stop_due and not tracker.stopped and tracker.failure is None

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s / 2):
            try:
                self._tick()
            except Exception as error:  # never the script's problem: say so once and stop checkpointing
                print(
                    f"stepscope: checkpoints stopped ({type(error).__name__}: {error}); the script runs on.",
                    file=sys.stderr,
                )
                return

    def _tick(self) -> None:
        now = time.monotonic()
        steps = self._steps_closed()
        if steps != self._steps:
            self._steps, self._progress_at, self._stall = steps, now, None
        elif self._stall is None and now - self._progress_at >= self._interval_s and self._watching():
            frame = sys._current_frames().get(self._thread_id)
            if frame is not None:
                stall = {"since": self._last_step_at(), "steps": steps, **where_blocked(frame, self._kinds)}
                # The phase open there tells a wait in a collective that no Python frame shows: DDP's gradient
                # all-reduce is waited for inside autograd's backward, FSDP's all-gathers inside forward, a hung
                # NCCL kernel at the next sync.
                stall["phase"] = self._tracker.phase_at(frame)
                peers = stall["phase"] in PEER_WAIT_PHASES and _ranks() > 1
                stall["collective"] = stall["collective"] or peers
                self._stall = stall
            del frame  # a frame keeps its locals alive
        if now - self._last_write < self._interval_s:
            return
        with self.lock:
            if self._stop.is_set():
                return
            self._last_write = time.monotonic()
            self._write()

    def _last_step_at(self) -> float:
        """Unix time of the last step close (the start of the open step), or when watching began."""
        scope = self._tracker.scope
        start_ns = scope._step_start_ns
        if start_ns is None or self._steps_closed() == 0:
            return self._started_at
        return time.time() - (scope._clock() - start_ns) / 1e9
