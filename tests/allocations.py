"""What a loop leaves allocated: the check behind "a disabled feature allocates nothing per call"."""

from __future__ import annotations

import gc
import os
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass

import stepscope


@dataclass
class Growth:
    """Memory a loop kept and peaked at (bytes, over the start), and stepscope's files whose block count changed."""

    kept: int
    peak: int
    grown_files: list[str]


def growth(loop: Callable[[int], None], calls: int) -> Growth:
    """Run ``loop(10)`` to warm lazily created state, then measure ``loop(calls)`` with tracemalloc."""
    loop(10)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        current_before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        loop(calls)
        current_after, peak = tracemalloc.get_traced_memory()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    package = os.path.dirname(stepscope.__file__)
    grown = [
        str(stat.traceback[0].filename)
        for stat in after.compare_to(before, "filename")
        if stat.traceback[0].filename.startswith(package) and stat.count_diff != 0
    ]
    return Growth(current_after - current_before, peak - current_before, grown)
