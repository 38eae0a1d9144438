"""The HTML report: sections from fixture summaries, escaping, the SVG charts, the CLI, and a real render in
headless Chromium (no console errors, no request beyond the file, the verdict on the page)."""

from __future__ import annotations

import dataclasses
import re
import xml.etree.ElementTree as ET

import pytest
from chromium import find_chromium, load_page
from kineto import Kineto
from run_helpers import script, stepscope_here

from stepscope.analyses.trace.analyze import (
    CpuShare,
    DataLoading,
    KernelStat,
    RankTrace,
    TraceAnalysis,
    TraceFileStatus,
)
from stepscope.analyses.trace.highlights import highlights
from stepscope.analyses.trace.ops import OpStat
from stepscope.cli import _split_run, build_parser, main
from stepscope.report import svg
from stepscope.report.html import render_html, write_html
from stepscope.summary import (
    Cluster,
    Exit,
    Fix,
    LoaderInfo,
    Meta,
    PhaseStats,
    RunSummary,
    Steps,
    StepSeries,
    Straggler,
    Throughput,
    Verdict,
)

EVIL = "<script>alert(1)</script> \"quoted\" 'single' & co"
EVIL_ESCAPED = "&lt;script&gt;alert(1)&lt;/script&gt; &quot;quoted&quot; &#x27;single&#x27; &amp; co"

needs_chromium = pytest.mark.skipif(
    find_chromium() is None,
    reason="chromium is not on PATH (`make test` installs Debian's chromium with apt-get where it can)",
)


def phase(mean_ms: float, share: float, steps: int = 40, nested: bool = False) -> PhaseStats:
    return PhaseStats(mean_ms, mean_ms, mean_ms * 1.2, share, steps, nested, mean_ms * 0.9, mean_ms, mean_ms, share)


def rank_phases(data_ms: float) -> dict[str, PhaseStats]:
    """A CUDA-timed step of data_ms waiting for data plus 30 ms of work, with an oddly named custom phase."""
    total = data_ms + 30.0
    names = {"data_wait": data_ms, "forward": 9.0, "backward": 15.0, EVIL: 2.0, "optimizer": 3.0, "other": 1.0}
    phases = {name: phase(ms, ms / total) for name, ms in names.items()}
    phases["h2d"] = phase(0.5, 0.5 / total, nested=True)
    phases["total"] = phase(total, 1.0)
    return phases


def gpu_system(rank: int, points: int = 12) -> dict:
    """A sampled system dict of one rank with one GPU, in the collectors' layout (docs/collectors.md)."""
    t = [0.5 * (i + 1) for i in range(points)]
    return {
        "interval_s": 0.5,
        "samples": points,
        "duration_s": t[-1],
        "host": {
            "cpu_util_pct": 98.0,
            "workers_cpu_util_pct": 310.0,
            "workers_max": 4,
            "workers_busy_avg": 3.6,
            "system_cpu_util_pct": 61.0,
            "peak_rss_mb": 5120.0,
            "cores": 16,
            "cpu_quota": None,
        },
        "gpu": {
            "available": True,
            "devices": [
                {
                    "index": rank,
                    "name": f"NVIDIA H100 {EVIL}",
                    "util_avg_pct": 55.0,
                    "mem_util_avg_pct": 20.0,
                    "sm_clock_ratio_avg": 0.93,
                    "power_avg_w": 310.0,
                    "power_limit_w": 700.0,
                    "energy_j": 1860.0,
                    "energy_source": "counter",
                    "mem_peak_mb": 30000.0,
                    "mem_total_mb": 81559.0,
                    "temp_max_c": 51.0,
                    "throttle": {},
                }
            ],
        },
        "memory": {"max_allocated_mb": 20000.0, "max_reserved_mb": 24000.0, "alloc_retries": 0, "ooms": 0},
        "energy": {"total_j": 1860.0},
        "timeline": {
            "t_s": t,
            "cpu_util_pct": [95.0 + i % 3 for i in range(points)],
            "workers_cpu_util_pct": [300.0 + 5 * (i % 4) for i in range(points)],
            "gpu_util_pct": [None, *[50.0 + 3 * (i % 5) for i in range(points - 1)]],
            "sm_clock_ratio": [0.9 + 0.01 * (i % 3) for i in range(points)],
            "power_w": [300.0 + 10 * (i % 4) for i in range(points)],
        },
        "signals": [],
        "notes": [f"GPU {rank} does not report: {EVIL}."],
    }


