"""`stepscope doctor --verify`: the fixes chosen, the flags, the re-ranking, and real verified gains.

Ground truth for the end-to-end runs: a loader whose every sample sleeps 3 ms (one process fetches a batch of 8 in
24 ms; workers overlap those waits), so the worker fix's gain is large and known in direction; a fix that does
nothing (pinned memory without an accelerator) must read "no detectable difference". Both are sleep-bound and hold
beside other tests. The CPU-bound fixes (fused optimizer, anomaly mode off) need free cores: bench/verify_cpu.py.
"""

from __future__ import annotations

import pytest
from run_helpers import script, scripts_here, stepscope_here

from stepscope.analyses.ab import FASTER, NO_DIFFERENCE, SLOWER, Comparison, Settings
from stepscope.instrument.apply import parse_fixes
from stepscope.instrument.launch import script_target
from stepscope.instrument.verify import apply_argument, largest_speedup, plan, rerank, verify
from stepscope.summary import Fix, RunSummary


def fix(fix_id: str, bound: float | None = 0.5, cost: str = "config", numerics: bool = False, **kw) -> Fix:
    return Fix(fix_id, fix_id, "why", [], "how", cost, bound, changes_numerics=numerics, **kw)


def comparison(speedup: float, ci: tuple[float, float] | None, verdict: str) -> Comparison:
    return Comparison("baseline", "x", speedup, ci, None, verdict, runs=(3, 3))


# -- choosing and ranking -----------------------------------------------------------------------------------------


def test_the_plan_takes_the_top_appliable_fixes_and_says_why_it_skips_the_others():
    fixes = [
        fix("loader.io_bound", cost="infra"),
        fix("precision.bf16", numerics=True),
        fix("loader.num_workers", apply="loader.num_workers=6"),
        fix("debug.anomaly"),
        fix("optimizer.foreach"),
    ]
    chosen = plan(fixes, top=2, allow_numerics=False)
    assert [(f.id, arg) for f, arg in chosen.chosen] == [
        ("loader.num_workers", "loader.num_workers=6"),  # the rule's own value
        ("debug.anomaly", "debug.anomaly"),  # the catalogue's default direction
    ]
    assert chosen.skipped == [
        "loader.io_bound is not verified: it is a infra change --apply cannot make at runtime",
        "precision.bf16 is not verified: it changes numerics (--allow-numerics verifies it)",
    ]
    assert [f.id for f, _ in plan(fixes, top=2, allow_numerics=True).chosen] == ["precision.bf16", "loader.num_workers"]
    # A count without the value the evidence recommends cannot be applied: --apply needs N.
    assert apply_argument(fix("loader.num_workers")) is None


def test_measured_gains_rank_first_and_a_loss_last():
    fixes = [fix("a"), fix("b"), fix("c"), fix("d"), fix("e")]
    fixes[1].measured = {"verdict": FASTER, "speedup": 1.4}
    fixes[2].measured = {"verdict": SLOWER, "speedup": 0.8}
    fixes[3].measured = {"verdict": FASTER, "speedup": 2.5}
    fixes[4].measured = {"verdict": NO_DIFFERENCE, "speedup": 1.01}
    assert [f.id for f in rerank(fixes)] == ["d", "b", "a", "e", "c"]


def test_a_loss_or_a_gain_beyond_the_bound_is_flagged():
    from stepscope.instrument.verify import _measured

    bounded = fix("x", bound=0.2)  # saves at most 20% of the step: at most 1.25x
    assert largest_speedup(bounded) == pytest.approx(1.25)
    assert largest_speedup(fix("x", bound=None)) is None
    assert largest_speedup(fix("x", bound=0.2, gain_basis="wall")) is None
    slower = _measured(comparison(0.8, (0.7, 0.9), SLOWER), "x", bounded)
    assert slower["flag"].startswith("measured slower (0.80x)")
    beyond = _measured(comparison(2.0, (1.8, 2.2), FASTER), "x", bounded)
    assert "beyond the 1.25x its bound (20% of the step) allows" in beyond["flag"]
    within = _measured(comparison(1.2, (1.1, 1.3), FASTER), "x", bounded)
    assert within["flag"] is None and (within["ci_low"], within["ci_high"], within["runs"]) == (1.1, 1.3, [3, 3])


