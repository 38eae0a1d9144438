"""Collective wait as the ``comms`` phase, and the job's verdict from the rank the others wait for."""

import re

import pytest
from run_helpers import free_port, script, stepscope_run, torchrun
from test_merge import rank as merge_rank

from stepscope.doctor.checkup import examine
from stepscope.doctor.verdict import OVERSUBSCRIBED, attributed_straggler
from stepscope.instrument.merge import find_straggler, merge
from stepscope.record import GROUPS, PHASES
from stepscope.summary import LoaderInfo, RunSummary

DDP_FACTS = {
    "models": [{"ddp": {"find_unused_parameters": False, "gradient_as_bucket_view": False, "bucket_cap_mb": 25}}]
}


def slow_loader() -> LoaderInfo:
    return LoaderInfo(
        index=0, dataset="SleepyDataset", batch_size=8, num_workers=0, pin_memory=False, persistent_workers=False,
        prefetch_factor=None, drop_last=True, iterable=False, length=64, batches=40, samples=320, fetch_s=0.4,
    )  # fmt: skip


def rank(r: int, phases_ms: dict[str, float], world: int = 2) -> RunSummary:
    """test_merge's rank summary (8-sample batches), with a DDP model and a loader without workers."""
    summary = merge_rank(r, phases_ms, samples_per_s=8e3 / sum(phases_ms.values()), world=world)
    summary.loaders, summary.facts = [slow_loader()], DDP_FACTS
    return summary


def two_ranks(fast: dict[str, float], slow: dict[str, float]) -> RunSummary:
    """The examined job of rank 0 with ``fast``'s phases (ms) and rank 1 with ``slow``'s."""
    return examine(merge([rank(0, fast), rank(1, slow)]), [])


# Rank 1's loader is 10.9 ms slower per batch; rank 0 waits for it in DDP's all-reduce (comms). Both 17.7 ms steps.
FAST = {"data_wait": 0.5, "forward": 1.0, "backward": 4.0, "comms": 11.5, "optimizer": 0.5, "other": 0.2}
SLOW = {"data_wait": 11.4, "forward": 1.0, "backward": 4.0, "comms": 0.6, "optimizer": 0.5, "other": 0.2}


def test_comms_is_a_phase_after_backward_and_its_own_group():
    assert PHASES.index("comms") == PHASES.index("backward") + 1
    assert GROUPS["comms"] == ("comms",)
    assert sum(group.count("comms") for group in GROUPS.values()) == 1


def test_straggler_names_the_slow_phase_and_the_ranks_waiting_in_comms():
    straggler = find_straggler([rank(0, FAST), rank(1, SLOW)])
    assert (straggler.rank, straggler.phase) == (1, "data_wait")
    assert straggler.excess_ms == pytest.approx(10.9)
    assert straggler.waiting_ranks == [0]
    assert straggler.wait_ms == pytest.approx(11.5)
    assert straggler.own_comms_ms == pytest.approx(0.6)


def test_comms_itself_is_never_the_straggler_phase():
    # The ranks differ only in how long they wait: nobody's work explains it, and waiting is not a cause.
    ranks = [rank(0, {**FAST, "data_wait": 0.5}), rank(1, {**FAST, "comms": 0.6, "other": 11.1})]
    assert find_straggler(ranks).phase == "other"
    even = [rank(0, {"forward": 5.0, "comms": 12.0}), rank(1, {"forward": 5.0, "comms": 1.0})]
    assert find_straggler(even) is None


def test_job_verdict_is_the_stragglers_cause_citing_both_sides():
    job = examine(merge([rank(0, FAST), rank(1, SLOW)]), [])
    verdict = job.verdict
    assert (verdict.bound, verdict.confidence) == ("data", "high"), verdict
    assert verdict.evidence[:2] == [
        "rank 1's data_wait is 10.9 ms above the other ranks' median (62% of the 17.7 ms job step)",
        "rank 0 waits 11.5 ms per step in comms for it, against 0.6 ms on rank 1",
    ]
    assert "rank 1: data_wait is 64% of the step (11.4 ms of a 17.7 ms step)" in verdict.evidence


