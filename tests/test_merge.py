"""Merging per-rank summaries: cluster figures, the straggler, dead ranks, exits; files merge must skip."""

import statistics
import subprocess
import sys

import pytest
from run_helpers import run_env

from stepscope.instrument.merge import find_straggler, merge
from stepscope.invariants import broken
from stepscope.summary import Exit, Meta, PhaseStats, RunSummary, Steps, StepSeries, Throughput, Wall


def rank(r: int, phases_ms: dict[str, float], samples_per_s: float = 100.0, world: int = 2, exit_reason="stopped"):
    step_ms = sum(phases_ms.values())
    phases = {n: PhaseStats(ms, ms, ms * 1.5, ms / step_ms, 20) for n, ms in phases_ms.items()}
    phases["total"] = PhaseStats(step_ms, step_ms, step_ms * 1.2, 1.0, 20)
    return RunSummary(
        steps=Steps(warmup=3, measured=20, boundary="optimizer.step"),
        phases=phases,
        throughput=Throughput(steps_per_s=1e3 / step_ms, samples_per_s=samples_per_s, step_time_ms=step_ms),
        meta=Meta(rank=r, world_size=world, command="train.py"),
        exit=Exit(reason=exit_reason, code=0),
    )


def test_slow_loader_on_one_rank_is_the_straggler_not_the_rank_waiting_in_backward():
    # Rank 1 fetches slowly; rank 0 waits for it in DDP's all-reduce inside backward: equal step times.
    ranks = [
        rank(0, {"data_wait": 5.0, "forward": 0.3, "backward": 18.2, "other": 0.3}),
        rank(1, {"data_wait": 21.6, "forward": 0.4, "backward": 1.4, "other": 0.4}),
    ]
    straggler = find_straggler(ranks)
    assert (straggler.rank, straggler.phase) == (1, "data_wait")
    assert straggler.excess_ms == pytest.approx(21.6 - 5.0)  # against the median of the other ranks


def test_a_ranks_wait_for_another_ranks_validation_is_validation_not_step_time():
    # Rank 0 alone validates, 0.24 s over 20 steps; rank 1 waits for it in the next steps' all-reduce: 12 ms a step
    # more comms. The job trains at 9 ms a step, not rank 1's 21.
    validating = rank(0, {"data_wait": 2.0, "forward": 3.0, "comms": 1.0, "other": 3.0})
    waiting = rank(1, {"data_wait": 2.0, "forward": 3.0, "comms": 13.0, "other": 3.0})
    waiting.phases["comms"].median_ms = 1.0  # its usual step's: the waits fell in 4 steps of 20
    validating.wall = Wall(window_s=0.42, steps_s=0.18, eval_s=0.24)
    waiting.wall = Wall(window_s=0.42, steps_s=0.42)
    validating.eval = {"passes": 20}  # a stretch cut out of every step is not validation the others wait for
    assert merge([validating, waiting]).throughput.step_time_ms == pytest.approx(21.0)
    validating.eval = {"passes": 4}
    job = merge([validating, waiting])
    assert job.throughput.step_time_ms == pytest.approx(9.0)
    assert job.throughput.wall_steps_per_s == pytest.approx(20 / 0.42)
    moved = job.ranks[1]
    assert moved.phases["comms"].mean_ms == pytest.approx(1.0)
    assert moved.phases["total"].mean_ms == pytest.approx(9.0)
    assert sum(p.share for n, p in moved.phases.items() if n != "total") == pytest.approx(1.0)
    assert moved.wall == Wall(window_s=0.42, steps_s=pytest.approx(0.18), eval_s=pytest.approx(0.24))
    assert moved.throughput.samples_per_s == pytest.approx(100.0 * 21 / 9)
    assert any("for rank 0's validation" in note for note in job.notes), job.notes
    assert job.cluster.straggler is None
    assert broken(job) == []
    # The wait moved is at most the difference in validation time, and at most the comms beyond its usual step's.
    validating.wall = Wall(window_s=0.42, steps_s=0.32, eval_s=0.1)
    assert merge([validating, waiting]).ranks[1].phases["comms"].mean_ms == pytest.approx(13.0 - 5.0)
    validating.wall = Wall(window_s=0.42, steps_s=0.18, eval_s=0.24)
    waiting.phases["comms"].mean_ms = 8.0  # (its step had other time too; only the comms beyond 1 ms can move)
    assert merge([validating, waiting]).ranks[1].phases["comms"].mean_ms == pytest.approx(1.0)
    waiting.phases["comms"].mean_ms = 13.0


