"""Runtime facts: the settings of a live training process that the doctor's rules read.

Collected inside the measured process by the instrumentation (instrument/tracker.py), in two moments:
``probe`` runs at the start of the first forward passes of the measured window, while the script's context
managers are open (autocast, anomaly mode, a running profiler); ``collect`` runs when the summary is written and
reads what lasts (models, optimizers, threads, compile counters, device memory). Everything is plain JSON-ready
data, stored in ``RunSummary.facts`` and documented in docs/summary-schema.md. A fact that cannot be read is left
out, never guessed: the rules treat an absent fact as "unknown" and stay silent.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

MB = 1 << 20
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
CONV_TYPES = ("Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d")


def torch_flags() -> dict[str, Any]:
    """Global torch settings that change speed: matmul precision, cuDNN autotuning, debug modes."""
    import torch

    return {
        "matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_tf32": bool(torch.backends.cudnn.allow_tf32),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "deterministic_algorithms": bool(torch.are_deterministic_algorithms_enabled()),
        "anomaly": bool(torch.is_anomaly_enabled()),
        "profiler": bool(torch.autograd.profiler._is_profiler_enabled),
        "grad_enabled": bool(torch.is_grad_enabled()),
    }


def autocast_state() -> dict[str, Any]:
    """Whether autocast is on for CUDA and CPU at this moment, and with which dtype."""
    import torch

    state: dict[str, Any] = {}
    for device in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device):
            state[device] = str(torch.get_autocast_dtype(device)).removeprefix("torch.")
    return state


def first_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """Shape, dtype, device and memory format of the first tensor a model is called with."""
    import torch

    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            fact: dict[str, Any] = {
                "shape": list(value.shape),
                "dtype": str(value.dtype).removeprefix("torch."),
                "device": value.device.type,
            }
            if value.dim() == 4:
                fact["channels_last"] = bool(
                    value.is_contiguous(memory_format=torch.channels_last) and not value.is_contiguous()
                )
            return fact
    return None


def describe_model(module: Any) -> dict[str, Any]:
    """Structure of a model: size, parameter dtypes, layer kinds, and its data-parallel wrapper's settings."""
    from torch import nn

    wrapper, inner = _wrapper(module)
    params = [p for p in inner.parameters()]
    trainable = [p for p in params if p.requires_grad]
    kinds = Counter(type(m).__name__ for m in inner.modules())
    fact: dict[str, Any] = {
        "type": type(inner).__name__,
        "params": sum(p.numel() for p in params),
        "trainable_params": sum(p.numel() for p in trainable),
        "param_mb": sum(p.numel() * p.element_size() for p in params) / MB,
        "dtypes": dict(Counter(str(p.dtype).removeprefix("torch.") for p in trainable)),
        "device": params[0].device.type if params else None,
        "convs": sum(kinds[k] for k in CONV_TYPES),
        "attention": sum(1 for m in inner.modules() if isinstance(m, nn.MultiheadAttention)),
        "batchnorms": sum(n for k, n in kinds.items() if k.startswith("BatchNorm")),
        "compiled": wrapper == "compiled" or type(module).__name__ == "OptimizedModule",
        "wrapper": wrapper,
    }
    if wrapper == "ddp":
        fact["ddp"] = {
            "find_unused_parameters": bool(module.find_unused_parameters),
            "bucket_cap_mb": module.bucket_bytes_cap / MB,
            "gradient_as_bucket_view": bool(module.gradient_as_bucket_view),
            "static_graph": bool(getattr(module, "static_graph", False)),
        }
    elif wrapper == "fsdp":
        prefetch = getattr(module, "backward_prefetch", None)
        fact["fsdp"] = {
            "sharding_strategy": getattr(getattr(module, "sharding_strategy", None), "name", None),
            "backward_prefetch": None if prefetch is None else getattr(prefetch, "name", str(prefetch)),
            "forward_prefetch": bool(getattr(module, "forward_prefetch", False)),
        }
    return fact


def _wrapper(module: Any) -> tuple[str | None, Any]:
    """The data-parallel or compile wrapper around a model, and the model inside it."""
    name = type(module).__name__
    if name == "OptimizedModule":
        inner_wrapper, inner = _wrapper(module._orig_mod)
        return inner_wrapper or "compiled", inner
    if name == "DistributedDataParallel":
        return "ddp", module.module
    if name == "FullyShardedDataParallel":
        return "fsdp", module
    if name == "DataParallel":
        return "dp", module.module
    return None, module