def test_job_fixes_are_the_stragglers_bounded_by_the_job_step():
    job = examine(merge([rank(0, FAST), rank(1, SLOW)]), [])
    first = job.fixes[0]
    assert first.id == "loader.num_workers", [f.id for f in job.fixes]
    assert first.gain_bound == pytest.approx(round(10.9 / 17.7, 4))  # its excess, not its whole 11.4 ms wait
    assert "rank 1: loader 0 (SleepyDataset) has num_workers=0" in first.evidence
    assert first.gain_reason == "at most rank 1's excess in data_wait, which the other ranks wait for"
    bucket_view = next(f for f in job.fixes if f.id == "ddp.gradient_as_bucket_view")
    assert bucket_view.gain_bound == pytest.approx(round(4.0 / 17.7, 4))  # rank 1's own backward: not the cause


def test_waits_the_straggler_does_not_explain_leave_the_phase_verdict():
    # Rank 0 waits 2 ms more than rank 1 in comms against a 10.9 ms excess: something else holds it up.
    fast = {**FAST, "comms": 2.6, "forward": 9.9}
    job = merge([rank(0, fast), rank(1, SLOW)])
    assert job.cluster.straggler.waiting_ranks == [0]
    assert attributed_straggler(job) is None
    examine(job, [])
    assert not any("waits" in line for line in job.verdict.evidence), job.verdict


def test_a_small_excess_on_a_step_every_rank_spends_elsewhere_is_named_but_not_the_bound():
    # The truth generator's c053 beside busy loops: both ranks spend 19.2 ms of a 30.6 ms step in the script's own
    # host work; load gave rank 1 2.2 ms more data_wait, which rank 0 waits for. The job's step is rank 1's, and
    # host leads it: "data" would aim the user at 7% of the step.
    fast = {"data_wait": 0.4, "forward": 4.3, "backward": 2.9, "comms": 3.6, "optimizer": 0.2, "other": 19.2}
    slow = {**fast, "data_wait": 2.6, "comms": 1.4}
    job = two_ranks(fast, slow)
    assert (job.cluster.straggler.rank, job.cluster.straggler.phase) == (1, "data_wait")
    assert attributed_straggler(job) is not None
    assert (job.verdict.bound, job.verdict.confidence) == ("host", "high"), job.verdict
    assert job.verdict.evidence[0] == "rank 1: other is 63% of the step (19.2 ms of a 30.6 ms step)", job.verdict
    assert job.verdict.evidence[-2:] == [
        "rank 1's data_wait is 2.2 ms above the other ranks' median (7% of the 30.6 ms job step)",
        "rank 0 waits 3.6 ms per step in comms for it, against 1.4 ms on rank 1",
    ]


def test_an_excess_that_leads_a_step_no_group_holds_40_percent_of_is_still_the_bound():
    # Rank 1's data group (6 ms: 5.5 ms excess) leads its 16.5 ms step at 36%, under the 40% a bound by share needs.
    fast = {"data_wait": 0.5, "forward": 2.0, "backward": 2.0, "comms": 6.0, "optimizer": 3.0, "other": 3.0}
    slow = {**fast, "data_wait": 6.0, "comms": 0.5}
    job = two_ranks(fast, slow)
    assert job.verdict.bound == "data", job.verdict
    assert job.verdict.evidence[0].startswith("rank 1's data_wait is 5.5 ms above"), job.verdict
    # Its 4 ms excess no longer leads when compute holds 5 ms of rank 1's step: no group is the job's bound.
    fast = {"data_wait": 0.5, "forward": 2.5, "backward": 2.5, "comms": 4.5, "optimizer": 4.0, "other": 4.0}
    slow = {**fast, "data_wait": 4.5, "comms": 0.5}
    job = two_ranks(fast, slow)
    assert job.verdict.bound == "balanced", job.verdict
    assert job.verdict.evidence[0].startswith("rank 1: no part of the step reaches 40%"), job.verdict
    assert job.verdict.evidence[1].startswith("rank 1's data_wait is 4.0 ms above"), job.verdict