def test_a_straggler_waits_for_the_others_validation_where_it_outlasts_the_stragglers_excess():
    # Seed 2029's c033 beside busy loops: rank 1 straggles by 9 ms in backward, so rank 0 waits for it in comms every
    # step (13.9 ms) and rank 1, whose comms are the least, 0.75 ms in its usual step; rank 0 validates 20 ms every
    # 5th step, longer than the excess, and rank 1 waits for the rest (2.44 ms a step on average). Measured against
    # the least comms, none of its wait moved and the job read 31.0 steps/s where the scripts' own timers give 32.7.
    validating = rank(0, {"data_wait": 1.0, "forward": 3.0, "backward": 4.0, "comms": 13.86, "other": 3.0})
    straggler = rank(1, {"data_wait": 1.0, "forward": 3.0, "backward": 13.0, "comms": 2.44, "other": 3.0})
    straggler.phases["comms"].median_ms = 0.75
    validating.wall = Wall(window_s=0.52, steps_s=0.35, eval_s=0.17)
    straggler.wall = Wall(window_s=0.52, steps_s=0.52)
    validating.eval = {"passes": 4}
    moved = merge([validating, straggler]).ranks[1]
    assert moved.phases["comms"].mean_ms == pytest.approx(0.75)
    assert moved.wall.eval_s == pytest.approx((2.44 - 0.75) * 20 / 1e3)
    # Where the straggler validates, the other rank's waits for it every step are its usual step's, not validation
    # (against the least comms, 0.17 s of them would have moved).
    waiting, validating_straggler = validating, straggler
    validating_straggler.wall, validating_straggler.eval = Wall(window_s=0.52, steps_s=0.35, eval_s=0.17), {"passes": 4}
    waiting.wall, waiting.eval = Wall(window_s=0.52, steps_s=0.52), None
    job = merge([waiting, validating_straggler])
    assert job.ranks[0].phases["comms"].mean_ms == pytest.approx(13.86) and job.ranks[0].wall.eval_s == 0.0


def test_the_wait_for_validation_is_measured_in_the_steps_where_the_passes_fell():
    # Seed 2026's c046: rank 0 logs 15 ms a step (the straggler) and alone validates 17 ms before steps 1, 7, 13
    # and 19; rank 1 waits for the log every step (its steps 14-20 ms, noisy) and for the validation too (+17 ms
    # there). Its comms beyond their median (biased up by the four long steps) took 55 ms for validation, where the
    # four steps hold 66; the least comms of any rank (the straggler's) would have moved all of its waits, capped.
    # Each step's excess over the rank's usual step, in the steps the passes fell in, is the wait.
    noisy = [14.0, 20.0, 16.0, 18.0, 15.0, 19.0, 17.0, 16.0, 18.0, 15.0, 19.0, 17.0, 14.0, 20.0, 16.0, 18.0]
    pass_steps = [1, 7, 13, 19]
    step_ms, usual = [], iter(noisy)
    for at in range(20):
        step_ms.append(17.0 + 16.5 if at in pass_steps else next(usual))
    validating = rank(0, {"data_wait": 1.0, "forward": 3.0, "comms": 1.0, "other": 16.0})
    waiting = rank(1, {"data_wait": 1.0, "forward": 3.0, "comms": sum(step_ms) / 20 - 6.0, "other": 2.0})
    waiting.phases["comms"].median_ms = statistics.median(step_ms) - 6.0
    validating.wall = Wall(window_s=0.49, steps_s=0.42, eval_s=0.07)
    waiting.wall = Wall(window_s=0.49, steps_s=0.49)
    validating.eval = {"passes": 4, "steps": pass_steps}
    validating.series = StepSeries(stride=1, step_ms=[21.0] * 20)
    waiting.series = StepSeries(stride=1, step_ms=step_ms)
    moved = merge([validating, waiting]).ranks[1]
    wait_s = sum(step_ms[at] - statistics.median(noisy) for at in pass_steps) / 1e3
    assert wait_s == pytest.approx(0.066)
    assert moved.wall.eval_s == pytest.approx(wait_s)
    # Without the pass steps (a summary from before they were kept): the comms beyond their median, capped.
    validating.eval = {"passes": 4}
    fallback = merge([validating, waiting]).ranks[1].wall.eval_s
    assert fallback == pytest.approx((sum(step_ms) / 20 - statistics.median(step_ms)) * 20 / 1e3)
    assert fallback < 0.06
    # A straggler whose own 9 ms excess overlaps 17 ms of validation waits 8 ms in those steps, not 17.
    validating.eval = {"passes": 4, "steps": pass_steps}
    waiting.series = StepSeries(stride=1, step_ms=[38.0 if at in pass_steps else 30.0 for at in range(20)])
    assert merge([validating, waiting]).ranks[1].wall.eval_s == pytest.approx(4 * 8.0 / 1e3)


