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

# cpu_contention: this job's threads were runnable but waiting for a CPU (run-queue delay, summed over threads, in %
# of wall time). Measured on a 2-core VM (docs/benchmarks.md): a quiet run reads 0-1%; 2 CPU-bound loader workers
# beside 2 intra-op threads 55% (training process) and 81% (workers); a CPU burner on every core 5-21%.
CONTENTION_PCT = 10.0  # the training process's threads, or per busy worker
# Waking up costs run delay too: a thread that sleeps thousands of times a second waits µs in the run queue at each
# wake-up, however quiet the machine, while a thread kept from a CPU waits for someone else's timeslice. So only the
# delay beyond WAKEUP_LATENCY_US per wait counts as waiting for a CPU. Measured on the 2-core VM (2026-11-26, run
# delay / timeslices from schedstat), per wait: a 0.2-0.4 ms sleep loop 4-13 µs quiet, 11-25 µs beside a busy loop on
# each core; a loader sleeping 0.4 ms per sample 5-20 µs (main thread) and 17-32 µs (workers) quiet, its threads
# waiting 4-33% of wall time, and 34-65 µs while busy loops or other jobs loaded the machine. Against that, the main
# thread beside 6 CPU-bound loader workers 97-480 µs (it waits at each wake-up for a core a worker holds), a thread
# that computes beside busy loops 180 µs-7.6 ms. At 50 µs the sleeping loader's delay is all latency and the main
# thread beside its workers keeps about half of its own (97 µs per wait: 34% of wall time, 17% beyond latency).
WAKEUP_LATENCY_US = 50.0
OTHERS_BUSY_PCT = 50.0  # of one core: other processes using at least half a core count as the machine's load
SELF_BUSY_FRACTION = 0.50  # of the usable cores, on average: this job's own bursts fill them (runnable > cores)
STEAL_PCT = 5.0  # of all cores' time taken by the hypervisor


def derive_signals(system: dict[str, Any]) -> list[dict[str, str]]:
    """``[{"id", "evidence"}]`` for launch_bound, transform_bound, io_bound, throttled and cpu_contention, in that
    order (cpu_contention also has ``cause``: ``others``, ``self``, ``both`` or ``workers``)."""
    if (system.get("samples") or 0) < MIN_SAMPLES:
        return []
    gpu = system.get("gpu") or {}
    devices = (gpu.get("devices") or []) if gpu.get("available") else []
    host = system.get("host") or {}
    found = [_launch_bound(d) for d in devices]
    found += [_transform_bound(host, devices, system), _io_bound(host, devices, system)]
    found += [_throttled(d) for d in devices]
    found.append(cpu_contention(host))
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
    # Runnable time is what the workers ask of the CPUs: the time they ran plus the time they waited for a CPU
    # (on a machine shared with other work they get less than their ceiling, yet are no less CPU-bound).
    waiting = host.get("run_delay_workers_pct") or 0.0
    if workers_pct + waiting < WORKERS_PEGGED_FRACTION * ceiling:
        return None
    also = f" and waited {waiting:.0f}% for a CPU while runnable" if waiting >= 0.1 * ceiling else ""
    return _signal(
        "transform_bound",
        f"{gpu} while its {name} used {workers_pct:.0f}% CPU, {workers_pct / ceiling:.0%} of the "
        f"{ceiling:.0f}% they can get{also}: the input transforms cannot keep up.",
    )


def _io_bound(host: dict[str, Any], devices: list[dict[str, Any]], system: dict[str, Any]) -> dict[str, str] | None:
    gpu = _gpu_state(devices, system)
    main_pct, workers_pct = host.get("cpu_util_pct"), host.get("workers_cpu_util_pct")
    if gpu is None or main_pct is None or workers_pct is None:
        return None
    # What a process asks of the CPUs is its run time plus its wait for one: a loader starved by other processes'
    # work computes, it does not wait on storage (seed 2039's c028 beside busy loops: its one computing worker ran
    # 29% and waited for a CPU 19% of the time).
    if main_pct + (cpu_wait_pct(host, "main_thread") or 0.0) >= IO_MAIN_CPU_MAX_PCT:
        return None
    workers = _workers_ceiling(host)
    if workers is None:
        phrase = "it has no worker processes"
    elif workers_pct + (cpu_wait_pct(host, "workers") or 0.0) < IO_WORKERS_CPU_MAX_FRACTION * workers[0]:
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


def cpu_wait_pct(host: dict[str, Any], group: str) -> float | None:
    """How long ``group`` (``main_thread``, ``process`` or ``workers``) waited for a CPU, % of wall time: its run
    delay less WAKEUP_LATENCY_US per wait (the latency of waking up, not a wait for a CPU); the whole run delay where
    the per-wait figure is missing (a summary from before it was measured); None where run delay was not measured."""
    delay, per_wait = host.get(f"run_delay_{group}_pct"), host.get(f"run_delay_{group}_per_wait_us")
    if delay is None or per_wait is None:
        return delay
    return delay * max(0.0, 1.0 - WAKEUP_LATENCY_US / per_wait) if per_wait > 0 else 0.0


