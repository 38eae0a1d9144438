"""`analyze_trace`: one rank per trace file, read in parallel, analysed with HTA's definitions, compared across ranks.

A folder is one job: each file is a rank (``distributedInfo.rank``, else ``rank<N>`` in the file name, else 0).
Files that cannot be read are reported with the reason and the others analysed.
"""

from __future__ import annotations

import re
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from itertools import repeat
from pathlib import Path
from typing import Any

import numpy as np

from stepscope.analyses.trace import breakdown as bd
from stepscope.analyses.trace.collectives import RankCollectives, late_ranks, rank_collectives
from stepscope.analyses.trace.events import TraceEvents, read_trace, trace_files
from stepscope.analyses.trace.ops import OpStat, top_ops
from stepscope.analyses.trace.shares import idle_cores, usable_cores
from stepscope.analyses.trace.steps import step_marks
from stepscope.analyses.trace.stream import TraceReadError
from stepscope.instrument import RANGE_PREFIX
from stepscope.verdict import Verdict

DATALOADER = re.compile(r"enumerate\(DataLoader\)|DataLoader.*__next__")
PHASE_RANGE = re.compile("^" + re.escape(RANGE_PREFIX))  # the phase ranges stepscope's capture writes
ATEN_OP = re.compile(r"^aten::")
# Collectives that are not NCCL kernels (torch symmetric memory, NVSHMEM, custom all-reduce): HTA's definition counts
# them as computation; they are named in a note rather than reclassified, so the figures stay comparable with HTA.
HIDDEN_COLLECTIVE = re.compile(
    r"multimem|nvshmem|symm_mem|one_shot_all_reduce|two_shot_all_reduce|(all_?reduce|all_?gather|reduce_?scatter)"
    r".*kernel",
    re.IGNORECASE,
)
LOSS_FLOOR_PCT = 15.0  # a cause must cost at least this share of the GPU's time to be named the bottleneck
COMPUTE_BOUND_PCT = 60.0
PARALLEL_MIN_BYTES = 8 << 20  # files on disk (gzip: ~100 MB of JSON) before ranks are read in parallel
STRAGGLER_RATIO = 1.05  # a rank whose mean step is 5% above the median of the other ranks' steps

DEFINITIONS = {
    "window": "HTA's: the last ProfilerStep is dropped (device events count when their launch is before it); "
    "a job with fewer than two ProfilerStep names is analysed whole",
    "kernel_span": "first device event start to last device event end on the rank, after the window is applied",
    "idle_pct": "kernel span minus the union of device events on every stream, % of the kernel span",
    "compute_pct": "union of computation kernels, % of the kernel span",
    "non_compute_pct": "kernel span minus compute minus idle: communication, memory copies/sets and syncs that "
    "no computation overlaps, % of the kernel span",
    "kernel types": "communication ^nccl.*Kernel (NCCL and RCCL); memory ^Memcpy|^Memset|^dma; computation: not "
    "^nccl.*Kernel|.*Memcpy|^Memset|.*Sync; other: the rest",
    "idle_breakdown": "per stream, each gap before a kernel: host_wait if its launch call started after the previous "
    "kernel ended, kernel_wait if not and the gap is under 30 µs, other otherwise; % of the gaps summed over streams",
    "overlap_pct": "union of communication kernels during which computation runs, % of the communication union",
    "exposed_comm_pct": "communication not overlapped by computation, % of the kernel span",
    "wall": "the same shares over the window's ProfilerSteps (first step start to last kept step end) instead of "
    "the kernel span",
    "top_kernels": "device events grouped by name, by total duration; pct of the summed durations",
    "data_loading": "host spans named enumerate(DataLoader)... or DataLoader...__next__, per kept ProfilerStep; "
    "gpu_idle_pct: share of their time with no device event running",
    "cpu": "CPU-only traces: union of aten:: ops on the thread with the ProfilerSteps (else the busiest), % of "
    "the window",
    "steps": "ProfilerStep ranges; without them, the marks of stepscope/step, stepscope/optimizer, a user "
    "record_function repeating once per iteration, or Optimizer.step#: n marks give n-1 steps, start to start; "
    "without any, no per-step figure (trace_ms: the whole trace)",
    "top_ops": "CPU-only traces: host events by name over the whole trace, as key_averages(): calls, self time (own "
    "duration minus direct children on the same thread), % of all self time, total time",
    "late_ranks": "collectives matched across ranks by name and order, clocks aligned on their ends; the rank that "
    "starts last is late, the others' time until it starts is waiting; named when that is at least half the others' "
    "communication time, with the part (data, compute, host) of the time before the collectives where it exceeds "
    "the others",
}


