"""Trace capture on a real CUDA device: `stepscope run --trace --nvtx --nsys-window` and `Scope(profile=..., nvtx=...)`.

Skipped without a GPU. The run test uses tests/gpu_scripts/cuda_train.py: a TensorDataset collated on one CPU thread
feeds a model the GPU finishes quickly, so the trace shows a loader-bound step (on an H100: DataLoader ~4.4 ms per
step, ~61% of the step, the GPU idle for all of it).
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from stepscope import ProfileWindow, RunSummary, Scope, analyze_trace

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = Path(__file__).resolve().parent.parent


def trace_events(path: Path) -> list[dict]:
    raw = path.read_bytes()
    assert raw[:2] == b"\x1f\x8b", f"{path} is not gzip"
    return json.loads(gzip.decompress(raw))["traceEvents"]


def test_run_trace_nvtx_and_nsys_window_on_a_loader_bound_cuda_script(tmp_path):
    out, traces = tmp_path / "s.json", tmp_path / "traces"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("STEPSCOPE", None)
    script = ROOT / "tests" / "gpu_scripts" / "cuda_train.py"
    cmd = [
        sys.executable, "-m", "stepscope.cli", "run", "--warmup", "5", "--steps", "20", "--json", out,
        "--trace", traces, "--trace-window", "1:1:5", "--nvtx", "--nsys-window", "8:12", script,
    ]  # fmt: skip
    done = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "could not set up the trace capture" not in done.stderr, done.stderr  # NVTX and the Nsight window are on

    # step 5 measured (wait), 6 profiled and discarded, 7-11 recorded
    files = sorted(p.name for p in traces.iterdir())
    assert files == ["rank0.step7-11.pt.trace.json.gz"], (files, done.stderr)
    summary = RunSummary.from_json(out)
    assert summary.meta.timing == "cuda"
    assert summary.steps.measured == 20
    assert summary.steps.profiled == 6, summary.steps  # the window's warmup + active

    events = trace_events(traces / files[0])
    assert any(e.get("cat") == "kernel" for e in events), "no GPU kernels in the trace"
    ranges = {e["name"] for e in events if e.get("name", "").startswith("stepscope/")}
    assert {"stepscope/forward", "stepscope/backward", "stepscope/optimizer", "stepscope/h2d"} <= ranges, ranges

    analysis = analyze_trace(traces)
    (rank,) = analysis.ranks
    assert rank.rank == 0 and rank.device_type != "cpu", rank
    # 5 recorded; HTA's window drops the last when its kernels ran past the trace's end (the H100 runs of
    # 2026-11-23), and keeps it when they finished inside it (the H200 of 2026-11-27)
    assert rank.steps in (4, 5), rank.steps
    assert rank.kernel_span_ms is not None and rank.kernel_span_ms > 0
    assert rank.idle_pct + rank.compute_pct + rank.non_compute_pct == pytest.approx(100, abs=0.01)
    assert rank.top_kernels and any(k.type == "computation" for k in rank.top_kernels), rank.top_kernels
    for phase in ("forward", "backward", "optimizer", "h2d"):
        assert rank.phases_ms.get(phase, 0) > 0, rank.phases_ms
    assert rank.data_loading is not None and rank.data_loading.per_step_ms > 0, rank.data_loading
    assert rank.data_loading.gpu_idle_pct is not None
    assert rank.cpu is None  # GPU figures, not the CPU-only share
    assert rank.verdict.bound == "data", (rank.verdict, rank.data_loading, rank.idle_pct)

    # The profiled steps are left out of the per-step counts (one loss.item() a step) and the trace export out of the
    # measured step after the window (it would show as ~100 ms of "other" in one step).
    assert summary.counters["item_calls"] == pytest.approx(1.0), summary.counters
    total = summary.phases["total"]
    assert total.mean_ms < 2 * total.median_ms, total


def test_scope_profile_with_nvtx_and_nsys_window_times_cuda_phases(tmp_path):
    """The library path on CUDA: the phases are CUDA-event timed *and* profiler/NVTX ranges (_MarkedCudaPhase)."""
    torch.manual_seed(0)
    device = "cuda"
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 10)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = DataLoader(TensorDataset(torch.randn(1024, 256), torch.randint(0, 10, (1024,))), batch_size=64)
    scope = Scope(
        warmup=2,
        nvtx=True,
        nsys_window="3:6",
        profile=ProfileWindow(wait=1, warmup=1, active=2, dir=str(tmp_path)),
        system_interval_s=None,
    )
    for step, (x, y) in enumerate(scope.data(loader)):
        with scope.phase("h2d"):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with scope.phase("forward"):
            loss = nn.functional.cross_entropy(model(x), y)
        with scope.phase("backward"):
            loss.backward()
        with scope.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        scope.step(batch_size=64)
        if step == 11:
            break
    summary = scope.summary()
    scope.close()

    assert summary.meta.timing == "cuda"
    assert summary.steps.profiled == 3 and summary.steps.measured == 12 - 2 - 3, summary.steps
    assert summary.phases["forward"].device_mean_ms > 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["rank0.step4-5.pt.trace.json.gz"], files
    events = trace_events(tmp_path / files[0])
    assert any(e.get("cat") == "kernel" for e in events)
    (rank,) = analyze_trace(tmp_path).ranks
    assert {"data_wait", "h2d", "forward", "backward", "optimizer"} <= set(rank.phases_ms), rank.phases_ms
    assert rank.kernel_span_ms and rank.kernel_span_ms > 0