def test_the_stragglers_own_comms_never_decide_its_step():
    # The two-node test beside busy loops: under load each rank waits for the other in turn, and rank 1's own comms
    # (12 ms) lead its step, above its 9 ms data_wait excess. Its waiting is not why it is the slowest.
    fast = {"data_wait": 1.0, "forward": 2.0, "backward": 2.0, "comms": 21.0, "optimizer": 1.0, "other": 1.0}
    slow = {**fast, "data_wait": 10.0, "comms": 12.0}
    job = two_ranks(fast, slow)
    assert (job.cluster.straggler.rank, job.cluster.straggler.phase) == (1, "data_wait")
    assert job.verdict.bound == "data", job.verdict
    assert job.verdict.evidence[0].startswith("rank 1's data_wait is 9.0 ms above"), job.verdict
    # When its own work spreads thin beside its comms, no group is the job's bound unless the excess leads it.
    fast = {"data_wait": 1.0, "forward": 3.0, "backward": 3.0, "comms": 20.0, "optimizer": 5.0, "other": 5.0}
    slow = {**fast, "data_wait": 5.5, "comms": 15.5}
    job = two_ranks(fast, slow)
    assert job.verdict.bound == "balanced", job.verdict
    assert job.verdict.evidence[0].startswith("rank 1: no part of the step but comms reaches 40%"), job.verdict
    job = two_ranks(fast, {**slow, "data_wait": 7.0})
    assert job.verdict.bound == "data", job.verdict


def test_summaries_without_comms_keep_the_old_straggler_and_no_attribution():
    # An older run: the wait sits inside rank 0's backward, so no rank is seen waiting.
    old_fast = {"data_wait": 0.5, "forward": 1.0, "backward": 15.5, "optimizer": 0.5, "other": 0.2}
    old_slow = {"data_wait": 11.4, "forward": 1.0, "backward": 4.6, "optimizer": 0.5, "other": 0.2}
    job = examine(merge([rank(0, old_fast), rank(1, old_slow)]), [])
    straggler = job.cluster.straggler
    assert (straggler.rank, straggler.phase, straggler.waiting_ranks, straggler.wait_ms) == (1, "data_wait", [], None)
    assert attributed_straggler(job) is None


def test_four_ranks_waiting_for_one_compute_straggler(tmp_path):
    fast = {"data_wait": 0.5, "forward": 2.0, "backward": 4.0, "comms": 9.0, "optimizer": 0.5}
    slow = {"data_wait": 0.5, "forward": 2.0, "backward": 12.0, "comms": 1.0, "optimizer": 0.5}
    ranks = [rank(r, slow if r == 2 else {**fast, "comms": 9.0 + 0.1 * r}, world=4) for r in range(4)]
    job = examine(merge(ranks), [])
    assert job.verdict.bound == "compute"
    assert (
        job.verdict.evidence[1]
        == "ranks 0, 1, 3 wait 9.1 ms per step (median) in comms for it, against 1.0 ms on rank 2"
    )
    path = tmp_path / "s.json"
    job.to_json(path)
    loaded = RunSummary.from_json(path).cluster.straggler
    assert (loaded.rank, loaded.waiting_ranks, loaded.own_comms_ms) == (2, [0, 1, 3], 1.0)


def _past_contention(evidence: list[str]) -> list[str]:
    """The verdict's evidence after its contention line, if any: two ranks on two cores beside another test's
    processes (the suite runs on two workers) may find the machine oversubscribed, and say so first."""
    return evidence[1:] if evidence and evidence[0].startswith(OVERSUBSCRIBED) else evidence


# -- end to end: torchrun, gloo, 2 ranks ------------------------------------------------------------------------


