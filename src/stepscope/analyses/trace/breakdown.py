"""Where one rank's GPU time goes, from its trace columns: pure numpy, with Holistic Trace Analysis' definitions.

HTA 0.5 is the reference (docs/trace-analysis.md states each definition and where stepscope departs from it):

- *window*: HTA drops the last ``ProfilerStep`` (often cut short by the profiler stopping). Host events that start
  before it are kept, and device events only when the runtime call that launched them is kept (by
  ``correlation``); with fewer than two ``ProfilerStep`` names in the job nothing is dropped.
- *kernel span*: first device event start to last device event end; the temporal figures are shares of it.
- *idle*: span minus the union of all device intervals (every stream); *compute*: union of computation kernels;
  *non-compute*: the rest (communication, memory copies and sets, syncs, not overlapped by computation).
- kernel types: communication ``^nccl.*Kernel`` (RCCL names its kernels the same), memory ``^Memcpy|^Memset|^dma``,
  computation anything not matching ``^nccl.*Kernel|.*Memcpy|^Memset|.*Sync``, other the rest.
- *idle breakdown*, per stream, for each gap before a kernel: *host wait* when the launch call started after the
  previous kernel ended (the GPU waited for the host), *kernel wait* when it did not and the gap is under 30 µs
  (back-to-back launch latency), *other* otherwise (e.g. waiting on another stream or an event).
- *overlap*: the share of communication time (union) during which computation runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from stepscope.analyses.trace.events import DEVICE_KINDS, SYNC_NAMES, TraceEvents

COMMUNICATION, MEMORY, COMPUTATION, OTHER = 0, 1, 2, 3
KERNEL_TYPES = ("communication", "memory", "computation", "other")
_COMM = re.compile(r"^nccl.*Kernel")
_MEMORY = re.compile(r"(^Memcpy)|(^Memset)|(^dma)")
_NOT_COMPUTE = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")
PROFILER_STEP = re.compile(r"ProfilerStep")
_SYNC = re.compile("^(" + "|".join(map(re.escape, sorted(SYNC_NAMES))) + ")$")
KERNEL_WAIT_US = 30  # HTA's consecutive_kernel_delay: gaps shorter than this are launch latency
IDLE_KINDS = [DEVICE_KINDS[k] for k in ("kernel", "gpu_memcpy", "gpu_memset", "mtia_ccp_events")]  # not syncs


def kernel_type(name: str) -> int:
    """HTA's kernel type of a device event name: COMMUNICATION, MEMORY, COMPUTATION or OTHER."""
    if _COMM.match(name):
        return COMMUNICATION
    if _MEMORY.match(name):
        return MEMORY
    return OTHER if _NOT_COMPUTE.match(name) else COMPUTATION


