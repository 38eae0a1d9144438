"""The invariants every summary must hold (stepscope.invariants), each with a summary that breaks it, and the
producers that used to break them: a verdict's "X ms of a Y ms step" for a phase that ran in few steps, a merged
job's samples/s summed over ranks that each left out different things, a loader fix naming the first loader
rather than the one the step waits for. Exact figures: a fake clock or hand-built summaries."""

from __future__ import annotations

import pytest

from stepscope import Scope
from stepscope.doctor.checkup import examine
from stepscope.doctor.verdict import classify
from stepscope.instrument.merge import merge
from stepscope.invariants import between_note, broken, check
from stepscope.summary import Fix, LoaderInfo, Meta, PhaseStats, RunSummary, Steps, Throughput, Verdict, Wall


def _phase(mean_ms: float, share: float, steps: int = 10, nested: bool = False) -> PhaseStats:
    return PhaseStats(mean_ms=mean_ms, median_ms=mean_ms, p95_ms=mean_ms, share=share, steps=steps, nested=nested)


def _summary(phases_ms: dict[str, float], steps: int = 10, rank: int | None = None, **fields) -> RunSummary:
    """A consistent summary: every phase in every step, ``other`` what is left, wall window = the steps."""
    total = sum(phases_ms.values())
    phases = {name: _phase(ms, ms / total, steps) for name, ms in phases_ms.items()}
    phases["total"] = _phase(total, 1.0, steps)
    step_s = total / 1e3 * steps
    summary = RunSummary(
        steps=Steps(warmup=2, measured=steps),
        phases=phases,
        throughput=Throughput(
            steps_per_s=1e3 / total,
            samples_per_s=8e3 / total,
            wall_steps_per_s=1e3 / total,
            wall_samples_per_s=8e3 / total,
            step_time_ms=total,
        ),
        wall=Wall(window_s=step_s, steps_s=step_s),
        meta=Meta(rank=rank, world_size=None if rank is None else 2),
    )
    for name, value in fields.items():
        setattr(summary, name, value)
    return summary


def test_a_consistent_summary_breaks_nothing():
    summary = _summary({"data_wait": 2.0, "forward": 5.0, "other": 1.0})
    assert broken(summary) == []
    assert check(summary).invariants == [] and summary.notes == []


def test_a_share_above_the_whole_is_broken():
    summary = _summary({"forward": 5.0, "other": 1.0})
    summary.phases["forward"].share = 1.2
    found = broken(summary)
    assert any("forward is 120.0% of the step" in s for s in found), found
    assert any("add up to" in s for s in found), found


def test_phases_that_do_not_add_up_to_the_step_are_broken():
    summary = _summary({"forward": 5.0, "other": 1.0})
    summary.phases["other"] = _phase(3.0, 0.5)  # 5 + 3 ms in a 6 ms step
    assert any("add up to 8.000 ms per step, not the step's 6.000 ms" in s for s in broken(summary))


def test_a_phase_that_ran_in_some_steps_adds_up_by_its_steps():
    # sync in 2 of 10 steps, 5 ms each: 1 ms per step. Its mean (5 ms) is above its share of the 6 ms step.
    summary = _summary({"forward": 4.0, "other": 1.0})
    summary.phases["sync"] = _phase(5.0, 1.0 / 6.0, steps=2)
    summary.phases["total"] = _phase(6.0, 1.0)
    summary.phases["forward"].share, summary.phases["other"].share = 4 / 6, 1 / 6
    assert broken(summary) == []


def test_evidence_with_a_part_larger_than_its_whole_is_broken():
    summary = _summary({"forward": 5.0, "other": 1.0})
    summary.verdict = Verdict("host", "high", ["sync is 17% of the step (50.0 ms of a 6.0 ms step)"])
    assert any("part larger than its whole" in s for s in broken(summary))


def test_the_verdict_gives_a_phase_that_ran_in_few_steps_per_measured_step():
    # A 60 ms sync in 1 of 10 steps of a 10 ms step: 6 ms per step, 60% of it. Its mean over the steps it ran in
    # is 60 ms, which the verdict used to print as "60.0 ms of a 10.0 ms step".
    summary = _summary({"forward": 4.0})
    summary.phases = {
        "forward": _phase(4.0, 0.4),
        "sync": _phase(60.0, 0.6, steps=1),
        "total": _phase(10.0, 1.0),
    }
    verdict = classify(summary)
    assert "sync is 60% of the step (6.0 ms of a 10.0 ms step)" in verdict.evidence, verdict.evidence
    summary.verdict = verdict
    assert broken(summary) == []


