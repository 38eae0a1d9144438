"""The stepscope command."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import stepscope
from stepscope import Scope
from stepscope.cli import main

SRC = Path(stepscope.__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def no_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)


@pytest.fixture
def summary_path(tmp_path, clock):
    """A summary written by a real Scope run: 4 measured steps of data 3 ms, forward 12 ms, backward 24 ms."""
    scope = Scope(clock=clock, warmup=1, timing="host")
    for _ in range(5):
        with scope.phase("data_wait"):
            clock.advance(3)
        with scope.phase("forward"):
            clock.advance(12)
        with scope.phase("backward"):
            clock.advance(24)
        clock.advance(1)
        scope.step(batch_size=10)
    path = tmp_path / "run.json"
    scope.summary().to_json(path)
    return path


def line_of(text, name):
    return next(line for line in text.splitlines() if line.split()[:1] == [name])


def test_show_prints_the_phase_table(summary_path, capsys):
    assert main(["show", str(summary_path)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert line_of(out, "data_wait").split() == ["data_wait", "3.000", "3.000", "3.000", "7.5%"]
    assert line_of(out, "forward").split() == ["forward", "12.0", "12.0", "12.0", "30.0%"]
    assert line_of(out, "backward").split() == ["backward", "24.0", "24.0", "24.0", "60.0%"]
    assert line_of(out, "other").split() == ["other", "1.000", "1.000", "1.000", "2.5%"]
    assert line_of(out, "total").split() == ["total", "40.0", "40.0", "40.0", "100.0%"]
    assert "throughput: 25.00 steps/s, 250.0 samples/s over 4 measured steps (warm-up 1)" in out
    assert "bound: compute [confidence high] (forward is 30% of the step" in out  # Scope.summary() decided it


def test_show_prints_a_doctor_summary_with_its_fixes(summary_path, capsys):
    from stepscope.doctor.checkup import examine
    from stepscope.doctor.lint import LintHit
    from stepscope.summary import RunSummary

    summary = RunSummary.from_json(summary_path)
    examine(summary, [LintHit("anomaly", 3, "torch.autograd.set_detect_anomaly(True)")])
    summary.to_json(summary_path)
    assert main(["show", str(summary_path)]) == 0
    out, _ = capsys.readouterr()
    assert "verdict: compute (confidence high)" in out
    assert "1. Turn off autograd anomaly detection [debug.anomaly · config · ≤ 90% of step time]" in out
    assert "seen: line 3: torch.autograd.set_detect_anomaly(True)" in out


def test_show_missing_file(capsys):
    assert main(["show", "missing.json"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("stepscope: no summary file at")
    assert "missing.json" in err


def test_show_invalid_json(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text("not json")
    assert main(["show", str(path)]) == 2
    assert "is not valid JSON" in capsys.readouterr().err


def test_show_newer_schema(tmp_path, capsys):
    path = tmp_path / "future.json"
    path.write_text('{"schema_version": 99}')
    assert main(["show", str(path)]) == 2
    assert "upgrade stepscope" in capsys.readouterr().err


def test_no_command_prints_help_and_returns_2(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    assert "usage: stepscope" in out
    assert "show" in out


def test_show_without_a_path_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["show"])
    assert info.value.code == 2
    assert "usage" in capsys.readouterr().err


def run_module(*args):
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.run(
        [sys.executable, "-m", "stepscope.cli", *args], capture_output=True, text=True, env=env, timeout=60
    )


def test_version_subprocess():
    result = run_module("--version")
    assert result.returncode == 0
    assert result.stdout == f"stepscope {stepscope.__version__}\n"
    assert stepscope.__version__ == "0.1.0"


def test_module_exit_code_for_missing_file_subprocess(tmp_path):
    result = run_module("show", str(tmp_path / "absent.json"))
    assert result.returncode == 2
    assert result.stderr.startswith("stepscope: no summary file at")