def test_doctor_blames_the_slow_loader_of_rank_1_not_rank_0s_wait(tmp_path):
    # Rank 1 sleeps 8 x 1.25 = 10 ms more per batch in its loader; rank 0 waits for it in DDP's all-reduce.
    launcher = [*torchrun(), script("ddp.py"), "--sample-ms", "0", "--extra-ms", "1.25"]
    r = stepscope_run(
        tmp_path, "--ceiling-batches", "0", "--", *launcher, warmup=5, steps=25, timeout=180, verb="doctor"
    )
    assert r.returncode == 0, r.describe()
    s = r.summary
    by_rank = {x.meta.rank: x.phases for x in s.ranks}
    excess = s.cluster.straggler.excess_ms
    assert 6 < excess < 16, (s.cluster.straggler, r.describe())
    waited = by_rank[0]["comms"].mean_ms - by_rank[1]["comms"].mean_ms
    assert abs(waited - excess) < max(3.0, 0.3 * excess), (waited, excess, r.describe())
    # The wait left rank 0's backward: its backward is a tiny MLP's, as on rank 1.
    assert by_rank[0]["backward"].mean_ms < min(3.0, 0.25 * by_rank[0]["comms"].mean_ms), r.describe()
    assert s.verdict.bound == "data", (s.verdict, r.describe())
    evidence = _past_contention(s.verdict.evidence)
    assert evidence[0].startswith("rank 1's data_wait is "), s.verdict
    assert evidence[1].startswith("rank 0 waits "), s.verdict
    assert s.fixes[0].id == "loader.num_workers", [f.id for f in s.fixes]
    job_ms = s.phases["total"].mean_ms
    assert s.fixes[0].gain_bound == pytest.approx(min(1.0, excess / job_ms), abs=2e-4)
    assert re.search(r"^verdict: data \(confidence (high|medium)\)", r.stdout, re.MULTILINE), r.describe()


def test_ranks_started_by_multiprocessing_spawn_are_the_jobs_ranks(tmp_path):
    # torch.multiprocessing.spawn: no launcher variables name the ranks, and each destroys its process group before
    # it exits. Both ranks reported rank "?" beside the script's own process, which trained nothing: "3 of 3 ranks,
    # missing 1-2", 0 measured steps, and the verdict unknown.
    r = stepscope_run(tmp_path, script("spawned.py"), "--port", str(free_port()), warmup=3, steps=15, timeout=180)
    assert r.returncode == 0, r.describe()
    s = r.summary
    assert sorted((x.meta.rank, x.meta.world_size) for x in s.ranks) == [(0, 2), (1, 2)], r.describe()
    assert s.steps.measured == 15 and all(x.steps.measured == 15 for x in s.ranks), r.describe()
    assert not any("no training step" in note for note in s.notes), s.notes
    # The job's samples are both ranks' batches of 8 a step.
    assert s.throughput.samples_per_s == pytest.approx(16 * s.throughput.steps_per_s, rel=0.02), s.throughput
    assert "ranks: 2 of 2 reported" in r.stdout, r.describe()