def test_a_wall_window_that_does_not_add_up_or_counts_twice_is_broken():
    summary = _summary({"forward": 5.0})
    summary.wall = Wall(window_s=1.0, steps_s=0.8, eval_s=0.5, between_s=-0.3)
    found = broken(summary)
    assert any("counted twice" in s for s in found), found
    summary.wall = Wall(window_s=1.0, steps_s=0.8, eval_s=0.1, between_s=0.0)
    assert any("not its parts' sum" in s for s in broken(summary))


def test_a_wall_rate_above_the_step_rate_is_broken():
    summary = _summary({"forward": 5.0})
    summary.throughput.wall_steps_per_s = 2 * summary.throughput.steps_per_s
    assert any("wall rate" in s and "above the step rate" in s for s in broken(summary))


def test_more_validation_passes_than_steps_is_broken():
    summary = _summary({"forward": 5.0}, eval={"passes": 11, "share_of_wall": 0.5})
    assert any("11 validation passes in 10 measured steps" in s for s in broken(summary))


def _loaders(fetch_s: list[float]) -> list[LoaderInfo]:
    return [
        LoaderInfo(i, f"Set{i}", 8, 0, False, False, None, False, False, 100, batches=50, samples=400, fetch_s=s)
        for i, s in enumerate(fetch_s)
    ]


def test_a_loader_fix_naming_a_loader_the_step_does_not_wait_for_is_broken():
    summary = _summary({"data_wait": 8.0, "forward": 1.0}, loaders=_loaders([0.05, 0.4]))
    fix = Fix("loader.num_workers", "t", "w", ["loader 0 (Set0) has num_workers=0"], "h", "config", 0.8)
    summary.fixes = [fix]
    assert any("names loader 0" in s for s in broken(summary))
    fix.evidence = ["loader 1 (Set1) has num_workers=0"]
    assert broken(summary) == []


def test_the_workers_fix_names_the_loader_the_step_waits_for_most():
    # Two loaders without workers; the second one's fetches took 8 times as long: it is the one to fix.
    summary = _summary({"data_wait": 8.0, "forward": 1.0}, loaders=_loaders([0.05, 0.4]))
    examine(summary, [])
    workers = next(f for f in summary.fixes if f.id == "loader.num_workers")
    assert workers.evidence[0].startswith("loader 1 (Set1)"), workers.evidence
    assert broken(summary) == []


def _rank(rank: int, step_ms: float, comms_ms: float, window_ms_per_step: float) -> RunSummary:
    summary = _summary({"forward": step_ms - comms_ms, "comms": comms_ms}, steps=40, rank=rank)
    summary.wall = Wall(window_s=window_ms_per_step * 40 / 1e3, steps_s=step_ms * 40 / 1e3)
    summary.wall.eval_s = summary.wall.window_s - summary.wall.steps_s
    summary.throughput.wall_steps_per_s = 1e3 / window_ms_per_step
    summary.throughput.wall_samples_per_s = 8e3 / window_ms_per_step
    return summary


def test_a_synchronous_jobs_rate_is_the_jobs_not_a_sum_of_rank_rates():
    # The job of issue 24: rank 1's per-step side work was cut out of its step as validation, so its step read
    # 2.1 ms against rank 0's 25.1 ms, and the sum of the ranks' rates (8/2.1 + 8/25.1 samples per ms) made the job
    # 3,800 samples/s where its clock says 640. The job's clock is the slowest rank's.
    ranks = [_rank(0, 25.1, 20.0, 25.1), _rank(1, 2.1, 0.5, 25.1)]
    job = merge(ranks)
    assert job.throughput.samples_per_s == pytest.approx(16e3 / 25.1)
    assert job.cluster.samples_per_s == pytest.approx(16e3 / 25.1)
    assert job.throughput.steps_per_s == pytest.approx(1e3 / 25.1)
    assert job.throughput.wall_samples_per_s == pytest.approx(16e3 / 25.1)


def test_ranks_of_a_synchronous_job_must_share_one_clock():
    even = merge([_rank(0, 25.0, 10.0, 25.0), _rank(1, 25.0, 1.0, 25.5)])
    assert broken(even) == []
    uneven = merge([_rank(0, 25.0, 10.0, 25.0), _rank(1, 2.1, 0.5, 2.1)])
    assert any("disagree on its wall time per step" in s for s in broken(uneven)), broken(uneven)