def member(values: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Which ``values`` occur in ``table``, by sorting and binary search (np.isin is several times slower on
    millions of correlation ids)."""
    table = np.sort(table)
    if len(table) == 0:
        return np.zeros(len(values), dtype=bool)
    at = np.minimum(np.searchsorted(table, values), len(table) - 1)
    return table[at] == values


def merge(ts: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals [ts, end) as sorted disjoint intervals (touching intervals merge, as in HTA)."""
    if len(ts) == 0:
        return ts, end
    order = np.argsort(ts, kind="stable")
    ts, end = ts[order], end[order]
    reach = np.maximum.accumulate(end)
    starts = np.flatnonzero(np.r_[True, ts[1:] > reach[:-1]])
    return ts[starts], np.maximum.reduceat(end, starts)


def length(intervals: tuple[np.ndarray, np.ndarray]) -> float:
    """Total length of disjoint intervals (µs)."""
    return float(intervals[1].sum() - intervals[0].sum())


def intersection(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> float:
    """Length of the overlap of two sets of disjoint intervals (µs): |A| + |B| - |A ∪ B|."""
    both = merge(np.concatenate([a[0], b[0]]), np.concatenate([a[1], b[1]]))
    return length(a) + length(b) - length(both)


def clip(intervals: tuple[np.ndarray, np.ndarray], lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint intervals cut to the window [lo, hi)."""
    ts, end = np.maximum(intervals[0], lo), np.minimum(intervals[1], hi)
    keep = end > ts
    return ts[keep], end[keep]


@dataclass
class Window:
    """The measured part of a rank's trace: which events count, and the ProfilerSteps inside it."""

    device: np.ndarray  # bool mask over trace.device
    runtime: np.ndarray  # bool mask over trace.runtime
    steps: list[tuple[float, float]]  # (start, end) µs of the ProfilerSteps kept
    dropped_step: bool  # the last ProfilerStep was dropped
    note: str = ""


def profiler_steps(trace: TraceEvents) -> tuple[np.ndarray, np.ndarray, set[str]]:
    """Starts and ends (µs, sorted) of the trace's ProfilerStep ranges, and their distinct names."""
    rows = trace.named(trace.cpu["name"], PROFILER_STEP)
    order = np.argsort(trace.cpu["ts"][rows], kind="stable")
    names = {trace.names[i] for i in set(trace.cpu["name"][rows].tolist())}
    return trace.cpu["ts"][rows][order], trace.cpu["end"][rows][order], names


def window(trace: TraceEvents, job_step_names: int) -> Window:
    """HTA's trimming: drop the last ProfilerStep when the job has at least two ProfilerStep names."""
    starts, ends, _ = profiler_steps(trace)
    everything = Window(np.ones(len(trace.device["ts"]), bool), np.ones(len(trace.runtime["ts"]), bool), [], False)
    everything.steps = list(zip(starts.tolist(), ends.tolist(), strict=True))
    if job_step_names < 2:
        everything.note = "fewer than two ProfilerSteps: the whole trace is analysed"
        return everything
    if len(starts) == 0:
        everything.note = "no ProfilerStep on this rank: the whole trace is analysed"
        return everything
    # HTA cuts at the last ProfilerStep of any host-side row, and GPU annotations have no stream: they count too
    annotations = trace.gpu_annotations
    on_gpu = annotations["ts"][trace.named(annotations["name"], PROFILER_STEP)]
    last_start = max(float(starts[-1]), float(on_gpu.max())) if len(on_gpu) else float(starts[-1])
    runtime = trace.runtime["ts"] < last_start
    kept = trace.runtime["correlation"][runtime]
    if (trace.cpu["ts"] < last_start).any():  # host events without a correlation match device events without one
        kept = np.append(kept, -1)
    device = trace.device
    launched = ((device["stream"] >= 0) & (device["correlation"] >= 0)) | trace.named(device["name"], _SYNC)
    keep = np.where(launched, member(device["correlation"], kept), device["ts"] < last_start)
    steps = [(s, e) for s, e in everything.steps if s < last_start]
    return Window(keep, runtime, steps, True)


@dataclass
class Temporal:
    """Shares (%) of a time basis: GPU idle, computation, and the rest of the device time."""

    basis_us: float
    idle_pct: float
    compute_pct: float
    non_compute_pct: float


@dataclass
class IdleBreakdown:
    """Why the GPU idled: shares (%) of the idle gaps between kernels, summed over streams."""

    host_wait_pct: float
    kernel_wait_pct: float
    other_pct: float
    idle_us: float
    streams: dict[int, dict[str, float]] = field(default_factory=dict)  # stream -> category -> µs


@dataclass
class DeviceTime:
    """The device intervals of a rank's window, split the ways the analyses need."""

    busy: tuple[np.ndarray, np.ndarray]
    by_type: dict[int, tuple[np.ndarray, np.ndarray]]
    types: np.ndarray  # kernel type per kept event
    ts: np.ndarray
    end: np.ndarray
    stream: np.ndarray
    name: np.ndarray
    kind: np.ndarray
    correlation: np.ndarray


def device_time(trace: TraceEvents, win: Window) -> DeviceTime:
    """The kept device events on real streams, their union and the union of each kernel type."""
    device = trace.device
    keep = win.device & (device["stream"] != -1)
    type_of_name = np.fromiter((kernel_type(n) for n in trace.names), dtype=np.int8, count=len(trace.names))
    names = device["name"][keep]
    types = type_of_name[names] if len(names) else np.zeros(0, np.int8)
    ts, end = device["ts"][keep], device["end"][keep]
    by_type = {t: merge(ts[types == t], end[types == t]) for t in range(len(KERNEL_TYPES))}
    return DeviceTime(
        merge(ts, end), by_type, types, ts, end, device["stream"][keep], names, device["kind"][keep],
        device["correlation"][keep],
    )  # fmt: skip


def temporal(dev: DeviceTime, lo: float | None = None, hi: float | None = None) -> Temporal | None:
    """HTA's temporal breakdown over the kernel span, or over the window [lo, hi) (wall basis) when given."""
    busy, compute = dev.busy, dev.by_type[COMPUTATION]
    if len(busy[0]) == 0:
        return None
    if lo is None or hi is None:
        lo, hi = float(busy[0][0]), float(busy[1][-1])
    else:
        busy, compute = clip(busy, lo, hi), clip(compute, lo, hi)
    basis = hi - lo
    if basis <= 0:
        return None
    idle = basis - length(busy)
    computing = length(compute)
    return Temporal(basis, 100 * idle / basis, 100 * computing / basis, 100 * (basis - computing - idle) / basis)


def communication(dev: DeviceTime) -> tuple[float, float] | None:
    """The union of communication kernels (µs) and the part of it that computation overlaps (µs); None without
    communication kernels. ``overlap_pct`` is the second over the first."""
    comm = dev.by_type[COMMUNICATION]
    if len(comm[0]) == 0:
        return None
    return length(comm), intersection(comm, dev.by_type[COMPUTATION])


def idle_breakdown(trace: TraceEvents, win: Window, dev: DeviceTime) -> IdleBreakdown | None:
    """HTA's idle-time breakdown, per stream, summed over streams."""
    rows = np.isin(dev.kind, IDLE_KINDS)
    if not rows.any():
        return None
    runtime = trace.runtime
    corr, launch_ts = runtime["correlation"][win.runtime], runtime["ts"][win.runtime]
    order = np.argsort(corr, kind="stable")
    corr, launch_ts = corr[order], launch_ts[order]
    streams: dict[int, dict[str, float]] = {}
    for stream in sorted(set(dev.stream[rows].tolist())):  # not np.unique: it imports numpy.ma (~10 ms)
        on = rows & (dev.stream == stream)
        order = np.argsort(dev.ts[on], kind="stable")
        ts, end, kc = dev.ts[on][order], dev.end[on][order], dev.correlation[on][order]
        gap = ts[1:] - end[:-1]
        at = np.clip(np.searchsorted(corr, kc[1:]), 0, max(len(corr) - 1, 0))
        found = (corr[at] == kc[1:]) if len(corr) else np.zeros(len(kc) - 1, bool)
        host = found & (np.where(found, launch_ts[at] if len(corr) else 0.0, 0.0) > end[:-1])
        kernel = ~host & (gap < KERNEL_WAIT_US)
        other = ~host & ~kernel
        streams[int(stream)] = {
            "host_wait": float(gap[host].sum()),
            "kernel_wait": float(gap[kernel].sum()),
            "other": float(gap[other].sum()),
        }
    totals = {k: sum(s[k] for s in streams.values()) for k in ("host_wait", "kernel_wait", "other")}
    idle = sum(totals.values())
    if idle == 0:
        return None

    def pct(value: float) -> float:
        return 100 * value / idle

    return IdleBreakdown(pct(totals["host_wait"]), pct(totals["kernel_wait"]), pct(totals["other"]), idle, streams)
