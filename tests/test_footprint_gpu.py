"""stepscope's footprint on a real CUDA step (issues 25 and 27): the loss is kept on the device and read once at the
end, nothing stepscope does makes the host wait for the GPU inside a measured step, its own cost is reported, and
`tune --allow-numerics` keeps a numerics setting with the loss of the same steps side by side.

Skipped without a GPU. tests/gpu_scripts/verify_matmul.py at batch 4096 never syncs; its GPU work (~14 ms a step of
float32 matmuls on an H200) dwarfs the host's, so a sync stepscope added would make host steps as long as the GPU's.
Figures: docs/gpu-validation.md.
"""

from __future__ import annotations

import gzip
import json
import math
import time

import pytest
import torch
from run_helpers import REPO, stepscope_run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
GPU_SCRIPTS = REPO / "tests" / "gpu_scripts"
# 2 + 10 steps of ~40 queued kernels and events stay under CUDA's ~1,024-entry launch queue, past which a launch
# blocks and the host would wait for the GPU through no fault of stepscope's.
WARMUP, STEPS = 2, 10
NO_SYNC = {"MATMUL_BATCH": "4096"}


def _reference_ms_per_step(steps: int = 10) -> float:
    """The script's step timed the ordinary way: the same model and batch, a synchronize before and after."""
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    layers = [nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 16)]
    model = nn.Sequential(*layers).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(4096, 4096, device="cuda"), torch.randint(0, 16, (4096,), device="cuda")
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3 / steps)
    return sorted(times)[1]


def test_a_loop_that_never_syncs_is_timed_at_the_gpus_pace_and_its_loss_read_at_the_end(tmp_path):
    r = stepscope_run(
        tmp_path, str(GPU_SCRIPTS / "verify_matmul.py"), warmup=WARMUP, steps=STEPS, timeout=300, env=NO_SYNC
    )
    assert r.returncode == 0, r.describe()
    s = r.summary
    print(r.stdout)
    reference_ms = _reference_ms_per_step()
    assert s.meta.timing == "cuda" and s.steps.measured == STEPS
    assert s.counters.get("host_syncs", 0) == 0 and s.counters.get("item_calls", 0) == 0, s.counters
    device_ms = sum(p.device_mean_ms or 0 for name, p in s.phases.items() if name != "total")
    host_ms, step_ms = s.phases["total"].mean_ms, s.throughput.step_time_ms
    print(f"host {host_ms:.3f} ms a step, GPU phases {device_ms:.3f} ms, step {step_ms:.3f} ms, "
          f"reference {reference_ms:.3f} ms; overhead {s.overhead}")  # fmt: skip
    assert host_ms < 0.5 * device_ms, (host_ms, device_ms)  # the host never waited for the GPU
    # The step is the GPU's pace, as a synchronised timer of the same work reads it, not the host's time to queue.
    assert step_ms == pytest.approx(reference_ms, rel=0.25), (step_ms, reference_ms)
    assert s.throughput.gpu_excess_ms is not None and any("ran ahead of the GPU" in n for n in s.notes), s.notes
    assert s.invariants == [], s.invariants
    assert s.verdict.bound == "compute", s.verdict
    assert s.loss is not None and s.loss.steps == list(range(STEPS)), s.loss
    assert all(v is not None and math.isfinite(v) and v > 0 for v in s.loss.values), s.loss
    assert s.loss.values[-1] < s.loss.values[0], s.loss  # the script's own losses, in step order
    # The hooks, on the loop's thread: 2.5% of the step on the H200 once the loss buffer was made in the warm-up, 20%
    # while its first add waited for the GPU. Its threads' CPU is reported, not bounded: in a 10-step window it is
    # the samplers' start (NVML read 10 times a second in the first second, ~4 ms a read), on other cores; 636 us a
    # step on the H200 on 2026-11-27, 4.6% of this step, once the window fell early in that second.
    assert s.overhead is not None and s.overhead.hooks_us_per_step is not None, s.overhead
    assert s.overhead.hooks_us_per_step / 1e3 < 0.05 * step_ms, s.overhead
    assert s.overhead.threads_us_per_step is not None, s.overhead


@pytest.mark.xfail(
    strict=True,
    reason="issue 27: on the H200 (2026-11-27) stepscope's hooks cost 351 us of a 3.7 ms CUDA step: ~150 us of event "
    "records, their harvest and the loss buffer's add, the rest the handlers' Python; docs/gpu-validation.md",
)
def test_own_cost_on_a_cuda_step(tmp_path):
    r = stepscope_run(
        tmp_path, str(REPO / "tests" / "gpu_scripts" / "cuda_train.py"), warmup=10, steps=100, timeout=300
    )
    assert r.returncode == 0, r.describe()
    s = r.summary
    print(f"step {s.throughput.step_time_ms:.3f} ms; overhead {s.overhead}")
    assert s.overhead is not None and s.overhead.share is not None and s.overhead.share < 0.05, s.overhead


def test_no_sync_lands_inside_a_measured_step_in_a_profiler_trace(tmp_path):
    traces = tmp_path / "traces"
    r = stepscope_run(
        tmp_path, "--trace", str(traces), "--trace-window", "1:1:3", str(GPU_SCRIPTS / "verify_matmul.py"),
        warmup=WARMUP, steps=STEPS, timeout=300, env=NO_SYNC,
    )  # fmt: skip
    assert r.returncode == 0, r.describe()
    (trace,) = traces.iterdir()
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    phases = [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name", "").startswith("stepscope/")]
    assert phases, "no stepscope phase ranges in the trace"
    syncs = [
        e for e in events
        if e.get("cat") == "cuda_runtime" and ("Synchronize" in e["name"] or e["name"].startswith("cudaMemcpy"))
    ]  # fmt: skip
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name", "").startswith("ProfilerStep#"))
    inside = [
        (e["name"], name, round(e["ts"] - steps[0][0]) if steps else None)
        for e in syncs
        for name, lo, hi in phases
        if lo <= e["ts"] < hi
    ]
    print(f"steps {[(round(lo - steps[0][0]), round(hi - lo)) for lo, hi in steps]}; syncs in phases {inside}")
    # The profiler's own start and stop may wait for the GPU at the window's edges; no step inside it may.
    middle = [(lo, hi) for lo, hi in steps[1:-1]]
    assert not [e for e in syncs if any(lo <= e["ts"] < hi for lo, hi in middle)], inside
    adds = [e["dur"] for e in events if e.get("name") == "aten::add_"]
    print(f"{len(syncs)} sync/copy runtime calls in the trace; in-place adds (the loss buffer's): {adds} us")


def test_tune_with_numerics_keeps_tf32_or_bf16_and_shows_the_loss_side_by_side(tmp_path):
    r = stepscope_run(
        tmp_path, "--allow-numerics", "--repeats", "2", "--budget-s", "400", str(GPU_SCRIPTS / "verify_matmul.py"),
        warmup=5, steps=20, verb="tune", timeout=500,
    )  # fmt: skip
    assert r.returncode == 0, r.describe()
    print(r.stdout)
    data = json.loads(r.json_path.read_text())  # --json is the tune's result
    best = data["best"]
    assert {"tf32", "precision.bf16"} & set(best["apply"]), data
    assert best["ci_low"] > 1.0, best
    loss = best["loss"]
    assert loss is not None and loss["numerics"], best
    assert len(loss["baseline"]) == len(loss["tuned"]) == len(loss["steps"]) > 0, loss
    assert loss["max_rel_diff"] is not None and loss["max_rel_diff"] < 0.05, loss  # same training, other rounding
