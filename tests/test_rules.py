"""The fix catalogue: every rule fires on a fixture that shows its problem, stays silent on a near miss and on
absent facts, and diagnose ranks what fires by cost, then gain bound.

Most fixtures start from ``healthy()``: a CUDA-timed DDP run on an A100 that no rule has anything to say about
(checked by a test), and change the one fact a rule reads. The phase shares are chosen so that every Amdahl bound
is a known number: the GPU is busy in forward 30% and backward 45% of the step (``COMPUTE`` = 0.75), while the
host clock sees other figures, so a rule that read the wrong clock would get the wrong bound.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable
from typing import Any

import pytest

from stepscope.doctor import rules
from stepscope.doctor.lint import LintHit
from stepscope.doctor.rules import CATALOGUE, Case, Finding, Rule, diagnose
from stepscope.doctor.verdict import NOT_LAUNCH_BOUND, refine
from stepscope.instrument.apply import parse_fixes
from stepscope.summary import (
    COSTS,
    Cluster,
    Epoch,
    Fix,
    LoaderInfo,
    Meta,
    PhaseStats,
    RunSummary,
    Steps,
    StepSeries,
    Straggler,
    Verdict,
    Wall,
)

STEP_MS = 100.0

# -- fixture builders -------------------------------------------------------------------------------------------


def make_summary(
    phases: dict[str, float],
    *,
    device: dict[str, float] | None = None,
    timing: str = "host",
    loaders: list[LoaderInfo] | None = None,
    epochs: list[Epoch] | None = None,
    facts: dict[str, Any] | None = None,
    counters: dict[str, float] | None = None,
    measured: int = 20,
    warmup: int = 10,
    stats: dict[str, dict[str, float]] | None = None,
    signals: list[dict[str, str]] | None = None,
    params: list[dict[str, Any]] | None = None,
    world_size: int | None = None,
) -> RunSummary:
    """A summary whose phases take ``share`` of a 100 ms step (host clock) and ``device[name]`` of it on the GPU;
    ``stats`` overrides single fields (``{"data_wait": {"median_ms": 2.0}}``, ``{"total": {"p95_ms": 350.0}}``)."""
    device = device or {}
    built: dict[str, PhaseStats] = {}
    for name, share in phases.items():
        ms = share * STEP_MS
        gpu = device.get(name)
        gpu_ms = None if gpu is None else gpu * STEP_MS
        built[name] = PhaseStats(
            mean_ms=ms,
            median_ms=ms,
            p95_ms=ms,
            share=share,
            steps=measured,
            device_mean_ms=gpu_ms,
            device_median_ms=gpu_ms,
            device_p95_ms=gpu_ms,
            device_share=gpu,
        )
    built["total"] = PhaseStats(STEP_MS, STEP_MS, STEP_MS, 1.0, measured)
    for name, fields in (stats or {}).items():
        built[name] = dataclasses.replace(built[name], **fields)
    return RunSummary(
        steps=Steps(warmup=warmup, measured=measured),
        phases=built,
        meta=Meta(device="cuda" if timing == "cuda" else "cpu", timing=timing, world_size=world_size),
        loaders=list(loaders or []),
        epochs=list(epochs or []),
        counters=dict(counters or {}),
        facts=copy.deepcopy(facts or {}),
        system={"signals": list(signals)} if signals else {},
        params=list(params or []),
    )


def loader(
    num_workers: int = 4,
    pin_memory: bool = True,
    persistent_workers: bool = True,
    prefetch_factor: int | None = 2,
    batches: int = 30,
    index: int = 0,
) -> LoaderInfo:
    return LoaderInfo(
        index=index,
        dataset="ToyDataset",
        batch_size=32,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=persistent_workers,
        prefetch_factor=prefetch_factor if num_workers else None,
        drop_last=False,
        iterable=False,
        length=100,
        batches=batches,
        samples=32 * batches,
        fetch_s=1.0,
    )


def torch_flags(**changes: Any) -> dict[str, Any]:
    flags = {
        "matmul_precision": "high",
        "cuda_matmul_tf32": True,
        "cudnn_tf32": True,
        "cudnn_benchmark": True,
        "cudnn_deterministic": False,
        "deterministic_algorithms": False,
        "anomaly": False,
        "profiler": False,
        "grad_enabled": True,
    }
    return {**flags, **changes}


def device_fact(**changes: Any) -> dict[str, Any]:
    fact = {
        "index": 0,
        "name": "NVIDIA A100-SXM4-80GB",
        "capability": [8, 0],
        "bf16": True,
        "total_mb": 81920.0,
        "peak_allocated_mb": 60000.0,
        "peak_reserved_mb": 62000.0,
        "alloc_retries": 0,
        "ooms": 0,
    }
    return {**fact, **changes}


def model_fact(**changes: Any) -> dict[str, Any]:
    fact = {
        "type": "ConvNet",
        "params": 25_000_000,
        "trainable_params": 25_000_000,
        "param_mb": 95.4,
        "dtypes": {"float32": 10},
        "device": "cuda",
        "convs": 5,
        "attention": 0,
        "batchnorms": 5,
        "compiled": False,
        "wrapper": "ddp",
        "ddp": {
            "find_unused_parameters": False,
            "bucket_cap_mb": 25.0,
            "gradient_as_bucket_view": True,
            "static_graph": False,
        },
    }
    return {**fact, **changes}


def fsdp_model(strategy: str = "FULL_SHARD", param_mb: float = 1024.0, **fsdp: Any) -> dict[str, Any]:
    fact = model_fact(wrapper="fsdp", param_mb=param_mb)
    del fact["ddp"]
    fact["fsdp"] = {"sharding_strategy": strategy, "backward_prefetch": "BACKWARD_PRE", "forward_prefetch": True}
    fact["fsdp"].update(fsdp)
    return fact


def _plain_model() -> dict[str, Any]:
    fact = model_fact(wrapper=None)
    del fact["ddp"]
    return fact


def optimizer_fact(**changes: Any) -> dict[str, Any]:
    fact = {
        "type": "AdamW",
        "fused": True,
        "foreach": None,
        "has_fused": True,
        "has_foreach": True,
        "params": 10,
        "device": "cuda",
    }
    return {**fact, **changes}


def threads_fact(
    torch_threads: int = 4, cores: int = 16, cpu_quota: float | None = None, local_ranks: int = 1, **env: str
) -> dict:
    """``local_ranks``: ranks sharing this machine's cores (torchrun's LOCAL_WORLD_SIZE)."""
    return {
        "torch_threads": torch_threads,
        "interop_threads": 4,
        "env": env,
        "cores": cores,
        "cpu_quota": cpu_quota,
        "local_ranks": local_ranks,
    }


IMAGE = {"shape": [32, 3, 224, 224], "dtype": "float32", "device": "cuda", "channels_last": True}
FLASH = {"dtype": "bfloat16", "head_dim": 64, "mask": False, "flash": True, "efficient": True, "cudnn": False}

# Host clock: what the host saw (kernel launches, waits). GPU: what the device did.
HOST_SHARES = {
    "data_wait": 0.05,
    "h2d": 0.02,
    "forward": 0.15,
    "backward": 0.2,
    "optimizer": 0.08,
    "zero_grad": 0.03,
    "other": 0.47,
}
GPU_SHARES = {"h2d": 0.02, "forward": 0.3, "backward": 0.45, "optimizer": 0.08, "zero_grad": 0.03}
COMPUTE = 0.75  # GPU forward + backward
HOST_IDLE = 0.07  # 1 - GPU busy outside data (0.86) - data (0.05 + 0.02)


def healthy_facts() -> dict[str, Any]:
    return {
        "torch": torch_flags(),
        "autocast": {"cuda": "bfloat16"},
        "inputs": [dict(IMAGE)],
        "models": [model_fact()],
        "optimizers": [optimizer_fact()],
        "threads": threads_fact(local_ranks=2),
        "zero_grad": {"set_to_none": True},
        "h2d": {"copies": 40, "non_blocking": 40, "to_cuda": 40, "pinned_source": 8},
        "dynamo": {
            "graphs": 2,
            "frames": 2,
            "frames_ok": 2,
            "graph_breaks": {},
            "recompile_limit_hits": 0,
            "graphs_in_window": 0,
        },
        "device": device_fact(),
        "sdpa": [dict(FLASH)],
    }


def audit(steps: int = 5, unused: list | None = None, conditional: list | None = None) -> dict[str, Any]:
    return {
        "model": "ConvNet",
        "steps": steps,
        "used_count": 10,
        "unused": unused or [],
        "zero_grad": [],
        "frozen": [],
        "conditional": conditional or [],
        "ddp_find_unused": True,
        "zero_grad_checked": False,
        "total_count": 10,
        "wrapped_in": ["DistributedDataParallel"],
    }


def healthy(**changes: Any) -> RunSummary:
    """A CUDA-timed 2-rank DDP run on one machine with nothing to fix; keyword arguments replace make_summary's."""
    kwargs: dict[str, Any] = {
        "device": GPU_SHARES,
        "timing": "cuda",
        "loaders": [loader()],
        "facts": healthy_facts(),
        "counters": {"host_syncs": 0.0, "item_calls": 0.0, "checkpoint_calls": 0.0},
        "params": [audit()],
        "world_size": 2,
    }
    kwargs.update(changes)
    return make_summary(HOST_SHARES, **kwargs)


def with_facts(summary: RunSummary, **changes: Any) -> RunSummary:
    summary.facts.update(changes)
    return summary


def cpu_summary(phases: dict[str, float] | None = None, **changes: Any) -> RunSummary:
    """A host-timed CPU run: no device fact."""
    shares = phases or {"data_wait": 0.1, "forward": 0.3, "backward": 0.4, "optimizer": 0.1, "other": 0.1}
    return make_summary(shares, **changes)


def ids(fixes: list[Fix]) -> list[str]:
    return [f.id for f in fixes]


def fired(case: Case) -> dict[str, Fix]:
    fixes, notes = diagnose(case)
    assert notes == []
    return {f.id: f for f in fixes}


# -- positive and negative fixtures ------------------------------------------------------------------------------

Builder = Callable[[], Case]
POSITIVE: list[tuple[str, Builder, float | None, str]] = []
NEGATIVE: list[tuple[str, Builder]] = []


def positive(rule_id: str, gain: float | None, evidence: str) -> Callable[[Builder], Builder]:
    """Register a fixture on which ``rule_id`` fires with this gain bound and this exact evidence line."""

    def register(build: Builder) -> Builder:
        POSITIVE.append((rule_id, build, gain, evidence))
        return build

    return register


def negative(rule_id: str) -> Callable[[Builder], Builder]:
    """Register a near miss: ``rule_id`` must stay silent on it."""

    def register(build: Builder) -> Builder:
        NEGATIVE.append((rule_id, build))
        return build

    return register


DATA_BOUND = {"data_wait": 0.6, "forward": 0.15, "backward": 0.2, "optimizer": 0.05}


@positive("loader.num_workers", 0.6, "data_wait is 60% of the step (60.0 ms of 100.0 ms)")
def workers_zero() -> Case:
    facts = {"threads": threads_fact(cores=8)}
    return Case(make_summary(DATA_BOUND, loaders=[loader(num_workers=0, pin_memory=False)], facts=facts))