def rank_summary(rank: int, data_ms: float) -> RunSummary:
    # 10 warm-up steps (the first one compiles: 2.5 s), then 40 measured; stride 2 keeps 25 points.
    steps = [2500.0, *[data_ms + 35.0] * 9, *[data_ms + 30.0 + (i % 3) for i in range(40)]]
    series = StepSeries(stride=2, step_ms=[(a + b) / 2 for a, b in zip(steps[::2], steps[1::2], strict=True)])
    return RunSummary(
        steps=Steps(warmup=10, measured=40, boundary="optimizer.step"),
        phases=rank_phases(data_ms),
        throughput=Throughput(steps_per_s=1000 / (data_ms + 30), samples_per_s=64000 / (data_ms + 30)),
        system=gpu_system(rank),
        meta=Meta(device=f"cuda:{rank} (NVIDIA H100)", timing="cuda", command=f"train.py --tag {EVIL}", rank=rank,
                  local_rank=rank, world_size=2),
        series=series,
    )  # fmt: skip


# PipelineMonitor.to_summary()'s layout: its snapshot's fields and the history.
PIPELINE = {
    "window_s": 10.0, "slots": 4, "infer_capacity": 900.0, "train_capacity": 1500.0, "thru": 880.0, "inflow": 900.0,
    "infer_batch_time_s": 0.28, "dispatch_wait_s": 0.01, "pool": 12.0, "pool_trend": -1.5, "slot_busy": 0.85,
    "infer_calls": 320, "infer_errors": 0, "train_steps": 140, "samples_in": 8800.0, "samples_out": 8750.0,
    "bottleneck": "inference", "confidence": "high", "training_side": None,
    "evidence": [f"inference capacity 900/s is below training's 1500/s ({EVIL})"],
    "history": [
        {"t_s": 10.0 * i, "infer_capacity": 880.0 + i, "train_capacity": 1500.0 - i, "thru": 870.0 + i,
         "inflow": 890.0, "pool": 12.0 - i % 3}
        for i in range(1, 7)
    ],
}  # fmt: skip


def trace_analysis() -> TraceAnalysis:
    """Two GPU ranks of one job: rank 1 straggles; a kernel and a skipped file carry EVIL (names come from the run)."""
    kernels = [
        KernelStat(f"gemm_{EVIL}", "computation", 120, 84_000.0, 700.0, 70.0),
        KernelStat("ncclKernel_AllReduce_RING_LL_Sum_float", "communication", 40, 24_000.0, 600.0, 20.0),
        KernelStat("Memcpy HtoD (Pageable -> Device)", "memory", 40, 12_000.0, 300.0, 10.0),
    ]
    ranks = [
        RankTrace(rank, f"/runs/traces/rank{rank}.step4-6.pt.trace.json.gz", "/runs/traces", "distributedInfo",
                  "cuda", steps=2, step_ms=60.0 + 12 * rank, kernel_span_ms=118.0 + 24 * rank,
                  idle_pct=12.5 + 10 * rank, compute_pct=70.0 - 10 * rank, non_compute_pct=17.5, overlap_pct=40.0,
                  exposed_comm_pct=8.0, idle_breakdown={"host_wait_pct": 60.0, "kernel_wait_pct": 5.0,
                                                        "other_pct": 35.0},
                  top_kernels=kernels, data_loading=DataLoading(2, 3.5, 5.8, 90.0),
                  phases_ms={"forward": 20.0, "backward": 38.0}, notes=[f"rank note {EVIL}"],
                  verdict=Verdict("compute", "medium", ["computation kernels run 70% of the kernel span"]))
        for rank in (0, 1)
    ]  # fmt: skip
    files = [TraceFileStatus(r.file, True, rank=r.rank) for r in ranks]
    files.append(TraceFileStatus(f"/runs/traces/{EVIL}.json", False, "the file is empty"))
    straggler = {"job": "/runs/traces", "rank": 1, "step_ms": 72.0, "median_step_ms": 60.0, "slower_pct": 20.0,
                 "why": "GPU idle: +9.84 ms per step over the other ranks' median"}  # fmt: skip
    return TraceAnalysis(
        ranks, files, Verdict("compute", "medium", ["2 of 2 ranks are compute-bound"]), stragglers=[straggler],
        warnings=[f"a warning {EVIL}"],
    )  # fmt: skip


