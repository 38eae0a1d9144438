"""The trace analyser on real-shaped traces: steps without ProfilerStep, top host operators of CPU-only traces
(against torch's own ``key_averages()``), and late ranks in multi-rank traces (synthetic, exact answers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kineto import ORIGIN_US, Kineto

from stepscope.analyses.trace.analyze import RankTrace, TraceAnalysis, analyze_trace
from stepscope.analyses.trace.highlights import highlights
from stepscope.analyses.trace.ops import parents, self_times
from stepscope.report.trace import print_trace

GEMM = "void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_256x64_16x4_nn_align4>(Params)"
COMM = "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)"
LOADER = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"
OPTIMIZER = "Optimizer.step#SGD.step"


def approx(value: float, tol: float = 1e-9):
    return pytest.approx(value, abs=tol)


def only_rank(analysis: TraceAnalysis) -> RankTrace:
    assert [f.reason for f in analysis.files if not f.ok] == []
    assert len(analysis.ranks) == 1
    return analysis.ranks[0]


def unmarked_data_bound(marks: str | None, steps: int = 4) -> Kineto:
    """Iterations of 1 ms without ProfilerStep: the DataLoader takes 600 µs with the GPU idle, then a 300 µs kernel;
    ``marks``: what marks each iteration (an Optimizer.step range at its end, a covering user range, ...)."""
    trace = Kineto()
    for n in range(steps):
        t0 = 1000 * n
        trace.host(LOADER, t0, 600, cat="user_annotation")
        trace.kernel(GEMM, t0 + 650, 300, launch=t0 + 620)
        if marks == "optimizer":
            trace.host(OPTIMIZER, t0 + 960, 30, cat="user_annotation")
        elif marks == "user":
            trace.host("train_iteration", t0, 990, cat="user_annotation")
            trace.host("forward", t0 + 610, 50, cat="user_annotation")  # once per iteration too, but covers less
        elif marks == "stepscope":
            trace.host("stepscope/optimizer", t0 + 960, 30, cat="user_annotation")
            trace.host(OPTIMIZER, t0 + 965, 20, cat="user_annotation")
    return trace


@pytest.mark.parametrize(
    "marks, source",
    [("optimizer", "Optimizer.step"), ("user", "record_function train_iteration"),
     ("stepscope", "stepscope/optimizer")],
)  # fmt: skip
def test_steps_from_other_markers(tmp_path, marks, source):
    """4 marks 1 ms apart: 3 steps of 1 ms, each with 0.6 ms of loading while the GPU idles."""
    rank = only_rank(analyze_trace(unmarked_data_bound(marks).write(tmp_path / "t.json"), jobs=1))
    assert (rank.step_source, rank.steps, rank.step_ms) == (source, 3, approx(1.0))
    loading = rank.data_loading
    assert (loading.per_step_ms, loading.step_share_pct, loading.gpu_idle_pct) == (approx(0.6), approx(60), 100)
    assert loading.total_ms == approx(1.8), "spans outside the marked steps (the 4th iteration's) are cut"
    assert rank.wall is not None and rank.wall["basis_ms"] == approx(3.0)
    assert (rank.verdict.bound, rank.verdict.confidence) == ("data", "high"), rank.verdict
    assert any(f"3 step(s) between the 4 {source} marks" in n for n in rank.notes), rank.notes


def test_a_user_range_repeating_more_often_than_the_optimizer_is_not_a_step(tmp_path):
    trace = unmarked_data_bound("optimizer")
    for n in range(4):
        for micro in range(2):  # two micro-batches per iteration
            trace.host("micro_batch", 1000 * n + 600 + 180 * micro, 170, cat="user_annotation")
    rank = only_rank(analyze_trace(trace.write(tmp_path / "t.json"), jobs=1))
    assert (rank.step_source, rank.steps) == ("Optimizer.step", 3)


def test_no_step_markers_figures_are_over_the_whole_trace(tmp_path):
    trace = unmarked_data_bound(None, steps=2)
    trace.host("stepscope/forward", 650, 100, cat="user_annotation")  # a phase seen once: no per-step figure
    rank = only_rank(analyze_trace(trace.write(tmp_path / "t.json"), jobs=1))
    assert (rank.step_source, rank.steps, rank.step_ms, rank.trace_ms) == (None, 0, None, approx(1.95))
    assert "no step markers: figures are over the whole 1.9 ms trace" in rank.notes, rank.notes
    loading = rank.data_loading
    assert (loading.per_step_ms, loading.step_share_pct, loading.total_ms) == (None, None, approx(1.2))
    assert loading.trace_share_pct == approx(100 * 1200 / 1950)
    assert rank.phases_ms == {}, "a whole-trace total is not presented per step"
    assert rank.verdict.bound == "data", "the shares still decide the verdict without steps"
    assert rank.verdict.evidence[0].startswith("DataLoader spans take 1.2 ms, 62% of the whole trace")
    digest = highlights(analyze_trace(tmp_path, jobs=1), tmp_path)["ranks"][0]
    assert (digest["step_source"], digest["trace_ms"], digest["data_loading"]["per_step_ms"]) == (None, 1.95, None)


def test_cpu_only_trace_without_steps_is_not_unknown_for_lack_of_steps(tmp_path):
    trace = Kineto(device=None)
    trace.host(LOADER, 0, 700, cat="user_annotation")
    trace.host("aten::mm", 700, 300)
    rank = only_rank(analyze_trace(trace.write(tmp_path / "t.json"), jobs=1))
    assert rank.steps == 0 and rank.cpu is not None
    assert rank.verdict.bound == "data" and "70% of the whole trace" in rank.verdict.evidence[0]


# ---------------------------------------------------------------------------------------------------------------------
# Top operators
# ---------------------------------------------------------------------------------------------------------------------


def test_self_times_subtract_direct_children_on_the_same_thread():
    #         0: [0, 100) t1  1: [10, 60) t1 (in 0)  2: [20, 30) t1 (in 1)  3: [40, 50) t1 (in 1)
    #         4: [70, 90) t1 (in 0)  5: [0, 100) t2 (other thread)  6: [5, 15) t2 (in 5)  7: [95, 95) zero length
    ts = np.array([0, 10, 20, 40, 70, 0, 5, 95], float)
    end = np.array([100, 60, 30, 50, 90, 100, 15, 95], float)
    tid = np.array([1, 1, 1, 1, 1, 2, 2, 1])
    parent = parents(ts, end, tid)
    assert parent.tolist() == [-1, 0, 1, 1, 0, -1, 5, -1]
    assert self_times(ts, end, parent).tolist() == [30, 30, 10, 10, 20, 90, 10, 0]


def test_self_times_of_identical_ranges_nest_once():
    ts, end, tid = np.array([0.0, 0.0, 0.0]), np.array([10.0, 10.0, 4.0]), np.array([1, 1, 1])
    assert sorted(self_times(ts, end, parents(ts, end, tid)).tolist()) == [0, 4, 6]


def test_top_ops_agree_with_key_averages(tmp_path):
    """A real CPU profile of a small model, no schedule, no prof.step(): top operators as key_averages() gives them
    (self CPU within 3% + 2 µs a call, the rounding of Kineto's ns timestamps), steps from Optimizer.step."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = torch.randn(128, 256)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            model(batch).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    path = tmp_path / "cpu.pt.trace.json"
    prof.export_chrome_trace(str(path))
    rank = only_rank(analyze_trace(path, jobs=1, top=5))
    assert (rank.device_type, rank.step_source, rank.steps) == ("cpu", "Optimizer.step", 3)
    theirs = {event.key: event for event in prof.key_averages()}
    assert len(rank.top_ops) == 5
    total_self = sum(event.self_cpu_time_total for event in theirs.values())
    for op in rank.top_ops:
        event = theirs[op.name]
        assert op.count == event.count, op.name
        slack = 0.03 * event.self_cpu_time_total + 2 * event.count
        assert abs(op.self_ms * 1000 - event.self_cpu_time_total) <= slack, (op, event.self_cpu_time_total)
        assert abs(op.total_ms * 1000 - event.cpu_time_total) <= 0.03 * event.cpu_time_total + 2 * event.count
        assert op.self_pct == pytest.approx(100 * event.self_cpu_time_total / total_self, rel=0.05, abs=0.5)
    ranked = sorted((e for e in theirs.values() if not e.key.startswith("ProfilerStep")),
                    key=lambda e: -e.self_cpu_time_total)  # fmt: skip
    assert rank.top_ops[0].name in {e.key for e in ranked[:2]}, "the same operator leads"


def test_top_ops_in_the_report_and_highlights(tmp_path):
    trace = Kineto(device=None)
    trace.host("aten::linear", 0, 100)
    trace.host("aten::addmm", 10, 80)
    trace.host("aten::linear", 200, 50)
    trace.host("aten::addmm", 205, 40)
    rank = only_rank(analyze_trace(trace.write(tmp_path / "t.json"), jobs=1))
    assert [(o.name, o.count, o.self_ms, o.total_ms) for o in rank.top_ops] == [
        ("aten::addmm", 2, approx(0.12), approx(0.12)), ("aten::linear", 2, approx(0.03), approx(0.15)),
    ]  # fmt: skip
    assert [o.self_pct for o in rank.top_ops] == [approx(80), approx(20)]
    digest = highlights(analyze_trace(tmp_path, jobs=1), tmp_path)["ranks"][0]
    assert digest["top_ops"][0] == {"name": "aten::addmm", "count": 2, "self_ms": 0.12, "self_pct": 80.0,
                                    "total_ms": 0.12}  # fmt: skip
    out = tmp_path / "report.txt"
    with out.open("w") as file:
        print_trace(analyze_trace(tmp_path, jobs=1), file=file)
    assert "top operators, rank 0" in out.read_text() and "aten::addmm" in out.read_text()


# ---------------------------------------------------------------------------------------------------------------------
# Late ranks
# ---------------------------------------------------------------------------------------------------------------------


def nccl_rank(rank: int, loader_us: float, gemm_us: float, origin: float = ORIGIN_US) -> Kineto:
    """3 steps of 1 ms (the last dropped): loading, a GEMM, then an all-reduce that ends at 900 µs on every rank."""
    trace = Kineto(rank=rank, origin=origin)
    for n in range(3):
        t0 = 1000 * n
        trace.step(n + 1, t0, 1000)
        trace.host(LOADER, t0, loader_us, cat="user_annotation")
        trace.kernel(GEMM, t0 + loader_us + 10, gemm_us, launch=t0 + loader_us + 5)
        arrive = t0 + loader_us + 10 + gemm_us
        trace.kernel(COMM, arrive, t0 + 900 - arrive, launch=t0 + loader_us + 6, stream=20)
    return trace


@pytest.mark.parametrize("skew_us", [0, 5000, -123_456], ids=["same-clock", "ahead", "behind"])
def test_a_rank_late_from_data_loading_decides_the_job(tmp_path, skew_us):
    """Ranks 0 and 1 load for 100 µs, rank 2 for 400 µs: 0 and 1 wait 300 µs per step in their all-reduce. Rank 1's
    clock may be off: the collectives' ends align it."""
    job = tmp_path / "job"
    for rank, loader in [(0, 100), (1, 100), (2, 400)]:
        origin = ORIGIN_US + (skew_us if rank == 1 else 0)
        nccl_rank(rank, loader, 300, origin).write(job / f"rank{rank}.json")
    analysis = analyze_trace(job, jobs=1)
    assert [r.verdict.bound for r in analysis.ranks][:2] == ["comms", "comms"], "alone, ranks 0 and 1 look comms-bound"
    assert analysis.stragglers == [], "every rank's step is as long: no straggler by step time"
    (late,) = analysis.late_ranks
    assert (late["rank"], late["cause"], late["collectives"], late["last_at"]) == (2, "data", 2, 2)
    assert (late["late_ms"], late["waited_ms"]) == (approx(0.3, 1e-6), approx(0.3, 1e-6))
    assert late["wait_share_pct"] == approx(100 * 300 / 490, 1e-6)
    assert late["wait_pct"] == approx(100 * 600 / 1790, 1e-6)
    assert (late["cause_ms"], late["others_cause_ms"]) == (approx(0.4), approx(0.1))
    assert late["clock_offset_ms"]["1"] == approx(skew_us / 1000, 1e-6)
    verdict = analysis.verdict
    assert (verdict.bound, verdict.confidence) == ("data", "high"), verdict
    assert verdict.evidence[0].startswith("rank 2 starts 2 of 2 collectives last (NCCL kernels")
    assert "wait 0.30 ms per step for it" in verdict.evidence[1]
    assert verdict.evidence[2] == (
        "before those collectives rank 2 spends 0.40 ms per step on data loading, the other ranks 0.10 ms (median)"
    )


def test_a_rank_late_from_compute(tmp_path):
    job = tmp_path / "job"
    for rank, gemm in [(0, 300), (1, 250), (2, 600)]:
        nccl_rank(rank, 100, gemm).write(job / f"rank{rank}.json")
    analysis = analyze_trace(job, jobs=1)
    (late,) = analysis.late_ranks
    assert (late["rank"], late["cause"]) == (2, "compute")
    assert (late["cause_ms"], late["others_cause_ms"]) == (approx(0.6), approx(0.275)), "median of 0.3 and 0.25"
    assert analysis.verdict.bound == "compute"


def test_no_late_rank_when_ranks_arrive_together(tmp_path):
    job = tmp_path / "job"
    for rank in range(3):
        nccl_rank(rank, 100, 300 + 5 * rank).write(job / f"rank{rank}.json")
    analysis = analyze_trace(job, jobs=1)
    assert analysis.late_ranks == [], "a 10 µs spread is 2% of 490 µs of communication"
    assert analysis.verdict.bound == "comms" and analysis.verdict.evidence[0] == "3 of 3 ranks are comms-bound"


def test_collectives_that_do_not_match_are_not_compared(tmp_path):
    job = tmp_path / "job"
    nccl_rank(0, 100, 300).write(job / "rank0.json")
    other = Kineto(rank=1)
    for n in range(3):
        other.step(n + 1, 1000 * n, 1000)
        other.kernel(GEMM, 1000 * n + 10, 800)
    other.write(job / "rank1.json")
    assert analyze_trace(job, jobs=1).late_ranks == []


def gloo_rank(rank: int, loader_us: float) -> Kineto:
    """CPU only, no ProfilerStep: loading, 300 µs of ATen ops, then a gloo all-reduce on a worker thread ending at
    900 µs on every rank, and Optimizer.step marking each iteration."""
    trace = Kineto(rank=rank, device=None)
    for n in range(4):
        t0 = 1000 * n
        trace.host(LOADER, t0, loader_us, cat="user_annotation")
        trace.host("aten::addmm", t0 + loader_us, 300)
        arrive = t0 + loader_us + 300
        trace.host("c10d::allreduce_", arrive - 2, 2)
        trace.host("gloo:all_reduce", arrive, t0 + 900 - arrive, tid=7, cat="user_annotation")
        trace.host(OPTIMIZER, t0 + 950, 40, cat="user_annotation")
    return trace


def test_a_late_rank_in_a_gloo_cpu_job(tmp_path):
    job = tmp_path / "job"
    gloo_rank(0, 100).write(job / "rank0.json")
    gloo_rank(1, 450).write(job / "rank1.json")
    analysis = analyze_trace(job, jobs=1)
    (late,) = analysis.late_ranks
    # the steps run from the 1st Optimizer.step to the 4th: the 1st iteration's collective is before them
    assert (late["rank"], late["cause"], late["collectives"], late["last_at"]) == (1, "data", 3, 3)
    assert (late["cause_ms"], late["others_cause_ms"]) == (approx(0.45), approx(0.1))
    assert late["late_ms"] == approx(0.35, 1e-6)
    assert late["wait_share_pct"] == approx(100 * 350 / 500, 1e-6)
    assert analysis.verdict.bound == "data" and "gloo ranges" in analysis.verdict.evidence[0]
    assert analysis.ranks[0].step_source == "Optimizer.step"
    out = tmp_path / "report.txt"
    with out.open("w") as file:
        print_trace(analysis, file=file)
    text = out.read_text()
    assert "late rank: 1" in text and "bound: data" in text
    assert highlights(analysis, job)["late_ranks"][0]["rank"] == 1
