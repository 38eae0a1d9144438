"""Model FLOPs and MFU: a Linear layer's known count, the peak table, and the figures in Scope and `run`."""

from __future__ import annotations

import pytest
import torch
from run_helpers import script, stepscope_here

from stepscope import Scope
from stepscope.analyses.flops import count_flops, gpu_peak, peak_tflops, training_dtype

M, K, N = 16, 64, 32  # batch, in features, out features


def test_a_linear_layer_counts_2mnk_forward_and_2mnk_for_the_weight_gradient():
    layer = torch.nn.Linear(K, N)
    x = torch.randn(M, K)
    assert count_flops(lambda: layer(x).sum().backward()) == 4 * M * N * K
    x.requires_grad_(True)  # the input's gradient is one more matmul
    assert count_flops(lambda: layer(x).sum().backward()) == 6 * M * N * K


@pytest.mark.parametrize(
    ("name", "dtype", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", "bfloat16", 989.4),
        ("NVIDIA H100 PCIe", "bfloat16", 756.0),
        ("NVIDIA H200", "tf32", 494.7),
        ("NVIDIA A100-SXM4-80GB", "float32", 19.5),
        ("NVIDIA L4", "float16", 121.0),
        ("NVIDIA L40S", "bfloat16", 362.1),
        ("Tesla V100-SXM2-16GB", "bfloat16", None),  # no bf16 tensor cores
        ("Some Future GPU", "bfloat16", None),
    ],
)
def test_peak_table(name, dtype, peak):
    assert peak_tflops(name, dtype) == peak


def test_training_dtype_prefers_autocast_then_parameters_and_tf32():
    assert training_dtype({"autocast": {"cuda": "bfloat16"}, "models": [{"dtypes": {"float32": 4}}]}) == "bfloat16"
    fp32 = {"models": [{"dtypes": {"float32": 4}}], "torch": {"matmul_precision": "highest"}}
    assert training_dtype(fp32) == "float32"
    assert training_dtype({**fp32, "torch": {"matmul_precision": "high"}}) == "tf32"
    assert training_dtype({}) is None


def test_gpu_peak_and_the_figures_against_it(clock):
    peak, label = gpu_peak("NVIDIA H100 80GB HBM3", "bfloat16")
    assert label == "NVIDIA H100 80GB HBM3 bfloat16 dense 989.4 TFLOP/s"
    assert gpu_peak(None, "float32") is None and gpu_peak("NVIDIA H100 80GB HBM3", None) is None
    for peak_used, tflops, mfu in ((peak, 494.7 * 0.1 / 0.2, 0.25), (None, 494.7 * 0.1 / 0.2, None)):
        scope = Scope(
            clock=clock, warmup=0, flops_per_step=int(494.7e12 * 0.1), peak_tflops=peak_used, system_interval_s=None
        )
        for _ in range(2):
            with scope.phase("forward"):
                clock.advance(200)
            scope.step()
        throughput = scope.summary().throughput
        assert throughput.tflops == pytest.approx(tflops)
        assert throughput.mfu == (None if mfu is None else pytest.approx(mfu))


def test_scope_reports_tflops_and_mfu(clock):
    scope = Scope(clock=clock, warmup=0, flops_per_step=4 * 10**12, peak_tflops=100.0, system_interval_s=None)
    for _ in range(3):
        with scope.phase("forward"):
            clock.advance(200)  # 0.2 s steps: 20 TFLOP/s
        scope.step()
    assert scope.metrics()["perf/tflops"] == pytest.approx(20.0)
    assert scope.metrics()["perf/mfu"] == pytest.approx(0.2)
    throughput = scope.summary().throughput
    assert throughput.tflops == pytest.approx(20.0) and throughput.mfu == pytest.approx(0.2)


def test_run_counts_the_model_flops_in_a_warm_up_step(tmp_path):
    r = stepscope_here(tmp_path, script("doctor_item.py"), warmup=3, steps=10)
    assert r.returncode == 0, r.describe()
    t = r.summary.throughput
    # doctor_item: Linear(256, 1024) -> ReLU -> Linear(1024, 4) on a batch of 512, inputs without gradients:
    # forward 2·512·(256·1024 + 1024·4); backward: both weight gradients, and the hidden activation's gradient.
    forward = 2 * 512 * (256 * 1024 + 1024 * 4)
    backward = 2 * 512 * (256 * 1024 + 1024 * 4) + 2 * 512 * 1024 * 4
    assert t.flops_per_step == forward + backward
    assert t.tflops == pytest.approx(t.flops_per_step / (t.step_time_ms / 1e3) / 1e12)
    assert t.mfu is None  # a CPU: no peak to compare with
    assert "GFLOP/s model" in r.stdout
