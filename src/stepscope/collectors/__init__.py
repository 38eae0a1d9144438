"""System collectors: a background sampler of the host (psutil), the GPUs (NVML) and torch's device memory.

    handle = start_collectors(interval_s=1.0, devices=[0])
    ...                                   # training; handle.snapshot() gives the latest sys/ readings
    system = handle.stop(steps=120, samples=3840)   # RunSummary.system

Fields, units and signals are described in docs/collectors.md.
"""

from stepscope.collectors.nvml import NvmlBackend, NvmlUnavailable, NvmlUnsupported, PynvmlBackend
from stepscope.collectors.sampler import Collectors
from stepscope.collectors.signals import derive_signals
from stepscope.collectors.start import start_collectors

__all__ = [
    "Collectors",
    "NvmlBackend",
    "NvmlUnavailable",
    "NvmlUnsupported",
    "PynvmlBackend",
    "derive_signals",
    "start_collectors",
]
