"""The training process's memory allocator: which one it is, how often the kernel faults pages into the process
during the measured steps, what one such fault costs on this machine, and glibc's thresholds.

glibc's malloc gives large freed blocks back to the kernel: a block above its mmap threshold is unmapped when freed,
and free memory above the trim threshold at the top of the heap is returned. A training step that allocates and
frees activations of a few hundred KB can then hand them back every step and fault every page in again in the next
one. Its thresholds start at 128 KB and move with what the process freed before, so the same script churns or not
depending on what ran first (on a 2-core VM, `tests/scripts/malloc_churn.py` took 380-910 page faults a step in
five identical runs). Fixed thresholds, or a pooling allocator (jemalloc, TCMalloc), keep the pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import platform
import resource
import time

GLIBC_MAX_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc refuses a larger mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
TUNING_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")
POOLING = ("jemalloc", "tcmalloc", "mimalloc")
# The pooling allocators `--apply malloc.allocator` can preload, by the names their libraries go by
PRELOADABLE = {"jemalloc": ("jemalloc",), "tcmalloc": ("tcmalloc_minimal", "tcmalloc")}
INSTALL_HINT = {"jemalloc": "apt-get install libjemalloc2", "tcmalloc": "apt-get install libtcmalloc-minimal4"}
CHURN_BLOCK = 256 * 1024  # the calibration's block: an activation of a small model
CHURN_ROUNDS = 16  # 1,024 faults of 4 KB pages: ~5 ms here, once, when the run ends


def minor_faults(native_id: int) -> int:
    """Minor page faults so far of one thread of this process, by native id: the training thread's own, not those
    of stepscope's samplers or the script's other threads. The whole process's where /proc cannot tell threads
    apart."""
    try:
        with open(f"/proc/self/task/{native_id}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after "(comm)", which may hold spaces
        return int(fields[7])  # minflt, the 10th field of stat(5)
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def allocator() -> str:
    """The malloc this process runs on: a pooling allocator mapped into it (jemalloc, tcmalloc, mimalloc, by
    LD_PRELOAD or linking), else "glibc" on glibc, else "other"."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        maps = ""
    for name in POOLING:
        if f"lib{name}" in maps:
            return name
    return "glibc" if platform.libc_ver()[0] == "glibc" else "other"


def pooling_library(name: str) -> str | None:
    """The shared library of pooling allocator ``name`` (jemalloc, tcmalloc) as the dynamic linker finds it, e.g.
    ``libjemalloc.so.2`` (what LD_PRELOAD takes); None when it is not installed."""
    for library in PRELOADABLE.get(name, ()):
        found = ctypes.util.find_library(library)
        if found:
            return found
    return None


def tuned_in_env() -> list[str]:
    """The environment's settings of glibc's malloc thresholds, as ``NAME=VALUE``."""
    found = [f"{name}={os.environ[name]}" for name in TUNING_ENV if name in os.environ]
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    found += [f"GLIBC_TUNABLES={part}" for part in tunables.split(":") if part.startswith("glibc.malloc.")]
    return found


def us_per_fault(block: int = CHURN_BLOCK, rounds: int = CHURN_ROUNDS) -> float:
    """What one page fault of allocator churn costs on this machine now, µs: a block mapped, each page written,
    and unmapped, as glibc does with a freed block (a VM's nested paging makes it several µs)."""
    page = mmap.PAGESIZE
    start = time.perf_counter_ns()
    for _ in range(rounds):
        mapped = mmap.mmap(-1, block)
        for offset in range(0, block, page):
            mapped[offset] = 1
        mapped.close()
    return (time.perf_counter_ns() - start) / 1e3 / (rounds * (block // page))


def threshold_env(mmap_threshold: int) -> dict[str, str]:
    """The environment that fixes glibc's thresholds from a process's first malloc: the mmap threshold at
    ``mmap_threshold`` bytes and the trim threshold at twice it. Set before the interpreter starts, the heap is laid
    out under them from the start; mallopt in a running process leaves what was already freed and placed as it was."""
    return {"MALLOC_MMAP_THRESHOLD_": str(mmap_threshold), "MALLOC_TRIM_THRESHOLD_": str(2 * mmap_threshold)}


def set_thresholds(mmap_threshold: int) -> None:
    """Fix glibc's mmap threshold at ``mmap_threshold`` bytes and its trim threshold at twice that (the ratio its
    own dynamic rule keeps), for this process and the processes it forks; ValueError when glibc refuses."""
    libc = ctypes.CDLL(None)
    if not (libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold) and libc.mallopt(M_TRIM_THRESHOLD, 2 * mmap_threshold)):
        raise ValueError(f"glibc's mallopt refused an mmap threshold of {mmap_threshold} bytes")
