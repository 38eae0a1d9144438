"""What does the system sampler cost? CPU time of the sampler thread itself, per sample and as % of one core.

The sampler runs with the real host source (psutil, with --children idle child processes to walk, like DataLoader
workers) and a fake NVML backend with --gpus devices (constant readings: the Python around NVML, not the driver).
Its thread's own CPU clock (pthread_getcpuclockid) is read from the main thread before and after a window of
--window-s seconds at each rate; the main thread sleeps meanwhile. Medians of --repeats windows.

Also: µs per read of each source in a hot loop, and, when a GPU and nvidia-ml-py are present, µs per read of the
real NVML call set (one device).

Target (issue 7): < 1% of one core at 1 Hz.

    python bench/collectors_overhead.py [--repeats 3] [--window-s 10] [--children 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

from stepscope.collectors import NvmlUnavailable, NvmlUnsupported, PynvmlBackend, start_collectors
from stepscope.collectors.gpu import GpuSource
from stepscope.collectors.host import HostSource


class ConstantNvml:
    """An NVML backend answering constants at once (every query the real source makes, energy counter included)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.mj = 0

    def init(self) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def device_count(self) -> int:
        return self.count

    def handle(self, nvml_index: int) -> int:
        return nvml_index

    def uuid(self, handle: int) -> str:
        return f"GPU-{handle:08x}"

    def name(self, handle: int) -> str:
        return "Constant GPU"

    def utilization(self, handle: int) -> tuple[float, float]:
        return 90.0, 40.0

    def sm_clock_mhz(self, handle: int) -> float:
        return 1755.0

    def max_sm_clock_mhz(self, handle: int) -> float:
        return 1980.0

    def power_w(self, handle: int) -> float:
        return 500.0

    def power_limit_w(self, handle: int) -> float:
        return 700.0

    def energy_mj(self, handle: int) -> int:
        self.mj += 1000
        return self.mj

    def memory_mb(self, handle: int) -> tuple[float, float]:
        return 40_000.0, 81_559.0

    def temperature_c(self, handle: int) -> float:
        return 65.0

    def throttle_reasons(self, handle: int) -> int:
        return 0x4


def thread_cpu_s(thread: Any) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def sampler_cost(interval_s: float, window_s: float, gpus: int) -> dict[str, float]:
    """One window: the sampler thread's CPU seconds per sample and per wall second."""
    handle = start_collectors(interval_s=interval_s, devices=list(range(gpus)), nvml=ConstantNvml(gpus))
    thread = handle._thread
    assert thread is not None
    cpu0, wall0 = thread_cpu_s(thread), time.monotonic()
    samples0 = handle._samples
    time.sleep(window_s)
    cpu1, wall1 = thread_cpu_s(thread), time.monotonic()
    samples = handle._samples - samples0
    handle.stop()
    cpu = cpu1 - cpu0
    return {"us_per_sample": 1e6 * cpu / max(samples, 1), "pct_core": 100 * cpu / (wall1 - wall0), "samples": samples}


def read_us(source: Any, n: int) -> float:
    """µs per ``read`` of a started source, in a hot loop on this thread's CPU clock (best of 3)."""
    times = []
    t = time.monotonic()
    source.start(t)
    for _ in range(3):
        c0 = time.thread_time()
        for _ in range(n):
            t += 0.05
            source.read(t)
        times.append((time.thread_time() - c0) / n * 1e6)
    return min(times)


def contention_us(n: int) -> float:
    """µs per contention read alone (run delay of every thread of this process and its children from schedstat,
    involuntary switches from status, load average): part of every host read, timed apart (best of 3)."""
    source = HostSource()
    source.start(time.monotonic())
    children = list(source._children)
    times = []
    for _ in range(3):
        c0 = time.thread_time()
        for _ in range(n):
            source._contention(children, 1.0)
        times.append((time.thread_time() - c0) / n * 1e6)
    return min(times)


def real_nvml_us(n: int) -> float | None:
    """µs per read of one real GPU through nvidia-ml-py, or None without one."""
    try:
        backend = PynvmlBackend()
        source = GpuSource.open(backend, [0])
    except (NvmlUnavailable, NvmlUnsupported, RuntimeError) as error:
        print(f"real NVML: skipped ({error})")
        return None
    try:
        return read_us(source, n)
    finally:
        source.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="stepscope collectors overhead benchmark")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--window-s", type=float, default=10.0, help="seconds per measured window")
    parser.add_argument("--children", type=int, default=4, help="idle child processes for the host source to walk")
    parser.add_argument("--gpus", type=int, default=1, help="devices of the fake NVML backend")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"]) for _ in range(args.children)]
    try:
        time.sleep(0.5)
        result: dict[str, Any] = {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "children": args.children,
            "gpus": args.gpus,
        }
        for hz in (1, 20):
            runs = [sampler_cost(1.0 / hz, args.window_s, args.gpus) for _ in range(args.repeats)]
            result[f"{hz}hz"] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        result["host_read_us"] = read_us(HostSource(), 500)
        result["contention_read_us"] = contention_us(500)
        result["fake_gpu_read_us"] = read_us(GpuSource.open(ConstantNvml(args.gpus), list(range(args.gpus))), 2000)
        result["real_nvml_read_us"] = real_nvml_us(500)
    finally:
        for child in children:
            child.kill()
            child.wait()

    print(
        f"python {result['python']}, {args.children} idle children, {args.gpus} fake GPU(s), medians of {args.repeats}"
    )
    for hz in (1, 20):
        r = result[f"{hz}hz"]
        print(
            f"{hz:>2} Hz  {r['us_per_sample']:8.1f} µs/sample (sampler thread CPU)  "
            f"{r['pct_core']:.3f}% of one core  ({r['samples']:.0f} samples/window)"
        )
    print(f"host source read      {result['host_read_us']:8.1f} µs")
    print(f"  of which contention {result['contention_read_us']:8.1f} µs (schedstat, status, load average)")
    print(f"fake GPU source read  {result['fake_gpu_read_us']:8.1f} µs")
    if result["real_nvml_read_us"] is not None:
        print(f"real NVML read (1 GPU) {result['real_nvml_read_us']:7.1f} µs")
    ok = result["1hz"]["pct_core"] < 1.0
    print(f"  {'PASS' if ok else 'MISS'}  < 1% of one core at 1 Hz")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