@positive(
    "loader.num_workers",
    0.5,  # loaders 0 and 2 together: 0.6 of the step times their 0.5 s of the 0.6 s the steps waited on loaders
    "loader 0 (ToyDataset) has num_workers=0, and so does loader 2 (ToyDataset)",
)
def workers_zero_on_two_of_three_loaders() -> Case:
    # Seed 2032's c014 of the truth generator (beside busy loops): three loaders, none with workers, waited for
    # 50% of the step in all and 21% on the one waited for most; the bound named that one alone, under the
    # optimizer's 34%, where the data wait was the verdict. The advice, and --apply, give every such loader its
    # workers. Loader 1 has enough workers of its own: its wait is not the fix's.
    loaders = [loader(num_workers=0, index=0), loader(num_workers=2, index=1), loader(num_workers=0, index=2)]
    for x, fetch_s in zip(loaders, (0.3, 0.1, 0.2), strict=True):
        x.fetch_s = fetch_s
    return Case(make_summary(DATA_BOUND, loaders=loaders, facts={"threads": threads_fact(cores=8)}))


@positive(
    "loader.num_workers",
    0.588,  # loaders 0 and 1 (0.6 s and 0.38 s of the 1 s waited); loader 2's 0.02 s (1.2% of the step) is left out
    "loader 0 (ToyDataset) has num_workers=0, and so does loader 1 (ToyDataset)",
)
def workers_zero_beside_a_loader_barely_waited_for() -> Case:
    # Seed 2035's c046: a validation loader whose first batch is fetched inside a step waited 1% of it, and was
    # named beside the training loaders. A loader under MIN_GAIN of the step is noise in the bound and the advice.
    loaders = [loader(num_workers=0, index=i) for i in range(3)]
    for x, fetch_s in zip(loaders, (0.6, 0.38, 0.02), strict=True):
        x.fetch_s = fetch_s
    return Case(make_summary(DATA_BOUND, loaders=loaders, facts={"threads": threads_fact(cores=8)}))


def idle_workers_of_another_loader(workers_cpu_pct: float) -> Case:
    """Two ranks on 2 cores, each with a loader without workers that computes and one whose single worker uses
    ``workers_cpu_pct`` of a core (seed 2035's c046, seed 2036's c019: a free loader's worker, 5% of a core)."""
    loaders = [loader(num_workers=0, index=0), loader(num_workers=1, index=1)]
    loaders[0].fetch_s, loaders[1].fetch_s = 0.9, 0.1
    facts = {"threads": threads_fact(cores=2, local_ranks=2)}
    summary = make_summary(DATA_BOUND, loaders=loaders, facts=facts)
    summary.system["host"] = {"workers_cpu_util_pct": workers_cpu_pct, "workers_max": 1, "cpu_util_pct": 70.0}
    return Case(summary)


@positive("loader.num_workers", 0.54, "loader 0 (ToyDataset) has num_workers=0")
def workers_zero_beside_idle_workers() -> Case:
    # Counted, the two ranks' idle workers filled both cores and no loader fix was found on the rank the job waited
    # for; measured, they hold none.
    return idle_workers_of_another_loader(5.0)


@negative("loader.num_workers")
def workers_zero_beside_busy_workers() -> Case:
    return idle_workers_of_another_loader(95.0)


def per_sample_tensors(tensors: int) -> Case:
    """A loader with 2 workers whose batches hold ``tensors`` tensors, waited for 60% of the step."""
    batched = loader(num_workers=2)
    batched.tensors_per_batch = tensors
    return Case(make_summary(DATA_BOUND, loaders=[batched], facts={"threads": threads_fact(cores=8)}))


@positive(
    "loader.batched_tensors",
    0.6,
    "loader 0 (ToyDataset, num_workers=2): 24 tensors a batch, each sent from its worker apart",
)
def per_sample_tensors_from_workers() -> Case:
    # Seed 2038's c029: 8 inputs and 8 target dicts a batch (collate_fn=lambda b: tuple(zip(*b))) through one worker:
    # 7.2 ms a batch against 1.4 ms batched; the step waited half its time with no loader fix.
    return per_sample_tensors(24)


@negative("loader.batched_tensors")
def batched_tensors_from_workers() -> Case:
    return per_sample_tensors(2)


# The doctor's loader ceiling: loader 0 alone delivers 1.05x what training consumed.
SLOW_ALONE = {
    "index": 0,
    "against_training": {"input_bound": True, "loader_ceiling": 105.0, "headroom": 1.05, "train_rate": 100.0},
}


@negative("loader.num_workers")
def workers_filling_the_cores() -> Case:
    # 2 workers and the training process on 3 cores: no core for another computing worker.
    return Case(make_summary(DATA_BOUND, loaders=[loader(num_workers=2)], facts={"threads": threads_fact(cores=3)}))


@positive(
    "loader.num_workers",
    0.6,
    "loader 0 (ToyDataset) has num_workers=2, and the step still waits for it: 60% of the step (60.0 ms of 100.0 ms)",
)
def workers_two_of_eight_cores() -> Case:
    summary = make_summary(DATA_BOUND, loaders=[loader(num_workers=2)], facts={"threads": threads_fact(cores=8)})
    summary.dataloader = SLOW_ALONE
    return Case(summary)


@negative("loader.num_workers")
def workers_waited_on_but_not_measured_slow() -> Case:
    # The step waits on a loader with workers, but nothing measured it too slow: on a busy machine each batch's
    # hand-over from a worker alone can take this long, and more workers would not shorten it.
    return Case(make_summary(DATA_BOUND, loaders=[loader(num_workers=2)], facts={"threads": threads_fact(cores=8)}))


@positive(
    "loader.num_workers",
    0.6,
    "loader 0 (ToyDataset) has num_workers=2, and the step still waits for it: 60% of the step (60.0 ms of 100.0 ms)",
)
def sleeping_workers_that_cannot_keep_up() -> Case:
    # 2 workers at 10% of a core each on 3 cores: they wait (a read), so more of them overlap more waits.
    host = {"workers_cpu_util_pct": 20.0, "workers_max": 2}
    summary = make_summary(DATA_BOUND, loaders=[loader(num_workers=2)], facts={"threads": threads_fact(cores=3)})
    summary.system["host"] = host
    summary.dataloader = SLOW_ALONE
    return Case(summary)


@negative("loader.num_workers")
def workers_zero_little_data_wait() -> Case:
    phases = {"data_wait": 0.04, "forward": 0.5, "backward": 0.46}
    return Case(make_summary(phases, loaders=[loader(num_workers=0)]))


@negative("loader.num_workers")
def workers_zero_no_steps() -> Case:
    return Case(make_summary(DATA_BOUND, loaders=[loader(num_workers=0)], measured=0))


def _epochs(stalls_ms: list[float], loader_index: int = 0) -> list[Epoch]:
    return [Epoch(loader_index, i, 10.0, 30, 960, stall, True) for i, stall in enumerate(stalls_ms)]


@positive(
    "loader.persistent_workers",
    0.04,
    "2 epoch restart(s) of loader 0 (ToyDataset, num_workers=4) stalled 600 ms each before the first batch",
)
def restarted_workers() -> Case:
    # later stalls 1.2 s over 30 s of epochs: 4%; the first epoch's start-up is paid either way.
    return Case(healthy(loaders=[loader(persistent_workers=False)], epochs=_epochs([500.0, 600.0, 600.0])))


@positive(
    "loader.persistent_workers",
    0.4768,  # 0.48 of the step, times the two loaders' 0.904 s of the 0.91 s the steps waited on loaders
    "epochs of 2 batches: each fetch waits on workers started again, 48% of the step",
)
def short_epochs_of_two_loaders() -> Case:
    # Seed 2030's c029 of the truth generator: two one-worker loaders fetched in turn, each starting its worker
    # again every 2 batches; the steps waited 48% of the time, nearly all of it on those two. Their stalls alone,
    # summed over both loaders' overlapping epochs, read 13%, under the optimizer's 43%: the first fix was the
    # optimizer's where the data wait was the bound.
    loaders = [loader(num_workers=1, persistent_workers=False, index=i) for i in (0, 1)]
    loaders.append(loader(num_workers=0, index=2))
    for x, fetch_s in zip(loaders, (0.19, 0.25, 0.006), strict=True):
        x.fetch_s = fetch_s
    epochs = [Epoch(0, i, 0.19, 2, 64, 25.0, True) for i in range(8)]
    epochs += [Epoch(1, i, 0.19, 2, 64, 33.0, True) for i in range(8)]
    phases = {"data_wait": 0.48, "optimizer": 0.43, "forward": 0.05, "other": 0.04}
    return Case(make_summary(phases, loaders=loaders, epochs=epochs))


@negative("loader.persistent_workers")
def persistent_already() -> Case:
    return Case(healthy(epochs=_epochs([500.0, 600.0, 600.0])))


@negative("loader.persistent_workers")
def one_epoch_only() -> Case:
    return Case(healthy(loaders=[loader(persistent_workers=False)], epochs=_epochs([2000.0])))


@negative("loader.persistent_workers")
def short_restart_stalls() -> Case:
    # 2 × 100 ms over 30 s: 0.7%, under the 2% worth a fix
    return Case(healthy(loaders=[loader(persistent_workers=False)], epochs=_epochs([500.0, 100.0, 100.0])))


@positive("loader.pin_memory", 0.02, "h2d is 2% of the step (2.00 ms)")
def unpinned() -> Case:
    summary = healthy(loaders=[loader(pin_memory=False)])
    summary.facts["h2d"] = {"copies": 40, "non_blocking": 0, "to_cuda": 40, "pinned_source": 0}
    return Case(summary)


@negative("loader.pin_memory")
def unpinned_loader_but_pinned_by_hand() -> Case:
    return Case(healthy(loaders=[loader(pin_memory=False)]))  # pinned_source 8: the script pins its batches


@negative("loader.pin_memory")
def unpinned_copies_in_no_time() -> Case:
    case = unpinned()
    set_share(case.summary, "h2d", 0.005)
    return case


@negative("loader.pin_memory")
def unpinned_on_cpu() -> Case:
    h2d = {"copies": 40, "non_blocking": 0, "to_cuda": 0, "pinned_source": 0}
    return Case(cpu_summary(loaders=[loader(pin_memory=False)], facts={"h2d": h2d}))


@positive("h2d.non_blocking", 0.02, "loader 0 (ToyDataset) pins memory, but 40 copies to the GPU were blocking")
def blocking_copies() -> Case:
    summary = healthy()
    summary.facts["h2d"]["non_blocking"] = 0
    return Case(summary)


@negative("h2d.non_blocking")
def blocking_copies_from_unpinned_loader() -> Case:
    summary = healthy(loaders=[loader(pin_memory=False)])
    summary.facts["h2d"]["non_blocking"] = 0
    return Case(summary)


BURSTY = {"data_wait": {"median_ms": 2.0, "p95_ms": 150.0}}
PREFETCH_PHASES = {"data_wait": 0.3, "forward": 0.3, "backward": 0.3, "optimizer": 0.1}


@positive("loader.prefetch", 0.3, "data_wait median 2.00 ms but mean 30.0 ms and p95 150.0 ms")
def bursty_fetches() -> Case:
    return Case(make_summary(PREFETCH_PHASES, loaders=[loader()], stats=BURSTY))


