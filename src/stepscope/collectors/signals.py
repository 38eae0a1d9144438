"""Signals derived from the system dict alone: what the sampled figures say about the bottleneck.

A pure function of the dict ``Collectors.stop`` returns (so it also runs on summaries from other machines). A
signal is given only when every figure it rests on was measured, over at least ``MIN_SAMPLES`` samples; its
evidence is one sentence with those figures.
"""

from __future__ import annotations

from typing import Any

MIN_SAMPLES = 3  # fewer samples say too little about a whole run

# launch_bound: the GPU is "busy" (a kernel is running most of the time) but draws little power or runs at low SM
# clocks: a trickle of small kernels, each too short to load the device.
BUSY_UTIL_PCT = 80.0
LAUNCH_POWER_FRACTION_MAX = 0.40  # of the enforced power limit
LAUNCH_SM_CLOCK_RATIO_MAX = 0.50  # of the maximum SM clock; not used on a device that was throttled

# transform_bound / io_bound: the GPU waits (or there is none) while the host does or does not work.
IDLE_UTIL_PCT = 50.0
WORKERS_PEGGED_FRACTION = 0.80  # of the workers' CPU ceiling: min(busy workers, usable cores, quota) × 100%
IO_MAIN_CPU_MAX_PCT = 30.0  # of one core
IO_WORKERS_CPU_MAX_FRACTION = 0.30  # of the workers' CPU ceiling

# throttled: clocks held down by heat or the power cap in at least this fraction of samples.
THROTTLE_FRACTION_MIN = 0.10
THROTTLE_REASONS = ("sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake")


def derive_signals(system: dict[str, Any]) -> list[dict[str, str]]:
    """``[{"id", "evidence"}]`` for launch_bound, transform_bound, io_bound and throttled, in that order."""
    if (system.get("samples") or 0) < MIN_SAMPLES:
        return []
    gpu = system.get("gpu") or {}
    devices = (gpu.get("devices") or []) if gpu.get("available") else []
    host = system.get("host") or {}
    found = [_launch_bound(d) for d in devices]
    found += [_transform_bound(host, devices, system), _io_bound(host, devices, system)]
    found += [_throttled(d) for d in devices]
    return [s for s in found if s is not None]


def _signal(signal_id: str, evidence: str) -> dict[str, str]:
    return {"id": signal_id, "evidence": evidence}


def _launch_bound(dev: dict[str, Any]) -> dict[str, str] | None:
    util, power = dev.get("util_avg_pct"), dev.get("power_avg_w")
    limit, ratio = dev.get("power_limit_w"), dev.get("sm_clock_ratio_avg")
    if util is None or util < BUSY_UTIL_PCT:
        return None
    low_power = power is not None and bool(limit) and power < LAUNCH_POWER_FRACTION_MAX * limit
    low_clock = ratio is not None and ratio < LAUNCH_SM_CLOCK_RATIO_MAX and _throttle_reasons(dev)[0] is None
    if not (low_power or low_clock):
        return None
    figures = []
    if power is not None and limit:
        figures.append(f"drew {power:.0f} W of its {limit:.0f} W limit ({power / limit:.0%})")
    if ratio is not None:
        figures.append(f"ran at {ratio:.0%} of its maximum SM clock")
    return _signal(
        "launch_bound",
        f"GPU {dev.get('index')} had a kernel running {util:.0f}% of the time but {' and '.join(figures)}: "
        "a trickle of small kernels keeps it nominally busy.",
    )


def _gpu_state(devices: list[dict[str, Any]], system: dict[str, Any]) -> str | None:
    """A phrase for "the GPU waits" when it does (util below IDLE_UTIL_PCT on every device, or no GPU in use at
    all); None when a GPU is busy or its use is unknown (CUDA in use but NVML unavailable)."""
    if not devices:
        return None if system.get("memory") else "No GPU was in use"
    utils = [d.get("util_avg_pct") for d in devices]
    if None in utils or max(utils) >= IDLE_UTIL_PCT:  # type: ignore[type-var]
        return None
    return " and ".join(f"GPU {d.get('index')} was busy {d['util_avg_pct']:.0f}% of the time" for d in devices)