# -- real runs ----------------------------------------------------------------------------------------------------


def _verified(summary: RunSummary, fix_id: str) -> dict:
    (found,) = [f for f in summary.fixes if f.id == fix_id]
    assert found.measured is not None, summary.fixes
    return found.measured


def test_a_starved_loaders_worker_fix_is_verified_faster_and_ranked_first(tmp_path):
    # 60 steps of ~27 ms: enough host samples (4 Hz) for the doctor to see that the fetch waits rather than computes,
    # so it recommends workers that overlap the waits rather than one per spare core.
    r = stepscope_here(
        tmp_path, "--ceiling-batches", "0", "--verify", "1", script("slow_loader.py"), "--sample-ms", "3",
        warmup=3, steps=60, verb="doctor",
    )  # fmt: skip
    assert r.returncode == 0, r.describe()
    s = r.summary
    measured = _verified(s, "loader.num_workers")
    assert measured["verdict"] == FASTER and measured["ci_low"] > 1.3, (measured, r.describe())
    assert measured["applied"].startswith("loader.num_workers=") and measured["runs"] == [3, 3], measured
    assert s.fixes[0].id == "loader.num_workers", [f.id for f in s.fixes]
    assert "measured: " in r.stdout and "faster with --apply loader.num_workers=" in r.stdout, r.stdout


def test_a_fix_that_does_nothing_reads_no_detectable_difference(tmp_path):
    # Pinned memory needs an accelerator: on this CPU machine --apply records it as not applied, so both arms run
    # the same program. The ground truth is "no difference".
    summary = RunSummary(fixes=[fix("loader.pin_memory")])
    target = script_target(script("slow_loader.py"), ["--sample-ms", "1", "--num-workers", "2"])
    chosen = plan(summary.fixes, top=1, allow_numerics=False)
    with scripts_here():
        result = verify(target, summary, chosen, Settings(repeats=3, steps=15, warmup=3), budget_s=None, log=print)
    assert result is not None
    measured = summary.fixes[0].measured
    # Sleep-bound steps vary so little that a change of load between interleaved runs (other tests) can read as a
    # real, small difference: any other verdict must keep the whole interval within 5% of 1.
    if measured["verdict"] == NO_DIFFERENCE:
        assert measured["ci_low"] <= 1 <= measured["ci_high"], measured
    else:
        assert measured["ci_low"] >= 0.95 and measured["ci_high"] <= 1.05, (measured, summary.notes)


def test_the_budget_stops_runs_that_would_end_past_it(tmp_path):
    summary = RunSummary(fixes=[fix("debug.anomaly")])
    target = script_target(script("ab_sleep.py"), [])
    chosen = plan(summary.fixes, top=1, allow_numerics=False)
    result = verify(target, summary, chosen, Settings(repeats=3, steps=5, warmup=1), budget_s=0.5, log=print)
    assert (
        result is not None
        and result.stopped is not None
        and "budget of 0.5 s ran out after 1 of 6 runs" in (result.stopped)
    ), result.stopped
    assert any("--verify: the budget of 0.5 s ran out" in note for note in summary.notes), summary.notes
    assert summary.fixes[0].measured["verdict"] == "unknown"  # no run of the fix: nothing to compare


def test_a_worker_fix_is_measured_after_its_prefetched_batches_are_drained():
    from stepscope.instrument.verify import queue_steps

    chosen = plan([fix("loader.num_workers", apply="loader.num_workers=8"), fix("debug.anomaly")], 2, False)
    applied = parse_fixes([arg for _, arg in chosen.chosen])
    assert queue_steps(applied) == 18  # 8 workers x 2 batches ahead, and 2 more
    assert queue_steps(parse_fixes(["debug.anomaly=off"])) == 0
