"""`stepscope trace` on many ranks in bounded memory: each trace is reduced to its rank's figures and its collectives
as arrays, then freed, before the next is read (synthetic NCCL ranks, exact answers).

The reference is the direct composition of the pieces, every trace held at once: read each rank, count the job's
ProfilerStep names over all of them, analyse each rank with that count, compare their collectives. The streamed
analysis must give the same figures, stragglers, late rank and verdict, serially and with reader processes.
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np
import pytest
from kineto import Kineto

import stepscope.analyses.trace.analyze as analyze
from stepscope.analyses.trace import breakdown as bd
from stepscope.analyses.trace.analyze import analyze_rank, analyze_trace, job_verdict, reduce_file
from stepscope.analyses.trace.collectives import RankCollectives, late_ranks
from stepscope.analyses.trace.events import TraceEvents, read_trace, trace_files

GEMM = "void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_256x64_16x4_nn_align4>(Params)"
COMM = "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)"
LOADER = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"
RANKS = 16
LATE_RANK = 11  # loads 400 µs per step, the others 100 µs


def nccl_rank(rank: int, steps: int = 4) -> Kineto:
    """``steps`` ProfilerSteps of 1 ms: loading, a GEMM (its length varies by rank), then an all-reduce and a
    broadcast that end at the same times on every rank; the clock of odd ranks is 7 ms ahead."""
    trace = Kineto(rank=rank, origin=1_700_000_000_000_000.0 + 7000 * (rank % 2))
    loader = 400 if rank == LATE_RANK else 100
    for n in range(steps):
        t0 = 1000 * n
        trace.step(n + 1, t0, 1000)
        trace.host(LOADER, t0, loader, cat="user_annotation")
        gemm = 200 + 5 * rank
        trace.kernel(GEMM, t0 + loader + 10, gemm, launch=t0 + loader + 5)
        arrive = t0 + loader + 10 + gemm
        trace.kernel(COMM, arrive, t0 + 800 - arrive, launch=t0 + loader + 6, stream=20)
        trace.kernel("ncclKernel_Broadcast_RING_LL_Sum_float", t0 + 820, 60, launch=t0 + 815, stream=20)
    return trace


@pytest.fixture
def job(tmp_path):
    folder = tmp_path / "job"
    for rank in range(RANKS):
        nccl_rank(rank).write(folder / f"rank{rank}.json.gz")
    return folder


def reference(folder) -> tuple[list, list, list]:
    """Every trace in memory at once: the ranks' figures, the late ranks and the stragglers."""
    traces = [read_trace(p) for p in trace_files([folder])]
    names = len(set().union(*(bd.profiler_steps(t)[2] for t in traces)))
    pairs = sorted((analyze_rank(t, names) for t in traces), key=lambda pair: pair[0].rank)
    found: list = []
    if all(c is not None for _, c in pairs):
        found, note = late_ranks([c for _, c in pairs])
        assert note is None
    ranks = [r for r, _ in pairs]
    return ranks, [{"job": str(folder), **entry} for entry in found], analyze._stragglers(ranks)


def check_same(folder, jobs: int) -> analyze.TraceAnalysis:
    ranks, late, stragglers = reference(folder)
    analysis = analyze_trace(folder, jobs=jobs)
    assert [dataclasses.asdict(r) for r in analysis.ranks] == [dataclasses.asdict(r) for r in ranks]
    assert analysis.late_ranks == late and analysis.stragglers == [{"job": str(folder), **s} for s in stragglers]
    assert analysis.verdict == job_verdict(ranks, late)
    return analysis


@pytest.mark.parametrize("jobs", [1, 2], ids=["serial", "reader-processes"])
def test_many_ranks_streamed_give_the_same_analysis_as_all_traces_held(job, jobs, monkeypatch):
    monkeypatch.setattr(analyze, "PARALLEL_MIN_BYTES", 0)  # small files: let two processes read them
    analysis = check_same(job, jobs)
    # the answers themselves, so that an error shared by both paths still shows
    (found,) = analysis.late_ranks
    assert (found["rank"], found["cause"], found["cause_ms"]) == (LATE_RANK, "data", pytest.approx(0.4))
    assert found["collectives"] == 6 and found["clock_offset_ms"]["1"] == pytest.approx(7.0), "odd clocks 7 ms ahead"
    read = analysis.read
    assert (read["files"], read["ranks"], read["processes"]) == (RANKS, RANKS, jobs)
    assert read["events"] == sum(f.events for f in analysis.files) > 0
    assert read["mb"] == pytest.approx(sum(f.mb for f in analysis.files)) and read["mb_per_s"] > 0