@dataclass
class KernelStat:
    """One kernel name's device time (µs) and share (%) of the rank's summed device time."""

    name: str
    type: str
    count: int
    total_us: float
    mean_us: float
    pct: float


@dataclass
class DataLoading:
    """DataLoader spans seen on the host: per step (ms), share of the step (%), and GPU idleness during them (%)."""

    spans: int
    per_step_ms: float | None  # None without step markers
    step_share_pct: float | None
    gpu_idle_pct: float | None
    total_ms: float = 0.0
    trace_share_pct: float | None = None  # share of the whole trace, given when there are no step markers


@dataclass
class CpuShare:
    """CPU-only traces: ATen op time vs everything else on the main thread (% of the window)."""

    thread: int
    basis_ms: float
    computation_pct: float
    other_pct: float


@dataclass
class RankTrace:
    """One rank's figures; percentages of the kernel span unless the field says otherwise (see `DEFINITIONS`)."""

    rank: int
    file: str
    job: str  # the folder the file is in: the files of one folder are the ranks of one job
    rank_source: str
    device_type: str
    steps: int = 0  # ProfilerSteps in the window, else steps between other step marks (`step_source`)
    step_ms: float | None = None  # their mean duration
    step_source: str | None = None  # "ProfilerStep", another marker (see DEFINITIONS["steps"]) or None
    trace_ms: float | None = None  # first event start to last event end: the basis when there are no steps
    kernel_span_ms: float | None = None
    idle_pct: float | None = None
    compute_pct: float | None = None
    non_compute_pct: float | None = None
    overlap_pct: float | None = None
    exposed_comm_pct: float | None = None
    idle_breakdown: dict[str, float] | None = None
    wall: dict[str, float] | None = None
    kernel_types: dict[str, dict[str, float]] = field(default_factory=dict)
    top_kernels: list[KernelStat] = field(default_factory=list)
    data_loading: DataLoading | None = None
    cpu: CpuShare | None = None
    top_ops: list[OpStat] = field(default_factory=list)  # CPU-only traces: as key_averages()
    phases_ms: dict[str, float] = field(default_factory=dict)  # stepscope's phase ranges, mean per step
    notes: list[str] = field(default_factory=list)
    verdict: Verdict = field(default_factory=Verdict)


@dataclass
class TraceFileStatus:
    """What happened to one input file."""

    path: str
    ok: bool
    reason: str = ""
    rank: int | None = None
    events: int = 0
    mb: float = 0.0  # decompressed size
    read_s: float = 0.0


