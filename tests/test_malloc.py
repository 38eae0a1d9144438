"""Allocator churn: the page faults a step takes, what one costs here, the `host.malloc_churn` fix, and
`--apply malloc.mmap_threshold`.

Ground truth: tests/scripts/malloc_churn.py counts its own page faults per step (getrusage); glibc's thresholds
moved only by what ran before, it faults in hundreds of pages a step, and with them fixed, almost none.
"""

from __future__ import annotations

import pytest
from run_helpers import AS_USERS_START, cli_here, script, stepscope_cmd, stepscope_run

from stepscope.collectors.malloc import allocator, pooling_library, us_per_fault
from stepscope.doctor.rules import Case, diagnose
from stepscope.summary import PhaseStats, RunSummary, Throughput


def churning(faults_per_step: float, us: float | None = 4.6, step_ms: float = 10.0, **malloc) -> RunSummary:
    summary = RunSummary(
        phases={"total": PhaseStats(step_ms, step_ms, step_ms, 1.0, 50), "forward": PhaseStats(5, 5, 5, 0.5, 50)},
        throughput=Throughput(steps_per_s=1e3 / step_ms, step_time_ms=step_ms),
    )
    summary.steps.measured = 50
    summary.facts["malloc"] = {
        "allocator": "glibc", "faults_per_step": faults_per_step, "us_per_fault": us, "tuned": [], **malloc
    }  # fmt: skip
    return summary


def fix_ids(summary: RunSummary) -> list[str]:
    return [f.id for f in diagnose(Case(summary))[0]]


def test_faults_that_cost_a_share_of_the_step_make_the_fix_with_its_evidence():
    fixes = diagnose(Case(churning(400)))[0]
    (fix,) = [f for f in fixes if f.id == "host.malloc_churn"]
    assert fix.apply == "malloc.mmap_threshold" and fix.cost == "config"
    assert fix.gain_bound == pytest.approx(400 * 4.6 / 1e3 / 10.0)  # 18% of a 10 ms step
    assert "400 minor page faults a step in the training process, 4.6 µs each measured here" in fix.evidence[0]
    assert "18% of the step" in fix.evidence[0]


@pytest.mark.parametrize(
    "summary",
    [
        churning(50),  # 50 x 4.6 µs = 2.3% of 10 ms: under 3%
        churning(400, tuned=["MALLOC_MMAP_THRESHOLD_=33554432"]),  # already set by the user
        churning(400, allocator="jemalloc"),  # a pooling allocator keeps its pages
        churning(400, us=None),  # not priced: no claim
    ],
    ids=["cheap", "tuned", "jemalloc", "unpriced"],
)
def test_no_fix_where_the_faults_cost_little_or_the_allocator_is_set(summary):
    assert "host.malloc_churn" not in fix_ids(summary)


def test_a_fault_is_priced_on_this_machine():
    cost = us_per_fault()
    assert 0.05 < cost < 1000, cost  # a trap and a zeroed page: well under a millisecond, above a memory write
    assert allocator() in ("glibc", "jemalloc", "tcmalloc", "mimalloc", "other")


def test_doctor_finds_the_churn_and_the_applied_thresholds_end_it(tmp_path):
    # 120 iterations, fewer than the steps asked for: the script runs to its end and prints its own count. Even with
    # the thresholds fixed glibc grows its heap by a 4 MB gradient now and then (1,024 faults at once); 115 measured
    # steps keep a few of those under a tenth of the churn.
    churn = (script("malloc_churn.py"), "--iters", "120")
    doctor = stepscope_run(tmp_path / "doctor", *churn, warmup=5, steps=200, verb="doctor", env=AS_USERS_START)
    assert doctor.returncode == 0, doctor.describe()
    malloc = doctor.summary.facts["malloc"]
    own = float(next(line for line in doctor.stdout.splitlines() if line.startswith("faults_per_step")).split()[1])
    assert malloc["allocator"] == "glibc" and malloc["tuned"] == [], malloc
    assert malloc["faults_per_step"] >= 100 and own >= 100, (malloc, own)  # the script's own count agrees: it churns
    assert malloc["us_per_fault"] > 0, malloc
    fix = next(f for f in doctor.summary.fixes if f.id == "host.malloc_churn")
    assert fix.apply == "malloc.mmap_threshold", fix
    applied = stepscope_run(tmp_path / "applied", "--apply", fix.apply, *churn, warmup=5, steps=200, env=AS_USERS_START)
    assert applied.returncode == 0, applied.describe()
    summary = applied.summary
    (entry,) = summary.applied
    assert entry["applied"] and "trim threshold 67,108,864 from the process's start" in entry["where"], entry
    tuned = summary.facts["malloc"]
    assert tuned["tuned"] == ["malloc.mmap_threshold=33554432"], tuned
    assert tuned["faults_per_step"] < 0.1 * malloc["faults_per_step"], (tuned, malloc)
    own_after = float(next(x for x in applied.stdout.splitlines() if x.startswith("faults_per_step")).split()[1])
    assert own_after < 0.1 * own, (own_after, own)
    assert "host.malloc_churn" not in [f.id for f in summary.fixes]


@pytest.mark.skipif(
    pooling_library("jemalloc") is None,
    reason="needs jemalloc installed (apt-get install libjemalloc2; make test does)",
)
def test_the_preloaded_pooling_allocator_ends_the_churn(tmp_path):
    # The same churning script under `--apply malloc.allocator=jemalloc`: every process of the command starts on
    # jemalloc, which keeps freed blocks, so the training thread's page faults a step fall to a few.
    churn = (script("malloc_churn.py"), "--iters", "120")
    r = stepscope_run(tmp_path, "--apply", "malloc.allocator=jemalloc", *churn, warmup=5, steps=200, env=AS_USERS_START)
    assert r.returncode == 0, r.describe()
    (entry,) = r.summary.applied
    assert entry["applied"] and entry["where"] == "the process runs on jemalloc (LD_PRELOAD)", entry
    malloc = r.summary.facts["malloc"]
    assert malloc["allocator"] == "jemalloc", malloc
    own = float(next(line for line in r.stdout.splitlines() if line.startswith("faults_per_step")).split()[1])
    assert own < 50 and malloc["faults_per_step"] < 50, (own, malloc)  # glibc's churn here: 380-910 a step
    assert "host.malloc_churn" not in [f.id for f in r.summary.fixes]


def test_a_pooling_allocator_that_is_not_installed_is_one_sentence(tmp_path, monkeypatch):
    import stepscope.collectors.malloc as malloc

    monkeypatch.setattr(malloc.ctypes.util, "find_library", lambda name: None)
    code, _, err = cli_here(tmp_path, stepscope_cmd(None, "--apply", "malloc.allocator=tcmalloc", script("basic.py")))
    assert code == 2, err
    assert "--apply malloc.allocator=tcmalloc: tcmalloc is not installed on this machine (apt-get install " in err
    assert "Traceback" not in err
