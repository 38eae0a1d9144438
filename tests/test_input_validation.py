"""Bad input is refused with a reason or ignored with one warning, never a traceback or a silently wrong figure
(issue 18: summaries with wrongly typed fields, a phase nested in itself, a Scope used from two threads, negative,
NaN and infinite batch sizes and sample counts)."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
import threading
from typing import Any

import numpy as np
import orjson
import pytest
from run_helpers import run_env
from test_summary import full_summary

from stepscope import PipelineMonitor, RunSummary, Scope, SummaryError
from stepscope.cli import main
from stepscope.scope import enabled_scope


def approx(value: float) -> Any:
    return pytest.approx(value, rel=1e-9, abs=1e-9)


# -- loading: every field of the schema has the type it says --------------------------------------------------------


def _set(path: str, value: Any):
    """An edit of a summary's JSON form that sets the field at ``path`` (dots and [i]) to ``value``."""

    def edit(data: dict[str, Any]) -> None:
        keys = [int(k) if k.isdigit() else k for k in path.replace("[", ".").replace("]", "").split(".")]
        target = data
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value

    return edit


def _with_cluster(data: dict[str, Any]) -> None:
    data["cluster"] = {"world_size": 2, "ranks_reported": [0, 1], "samples_per_s": 10.0,
                       "straggler": {"rank": "1", "phase": "forward", "excess_ms": 3.0}}  # fmt: skip


WRONG_TYPES = {
    "string for a number": (
        _set("phases.forward.mean_ms", "abc"),
        "phases.forward.mean_ms should be a number, got 'abc'",
    ),
    "string for an int": (_set("steps.measured", "3"), "steps.measured should be an integer, got '3'"),
    "bool for an int": (_set("steps.measured", True), "steps.measured should be an integer, got True"),
    "fraction for an int": (_set("meta.rank", 1.5), "meta.rank should be an integer, got 1.5"),
    "list for a number": (_set("throughput.samples_per_s", [1]), "throughput.samples_per_s should be a number"),
    "string for a list": (_set("verdict.evidence", "x"), "verdict.evidence should be a list, got 'x'"),
    "in a list item": (_set("fixes[0].gain_bound", "big"), "fixes[0].gain_bound should be a number, got 'big'"),
    "in a dict value": (_set("counters", {"host_syncs": "x"}), "counters.host_syncs should be a number, got 'x'"),
    "list item type": (_set("notes", [1]), "notes[0] should be a string, got 1"),
    "null where not allowed": (_set("phases.forward.share", None), "phases.forward.share should be a number, got None"),
    "list for an object": (_set("system", []), "system should be an object, got []"),
    "nested object": (_with_cluster, "cluster.straggler.rank should be an integer, got '1'"),
    "section not an object": (_set("steps", 5), "steps should be an object (Steps), got 5"),
}