@dataclass
class TraceAnalysis:
    """The result of `analyze_trace`; `to_dict` is the JSON of ``stepscope trace --json``."""

    ranks: list[RankTrace]
    files: list[TraceFileStatus]
    verdict: Verdict
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    spread: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)  # job -> figure -> min/max/...
    late_ranks: list[dict[str, Any]] = field(default_factory=list)  # see collectives.late_ranks, with "job"
    warnings: list[str] = field(default_factory=list)
    read: dict[str, float] = field(default_factory=dict)  # files, ranks, events, mb, seconds, mb_per_s, processes
    definitions: dict[str, str] = field(default_factory=lambda: dict(DEFINITIONS))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data."""
        return asdict(self)


@dataclass
class RankReduction:
    """What one trace file is reduced to before the next is read: its figures, its collectives as arrays and its
    ProfilerStep names; the events themselves are freed. ``rank`` is None when the file could not be read or its
    rank was not asked for."""

    status: TraceFileStatus
    rank: RankTrace | None = None
    collectives: RankCollectives | None = None
    step_names: frozenset[str] = frozenset()
    window_step_names: int = 0  # the ProfilerStep names the window was cut for (see `bd.window`)


def reduce_file(
    path: Path, wanted: frozenset[int] | None, top: int, job_step_names: int | None = None, processes: int = 1
) -> RankReduction:
    """Read one trace and analyse it as its rank (`analyze_rank`), keeping only the result; ``job_step_names``: the
    job's distinct ProfilerStep names when known, else the rank's own (`analyze_trace` re-reduces the rare rank for
    which that changes the window); ``processes``: that may read a large file together (`read_trace`). Unreadable
    files come back with the reason."""
    begin = time.perf_counter()
    try:
        trace = read_trace(path, processes)
    except (TraceReadError, OSError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        return RankReduction(TraceFileStatus(str(path), False, reason, read_s=time.perf_counter() - begin))
    status = TraceFileStatus(
        str(path), True, rank=trace.rank, events=trace.events, mb=trace.bytes_read / 1e6,
        read_s=time.perf_counter() - begin,
    )  # fmt: skip
    if wanted is not None and trace.rank not in wanted:
        return RankReduction(status)
    names = frozenset(bd.profiler_steps(trace)[2])
    window_names = len(names) if job_step_names is None else job_step_names
    rank, collectives = analyze_rank(trace, window_names, top)
    return RankReduction(status, rank, collectives, names, window_names)


def _reduce_all(
    paths: list[Path], wanted: frozenset[int] | None, top: int, jobs: int
) -> tuple[list[RankReduction], int]:
    """Reduce every file, in order; in worker processes (``jobs``, 0: one per usable core) when there is enough to
    read. Each process holds one trace at a time, so memory follows the largest trace, not the folder. Also returns
    the processes used."""
    # worker processes cost ~0.1 s to start: worth it only when there is more to read than that
    if jobs != 1 and len(paths) > 1 and sum(_size(p) for p in paths) >= PARALLEL_MIN_BYTES:
        from concurrent.futures import ProcessPoolExecutor

        workers = min(jobs or usable_cores(), len(paths))
        if workers > 1:
            with ProcessPoolExecutor(max_workers=workers) as pool:
                return list(pool.map(reduce_file, paths, repeat(wanted), repeat(top))), workers
    # one file at a time: a large one may be read by two processes (the parallelism is within the file), which pays
    # only with a core to spare: on a busy machine the second one's share of the work (it decompresses the whole
    # file too) made a 207 MB trace 10-15% slower to read, against 25% faster with a core idle
    # By default never from a process that runs other threads (a training script's, `stepscope run`'s own at its
    # end): the child is forked, and a lock another thread held at that moment stays held in it.
    alone = threading.active_count() == 1
    processes = min(2, jobs) if jobs else 2 if alone and idle_cores() >= 1 else 1
    return [reduce_file(p, wanted, top, processes=processes) for p in paths], 1


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _step_stats(win: bd.Window) -> tuple[int, float | None]:
    durations = [end - start for start, end in win.steps]
    return len(durations), (statistics.fmean(durations) / 1000 if durations else None)


def _kernels(trace: TraceEvents, dev: bd.DeviceTime, top: int) -> tuple[dict[str, dict[str, float]], list[KernelStat]]:
    dur = dev.end - dev.ts
    total = float(dur.sum())
    if total <= 0:
        return {}, []
    types = {}
    for t, label in enumerate(bd.KERNEL_TYPES):
        spent = float(dur[dev.types == t].sum())
        if spent > 0:
            types[label] = {"time_ms": spent / 1000, "pct": 100 * spent / total}
    by_name = np.bincount(dev.name, weights=dur, minlength=len(trace.names))
    counts = np.bincount(dev.name, minlength=len(trace.names))
    stats = []
    present = np.flatnonzero(counts)
    for i in present[np.argsort(-by_name[present], kind="stable")][:top]:
        name = trace.names[i]
        stats.append(
            KernelStat(
                name,
                bd.KERNEL_TYPES[bd.kernel_type(name)],
                int(counts[i]),
                float(by_name[i]),
                float(by_name[i] / counts[i]),
                100 * float(by_name[i]) / total,
            )
        )
    return types, stats


def _hidden_collectives(trace: TraceEvents, dev: bd.DeviceTime) -> str | None:
    rows = trace.named(dev.name, HIDDEN_COLLECTIVE) & (dev.types == bd.COMPUTATION)
    if not rows.any():
        return None
    spent_ms = float((dev.end[rows] - dev.ts[rows]).sum()) / 1000
    names = sorted({trace.names[i] for i in set(dev.name[rows].tolist())})
    return (
        f"{int(rows.sum())} kernel(s) look like collectives outside NCCL ({spent_ms:.2f} ms, e.g. {names[0][:60]}): "
        "HTA's definition counts them as computation, and so do these figures"
    )


def _host_rows(trace: TraceEvents, pattern: re.Pattern[str], win: bd.Window) -> np.ndarray:
    rows = trace.named(trace.cpu["name"], pattern)
    if win.dropped_step and win.steps:
        rows &= trace.cpu["ts"] < win.steps[-1][1]
    return rows


def _data_loading(
    trace: TraceEvents, win: bd.Window, dev: bd.DeviceTime | None, marked: bool, trace_us: float
) -> DataLoading | None:
    """DataLoader spans per step; ``marked``: the steps come from another marker than ProfilerStep, so spans are cut
    to them (marks start to start leave time before the first and after the last); none: over the whole trace."""
    rows = _host_rows(trace, DATALOADER, win)
    if not rows.any():
        return None
    spans = bd.merge(trace.cpu["ts"][rows], trace.cpu["end"][rows])
    if marked and win.steps:
        spans = bd.clip(spans, win.steps[0][0], win.steps[-1][1])
    total = bd.length(spans)
    steps = len(win.steps)
    per_step = total / steps / 1000 if steps else None
    step_share = trace_share = None
    if steps:
        step_us = sum(end - start for start, end in win.steps)
        step_share = 100 * total / step_us if step_us > 0 else None
    elif trace_us > 0:
        trace_share = 100 * total / trace_us
    gpu_idle = None
    if dev is not None and len(dev.busy[0]) and total > 0:
        gpu_idle = 100 * (total - bd.intersection(spans, dev.busy)) / total
    return DataLoading(int(rows.sum()), per_step, step_share, gpu_idle, total / 1000, trace_share)


def _phases(trace: TraceEvents, win: bd.Window) -> dict[str, float]:
    rows = _host_rows(trace, PHASE_RANGE, win)
    if not rows.any() or not win.steps:  # per step only: without steps a total is not a step's
        return {}
    steps = len(win.steps)
    spent = np.bincount(trace.cpu["name"][rows], weights=trace.cpu["end"][rows] - trace.cpu["ts"][rows])
    return {trace.names[i].removeprefix(RANGE_PREFIX): float(spent[i]) / steps / 1000 for i in np.flatnonzero(spent)}


def _cpu_share(trace: TraceEvents, win: bd.Window) -> CpuShare | None:
    cpu = trace.cpu
    ops = cpu["kind"] == 0
    if not ops.any():
        return None
    step_rows = trace.named(cpu["name"], bd.PROFILER_STEP)
    if step_rows.any():
        thread = int(Counter(cpu["tid"][step_rows].tolist()).most_common(1)[0][0])
    else:
        busy = Counter()
        for tid, spent in zip(cpu["tid"][ops].tolist(), (cpu["end"] - cpu["ts"])[ops].tolist(), strict=True):
            busy[tid] += spent
        thread = int(busy.most_common(1)[0][0])
    if win.steps:
        lo, hi = win.steps[0][0], win.steps[-1][1]
    else:
        on_thread = cpu["tid"] == thread
        lo, hi = float(cpu["ts"][on_thread].min()), float(cpu["end"][on_thread].max())
    if hi <= lo:
        return None
    aten = ops & (cpu["tid"] == thread) & trace.named(cpu["name"], ATEN_OP)
    computing = bd.length(bd.clip(bd.merge(cpu["ts"][aten], cpu["end"][aten]), lo, hi))
    share = 100 * computing / (hi - lo)
    return CpuShare(thread, (hi - lo) / 1000, share, 100 - share)


def _trace_us(trace: TraceEvents) -> float:
    """First event start to last event end (µs): times start at 0 at the first kept event."""
    ends = [float(c["end"].max()) for c in (trace.device, trace.runtime, trace.cpu) if len(c["end"])]
    return max(ends, default=0.0)


def _duration(us: float) -> str:
    return f"{us / 1e6:.2f} s" if us >= 1e6 else f"{us / 1000:.1f} ms"


def analyze_rank(trace: TraceEvents, job_step_names: int, top: int = 10) -> tuple[RankTrace, RankCollectives | None]:
    """Every figure for one rank (see `DEFINITIONS`), and its collectives for the cross-rank comparison;
    ``job_step_names``: distinct ProfilerStep names in the job."""
    win = bd.window(trace, job_step_names)
    result = RankTrace(trace.rank, str(trace.path), str(trace.path.parent), trace.rank_source, trace.device_type)
    trace_us = _trace_us(trace)
    result.trace_ms = trace_us / 1000
    if win.note:
        result.notes.append(win.note)
    marked = False
    if win.steps:
        result.step_source = "ProfilerStep"
    elif (marks := step_marks(trace)) is not None:
        win.steps, result.step_source, marked = marks.steps, marks.source, True
        result.notes.append(
            f"no ProfilerStep: {len(marks.steps)} step(s) between the {len(marks.steps) + 1} {marks.source} marks "
            "(each from one mark's start to the next's)"
        )
    else:
        result.notes.append(f"no step markers: figures are over the whole {_duration(trace_us)} trace")
    result.steps, result.step_ms = _step_stats(win)
    dev = bd.device_time(trace, win)
    span = bd.temporal(dev)
    if span is None:
        result.notes.append("no GPU activity in the window: GPU figures are absent")
        dev_for_data = None
    else:
        dev_for_data = dev
        result.kernel_span_ms = span.basis_us / 1000
        result.idle_pct, result.compute_pct, result.non_compute_pct = (
            span.idle_pct,
            span.compute_pct,
            span.non_compute_pct,
        )
        if (comm := bd.communication(dev)) is not None:
            total, overlapped = comm
            result.overlap_pct = 100 * overlapped / total if total > 0 else None
            result.exposed_comm_pct = 100 * (total - overlapped) / span.basis_us
        idle = bd.idle_breakdown(trace, win, dev)
        if idle is not None:
            result.idle_breakdown = {
                "host_wait_pct": idle.host_wait_pct, "kernel_wait_pct": idle.kernel_wait_pct,
                "other_pct": idle.other_pct,
            }  # fmt: skip
        if win.steps:
            wall = bd.temporal(dev, win.steps[0][0], win.steps[-1][1])
            if wall is not None:
                result.wall = {
                    "basis_ms": wall.basis_us / 1000, "idle_pct": wall.idle_pct, "compute_pct": wall.compute_pct,
                    "non_compute_pct": wall.non_compute_pct,
                }  # fmt: skip
        result.kernel_types, result.top_kernels = _kernels(trace, dev, top)
        if note := _hidden_collectives(trace, dev):
            result.notes.append(note)
    result.data_loading = _data_loading(trace, win, dev_for_data, marked, trace_us)
    result.phases_ms = _phases(trace, win)
    if span is None:
        result.cpu = _cpu_share(trace, win)
        result.top_ops = top_ops(trace, top)
    result.verdict = rank_verdict(result)
    steps_span = (win.steps[0][0], win.steps[-1][1]) if win.steps else None
    basis = span.basis_us if span is not None else steps_span[1] - steps_span[0] if steps_span else trace_us
    # host collectives, and any collective when the steps are not ProfilerStep's window, count inside the steps
    cut = steps_span if span is None or marked else None
    loader = _host_rows(trace, DATALOADER, win)
    return result, rank_collectives(trace, win, dev, loader, basis, cut)


def _losses(rank: RankTrace) -> dict[str, tuple[float, str]]:
    """Share (%) of the rank's time each cause costs, with the sentence that shows it."""
    losses: dict[str, tuple[float, str]] = {}
    data = rank.data_loading
    if data and (share := _data_share(data)) is not None:
        idle_frac = (data.gpu_idle_pct if data.gpu_idle_pct is not None else 100.0) / 100
        losses["data"] = (
            share * idle_frac,
            _data_words(data)
            + (f", the GPU idle for {data.gpu_idle_pct:.0f}% of them" if data.gpu_idle_pct is not None else ""),
        )
    if rank.exposed_comm_pct is not None:
        losses["comms"] = (
            rank.exposed_comm_pct,
            f"communication not overlapped by computation is {rank.exposed_comm_pct:.1f}% of the kernel span "
            f"(overlap {rank.overlap_pct or 0:.0f}%)",
        )
    if rank.idle_pct is not None and rank.idle_breakdown:
        host = rank.idle_pct * rank.idle_breakdown["host_wait_pct"] / 100
        if "data" in losses:  # time already blamed on the loader
            host = max(host - losses["data"][0], 0.0)
        losses["host"] = (
            host,
            f"the GPU idles {rank.idle_pct:.1f}% of the kernel span, {rank.idle_breakdown['host_wait_pct']:.0f}% of "
            "it waiting for the host to launch the next kernel",
        )
    return losses


