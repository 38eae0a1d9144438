"""PipelineMonitor linked to a CUDA-timed Scope, with engines producing on the GPU. Skipped without a GPU.

Engine threads run real matmuls on their own CUDA streams and put the outputs in a pool; the trainer trains on
them. The monitor must name the side made slow on purpose, while the Scope times phases with CUDA events.
"""

from __future__ import annotations

import queue
import threading
import time

import pytest
import torch

from stepscope import PipelineMonitor, Scope

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def run_pipeline(engine_s: float, train_repeats: int, seconds: float = 4.0):
    """Two engine threads (each call: GPU matmuls, then ``engine_s`` of host latency) feeding a trainer whose step
    runs ``train_repeats`` 2048² matmuls. Returns the summary of the linked Scope."""
    scope = Scope(warmup=5, system_interval_s=None)
    mon = PipelineMonitor(slots=2, window_s=2.0, scope=scope)
    pool: queue.Queue = queue.Queue()
    stop = threading.Event()
    weight = torch.randn(256, 256, device="cuda")

    def engine() -> None:
        stream = torch.cuda.Stream()
        while not stop.is_set():
            with mon.infer(batch_size=32), torch.cuda.stream(stream):
                out = torch.tanh(torch.randn(32, 256, device="cuda") @ weight)
                stream.synchronize()  # the engine hands over finished outputs, as a serving engine does
                time.sleep(engine_s)
            pool.put(out)
            mon.pool_put(32)

    threads = [threading.Thread(target=engine, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    model = torch.nn.Linear(256, 256, device="cuda")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    big = torch.randn(2048, 2048, device="cuda")
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        with scope.phase("data_wait"), mon.dispatch_wait():
            batch = pool.get()
        mon.pool_take(32)
        with scope.phase("forward"):
            loss = model(batch).square().mean()
            work = big
            for _ in range(train_repeats):
                work = (work @ big).tanh_()
            loss = loss + work.mean() * 0
        with scope.phase("backward"):
            loss.backward()
        with scope.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad()
        scope.step(batch_size=32)
    stop.set()
    for thread in threads:
        thread.join()
    return scope.summary()


def test_slow_engines_make_a_cuda_trainer_inference_bound():
    summary = run_pipeline(engine_s=0.05, train_repeats=1)
    assert summary.meta.timing == "cuda"
    pipeline = summary.pipeline
    assert pipeline["bottleneck"] == "inference" and summary.verdict.bound == "inference"
    # 2 slots x 32 samples per call of >= 50 ms: at most 1,280 samples/s.
    assert 800 < pipeline["infer_capacity"] <= 1280
    assert pipeline["train_capacity"] > 2 * pipeline["infer_capacity"]


def test_heavy_steps_make_a_cuda_trainer_training_bound_on_compute():
    summary = run_pipeline(engine_s=0.001, train_repeats=200)
    pipeline = summary.pipeline
    assert pipeline["bottleneck"] == "training" and pipeline["training_side"] == "compute"
    assert pipeline["pool_trend"] > 0
    assert summary.phases["forward"].device_mean_ms is not None
