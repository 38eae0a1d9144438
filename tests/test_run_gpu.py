"""`stepscope run` on a real CUDA script. Skipped without a GPU; results go to docs/gpu-validation.md."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stepscope import RunSummary

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = Path(__file__).resolve().parent.parent


def test_run_times_a_cuda_script_with_events_h2d_and_syncs(tmp_path):
    out = tmp_path / "s.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    script = ROOT / "tests" / "gpu_scripts" / "cuda_train.py"
    cmd = [sys.executable, "-m", "stepscope.cli", "run", "--warmup", "5", "--steps", "30", "--json", str(out), script]
    done = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    summary = RunSummary.from_json(out)
    assert summary.meta.timing == "cuda"
    assert summary.steps.measured == 30
    phases = summary.phases
    for name in ("data_wait", "h2d", "forward", "backward", "optimizer", "sync"):
        assert name in phases, name
    # Every phase launched on the GPU has device time; the GPU work of the step is mostly backward + forward.
    assert phases["forward"].device_mean_ms > 0
    assert phases["backward"].device_mean_ms > phases["forward"].device_mean_ms * 0.8
    # One loss.item() per step: one host sync, where the host waits for the step's GPU work.
    assert summary.counters["host_syncs"] == pytest.approx(1.0)
    assert summary.counters["item_calls"] == pytest.approx(1.0)
    assert phases["sync"].mean_ms > phases["forward"].mean_ms
    assert summary.throughput.samples_per_s == pytest.approx(256 * summary.throughput.steps_per_s, rel=0.01)
    assert summary.verdict.bound != "unknown"