def _data_share(data: DataLoading) -> float | None:
    """The loader's share of the steps, else (no step markers) of the whole trace."""
    return data.step_share_pct if data.step_share_pct is not None else data.trace_share_pct


def _data_words(data: DataLoading) -> str:
    if data.per_step_ms is not None and data.step_share_pct is not None:
        return f"DataLoader spans take {data.per_step_ms:.1f} ms per step ({data.step_share_pct:.0f}% of the step)"
    return f"DataLoader spans take {data.total_ms:.1f} ms, {data.trace_share_pct or 0:.0f}% of the whole trace"


def rank_verdict(rank: RankTrace) -> Verdict:
    """The rank's bottleneck: the cause that costs the most GPU time, if any costs over 15%, else compute or unknown."""
    if rank.cpu is not None:
        return _cpu_verdict(rank, rank.cpu)
    losses = sorted(_losses(rank).items(), key=lambda item: -item[1][0])
    if losses and losses[0][1][0] >= LOSS_FLOOR_PCT:
        (bound, (loss, why)), rest = losses[0], losses[1:]
        runner_up = rest[0][1][0] if rest else 0.0
        confidence = "high" if loss >= 25 and loss >= 2 * runner_up else "medium"
        return Verdict(bound, confidence, [why] + [w for _, (v, w) in rest if v >= LOSS_FLOOR_PCT])
    if rank.compute_pct is not None and rank.compute_pct >= COMPUTE_BOUND_PCT:
        return Verdict("compute", "high" if rank.compute_pct >= 80 else "medium", [
            f"computation kernels run {rank.compute_pct:.0f}% of the kernel span; the GPU is the bottleneck"
        ])  # fmt: skip
    evidence = [w for _, (_, w) in losses] or ["no device activity to attribute"]
    return Verdict("unknown", "low", evidence)


