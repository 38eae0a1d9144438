"""The program under `stepscope run` is the program without it: the process-wide state a script can see or depend
on is the same as in a plain run, except for stepscope's own named threads once torch is imported.

Ground truth is the same script run plainly: tests/scripts/process_state.py prints its state before any import,
after it sets OMP_NUM_THREADS=1 and imports numpy (OpenBLAS reads that variable when it loads and starts its
thread pool then), and after it imports torch and trains.
"""

from __future__ import annotations

import json
import subprocess
import sys

from run_helpers import run_env, script, stepscope_cmd


def _states(command: list[str], tmp_path) -> dict[str, dict]:
    env = run_env()
    env.pop("OMP_NUM_THREADS")  # the script sets it itself, after start-up
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    states = [json.loads(line[len("state ") :]) for line in done.stdout.splitlines() if line.startswith("state ")]
    assert [s["moment"] for s in states] == ["start", "numpy", "trained"], done.stdout + done.stderr
    return {s.pop("moment"): s for s in states}


def test_the_script_sees_the_process_it_would_see_without_stepscope(tmp_path):
    plain = _states([sys.executable, script("process_state.py")], tmp_path)
    measured = _states(stepscope_cmd(None, "--no-stop", script("process_state.py"), warmup=2, steps=5), tmp_path)
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