def test_a_phase_that_ran_in_different_steps_on_each_rank_still_adds_up_to_the_job_step():
    # The truth generator's c039 beside busy loops: rank 0's data_wait ran in 8 of 20 steps (3.2 ms each), rank 1's
    # in 1 (24.4 ms); the mean of the two means over 1 step left the job's phases 0.3 ms short of its step.
    ranks = [rank(0, {"data_wait": 3.2, "forward": 10.0}), rank(1, {"data_wait": 24.4, "forward": 10.0})]
    ranks[0].phases["data_wait"].steps, ranks[1].phases["data_wait"].steps = 8, 1
    for r in ranks:  # the step is its phases' time per measured step
        per_step = sum(p.mean_ms * p.steps / 20 for n, p in r.phases.items() if n != "total")
        r.phases["total"].mean_ms = per_step
    job = merge(ranks)
    data = job.phases["data_wait"]
    assert data.steps == 8
    assert data.mean_ms * data.steps / 20 == pytest.approx((3.2 * 8 + 24.4) / 20 / 2)
    assert broken(job) == []
    # A phase one rank alone ran counts for nothing on the others (the job's step is the mean of theirs).
    ranks[1].phases.pop("data_wait")
    ranks[1].phases["total"].mean_ms = 10.0
    assert merge(ranks).phases["data_wait"].mean_ms * 8 / 20 == pytest.approx(3.2 * 8 / 20 / 2)


def test_even_ranks_have_no_straggler():
    ranks = [rank(r, {"data_wait": 5.0 + 0.01 * r, "forward": 10.0, "backward": 20.0}) for r in range(4)]
    assert find_straggler(ranks) is None


def test_merge_cluster_figures():
    ranks = [
        rank(1, {"data_wait": 10.0, "forward": 30.0}, samples_per_s=90.0),
        rank(0, {"data_wait": 12.0, "forward": 28.0}, samples_per_s=110.0),
    ]
    merged = merge(ranks)
    assert [r.meta.rank for r in merged.ranks] == [0, 1]
    assert merged.cluster.world_size == 2
    assert merged.cluster.ranks_reported == [0, 1]
    assert merged.cluster.samples_per_s == pytest.approx(200.0)
    assert merged.throughput.samples_per_s == pytest.approx(200.0)
    assert merged.cluster.phases["data_wait"] == {"min_ms": 10.0, "mean_ms": 11.0, "max_ms": 12.0}
    assert merged.phases["data_wait"].mean_ms == pytest.approx(11.0)
    assert merged.phases["data_wait"].p95_ms == pytest.approx(18.0)  # the largest rank's p95
    assert merged.meta.rank is None
    assert merged.meta.world_size == 2
    assert merged.steps.measured == 20


def test_a_rank_that_wrote_nothing_is_named_and_the_rest_is_merged():
    merged = merge([rank(0, {"forward": 10.0}, world=3), rank(2, {"forward": 10.0}, world=3)])
    assert merged.cluster.ranks_reported == [0, 2]
    assert any("rank(s) 1 wrote no summary" in note for note in merged.notes)


def test_the_worst_exit_wins_and_notes_name_their_rank():
    a = rank(0, {"forward": 10.0}, exit_reason="stopped")
    b = rank(1, {"forward": 10.0}, exit_reason="error")
    b.notes.append("something odd")
    merged = merge([a, b])
    assert merged.exit.reason == "error"
    assert "rank 1: something odd" in merged.notes


def test_a_single_process_summary_is_returned_as_is():
    only = rank(0, {"forward": 10.0}, world=1)
    only.meta.world_size = None
    assert merge([only]) is only


def test_merged_summary_round_trips_through_json(tmp_path):
    merged = merge([rank(0, {"data_wait": 5.0, "backward": 18.0}), rank(1, {"data_wait": 21.0, "backward": 2.0})])
    path = tmp_path / "merged.json"
    merged.to_json(path)
    loaded = RunSummary.from_json(path)
    assert loaded == merged
    assert loaded.cluster.straggler.rank == 1


# -- `stepscope merge` on files it must skip (a real merge process) ------------------------------------------------


def _merge_cli(*paths):
    cmd = [sys.executable, "-m", "stepscope", "merge", *map(str, paths)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=run_env())