def _cpu_verdict(rank: RankTrace, cpu: CpuShare) -> Verdict:
    """CPU-only traces: the loader's share of the step against the ATen ops' share of the main thread."""
    ops = f"ATen ops take {cpu.computation_pct:.0f}% of the main thread's time (CPU-only trace)"
    data = rank.data_loading
    data_share = (_data_share(data) if data is not None else None) or 0.0
    if data is not None and data_share >= LOSS_FLOOR_PCT and data_share >= cpu.computation_pct:
        return Verdict("data", "high" if data_share >= 50 else "medium", [_data_words(data), ops])
    if cpu.computation_pct >= COMPUTE_BOUND_PCT:
        return Verdict("compute", "medium", [ops])
    return Verdict("unknown", "low", [ops])


def _spread(ranks: list[RankTrace]) -> dict[str, dict[str, float]]:
    spread = {}
    for figure in ("step_ms", "idle_pct", "compute_pct", "non_compute_pct", "overlap_pct"):
        values = [getattr(r, figure) for r in ranks if getattr(r, figure) is not None]
        if len(values) > 1:
            spread[figure] = {
                "min": min(values), "max": max(values), "mean": statistics.fmean(values),
                "range": max(values) - min(values),
            }  # fmt: skip
    return spread


def _stragglers(ranks: list[RankTrace]) -> list[dict[str, Any]]:
    timed = [r for r in ranks if r.step_ms]
    if len(timed) < 2:
        return []
    slow = max(timed, key=lambda r: r.step_ms)
    others = [r for r in timed if r is not slow]
    median = statistics.median(r.step_ms for r in others)
    if slow.step_ms < STRAGGLER_RATIO * median:
        return []

    def per_step_ms(r: RankTrace, share: float | None) -> float:
        return (share or 0.0) / 100 * (r.kernel_span_ms or 0.0) / max(r.steps, 1)

    parts = {
        "computation": lambda r: per_step_ms(r, r.compute_pct),
        "GPU idle": lambda r: per_step_ms(r, r.idle_pct),
        "non-compute kernels": lambda r: per_step_ms(r, r.non_compute_pct),
        "data loading": lambda r: r.data_loading.per_step_ms if r.data_loading else 0.0,
    }
    excess = {name: f(slow) - statistics.median(f(r) for r in others) for name, f in parts.items()}
    why, extra = max(excess.items(), key=lambda item: item[1])
    reason = f"{why}: {extra:+.2f} ms per step over the other ranks' median" if extra > 0 else "no single cause"
    return [{
        "rank": slow.rank, "step_ms": slow.step_ms, "median_step_ms": median,
        "slower_pct": 100 * (slow.step_ms / median - 1),
        "why": reason,
    }]  # fmt: skip


