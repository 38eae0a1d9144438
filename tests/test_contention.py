"""CPU contention: run delay and switches measured from /proc, the cpu_contention signal, the verdict that states it,
and the threads-vs-workers rules; end to end on real scripts, with and without a CPU burner on every core."""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
from typing import Any
from unittest import mock

import pytest
from run_helpers import cli_here, run_env, script, stepscope_cmd
from test_rules import loader, make_summary, threads_fact

from stepscope.collectors.host import (
    HostSource,
    parse_involuntary_switches,
    parse_proc_stat,
    parse_schedstat,
    parse_timeslices,
    per_wait_us,
)
from stepscope.collectors.signals import CONTENTION_PCT, cpu_contention, cpu_wait_pct, derive_signals
from stepscope.collectors.stats import fold
from stepscope.doctor.checkup import examine
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


def test_schedstat_timeslices_give_the_delay_per_wait():
    assert parse_timeslices("22735607 5973944 93\n") == 93  # the third field: times put on a CPU
    # 20% of wall time waiting over 2,000 waits a second: 200 ms / 2,000 = 100 µs per wait.
    assert per_wait_us(20.0, 2000.0) == pytest.approx(100.0)
    assert per_wait_us(20.0, 0.0) is None and per_wait_us(None, 10.0) is None


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
    # Sleeping is not runnable: whatever else loads the machine, the main thread waited for no CPU. (A loaded CI run
    # once read 99.7% here with no CPU used; the figures that say why are in the message.)
    delay, waits = readings["host/run_delay_main"], readings["host/run_waits_main"]
    why = f"run delay {delay:.1f}% over {waits:.1f} waits/s, process {readings['host/run_delay_process']:.1f}%"
    assert delay < 3.0, f"{why}; {readings}"
    assert readings["host/load_1m"] >= 0


def _wake_often(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.0002)  # thousands of wake-ups a second, as a loader that reads small samples


def _main_thread(readings: dict[str, float]) -> dict[str, float | None]:
    """The main thread's figures of a host section, from one sample's readings."""
    delay = readings["host/run_delay_main"]
    return {
        "run_delay_main_thread_pct": delay,
        "run_delay_main_thread_per_wait_us": per_wait_us(delay, readings["host/run_waits_main"]),
    }


@pytest.mark.skipif(not LINUX_SCHEDSTAT, reason="needs /proc/<pid>/task/<tid>/schedstat")
def test_frequent_wakeups_are_not_waits_for_a_cpu():
    # Scheduling latency of a wake-up: 4-25 µs per wait on the 2-core VM, quiet or beside a busy loop on every core
    # (a woken sleeper runs ahead of the loops), under WAKEUP_LATENCY_US: none of it counts as waiting for a CPU.
    readings = _host_readings(_wake_often, 1.0)
    assert readings["host/run_waits_main"] >= 500, readings  # ~2,000 sleeps a second, a wait in the run queue each
    wait = cpu_wait_pct(_main_thread(readings), "main_thread")
    assert wait is not None and wait < CONTENTION_PCT / 2, readings


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
    # Preempted by the burners, it waits a timeslice at a time (3.6-7.6 ms per wait measured): nearly all of it is
    # waiting for a CPU, not the latency of waking up.
    wait = cpu_wait_pct(_main_thread(readings), "main_thread")
    assert wait is not None and wait >= 0.8 * readings["host/run_delay_main"], readings


@pytest.mark.skipif(not LINUX_SCHEDSTAT, reason="needs /proc/<pid>/task/<tid>/schedstat")
def test_section_reports_run_delay_per_process_group():
    source = HostSource()
    t = time.monotonic()
    source.start(t)
    stats: dict[str, Any] = {}
    for _ in range(3):
        time.sleep(0.2)
        fold(stats, source.read(time.monotonic()))
    section = source.section(stats)
    for key in ("run_delay_main_thread_pct", "run_delay_process_pct", "run_delay_workers_pct", "load_avg_1m"):
        assert section[key] is not None, (key, section)
    assert section["machine_cores"] == os.cpu_count()
    assert source.notes == []


def test_section_reports_the_delay_per_wait_of_each_group():
    source = HostSource()
    stats: dict[str, Any] = {}
    for delay, waits in ((10.0, 500.0), (30.0, 1500.0)):  # means: 20% over 1,000 waits/s = 200 µs per wait
        fold(stats, {"host/run_delay_main": delay, "host/run_waits_main": waits})
    fold(stats, {"host/run_delay_process": 5.0, "host/run_waits_process": 10_000.0})
    section = source.section(stats)
    assert section["run_delay_main_thread_per_wait_us"] == 200.0
    assert section["run_delay_process_per_wait_us"] == 5.0
    assert section["run_delay_workers_per_wait_us"] is None  # no workers sampled


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