@negative("loader.prefetch")
def steady_fetches() -> Case:
    steady = {"data_wait": {"median_ms": 28.0, "p95_ms": 35.0}}
    return Case(make_summary(PREFETCH_PHASES, loaders=[loader()], stats=steady))


@negative("loader.prefetch")
def bursty_without_workers() -> Case:
    return Case(make_summary(PREFETCH_PHASES, loaders=[loader(num_workers=0)], stats=BURSTY))


@negative("loader.prefetch")
def bursts_at_short_epochs_restarts() -> Case:
    # The truth generator's c067: an epoch every 5 batches starts the one worker again; the p95 is the epochs'
    # first fetches, which a deeper buffer (empty at every new iterator) cannot absorb.
    epochs = [Epoch(0, i, 0.1, 5, 40, 21.0, True) for i in range(8)]
    summary = make_summary(PREFETCH_PHASES, loaders=[loader(persistent_workers=False)], stats=BURSTY, epochs=epochs)
    return Case(summary)


@positive("loader.prefetch", 0.3, "data_wait median 2.00 ms but mean 30.0 ms and p95 150.0 ms")
def bursty_fetches_in_long_epochs() -> Case:
    epochs = [Epoch(0, i, 3.0, 100, 800, 21.0, True) for i in range(3)]
    summary = make_summary(PREFETCH_PHASES, loaders=[loader(persistent_workers=False)], stats=BURSTY, epochs=epochs)
    return Case(summary)


def accumulating_from_one_worker(burst_s: float) -> Case:
    """A loader with 1 worker (prefetch_factor 2) that each of 30 steps takes 4 batches from: 60 fetches past the
    buffer waited ``burst_s`` in all, the 60 it served 0.06 s; the step's wait steady step to step (its data_wait
    sums each step's fetches)."""
    one = loader(num_workers=1, batches=120)
    one.fetch_s, one.burst_fetches, one.burst_fetch_s = 0.06 + burst_s, 60, burst_s
    steady = {"data_wait": {"median_ms": 28.0, "p95_ms": 35.0}}
    return Case(make_summary(PREFETCH_PHASES, loaders=[one], stats=steady))


@positive(
    "loader.prefetch",
    0.24,  # the data wait's 30% times the 0.24 s of the 0.30 s the steps waited on the loader
    "loader 0 (ToyDataset): a step takes 4.0 batches from it at once, and its 1 worker(s) hold 2 ready "
    "(prefetch_factor=2): a fetch past those waited 4.0 ms, one the buffer served 1.0 ms",
)
def accumulation_waits_past_the_buffer() -> Case:
    # Seed 2039's c003 (beside busy loops): 4 micro-batches a step from loaders with one worker each; each step's
    # last two were made while it waited: data 52% of the step, and no loader fix.
    return accumulating_from_one_worker(0.24)


@negative("loader.prefetch")
def accumulation_of_free_batches() -> Case:
    # Past the buffer, the fetches wait what a hand-over takes (a free loader's): a deeper buffer saves nothing.
    return accumulating_from_one_worker(0.072)


@positive("loader.too_many_workers", None, "loader 0 (ToyDataset): 8 workers × 1 rank(s) for 4 cgroup quota")
def workers_over_quota() -> Case:
    return Case(healthy(loaders=[loader(num_workers=8)], facts={"threads": threads_fact(cpu_quota=4.0)}, world_size=1))


@negative("loader.too_many_workers")
def workers_at_quota() -> Case:
    return Case(healthy(loaders=[loader(num_workers=4)], facts={"threads": threads_fact(cpu_quota=4.0)}, world_size=1))


@negative("loader.too_many_workers")
def workers_per_rank_fit() -> Case:
    facts = {"threads": threads_fact(cores=8, local_ranks=2)}  # 4 workers × 2 ranks = 8 cores
    return Case(healthy(loaders=[loader(num_workers=4)], facts=facts, world_size=2))


@negative("loader.too_many_workers")
def workers_over_quota_that_wait_on_io() -> Case:
    # 8 workers using 120% CPU together (15% each) mostly wait: more workers than cores overlap the waits.
    summary = healthy(loaders=[loader(num_workers=8)], facts={"threads": threads_fact(cpu_quota=4.0)}, world_size=1)
    summary.system["host"] = {"workers_cpu_util_pct": 120.0, "workers_max": 8}
    return Case(summary)


TRANSFORM = "No GPU was in use while its 4 DataLoader worker process(es) used 390% CPU"
IO = "No GPU was in use while the training process used 3% of a core and it has no worker processes"


@positive("loader.transform_bound", 0.5, TRANSFORM)
def transform_bound() -> Case:
    phases = {"data_wait": 0.5, "forward": 0.2, "backward": 0.3}
    return Case(make_summary(phases, signals=[{"id": "transform_bound", "evidence": TRANSFORM}]))


@negative("loader.transform_bound")
def transform_signal_little_data_wait() -> Case:
    phases = {"data_wait": 0.04, "forward": 0.5, "backward": 0.46}
    return Case(make_summary(phases, signals=[{"id": "transform_bound", "evidence": TRANSFORM}]))


@positive("loader.io_bound", 0.5, "data_wait is 50% of the step")
def io_bound() -> Case:
    phases = {"data_wait": 0.5, "forward": 0.2, "backward": 0.3}
    return Case(make_summary(phases, signals=[{"id": "io_bound", "evidence": IO}]))


@negative("loader.io_bound")
def idle_in_a_sleeping_forward_with_a_small_data_wait() -> Case:
    # The process idles, but in its forward: the 9% data_wait is a worker handing batches over, not storage.
    phases = {"data_wait": 0.09, "forward": 0.6, "backward": 0.31}
    return Case(make_summary(phases, signals=[{"id": "io_bound", "evidence": IO}]))


@negative("loader.io_bound")
def data_bound_without_io_signal() -> Case:
    phases = {"data_wait": 0.5, "forward": 0.2, "backward": 0.3}
    return Case(make_summary(phases, signals=[{"id": "transform_bound", "evidence": TRANSFORM}]))


def fp32_no_autocast(**flags: Any) -> RunSummary:
    """The healthy run in plain float32: no autocast, float32 parameters."""
    return with_facts(healthy(), autocast={}, torch=torch_flags(**flags))


@positive("tf32", COMPUTE, 'float32 matmul precision is "highest" (TF32 off)')
def tf32_off() -> Case:
    return Case(fp32_no_autocast(matmul_precision="highest", cuda_matmul_tf32=False))


@negative("tf32")
def tf32_already_high() -> Case:
    return Case(fp32_no_autocast(matmul_precision="high", cuda_matmul_tf32=True))


@negative("tf32")
def tf32_off_on_volta() -> Case:
    summary = fp32_no_autocast(matmul_precision="highest", cuda_matmul_tf32=False)
    summary.facts["device"].update(capability=[7, 0], name="Tesla V100-SXM2-32GB")
    return Case(summary)


@negative("tf32")
def tf32_off_under_autocast() -> Case:
    return Case(with_facts(healthy(), torch=torch_flags(matmul_precision="highest", cuda_matmul_tf32=False)))


@negative("tf32")
def tf32_off_bf16_parameters() -> Case:
    summary = fp32_no_autocast(matmul_precision="highest", cuda_matmul_tf32=False)
    summary.facts["models"][0]["dtypes"] = {"bfloat16": 10}
    return Case(summary)


@negative("tf32")
def tf32_off_autocast_not_probed() -> Case:
    summary = fp32_no_autocast(matmul_precision="highest", cuda_matmul_tf32=False)
    del summary.facts["autocast"]
    return Case(summary)


@positive(
    "cudnn.benchmark", COMPUTE, "5 convolution layer(s), fixed input shape(s) [32, 3, 224, 224] in the probed steps"
)
def benchmark_off() -> Case:
    return Case(with_facts(healthy(), torch=torch_flags(cudnn_benchmark=False)))


@negative("cudnn.benchmark")
def benchmark_off_varying_shapes() -> Case:
    inputs = [IMAGE, {**IMAGE, "shape": [32, 3, 256, 256]}]
    return Case(with_facts(healthy(), torch=torch_flags(cudnn_benchmark=False), inputs=inputs))


@negative("cudnn.benchmark")
def benchmark_off_no_convs() -> Case:
    return Case(with_facts(healthy(), torch=torch_flags(cudnn_benchmark=False), models=[model_fact(convs=0)]))


@negative("cudnn.benchmark")
def benchmark_off_on_cpu() -> Case:
    facts = {"torch": torch_flags(cudnn_benchmark=False), "inputs": [IMAGE], "models": [model_fact()]}
    return Case(cpu_summary(facts=facts))


@positive(
    "cudnn.benchmark_varying", COMPUTE, "2 input shapes in the probed steps ([32, 3, 224, 224], [32, 3, 256, 256])"
)
def benchmark_on_varying_shapes() -> Case:
    return Case(with_facts(healthy(), inputs=[IMAGE, {**IMAGE, "shape": [32, 3, 256, 256]}]))


@negative("cudnn.benchmark_varying")
def benchmark_off_varying() -> Case:
    inputs = [IMAGE, {**IMAGE, "shape": [32, 3, 256, 256]}]
    return Case(with_facts(healthy(), torch=torch_flags(cudnn_benchmark=False), inputs=inputs))


@positive("channels_last", COMPUTE, "4-D inputs are NCHW")
def nchw_under_autocast() -> Case:
    return Case(with_facts(healthy(), inputs=[{**IMAGE, "channels_last": False}]))


@negative("channels_last")
def nchw_without_autocast() -> Case:
    return Case(with_facts(healthy(), inputs=[{**IMAGE, "channels_last": False}], autocast={}))


@negative("channels_last")
def no_4d_inputs() -> Case:
    return Case(with_facts(healthy(), inputs=[{"shape": [32, 512], "dtype": "float32", "device": "cuda"}]))


def set_share(summary: RunSummary, phase: str, share: float) -> RunSummary:
    """Give a phase this share of the step on both clocks."""
    summary.phases[phase] = dataclasses.replace(
        summary.phases[phase], share=share, mean_ms=share * STEP_MS, device_share=share, device_mean_ms=share * STEP_MS
    )
    return summary


@positive("zero_grad.set_to_none", 0.03, "zero_grad takes 3.00 ms per step (3%)")
def zero_grad_keeps() -> Case:
    return Case(with_facts(healthy(), zero_grad={"set_to_none": False}))


@negative("zero_grad.set_to_none")
def zero_grad_keeps_in_no_time() -> Case:
    return Case(set_share(with_facts(healthy(), zero_grad={"set_to_none": False}), "zero_grad", 0.01))


@negative("zero_grad.set_to_none")
def zero_grad_not_seen() -> Case:
    summary = healthy()
    del summary.facts["zero_grad"]
    return Case(summary, [LintHit("zero_grad_keep", 9, "opt.zero_grad(set_to_none=False)")])


@positive("debug.anomaly", COMPUTE, "anomaly detection was on during the measured steps")
def anomaly_on() -> Case:
    return Case(with_facts(healthy(), torch=torch_flags(anomaly=True)))