@pytest.mark.parametrize(("edit", "message"), list(WRONG_TYPES.values()), ids=list(WRONG_TYPES))
def test_a_wrongly_typed_field_is_refused_naming_its_path(tmp_path, capsys, edit, message):
    data = full_summary().to_dict()
    edit(data)
    path = tmp_path / "bad.json"
    path.write_bytes(orjson.dumps(data))
    with pytest.raises(SummaryError) as caught:
        RunSummary.from_json(path)
    assert message in str(caught.value)
    assert str(path) in str(caught.value)
    assert main(["show", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err and message in err and err.count("\n") == 1, err


def test_a_rank_entry_is_checked_too():
    data = full_summary().to_dict()
    rank = full_summary().to_dict()
    rank["phases"]["forward"]["p95_ms"] = "slow"
    data["ranks"] = [full_summary().to_dict(), rank]
    with pytest.raises(SummaryError, match=r"x\.json \(rank entry 1\) .*phases\.forward\.p95_ms should be a number"):
        RunSummary.from_dict(data, source="x.json")


def test_json_numbers_load_as_the_field_types():
    data = full_summary().to_dict()
    data["phases"]["forward"]["mean_ms"] = 5  # an int where a float is expected
    data["steps"]["measured"] = 480.0  # JSON does not tell 480 from 480.0
    data["throughput"]["samples_per_s"] = None  # optional
    summary = RunSummary.from_dict(data)
    assert summary.phases["forward"].mean_ms == 5.0 and type(summary.phases["forward"].mean_ms) is float
    assert summary.steps.measured == 480 and type(summary.steps.measured) is int
    assert summary.throughput.samples_per_s is None
    assert RunSummary.from_dict(full_summary().to_dict()) == full_summary(), "a good summary loads unchanged"


def test_show_prints_a_pipeline_whose_pool_is_null(tmp_path, capsys):
    # what a summary saved after pool_put(nan) held before the monitor refused NaN
    data = full_summary().to_dict()
    data["pipeline"] = {"thru": None, "infer_capacity": 12.0, "pool": None, "bottleneck": "unknown"}
    data["trace"] = {}  # the fixture's trace section is partial
    path = tmp_path / "run.json"
    path.write_bytes(orjson.dumps(data))
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "pipeline: thru - · inference capacity 12.0/s" in out and "pool - ·" in out


# -- Scope: a phase entered while open counts once ------------------------------------------------------------------


def _scope(clock: Any) -> Scope:
    return Scope(clock=clock, warmup=0, timing="host", system_interval_s=None)


def test_a_phase_nested_in_itself_is_counted_once(clock):
    scope = _scope(clock)
    for _ in range(3):
        with scope.phase("forward"):
            clock.advance(2)
            with scope.phase("forward"):  # a model whose submodule is timed under the same name
                clock.advance(4)
                with scope.phase("forward"):
                    clock.advance(1)
            clock.advance(3)
        with scope.phase("backward"):
            clock.advance(10)
        scope.step(batch_size=8)
    phases = scope.summary().phases
    assert phases["forward"].mean_ms == approx(10) and phases["forward"].share == approx(0.5)
    assert phases["forward"].nested is False
    assert phases["backward"].share == approx(0.5)
    assert sum(p.share for name, p in phases.items() if name != "total" and not p.nested) == approx(1.0)


def test_a_phase_nested_in_itself_inside_another_phase_is_still_counted_once(clock):
    scope = _scope(clock)
    for _ in range(2):
        with scope.phase("forward"):
            clock.advance(1)
            with scope.phase("h2d"):
                clock.advance(2)
                with scope.phase("forward"):  # inside forward already: part of it
                    clock.advance(3)
        clock.advance(4)
        scope.step()
    phases = scope.summary().phases
    assert phases["forward"].mean_ms == approx(6) and phases["forward"].share == approx(0.6)
    assert phases["h2d"].mean_ms == approx(5) and phases["h2d"].nested is True
    assert phases["other"].share == approx(0.4)


# -- Scope: one thread is timed, another thread's calls are ignored with one warning ------------------------------


def _on_thread(work) -> None:
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()


def test_phases_and_steps_from_a_second_thread_are_ignored_with_one_warning(clock, caplog):
    scope = _scope(clock)

    def other_thread() -> None:
        for _ in range(2):
            with scope.phase("backward"):
                clock.advance(50)  # would overlap the loop's forward, had it run at the same time
            scope.step(batch_size=99)
        assert list(scope.data([1, 2, 3])) == [1, 2, 3]  # iterated untimed

    with caplog.at_level(logging.WARNING, logger="stepscope"):
        for _ in range(4):
            with scope.phase("forward"):
                clock.advance(10)
                _on_thread(other_thread)
            scope.step(batch_size=8)
    summary = scope.summary()
    assert summary.steps.measured == 4
    assert set(summary.phases) == {"forward", "other", "total"}, "the other thread's backward is not counted"
    # the other thread's 100 ms fell inside the loop's forward (one clock): in it, once, and only there
    assert summary.phases["forward"].mean_ms == approx(110) and summary.phases["forward"].share == approx(1.0)
    assert summary.throughput.samples_per_s == approx(8 / 0.110)  # the loop's 8 samples a step, none of the 99
    warnings = [r.message for r in caplog.records if "thread other than" in r.message]
    assert len(warnings) == 1, warnings
    assert any(note.startswith("ignored 20 call(s) like scope.phase() on a thread") for note in summary.notes)


def test_the_first_thread_to_use_a_scope_is_the_one_timed(clock):
    scope = _scope(clock)  # made here, used only on another thread (a trainer thread)

    def loop() -> None:
        for _ in range(3):
            with scope.phase("forward"):
                clock.advance(5)
            scope.step(batch_size=4)

    _on_thread(loop)
    summary = scope.summary()
    assert summary.phases["forward"].share == approx(1.0) and summary.steps.measured == 3
    assert not any("ignored" in note for note in summary.notes)


def test_stepscope_run_scope_counts_every_thread(clock):
    # `stepscope run`'s scope is driven by hooks; its tracker sorts threads out, so the scope does not refuse any
    scope = enabled_scope(clock=clock, warmup=0, timing="host", system_interval_s=None)
    with scope.phase("forward"):
        clock.advance(1)
    scope.step()

    def step() -> None:
        with scope.phase("forward"):
            clock.advance(5)
        scope.step(batch_size=2)

    _on_thread(step)
    summary = scope.summary()
    assert summary.steps.measured == 2 and summary.phases["forward"].mean_ms == approx(3)


# -- Scope.step(batch_size): a finite number >= 0 ------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-5, math.nan, math.inf, -math.inf, "32", True, [8]])
def test_a_bad_batch_size_is_dropped_with_one_warning(clock, caplog, bad):
    scope = _scope(clock)
    with caplog.at_level(logging.WARNING, logger="stepscope"):
        for batch in [8, bad, 8, bad, bad, 8, 8]:
            with scope.phase("forward"):
                clock.advance(10)
            scope.step(batch_size=batch)
    summary = scope.summary()
    # 7 steps of 10 ms, 4 of them with 8 samples: 32 samples in the 40 ms of the steps that know their size
    assert summary.throughput.samples_per_s == approx(32 / 0.040)
    assert summary.throughput.samples_per_s > 0
    warnings = [r.message for r in caplog.records if "batch size is a finite number" in r.message]
    assert len(warnings) == 1, warnings
    assert any(note.startswith("ignored 3 call(s) like scope.step(batch_size=") for note in summary.notes)
    text = summary.to_json()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))


