"""Commands that run the script many times (ab, doctor --verify) stop when asked, end a hanging run, and leave
no process behind. Real processes throughout: stepscope as a subprocess, each run a real command
(tests/scripts/stubborn.py, no torch) that records its signal dispositions and its pids."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import psutil
import pytest
from run_helpers import SCRIPTS, run_env, terminal_signals

from stepscope.summary import RunSummary

STUBBORN = SCRIPTS / "stubborn.py"
SIGINT_BIT, SIGTERM_BIT = 1 << (signal.SIGINT - 1), 1 << (signal.SIGTERM - 1)


def _start_ab(tmp_path: Path, *variants: str, extra: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "stepscope.cli", "ab", "--json", str(tmp_path / "ab.json"), "--repeats", "2"]
    cmd += ["--steps", "5", "--warmup", "1", *extra]
    for variant in variants:
        cmd += ["--variant", variant]
    return subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=run_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=terminal_signals,
    )


def _wait_for(path: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)
    time.sleep(0.2)  # the run is now sleeping


def _pids(folder: Path) -> list[int]:
    return [int(pid) for path in folder.glob("run-*.pids") for pid in path.read_text().split()]


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            continue
    return alive


def _ignored(folder: Path, run: int) -> int:
    return int((folder / f"run-{run}.status").read_text().split()[1], 16)


def test_every_run_starts_with_sigint_and_sigterm_at_their_defaults(tmp_path):
    # Before, stepscope ignored both signals once a run had ended, and every later run inherited that: run 2's
    # command could be stopped by neither.
    runs = tmp_path / "runs"
    runs.mkdir()
    ab = _start_ab(tmp_path, f"a=python {STUBBORN} {runs}", f"b=python {STUBBORN} {runs}")
    _out, err = ab.communicate(timeout=120)
    assert len(list(runs.glob("run-*.status"))) == 4, err
    for run in (1, 2, 3, 4):
        assert _ignored(runs, run) & (SIGINT_BIT | SIGTERM_BIT) == 0, (run, hex(_ignored(runs, run)), err)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_a_later_run_stops_ab_with_its_code_and_no_process_left(tmp_path, signum):
    runs = tmp_path / "runs"
    runs.mkdir()
    quick = f"a=python {STUBBORN} {runs}"
    slow = f"b=python {STUBBORN} {runs} --sleep-s 600 --grandchild"
    ab = _start_ab(tmp_path, quick, slow)
    _wait_for(runs / "run-2.pids")
    started = time.monotonic()
    ab.send_signal(signum)
    _out, err = ab.communicate(timeout=30)
    assert time.monotonic() - started < 10, err
    assert ab.returncode == 128 + signum, (ab.returncode, err)
    assert _alive(_pids(runs)) == [], err  # the run and its own child are gone
    assert not (runs / "run-3.status").exists(), "no run starts after the signal"
    data = orjson.loads((tmp_path / "ab.json").read_bytes())
    assert data["stopped"] and "compared what ran" in data["stopped"], data["stopped"]


def test_a_second_ctrl_c_kills_a_run_that_ignores_the_first(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    ab = _start_ab(tmp_path, f"a=python {STUBBORN} {runs} --sleep-s 600 --ignore-int", f"b=python {STUBBORN} {runs}")
    _wait_for(runs / "run-1.pids")
    ab.send_signal(signal.SIGINT)
    time.sleep(1.0)
    assert ab.poll() is None, "the run ignores SIGINT: the first Ctrl-C cannot end it"
    ab.send_signal(signal.SIGINT)
    _out, err = ab.communicate(timeout=15)
    assert ab.returncode == 130, (ab.returncode, err)
    assert _alive(_pids(runs)) == [], err


def test_a_hanging_run_is_ended_with_its_tree_left_out_and_the_ab_goes_on(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    quick = f"a=python {STUBBORN} {runs}"
    hangs = f"b=python {STUBBORN} {runs} --sleep-s 600 --grandchild"
    ab = _start_ab(tmp_path, quick, hangs, extra=("--run-timeout-s", "3"))
    _out, err = ab.communicate(timeout=120)
    assert len(list(runs.glob("run-*.status"))) == 4, err  # the A/B went on past each hanging run
    assert _alive(_pids(runs)) == [], err
    data = orjson.loads((tmp_path / "ab.json").read_bytes())
    hung = data["variants"][1]["runs"]
    assert [r["exit_reason"] for r in hung] == ["timeout", "timeout"], hung
    assert all("3 s time limit" in r["failure"] for r in hung), hung
    assert "time limit" in err, err


def _doctor_verify(tmp_path: Path, steps: int, verb: str = "doctor") -> tuple[subprocess.Popen[str], Path]:
    """``stepscope doctor --verify 1`` (or ``tune``) of verify_stubborn.py, whose runs record themselves in the
    returned folder."""
    runs = tmp_path / "runs"
    runs.mkdir()
    cmd = [sys.executable, "-m", "stepscope.cli", verb, "--json", str(tmp_path / "s.json"), "--steps", str(steps)]
    cmd += ["--warmup", "1", "--ceiling-batches", "0", "--verify", "1"] if verb == "doctor" else []
    cmd += [str(SCRIPTS / "verify_stubborn.py"), str(runs)]
    doctor = subprocess.Popen(
        cmd, cwd=tmp_path, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=terminal_signals,
    )  # fmt: skip
    return doctor, runs


@pytest.mark.parametrize(("stopped", "code"), [("doctor", 143), ("script", 130)])
def test_a_stop_during_the_doctors_own_run_starts_no_verify_run(tmp_path, stopped, code):
    # SIGTERM to the doctor, or Ctrl-C at a terminal (which reaches the script alone, stepscope ignoring its own
    # copy): the doctor reports the run it measured and starts none of --verify's.
    doctor, runs = _doctor_verify(tmp_path, steps=100_000)
    try:
        _wait_for(runs / "run-1.pids", timeout_s=120)
        time.sleep(1.0)  # steps measured
        if stopped == "doctor":
            doctor.send_signal(signal.SIGTERM)
        else:
            os.kill(_pids(runs)[0], signal.SIGINT)
        _out, err = doctor.communicate(timeout=60)
    finally:
        if doctor.poll() is None:
            doctor.kill()
            doctor.wait()
    assert doctor.returncode == code, (doctor.returncode, err)
    assert not (runs / "run-2.pids").exists(), err
    summary = RunSummary.from_json(tmp_path / "s.json")
    assert "--verify: nothing was measured: the run was stopped before it." in summary.notes, summary.notes
    # the script's Ctrl-C traceback ends at its own line, as without stepscope (whose handler raised it)
    assert "_on_sigint" not in err, err


@pytest.mark.parametrize("verb", ["doctor", "tune"])
def test_doctor_verify_and_tune_stop_on_sigterm_during_their_runs(tmp_path, verb):
    # The doctor's own run, then --verify's (or tune's) interleaved runs of the baseline and a setting: a SIGTERM
    # during the second of those ends the command within 10 s, with no process left.
    doctor, runs = _doctor_verify(tmp_path, steps=5, verb=verb)
    _wait_for(runs / "run-3.pids", timeout_s=120)  # the doctor's run, then verify's runs 1 and 2
    started = time.monotonic()
    doctor.send_signal(signal.SIGTERM)
    _out, err = doctor.communicate(timeout=30)
    assert time.monotonic() - started < 10, err
    assert doctor.returncode == 143, (doctor.returncode, err)
    assert _alive(_pids(runs)) == [], err
    assert not (runs / "run-4.status").exists(), err