def test_ranks_that_wait_for_nobody_add_their_rates_up():
    ranks = [_summary({"forward": 10.0}, rank=0), _summary({"forward": 20.0}, rank=1)]
    job = merge(ranks)
    assert job.throughput.samples_per_s == pytest.approx(800 + 400)
    assert broken(job) == []


def test_check_notes_what_is_broken_once():
    summary = _summary({"forward": 5.0}, eval={"passes": 11})
    check(check(summary))
    assert len(summary.invariants) == 1
    assert sum("break stepscope's own invariants" in note for note in summary.notes) == 1


# -- the wall window of a Scope: exact figures with a fake clock ----------------------------------------------------


def test_a_scopes_wall_window_is_its_steps_its_passes_and_the_time_between(clock):
    scope = Scope(warmup=1, clock=clock, system_interval_s=None)
    for i in range(7):
        with scope.phase("forward"):
            clock.advance(5.0)
        clock.advance(1.0)
        scope.step(batch_size=4)
        if i == 3:
            with scope.phase("eval"):
                clock.advance(30.0)
    summary = scope.summary()
    # 6 measured steps of 6 ms and one 30 ms pass, back to back: a 66 ms window.
    wall = summary.wall
    assert (wall.window_s, wall.steps_s, wall.eval_s) == pytest.approx((0.066, 0.036, 0.03))
    assert wall.between_s == pytest.approx(0.0, abs=1e-12)
    assert summary.throughput.steps_per_s == pytest.approx(6 / 0.036)
    assert summary.throughput.wall_steps_per_s == pytest.approx(6 / 0.066)
    assert summary.throughput.wall_samples_per_s == pytest.approx(24 / 0.066)
    assert summary.eval["share_of_wall"] == pytest.approx(30 / 66)
    assert summary.invariants == [] and between_note(summary) is None


def test_time_in_no_step_and_no_pass_is_said_when_it_makes_the_rates_disagree():
    summary = _summary({"forward": 5.0})
    summary.wall = Wall(window_s=0.1, steps_s=0.05, eval_s=0.01, between_s=0.04)
    summary.throughput.wall_steps_per_s = 100.0
    note = between_note(summary)
    assert note is not None and "0.04 s (40%) were in no step" in note, note


def test_no_workers_advice_for_a_loader_the_step_hardly_waits_on():
    # The truth generator's case c021: a free loader without workers beside a loader with one worker that holds
    # all the wait. Advising workers for the free one aims at nothing.
    loaders = _loaders([0.03, 0.0005])
    loaders[0].num_workers = 1
    summary = _summary({"data_wait": 1.5, "forward": 8.0}, loaders=loaders)
    examine(summary, [])
    assert "loader.num_workers" not in [f.id for f in summary.fixes], summary.fixes


def test_a_validation_loaders_fetches_do_not_count_as_the_steps_wait():
    # Loader 1 feeds validation passes only: its fetch time is the passes', not the step's.
    loaders = _loaders([0.1, 0.5])
    loaders[1].eval_fetch_s, loaders[1].eval_batches = 0.5, 50
    summary = _summary({"data_wait": 5.0, "forward": 3.0}, loaders=loaders)
    examine(summary, [])
    workers = next(f for f in summary.fixes if f.id == "loader.num_workers")
    assert workers.evidence[0].startswith("loader 0 (Set0)"), workers.evidence
    assert broken(summary) == []


def test_a_jobs_loader_fix_is_checked_against_the_rank_it_names():
    # The truth generator's c153: the straggler rank 1 waits on loader 0, which rank 0 hardly waits on; the job's
    # fix says "rank 1: loader 0 ...", which the merged summary's loaders (rank 0's) do not bear out.
    ranks = []
    for r, fetch in ((0, [0.03, 0.3]), (1, [1.2, 0.3])):
        ranks.append(_summary({"data_wait": 8.0, "forward": 1.0}, rank=r, loaders=_loaders(fetch)))
    job = merge(ranks)
    job.fixes = [Fix("loader.num_workers", "t", "w", ["rank 1: loader 0 (Set0) has num_workers=0"], "h", "config", 0.5)]
    assert broken(job) == []
    job.fixes[0].evidence = ["rank 0: loader 0 (Set0) has num_workers=0"]
    assert any("names loader 0" in s for s in broken(job))
