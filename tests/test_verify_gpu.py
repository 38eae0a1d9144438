"""`doctor --verify` on a real CUDA device: the GPU knobs the doctor names are applied and measured.

Skipped without a GPU. A float32 matmul-bound MLP with TF32 off must verify `tf32` and, with --allow-numerics,
`precision.bf16` (bf16 autocast) as faster; a conv net with cudnn.benchmark off and a fixed shape must verify
`cudnn.benchmark` as no slower (cuDNN's heuristic is often already the fastest algorithm: a gain is measured where
it is not). Figures: docs/gpu-validation.md.
"""

from __future__ import annotations

import pytest
import torch
from run_helpers import REPO, stepscope_run

from stepscope.analyses.ab import FASTER, SLOWER

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
GPU_SCRIPTS = REPO / "tests" / "gpu_scripts"


def _measured(tmp_path, script: str, *extra: str) -> dict[str, dict]:
    r = stepscope_run(
        tmp_path, "--ceiling-batches", "0", "--verify", "3", *extra, str(GPU_SCRIPTS / script),
        warmup=10, steps=40, verb="doctor", timeout=580,
    )  # fmt: skip
    assert r.returncode == 0, r.describe()
    print(r.stdout)
    return {f.id: f.measured for f in r.summary.fixes if f.measured is not None}


def test_tf32_and_bf16_verify_faster_on_a_float32_matmul_model(tmp_path):
    measured = _measured(tmp_path, "verify_matmul.py", "--allow-numerics")
    for fix_id in ("tf32", "precision.bf16"):
        assert fix_id in measured, measured
        assert measured[fix_id]["verdict"] == FASTER, (fix_id, measured[fix_id])


def test_numerics_fixes_are_not_verified_without_the_flag(tmp_path):
    measured = _measured(tmp_path, "verify_matmul.py")
    assert "tf32" not in measured and "precision.bf16" not in measured, measured


def test_cudnn_benchmark_is_verified_on_a_conv_model(tmp_path):
    measured = _measured(tmp_path, "verify_conv.py")
    assert "cudnn.benchmark" in measured, measured
    assert measured["cudnn.benchmark"]["verdict"] != SLOWER, measured["cudnn.benchmark"]