def describe_optimizer(optimizer: Any) -> dict[str, Any]:
    """An optimizer's class, implementation (fused / foreach / per-parameter loop) and where its parameters are."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    defaults = optimizer.defaults
    return {
        "type": type(optimizer).__name__,
        "fused": defaults.get("fused"),  # None when the class has no fused kernel or it was left to the default
        "foreach": defaults.get("foreach"),
        "has_fused": "fused" in defaults,
        "has_foreach": "foreach" in defaults,
        "params": len(params),
        "device": params[0].device.type if params else None,
    }


def threads() -> dict[str, Any]:
    """Thread settings and the cores this process may use (affinity, and the cgroup quota when set)."""
    import torch

    from stepscope.collectors.host import cgroup_cpu_quota, usable_cores

    cores = usable_cores()
    return {
        "torch_threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "env": {name: os.environ[name] for name in THREAD_ENV if name in os.environ},
        "cores": cores,
        "cpu_quota": cgroup_cpu_quota(),
        "local_ranks": int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1),  # ranks on this machine (torchrun)
    }


def cores_of(found: dict[str, Any]) -> float | None:
    """CPU cores a process of the run may use, from its facts: the cgroup quota when set, else its affinity."""
    threads = found.get("threads", {})
    return threads.get("cpu_quota") or threads.get("cores")


def ranks_per_machine(found: dict[str, Any]) -> int:
    """Ranks sharing one machine's cores (torchrun's LOCAL_WORLD_SIZE; 1 when not launched by it)."""
    return int(found.get("threads", {}).get("local_ranks") or 1)


def oversubscribed_threads(found: dict[str, Any]) -> tuple[int, float] | None:
    """(torch threads across this machine's ranks, usable cores) when the threads exceed the cores; None when they
    fit or the facts are missing."""
    cores = cores_of(found)
    threads = found.get("threads", {}).get("torch_threads")
    if not cores or threads is None:
        return None
    used = threads * ranks_per_machine(found)
    return (used, cores) if used > max(cores, 1) + 0.5 else None


def threads_for_workers(found: dict[str, Any], workers: int) -> tuple[int, int, float] | None:
    """(torch threads, threads that fit, usable cores) when this rank's intra-op threads plus ``workers`` loader
    worker processes (each a core while it loads), times the ranks on this machine, exceed the usable cores and
    fewer threads would fit them; None when they fit, threads are already 1, or the facts are missing."""
    cores = cores_of(found)
    threads = found.get("threads", {}).get("torch_threads")
    if not cores or threads is None:
        return None
    local = ranks_per_machine(found)
    if (threads + workers) * local <= max(cores, 1) + 0.5:
        return None
    fit = max(1, int(cores // local) - workers)
    return (threads, fit, cores) if fit < threads else None


def dynamo_counters() -> dict[str, Any] | None:
    """torch.compile's counters so far (graphs compiled, graph breaks by reason, recompile-limit hits); None
    when torch.compile was never used."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return None
    counters = utils.counters
    frames = counters.get("frames", {})
    if not frames.get("total"):
        return None
    limit_hits = sum(n for reason, n in counters.get("unimplemented", {}).items() if _is_limit_hit(reason))
    return {
        "graphs": int(counters.get("stats", {}).get("unique_graphs", 0)),
        "frames": int(frames.get("total", 0)),
        "frames_ok": int(frames.get("ok", 0)),
        "graph_breaks": {reason.split("\n")[0][:160]: int(n) for reason, n in counters.get("graph_break", {}).items()},
        "recompile_limit_hits": int(limit_hits),
    }


def _is_limit_hit(reason: str) -> bool:
    lowered = reason.lower()
    return "recompile limit" in lowered or "cache_size_limit" in lowered or "recompile_limit" in lowered


def device() -> dict[str, Any] | None:
    """The CUDA device in use: name, compute capability, bf16 support, memory and allocator figures; None when
    CUDA was never initialised (reading these never synchronises)."""
    import torch

    from stepscope.collectors.memory import device_memory

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    memory = device_memory([index])
    return {
        "index": index,
        "name": props.name,
        "capability": [props.major, props.minor],
        "bf16": _bf16_native(),
        "total_mb": props.total_memory / MB,
        "peak_allocated_mb": memory["max_allocated_mb"],
        "peak_reserved_mb": memory["max_reserved_mb"],
        "alloc_retries": memory["alloc_retries"],
        "ooms": memory["ooms"],
    }


def _bf16_native() -> bool:
    """bfloat16 in hardware; ``is_bf16_supported()`` alone also counts emulation on pre-Ampere GPUs."""
    import torch

    try:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # torch versions without the argument did not count emulation
        return bool(torch.cuda.is_bf16_supported())


def sdpa_kernels(query: Any, key: Any, value: Any, attn_mask: Any, dropout_p: float, is_causal: bool) -> dict[str, Any]:
    """Which fused attention kernels could run a scaled_dot_product_attention call on CUDA (False for all three
    means the slow math kernel), and the inputs that decide it."""
    import torch
    from torch.backends import cuda

    fact: dict[str, Any] = {
        "dtype": str(query.dtype).removeprefix("torch."),
        "head_dim": int(query.shape[-1]),
        "mask": attn_mask is not None,
    }
    try:
        params = torch.backends.cuda.SDPAParams(query, key, value, attn_mask, dropout_p, is_causal, False)
    except TypeError:  # torch versions whose SDPAParams takes no enable_gqa
        params = torch.backends.cuda.SDPAParams(query, key, value, attn_mask, dropout_p, is_causal)
    fact["flash"] = bool(cuda.can_use_flash_attention(params, False))
    fact["efficient"] = bool(cuda.can_use_efficient_attention(params, False))
    can_cudnn = getattr(cuda, "can_use_cudnn_attention", None)
    fact["cudnn"] = bool(can_cudnn(params, False)) if can_cudnn is not None else False
    return fact