def job_verdict(ranks: list[RankTrace], late: list[dict[str, Any]] | None = None) -> Verdict:
    """The verdict of most ranks of one job, with the first such rank's evidence; but when the ranks lose at least
    15% of their time waiting in collectives for a late rank (``late``: `late_ranks`), that rank decides it."""
    if not ranks:
        return Verdict("unknown", "low", ["nothing could be analysed"])
    if len({r.job for r in ranks}) > 1:
        return Verdict("unknown", "low", ["several jobs: see each rank's verdict"])
    for found in late or []:
        if found["wait_pct"] >= LOSS_FLOOR_PCT:
            confidence = (
                "high" if found["wait_pct"] >= 25 and found["cause_ms"] > 2 * found["others_cause_ms"] else "medium"
            )
            return Verdict(found["cause"], confidence, list(found["evidence"]))
    bounds = Counter(r.verdict.bound for r in ranks)
    bound, count = bounds.most_common(1)[0]
    example = next(r for r in ranks if r.verdict.bound == bound)
    evidence = [f"rank {example.rank}: {line}" for line in example.verdict.evidence]
    if len(ranks) > 1:
        evidence.insert(0, f"{count} of {len(ranks)} ranks are {bound}-bound")
    confidence = example.verdict.confidence if count == len(ranks) else "medium" if count > len(ranks) / 2 else "low"
    return Verdict(bound, confidence, evidence)