def test_merge_names_each_skipped_file_and_why_when_none_is_readable(tmp_path):
    good = tmp_path / "good.json"
    rank(0, {"forward": 10.0}).to_json(good)
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "text.json").write_text("hello\n")
    (folder / "cut.json").write_text(good.read_text()[:120])
    (folder / "list.json").write_text("[1, 2]\n")
    result = _merge_cli(folder)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    for name, why in (
        ("cut.json", "is not valid JSON"),
        ("list.json", "not a stepscope summary"),
        ("text.json", "JSON"),
    ):
        (line,) = [line for line in lines if f"{name} was skipped" in line]
        assert why in line and str(folder / name) in line, lines
    assert lines[-1].startswith("stepscope: no stepscope summary could be read"), lines
    assert "3 file(s) skipped, each for the reason above" in lines[-1], lines
    assert len(lines) == 4, lines  # one sentence per file, then the count


@pytest.mark.parametrize(
    ("bad", "world", "why"), [(-3, 2, "outside the job's ranks 0 to 1"), (2, 2, "rank 2"), (-1, None, "rank -1")]
)
def test_merge_skips_a_summary_whose_rank_is_outside_the_job(tmp_path, bad, world, why):
    rank(0, {"forward": 10.0}, world=world).to_json(tmp_path / "r0.json")
    rank(1, {"forward": 10.0}, world=world).to_json(tmp_path / "r1.json")
    rank(bad, {"forward": 10.0}, world=world).to_json(tmp_path / "odd.json")
    result = _merge_cli(tmp_path, "--json", tmp_path / "job.out")
    assert result.returncode == 0, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if "odd.json" in line]
    assert line.startswith(f"stepscope: {tmp_path / 'odd.json'} was skipped: it says") and why in line, line
    job = RunSummary.from_json(tmp_path / "job.out")
    assert [r.meta.rank for r in job.ranks] == [0, 1]
    assert "ranks: 2 of 2 reported" in result.stdout and "wrote no summary" not in result.stdout, result.stdout


def test_merge_of_only_out_of_range_ranks_fails_with_each_reason(tmp_path):
    rank(-3, {"forward": 10.0}).to_json(tmp_path / "a.json")
    rank(7, {"forward": 10.0}).to_json(tmp_path / "b.json")
    result = _merge_cli(tmp_path)
    assert result.returncode == 2, result.stderr
    assert "a.json was skipped: it says rank -3, outside the job's ranks 0 to 1 (world size 2)." in result.stderr
    assert "b.json was skipped: it says rank 7, outside the job's ranks 0 to 1 (world size 2)." in result.stderr
    assert "2 file(s) skipped" in result.stderr.splitlines()[-1]


def test_a_small_earlier_difference_is_not_named_over_the_phase_that_holds_the_job_up():
    # Truth case c013 beside busy loops: rank 0 sleeps 10.5 ms in forward; rank 1's CPU-bound loading, stretched by
    # the busy machine, takes 2 ms more than rank 0's. The earliest phase that differs is data_wait, but it explains
    # a fifth of what the forward does: rank 0's forward is the straggler.
    ranks = [
        rank(0, {"data_wait": 4.6, "forward": 11.1, "backward": 1.0, "other": 0.3}),
        rank(1, {"data_wait": 6.5, "forward": 0.3, "backward": 11.5, "other": 0.3}),
    ]
    straggler = find_straggler(ranks)
    assert (straggler.rank, straggler.phase) == (0, "forward")
    assert straggler.excess_ms == pytest.approx(10.8)


def test_a_phase_in_some_steps_only_is_compared_per_step_not_per_occurrence():
    # Rank 0 reads its loss every 10th step for 10 ms, rank 1 every step for 1 ms: 1 ms a step on both. Compared by
    # the mean over the steps each ran it in (10 against 1 ms), rank 0 was a 9 ms straggler in sync.
    ranks = [rank(r, {"data_wait": 2.0, "forward": 10.0, "backward": 20.0, "sync": 1.0}) for r in range(2)]
    sync = ranks[0].phases["sync"]
    ranks[0].phases["sync"] = PhaseStats(10.0, 10.0, 10.0, sync.share, steps=2)
    assert find_straggler(ranks) is None
    ranks[0].phases["sync"] = PhaseStats(40.0, 40.0, 40.0, 4 * sync.share, steps=2)  # 4 ms a step: 3 ms above
    straggler = find_straggler(ranks)
    assert (straggler.rank, straggler.phase) == (0, "sync")
    assert straggler.excess_ms == pytest.approx(3.0)
