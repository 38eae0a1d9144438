"""CPU contention: run delay and switches measured from /proc, the cpu_contention signal, the verdict that states it,
and the threads-vs-workers rules; end to end on real scripts, with and without a CPU burner on every core."""

from __future__ import annotations

import math
import os
import subprocess
import threading
import time
from typing import Any

import pytest
from run_helpers import run_env, script, stepscope_cmd
from test_rules import loader, make_summary, threads_fact

from stepscope.collectors.host import (
    HostSource,
    parse_involuntary_switches,
    parse_proc_stat,
    parse_schedstat,
)
from stepscope.collectors.signals import cpu_contention, derive_signals
from stepscope.doctor.rules import Case, diagnose
from stepscope.doctor.verdict import OVERSUBSCRIBED, classify
from stepscope.report.terminal import print_summary, split_contention
from stepscope.summary import RunSummary

LINUX_SCHEDSTAT = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat")
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

# -- parsing fixture text ---------------------------------------------------------------------------------------

PROC_STAT = """cpu  7307 0 2311 39752 152 0 35 6 0 0
cpu0 3600 0 1100 19900 70 0 20 4 100 0
cpu1 3707 0 1211 19852 82 0 15 2 0 0
intr 1234 0 0
ctxt 99887766
"""

STATUS = """Name:\tpython
State:\tR (running)
voluntary_ctxt_switches:\t1520
nonvoluntary_ctxt_switches:\t347
"""


def test_proc_stat_per_core_busy_total_and_steal():
    cores = parse_proc_stat(PROC_STAT)
    assert len(cores) == 2  # the aggregate "cpu " line is not a core
    # cpu0: user..steal = 3600+0+1100+19900+70+0+20+4 = 24694; idle 19900 and iowait 70 are not busy; guest (100)
    # is already inside user and is not added again.
    assert cores[0].total == 24694
    assert cores[0].busy == 24694 - 19900 - 70
    assert cores[0].steal == 4
    assert cores[1].steal == 2


def test_proc_stat_of_an_old_kernel_without_steal():
    (core,) = parse_proc_stat("cpu  1 2 3 4\ncpu0 10 0 5 85\n")
    assert (core.busy, core.total, core.steal) == (15, 100, 0)


def test_schedstat_and_status_fields():
    assert parse_schedstat("22735607 5973944 93\n") == 5973944  # the second field: ns runnable but waiting
    assert parse_involuntary_switches(STATUS) == 347
    assert parse_involuntary_switches("Name:\tx\n") is None


# -- measured on this machine -----------------------------------------------------------------------------------


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds  # wall time: the thread is runnable all along, running or waiting
    while time.monotonic() < end:
        pass


def _host_readings(work: Any, seconds: float = 1.0) -> dict[str, float]:
    source = HostSource()
    t0 = time.monotonic()
    source.start(t0)
    work(seconds)
    return source.read(time.monotonic())


@pytest.mark.skipif(not LINUX_SCHEDSTAT, reason="needs /proc/<pid>/task/<tid>/schedstat")
def test_a_sleeping_thread_accrues_no_run_delay():
    readings = _host_readings(time.sleep)
    # Sleeping is not runnable: whatever else loads the machine, the main thread waited for no CPU.
    assert readings["host/run_delay_main"] < 3.0, readings
    assert readings["host/load_1m"] >= 0


@pytest.mark.skipif(not LINUX_SCHEDSTAT, reason="needs /proc/<pid>/task/<tid>/schedstat")
def test_a_spinning_thread_beside_a_burner_waits_for_a_cpu(burner):
    # CORES + 1 runnable tasks (this thread, the burners) share CORES cores: each runs at most CORES/(CORES+1) of
    # the time, so this thread waited at least 1/(CORES+1) of it (1/3 on 2 cores); half that leaves scheduler slack.
    floor = 100.0 / (CORES + 1) * 0.5
    readings = _host_readings(_spin, 1.0)
    assert readings["host/run_delay_main"] >= floor, readings
    assert readings["host/run_delay_process"] >= readings["host/run_delay_main"] - 0.5, readings
    assert readings["host/others_cpu_util"] >= 50.0 * CORES, readings  # the burners: ~100% of each core
    assert readings.get("host/nvcsw_per_s", 0.0) > 0, readings