@positive("debug.anomaly", 0.7, "line 3: torch.autograd.set_detect_anomaly(True)")
def anomaly_in_script_only() -> Case:
    return Case(cpu_summary(), [LintHit("anomaly", 3, "torch.autograd.set_detect_anomaly(True)")])


@negative("debug.anomaly")
def anomaly_in_source_but_off_at_runtime() -> Case:
    return Case(healthy(), [LintHit("anomaly", 3, "torch.autograd.set_detect_anomaly(args.debug)")])


@positive("debug.profiler", None, "a torch profiler was recording during the measured steps")
def profiler_on() -> Case:
    return Case(with_facts(healthy(), torch=torch_flags(profiler=True)))


@negative("debug.profiler")
def profiler_in_source_only() -> Case:
    return Case(healthy(), [LintHit("profiler", 20, "with torch.profiler.profile() as prof:")])


@positive("debug.gradcheck", None, "line 7: torch.autograd.gradcheck(f, (x,))")
def gradcheck_in_script() -> Case:
    return Case(healthy(), [LintHit("gradcheck", 7, "torch.autograd.gradcheck(f, (x,))")])


@negative("debug.gradcheck")
def other_lint_only() -> Case:
    return Case(healthy(), [LintHit("checkpoint", 7, "checkpoint(block, x)")])


@positive("debug.deterministic", COMPUTE, "deterministic_algorithms and cudnn_deterministic on")
def deterministic_on() -> Case:
    return Case(with_facts(healthy(), torch=torch_flags(deterministic_algorithms=True, cudnn_deterministic=True)))


@negative("debug.deterministic")
def deterministic_on_cpu() -> Case:
    return Case(cpu_summary(facts={"torch": torch_flags(deterministic_algorithms=True)}))


@positive(
    "precision.bf16", COMPUTE, "NVIDIA A100-SXM4-80GB supports bfloat16; the model trains in float32 with no autocast"
)
def float32_on_ampere() -> Case:
    return Case(fp32_no_autocast())


@negative("precision.bf16")
def float32_without_bf16() -> Case:
    summary = fp32_no_autocast()
    summary.facts["device"].update(capability=[7, 0], name="Tesla V100-SXM2-32GB", bf16=False)
    return Case(summary)


@negative("precision.bf16")
def bf16_autocast_already() -> Case:
    return Case(healthy())


@positive(
    "sdpa.math", COMPUTE, "no fused attention kernel accepts the inputs (float32 inputs, an explicit attention mask)"
)
def attention_on_math_kernel() -> Case:
    math = {"dtype": "float32", "head_dim": 64, "mask": True, "flash": False, "efficient": False, "cudnn": False}
    return Case(with_facts(healthy(), sdpa=[FLASH, math]))


@negative("sdpa.math")
def attention_with_efficient_kernel_only() -> Case:
    efficient = {**FLASH, "dtype": "float32", "flash": False, "efficient": True}
    return Case(with_facts(healthy(), sdpa=[efficient]))


def dynamo(**changes: Any) -> dict[str, Any]:
    return {**healthy_facts()["dynamo"], **changes}


@positive("compile.recompile_limit", None, "2 function(s) hit the recompile limit")
def recompile_limit() -> Case:
    return Case(with_facts(healthy(), dynamo=dynamo(recompile_limit_hits=2)))


@negative("compile.recompile_limit")
def no_compile() -> Case:
    summary = healthy()
    del summary.facts["dynamo"]
    return Case(summary)


@positive("compile.graph_breaks", None, "5× print (builtin)")
def graph_breaks() -> Case:
    return Case(with_facts(healthy(), dynamo=dynamo(graph_breaks={"Tensor.item": 3, "print (builtin)": 5})))


@negative("compile.graph_breaks")
def compiled_without_breaks() -> Case:
    return Case(healthy())


@positive("memory.checkpointing", 0.3, "12 checkpointed region(s) per step")
def checkpointing_with_headroom() -> Case:
    summary = healthy(counters={"checkpoint_calls": 12.0})
    summary.facts["device"]["peak_allocated_mb"] = 20480.0  # 25%
    return Case(summary)


@negative("memory.checkpointing")
def checkpointing_near_capacity() -> Case:
    return Case(healthy(counters={"checkpoint_calls": 12.0}))  # peak 73%


@negative("memory.checkpointing")
def headroom_without_checkpointing() -> Case:
    summary = healthy()
    summary.facts["device"]["peak_allocated_mb"] = 20480.0
    return Case(summary)


@positive("memory.batch_size", None, "peak memory is 10% of the device")
def small_batch() -> Case:
    summary = healthy()
    summary.facts["device"]["peak_allocated_mb"] = 8192.0
    return Case(summary)


@negative("memory.batch_size")
def batch_uses_a_third() -> Case:
    summary = healthy()
    summary.facts["device"]["peak_allocated_mb"] = 27000.0  # 33%
    return Case(summary)


@negative("memory.batch_size")
def small_batch_but_data_bound() -> Case:
    summary = make_summary(DATA_BOUND, timing="cuda", facts={"device": device_fact(peak_allocated_mb=8192.0)})
    return Case(summary)


@positive("memory.alloc_retries", None, "7 allocator retries (cache flushes)")
def alloc_retries() -> Case:
    summary = healthy()
    summary.facts["device"]["alloc_retries"] = 7
    return Case(summary)


@negative("memory.alloc_retries")
def no_alloc_retries() -> Case:
    return Case(healthy())


@positive("host.sync", HOST_IDLE, "3.0 host-device syncs per step")
def syncs_on_gpu() -> Case:
    return Case(healthy(counters={"host_syncs": 3.0}))


@positive("host.sync", None, "2.0 .item()/.tolist() calls per step in the script")
def item_in_cpu_loop() -> Case:
    phases = {"data_wait": 0.1, "forward": 0.3, "backward": 0.4, "optimizer": 0.1, "sync": 0.05, "other": 0.05}
    summary = cpu_summary(phases, counters={"item_calls": 2.0})
    return Case(summary, [LintHit("loop_sync", 54, "total += loss.item()")])


@negative("host.sync")
def sync_every_other_step() -> Case:
    return Case(healthy(counters={"host_syncs": 0.5}))


@negative("host.sync")
def item_outside_the_loop_on_cpu() -> Case:
    return Case(cpu_summary(counters={"item_calls": 2.0}))  # no loop_sync hit: the reads are not in the loop


LAUNCH_GPU = {"h2d": 0.02, "forward": 0.1, "backward": 0.15, "optimizer": 0.03, "zero_grad": 0.01}
LAUNCH = "GPU 0 had a kernel running 97% of the time but drew 90 W of its 400 W limit (22%)"


@positive("host.launch_bound", 0.64, "the GPU had no work for 64% of the step outside data waits")
def gpu_starved() -> Case:
    return Case(healthy(device=LAUNCH_GPU))  # busy 0.29, data 0.07


@positive("host.launch_bound", HOST_IDLE, LAUNCH)
def launch_bound_signal() -> Case:
    return Case(healthy(signals=[{"id": "launch_bound", "evidence": LAUNCH}]))


@negative("host.launch_bound")
def host_timed_run() -> Case:
    return Case(cpu_summary({"forward": 0.1, "backward": 0.1, "sync": 0.3, "other": 0.5}))


@positive("host.threads", None, "32 torch threads × 2 rank(s) for a 16 usable cores")
def threads_oversubscribed() -> Case:
    return Case(with_facts(healthy(), threads=threads_fact(torch_threads=32, local_ranks=2)))


@positive("host.threads", None, "set in the environment: OMP_NUM_THREADS=8")
def threads_over_quota() -> Case:
    return Case(
        with_facts(healthy(world_size=1), threads=threads_fact(torch_threads=8, cpu_quota=2.5, OMP_NUM_THREADS="8"))
    )


@negative("host.threads")
def threads_fill_the_cores() -> Case:
    return Case(with_facts(healthy(), threads=threads_fact(torch_threads=8, local_ranks=2)))  # 8 × 2 ranks = 16 cores


@negative("host.threads")
def threads_within_fractional_quota() -> Case:
    return Case(with_facts(healthy(world_size=1), threads=threads_fact(torch_threads=2, cpu_quota=1.5)))


def malloc_fact(faults_per_step: float = 4000, **changes: Any) -> dict[str, Any]:
    return {"allocator": "glibc", "faults_per_step": faults_per_step, "us_per_fault": 4.5, "tuned": [], **changes}


@positive(
    "host.malloc_churn",
    0.18,  # 4,000 faults × 4.5 µs = 18 ms of a 100 ms step
    "4,000 minor page faults a step in the training process, 4.5 µs each measured here (a 256 KB block mapped, "
    "written and unmapped): 18% of the step",
)
def malloc_churning() -> Case:
    return Case(with_facts(cpu_summary(), malloc=malloc_fact()))


@negative("host.malloc_churn")
def malloc_churn_below_3_percent() -> Case:
    return Case(with_facts(cpu_summary(), malloc=malloc_fact(600)))  # 2.7 ms of 100


@negative("host.malloc_churn")
def malloc_thresholds_set_in_the_environment() -> Case:
    return Case(with_facts(cpu_summary(), malloc=malloc_fact(tuned=["MALLOC_TRIM_THRESHOLD_=67108864"])))


def hot_row(code: str, calls: str | None, share: float = 0.5, samples: int = 50, **extra: Any) -> dict[str, Any]:
    """A stack-sampler hotspot row at train.py:42 taking ``share`` of its phase's samples."""
    row = {"file": "train.py", "line": 42, "function": "main", "code": code, "calls": calls, "share": share}
    return {**row, "samples": samples, "ms_per_step": 40.0, **extra}


def hot_case(rows: dict[str, list[dict[str, Any]]], phases: dict[str, float] | None = None) -> Case:
    summary = cpu_summary(phases or {"forward": 0.1, "backward": 0.1, "other": 0.8})
    summary.hotspots = {"rate_hz": 100.0, "samples": 1000, "phases": rows}
    return Case(summary)


SAVE_LINE = "train.py:42 torch.save(state, path) [torch.serialization.save]"
SCALAR = "torch.utils.tensorboard.writer.SummaryWriter.add_scalar"


def hot_evidence(phase: str, line: str, of_phase: int, of_step: int) -> str:
    return f"{phase}: {line} is {of_phase}% of {phase}, {of_step}% of the step (40.0 ms per step, 50 stack samples)"


@positive("host.checkpoint_every_step", 0.4, hot_evidence("other", SAVE_LINE, 50, 40))
def torch_save_in_other() -> Case:
    return hot_case({"other": [hot_row("torch.save(state, path)", "torch.serialization.save")]})


@positive("host.checkpoint_every_step", 0.4, hot_evidence("other", "train.py:42 time.sleep(0.02)", 50, 40))
def save_function_in_other() -> Case:
    return hot_case({"other": [hot_row("time.sleep(0.02)", None, function="save_checkpoint")]})


@negative("host.checkpoint_every_step")
def small_save() -> Case:  # 5% of a 80% other: 4% of the step
    return hot_case({"other": [hot_row("torch.save(state, path)", "torch.serialization.save", share=0.05)]})


@negative("host.checkpoint_every_step")
def save_seen_in_few_samples() -> Case:
    return hot_case({"other": [hot_row("torch.save(state, path)", "torch.serialization.save", samples=3)]})