def test_a_rank_with_one_profiler_step_in_a_job_with_more_is_cut_by_the_jobs_window(tmp_path):
    """HTA's window drops the last ProfilerStep when the job (not the rank) has at least two: a rank that traced one
    step is analysed again with the job's count, as when every trace is held."""
    folder = tmp_path / "job"
    for rank in range(3):
        nccl_rank(rank, steps=1 if rank == 2 else 4).write(folder / f"rank{rank}.json.gz")
    analysis = check_same(folder, jobs=1)
    assert [r.steps for r in analysis.ranks] == [3, 3, 0], "its only step is dropped"
    assert reduce_file(folder / "rank2.json.gz", None, top=10).rank.steps == 1, "alone, the whole trace is kept"


def test_a_rank_outside_ranks_is_read_but_not_analysed(job):
    analysis = analyze_trace(job, ranks=[0, LATE_RANK], jobs=1)
    assert [r.rank for r in analysis.ranks] == [0, LATE_RANK] and len(analysis.files) == RANKS
    assert analysis.late_ranks[0]["rank"] == LATE_RANK
    assert analysis.read["ranks"] == 2 and analysis.read["files"] == RANKS


def test_each_trace_is_freed_before_the_next_is_read(job, monkeypatch):
    """What the analysis keeps of a rank is its figures and its collectives as arrays: no trace outlives its rank."""
    alive: list[weakref.ref] = []
    held_at_each_read = []

    def tracked(path, *options):
        held_at_each_read.append(sum(ref() is not None for ref in alive))
        trace = read_trace(path, *options)
        alive.append(weakref.ref(trace))
        return trace

    monkeypatch.setattr(analyze, "read_trace", tracked)
    analysis = analyze_trace(job, jobs=1)
    assert len(analysis.ranks) == RANKS
    assert held_at_each_read == [0] * RANKS, "one read per file, none while another trace is held"
    assert all(ref() is None for ref in alive)


def test_a_reduced_rank_holds_its_collectives_as_arrays(job):
    reduced = reduce_file(job / "rank3.json.gz", None, top=10)
    fields = {f.name: getattr(reduced, f.name) for f in dataclasses.fields(reduced)}
    assert not any(isinstance(value, TraceEvents) for value in fields.values())
    collectives = reduced.collectives
    assert isinstance(collectives, RankCollectives)
    # the window drops the last of 4 steps: 3 all-reduces and 3 broadcasts, one row each, names stored once
    assert sorted(collectives.name_table) == sorted([COMM, "ncclKernel_Broadcast_RING_LL_Sum_float"])
    arrays = [collectives.name, collectives.start, collectives.end, *collectives.before.values()]
    assert all(isinstance(a, np.ndarray) and a.shape == (6,) for a in arrays)
    assert collectives.name.dtype == np.int32
    assert reduced.step_names == {f"ProfilerStep#{n}" for n in range(1, 5)} and reduced.window_step_names == 4


def test_a_large_jobs_rank_table_lists_the_named_and_outlying_ranks():
    from stepscope.analyses.trace.analyze import RankTrace
    from stepscope.report.trace import RANK_ROWS, outlying_ranks

    ranks = [
        RankTrace(r, f"r{r}.json", "job", "distributedInfo", "cuda", step_ms=100.0, idle_pct=10.0) for r in range(64)
    ]
    ranks[7].step_ms = 130.0  # 30% slower
    ranks[40].idle_pct = 35.0  # 25 points idler
    shown = outlying_ranks(ranks, named={63})
    assert len(shown) == RANK_ROWS and [r.rank for r in shown][:2] == [0, 1]  # ties keep rank order
    assert {7, 40, 63} <= {r.rank for r in shown}
    assert outlying_ranks(ranks[:RANK_ROWS], named=set()) == ranks[:RANK_ROWS]