@pytest.mark.skipif(not LINUX_SCHEDSTAT, reason="needs /proc/<pid>/task/<tid>/schedstat")
def test_section_reports_run_delay_per_process_group():
    source = HostSource()
    t = time.monotonic()
    source.start(t)
    stats: dict[str, Any] = {}
    from stepscope.collectors.stats import fold

    for _ in range(3):
        time.sleep(0.2)
        fold(stats, source.read(time.monotonic()))
    section = source.section(stats)
    for key in ("run_delay_main_thread_pct", "run_delay_process_pct", "run_delay_workers_pct", "load_avg_1m"):
        assert section[key] is not None, (key, section)
    assert section["machine_cores"] == os.cpu_count()
    assert source.notes == []


# -- the signal on exact inputs ---------------------------------------------------------------------------------


def host(**changes: Any) -> dict[str, Any]:
    base = {
        "cpu_util_pct": 90.0,
        "workers_cpu_util_pct": 90.0,
        "workers_max": 2,
        "workers_busy_avg": 2.0,
        "cores": 2,
        "cpu_quota": None,
        "machine_cores": 2,
        "run_delay_main_thread_pct": 4.0,
        "run_delay_process_pct": 9.9,
        "run_delay_workers_pct": 19.9,
        "others_cpu_util_pct": 10.0,
        "steal_pct": 0.0,
        "load_avg_1m": 3.5,
    }
    return {**base, **changes}


def test_no_contention_below_the_thresholds():
    assert cpu_contention(host()) is None  # 9.9% < 10% for the process, 19.9% < 10% × 2 busy workers


def test_no_signal_where_run_delay_was_not_measured():
    assert cpu_contention(host(run_delay_process_pct=None, run_delay_workers_pct=None)) is None


def test_contention_of_the_training_process_with_others_load():
    signal = cpu_contention(host(run_delay_process_pct=10.0, cpu_util_pct=30.0, workers_cpu_util_pct=0.0,
                                 others_cpu_util_pct=170.0))  # fmt: skip
    assert signal is not None
    assert signal["cause"] == "others"
    assert "waited for a CPU 10% of wall time (summed), its main thread 4%" in signal["evidence"]
    assert "other processes 170% of the machine's 2" in signal["evidence"]
    assert "load average 3.5" in signal["evidence"]


def test_contention_of_the_workers_alone_is_self_inflicted():
    signal = cpu_contention(host(run_delay_workers_pct=20.0))
    assert signal is not None
    assert signal["cause"] == "self"  # others used 10% of a core: the job's own threads and workers crowd the cores
    assert "loader workers 20% (summed over 2 worker(s))" in signal["evidence"]
    assert "training process's threads" not in signal["evidence"]


def test_both_causes_and_steal():
    signal = cpu_contention(host(run_delay_process_pct=50.0, others_cpu_util_pct=60.0))
    assert signal is not None and signal["cause"] == "both"  # job 180% ≥ 50% of 2 cores, others ≥ half a core
    stolen = cpu_contention(host(run_delay_process_pct=50.0, cpu_util_pct=20.0, workers_cpu_util_pct=0.0,
                                 steal_pct=8.0))  # fmt: skip
    assert stolen is not None and stolen["cause"] == "others"
    assert "the hypervisor stole 8%" in stolen["evidence"]


def test_derive_signals_includes_contention_after_three_samples():
    system = {"samples": 3, "host": host(run_delay_process_pct=40.0), "gpu": {"available": False}}
    assert [s["id"] for s in derive_signals(system)][-1] == "cpu_contention"
    assert all(s["id"] != "cpu_contention" for s in derive_signals({**system, "samples": 2}))


# -- the verdict says so ----------------------------------------------------------------------------------------

CONTENDED = {
    "id": "cpu_contention",
    "evidence": "CPU contention (other processes load the machine): x.",
    "cause": "others",
}


def contended(bound_phases: dict[str, float], **host_changes: Any) -> RunSummary:
    summary = make_summary(bound_phases)
    summary.system = {"samples": 5, "host": host(run_delay_process_pct=35.0, **host_changes), "signals": [CONTENDED]}
    return summary


def test_the_verdict_states_contention_and_lowers_confidence_of_a_compute_verdict():
    summary = contended({"data_wait": 0.2, "forward": 0.4, "backward": 0.4})
    verdict = classify(summary)
    assert verdict.bound == "compute"
    assert verdict.confidence == "medium"  # 80% compute: high on a free machine
    assert verdict.evidence[0] == OVERSUBSCRIBED + CONTENDED["evidence"]
    assert verdict.evidence[1].startswith("the compute share includes that wait")
    assert "35%" in verdict.evidence[1]
    assert any(e.startswith("forward is 40% of the step") for e in verdict.evidence)


