"""The program under `stepscope run` is the program without it, and stepscope says what it costs.

- Process state: the process-wide state a script can see or depend on is the same as in a plain run, except for
  stepscope's own named threads once torch is imported. Ground truth is the same script run plainly:
  tests/scripts/process_state.py prints its state before any import, after it sets OMP_NUM_THREADS=1 and imports
  numpy (OpenBLAS reads that variable when it loads and starts its thread pool then), and after it trains.
- Its own cost (``summary.overhead``), measured in the run: against a known cost injected into a hook handler (a
  sleep) and into a thread named as stepscope's (a busy loop of known CPU time).
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading
import time

import pytest
import torch
from run_helpers import AS_USERS_START, hooked, run_env, script, stepscope_cmd
from torch import nn

from stepscope.instrument.hooks import install
from stepscope.instrument.own_cost import overhead, threads_cpu_between
from stepscope.instrument.tracker import RunConfig, Tracker
from stepscope.report.terminal import print_summary
from stepscope.scope import enabled_scope
from stepscope.summary import RunSummary


def _states(command: list[str], tmp_path) -> dict[str, dict]:
    env = run_env(AS_USERS_START)  # the process as a user's starts: this is a test of its state
    env.pop("OMP_NUM_THREADS")  # the script sets it itself, after start-up
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    states = [json.loads(line[len("state ") :]) for line in done.stdout.splitlines() if line.startswith("state ")]
    assert [s["moment"] for s in states] == ["start", "numpy", "trained"], done.stdout + done.stderr
    return {s.pop("moment"): s for s in states}


def test_the_script_sees_the_process_it_would_see_without_stepscope(tmp_path):
    plain = _states([sys.executable, script("process_state.py")], tmp_path)
    json_path = tmp_path / "s.json"
    measured = _states(stepscope_cmd(json_path, "--no-stop", script("process_state.py"), warmup=2, steps=5), tmp_path)
    # Until the script imports torch, nothing: no module it did not import (numpy loaded by stepscope would have
    # started OpenBLAS's threads before the script's OMP_NUM_THREADS=1), no thread, no handler, no gc change.
    assert measured["start"] == plain["start"], (measured["start"], plain["start"])
    assert measured["numpy"] == plain["numpy"], (measured["numpy"], plain["numpy"])
    # Once it trains: stepscope's own threads, named, and its modules; the rest as without it.
    own = measured["trained"].pop("stepscope_threads")
    assert own and all(name.startswith("stepscope-") for name in own), own
    assert plain["trained"].pop("stepscope_threads") == []
    assert measured["trained"].pop("native_threads") == plain["trained"].pop("native_threads") + len(own)
    plain_modules = plain["trained"].pop("modules")
    assert set(measured["trained"].pop("modules")) - set(plain_modules) <= {"psutil", "stepscope.instrument.tracker"}
    assert measured["trained"] == plain["trained"], (measured["trained"], plain["trained"])
    # and it says what it cost: measured in the run, never nothing
    own = RunSummary.from_json(json_path).overhead
    assert own is not None and own.us_per_step > 0 and own.hooks_us_per_step > 0, own
    assert own.threads_us_per_step is not None and "measured in this run" in own.how, own


# -- its own cost, measured in the run ---------------------------------------------------------------------------

WARMUP, STEPS = 2, 10


def _train(tmp_path, during=None) -> RunSummary:
    """10 measured steps of a small model under stepscope's hooks in this process; ``during(i)`` runs in step i."""
    with hooked(tmp_path, WARMUP, STEPS) as tracker:
        model = nn.Linear(8, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(WARMUP + STEPS + 1):
            model(torch.randn(4, 8)).sum().backward()
            if during is not None:
                during(i)
            optimizer.step()
            optimizer.zero_grad()
    return tracker.summary()


def test_the_hooks_wrap_what_the_build_can_use_and_a_backward_once(tmp_path):
    # Every .to() in the program passes through the copy hook (clipping makes one per gradient, ~20 a step here), for
    # copies to a device that a CPU-only build cannot make: it has none. loss.backward() calls
    # torch.autograd.backward, so one wrapper times both entry points and a backward pays for one event.
    originals = {name: getattr(torch.Tensor, name) for name in ("to", "cuda", "backward")}
    summary = _train(tmp_path, during=lambda i: None)
    assert {name: getattr(torch.Tensor, name) for name in originals} == originals  # all put back
    assert summary.counters["backward_calls"] == pytest.approx(1.0), summary.counters
    assert summary.phases["backward"].mean_ms > 0
    scope = enabled_scope(warmup=0, system_interval_s=None)
    tracker = Tracker(scope, RunConfig(out_dir=str(tmp_path), warmup=0, steps=STEPS))
    undo = install(tracker)
    try:
        assert torch.Tensor.backward is originals["backward"]
        copies_hooked = torch.Tensor.to is not originals["to"] and torch.Tensor.cuda is not originals["cuda"]
        device_build = bool(torch.version.cuda or torch.version.hip or torch.backends.mps.is_built())
        assert copies_hooked == tracker.watch_copies == device_build, (copies_hooked, device_build)
    finally:
        undo()


def test_a_handler_that_takes_2_ms_is_2_ms_of_its_cost_a_step(tmp_path, monkeypatch):
    # The eval detector's training mark sleeps 2 ms inside each handler that calls it: stepscope's own time,
    # whatever phase the step's accounting gives it.
    from stepscope.instrument.evaluation import EvalDetector

    original = EvalDetector.training
    slept_s: list[float] = []

    def slow(self, tracker, now):
        start = time.perf_counter()
        time.sleep(0.002)
        slept_s.append(time.perf_counter() - start)
        return original(self, tracker, now)

    monkeypatch.setattr(EvalDetector, "training", slow)
    summary = _train(tmp_path)
    own = summary.overhead
    assert summary.steps.measured == STEPS and own is not None
    # The training mark runs at the backward's and the optimizer step's start: 2 ms twice a step, and a sleep never
    # returns early. Beside busy loops each wake-up may wait milliseconds for a CPU (6.6 ms a step once), so the
    # upper bound is what the measured steps' sleeps took in this run, plus the handlers' own work.
    assert len(slept_s) == 2 * (WARMUP + STEPS), len(slept_s)
    slept_us = sum(slept_s[-2 * STEPS :]) / STEPS * 1e6
    assert 4000 <= own.hooks_us_per_step <= 1.5 * slept_us + 500, (own, slept_us)
    step_us = summary.throughput.step_time_ms * 1e3
    assert own.share == pytest.approx(own.us_per_step / step_us, rel=0.01), own
    assert 0.5 < own.share < 1.0, own  # the step is mostly that sleep


def test_a_stepscope_thread_burning_cpu_in_the_window_is_counted(tmp_path):
    # A thread named as stepscope's burns ~60 ms of CPU during the measured steps (it starts in the first one and
    # the last step waits for it), then waits, as stepscope's samplers live as long as the run: at least that much
    # of its cost, a step's share of it. (A thread that ends inside the window loses its time since the window
    # began: stepscope's own do not.)
    burned, release = threading.Event(), threading.Event()

    def burn():
        end = time.thread_time() + 0.06
        while time.thread_time() < end:
            pass
        burned.set()
        release.wait(60)

    def during(i):
        if i == WARMUP:
            threading.Thread(target=burn, name="stepscope-test-burner", daemon=True).start()
        if i == WARMUP + STEPS - 1:
            assert burned.wait(30)

    try:
        own = _train(tmp_path, during).overhead
    finally:
        release.set()
    assert own is not None and own.threads_us_per_step is not None, own
    assert own.threads_us_per_step * STEPS >= 0.9 * 60_000, own  # schedstat counts the thread's CPU exactly
    assert own.us_per_step == pytest.approx(own.hooks_us_per_step + own.threads_us_per_step, abs=0.02)


def test_threads_that_started_or_ended_in_the_window():
    assert threads_cpu_between({1: 100, 2: 50}, {1: 400, 3: 70}) == 300 + 70  # thread 2 ended: its tail is lost
    assert threads_cpu_between(None, {1: 5}) is None
    assert overhead(0, None, 0, 10.0) is None
    own = overhead(hook_ns=40_000, threads_ns=None, steps=2, step_ms=4.0)
    assert (own.us_per_step, own.share, own.threads_us_per_step) == (20.0, 0.005, None)
    assert "not measured here" in own.how


def test_the_terminal_shows_its_cost_only_above_1_percent_of_the_step():
    def printed(share: float) -> str:
        summary = RunSummary()
        summary.overhead = overhead(hook_ns=int(share * 4_000_000), threads_ns=0, steps=1, step_ms=4.0)
        text = io.StringIO()
        print_summary(summary, file=text)
        return text.getvalue()

    assert "stepscope's own cost" not in printed(0.009)
    assert "stepscope's own cost: 80 µs a step (2.0% of the step, measured in the run)" in printed(0.02)
