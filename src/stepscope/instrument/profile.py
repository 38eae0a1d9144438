"""Capturing a few representative steps: torch.profiler on a schedule, phase ranges, and an Nsight Systems window.

- `ProfileWindow` runs torch.profiler with ``schedule(wait, warmup, active, repeat)`` counted in training steps
  from the first measured step (after the Scope's own warm-up), and writes each active window to
  ``DIR/rank<R>.step<N>.pt.trace.json.gz``: one file per rank and window, never overwritten by another rank.
- Phase ranges: while a profiler window or NVTX is on, every phase is also a ``record_function`` /
  NVTX range named ``stepscope/<phase>``, so the trace shows data_wait/forward/backward/optimizer.
- `NsysWindow` calls ``cudaProfilerStart``/``cudaProfilerStop`` around the chosen steps, for
  ``nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop``.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepscope.instrument import RANGE_PREFIX

log = logging.getLogger("stepscope")


@dataclass
class ProfileWindow:
    """Which steps torch.profiler records, and how much detail (each option makes traces larger).

    Steps count from the first measured step: ``wait`` steps idle, ``warmup`` steps profiled and discarded,
    ``active`` steps recorded; ``repeat`` cycles (0: until the run ends).
    """

    wait: int = 1
    warmup: int = 1
    active: int = 3
    repeat: int = 1
    dir: str = "stepscope-traces"
    record_shapes: bool = False
    with_stack: bool = False  # Python stack events: often most of a trace's size
    profile_memory: bool = False

    def __post_init__(self) -> None:
        for name in ("wait", "warmup", "repeat"):
            if getattr(self, name) < 0:
                raise ValueError(f"ProfileWindow.{name} must be >= 0, got {getattr(self, name)}")
        if self.active < 1:
            raise ValueError(f"ProfileWindow.active must be >= 1, got {self.active}")


@dataclass
class NsysWindow:
    """Steps [start, stop) between cudaProfilerStart and cudaProfilerStop; steps count from 0, warm-up included."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop:
            raise ValueError(f"the Nsight window needs 0 <= START < STOP, got {self.start}:{self.stop}")

    @classmethod
    def parse(cls, text: str) -> NsysWindow:
        """``"START:STOP"`` → NsysWindow."""
        try:
            start, stop = (int(part) for part in text.split(":"))
        except ValueError:
            raise ValueError(f"expected START:STOP step numbers like 20:30, got {text!r}") from None
        return cls(start, stop)


def process_rank() -> int:
    """This process's rank: torch.distributed's when initialised, else the launcher's RANK, else 0."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return int(os.environ.get("RANK", "0") or 0)


class Ranges:
    """Named ranges around phases: torch.profiler ``record_function`` and/or NVTX."""

    def __init__(self, record_function: bool, nvtx: bool) -> None:
        import torch

        self._stack: list[Any] = []
        self._record = torch.autograd.profiler.record_function if record_function else None
        self._nvtx = None
        if nvtx:
            if not torch.cuda.is_available():
                raise ValueError("NVTX ranges need a CUDA build of torch and a GPU; torch sees no CUDA device.")
            self._nvtx = torch.cuda.nvtx

    def push(self, name: str) -> None:
        """Open the range ``stepscope/<name>``."""
        label = RANGE_PREFIX + name
        handle = None
        if self._record is not None:
            handle = self._record(label)
            handle.__enter__()
        self._stack.append(handle)
        if self._nvtx is not None:
            self._nvtx.range_push(label)

    def pop(self) -> None:
        """Close the innermost open range."""
        handle = self._stack.pop()
        if handle is not None:
            handle.__exit__(None, None, None)
        if self._nvtx is not None:
            self._nvtx.range_pop()


class NoRanges:
    """No ranges: what phases push and pop when nothing is being captured."""

    def push(self, name: str) -> None:
        return None

    def pop(self) -> None:
        return None


NO_RANGES = NoRanges()


class Profiler:
    """torch.profiler on `ProfileWindow`'s schedule, started at the first measured step, stepped at each step."""

    def __init__(self, window: ProfileWindow) -> None:
        import torch
        from torch.profiler import ProfilerAction, ProfilerActivity, profile, schedule

        self.window = window
        self.files: list[Path] = []
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._profile = profile(
            activities=activities,
            schedule=schedule(wait=window.wait, warmup=window.warmup, active=window.active, repeat=window.repeat),
            on_trace_ready=self._write,
            record_shapes=window.record_shapes,
            with_stack=window.with_stack,
            profile_memory=window.profile_memory,
        )
        self._running = False
        self._first_step = 0
        self._idle = ProfilerAction.NONE

    def start(self, first_step: int = 0) -> None:
        """Begin counting steps at training step ``first_step`` (nothing is recorded until the profiler's warm-up)."""
        self._first_step = first_step
        self._profile.start()
        self._running = True

    @property
    def recording(self) -> bool:
        """Whether this profiler records the current step (its warm-up or active steps)."""
        return self._running and self._profile.current_action != self._idle

    def step(self) -> bool:
        """One training step ended; returns whether the profiler was recording it (its warm-up or active steps):
        those steps carry the profiler's overhead and are left out of the step statistics."""
        recorded = self._profile.current_action != self._idle
        self._profile.step()
        return recorded

    def stop(self) -> None:
        """Stop; a window still recording is written."""
        if self._running:
            self._running = False
            self._profile.stop()

    def _write(self, prof: Any) -> None:
        directory = Path(self.window.dir)
        directory.mkdir(parents=True, exist_ok=True)
        # on_trace_ready runs at the step() that ends the active window; name the file by training step
        w = self.window
        cycle = w.wait + w.warmup + w.active
        done = prof.step_num - 1  # the last profiler step that ended
        first = self._first_step + done // cycle * cycle + w.wait + w.warmup
        last = max(self._first_step + done, first)
        path = directory / f"rank{process_rank()}.step{first}-{last}.pt.trace.json.gz"
        prof.export_chrome_trace(str(path))
        self.files.append(path)
        size = file_size(path.stat().st_size)
        print(f"stepscope: trace of steps {first}-{last} written to {path} ({size})", file=sys.stderr)


def file_size(size_bytes: int) -> str:
    """A file size in bytes as people read it: "824 B", "24.0 KB", "3.1 MB", "1.20 GB" (powers of 1000)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if size_bytes >= scale:
            return f"{size_bytes / scale:.2f} {unit}" if unit == "GB" else f"{size_bytes / scale:.1f} {unit}"
    return f"{size_bytes} B"


class NsysRange:
    """cudaProfilerStart at step ``start``, cudaProfilerStop at step ``stop`` (0-based, warm-up included)."""

    def __init__(self, window: NsysWindow) -> None:
        import torch

        if not torch.cuda.is_available():
            raise ValueError("the Nsight Systems window needs a CUDA device; torch sees none.")
        self.window = window
        self._cuda_profiler = torch.cuda.profiler
        self.started = False

    def at_step(self, step: int) -> bool:
        """Called with the index of the step about to begin; returns False (the step is measured as usual)."""
        if step == self.window.start:
            self._cuda_profiler.start()
            self.started = True
        elif step == self.window.stop and self.started:
            self._cuda_profiler.stop()
            self.started = False
        return False

    def stop(self) -> None:
        """End the capture if the run ends inside the window."""
        if self.started:
            self._cuda_profiler.stop()
            self.started = False
