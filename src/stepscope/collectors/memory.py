"""Device memory as torch's caching allocator saw it: peaks, allocation retries, out-of-memory errors.

Read once, when the collectors stop: the peaks and counters are cumulative, so sampling them adds nothing. Only
when torch is already imported and CUDA already initialised (this never initialises CUDA), and never with a
``torch.cuda.synchronize``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

MB = 2**20


def device_memory(devices: Sequence[int]) -> dict[str, Any]:
    """``{"max_allocated_mb", "max_reserved_mb", "alloc_retries", "ooms", "devices"}`` over CUDA ``devices``, or
    {} when CUDA is not in use. With several devices the peaks are the largest device's (MB) and the counts are
    summed."""
    torch = sys.modules.get("torch")
    if torch is None or not devices or not torch.cuda.is_initialized():
        return {}
    allocated, reserved, retries, ooms = [], [], 0, 0
    for index in devices:
        allocated.append(torch.cuda.max_memory_allocated(index) / MB)
        reserved.append(torch.cuda.max_memory_reserved(index) / MB)
        stats = torch.cuda.memory_stats(index)
        retries += int(stats.get("num_alloc_retries", 0))
        ooms += int(stats.get("num_ooms", 0))
    return {
        "max_allocated_mb": round(max(allocated), 1),
        "max_reserved_mb": round(max(reserved), 1),
        "alloc_retries": retries,
        "ooms": ooms,
        "devices": list(devices),
    }