@pytest.mark.parametrize("good", [0, 8.0, np.int64(8), np.float32(8.0)])
def test_valid_batch_sizes_are_kept(clock, good):
    scope = _scope(clock)
    for _ in range(3):
        with scope.phase("forward"):
            clock.advance(10)
        scope.step(batch_size=good)
    summary = scope.summary()
    assert summary.throughput.samples_per_s == approx(float(good) / 0.010)
    assert not any("ignored" in note for note in summary.notes)


# -- PipelineMonitor: counts and times are finite numbers >= 0 -------------------------------------------------------


class SecondsClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


BAD_CALLS = {
    "pool_put": lambda mon, bad: mon.pool_put(bad),
    "pool_take": lambda mon, bad: mon.pool_take(bad),
    "pool_level": lambda mon, bad: mon.pool_level(bad),
    "record_infer samples": lambda mon, bad: mon.record_infer(1.0, bad),
    "record_infer duration": lambda mon, bad: mon.record_infer(bad, 8),
    "train_step": lambda mon, bad: mon.train_step(bad, step_time=0.5),
    "train_step time": lambda mon, bad: mon.train_step(8, step_time=bad),
}


def _infer(mon: PipelineMonitor, bad: Any) -> None:
    with mon.infer(batch_size=bad):
        pass


BAD_CALLS["infer"] = _infer


@pytest.mark.parametrize("bad", [-5, math.nan, math.inf])
@pytest.mark.parametrize("call", list(BAD_CALLS.values()), ids=list(BAD_CALLS))
def test_monitor_ignores_bad_counts_with_one_warning(caplog, call, bad):
    clock = SecondsClock()
    mon = PipelineMonitor(slots=2, window_s=100.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="stepscope"):
        for _ in range(10):  # one second a round: 8 samples in, 8 out; a 1 s engine call of 8; a 0.5 s step
            clock.t += 1.0
            call(mon, bad)
            mon.pool_put(8)
            mon.record_infer(1.0, 8)
            mon.pool_take(8)
            mon.train_step(8, step_time=0.5)
            call(mon, bad)
    snap = mon.snapshot()
    assert snap.thru == approx(80 / 9)  # 80 taken over the 9 s since the first event
    assert snap.infer_capacity == approx(8 * 2)
    assert snap.train_capacity == approx(16)
    assert snap.pool == approx(0) and snap.samples_in == approx(80)
    warnings = [r.message for r in caplog.records if "ignored: sample counts and times" in r.message]
    assert len(warnings) == 1, warnings
    summary = json.dumps(mon.to_summary(), allow_nan=False)  # nothing non-finite reaches the summary
    assert "NaN" not in summary


# -- budget, wait and time options: finite, positive (or >= 0 where 0 means something) -------------------------------