# 6 CPU-bound loader workers and torch.set_num_threads(1) on a quiet 2-core VM (measured 2026-11-26).
OWN_WORKERS = host(
    cpu_util_pct=45.0,
    workers_cpu_util_pct=136.0,
    workers_max=6,
    workers_busy_avg=6.0,
    run_delay_main_thread_pct=42.0,
    run_delay_main_thread_per_wait_us=330.0,
    run_delay_process_pct=53.0,
    run_delay_process_per_wait_us=310.0,
    run_delay_workers_pct=152.0,
    run_delay_workers_per_wait_us=690.0,
    others_cpu_util_pct=7.0,
    load_avg_1m=1.2,
)


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


def test_frequent_wakeups_on_a_quiet_machine_are_not_contention():
    # A loader that sleeps 0.4 ms per sample on a quiet machine (load 0.4): its threads wake thousands of times a
    # second and wait 11% of wall time (summed), 20-30 µs per wait: scheduling latency, not a missing CPU.
    quiet = host(run_delay_process_pct=11.0, run_delay_process_per_wait_us=23.0, run_delay_main_thread_pct=8.0,
                 run_delay_main_thread_per_wait_us=20.0, run_delay_workers_pct=25.0,
                 run_delay_workers_per_wait_us=31.0, others_cpu_util_pct=2.0, load_avg_1m=0.4)  # fmt: skip
    assert cpu_contention(quiet) is None
    assert cpu_wait_pct(quiet, "process") == 0.0  # under WAKEUP_LATENCY_US per wait: all of it wake-up latency
    # The same delay in waits of 1 ms and 0.7 ms: 95% and 93% of it beyond wake-up latency, the threads were kept
    # from a CPU (10.45% ≥ 10% for the process, 23.2% ≥ 10% × 2 busy workers).
    long_waits = {**quiet, "run_delay_process_per_wait_us": 1000.0, "run_delay_workers_per_wait_us": 700.0}
    assert cpu_wait_pct(long_waits, "process") == pytest.approx(10.45)
    signal = cpu_contention(long_waits)
    assert signal is not None
    assert "waited for a CPU 11% of wall time (summed, 1000 µs per wait), its main thread 8%" in signal["evidence"]
    assert "loader workers 25% (summed over 2 worker(s), 700 µs per wait)" in signal["evidence"]
    # A summary from before the per-wait figure was measured counts every wait, as it did.
    assert cpu_wait_pct(host(run_delay_process_pct=11.0), "process") == 11.0


def test_the_main_thread_waiting_for_the_jobs_own_workers_is_charged_to_them():
    signal = cpu_contention(OWN_WORKERS)
    assert signal is not None and signal["cause"] == "workers"
    assert "its main thread 42% (330 µs per wait)" in signal["evidence"]
    assert "this job's loader workers hold the cores its main thread waits for" in signal["evidence"]


def test_busy_workers_beside_a_busier_machine_stay_the_others_load():
    signal = cpu_contention({**OWN_WORKERS, "others_cpu_util_pct": 170.0})
    assert signal is not None and signal["cause"] in ("others", "both")


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


def own_workers(phases: dict[str, float], timing: str = "host") -> RunSummary:
    summary = make_summary(phases, timing=timing, loaders=[loader(num_workers=6)],
                           facts={"threads": threads_fact(torch_threads=1, cores=2)})  # fmt: skip
    summary.system = {"samples": 20, "host": OWN_WORKERS, "signals": [cpu_contention(OWN_WORKERS)]}
    return summary


def test_a_cpu_held_by_the_jobs_own_workers_makes_the_step_data_bound():
    # The run: a forward that needs microseconds reads milliseconds, 69% of the step is "compute", because
    # the main thread waited 42% of wall time for the cores its 6 loader workers held.
    summary = own_workers({"data_wait": 0.18, "forward": 0.23, "backward": 0.46, "optimizer": 0.08, "other": 0.05})
    verdict = classify(summary)
    assert verdict.bound == "data", verdict
    # The wait beyond wake-up latency: 42% × (1 - 50/330) = 35.6%; the workers' part of it, by the CPU they used
    # beside other processes (136 of 143%): 33.9%. Data: 18% + 33.9% = 52%.
    assert verdict.confidence == "medium"
    assert not any(e.startswith(OVERSUBSCRIBED) for e in verdict.evidence), verdict.evidence
    assert verdict.evidence[0].startswith(
        "the main thread waited for a CPU 42% of wall time (330 µs per wait, 36% beyond the latency of waking up)"
    )
    assert "6 loader worker(s) used 136% CPU of its 2 usable core(s) and other processes 7%" in verdict.evidence[0]
    assert "part of that wait (95%, by the CPU they used)" in verdict.evidence[0]
    assert verdict.evidence[0].endswith("data 52% of the step, compute 40%, optimizer 5%, host 3%"), verdict.evidence
    assert any(e.startswith("data_wait is 18% of the step") for e in verdict.evidence)