@positive(
    "host.log_every_step",
    0.4,
    hot_evidence("other", "train.py:42 print(f'loss {loss}') [torch._tensor.Tensor.__format__]", 50, 40),
)
def print_in_other() -> Case:
    return hot_case({"other": [hot_row("print(f'loss {loss}')", "torch._tensor.Tensor.__format__")]})


@positive(
    "host.log_every_step",
    0.4,
    hot_evidence("other", f"train.py:42 writer.add_scalar('loss', loss, step) [{SCALAR}]", 50, 40),
)
def tensorboard_in_other() -> Case:
    row = hot_row("writer.add_scalar('loss', loss, step)", SCALAR)
    return hot_case({"other": [row]})


@negative("host.log_every_step")
def print_in_forward() -> Case:  # a print inside the model is forward time: not what this rule reads
    return hot_case({"forward": [hot_row("print(x.shape)", None)]})


@negative("host.data_in_loop")
def dataset_code_in_main_process() -> Case:  # a Dataset in the training process: loader.num_workers says it
    row = hot_row("img = rotate(img)", "scipy.ndimage.rotate", function="Images.__getitem__", in_loader=True)
    return hot_case({"data_wait": [row]}, {"data_wait": 0.6, "forward": 0.2, "other": 0.2})


@positive("host.data_in_loop", 0.4, hot_evidence("other", "train.py:42 batch = augment(batch)", 50, 40))
def augmentation_in_loop() -> Case:
    return hot_case({"other": [hot_row("batch = augment(batch)", None, function="augment")]})


@negative("host.data_in_loop")
def waiting_on_workers() -> Case:  # the loop's `for` line blocked on worker processes: no data code of the user's
    row = hot_row("for x, y in loader:", "torch.utils.data.dataloader._BaseDataLoaderIter.__next__")
    return hot_case({"data_wait": [row]}, {"data_wait": 0.6, "forward": 0.2, "other": 0.2})


def ddp_model(**ddp: Any) -> dict[str, Any]:
    fact = model_fact()
    fact["ddp"].update(ddp)
    return fact


@positive(
    "ddp.find_unused_parameters",
    0.3,
    "the parameter audit over 5 backward pass(es) found no parameter without a gradient",
)
def find_unused_needlessly() -> Case:
    summary = with_facts(healthy(), models=[ddp_model(find_unused_parameters=True)])
    return Case(
        summary, [LintHit("find_unused_parameters", 40, "DistributedDataParallel(m, find_unused_parameters=True)")]
    )


@negative("ddp.find_unused_parameters")
def find_unused_with_unused_parameter() -> Case:
    unused = [{"name": "aux_head.weight", "module": "aux_head", "numel": 512, "aliases": [], "reached_steps": None}]
    summary = with_facts(healthy(params=[audit(unused=unused)]), models=[ddp_model(find_unused_parameters=True)])
    return Case(summary)


@negative("ddp.find_unused_parameters")
def find_unused_with_conditional_parameter() -> Case:
    conditional = [{"name": "branch.weight", "module": "branch", "numel": 64, "aliases": [], "reached_steps": 2}]
    summary = with_facts(
        healthy(params=[audit(conditional=conditional)]), models=[ddp_model(find_unused_parameters=True)]
    )
    return Case(summary)


@negative("ddp.find_unused_parameters")
def find_unused_without_audit() -> Case:
    return Case(with_facts(healthy(params=[]), models=[ddp_model(find_unused_parameters=True)]))


@positive("ddp.gradient_as_bucket_view", 0.45, "gradient_as_bucket_view=False (bucket_cap_mb=25)")
def gradients_copied_into_buckets() -> Case:
    # 3B parameters: copying their gradients twice could take the whole backward (45% of the step).
    model = {**ddp_model(gradient_as_bucket_view=False), "params": 3_000_000_000}
    return Case(with_facts(healthy(), models=[model]))


@negative("ddp.gradient_as_bucket_view")
def too_few_gradients_to_copy() -> Case:
    # 25M parameters: two copies of 100 MB at 200 GB/s are 1 ms of a 100 ms step, under the 2% worth listing.
    return Case(with_facts(healthy(), models=[ddp_model(gradient_as_bucket_view=False)]))


@negative("ddp.gradient_as_bucket_view")
def not_ddp() -> Case:
    return Case(with_facts(healthy(), models=[_plain_model()]))


@positive("fsdp.prefetch", COMPUTE, "backward_prefetch=None, forward_prefetch=False")
def fsdp_without_prefetch() -> Case:
    model = fsdp_model(param_mb=8192.0, backward_prefetch=None, forward_prefetch=False)
    return Case(with_facts(healthy(), models=[model]))


@negative("fsdp.prefetch")
def fsdp_prefetching() -> Case:
    return Case(with_facts(healthy(), models=[fsdp_model(param_mb=8192.0)]))


@positive("fsdp.full_shard_fits", COMPUTE, "an unsharded replica needs ~16.0 GiB of 80 GiB")
def full_shard_of_a_small_model() -> Case:
    # 1 GiB shard × 4 ranks × (param, grad, 2 Adam moments) = 16 GiB, under 60% of 80 GiB
    return Case(with_facts(healthy(world_size=4), models=[fsdp_model(param_mb=1024.0)]))


@negative("fsdp.full_shard_fits")
def full_shard_of_a_large_model() -> Case:
    return Case(with_facts(healthy(world_size=4), models=[fsdp_model(param_mb=4096.0)]))  # 64 GiB > 48 GiB


@negative("fsdp.full_shard_fits")
def shard_grad_op_already() -> Case:
    return Case(with_facts(healthy(world_size=4), models=[fsdp_model("SHARD_GRAD_OP", param_mb=1024.0)]))


@positive("optimizer.fused", 0.08, "AdamW over 10 parameter tensors on cuda, default (foreach) implementation")
def adamw_default() -> Case:
    return Case(with_facts(healthy(), optimizers=[optimizer_fact(fused=None)]))


@positive("optimizer.fused", 0.1, "AdamW over 10 parameter tensors on cpu, per-parameter loop implementation")
def adamw_cpu_loop() -> Case:
    return Case(cpu_summary(facts={"optimizers": [optimizer_fact(fused=None, device="cpu")]}))


@negative("optimizer.fused")
def adamw_default_in_no_time() -> Case:
    return Case(set_share(with_facts(healthy(), optimizers=[optimizer_fact(fused=None)]), "optimizer", 0.01))


@negative("optimizer.fused")
def optimizer_without_fused_kernel() -> Case:
    sgd = optimizer_fact(type="RMSprop", fused=None, has_fused=False, foreach=None)
    return Case(with_facts(healthy(), optimizers=[sgd]))  # on CUDA the default is foreach: nothing to do


@positive("optimizer.foreach", 0.08, "RMSprop over 10 parameter tensors runs its per-parameter loop")
def rmsprop_foreach_off() -> Case:
    opt = optimizer_fact(type="RMSprop", fused=None, has_fused=False, foreach=False)
    return Case(with_facts(healthy(), optimizers=[opt]))


@negative("optimizer.foreach")
def rmsprop_foreach_on() -> Case:
    opt = optimizer_fact(type="RMSprop", fused=None, has_fused=False, foreach=True)
    return Case(with_facts(healthy(), optimizers=[opt]))


@positive("hygiene.compile_in_window", None, "3 graph(s) compiled during the measured steps")
def compiled_while_measuring() -> Case:
    return Case(with_facts(healthy(), dynamo=dynamo(graphs=5, graphs_in_window=3)))


@negative("hygiene.compile_in_window")
def compile_window_unknown() -> Case:
    return Case(with_facts(healthy(), dynamo=dynamo(graphs_in_window=None)))


@positive("hygiene.warmup", None, "step time p95 350.0 ms against a median of 100.0 ms")
def too_little_warmup() -> Case:
    return Case(healthy(warmup=1, stats={"total": {"p95_ms": 350.0}}))


@negative("hygiene.warmup")
def slow_tail_after_enough_warmup() -> Case:
    return Case(healthy(warmup=5, stats={"total": {"p95_ms": 350.0}}))


@negative("hygiene.warmup")
def slow_steps_at_epoch_restarts() -> Case:
    # The slow tail comes from each epoch's start (new workers), not from too short a warm-up.
    return Case(healthy(warmup=1, stats={"total": {"p95_ms": 350.0}}, epochs=_epochs([400.0, 400.0])))


@positive("hygiene.warmup", None, "step time p95 350.0 ms against a median of 100.0 ms")
def too_little_warmup_slow_first_steps() -> Case:  # the series shows it: the first measured steps are the slow ones
    summary = healthy(warmup=1, stats={"total": {"p95_ms": 350.0}})
    summary.series = StepSeries(1, [900.0, 400.0, 350.0, 300.0, *[100.0] * 16])
    return Case(summary)


@negative("hygiene.warmup")
def slow_steps_spread_over_the_run() -> Case:  # a busy machine or periodic work: more warm-up would not help
    summary = healthy(warmup=1, stats={"total": {"p95_ms": 350.0}})
    summary.series = StepSeries(1, [900.0, 100.0, 100.0, 100.0, *[100.0, 100.0, 100.0, 400.0] * 4])
    return Case(summary)


@negative("hygiene.warmup")
def little_warmup_steady_steps() -> Case:
    return Case(healthy(warmup=1, stats={"total": {"p95_ms": 290.0}}))


def eval_case(share_of_wall: float) -> Case:
    summary = make_summary({"forward": 0.9, "other": 0.1}, measured=40)
    summary.eval = {
        "passes": 4,
        "time_s": 1.0,
        "share_of_wall": share_of_wall,
        "mean_ms": 250.0,
        "median_ms": 250.0,
        "max_ms": 260.0,
        "phases_ms": {"forward": 245.0, "other": 5.0},
        "forwards_per_pass": 30.0,
        "batches_per_pass": 30.0,
    }
    return Case(summary)


@positive(
    "eval.frequency",
    0.74,
    "4 validation pass(es) of 250.0 ms (mean) took 74% of wall time, one every 10 training steps",
)
def validation_most_of_the_time() -> Case:
    return eval_case(0.74)


@negative("eval.frequency")
def validation_now_and_then() -> Case:  # 5% of wall time: not worth trading validation away
    return eval_case(0.05)


def _label(entry: tuple) -> str:
    return f"{entry[0]}:{entry[1].__name__}"


# -- the catalogue against the fixtures --------------------------------------------------------------------------


def test_healthy_run_has_nothing_to_fix():
    fixes, notes = diagnose(Case(healthy()))
    assert (ids(fixes), notes) == ([], [])


@pytest.mark.parametrize(("rule_id", "build", "gain", "evidence"), POSITIVE, ids=[_label(p) for p in POSITIVE])
def test_rule_fires_on_its_fixture(rule_id: str, build: Builder, gain: float | None, evidence: str):
    fixes = fired(build())
    assert rule_id in fixes, f"{rule_id} did not fire; fired: {sorted(fixes)}"
    fix = fixes[rule_id]
    assert fix.gain_bound == gain
    assert evidence in fix.evidence
    entry = next(r for r in CATALOGUE if r.id == rule_id)
    assert (fix.title, fix.why, fix.cost, fix.changes_numerics) == (
        entry.title,
        entry.why,
        entry.cost,
        entry.changes_numerics,
    )
    assert fix.gain_reason  # a bound, or why there is none


