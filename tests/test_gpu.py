"""Real CUDA-event timing. Skipped without a GPU; run on a GPU machine and record results in docs/gpu-validation.md."""

from __future__ import annotations

import time

import pytest
import torch

from stepscope import Scope

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _matmuls(a: torch.Tensor, repeats: int) -> torch.Tensor:
    out = a
    for _ in range(repeats):
        out = (out @ a).tanh_()
    return out


def _reference_ms(a: torch.Tensor, repeats: int) -> float:
    """GPU time of the same work, timed the ordinary way (events + a synchronize), median of 5."""
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _matmuls(a, repeats)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[2]


def test_device_time_matches_reference_and_no_sync_is_added(monkeypatch):
    a = torch.randn(4096, 4096, device="cuda")
    _matmuls(a, 2)
    torch.cuda.synchronize()
    reference = _reference_ms(a, 8)

    syncs = []
    real_sync = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kw: (syncs.append(1), real_sync(*args, **kw)))

    scope = Scope(warmup=2)  # auto: CUDA is initialised, so device events are used
    steps = 12
    t0 = time.perf_counter()
    for _ in range(steps):
        with scope.phase("forward"):
            _matmuls(a, 8)
        scope.step(batch_size=4096)
    host_loop_s = time.perf_counter() - t0
    assert syncs == [], "stepscope synchronised inside the loop"

    summary = scope.summary()
    assert len(syncs) <= 1  # summary() may wait once for events still in flight
    assert summary.meta.timing == "cuda"
    forward = summary.phases["forward"]
    assert forward.device_mean_ms == pytest.approx(reference, rel=0.2)
    # The host enqueued the work without waiting: its loop took far less than the GPU work it queued.
    assert host_loop_s * 1e3 < 0.5 * reference * steps
    assert forward.mean_ms < 0.5 * forward.device_mean_ms


def test_events_complete_later_and_are_harvested_without_blocking():
    a = torch.randn(2048, 2048, device="cuda")
    _matmuls(a, 2)  # cuBLAS's first call in a process (its handle, its heuristics) is no measured phase's work
    torch.cuda.synchronize()
    scope = Scope(warmup=0, timing="cuda", window=50)
    for _ in range(20):
        with scope.phase("forward"):
            _matmuls(a, 4)
        with scope.phase("backward"):
            _matmuls(a, 8)
        scope.step(batch_size=2048)
    # With an async GPU queue most steps are still pending here; the loop never waited for them.
    pending_at_end = scope._device.pending_steps
    summary = scope.summary()
    assert summary.steps.measured == 20
    assert summary.phases["forward"].device_mean_ms > 0
    # backward does twice the matmuls of forward
    ratio = summary.phases["backward"].device_mean_ms / summary.phases["forward"].device_mean_ms
    assert 1.6 < ratio < 2.4
    assert scope._device.pending_steps == 0
    assert pending_at_end >= 1


def test_metrics_report_gpu_compute_time_once_harvested():
    a = torch.randn(1024, 1024, device="cuda")
    scope = Scope(warmup=1, timing="cuda")
    for _ in range(6):
        with scope.phase("forward"):
            _matmuls(a, 4)
        scope.step(batch_size=8)
        torch.cuda.current_stream().synchronize()  # the user's own sync (e.g. loss.item()) lets events complete
    with scope.phase("forward"):
        _matmuls(a, 4)
    scope.step(batch_size=8)
    metrics = scope.metrics()
    assert metrics["perf/compute_time"] > 0
    assert metrics["perf/train_capacity"] > 0