def multi_rank_summary(pipeline: bool = True) -> RunSummary:
    """A merged two-rank CUDA doctor summary: rank 1 straggles in data_wait; fixes, notes and names carry EVIL."""
    ranks = [rank_summary(0, 10.0), rank_summary(1, 24.0)]
    fix = Fix(
        id="loader.num_workers",
        title=f"Load batches in enough worker processes {EVIL}",
        why=f"every batch is built in the training process {EVIL}",
        evidence=[f"loader 0 ({EVIL}) has num_workers=0", f"kernel {EVIL} runs 2 ms"],
        how=f"DataLoader(..., num_workers=4) {EVIL}",
        cost="config",
        gain_bound=0.39,
        gain_reason=f"at most the data wait {EVIL}",
    )
    unbounded = Fix("host.sync", "Stop reading GPU values every step", "why", [], "how", "code", None, "no bound")
    return RunSummary(
        steps=Steps(warmup=10, measured=40, boundary="optimizer.step"),
        phases=rank_phases(17.0),
        throughput=Throughput(steps_per_s=21.3, samples_per_s=2700.0, step_time_ms=47.0, tflops=120.0, mfu=0.12,
                              mfu_peak="NVIDIA H100 bfloat16 dense 989.4 TFLOP/s"),
        verdict=Verdict("data", "high", [f"data_wait is 36% of the step {EVIL}"]),
        fixes=[fix, unbounded],
        system={"signals": [{"id": "transform_bound", "evidence": f"rank 1: workers pegged {EVIL}"}]},
        ranks=ranks,
        meta=Meta(stepscope_version="0.1.0", device="cuda:0 (NVIDIA H100)", timing="cuda",
                  command=f"train.py --tag {EVIL}", hostname=f"host-{EVIL}", world_size=2,
                  started_at="2026-11-23T10:00:00+00:00"),
        notes=[f"a note {EVIL}"],
        loaders=[LoaderInfo(0, f"Dataset{EVIL}", 64, 0, True, False, None, True, False, 100, 50, 3200, 2.1)],
        counters={"item_calls": 1.0, "host_syncs": 1.0},
        exit=Exit("error", 1, f"RuntimeError: {EVIL}"),
        cluster=Cluster(2, [0, 1], 2700.0, straggler=Straggler(1, "data_wait", 14.0)),
        dataloader={
            "loader": {"samples_per_s": 1500.0},
            "cluster_sync_samples_per_s": 3000.0,
            "against_training": {"loader_ceiling": 3000.0, "train_rate": 2700.0, "headroom": 1.11,
                                 "input_bound": False},
            "best": {"settings": {"num_workers": 4, "prefetch_factor": 4, "pin_memory": True,
                                  "persistent_workers": True}, "samples_per_s": 9000.0, "gain": 5.0},
        },
        pipeline=dict(PIPELINE) if pipeline else {},
        trace=highlights(trace_analysis(), "/runs/traces"),
    )  # fmt: skip


def cpu_summary(system: dict | None = None) -> RunSummary:
    """A single-process CPU `stepscope run` summary with no fixes and, unless given, no sampled system."""
    phases = {"data_wait": phase(3.0, 0.3), "forward": phase(6.0, 0.6), "other": phase(1.0, 0.1)}
    phases["total"] = phase(10.0, 1.0)
    return RunSummary(
        steps=Steps(warmup=3, measured=20),
        phases=phases,
        throughput=Throughput(steps_per_s=100.0, samples_per_s=800.0, step_time_ms=10.0),
        verdict=Verdict("compute", "medium", ["forward is 60% of the step"]),
        system=system or {},
        meta=Meta(command="basic.py", device="cpu"),
        series=StepSeries(1, [30.0, 12.0, 11.0, *[10.0] * 20]),
    )


def section_ids(page: str) -> list[str]:
    return re.findall(r'<section id="([^"]+)"', page)


def section_of(page: str, section_id: str) -> str:
    found = re.search(rf'<section id="{section_id}">.*?</section>', page, flags=re.S)
    assert found, f"no {section_id} section"
    return found.group(0)


def svgs(page: str) -> list[ET.Element]:
    """Every inline chart, parsed as XML: a stray quote or bracket in a label would fail here."""
    return [ET.fromstring(s) for s in re.findall(r"<svg .*?</svg>", page, flags=re.S)]


def svg_text(element: ET.Element) -> str:
    return " ".join("".join(e.itertext()) for e in element.iter("{http://www.w3.org/2000/svg}text"))


# --- sections and escaping ----------------------------------------------------------------------------------------


def test_every_user_string_is_escaped_never_raw():
    page = render_html(multi_rank_summary())
    assert "<script" not in page.lower()  # the page has no script of its own either
    assert "alert(1)</" not in page
    # command, host, phase, evidence (verdict, fix, pipeline, signals), fix text, loader, device, notes, exit error
    assert page.count(EVIL_ESCAPED) >= 15
    for chart in svgs(page):
        assert "<script" not in ET.tostring(chart, encoding="unicode")
    # in the charts the strings are text, shown as they are
    assert any(EVIL in svg_text(chart) for chart in svgs(page))


def test_a_full_summary_has_every_section_in_order():
    page = render_html(multi_rank_summary())
    assert section_ids(page) == [
        "verdict", "fixes", "phases", "step-time", "system", "capacity", "pipeline", "trace", "run"
    ]  # fmt: skip
    assert '<span class="bound bound-data">data</span>' in page
    assert "confidence high" in page
    assert "Straggler: rank 1, data_wait +14.0 ms" in page
    assert "the script failed: RuntimeError:" in page  # an abnormal exit is said next to the verdict


