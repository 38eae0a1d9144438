"""Model FLOPs per step and MFU: achieved TFLOP/s against the GPU's dense peak for the dtype that trains.

FLOPs are counted once, for one forward and backward, with ``torch.utils.flop_counter.FlopCounterMode`` (matmuls,
convolutions, attention: what dominates a model; elementwise ops and the optimizer are not counted, as in the
usual MFU definition). MFU = FLOPs per step / step time / peak. The peaks are the vendors' dense (no sparsity)
tensor-core figures; on a CPU there is no table, and only the achieved FLOP/s is reported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Dense peak TFLOP/s by GPU (matched as a substring of the CUDA device name, first match wins) and dtype.
# "tf32" is float32 matmuls with TF32 allowed; "float32" without it.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"bfloat16": 989.4, "float16": 989.4, "tf32": 494.7, "float32": 66.9}),
    ("H100 PCIe", {"bfloat16": 756.0, "float16": 756.0, "tf32": 378.0, "float32": 51.2}),
    ("H100", {"bfloat16": 989.4, "float16": 989.4, "tf32": 494.7, "float32": 66.9}),  # SXM / HBM3
    ("A100", {"bfloat16": 312.0, "float16": 312.0, "tf32": 156.0, "float32": 19.5}),
    ("L40S", {"bfloat16": 362.1, "float16": 362.1, "tf32": 183.0, "float32": 91.6}),
    ("L4", {"bfloat16": 121.0, "float16": 121.0, "tf32": 60.0, "float32": 30.3}),
    ("A10", {"bfloat16": 125.0, "float16": 125.0, "tf32": 62.5, "float32": 31.2}),
    ("V100", {"float16": 125.0, "float32": 15.7}),
]


def count_flops(step: Callable[[], Any]) -> int:
    """FLOPs of one call of ``step`` (run it with a forward and a backward inside), counted by FlopCounterMode."""
    counter = StepFlopCounter()
    counter.start()
    try:
        step()
    finally:
        flops = counter.stop()
    return flops


class _TotalOnly:
    """FlopCounterMode's module tracker reduced to the total (the only figure read here). torch's own ModuleTracker
    hooks the gradients of every module's inputs and outputs, and a ``torch.autograd.grad`` on a leaf input (a
    gradient penalty's) then raises inside the script: a torch limitation that counting must not bring into it."""

    parents = ("Global",)

    def __enter__(self) -> _TotalOnly:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class StepFlopCounter:
    """Counts the FLOPs of one training step from inside it: ``start()`` at a step's start, ``stop()`` at its end
    (the auto-instrumentation's hooks call them, one warm-up step long)."""

    def __init__(self) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        self._mode = FlopCounterMode(display=False)
        if hasattr(self._mode, "mod_tracker"):  # torch >= 2.4 tracks modules; the total needs none of it
            self._mode.mod_tracker = _TotalOnly()
        self.flops: int | None = None

    def start(self) -> None:
        self._mode.__enter__()

    def stop(self) -> int:
        self._mode.__exit__(None, None, None)
        self.flops = int(self._mode.get_total_flops())
        return self.flops


def peak_tflops(device_name: str, dtype: str) -> float | None:
    """The dense peak TFLOP/s of a GPU (by its CUDA name) for ``dtype`` ("bfloat16", "float16", "tf32",
    "float32"); None for an unknown GPU or dtype."""
    for marker, peaks in PEAK_TFLOPS:
        if marker in device_name:
            return peaks.get(dtype)
    return None


def training_dtype(facts: dict[str, Any]) -> str | None:
    """The dtype the matmuls of the run use, from its runtime facts: autocast's, else the parameters' (float32
    counts as "tf32" when TF32 matmuls are allowed)."""
    autocast = facts.get("autocast", {})
    if "cuda" in autocast:
        return str(autocast["cuda"])
    dtypes = [d for m in facts.get("models", []) for d in m.get("dtypes", {})]
    if not dtypes:
        return None
    dtype = max(set(dtypes), key=dtypes.count)
    if dtype == "float32":
        flags = facts.get("torch", {})
        return "tf32" if flags.get("cuda_matmul_tf32") or flags.get("matmul_precision") in ("high", "medium") else dtype
    return dtype


def gpu_peak(device_name: str | None, dtype: str | None) -> tuple[float, str] | None:
    """The dense peak TFLOP/s that MFU is measured against, and the peak in words ("NVIDIA H100 80GB HBM3 bfloat16
    dense 989.4 TFLOP/s"); None without a known GPU and dtype (a CPU run reports achieved FLOP/s only)."""
    peak = peak_tflops(device_name, dtype) if device_name and dtype else None
    return None if peak is None else (peak, f"{device_name} {dtype} dense {peak:g} TFLOP/s")