def _workers_ceiling(host: dict[str, Any]) -> tuple[float, str] | None:
    """The CPU % the workers could use at most, and a phrase naming them: one core per busy worker (idle children
    such as torch.compile's compile workers do not count; at least one), within the usable cores and the quota."""
    workers, busy, cores, quota = (host.get(k) for k in ("workers_max", "workers_busy_avg", "cores", "cpu_quota"))
    if not workers or not cores:
        return None
    count = workers if busy is None else max(busy, 1.0)
    ceiling = 100.0 * min(count, cores, quota if quota is not None else cores)
    name = f"{workers} worker process(es)" if busy is None else f"worker processes ({workers} seen, {busy:g} busy)"
    return ceiling, name


def _transform_bound(
    host: dict[str, Any], devices: list[dict[str, Any]], system: dict[str, Any]
) -> dict[str, str] | None:
    gpu, workers, workers_pct = _gpu_state(devices, system), _workers_ceiling(host), host.get("workers_cpu_util_pct")
    if gpu is None or workers is None or workers_pct is None:
        return None
    ceiling, name = workers
    if workers_pct < WORKERS_PEGGED_FRACTION * ceiling:
        return None
    return _signal(
        "transform_bound",
        f"{gpu} while its {name} used {workers_pct:.0f}% CPU, {workers_pct / ceiling:.0%} of the "
        f"{ceiling:.0f}% they can get: the input transforms cannot keep up.",
    )


def _io_bound(host: dict[str, Any], devices: list[dict[str, Any]], system: dict[str, Any]) -> dict[str, str] | None:
    gpu = _gpu_state(devices, system)
    main_pct, workers_pct = host.get("cpu_util_pct"), host.get("workers_cpu_util_pct")
    if gpu is None or main_pct is None or workers_pct is None or main_pct >= IO_MAIN_CPU_MAX_PCT:
        return None
    workers = _workers_ceiling(host)
    if workers is None:
        phrase = "it has no worker processes"
    elif workers_pct < IO_WORKERS_CPU_MAX_FRACTION * workers[0]:
        ceiling, name = workers
        phrase = f"its {name} {workers_pct:.0f}% ({workers_pct / ceiling:.0%} of {ceiling:.0f}%)"
    else:
        return None
    return _signal(
        "io_bound",
        f"{gpu} while the training process used {main_pct:.0f}% of a core and {phrase}: "
        "everything waits, most likely on storage or the network.",
    )


def _throttle_reasons(dev: dict[str, Any]) -> tuple[str | None, list[str]]:
    """The worst throttle reason at or above THROTTLE_FRACTION_MIN (or None) and all such reasons as "word N%"."""
    throttle = dev.get("throttle") or {}
    hits = sorted(
        ((f, r) for r, f in throttle.items() if r in THROTTLE_REASONS and f >= THROTTLE_FRACTION_MIN), reverse=True
    )
    return (hits[0][1] if hits else None), [f"{r} in {f:.0%}" for f, r in hits]


def _throttled(dev: dict[str, Any]) -> dict[str, str] | None:
    worst, parts = _throttle_reasons(dev)
    if worst is None:
        return None
    figures = []
    if dev.get("temp_max_c") is not None:
        figures.append(f"max {dev['temp_max_c']:.0f} °C")
    if dev.get("power_avg_w") is not None and dev.get("power_limit_w"):
        figures.append(f"mean power {dev['power_avg_w']:.0f} of {dev['power_limit_w']:.0f} W")
    extra = f" ({', '.join(figures)})" if figures else ""
    return _signal(
        "throttled",
        f"GPU {dev.get('index')} had its clocks held down by {' and '.join(parts)} of samples{extra}.",
    )