def test_the_validation_fix_is_a_share_of_wall_time_not_of_the_step():
    (fix,) = [f for f in diagnose(validation_most_of_the_time())[0] if f.id == "eval.frequency"]
    assert (fix.gain_basis, fix.cost) == ("wall", "config")
    assert fix.evidence[1] == "a pass runs 30 forward(s) over 30 batch(es)"


@pytest.mark.parametrize(
    ("val_share", "data_share", "first"),
    [
        (0.30, 0.25, "loader.num_workers"),  # 25% of the steps' 70% of the wall (17.5%) beats half of 30%
        (0.60, 0.65, "eval.frequency"),  # half of 60% beats 65% of the steps' 40% of the wall (26%)
    ],
)
def test_step_and_wall_fixes_rank_on_one_scale(val_share: float, data_share: float, first: str):
    # A data-bound step with validation passes beside it: both fixes are config. Validating half as often saves
    # half the passes' time; a step fix saves its share of the steps' part of the window.
    case = workers_zero()
    case.summary.phases = make_summary({"data_wait": data_share, "forward": 1 - data_share}).phases
    case.summary.eval = eval_case(val_share).summary.eval
    case.summary.wall = Wall(window_s=10.0, steps_s=10.0 * (1 - val_share), eval_s=10.0 * val_share)
    fixes, _ = diagnose(case)
    assert ids(fixes)[:2] == [first, ({"loader.num_workers", "eval.frequency"} - {first}).pop()]


@pytest.mark.parametrize(("rule_id", "build"), NEGATIVE, ids=[_label(n) for n in NEGATIVE])
def test_rule_is_silent_on_a_near_miss(rule_id: str, build: Builder):
    assert rule_id not in fired(build())


def test_every_rule_has_a_positive_and_a_negative_fixture():
    catalogue = {r.id for r in CATALOGUE}
    assert len(catalogue) == len(CATALOGUE), "duplicate rule ids"
    assert {p[0] for p in POSITIVE} == catalogue
    assert {n[0] for n in NEGATIVE} == catalogue


# Rules that read only the summary's figures or the script's lint, not runtime facts.
SUMMARY_RULES = {
    "loader.num_workers",
    "loader.persistent_workers",
    "loader.prefetch",
    "loader.transform_bound",
    "loader.io_bound",
    "loader.batched_tensors",
    "debug.anomaly",
    "debug.gradcheck",
    "host.sync",
    "host.launch_bound",
    "hygiene.warmup",
    "host.checkpoint_every_step",  # these three read the summary's hotspots
    "host.log_every_step",
    "host.data_in_loop",
    "eval.frequency",  # reads the summary's validation passes
}


@pytest.mark.parametrize(("rule_id", "build", "gain", "evidence"), POSITIVE, ids=[_label(p) for p in POSITIVE])
def test_absent_facts_silence_every_fact_rule(rule_id: str, build: Builder, gain: float | None, evidence: str):
    case = build()
    case.summary.facts = {}
    fixes, notes = diagnose(case)
    assert notes == []
    assert set(ids(fixes)) <= SUMMARY_RULES
    # Anomaly mode may rest on the runtime flag; more computing workers rest on the cores fact.
    if rule_id in SUMMARY_RULES - {"debug.anomaly"} and build is not workers_two_of_eight_cores:
        assert rule_id in ids(fixes)  # what it rests on is still measured


def test_absent_facts_on_a_busy_summary_give_no_fix():
    summary = make_summary(HOST_SHARES, device=GPU_SHARES, timing="cuda", loaders=[loader()], world_size=2)
    assert diagnose(Case(summary)) == ([], [])


def test_summary_without_phases_or_facts_gives_no_fix():
    assert diagnose(Case(RunSummary())) == ([], [])


# -- rule details the fixtures do not pin ------------------------------------------------------------------------


def test_num_workers_evidence_and_hint_from_the_cores_per_rank():
    fix = fired(workers_zero())["loader.num_workers"]
    assert fix.evidence == [
        "loader 0 (ToyDataset) has num_workers=0",
        "data_wait is 60% of the step (60.0 ms of 100.0 ms)",
    ]
    assert fix.how == (
        "DataLoader(..., num_workers=7, persistent_workers=True) (8 usable cores, 1 rank(s) on this machine)"
    )
    facts = {"threads": threads_fact(cores=8, local_ranks=2)}
    two_ranks = make_summary(DATA_BOUND, loaders=[loader(num_workers=0)], facts=facts, world_size=2)
    hits = [LintHit("num_workers_zero", 31, "DataLoader(ds, batch_size=32)")]
    fix = fired(Case(two_ranks, hits))["loader.num_workers"]
    assert fix.how == (
        "DataLoader(..., num_workers=3, persistent_workers=True) (8 usable cores, 2 rank(s) on this machine)"
    )
    assert fix.evidence[-1] == "line 31: DataLoader(ds, batch_size=32)"


def test_num_workers_without_core_count_keeps_the_generic_change():
    summary = make_summary(DATA_BOUND, loaders=[loader(num_workers=0)])
    entry = next(r for r in CATALOGUE if r.id == "loader.num_workers")
    assert fired(Case(summary))["loader.num_workers"].how == entry.how


def test_num_workers_hint_respects_the_cgroup_quota():
    facts = {"threads": threads_fact(cores=64, cpu_quota=2.0)}
    fix = fired(Case(make_summary(DATA_BOUND, loaders=[loader(num_workers=0)], facts=facts)))["loader.num_workers"]
    assert fix.how == (
        "DataLoader(..., num_workers=1, persistent_workers=True) (2 usable cores, 1 rank(s) on this machine)"
    )
    suggested = int(re.search(r"num_workers=(\d+)", fix.how).group(1))  # type: ignore[union-attr]
    after = make_summary(DATA_BOUND, loaders=[loader(num_workers=suggested)], facts=facts)
    assert "loader.too_many_workers" not in fired(Case(after))


def test_a_fetch_measured_waiting_gets_the_workers_that_overlap_its_waits():
    # The doctor's loader ceiling (the loader alone, num_workers=0) kept the training process busy 12% of the time:
    # the fetch waits (storage, a sleep), so workers past the 2 cores overlap the 60 ms of waiting with the 40 ms
    # rest of the step: ceil(60 / 40) = 2 of them; no host samples (a short run) needed.
    facts = {"threads": threads_fact(cores=2)}
    summary = make_summary(DATA_BOUND, loaders=[loader(num_workers=0)], facts=facts)
    ceiling = {"settings": {"num_workers": 0, "prefetch_factor": None}, "busy_pct": 12.0}
    summary.dataloader = {"loader": ceiling}
    fix = fired(Case(summary))["loader.num_workers"]
    assert fix.how == (
        "DataLoader(..., num_workers=2, persistent_workers=True) (the fetch mostly waits, measured alone it kept "
        "the training process busy 12% of the time: 2 workers overlap 60.0 ms of fetching with the rest of the "
        "step, using no core)"
    )
    assert fix.apply == "loader.num_workers=2"
    # computing, even on a machine so busy that it waited for a CPU half of the time: the cores bound the workers
    summary.dataloader = {"loader": {**ceiling, "busy_pct": 97.0}}
    assert fired(Case(summary))["loader.num_workers"].apply == "loader.num_workers=1"
    # measured with workers already: their hand-over says nothing about the fetch
    summary.dataloader = {"loader": {**ceiling, "settings": {"num_workers": 2}}}
    assert fired(Case(summary))["loader.num_workers"].apply == "loader.num_workers=1"


def test_num_workers_follows_the_sweep_unless_it_was_cut_short():
    facts = {"threads": threads_fact(cores=2)}
    summary = make_summary(DATA_BOUND, loaders=[loader(num_workers=0)], facts=facts)
    w2 = {"num_workers": 2, "prefetch_factor": 2, "pin_memory": False, "persistent_workers": True}
    none = {"num_workers": 0, "prefetch_factor": None, "pin_memory": False, "persistent_workers": False}
    # ranked by this run's step (doctor --sweep, dataloader --against): the training rate is the one cited
    summary.dataloader = {"best": {"settings": w2, "samples_per_s": 900.0, "train_samples_per_s": 450.0, "gain": 0.5}}
    fix = fired(Case(summary))["loader.num_workers"]
    assert fix.apply == "loader.num_workers=2"
    assert fix.how.endswith(
        "(the loader sweep's best: 450 samples/s of this run's step, +50% over the current setting)"
    )
    # a complete sweep in which no worker count beat none: no advice
    summary.dataloader = {"best": {"settings": none, "samples_per_s": 300.0, "gain": 0.0}, "sweep_skipped": []}
    assert "loader.num_workers" not in fired(Case(summary))
    # cut short by its budget before more workers were tried: the advice falls back to the cores
    summary.dataloader["sweep_skipped"] = ["DataLoader(..., num_workers=2, ...): the 15 s budget ran out"]
    assert fired(Case(summary))["loader.num_workers"].apply == "loader.num_workers=1"


def test_a_worker_fix_applies_every_setting_its_advice_names():
    # A count alone restarts all the workers every epoch (on a 64-batch epoch of 8 sleeping workers that cost more
    # than the epoch's steps): --verify must measure the advice, persistent workers included, and the sweep's
    # prefetch and pinning where it measured them.
    facts = {"threads": threads_fact(cores=2)}
    plain = loader(num_workers=0, pin_memory=False, persistent_workers=False, prefetch_factor=None)
    summary = make_summary(DATA_BOUND, loaders=[plain], facts=facts)
    summary.dataloader = {"loader": {"settings": {"num_workers": 0, "prefetch_factor": None}, "busy_pct": 12.0}}
    fix = fired(Case(summary))["loader.num_workers"]
    assert fix.apply == "loader.num_workers=2,loader.persistent_workers"
    assert parse_fixes([fix.apply]) == [
        {"id": "loader.num_workers", "value": 2},
        {"id": "loader.persistent_workers", "value": True},
    ]
    best = {"num_workers": 8, "prefetch_factor": 4, "pin_memory": True, "persistent_workers": True}
    summary.dataloader = {"best": {"settings": best, "samples_per_s": 900.0, "gain": 2.0}}
    fix = fired(Case(summary))["loader.num_workers"]
    assert fix.apply == "loader.num_workers=8,loader.persistent_workers,loader.prefetch=4,loader.pin_memory"
    # what the sweep's best did not change is not applied: there is nothing to measure in it
    best = {"num_workers": 8, "prefetch_factor": 2, "pin_memory": False, "persistent_workers": False}
    summary.dataloader = {"best": {"settings": best, "samples_per_s": 900.0, "gain": 2.0}}
    assert fired(Case(summary))["loader.num_workers"].apply == "loader.num_workers=8"
    # more workers for a loader that has some but cannot keep up: persistent ones too
    eight = {"threads": threads_fact(cores=8)}
    summary = make_summary(DATA_BOUND, loaders=[loader(num_workers=2, persistent_workers=False)], facts=eight)
    summary.dataloader = SLOW_ALONE
    assert fired(Case(summary))["loader.num_workers"].apply.endswith(",loader.persistent_workers")