def analyze_trace(
    paths: str | Path | Iterable[str | Path], ranks: Iterable[int] | None = None, top: int = 10, jobs: int = 0
) -> TraceAnalysis:
    """Analyse Kineto traces: a file, a folder (one job, a file per rank), or several of them.

    ``ranks`` keeps only those ranks; ``top`` kernels are listed per rank; ``jobs`` processes read files in
    parallel (0: one per usable core), or two a file of 64 MB of JSON or more when the files are read one at a time
    (0: when a core is idle and no other thread runs; 1: never). Unreadable files are listed with their reason in
    ``files``.
    """
    begin = time.perf_counter()
    items = [paths] if isinstance(paths, (str, Path)) else list(paths)
    files = trace_files(items)
    wanted = frozenset(ranks) if ranks is not None else None
    reduced, processes = _reduce_all(files, wanted, top, jobs)
    statuses = [r.status for r in reduced]
    warnings: list[str] = []
    if not files:
        warnings.append("no .json or .json.gz files found in " + ", ".join(map(str, items)))
    results: list[RankTrace] = []
    stragglers: list[dict[str, Any]] = []
    late: list[dict[str, Any]] = []
    spread: dict[str, dict[str, dict[str, float]]] = {}
    for job, members in _jobs([r for r in reduced if r.rank is not None]).items():
        step_names = len(frozenset().union(*(m.step_names for m in members)))
        # HTA's window depends on the whole job's ProfilerStep names only through "fewer than two": a rank with fewer
        # of its own, in a job with more, is analysed again with the job's count
        members = [
            reduce_file(Path(m.status.path), wanted, top, step_names)
            if m.window_step_names < 2 <= step_names else m
            for m in members
        ]  # fmt: skip
        members.sort(key=lambda m: m.rank.rank)
        analysed = [m.rank for m in members]
        results += analysed
        seen = Counter(r.rank for r in analysed)
        if duplicated := sorted(r for r, n in seen.items() if n > 1):
            warnings.append(
                f"{job}: rank(s) {', '.join(map(str, duplicated))} appear in more than one file: the folder mixes "
                "jobs, so its ranks are not compared"
            )
            continue
        stragglers += [{"job": job, **s} for s in _stragglers(analysed)]
        if all(m.collectives is not None for m in members):
            found, note = late_ranks([m.collectives for m in members])
            late += [{"job": job, **entry} for entry in found]
            if note:
                warnings.append(f"{job}: {note}")
        if job_spread := _spread(analysed):
            spread[job] = job_spread
    return TraceAnalysis(
        ranks=results, files=statuses, verdict=job_verdict(results, late), stragglers=stragglers, spread=spread,
        late_ranks=late, warnings=warnings, read=_throughput(statuses, results, time.perf_counter() - begin, processes),
    )  # fmt: skip


def _throughput(statuses: list[TraceFileStatus], ranks: list[RankTrace], seconds: float, processes: int) -> dict:
    """How much was read and how fast: files read, ranks analysed, events, decompressed MB, wall seconds, MB/s."""
    read = [s for s in statuses if s.ok]
    mb = sum(s.mb for s in read)
    events = sum(s.events for s in read)
    return {
        "files": len(read), "ranks": len(ranks), "events": events, "mb": mb, "seconds": seconds,
        "mb_per_s": mb / seconds if seconds > 0 else 0.0, "events_per_s": events / seconds if seconds > 0 else 0.0,
        "processes": processes,
    }  # fmt: skip


def _jobs(reduced: list[RankReduction]) -> dict[str, list[RankReduction]]:
    """Reduced ranks grouped by folder: the files of one folder are the ranks of one job."""
    jobs: dict[str, list[RankReduction]] = {}
    for member in reduced:
        jobs.setdefault(member.rank.job, []).append(member)
    return jobs
