"""start_collectors: build the sources this process can use and start sampling, without ever raising."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from stepscope.collectors.gpu import GpuSource, warn_once
from stepscope.collectors.nvml import NvmlBackend, NvmlUnavailable, PynvmlBackend
from stepscope.collectors.sampler import Collectors, Source, check_interval
from stepscope.collectors.stacks import NO_STACKS, NoStacks, PhaseOf, StackSampler

log = logging.getLogger("stepscope")

NO_DEVICES = "this process uses no CUDA device."


def start_collectors(
    interval_s: float = 1.0,
    devices: Sequence[int] = (),
    nvml: NvmlBackend | None = None,
    stack_sample_hz: float | None = None,
    phase_of: PhaseOf | None = None,
) -> Collectors:
    """Start sampling the host and, for the CUDA ``devices`` this process uses, the GPUs; return the handle.

    Args:
        interval_s: seconds between samples, 0.05 (20 Hz) or more; 1.0 costs well under 1% of a core.
        devices: CUDA indices in use (``[torch.cuda.current_device()]`` in a single-GPU process; [] for none).
        nvml: an NVML backend (tests pass a fake); None uses nvidia-ml-py when installed.
        stack_sample_hz: also sample the calling thread's stack this often (collectors/stacks.py), attributing
            each sample to ``phase_of(frame)``; None samples no stacks. Call this from the training thread.

    Raises ValueError for an invalid ``interval_s`` and nothing else: a source that cannot be set up (no psutil,
    no NVML, no permission) is left out, and ``stop()`` says why in its notes or in ``gpu.reason``.
    """
    interval_s = check_interval(interval_s)
    devices = list(devices)
    sources: list[Source] = []
    notes: list[str] = []
    sections: dict[str, dict[str, Any]] = {}
    try:
        from stepscope.collectors.host import HostSource

        sources.append(HostSource())
    except Exception as error:
        notes.append(f"host figures are missing: {_why(error)}")
    if devices:
        try:
            sources.append(GpuSource.open(nvml if nvml is not None else PynvmlBackend(), devices))
        except Exception as error:
            reason = str(error) if isinstance(error, NvmlUnavailable) else f"NVML could not be started: {_why(error)}"
            warn_once(reason)
            sections["gpu"] = {"available": False, "reason": reason, "devices": []}
    else:
        sections["gpu"] = {"available": False, "reason": NO_DEVICES, "devices": []}
    stacks: StackSampler | NoStacks = NO_STACKS
    if stack_sample_hz is not None and phase_of is not None:
        try:
            stacks = StackSampler(threading.get_ident(), phase_of, stack_sample_hz)
        except Exception as error:
            notes.append(f"source lines are not sampled: {_why(error)}")
    try:
        collectors = Collectors(sources, interval_s, devices, sections, notes, stacks=stacks)
    except Exception as error:  # a bug building the handle: hand back one that measures nothing but says why
        collectors = Collectors([], interval_s, devices, sections, [*notes, f"the collectors failed: {_why(error)}"])
    try:
        collectors.start()
    except Exception as error:  # e.g. "can't start new thread" in a process at its thread limit
        collectors._notes.append(f"the sampler thread could not start: {_why(error)}")
    return collectors


def _why(error: BaseException) -> str:
    if isinstance(error, ImportError):
        return f"{error.name or 'a module'} is not installed."
    return f"{type(error).__name__}: {error}."