def test_fixes_are_bounded_by_their_phases_own_time_not_the_wait_for_the_workers_cores():
    # The truth generator's oversubscribed cases: the optimizer phase read 8% of the step, most of it the main
    # thread waiting for the cores 6 workers held, and optimizer.fused (config, <= 8%) came before every loader fix.
    # Its own time is 8% x (1 - 33.9/79) = 4.6%: under 5%, it goes last.
    summary = own_workers({"data_wait": 0.18, "forward": 0.23, "backward": 0.46, "optimizer": 0.08, "other": 0.05})
    summary.facts["optimizers"] = [
        {"type": "AdamW", "fused": False, "foreach": None, "has_fused": True, "has_foreach": True, "params": 600,
         "device": "cpu"}
    ]  # fmt: skip
    examine(summary, [])
    fused = next(f for f in summary.fixes if f.id.startswith("optimizer."))
    assert fused.gain_bound == pytest.approx(0.08 * (1 - 0.339 / 0.79), abs=0.005), fused
    assert summary.fixes[-1].id == fused.id or fused.gain_bound < 0.05, [f.id for f in summary.fixes]


def test_more_intra_op_threads_than_cores_keep_the_wait_contention():
    # 4 torch threads on 2 cores would keep the main thread waiting without any worker: not the workers' alone.
    summary = own_workers({"data_wait": 0.18, "forward": 0.23, "backward": 0.46, "optimizer": 0.08, "other": 0.05})
    summary.facts["threads"] = threads_fact(torch_threads=4, cores=2)
    verdict = classify(summary)
    assert (verdict.bound, verdict.confidence) == ("compute", "medium"), verdict
    assert verdict.evidence[0].startswith(OVERSUBSCRIBED), verdict.evidence


def test_a_compute_step_keeps_its_bound_with_the_workers_wait_taken_out():
    summary = own_workers({"data_wait": 0.05, "forward": 0.45, "backward": 0.45, "optimizer": 0.05})
    verdict = classify(summary)
    # 33.9% moves (as above): compute 90% less its part of it (90/95), 58%; data 5% + 33.9% = 39%.
    assert (verdict.bound, verdict.confidence) == ("compute", "medium"), verdict
    assert verdict.evidence[0].endswith("data 39% of the step, compute 58%, optimizer 3%"), verdict.evidence
    assert not any(e.startswith(OVERSUBSCRIBED) for e in verdict.evidence), verdict.evidence


def test_with_cuda_timing_only_the_host_share_holds_the_wait():
    # GPU-timed compute does not include the main thread's wait; the GPU idling while it waited (host) does.
    phases = {"data_wait": 0.2, "forward": 0.3, "backward": 0.3}
    summary = own_workers(phases, timing="cuda")
    for name in ("forward", "backward"):
        summary.phases[name] = dataclasses.replace(summary.phases[name], device_share=0.22)
    verdict = classify(summary)  # host: 1 - 0.44 GPU - 0.2 data = 36%, of which 33.9% moves: data 20% + 33.9%
    assert (verdict.bound, verdict.confidence) == ("data", "medium"), verdict
    assert verdict.evidence[0].endswith("data 54% of the step, compute 44%, host 2%"), verdict.evidence


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


def test_workers_beside_default_threads_are_data_bound_and_fewer_threads_come_first():
    # torch's default threads (one per core) beside the busy workers: the main thread's wait is the input pipeline's
    # (without the workers, 2 threads fit 2 cores), and the fix aimed at it is fewer intra-op threads. Fewer workers
    # is not advised: measured on the 2-core VM, this CPU-bound loader ran 205-213 steps/s with 2 workers against
    # 229-272 with 6 (--threads 1): the workers' CPU is the pipeline's capacity.
    summary = own_workers({"data_wait": 0.44, "forward": 0.3, "backward": 0.11, "optimizer": 0.1, "other": 0.05})
    summary.facts["threads"] = threads_fact(torch_threads=2, cores=2)
    verdict = classify(summary)
    assert (verdict.bound, verdict.confidence) == ("data", "high"), verdict  # 44% + 33.9% = 78%
    fixes = diagnose(Case(summary))[0]
    assert fixes[0].id == "host.threads", [f.id for f in fixes]
    assert fixes[0].how == "torch.set_num_threads(1) (or OMP_NUM_THREADS)"
    assert any("hold the cores its main thread waits for" in e for e in fixes[0].evidence), fixes[0].evidence


# -- end to end -------------------------------------------------------------------------------------------------


def doctor(tmp_path, *args: str, drop_omp: bool = False, steps: int = 200, warmup: int = 10) -> RunSummary:
    """`stepscope doctor` with the script's training process run in this one (``cli_here``), in the environment
    ``stepscope_run`` gives a child, less OMP_NUM_THREADS with ``drop_omp`` (torch's default: a thread per core)."""
    env = run_env()
    if drop_omp:
        env.pop("OMP_NUM_THREADS")
    json_path = tmp_path / "s.json"
    cmd = stepscope_cmd(json_path, "--sample-hz", "10", *args, warmup=warmup, steps=steps, verb="doctor")
    with mock.patch.dict(os.environ, env, clear=True):
        code, stdout, stderr = cli_here(tmp_path, cmd)
    assert code == 0 and json_path.exists(), stdout[-4000:] + stderr[-4000:]
    summary = RunSummary.from_json(json_path)
    summary.notes.append(stdout[-4000:])  # for assertion messages
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