def test_fixes_show_rank_cost_and_gain_bound():
    page = render_html(multi_rank_summary())
    fixes = section_of(page, "fixes")
    assert f"1. Load batches in enough worker processes {EVIL_ESCAPED}" in fixes
    assert '<span class="tag cost-config">config</span><span class="tag gain">≤ 39% of step time</span>' in fixes
    assert 'style="width:39.0%"' in fixes
    assert "2. Stop reading GPU values every step" in fixes and "gain not bounded" in fixes
    assert fixes.index("1. Load") < fixes.index("2. Stop")


def test_multi_rank_phase_bars_step_lines_and_gpu_series_per_rank():
    page = render_html(multi_rank_summary())
    charts = {chart.get("aria-label"): svg_text(chart) for chart in svgs(page)}
    bars = charts["share of the step time by phase"]
    assert "all ranks (mean)" in bars and "rank 0" in bars and "rank 1" in bars
    assert "data_wait" in bars and "h2d" not in bars  # nested phases are inside their parent's share
    assert "rank 0" in charts["step time over the run"] and "rank 1" in charts["step time over the run"]
    assert "warm-up" in charts["step time over the run"]
    assert "rank 1 · GPU utilisation" in charts["GPU"] and "rank 1 · SM clock" in charts["GPU"]
    assert "rank 0 · GPU power" in charts["GPU power"]
    assert "rank 0 · loader workers" in charts["host CPU"]
    phases = section_of(page, "phases")
    assert "<h3>Per rank</h3>" in phases and "GPU mean ms" in phases
    assert "<td>↳ h2d</td>" in phases  # nested: listed, marked, and not stacked


def test_step_time_caps_the_compile_step_and_keeps_its_value_in_the_hover_text():
    page = render_html(multi_rank_summary())
    section = section_of(page, "step-time")
    assert "Warm-up steps up to 1,280 ms" in section  # (2500 + 24 + 35) / 2: the first point averages 2 steps
    assert "each point is the mean of 2 consecutive steps" in section
    assert "rank 1: 1,280 ms at step 1.5" in section
    (chart,) = svgs(section)
    top = min(float(c.get("cy")) for c in chart.iter("{http://www.w3.org/2000/svg}circle"))
    first = next(c for c in chart.iter("{http://www.w3.org/2000/svg}circle") if "1,280 ms" in "".join(c.itertext()))
    assert float(first.get("cy")) == top  # drawn on the top edge


def test_pipeline_section_present_and_absent():
    with_pipeline = render_html(multi_rank_summary(pipeline=True))
    section = section_of(with_pipeline, "pipeline")
    assert "Bottleneck: <b>inference</b> (confidence high)" in section
    assert '<td>slots busy</td><td class="num">85.0%</td>' in section
    assert EVIL_ESCAPED in section
    assert "Rates over time" in section and "Pool over time" in section
    assert "inference capacity" in section and "900 samples/s" in section
    assert "pipeline" not in section_ids(render_html(multi_rank_summary(pipeline=False)))


def test_validation_passes_have_their_section_after_the_phases_only_when_there_are_any():
    summary = cpu_summary()
    assert "eval" not in section_ids(render_html(summary))
    summary.eval = {
        "passes": 4,
        "time_s": 1.0,
        "share_of_wall": 0.74,
        "mean_ms": 250.9,
        "median_ms": 250.1,
        "max_ms": 260.0,
        "phases_ms": {"data_wait": 3.7, "forward": 245.7, "other": 1.5},
        "forwards_per_pass": 30.0,
        "batches_per_pass": 30.0,
    }
    page = render_html(summary)
    ids = section_ids(page)
    assert ids.index("phases") < ids.index("eval")
    section = section_of(page, "eval")
    assert "4 validation pass(es) between training steps took 74.0% of wall time" in section
    assert '<td>mean</td><td class="num">250.9</td>' in section
    assert '<td>inside: forward</td><td class="num">245.7</td>' in section