def test_a_data_verdict_under_contention_is_less_sure_without_blaming_compute():
    summary = contended({"data_wait": 0.5, "forward": 0.25, "backward": 0.25})
    verdict = classify(summary)
    assert (verdict.bound, verdict.confidence) == ("data", "low")  # 50% data: medium on a free machine
    assert verdict.evidence[0].startswith(OVERSUBSCRIBED)
    assert not any("share includes that wait" in e for e in verdict.evidence)


def test_without_contention_the_confidence_stands():
    summary = make_summary({"forward": 0.5, "backward": 0.5})
    summary.system = {"samples": 5, "host": host(), "signals": []}
    verdict = classify(summary)
    assert verdict.confidence == "high" and not verdict.evidence[0].startswith(OVERSUBSCRIBED)


def test_a_balanced_step_on_a_busy_machine_says_so_too():
    verdict = classify(contended({"data_wait": 0.3, "forward": 0.35, "optimizer": 0.35}))
    assert (verdict.bound, verdict.confidence) == ("balanced", "low")
    assert verdict.evidence[0].startswith(OVERSUBSCRIBED)


def test_terminal_prints_contention_under_the_bound_line():
    summary = contended({"data_wait": 0.2, "forward": 0.4, "backward": 0.4})
    summary.verdict = classify(summary)
    line, rest = split_contention(summary.verdict.evidence)
    assert line == CONTENDED["evidence"] and all(not e.startswith(OVERSUBSCRIBED) for e in rest)
    import io

    out = io.StringIO()
    print_summary(summary, file=out)
    text = out.getvalue()
    bound = text.index("bound: compute [confidence medium]")
    contention = text.index("\ncontention: " + CONTENDED["evidence"])
    assert bound < contention, text
    assert "oversubscribed" not in text[bound:contention], text  # said once, on its own line


def test_html_verdict_block_states_contention():
    from stepscope.report.html_sections import verdict as verdict_section

    summary = contended({"data_wait": 0.2, "forward": 0.4, "backward": 0.4})
    summary.verdict = classify(summary)
    html = verdict_section(summary)
    assert '<p class="warn contention">The machine is oversubscribed: CPU contention' in html


# -- threads vs workers -----------------------------------------------------------------------------------------


def two_workers_two_threads(busy: float = 2.0) -> RunSummary:
    """Data-bound (60%, bursty fetches) with 2 loader workers beside 2 intra-op threads on 2 cores."""
    summary = make_summary(
        {"data_wait": 0.6, "forward": 0.2, "backward": 0.15, "optimizer": 0.05},
        loaders=[loader(num_workers=2)],
        facts={"threads": threads_fact(torch_threads=2, cores=2)},
        stats={"data_wait": {"median_ms": 2.0, "p95_ms": 150.0}},
    )
    summary.system = {"samples": 5, "host": host(workers_busy_avg=busy), "signals": []}
    return summary


def test_threads_fix_comes_first_with_workers_beside_default_threads():
    fixes, notes = diagnose(Case(two_workers_two_threads()))
    assert notes == []
    ids = [f.id for f in fixes]
    assert "loader.prefetch" in ids  # bounded by the data share (60%), yet ranked after the threads fix
    first = fixes[0]
    assert first.id == "host.threads", ids
    assert first.how == "torch.set_num_threads(1) (or OMP_NUM_THREADS)"
    assert first.evidence[:2] == [
        "2 torch threads × 1 rank(s) for a 2 usable cores",
        "beside 2 busy loader worker process(es) per rank, each a core while it loads",
    ]
    assert first.gain_bound is None and "ranked first" in first.gain_reason
    # No worker is advised on top of two that already fill the two cores.
    assert all("more workers" not in f.how for f in fixes), [f.how for f in fixes]


def test_threads_fix_stays_silent_when_workers_are_idle_or_threads_already_one():
    assert "host.threads" not in [f.id for f in diagnose(Case(two_workers_two_threads(busy=0.0)))[0]]
    one = two_workers_two_threads()
    one.facts["threads"] = threads_fact(torch_threads=1, cores=2)
    assert "host.threads" not in [f.id for f in diagnose(Case(one))[0]]