def test_persistent_workers_share_counts_only_restarts():
    fix = fired(restarted_workers())["loader.persistent_workers"]
    assert fix.evidence == [
        "2 epoch restart(s) of loader 0 (ToyDataset, num_workers=4) stalled 600 ms each before the first batch",
        "the stalls are 4% of the time spent in those epochs",
    ]


def test_persistent_workers_names_the_restarting_loader_waited_on_most():
    # The truth generator's c001 beside busy loops: three loaders restart their workers at every epoch; naming them
    # all named loaders the steps waited on less (the product's invariant caught it).
    loaders = [
        dataclasses.replace(loader(persistent_workers=False, index=i), fetch_s=s)
        for i, s in enumerate((0.33, 0.38, 0.35))
    ]
    epochs = [e for i in range(3) for e in _epochs([500.0, 600.0, 600.0], loader_index=i)]
    fix = fired(Case(healthy(loaders=loaders, epochs=epochs)))["loader.persistent_workers"]
    assert fix.evidence[0] == (
        "6 epoch restart(s) of loader 1 (ToyDataset, num_workers=4) and 2 other loader(s) stalled 600 ms each before "
        "the first batch"
    )


def test_pin_memory_notes_non_blocking_copies_from_pageable_memory():
    summary = healthy(loaders=[loader(pin_memory=False)])
    summary.facts["h2d"]["pinned_source"] = 0  # 40 non-blocking copies, none from pinned memory
    fix = fired(Case(summary))["loader.pin_memory"]
    assert fix.evidence == [
        "loader 0 (ToyDataset) has pin_memory=False and its batches are copied to the GPU",
        "h2d is 2% of the step (2.00 ms)",
        "the copies ask for non_blocking=True, which pageable memory cannot honour",
    ]
    assert "the copies ask" not in " ".join(fired(unpinned())["loader.pin_memory"].evidence)


def test_prefetch_hint_doubles_a_deep_buffer():
    assert fired(bursty_fetches())["loader.prefetch"].how == "DataLoader(..., prefetch_factor=4) or more workers"
    deep = make_summary(PREFETCH_PHASES, loaders=[loader(prefetch_factor=4)], stats=BURSTY)
    assert fired(Case(deep))["loader.prefetch"].how == "DataLoader(..., prefetch_factor=8) or more workers"


def test_too_many_workers_counts_every_rank_on_the_cores():
    facts = {"threads": threads_fact(cores=8, local_ranks=2)}
    summary = healthy(loaders=[loader(num_workers=5)], facts=facts, world_size=2)
    fix = fired(Case(summary))["loader.too_many_workers"]
    assert fix.evidence == ["loader 0 (ToyDataset): 5 workers × 2 rank(s) for 8 usable cores"]


def test_threads_fact_without_local_ranks_counts_one_rank():
    threads = threads_fact(cores=8)
    del threads["local_ranks"]  # not launched by torchrun
    summary = healthy(loaders=[loader(num_workers=5)], facts={"threads": threads}, world_size=2)
    assert Case(summary).local_ranks() == 1
    assert "loader.too_many_workers" not in fired(Case(summary))  # 5 workers × 1 rank on 8 cores


def test_a_multi_node_run_is_judged_per_machine():
    # 16 ranks on two machines, 8 per machine, 64 cores each: the other machine's ranks use their own cores.
    threads = threads_fact(torch_threads=8, cores=64, local_ranks=8)
    starved = make_summary(DATA_BOUND, loaders=[loader(num_workers=0)], facts={"threads": threads}, world_size=16)
    assert fired(Case(starved))["loader.num_workers"].how == (
        "DataLoader(..., num_workers=7, persistent_workers=True) (64 usable cores, 8 rank(s) on this machine)"
    )
    fitting = healthy(loaders=[loader(num_workers=8)], facts={"threads": threads}, world_size=16)
    assert "loader.too_many_workers" not in fired(Case(fitting))  # 8 workers × 8 ranks = 64 cores
    assert "host.threads" not in fired(Case(fitting))  # 8 threads × 8 ranks = 64 cores
    over = healthy(
        loaders=[loader(num_workers=9)],
        facts={"threads": threads_fact(torch_threads=9, cores=64, local_ranks=8)},
        world_size=16,
    )
    fixes = fired(Case(over))
    assert fixes["loader.too_many_workers"].evidence == [
        "loader 0 (ToyDataset): 9 workers × 8 rank(s) for 64 usable cores"
    ]
    assert fixes["host.threads"].evidence == ["9 torch threads × 8 rank(s) for a 64 usable cores"]
    assert fixes["host.threads"].how == "torch.set_num_threads(8) (or OMP_NUM_THREADS)"
    assert fixes["host.threads"].apply == "host.threads=8"  # what --verify and tune measure


def test_graph_breaks_are_listed_most_frequent_first():
    assert fired(graph_breaks())["compile.graph_breaks"].evidence == [
        "8 graph break(s)",
        "5× print (builtin)",
        "3× Tensor.item",
    ]


def test_sdpa_names_an_odd_head_dim():
    odd = {"dtype": "bfloat16", "head_dim": 300, "mask": False, "flash": False, "efficient": False, "cudnn": False}
    fix = fired(Case(with_facts(healthy(), sdpa=[odd])))["sdpa.math"]
    assert fix.evidence == ["no fused attention kernel accepts the inputs (head_dim 300)"]


def test_threads_hint_divides_the_quota_among_ranks():
    assert fired(threads_oversubscribed())["host.threads"].how == "torch.set_num_threads(8) (or OMP_NUM_THREADS)"
    fix = fired(threads_over_quota())["host.threads"]
    assert fix.evidence[0] == "8 torch threads × 1 rank(s) for a cgroup quota of 2.5 cores"
    assert fix.how == "torch.set_num_threads(2) (or OMP_NUM_THREADS)"


def test_host_sync_on_gpu_cites_the_loop_line():
    hits = [LintHit("loop_sync", 54, "total += loss.item()")]
    fix = fired(Case(healthy(counters={"host_syncs": 3.0}), hits))["host.sync"]
    assert fix.evidence == [
        "3.0 host-device syncs per step",
        "the GPU had no work for 7% of the step",
        "line 54: total += loss.item()",
    ]


def test_host_sync_on_cpu_has_no_bound():
    fix = fired(item_in_cpu_loop())["host.sync"]  # the run spent 5% in sync: not what a GPU would lose
    assert (fix.gain_bound, fix.gain_reason) == (
        None,
        "on this CPU run a scalar read waits for no device, so it cannot be bounded here; on a GPU it stalls each step",
    )
    assert fix.evidence == ["2.0 .item()/.tolist() calls per step in the script", "line 54: total += loss.item()"]


def test_anomaly_without_measured_steps_has_no_bound():
    summary = cpu_summary(measured=0)
    fix = fired(Case(summary, [LintHit("anomaly", 3, "torch.autograd.set_detect_anomaly(True)")]))["debug.anomaly"]
    assert fix.gain_bound is None
    assert fix.evidence == ["the script enables it", "line 3: torch.autograd.set_detect_anomaly(True)"]


def test_lint_evidence_is_capped_at_three_lines():
    hits = [LintHit("gradcheck", line, f"gradcheck(f, x{line})") for line in (3, 5, 8, 13)]
    assert fired(Case(healthy(), hits))["debug.gradcheck"].evidence == [
        "line 3: gradcheck(f, x3)",
        "line 5: gradcheck(f, x5)",
        "line 8: gradcheck(f, x8)",
    ]


def test_optimizer_fused_names_the_class_in_its_change():
    assert fired(adamw_default())["optimizer.fused"].how == "torch.optim.AdamW(params, ..., fused=True)"
    assert fired(rmsprop_foreach_off())["optimizer.foreach"].how == "torch.optim.RMSprop(..., foreach=True)"


def test_foreach_left_to_the_default_loops_only_on_cpu():
    cpu = optimizer_fact(type="RMSprop", fused=None, has_fused=False, foreach=None, device="cpu")
    fix = fired(Case(cpu_summary(facts={"optimizers": [cpu]})))["optimizer.foreach"]
    assert fix.gain_bound == 0.1


def test_bf16_is_not_advised_on_volta_even_when_torch_emulates_it():
    summary = fp32_no_autocast()
    summary.facts["device"].update(capability=[7, 0], name="Tesla V100-SXM2-32GB", bf16=True)
    assert "precision.bf16" not in fired(Case(summary))


NOISE = {"shape": [64, 100, 1, 1], "dtype": "float32", "device": "cuda", "channels_last": False}
FAKE_IMAGE = {"shape": [64, 3, 64, 64], "dtype": "float32", "device": "cuda", "channels_last": False}


def gan(inputs: list[dict[str, Any]], **flags: Any) -> Case:
    """A GAN: a generator fed noise and a discriminator fed images, 5 convolutions each."""
    generator = _plain_model() | {"type": "Generator"}
    discriminator = _plain_model() | {"type": "Discriminator"}
    facts = {"models": [generator, discriminator], "inputs": inputs, "autocast": {}, "torch": torch_flags(**flags)}
    return Case(with_facts(healthy(), **facts))


def test_two_models_with_one_fixed_shape_each_are_not_varying():
    inputs = [NOISE | {"model": "Generator"}, FAKE_IMAGE | {"model": "Discriminator"}]
    assert "cudnn.benchmark_varying" not in fired(gan(inputs))
    fix = fired(gan(inputs, cudnn_benchmark=False))["cudnn.benchmark"]
    assert fix.evidence == [
        "10 convolution layer(s), fixed input shape(s) [64, 100, 1, 1], [64, 3, 64, 64] in the probed steps",
        "torch.backends.cudnn.benchmark is False",
    ]


def test_varying_shapes_name_the_model_that_sees_them():
    inputs = [
        NOISE | {"model": "Generator"},
        FAKE_IMAGE | {"model": "Discriminator"},
        {**FAKE_IMAGE, "shape": [64, 3, 128, 128], "model": "Discriminator"},
    ]
    fix = fired(gan(inputs))["cudnn.benchmark_varying"]
    assert fix.evidence == ["Discriminator: 2 input shapes in the probed steps ([64, 3, 64, 64], [64, 3, 128, 128])"]
    assert "cudnn.benchmark" not in fired(gan(inputs, cudnn_benchmark=False))


def test_inputs_without_a_model_name_are_pooled_as_one_model():
    # summaries written before the tracker named the model: every first input counts as the same model's
    fix = fired(gan([NOISE, FAKE_IMAGE]))["cudnn.benchmark_varying"]
    assert fix.evidence == ["2 input shapes in the probed steps ([64, 100, 1, 1], [64, 3, 64, 64])"]
    assert "cudnn.benchmark" not in fired(gan([NOISE, FAKE_IMAGE], cudnn_benchmark=False))


def test_find_unused_needs_an_audit_that_saw_a_backward_pass():
    summary = with_facts(healthy(params=[audit(steps=0)]), models=[ddp_model(find_unused_parameters=True)])
    assert "ddp.find_unused_parameters" not in fired(Case(summary))


# -- ranking and failures ----------------------------------------------------------------------------------------