def test_trace_section_shows_ranks_kernels_stragglers_verdict_and_skipped_files():
    page = render_html(multi_rank_summary())
    section = section_of(page, "trace")
    assert "<code>/runs/traces</code>" in section
    assert "Trace verdict: <b>compute</b>" in section and "2 of 2 ranks are compute-bound" in section
    rows = re.findall(r"<tr><td>(rank \d)</td>(.*?)</tr>", section)
    assert [label for label, _ in rows] == ["rank 0", "rank 1"]
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", rows[1][1])
    # bound, steps, step ms, idle, compute, non-compute, host wait, kernel wait, overlap, exposed comm, data ms/step
    assert cells == ["compute", "2", "72.0", "22.5", "60.0", "17.5", "60.0", "5.0", "40.0", "8.0", "3.500"]
    assert "ATen ops %" not in section  # GPU traces
    (chart,) = svgs(section)
    assert chart.get("aria-label") == "GPU time by kind, % of the kernel span"
    titles = [t.text for t in chart.iter("{http://www.w3.org/2000/svg}title")]
    assert "rank 1 · idle: 22.5% (31.9 ms of a 142.0 ms kernel span)" in titles
    assert "<h3>Top kernels, rank 0</h3>" in section
    assert f'<td>gemm_{EVIL_ESCAPED}</td><td>computation</td><td class="num">120</td>' in section
    assert "rank 1: 72.0 ms per step, 20.0% above the median of the other ranks (60.0 ms); GPU idle" in section
    assert f"rank 0: rank note {EVIL_ESCAPED}" in section and f"a warning {EVIL_ESCAPED}" in section
    assert f"<li>{EVIL_ESCAPED}.json: the file is empty</li>" in section
    assert "<script" not in section and "alert(1)</" not in section


def test_trace_section_absent_without_analysed_ranks():
    assert "trace" not in section_ids(render_html(cpu_summary()))
    nothing = RunSummary(trace={"folder": "/t", "ranks": [], "skipped": [{"file": "a.json", "reason": "empty"}]})
    assert section_ids(render_html(nothing)) == ["verdict", "run"]


def test_trace_section_of_a_cpu_only_trace_has_no_gpu_columns_or_chart():
    rank = RankTrace(0, "/t/rank0.json", "/t", "file name", "cpu", steps=2, step_ms=5.0,
                     data_loading=DataLoading(2, 1.0, 20.0, None), cpu=CpuShare(1, 10.0, 35.0, 65.0),
                     verdict=Verdict("data", "medium", ["DataLoader spans take 1.0 ms per step"]))  # fmt: skip
    page = render_html(RunSummary(trace=highlights(TraceAnalysis([rank], [], rank.verdict), "/t")))
    section = section_of(page, "trace")
    assert svgs(section) == [] and "idle %" not in section and "Top kernels" not in section
    assert re.findall(r"<th[^>]*>([^<]*)</th>", section) == ["rank", "bound", "steps", "step ms", "data ms/step",
                                                             "ATen ops %"]  # fmt: skip
    assert "<td>rank 0</td><td>data</td>" in section and ">35.0</td>" in section


def test_trace_labels_name_the_file_when_files_share_a_rank():
    analysis = trace_analysis()
    analysis.ranks[1].rank = 0
    section = section_of(render_html(RunSummary(trace=highlights(analysis, "/runs/traces"))), "trace")
    assert "<td>rank 0 · rank1.step4-6.pt.trace.json.gz</td>" in section


def gloo_job(late: bool) -> RunSummary:
    """A CPU-only two-rank job in a folder named EVIL, with top operators per rank; rank 1 late from data loading."""
    job = f"/t/{EVIL}"
    ranks = [
        RankTrace(rank, f"{job}/rank{rank}.json", job, "distributedInfo", "cpu", steps=5, step_ms=16.0,
                  cpu=CpuShare(1, 80.0, 2.0, 98.0), verdict=Verdict("data" if rank else "unknown", "medium", []),
                  top_ops=[OpStat(f"op{rank} {EVIL}", 6, 91.2 - 80 * (1 - rank), 50.0, 91.5), OpStat("aten::mm", 12,
                           0.125, 0.1, 0.25)])
        for rank in (0, 1)
    ]  # fmt: skip
    entry = {
        "job": job, "rank": 1, "cause": "data", "collectives": 5, "last_at": 4, "late_ms": 15.25, "waited_ms": 14.5,
        "wait_share_pct": 82.4, "wait_pct": 58.0, "cause_ms": 15.3, "others_cause_ms": 0.02, "unit": "per step",
        "clock_offset_ms": {"0": 0.0, "1": 0.4}, "evidence": [],
    }  # fmt: skip
    analysis = TraceAnalysis(ranks, [], Verdict("data", "high", []), late_ranks=[entry] if late else [])
    return RunSummary(trace=highlights(analysis, "/t"))