def test_one_ranks_side_work_every_step_stays_in_its_step_and_the_job_rate_is_the_jobs(tmp_path):
    # Issue 24's job: after every optimizer step rank 1 runs 6 forwards without gradients of a second model (1.5 ms
    # each, a metric). Read as validation, they left rank 1 a 2 ms step beside rank 0's 25 ms, the job's samples/s
    # several times its own, and the verdict comms. It is rank 1's step work: the job waits for it.
    launcher = [
        *torchrun(),
        script("ddp.py"),
        "--sample-ms",
        "0",
        "--extra-ms",
        "0",
        "--side-forwards",
        "6",
        "--side-ms",
        "1.5",
    ]
    r = stepscope_run(
        tmp_path, "--ceiling-batches", "0", "--", *launcher, warmup=5, steps=30, timeout=180, verb="doctor"
    )
    assert r.returncode == 0, r.describe()
    s = r.summary
    by_rank = {x.meta.rank: x for x in s.ranks}
    assert all(x.eval == {} for x in s.ranks), [x.eval for x in s.ranks]
    side_ms = 6 * 1.5  # sleep-based: load makes it longer, never shorter
    assert by_rank[1].phases["forward"].mean_ms >= side_ms, r.describe()
    step_ms = [x.phases["total"].mean_ms for x in s.ranks]
    assert min(step_ms) >= side_ms and max(step_ms) <= 1.25 * min(step_ms), (step_ms, r.describe())
    # The job's rate: 16 samples per job step, never above what the slower rank's step allows.
    assert s.throughput.samples_per_s == pytest.approx(16e3 / max(step_ms), rel=1e-6), r.describe()
    assert s.throughput.wall_samples_per_s <= s.throughput.samples_per_s * (1 + 1e-9)
    assert s.cluster.straggler is not None and s.cluster.straggler.rank == 1, (s.cluster.straggler, r.describe())
    assert s.cluster.straggler.phase == "forward", (s.cluster.straggler, r.describe())
    assert s.verdict.bound == "compute", (s.verdict, r.describe())
    assert not s.fixes or s.fixes[0].id not in ("eval.frequency", "ddp.gradient_as_bucket_view"), s.fixes
    assert s.invariants == [], s.invariants


def test_rank_0_validating_alone_leaves_the_others_waits_out_of_the_job_step(tmp_path):
    # Rank 0 alone validates every 4 steps (4 batches of 12 ms); rank 1 waits for it in its next step's all-reduce.
    # That wait is the job's validation: read as rank 1's step, the step rate was about half the truth.
    launcher = [*torchrun(), script("ddp.py"), "--sample-ms", "1", "--extra-ms", "0", "--val-every", "4"]
    launcher += ["--val-batches", "4", "--val-ms", "12"]
    r = stepscope_run(tmp_path, "--", *launcher, warmup=5, steps=24, timeout=180)
    assert r.returncode == 0, r.describe()
    s = r.summary
    by_rank = {x.meta.rank: x for x in s.ranks}
    assert by_rank[0].eval["passes"] >= 4 and not by_rank[1].eval, [x.eval for x in s.ranks]
    steps = [by_rank[k].phases["total"].mean_ms for k in (0, 1)]
    assert max(steps) <= 1.3 * min(steps), (steps, r.describe())
    assert any("for rank 0's validation" in note for note in s.notes), s.notes
    # 48 ms of validation every 4 steps of ~9 ms: more than half the wall time
    assert s.throughput.steps_per_s >= 1.5 * s.throughput.wall_steps_per_s, (s.throughput, r.describe())
    assert s.verdict.bound == "data", (s.verdict, r.describe())
    assert s.invariants == [], s.invariants


def test_explicit_collectives_are_comms(tmp_path):
    # Rank 1 sleeps 10 ms after backward (its `other`); rank 0 waits that long in all_reduce, Work.wait, barrier.
    launcher = [*torchrun(), script("collectives.py"), "--sleep-ms", "10"]
    r = stepscope_run(tmp_path, "--", *launcher, warmup=5, steps=25, timeout=180)
    assert r.returncode == 0, r.describe()
    s = r.summary
    fast, slow = ({x.meta.rank: x.phases for x in s.ranks}[i] for i in (0, 1))
    waited = fast["comms"].mean_ms - slow["comms"].mean_ms
    assert 6 < waited < 16, (waited, r.describe())
    assert slow["other"].mean_ms > 8, r.describe()
    assert fast["other"].mean_ms < 3 and fast["backward"].mean_ms < 3, r.describe()
    straggler = s.cluster.straggler
    assert (straggler.rank, straggler.phase, straggler.waiting_ranks) == (1, "other", [0]), straggler
    assert s.verdict.bound == "host", s.verdict
    assert _past_contention(s.verdict.evidence)[0].startswith("rank 1's other is "), s.verdict