BAD_OPTIONS = [
    (["doctor", "--verify-budget-s", "-1"], "--verify-budget-s: must be a finite number of seconds > 0, got '-1'"),
    (["doctor", "--verify-budget-s", "nan"], "--verify-budget-s: must be a finite number of seconds > 0, got 'nan'"),
    (["doctor", "--verify-budget-s", "inf"], "--verify-budget-s: must be a finite number of seconds > 0, got 'inf'"),
    (["doctor", "--verify-budget-s", "0"], "--verify-budget-s: must be a finite number of seconds > 0, got '0'"),
    (["doctor", "--sweep-budget-s", "1e400"], "--sweep-budget-s: must be a finite number of seconds > 0"),
    (["doctor", "--sweep-budget-s", "0"], "--sweep-budget-s: must be a finite number of seconds > 0"),
    (["dataloader", "--budget-s", "-1"], "--budget-s: must be a finite number of seconds > 0, got '-1'"),
    (["dataloader", "--budget-s", "NaN"], "--budget-s: must be a finite number of seconds > 0, got 'NaN'"),
    (["run", "--out-wait-s", "-5"], "--out-wait-s: must be a finite number of seconds >= 0, got '-5'"),
    (["run", "--out-wait-s", "1e999"], "--out-wait-s: must be a finite number of seconds >= 0, got '1e999'"),
    (["run", "--checkpoint-s", "0"], "--checkpoint-s: must be a finite number of seconds >= 1, got '0'"),
    (["run", "--checkpoint-s", "nan"], "--checkpoint-s: must be a finite number of seconds >= 1, got 'nan'"),
    (["run", "--out-wait-s", "١"], "--out-wait-s: must be a finite number of seconds >= 0, got '١'"),
    (["run", "--steps", "١٠"], "--steps: must be a whole number in digits 0-9, got '١٠'"),
    (["run", "--batch-size", "0"], "--batch-size: must be >= 1, got 0"),
    (["run", "--sample-hz", "nan"], "--sample-hz: must be 0 (off) or in (0, 20] Hz"),
    (["doctor", "--stack-hz", "2000"], "--stack-hz: must be 0 (off) or in (0, 1000] Hz, got 2000"),
    (["dump", "--interval-s", "0", "1"], "--interval-s: must be a finite number of seconds > 0, got '0'"),
    (["dump", "--interval-s", "-0.5", "1"], "--interval-s: must be a finite number of seconds > 0, got '-0.5'"),
]


@pytest.mark.parametrize(("argv", "said"), BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS])
def test_a_budget_wait_or_time_option_refuses_nonsense(argv, said, capsys):
    with pytest.raises(SystemExit) as info:
        main([*argv, "train.py"] if argv[0] != "dump" else argv)
    assert info.value.code == 2
    assert said in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["ab", "--fail-if-slower", "nan", "--variant", "a=python x.py", "--variant", "b=python x.py"],
        ["ab", "--fail-if-slower", "inf", "--variant", "a=python x.py", "--variant", "b=python x.py"],
    ],
)
def test_fail_if_slower_refuses_nan_and_infinity(argv, capsys):
    assert main(argv) == 2
    assert "--fail-if-slower must be a finite percentage >= 0" in capsys.readouterr().err


def test_sensible_values_still_parse():
    from stepscope.cli import build_parser

    args = build_parser().parse_args(["run", "--out-wait-s", "0", "--checkpoint-s", "1.5"])
    assert (args.out_wait_s, args.checkpoint_s) == (0.0, 1.5)
    args = build_parser().parse_args(["doctor", "--verify-budget-s", "0.5", "--sweep-budget-s", "1e3"])
    assert (args.verify_budget_s, args.sweep_budget_s) == (0.5, 1000.0)


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--out-wait-s", "-5"],
        ["doctor", "--verify", "1", "--verify-budget-s", "nan"],
        ["dataloader", "--budget-s", "-1"],
    ],
)
def test_a_bad_time_option_stops_before_the_script_runs(tmp_path, argv):
    marker = tmp_path / "ran"
    train = tmp_path / "train.py"
    train.write_text(f"open({str(marker)!r}, 'w').close()\n")
    cmd = [sys.executable, "-m", "stepscope", *argv, str(train)]
    result = subprocess.run(cmd, cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"argument {argv[-2]}: must be a finite number of seconds" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not marker.exists()