def test_trace_section_names_the_late_rank_and_its_top_operators():
    section = section_of(render_html(gloo_job(late=True)), "trace")
    assert (
        f"<h3>Late rank</h3><ul><li>in {EVIL_ESCAPED}, rank 1 arrives last at 4 of 5 collectives in the traces, on "
        "average 15.25 ms after the others; they wait 14.50 ms per step for it (82% of their communication time), "
        "while it spends 15.30 ms per step on data loading against their 0.02 ms</li></ul>"
    ) in section
    # the late rank's operators (what it did while the others waited), not the first rank's
    assert "<h3>Top operators, rank 1 (CPU-only trace)</h3>" in section and "Top operators, rank 0" not in section
    assert re.findall(r"<th[^>]*>([^<]*)</th>", section.split("Top operators")[1]) == [
        "operator", "calls", "self ms", "% self time", "total ms",
    ]  # fmt: skip
    assert (
        f'<tr><td>op1 {EVIL_ESCAPED}</td><td class="num">6</td><td class="num">91.2</td><td class="num">50.0</td>'
        '<td class="num">91.5</td></tr><tr><td>aten::mm</td><td class="num">12</td><td class="num">0.125</td>'
        '<td class="num">0.1</td><td class="num">0.250</td></tr>'
    ) in section
    assert "<script" not in section


def test_trace_section_without_a_late_rank_lists_the_first_cpu_ranks_operators():
    section = section_of(render_html(gloo_job(late=False)), "trace")
    assert "Late rank" not in section and "<h3>Top operators, rank 0 (CPU-only trace)</h3>" in section
    gpu = section_of(render_html(multi_rank_summary()), "trace")
    assert "Late rank" not in gpu and "Top operators" not in gpu, "GPU traces list their kernels"


def test_the_pipeline_fixture_has_the_monitors_layout():
    from stepscope.pipeline.monitor import PipelineSnapshot

    assert set(PIPELINE) == {f.name for f in dataclasses.fields(PipelineSnapshot)} | {"history"}


def test_capacity_compares_loader_ceiling_training_and_realised():
    page = render_html(multi_rank_summary())
    section = section_of(page, "capacity")
    (chart,) = svgs(section)
    text = svg_text(chart)
    assert "3,000 samples/s" in text  # against_training's ceiling
    assert "4,230 samples/s" in text  # 2700 / (1 - 17/47): training without its data waits
    assert "2,700 samples/s" in text
    assert "The loader alone gives 1.11× what training consumed." in section
    assert "num_workers=4, prefetch_factor=4, persistent_workers=True, pin_memory=True" in section
    assert "+500%" in section


def test_an_empty_summary_renders_with_the_verdict_and_the_run_only():
    page = render_html(RunSummary())
    assert section_ids(page) == ["verdict", "run"]
    assert '<span class="bound bound-unknown">unknown</span>' in page
    assert "The measurements are too thin for a verdict." in page
    assert "No ranked fixes here" in page


def test_a_cpu_run_without_samples_leaves_out_the_system_section():
    page = render_html(cpu_summary())
    assert section_ids(page) == ["verdict", "phases", "step-time", "run"]
    assert "GPU mean ms" not in page  # host timing: no GPU columns


def test_a_cpu_run_with_host_samples_has_no_gpu_charts():
    system = gpu_system(0)
    system["gpu"] = {"available": False, "reason": "this process uses no CUDA device.", "devices": []}
    for name in ("gpu_util_pct", "sm_clock_ratio", "power_w"):
        system["timeline"][name] = [None] * len(system["timeline"]["t_s"])
    page = render_html(cpu_summary(system))
    section = section_of(page, "system")
    assert "<h2>Host over time</h2>" in section
    assert [chart.get("aria-label") for chart in svgs(section)] == ["host CPU"]
    assert "NVIDIA" not in section


def test_a_schema_1_summary_file_renders(tmp_path):
    path = tmp_path / "old.json"
    path.write_text('{"schema_version": 1, "steps": {"warmup": 1, "measured": 2}, "meta": {"command": "x.py"}}')
    assert main(["report", str(path), "--html", str(tmp_path / "old.html")]) == 0
    assert section_ids((tmp_path / "old.html").read_text()) == ["verdict", "run"]


def test_write_html_creates_folders_and_returns_the_path(tmp_path):
    path = write_html(cpu_summary(), tmp_path / "a" / "b" / "report.html")
    assert path.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")


# --- the SVG helpers ----------------------------------------------------------------------------------------------


def test_nice_ticks_cover_the_range_with_round_steps():
    assert svg.nice_ticks(0, 41.3) == [0, 10, 20, 30, 40, 50]
    assert svg.nice_ticks(0, 1) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert svg.nice_ticks(0, 12) == [0, 2.5, 5, 7.5, 10, 12.5]
    assert svg.nice_ticks(5, 5) == [5, 6, 7, 8, 9, 10]  # an empty range still gets an axis
    assert svg.tick_text(7.5, 2.5) == "7.5" and svg.tick_text(1500, 500) == "1,500"