def test_no_more_workers_when_the_workers_already_oversubscribe_the_cores():
    # A training loader with 3 workers on 2 cores and a validation loader without any: data-bound.
    summary = make_summary(
        {"data_wait": 0.7, "forward": 0.2, "backward": 0.1},
        loaders=[loader(num_workers=3), loader(num_workers=0, index=1)],
        facts={"threads": threads_fact(torch_threads=1, cores=2)},
        stats={"data_wait": {"median_ms": 2.0, "p95_ms": 150.0}},
    )
    summary.system = {"samples": 5, "host": host(workers_max=3, workers_busy_avg=3.0, workers_cpu_util_pct=190.0)}
    fixes, _ = diagnose(Case(summary))
    ids = [f.id for f in fixes]
    assert "loader.num_workers" not in ids, ids
    assert "loader.too_many_workers" in ids, ids
    assert all("more workers" not in f.how for f in fixes), [f.how for f in fixes]


# -- end to end -------------------------------------------------------------------------------------------------


def doctor(tmp_path, *args: str, drop_omp: bool = False, steps: int = 200, warmup: int = 10) -> RunSummary:
    env = run_env()
    if drop_omp:
        env.pop("OMP_NUM_THREADS")  # torch's default: one intra-op thread per core
    json_path = tmp_path / "s.json"
    cmd = stepscope_cmd(json_path, "--sample-hz", "10", *args, warmup=warmup, steps=steps, verb="doctor")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and json_path.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = RunSummary.from_json(json_path)
    summary.notes.append(proc.stdout[-4000:])  # for assertion messages
    return summary


@pytest.mark.skipif(CORES > 4, reason="the scenario is 2 workers beside one intra-op thread per core on a few cores")
def test_doctor_names_threads_first_for_workers_beside_default_threads(tmp_path):
    s = doctor(tmp_path, script("contention_loader.py"), "--num-workers", "2", drop_omp=True, steps=100)
    out = s.notes[-1]
    assert s.facts["threads"]["torch_threads"] == CORES, out
    busy = s.system["host"]["workers_busy_avg"]  # CPU-bound workers; on a loaded machine busy less than always
    assert busy > 0, out
    assert s.fixes and s.fixes[0].id == "host.threads", out
    fit = max(1, CORES - min(2, math.ceil(busy - 0.05)))
    assert s.fixes[0].how == f"torch.set_num_threads({fit}) (or OMP_NUM_THREADS)", out
    assert s.system["host"]["run_delay_process_pct"] is not None, out


@pytest.mark.skipif(CORES > 4, reason="the scenario is 2 workers beside one intra-op thread per core on a few cores")
def test_workers_beside_default_threads_and_a_burner_still_name_threads_or_say_contention(tmp_path, burner):
    # The same job while a burner spins on every core: fewer threads is still the first fix, or the verdict says
    # the machine is oversubscribed and is not sure (the burner may leave the workers too little CPU to count).
    s = doctor(tmp_path, script("contention_loader.py"), "--num-workers", "2", drop_omp=True, steps=100)
    out = s.notes[-1]
    if not (s.fixes and s.fixes[0].id == "host.threads"):
        assert s.verdict.evidence[0].startswith(OVERSUBSCRIBED) and s.verdict.confidence != "high", out


def test_data_bound_script_beside_a_burner_is_data_or_says_contention(tmp_path, burner):
    # Every sample sleeps 3 ms (a read): 24 ms of a step that computes well under 1 ms. A busy machine may slow the
    # step, but it must not turn the verdict into a confident wrong one.
    s = doctor(tmp_path, script("slow_loader.py"), "--sample-ms", "3", steps=30, warmup=5)
    out = s.notes[-1]
    host_figures = s.system["host"]
    assert host_figures["others_cpu_util_pct"] >= 50.0, out  # the burner was seen as others' load
    if s.verdict.bound != "data":
        assert s.verdict.confidence != "high", out
        assert s.verdict.evidence[0].startswith(OVERSUBSCRIBED), out
    signals = {x["id"]: x for x in s.system["signals"]}
    if "cpu_contention" in signals:
        assert signals["cpu_contention"]["cause"] in ("others", "both"), out
        assert s.verdict.evidence[0].startswith(OVERSUBSCRIBED), out
        assert s.verdict.confidence != "high", out
        assert "contention:" not in out or "the machine is oversubscribed" in out, out


def test_contended_thread_does_not_break_the_source():
    # A thread that exits between the listing and the read must not raise (its run delay is simply lost).
    source = HostSource()
    source.start(time.monotonic())
    threads = [threading.Thread(target=time.sleep, args=(0.01,)) for _ in range(20)]
    for t in threads:
        t.start()
    readings = source.read(time.monotonic() + 0.1)
    for t in threads:
        t.join()
    assert "host/load_1m" in readings
