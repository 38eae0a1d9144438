"""The late rank at collectives, end to end: a real 2-rank gloo job under `stepscope run --trace` in which rank 1's
DataLoader sleeps a known time per batch, read back from the summary's trace highlights, from `stepscope trace
--json`, from the terminal and from the HTML page; then the per-step figures when some collectives are left out, and
the doctor's evidence line (synthetic, exact answers).

The ground truth is a sleep: rank 1 spends at least ``BATCH_MS`` per step in its DataLoader, rank 0 about nothing,
so rank 0 reaches every all-reduce about ``BATCH_MS`` early and waits there. The bounds leave room for a loaded
machine (sleeps run long, processes are descheduled) and still fail when the rank, the cause or the figures are wrong.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from kineto import Kineto
from run_helpers import run_env, script, stepscope_run, torchrun

from stepscope.analyses.trace.analyze import analyze_trace
from stepscope.doctor.verdict import late_rank_lines, refine
from stepscope.summary import RunSummary, Verdict

BATCH_MS = 15.0  # rank 1's DataLoader sleeps this long per batch; rank 0's not at all
ACTIVE = 6  # profiled steps: the last is dropped (HTA's window), so 5 steps and their 5 all-reduces are compared
LOADER = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"


def check_late_rank_1_from_data(late: dict, where: str) -> None:
    """The late-rank entry of the job: rank 1, from data loading, and what it costs rank 0."""
    assert (late["rank"], late["cause"], late["unit"]) == (1, "data", "per step"), where
    assert 3 <= late["collectives"] <= ACTIVE - 1, f"{where}: most of the 5 all-reduces are compared"
    assert late["last_at"] >= late["collectives"] - 1, f"{where}: rank 1 starts (almost) every one last"
    # rank 1 loads at least BATCH_MS per step before the all-reduce; no sleep runs twice as long, even loaded
    assert 0.99 * BATCH_MS * late["last_at"] / late["collectives"] <= late["cause_ms"] <= 2 * BATCH_MS, where
    assert late["others_cause_ms"] < 0.2 * BATCH_MS, f"{where}: rank 0's batches cost nothing"
    assert late["late_ms"] >= 0.5 * BATCH_MS and late["waited_ms"] >= 0.5 * BATCH_MS, where
    # No bound on wait_share_pct beyond the 50% that names a late rank at all: beside busy loops the all-reduce's
    # own time grows with the load while the 15 ms sleep does not (57% once, where 60 was asked); the wait itself is
    # bounded above, from the sleep
    assert late["wait_pct"] >= 15, f"{where}: enough of rank 0's time for rank 1 to decide the job's verdict"
    assert abs(late["clock_offset_ms"]["1"]) < 0.5 * BATCH_MS, f"{where}: one host, one clock"


def check_verdict(verdict: dict, where: str) -> None:
    assert verdict["bound"] == "data", f"{where}: {verdict}"
    evidence = verdict["evidence"]
    assert evidence[0].startswith("rank 1 starts ") and "(gloo ranges, e.g. gloo:" in evidence[0], evidence
    assert "inside their collectives" in evidence[1], evidence
    assert evidence[2].startswith("before those collectives rank 1 spends ") and "on data loading" in evidence[2]


def test_a_rank_late_from_its_data_loader_in_a_real_gloo_job(tmp_path):
    traces, page = tmp_path / "traces", tmp_path / "report.html"
    r = stepscope_run(
        tmp_path, "--trace", str(traces), "--trace-window", f"0:1:{ACTIVE}", "--html", str(page),
        "--", *torchrun(), script("late_loader.py"), "--batch-ms", str(BATCH_MS),
        warmup=2, steps=3, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.describe()
    trace = r.summary.trace
    assert trace, r.describe()
    assert [(x["rank"], x["step_source"], x["steps"]) for x in trace["ranks"]] == [
        (0, "ProfilerStep", ACTIVE - 1), (1, "ProfilerStep", ACTIVE - 1),
    ], r.describe()  # fmt: skip
    rank0, rank1 = trace["ranks"]
    assert rank1["trace_ms"] >= ACTIVE * BATCH_MS, "each profiled step loads one batch"
    assert rank1["data_loading"]["per_step_ms"] >= 0.99 * BATCH_MS > 10 * rank0["data_loading"]["per_step_ms"]
    # CPU-only traces carry their top operators: rank 1's is its sleeping DataLoader, once per profiled step
    top = rank1["top_ops"][0]
    assert (top["name"], top["count"]) == (LOADER, ACTIVE), rank1["top_ops"]
    assert top["self_ms"] >= 0.99 * ACTIVE * BATCH_MS, top
    assert all(op["self_ms"] < ACTIVE * 0.1 * BATCH_MS for op in rank0["top_ops"] if op["name"] == LOADER)
    (late,) = trace["late_ranks"]
    check_late_rank_1_from_data(late, "summary")
    check_verdict(trace["verdict"], "summary")

    # where users look: the terminal's summary and the HTML page say which rank is late, and why
    terminal = " ".join(r.stdout.split())
    assert "trace late rank: rank 1 arrives last at " in terminal, r.describe()
    assert "ms per step on data loading against their " in terminal, r.describe()
    html = page.read_text()
    section = html[html.index('<section id="trace">') :]
    assert "<h3>Late rank</h3><ul><li>rank 1 arrives last at " in section
    assert "<h3>Top operators, rank 1 (CPU-only trace)</h3>" in section

    # `stepscope trace DIR --json` on the same files: the same late rank and verdict
    out = tmp_path / "trace.json"
    done = subprocess.run(
        [sys.executable, "-m", "stepscope.cli", "trace", str(traces), "--json", str(out)],
        env=run_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    analysis = json.loads(out.read_text())
    (full,) = analysis["late_ranks"]
    check_late_rank_1_from_data(full, "stepscope trace --json")
    assert full["cause_ms"] == pytest.approx(late["cause_ms"], abs=1e-3)
    check_verdict(analysis["verdict"], "stepscope trace --json")
    assert [rank["verdict"]["bound"] for rank in analysis["ranks"]][1] == "data", "rank 1 alone is data-bound too"


# ---------------------------------------------------------------------------------------------------------------------
# Per-step figures when some collectives are left out (synthetic: exact answers)
# ---------------------------------------------------------------------------------------------------------------------


def gloo_steps(rank: int, loader_us: float, late_end: dict[int, float], steps: int = 5) -> Kineto:
    """``steps`` ProfilerSteps of 2 ms on CPU (the last dropped): loading, 300 µs of ATen ops, then a gloo all-reduce
    that ends at 900 µs on every rank, except in the steps of ``late_end`` (step -> µs it ends later on this rank)."""
    trace = Kineto(rank=rank, device=None)
    for n in range(steps):
        t0 = 2000 * n
        trace.step(n + 1, t0, 2000)
        trace.host(LOADER, t0, loader_us, cat="user_annotation")
        trace.host("aten::addmm", t0 + loader_us, 300)
        arrive = t0 + loader_us + 300
        trace.host("gloo:all_reduce", arrive, t0 + 900 + late_end.get(n, 0) - arrive, tid=7, cat="user_annotation")
    return trace


def test_a_collective_left_out_does_not_dilute_the_per_step_figures(tmp_path):
    """Rank 1 loads 450 µs per step, rank 0 100 µs; in step 1 rank 1's all-reduce ends 500 µs late (descheduled):
    that collective is left out, and the 3 compared of 4 still give the figures of one step."""
    job = tmp_path / "job"
    gloo_steps(0, 100, {}).write(job / "rank0.json")
    gloo_steps(1, 450, {1: 500}).write(job / "rank1.json")
    (late,) = analyze_trace(job, jobs=1).late_ranks
    assert (late["rank"], late["cause"], late["collectives"], late["last_at"]) == (1, "data", 3, 3)
    assert (late["cause_ms"], late["others_cause_ms"]) == (pytest.approx(0.45), pytest.approx(0.1))
    assert late["waited_ms"] == pytest.approx(0.35)
    assert late["wait_share_pct"] == pytest.approx(100 * 350 / 500)
    assert late["wait_pct"] == pytest.approx(100 * 350 / 2000), "of rank 0's 2 ms steps"


def test_ends_apart_on_most_collectives_from_busy_hosts_still_find_the_late_rank(tmp_path):
    """As beside busy loops: of 7 all-reduces, rank 1 is descheduled at the end of 3 (0.2, 0.6 and 1 ms late) and
    rank 0 at 1 (1.05 ms; each before its next step). Every one still ends after both ranks started it; the ends are
    apart by 0.2 ms (median) here, so only those 1 ms apart are left out, and the 5 others compared (a fixed
    tolerance, 100 µs + 10% of the duration, would leave out 4 of 7 and give up)."""
    job = tmp_path / "job"
    gloo_steps(0, 100, {3: 1050}, steps=8).write(job / "rank0.json")
    gloo_steps(1, 450, {1: 1000, 2: 200, 4: 600}, steps=8).write(job / "rank1.json")
    analysis = analyze_trace(job, jobs=1)
    (late,) = analysis.late_ranks
    assert (late["rank"], late["cause"], late["collectives"], late["last_at"]) == (1, "data", 5, 5), analysis.warnings
    assert (late["cause_ms"], late["others_cause_ms"], late["waited_ms"]) == (
        pytest.approx(0.45), pytest.approx(0.1), pytest.approx(0.35),
    )  # fmt: skip
    assert late["clock_offset_ms"]["1"] == pytest.approx(0.0), "the median end difference: one host, one clock"


def test_a_batch_that_starts_before_the_collectives_recorded_end_still_counts_whole(tmp_path):
    """gloo records an all-reduce's end on its own thread; a busy host can deschedule that thread after it has woken
    the main thread, so the range ends after the next batch has started loading (here 200 µs into the next step, on
    both ranks: their ends agree). Each batch still counts whole toward the collective it delays: 1.2 ms against
    0.1 ms, not 1.0 against 0 (clipped at the recorded end, as a real run on a busy CI host read 14.8 ms for 15)."""
    job = tmp_path / "job"
    everywhere = dict.fromkeys(range(5), 1300)  # all-reduces end at 2.2 ms of their 2 ms step
    gloo_steps(0, 100, everywhere).write(job / "rank0.json")
    gloo_steps(1, 1200, everywhere).write(job / "rank1.json")
    analysis = analyze_trace(job, jobs=1)
    (late,) = analysis.late_ranks
    assert (late["rank"], late["cause"], late["collectives"], late["last_at"]) == (1, "data", 4, 4), analysis.warnings
    assert (late["cause_ms"], late["others_cause_ms"]) == (pytest.approx(1.2), pytest.approx(0.1))


def test_collectives_that_end_before_another_rank_starts_them_are_no_evidence(tmp_path):
    """Rank 1 traced other iterations: its all-reduces fall at other times of the step, so after the best clock
    alignment each ends before rank 0 starts it (or starts after rank 0's ended): no late rank, and a warning."""
    job = tmp_path / "job"
    gloo_steps(0, 100, {}).write(job / "rank0.json")
    other = Kineto(rank=1, device=None)
    for n, arrive in enumerate([100, 1800, 200, 1700, 150]):
        other.step(n + 1, 2000 * n, 2000)
        other.host("gloo:all_reduce", 2000 * n + arrive, 100, tid=7, cat="user_annotation")
    other.write(job / "rank1.json")
    analysis = analyze_trace(job, jobs=1)
    assert analysis.late_ranks == []
    (warning,) = analysis.warnings
    assert "4 end on a rank before another rank starts them): no late-rank analysis" in warning, warning


# ---------------------------------------------------------------------------------------------------------------------
# The doctor's evidence
# ---------------------------------------------------------------------------------------------------------------------

LATE = {
    "job": ".", "rank": 1, "cause": "data", "collectives": 5, "last_at": 4, "late_ms": 15.25, "waited_ms": 14.5,
    "wait_share_pct": 82.4, "wait_pct": 58.0, "cause_ms": 15.3, "others_cause_ms": 0.02, "unit": "per step",
    "clock_offset_ms": {"0": 0.0, "1": 0.4}, "evidence": [],
}  # fmt: skip
LINE = (
    "rank 1 arrives last at 4 of 5 collectives in the traces, on average 15.25 ms after the others; they wait "
    "14.50 ms per step for it (82% of their communication time), while it spends 15.30 ms per step on data loading "
    "against their 0.02 ms"
)


def test_late_rank_lines_name_the_rank_its_cause_and_the_job():
    assert late_rank_lines({"late_ranks": [LATE]}) == [LINE]
    host = {**LATE, "job": "node3", "cause": "host", "unit": "in the trace"}
    (line,) = late_rank_lines({"late_ranks": [host]})
    assert line.startswith("in node3, rank 1 arrives last") and "in the trace on host work (Python, " in line
    assert late_rank_lines({}) == [] and late_rank_lines({"late_ranks": []}) == []


def test_the_doctor_cites_the_late_rank_of_the_traces():
    summary = RunSummary(trace={"late_ranks": [LATE]})
    refined = refine(summary, Verdict("comms", "medium", ["comms is 60% of the step"]))
    assert (refined.bound, refined.evidence) == ("comms", ["comms is 60% of the step", LINE])
    assert refine(RunSummary(), Verdict("comms", "medium", ["x"])).evidence == ["x"], "no trace, no line"