def test_line_chart_breaks_at_gaps_and_caps_at_y_max():
    chart = svg.line_chart(
        [("a", [1, 2, 3, 4], [1.0, None, 3.0, 100.0])], x_label="step", y_label="time", y_unit="ms", y_max=4
    )
    root = ET.fromstring(chart)
    (path,) = root.iter("{http://www.w3.org/2000/svg}path")
    assert path.get("d").count("M") == 2  # the None splits the line
    circles = list(root.iter("{http://www.w3.org/2000/svg}circle"))
    assert len(circles) == 3
    assert "a: 100 ms at step 4" in "".join(circles[-1].itertext())
    assert float(circles[-1].get("cy")) == min(float(c.get("cy")) for c in circles)
    assert svg.line_chart([("a", [1], [None])], x_label="x", y_label="y") == ""


def test_long_lines_drop_their_hover_targets_to_keep_the_page_small():
    x = list(range(3000))
    few = svg.line_chart([("a", x[:100], [1.0] * 100)], x_label="x", y_label="y")
    assert few.count("<circle") == 100  # invisible hover targets, one per point
    many = svg.line_chart([("a", x, [1.0] * 3000), ("b", x, [2.0] * 3000)], x_label="x", y_label="y")
    assert many.count("<circle") == 0 and many.count("<path") == 2


def test_stacked_bars_escape_labels_and_segments():
    chart = svg.stacked_bars([EVIL], ["a<b", "c"], [[60.0, 40.0]], unit="%", details=[["1 ms", ""]])
    root = ET.fromstring(chart)
    text = svg_text(root)
    assert "a<b" in text and "60.0%" in text
    titles = [t.text for t in root.iter("{http://www.w3.org/2000/svg}title")]
    assert f"{EVIL} · a<b: 60.0% (1 ms)" in titles
    assert "<script>" not in chart
    assert svg.stacked_bars([], ["a"], []) == "" and svg.bars([], []) == ""


# --- the CLI ------------------------------------------------------------------------------------------------------


def test_report_writes_the_page_of_a_summary(tmp_path, capsys):
    source = tmp_path / "run.json"
    multi_rank_summary().to_json(source)
    out = tmp_path / "pages" / "report.html"
    assert main(["report", str(source), "--html", str(out)]) == 0
    assert capsys.readouterr().out == f"report written to {out}\n"
    assert section_ids(out.read_text())[:2] == ["verdict", "fixes"]


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "no summary file at"), ("not json", "is not valid JSON"), ('{"schema_version": 99}', "upgrade stepscope")],
)
def test_report_of_a_bad_summary_is_one_sentence_and_exit_2(tmp_path, capsys, content, message):
    source = tmp_path / "run.json"
    if content is not None:
        source.write_text(content)
    assert main(["report", str(source), "--html", str(tmp_path / "r.html")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("stepscope: ") and message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "r.html").exists()


def test_report_into_a_folder_is_a_usage_error(tmp_path, capsys):
    source = tmp_path / "run.json"
    cpu_summary().to_json(source)
    assert main(["report", str(source), "--html", str(tmp_path)]) == 2
    assert "cannot write the report" in capsys.readouterr().err


def test_report_needs_html(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(tmp_path / "run.json")])
    assert exit_info.value.code == 2
    assert "--html" in capsys.readouterr().err


def hostile_trace() -> Kineto:
    """Three 1 ms steps, each a 400 µs kernel whose name is EVIL (kernel names come from user and compiler code)."""
    trace = Kineto(rank=0)
    for n in range(3):
        trace.step(n + 1, 1000 * n, 1000)
        trace.kernel(EVIL, 1000 * n + 300, 400)
    return trace