def test_real_rules_rank_by_gain_for_the_cost_with_unbounded_last():
    summary = fp32_no_autocast(matmul_precision="highest", cuda_matmul_tf32=False)
    summary.facts["optimizers"] = [optimizer_fact(fused=None)]
    summary.facts["threads"] = threads_fact(cpu_quota=4.0)
    summary.meta.world_size = 1
    summary.loaders = [loader(num_workers=8)]
    summary.system = {"signals": [{"id": "io_bound", "evidence": IO}]}
    hits = [LintHit("gradcheck", 7, "torch.autograd.gradcheck(f, (x,))")]
    fixes, notes = diagnose(Case(summary, hits))
    assert notes == []
    assert [(f.id, f.cost, f.gain_bound) for f in fixes] == [
        ("loader.too_many_workers", "config", None),  # oversubscribed workers distort the other figures
        ("tf32", "config", COMPUTE),
        ("precision.bf16", "code", COMPUTE),  # the compute share for a code change: a third of it, above 8%
        ("optimizer.fused", "config", 0.08),
        ("debug.gradcheck", "code", None),
    ]


def _fake(rule_id: str, cost: str, gain: float | None) -> Rule:
    return Rule(rule_id, rule_id, "why", "how", cost, False, lambda case: Finding([rule_id], gain, "reason"))


def test_ranking_is_gain_for_the_cost_then_unbounded(monkeypatch: pytest.MonkeyPatch):
    # a fix that can save under 5% of the step comes after every one that can save more, whatever its cost; the
    # fix whose problem distorts every other figure (oversubscribed threads) is never moved down; the others by
    # their bound over what their cost takes (config 1, code 3, infra 10), unbounded ones last, cheapest first
    fakes = [
        _fake("config.tiny", "config", 0.03),
        _fake("host.threads", "config", 0.01),
        _fake("code.tiny", "code", 0.049),
        _fake("infra.big", "infra", 0.9),
        _fake("code.none", "code", None),
        _fake("config.none", "config", None),
        _fake("code.small", "code", 0.1),
        _fake("config.small", "config", 0.05),
        _fake("config.big", "config", 0.5),
        _fake("code.big", "code", 0.7),
        _fake("silent", "config", 0.9),
    ]
    fakes[-1] = Rule("silent", "silent", "why", "how", "config", False, lambda case: None)
    monkeypatch.setattr(rules, "CATALOGUE", fakes)
    fixes, notes = diagnose(Case(RunSummary()))
    assert notes == []
    assert ids(fixes) == [
        "host.threads",
        "config.big",  # 0.5
        "code.big",  # 0.7 / 3
        "infra.big",  # 0.9 / 10
        "config.small",  # 0.05
        "code.small",  # 0.1 / 3
        "config.none",
        "code.none",
        "config.tiny",
        "code.tiny",
    ]
    unbounded = [f for f in fixes if f.gain_bound is None]
    assert [COSTS.index(f.cost) for f in unbounded] == sorted(COSTS.index(f.cost) for f in unbounded)


def test_gain_bounds_are_clamped_to_a_fraction_and_rounded(monkeypatch: pytest.MonkeyPatch):
    fakes = [_fake("over", "config", 1.7), _fake("under", "config", -0.2), _fake("fine", "config", 0.123456)]
    monkeypatch.setattr(rules, "CATALOGUE", fakes)
    fixes, _ = diagnose(Case(RunSummary()))
    assert [(f.id, f.gain_bound) for f in fixes] == [("over", 1.0), ("fine", 0.1235), ("under", 0.0)]


def test_a_rule_failing_on_malformed_facts_leaves_a_note_and_the_others_run():
    summary = with_facts(healthy(), optimizers=[{"type": "Adam"}], torch=torch_flags(anomaly=True))
    fixes, notes = diagnose(Case(summary))
    assert notes == [
        "rule optimizer.fused could not read the facts (KeyError: 'has_fused')",
        "rule optimizer.foreach could not read the facts (KeyError: 'has_foreach')",
    ]
    assert ids(fixes) == ["debug.anomaly"]


def test_a_device_fact_without_capability_fails_only_the_rules_that_read_it():
    summary = fp32_no_autocast(matmul_precision="highest", cuda_matmul_tf32=False)
    del summary.facts["device"]["capability"]
    summary.facts["optimizers"] = [optimizer_fact(fused=None)]  # a rule that does not read the device
    fixes, notes = diagnose(Case(summary))
    assert notes == [
        "rule tf32 could not read the facts (KeyError: 'capability')",
        "rule precision.bf16 could not read the facts (KeyError: 'capability')",
    ]
    assert ids(fixes) == ["optimizer.fused"]


# -- verdict.refine ------------------------------------------------------------------------------------------------

COMPUTE_VERDICT = Verdict("compute", "high", ["backward is 45% GPU time (45.0 ms of a 100.0 ms step)"])
DATA_VERDICT = Verdict("data", "high", ["data_wait is 60% of the step (60.0 ms of a 100.0 ms step)"])


def test_refine_allocator_retries_make_it_memory():
    summary = healthy(measured=20)
    summary.facts["device"].update(alloc_retries=4, peak_reserved_mb=80100.0)
    assert refine(summary, COMPUTE_VERDICT) == Verdict(
        "memory",
        "medium",
        [
            "4 CUDA allocator retries (cache flushes with a device sync) in 20 steps",
            "peak memory 80100 of 81920 MB reserved",
            *COMPUTE_VERDICT.evidence,
        ],
    )


def test_refine_rare_allocator_retries_change_nothing():
    summary = healthy(measured=40)
    summary.facts["device"]["alloc_retries"] = 1  # 0.025 per step, under 0.05
    assert refine(summary, COMPUTE_VERDICT) == COMPUTE_VERDICT


def test_refine_launch_bound_turns_compute_into_host():
    summary = healthy(signals=[{"id": "launch_bound", "evidence": LAUNCH}])
    assert refine(summary, COMPUTE_VERDICT) == Verdict("host", "medium", [LAUNCH, *COMPUTE_VERDICT.evidence])


def test_refine_launch_bound_yields_to_gpu_work_the_events_measured():
    # float32 matmuls without TF32 kept an H200 88% busy at 232 W of 700: the signal read launch-bound, while the
    # probed steps showed the forward and backward ending far behind the host. The measurement outranks the guess;
    # where the GPU only followed the host, the signal stands.
    summary = healthy(signals=[{"id": "launch_bound", "evidence": LAUNCH}])
    for name in ("forward", "backward"):
        summary.phases[name].device_host_paced = 0.0
    assert refine(summary, COMPUTE_VERDICT) == Verdict("compute", "high", [*COMPUTE_VERDICT.evidence, NOT_LAUNCH_BOUND])
    assert "host.launch_bound" not in fired(Case(summary))
    for name in ("forward", "backward"):
        summary.phases[name].device_host_paced = 0.9
    assert refine(summary, COMPUTE_VERDICT) == Verdict("host", "medium", [LAUNCH, *COMPUTE_VERDICT.evidence])


def test_refine_launch_bound_leaves_a_data_verdict():
    summary = healthy(signals=[{"id": "launch_bound", "evidence": LAUNCH}])
    assert refine(summary, DATA_VERDICT) == DATA_VERDICT


def test_refine_adds_transform_bound_evidence_to_a_data_verdict_only():
    summary = healthy(signals=[{"id": "transform_bound", "evidence": TRANSFORM}])
    assert refine(summary, DATA_VERDICT) == Verdict("data", "high", [*DATA_VERDICT.evidence, TRANSFORM])
    assert refine(summary, COMPUTE_VERDICT) == COMPUTE_VERDICT


def test_refine_adds_io_bound_evidence_to_a_data_verdict():
    summary = healthy(signals=[{"id": "io_bound", "evidence": IO}])
    assert refine(summary, DATA_VERDICT).evidence == [*DATA_VERDICT.evidence, IO]


def test_refine_without_signals_or_facts_changes_nothing():
    for summary in (healthy(), make_summary(DATA_BOUND)):
        for verdict in (COMPUTE_VERDICT, DATA_VERDICT, Verdict("host", "medium", ["other is 50%"])):
            assert refine(summary, verdict) == verdict


def test_refine_cites_throttling_and_the_straggler():
    throttled = "GPU 0 had its clocks held down by thermal in 40% of samples."
    summary = healthy(signals=[{"id": "throttled", "evidence": throttled}])
    summary.cluster = Cluster(2, [0, 1], 640.0, straggler=Straggler(rank=1, phase="data_wait", excess_ms=12.5))
    assert refine(summary, COMPUTE_VERDICT).evidence == [
        *COMPUTE_VERDICT.evidence,
        throttled,
        "rank 1 is the straggler: its data_wait is 12.5 ms above the median of the other ranks",
    ]


def test_refine_names_oversubscribed_threads_in_a_compute_verdict():
    summary = with_facts(healthy(), threads=threads_fact(torch_threads=8, cores=8, local_ranks=2))
    assert refine(summary, COMPUTE_VERDICT) == Verdict(
        COMPUTE_VERDICT.bound,
        COMPUTE_VERDICT.confidence,
        [*COMPUTE_VERDICT.evidence, "16 torch threads across this machine's ranks compete for 8 usable cores"],
    )
    fitting = with_facts(healthy(), threads=threads_fact(torch_threads=4, cores=8, local_ranks=2))
    assert refine(fitting, COMPUTE_VERDICT) == COMPUTE_VERDICT
    assert refine(summary, DATA_VERDICT) == DATA_VERDICT  # threads do not explain a wait for data


def test_refine_weighs_the_loader_ceiling_against_training():
    summary = healthy()
    summary.dataloader = {
        "against_training": {"loader_ceiling": 105.0, "train_rate": 100.0, "headroom": 1.05, "input_bound": True}
    }
    balanced = Verdict("balanced", "medium", ["no part of the step reaches 40%"])
    verdict = refine(summary, balanced)
    assert verdict.bound == "data" and verdict.confidence == "medium"
    assert verdict.evidence[0] == (
        "the loader alone delivers 105.0 samples/s, only 1.05× the 100.0 samples/s training consumed: "
        "the input pipeline is the bottleneck"
    )
    summary.dataloader["against_training"].update(loader_ceiling=400.0, headroom=4.0, input_bound=False)
    assert refine(summary, balanced) == balanced


@pytest.mark.parametrize(
    ("headroom", "says"),
    [
        # data_wait is 80% of the step: a loader fetching in turn with the step would give 1/0.8 = 1.25x
        (1.2, "the loader alone delivers 1.20× what training consumed, as a loader that waits 80% of the step would"),
        (1.7, None),  # between 1.25x and 1.5x of the expected ratio: no claim either way
        (4.0, "yet the loader alone delivers 4.0× what training consumed, more than its 80% wait explains"),
    ],
)
def test_refine_says_whether_the_loader_speed_explains_the_wait(headroom, says):
    summary = healthy()
    summary.phases["data_wait"] = dataclasses.replace(summary.phases["data_wait"], share=0.8, nested=False)
    summary.dataloader = {
        "against_training": {
            "loader_ceiling": 100.0 * headroom,
            "train_rate": 100.0,
            "headroom": headroom,
            "input_bound": False,
        }
    }
    evidence = refine(summary, DATA_VERDICT).evidence
    added = evidence[len(DATA_VERDICT.evidence) :]
    if says is None:
        assert added == []
    else:
        assert len(added) == 1 and added[0].startswith(says), added