def _kept_waiting(host: dict[str, Any], group: str, floor: float) -> bool:
    wait = cpu_wait_pct(host, group)
    return wait is not None and wait >= floor


def _per_wait(host: dict[str, Any], group: str) -> list[str]:
    """``["330 µs per wait"]`` when the group's delay per wait was measured, else ``[]``."""
    per_wait = host.get(f"run_delay_{group}_per_wait_us")
    return [] if per_wait is None else [f"{per_wait:.0f} µs per wait"]


def _process_waited(host: dict[str, Any]) -> str:
    """The phrase for the training process's wait: "the training process's threads waited for a CPU 53% of wall
    time (summed, 310 µs per wait), its main thread 42% (330 µs per wait)", with the figures that were measured."""
    process, summed = host["run_delay_process_pct"], ", ".join(["summed", *_per_wait(host, "process")])
    text = f"the training process's threads waited for a CPU {process:.0f}% of wall time ({summed})"
    main = host.get("run_delay_main_thread_pct")
    if main is None:
        return text
    return text + f", its main thread {main:.0f}%" + "".join(f" ({x})" for x in _per_wait(host, "main_thread"))


def workers_hold_the_cpu(host: dict[str, Any]) -> bool:
    """The main thread waited for a CPU (at least CONTENTION_PCT beyond its wake-ups' latency) while this job's own
    loader workers, not other processes, kept the cores busy: they used at least OTHERS_BUSY_PCT of a core and more
    than other processes did, with no hypervisor steal."""
    workers_cpu = host.get("workers_cpu_util_pct") or 0.0
    others, steal = host.get("others_cpu_util_pct") or 0.0, host.get("steal_pct") or 0.0
    waited = _kept_waiting(host, "main_thread", CONTENTION_PCT)
    return waited and workers_cpu >= OTHERS_BUSY_PCT and workers_cpu > others and steal < STEAL_PCT


def cpu_contention(host: dict[str, Any]) -> dict[str, str] | None:
    """The job's threads waited for a CPU a significant share of the time: the training process's threads (or its
    main thread alone) at least CONTENTION_PCT of wall time (summed over threads), or its loader workers
    CONTENTION_PCT per busy worker, not counting the latency of their wake-ups (``cpu_wait_pct``): a thread that
    wakes often on a quiet machine is not contended.

    ``cause`` says whose load it was: ``workers`` when the main thread waited for the cores this job's own loader
    workers held (``workers_hold_the_cpu``: the wait is the input pipeline's), else ``others`` when processes outside
    this job used at least OTHERS_BUSY_PCT of a core (or the hypervisor stole STEAL_PCT), ``self`` when not (this
    job's own threads and workers outnumber the cores, at least at times), ``both`` when others were busy and the
    job alone also kept SELF_BUSY_FRACTION of its usable cores busy on average."""
    process = host.get("run_delay_process_pct")
    if process is None:
        return None  # not measured (no schedstat)
    busy = max(host.get("workers_busy_avg") or 0.0, 1.0)
    waited = []
    if _kept_waiting(host, "process", CONTENTION_PCT) or _kept_waiting(host, "main_thread", CONTENTION_PCT):
        waited.append(_process_waited(host))
    if _kept_waiting(host, "workers", CONTENTION_PCT * busy) and host.get("workers_max"):
        summed = ", ".join([f"summed over {host['workers_max']} worker(s)", *_per_wait(host, "workers")])
        waited.append(f"its loader workers {host['run_delay_workers_pct']:.0f}% ({summed})")
    if not waited:
        return None
    cores = host.get("cpu_quota") or host.get("cores") or 1
    machine = host.get("machine_cores") or cores
    main_cpu, workers_cpu = host.get("cpu_util_pct") or 0.0, host.get("workers_cpu_util_pct") or 0.0
    others, steal = host.get("others_cpu_util_pct") or 0.0, host.get("steal_pct") or 0.0
    crowded = others >= OTHERS_BUSY_PCT or steal >= STEAL_PCT
    full = main_cpu + workers_cpu >= SELF_BUSY_FRACTION * 100.0 * cores
    cause = ("both" if full else "others") if crowded else "self"
    if workers_hold_the_cpu(host):
        cause = "workers"
    load = host.get("load_avg_1m")
    figures = [f"this job used {main_cpu + workers_cpu:.0f}% CPU of its {cores:g} usable core(s)"]
    figures.append(f"other processes {others:.0f}% of the machine's {machine}")
    if steal >= STEAL_PCT:
        figures.append(f"the hypervisor stole {steal:.0f}%")
    if load is not None:
        figures.append(f"load average {load:.1f}")
    whose = {
        "others": "other processes load the machine",
        "self": "this job's own threads and loader workers outnumber its cores",
        "both": "other processes load the machine and this job's own threads and workers fill its cores",
        "workers": "this job's loader workers hold the cores its main thread waits for",
    }[cause]
    return {
        "id": "cpu_contention",
        "evidence": f"CPU contention ({whose}): {' and '.join(waited)} while runnable; {', '.join(figures)}.",
        "cause": cause,
    }