def test_report_trace_adds_a_trace_folders_highlights_to_a_saved_summary(tmp_path, capsys):
    source = tmp_path / "run.json"
    cpu_summary().to_json(source)
    traces = tmp_path / "traces"
    hostile_trace().write(traces / "rank0.step4-6.pt.trace.json.gz")
    text = hostile_trace().text()
    (traces / "rank1.json").write_bytes(text[: len(text) // 2])  # a capture cut short
    out = tmp_path / "report.html"
    assert main(["report", str(source), "--html", str(out), "--trace", str(traces)]) == 0
    assert capsys.readouterr() == (f"report written to {out}\n", "")
    page = out.read_text()
    assert section_ids(page)[-2:] == ["trace", "run"]
    section = section_of(page, "trace")
    assert f"<td>{EVIL_ESCAPED}</td><td>computation</td>" in section
    assert "<li>rank1.json: the file ends inside traceEvents after " in section
    assert "<script" not in page and "alert(1)</" not in page
    assert RunSummary.from_json(source).trace == {}, "the saved summary is left as it was"


def test_report_trace_with_nothing_readable_still_writes_the_page_with_a_note(tmp_path, capsys):
    source = tmp_path / "run.json"
    cpu_summary().to_json(source)
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "empty.json").write_bytes(b"")
    out = tmp_path / "report.html"
    assert main(["report", str(source), "--html", str(out), "--trace", str(tmp_path / "traces")]) == 0
    note = f"The traces in {tmp_path / 'traces'} could not be analysed (empty.json: the file is empty)."
    assert capsys.readouterr() == (f"report written to {out}\n", f"stepscope: {note}\n")
    page = out.read_text()
    assert "trace" not in section_ids(page)
    assert note in section_of(page, "run")


def test_report_trace_of_a_missing_folder_is_a_usage_error(tmp_path, capsys):
    source = tmp_path / "run.json"
    cpu_summary().to_json(source)
    assert main(["report", str(source), "--html", str(tmp_path / "r.html"), "--trace", str(tmp_path / "no")]) == 2
    assert capsys.readouterr().err == f"stepscope: --trace {tmp_path / 'no'}: no such file or folder.\n"
    assert not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("verb", ["run", "doctor"])
def test_html_is_an_option_of_the_measuring_verbs_and_takes_a_value(verb):
    options, command = _split_run(["--html", "r.html", "train.py", "--html", "theirs"])
    assert options == ["--html", "r.html"] and command == ["train.py", "--html", "theirs"]
    assert build_parser().parse_args([verb, *options]).html == "r.html"


def test_run_html_writes_the_report_of_a_real_run(tmp_path):
    page_path = tmp_path / "out" / "report.html"
    result = stepscope_here(tmp_path, "--html", str(page_path), script("basic.py"), warmup=2, steps=6)
    assert result.returncode == 0, result.describe()
    assert f"report written to {page_path}" in result.stdout
    page = page_path.read_text()
    bound = result.summary.verdict.bound
    assert f'<span class="bound bound-{bound}">{bound}</span>' in page
    # Host-time lines are there when the stack sampler caught the 6 short steps outside their phases (it may not).
    assert [s for s in section_ids(page) if s != "hotspots"][:3] == ["verdict", "phases", "step-time"]
    assert "basic.py" in page
    (chart,) = svgs(section_of(page, "step-time"))
    assert len(list(chart.iter("{http://www.w3.org/2000/svg}circle"))) == 8  # 2 warm-up + 6 measured steps


# --- real rendering in headless Chromium --------------------------------------------------------------------------

PAGE_PROBES = {
    "bound": "document.querySelector('#verdict .bound').textContent",
    "verdict_visible": "document.querySelector('#verdict .bound').getBoundingClientRect().height > 0",
    "sections": "[...document.querySelectorAll('section')].map(s => s.id)",
    "chart_sizes": "[...document.querySelectorAll('svg')].map(s => [s.getBoundingClientRect().width, "
    "s.getBoundingClientRect().height])",
    "scripts": "document.querySelectorAll('script').length",
    "text": "document.body.innerText",
}


@needs_chromium
def test_the_report_renders_in_chromium_without_errors(tmp_path):
    path = write_html(multi_rank_summary(), tmp_path / "report.html")
    load = load_page(path, PAGE_PROBES)
    assert load.errors == [] and load.console == []
    assert load.requests == [path.resolve().as_uri()]  # nothing fetched: self-contained
    assert load.values["bound"] == "data" and load.values["verdict_visible"]
    assert load.values["sections"] == section_ids(path.read_text())
    assert len(load.values["chart_sizes"]) == len(svgs(path.read_text())) == 10
    assert all(w > 300 and h > 40 for w, h in load.values["chart_sizes"])
    assert load.values["scripts"] == 0
    assert f"train.py --tag {EVIL}" in load.values["text"]  # escaped in the source, shown as typed


@needs_chromium
def test_an_empty_report_renders_in_chromium_without_errors(tmp_path):
    path = write_html(RunSummary(), tmp_path / "empty.html")
    load = load_page(path, PAGE_PROBES)
    assert load.errors == [] and load.console == []
    assert load.values["bound"] == "unknown" and load.values["sections"] == ["verdict", "run"]


@needs_chromium
def test_the_chromium_probe_sees_errors_and_requests(tmp_path):
    """The checks above mean something: a broken page is reported."""
    path = tmp_path / "broken.html"
    path.write_text(
        '<!DOCTYPE html><html><body><img src="missing.png">'
        "<script>console.error('boom'); notDefined();</script></body></html>"
    )
    load = load_page(path, {"title": "document.title"})
    assert "console.error: boom" in load.errors
    assert any("notDefined is not defined" in e for e in load.errors)
    assert any("ERR_FILE_NOT_FOUND" in e for e in load.errors)
    assert load.requests == [path.resolve().as_uri(), (tmp_path / "missing.png").resolve().as_uri()]
