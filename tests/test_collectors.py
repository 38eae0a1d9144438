"""System collectors: a fake NVML backend with scripted readings, real psutil on real child processes, and the
sampler's lifecycle. Host figures are checked with generous bounds: this 2-core machine is noisy."""

from __future__ import annotations

import json
import logging
import os
import resource
import subprocess
import sys
import threading
import time
from typing import Any

import psutil
import pytest

from stepscope.collectors import Collectors, NvmlUnavailable, NvmlUnsupported, PynvmlBackend, start_collectors
from stepscope.collectors import gpu as gpu_module
from stepscope.collectors.gpu import GpuSource
from stepscope.collectors.host import (
    _procfs_child_pids,
    _procfs_usage,
    _psutil_child_pids,
    _psutil_usage,
    cgroup_cpu_quota,
)
from stepscope.collectors.nvml import NOT_INSTALLED, nvml_index
from stepscope.collectors.sampler import TIMELINE_POINTS
from stepscope.collectors.signals import MIN_SAMPLES

# -- a fake NVML ----------------------------------------------------------------------------------------------------

FED = {
    "utilization": (95.0, 60.0),
    "sm_clock": 1980.0,
    "max_sm_clock": 1980.0,
    "power": 650.0,
    "power_limit": 700.0,
    "energy": None,  # a counter moving at the power draw (see FakeNvml)
    "memory": (60_000.0, 81_559.0),
    "temperature": 71.0,
    "throttle": 0x0,
}


class FakeNvml:
    """An NvmlBackend whose devices answer from scripts. A script value is a constant, a list (one item per call,
    the last repeated) or the NvmlUnsupported class (that query is not supported). ``energy: None`` makes a counter
    that advances by power × (fake) time, given a clock."""

    def __init__(self, *scripts: dict[str, Any], uuids: list[str] | None = None, clock: Any = None) -> None:
        self.scripts = [dict(FED, **s) for s in scripts]
        self.uuids = uuids or [f"GPU-{i:08x}-0000-0000-0000-000000000000" for i in range(len(scripts))]
        self.calls: dict[tuple[int, str], int] = {}
        self.clock = clock
        self.inits = self.shutdowns = 0

    def _answer(self, handle: int, what: str) -> Any:
        script = self.scripts[handle][what]
        if script is NvmlUnsupported:
            raise NvmlUnsupported(what)
        n = self.calls.get((handle, what), 0)
        self.calls[handle, what] = n + 1
        if isinstance(script, list):
            return script[min(n, len(script) - 1)]
        return script

    def init(self) -> None:
        self.inits += 1

    def shutdown(self) -> None:
        self.shutdowns += 1

    def device_count(self) -> int:
        return len(self.scripts)

    def handle(self, nvml_index: int) -> int:
        if nvml_index >= len(self.scripts):
            raise RuntimeError(f"no NVML device {nvml_index}")
        return nvml_index

    def uuid(self, handle: int) -> str:
        return self.uuids[handle]

    def name(self, handle: int) -> str:
        return f"Fake GPU {handle}"

    def utilization(self, handle: int) -> tuple[float, float]:
        return self._answer(handle, "utilization")

    def sm_clock_mhz(self, handle: int) -> float:
        return self._answer(handle, "sm_clock")

    def max_sm_clock_mhz(self, handle: int) -> float:
        return self._answer(handle, "max_sm_clock")

    def power_w(self, handle: int) -> float:
        return self._answer(handle, "power")

    def power_limit_w(self, handle: int) -> float:
        return self._answer(handle, "power_limit")

    def energy_mj(self, handle: int) -> int:
        if self.scripts[handle]["energy"] is None:
            return round(self.clock() * self.scripts[handle]["power"] * 1000)
        return self._answer(handle, "energy")

    def memory_mb(self, handle: int) -> tuple[float, float]:
        return self._answer(handle, "memory")

    def temperature_c(self, handle: int) -> float:
        return self._answer(handle, "temperature")

    def throttle_reasons(self, handle: int) -> int:
        return self._answer(handle, "throttle")


class FakeTime:
    """Monotonic seconds that move only on ``advance``."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


def gpu_run(*scripts: dict[str, Any], n: int, dt: float = 1.0, **stop: Any) -> dict[str, Any]:
    """Collectors over a fake GPU only, sampled ``n`` times ``dt`` fake seconds apart; the system dict."""
    clock = FakeTime()
    backend = FakeNvml(*scripts, clock=clock)
    collectors = Collectors([GpuSource.open(backend, list(range(len(scripts))))], devices=[], clock=clock)
    for _ in range(n):
        clock.advance(dt)
        collectors.sample()
    system = collectors.stop(**stop)
    assert backend.shutdowns == 1
    return system


def ids(system: dict[str, Any]) -> list[str]:
    return [s["id"] for s in system["signals"]]


# -- GPU through the fake backend -----------------------------------------------------------------------------------


def test_fed_gpu_reports_its_readings_and_counter_energy():
    system = gpu_run({}, n=10, steps=20, samples=640)
    assert system["gpu"]["available"] is True
    (dev,) = system["gpu"]["devices"]
    assert dev["index"] == 0 and dev["name"] == "Fake GPU 0"
    assert dev["util_avg_pct"] == 95.0 and dev["mem_util_avg_pct"] == 60.0
    assert dev["sm_clock_ratio_avg"] == 1.0
    assert dev["power_avg_w"] == 650.0 and dev["power_limit_w"] == 700.0
    assert dev["mem_peak_mb"] == 60_000.0 and dev["mem_total_mb"] == 81_559.0
    assert dev["temp_max_c"] == 71.0 and dev["throttle"] == {}
    assert dev["energy_source"] == "counter"
    assert dev["energy_j"] == pytest.approx(650.0 * 10, rel=1e-6)  # 650 W for 10 s
    assert system["energy"] == {"total_j": 6500.0, "per_step_j": 325.0, "per_sample_j": pytest.approx(10.156, abs=1e-3)}
    assert system["samples"] == 10 and system["duration_s"] == 10.0
    assert system["timeline"]["gpu_util_pct"] == [95.0] * 10
    assert system["timeline"]["power_w"] == [650.0] * 10
    assert ids(system) == []
    json.dumps(system)


def test_starved_gpu_has_low_utilisation_and_no_gpu_signal():
    system = gpu_run({"utilization": (8.0, 2.0), "power": 90.0, "sm_clock": 1980.0}, n=5)
    (dev,) = system["gpu"]["devices"]
    assert dev["util_avg_pct"] == 8.0
    assert "launch_bound" not in ids(system) and "throttled" not in ids(system)


def test_launch_bound_trickle_is_named_with_its_figures():
    system = gpu_run({"utilization": (100.0, 5.0), "sm_clock": 900.0, "power": 120.0}, n=5)
    (dev,) = system["gpu"]["devices"]
    assert dev["sm_clock_ratio_avg"] == pytest.approx(900 / 1980, abs=1e-3)
    (signal,) = system["signals"]
    assert signal["id"] == "launch_bound"
    assert "100%" in signal["evidence"] and "120 W of its 700 W" in signal["evidence"]


def test_throttle_reasons_are_decoded_into_fractions_and_idle_bits_ignored():
    # 4 of 10 samples sw_thermal (0x20), 1 of 10 also hw_slowdown (0x8); the rest only gpu_idle (0x1) and
    # applications clocks (0x2), which are not slow-downs.
    reasons = [0x20, 0x20 | 0x8, 0x20, 0x20, 0x1, 0x2, 0x1, 0x3, 0x0, 0x0]
    system = gpu_run({"throttle": reasons, "temperature": [80.0, 91.0, 85.0]}, n=10)
    (dev,) = system["gpu"]["devices"]
    assert dev["throttle"] == {"sw_thermal": 0.4, "hw_slowdown": 0.1}
    assert dev["temp_max_c"] == 91.0
    (signal,) = [s for s in system["signals"] if s["id"] == "throttled"]
    assert "sw_thermal in 40%" in signal["evidence"] and "hw_slowdown in 10%" in signal["evidence"]
    assert "91 °C" in signal["evidence"]


def test_energy_counter_wrapping_past_2_64_keeps_counting():
    top = 2**64
    # baseline, then +500 J, +500 J across the wrap, +500 J.
    energy = [top - 700_000, top - 200_000, 300_000, 800_000]
    system = gpu_run({"energy": energy, "power": 500.0}, n=3)
    (dev,) = system["gpu"]["devices"]
    assert dev["energy_source"] == "counter"
    assert dev["energy_j"] == pytest.approx(1500.0)


def test_energy_counter_going_backwards_falls_back_to_integrating_power():
    # baseline 10 kJ, +400 J, then a reset to 5 J: from there on energy = power × time.
    energy = [10_000_000, 10_400_000, 5_000, 405_000]
    system = gpu_run({"energy": energy, "power": 400.0}, n=3)
    (dev,) = system["gpu"]["devices"]
    assert dev["energy_source"] == "integrated"
    assert dev["energy_j"] == pytest.approx(400.0 + 2 * 400.0)  # 1 s counted, 2 s integrated
    assert any("GPU 0 went backwards (10400000 -> 5000 mJ)" in n for n in system["notes"])


def test_energy_counter_jumping_implausibly_far_falls_back_too():
    # 10**12 mJ in 1 s would be a petawatt: not a wrap, a reset to garbage.
    system = gpu_run({"energy": [0, 10**12], "power": 100.0}, n=2)
    (dev,) = system["gpu"]["devices"]
    assert dev["energy_source"] == "integrated" and dev["energy_j"] == pytest.approx(200.0)
    assert any("GPU 0 jumped (0 -> 1000000000000 mJ)" in n for n in system["notes"])


def test_energy_unsupported_is_integrated_from_power_samples():
    # Power at the baseline and at each of 4 samples 0.5 s apart: trapezoids give the energy exactly.
    power = [100.0, 100.0, 300.0, 300.0, 200.0]
    system = gpu_run({"energy": NvmlUnsupported, "power": power}, n=4, dt=0.5)
    (dev,) = system["gpu"]["devices"]
    assert dev["energy_source"] == "integrated"
    expected = 0.5 * (100 + 100) / 2 + 0.5 * (100 + 300) / 2 + 0.5 * (300 + 300) / 2 + 0.5 * (300 + 200) / 2
    assert dev["energy_j"] == pytest.approx(expected)
    assert any("does not report: energy counter" in n for n in system["notes"])


def test_constant_power_integrates_to_power_times_time():
    system = gpu_run({"energy": NvmlUnsupported, "power": 250.0}, n=40, dt=0.1)
    (dev,) = system["gpu"]["devices"]
    assert dev["energy_j"] == pytest.approx(250.0 * 4.0)


def test_energy_counter_that_stops_answering_mid_run_is_integrated_after():
    clock = FakeTime()
    backend = FakeNvml({"energy": [0, 300_000, 600_000], "power": 300.0}, clock=clock)
    collectors = Collectors([GpuSource.open(backend, [0])], clock=clock)
    for i in range(4):
        if i == 2:
            backend.scripts[0]["energy"] = NvmlUnsupported
        clock.advance(1.0)
        collectors.sample()
    (dev,) = collectors.stop()["gpu"]["devices"]
    assert dev["energy_source"] == "integrated"
    assert dev["energy_j"] == pytest.approx(4 * 300.0)


def test_no_power_and_no_counter_means_unknown_energy():
    system = gpu_run({"energy": NvmlUnsupported, "power": NvmlUnsupported}, n=3, steps=10)
    (dev,) = system["gpu"]["devices"]
    assert dev["energy_j"] is None and dev["energy_source"] is None and dev["power_avg_w"] is None
    assert system["energy"] == {}


def test_two_devices_power_is_summed_and_util_averaged_in_the_snapshot():
    clock = FakeTime()
    backend = FakeNvml({"utilization": (90.0, 0.0)}, {"utilization": (50.0, 0.0), "power": 350.0}, clock=clock)
    collectors = Collectors([GpuSource.open(backend, [0, 1])], clock=clock)
    clock.advance(1.0)
    collectors.sample()
    snap = collectors.snapshot()
    assert snap["sys/gpu_util"] == 70.0 and snap["sys/power_w"] == 1000.0 and snap["sys/gpu_temp_c"] == 71.0
    system = collectors.stop(steps=1)
    assert [d["index"] for d in system["gpu"]["devices"]] == [0, 1]
    assert system["energy"]["total_j"] == pytest.approx(650.0 + 350.0)


# -- device mapping -------------------------------------------------------------------------------------------------


def test_cuda_index_maps_through_cuda_visible_devices():
    uuids = ["GPU-aaaa1111-x", "GPU-bbbb2222-x", "GPU-bbbb3333-x"]
    assert nvml_index(1, None, lambda: uuids) == (1, None)
    assert nvml_index(1, "2,0", lambda: uuids) == (0, None)
    assert nvml_index(0, " 2 , 0", lambda: uuids) == (2, None)
    assert nvml_index(0, "GPU-bbbb3", lambda: uuids) == (2, None)
    assert nvml_index(1, "GPU-aaaa,GPU-bbbb2222-x", lambda: uuids) == (1, None)
    index, note = nvml_index(0, "GPU-bbbb", lambda: uuids)  # ambiguous prefix
    assert index == 0 and "names no single NVML GPU" in note
    index, note = nvml_index(0, "MIG-1234", lambda: uuids)
    assert index == 0 and "MIG-1234" in note
    index, note = nvml_index(3, "0,1", lambda: uuids)
    assert index == 3 and "not in CUDA_VISIBLE_DEVICES" in note


def test_gpu_source_opens_the_visible_device_by_uuid(monkeypatch):
    backend = FakeNvml({}, {"utilization": (12.0, 0.0)}, uuids=["GPU-aaaa-1", "GPU-bbbb-2"], clock=FakeTime())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbb")
    source = GpuSource.open(backend, [0])
    source.start(0.0)
    assert source.read(1.0)["gpu0/util"] == 12.0  # CUDA device 0 is NVML device 1


def test_a_device_that_cannot_be_opened_is_left_out_with_a_note():
    backend = FakeNvml({})
    source = GpuSource(backend, [0, 5])
    assert any("leave out CUDA device 5" in n for n in source.notes)
    with pytest.raises(RuntimeError, match="could not open CUDA device 5"):
        GpuSource(backend, [5])


# -- NVML missing or failing ----------------------------------------------------------------------------------------


@pytest.fixture
def not_warned(monkeypatch):
    monkeypatch.setattr(gpu_module, "_warned", False)


class _FailingInit(FakeNvml):
    def __init__(self, error: Exception) -> None:
        super().__init__({})
        self.error = error

    def init(self) -> None:
        raise self.error


def test_pynvml_missing_gives_a_reason_sentence_and_warns_once(monkeypatch, caplog, not_warned):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    with caplog.at_level(logging.WARNING, logger="stepscope"):
        first = start_collectors(interval_s=0.05, devices=[0]).stop()
        second = start_collectors(interval_s=0.05, devices=[0]).stop()
    for system in (first, second):
        assert system["gpu"] == {"available": False, "reason": NOT_INSTALLED, "devices": []}
        assert system["host"]["cores"] >= 1  # everything else still measured
    assert [r.getMessage() for r in caplog.records].count(f"stepscope: {NOT_INSTALLED} " + _LEFT_OUT) == 1


_LEFT_OUT = "GPU figures are left out; everything else is measured."


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (NvmlUnavailable("NVML is not available: the NVIDIA driver is not loaded."), "the NVIDIA driver is not loaded"),
        (OSError("boom"), "NVML could not be started: OSError: boom."),
    ],
)
def test_init_failure_gives_available_false_with_reason(error, reason, not_warned):
    system = start_collectors(interval_s=0.05, devices=[0], nvml=_FailingInit(error)).stop()
    assert system["gpu"]["available"] is False and reason in system["gpu"]["reason"]
    assert system["gpu"]["reason"].endswith(".")


def test_real_pynvml_init_errors_become_sentences(monkeypatch):
    pynvml = pytest.importorskip("pynvml")
    cases = {
        pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: "libnvidia-ml.so was not found",
        pynvml.NVML_ERROR_NO_PERMISSION: "no permission to query the GPU",
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED: "the NVIDIA driver is not loaded",
        pynvml.NVML_ERROR_UNKNOWN: "nvmlInit failed",
    }
    for value, words in cases.items():

        def fail(value: int = value) -> None:
            raise pynvml.NVMLError(value)

        monkeypatch.setattr(pynvml, "nvmlInit", fail)
        with pytest.raises(NvmlUnavailable, match=words):
            PynvmlBackend().init()


def test_no_devices_means_no_nvml_and_no_warning(caplog, not_warned):
    backend = FakeNvml({})
    with caplog.at_level(logging.WARNING, logger="stepscope"):
        system = start_collectors(interval_s=0.05, devices=[], nvml=backend).stop()
    assert backend.inits == 0 and caplog.records == []
    assert system["gpu"] == {"available": False, "reason": "this process uses no CUDA device.", "devices": []}
    assert system["memory"] == {}


def test_start_collectors_with_a_fake_backend_samples_on_its_thread():
    backend = FakeNvml({"energy": NvmlUnsupported})
    handle = start_collectors(interval_s=0.05, devices=[0], nvml=backend)
    time.sleep(0.5)
    snap = handle.snapshot()
    system = handle.stop(steps=10)
    assert snap["sys/gpu_util"] == 95.0 and snap["sys/power_w"] == 650.0 and "sys/cpu_util" in snap
    assert 5 <= system["samples"] <= 12
    (dev,) = system["gpu"]["devices"]
    assert dev["util_avg_pct"] == 95.0 and dev["energy_source"] == "integrated"
    assert dev["energy_j"] == pytest.approx(650.0 * system["duration_s"], rel=0.02)  # constant power × time
    assert backend.shutdowns == 1


# -- host, with real processes --------------------------------------------------------------------------------------

# Burns ``s`` seconds of its own CPU time, however long that takes on a loaded machine.
BURN = "import time\nwhile time.process_time() < {s}:\n    pass\n"


def children_cpu_s() -> float:
    """CPU seconds of every descendant of this process that has exited and been waited for: the ground truth."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def workers_cpu_s(system: dict[str, Any]) -> float:
    return system["host"]["workers_cpu_util_pct"] / 100 * system["duration_s"]


def test_a_busy_child_is_counted_as_workers_not_as_the_main_process():
    # Children this process already has count too: multiprocessing's resource tracker, left running by an earlier
    # test's spawned DataLoader workers in the same xdist worker (idle: never busy).
    others = len(psutil.Process().children(recursive=True))
    before = children_cpu_s()
    handle = start_collectors(interval_s=0.05)
    subprocess.run([sys.executable, "-c", BURN.format(s=1.0)], check=True)  # the main process waits, idle
    time.sleep(0.1)
    system = handle.stop()
    truth = children_cpu_s() - before
    host = system["host"]
    assert truth >= 1.0
    # All of the child's CPU but its last partial interval (<= 50 ms) is the workers'.
    # (The CPU seconds are the ground truth whatever else loads the machine; a percentage of wall time is not.)
    assert truth - 0.15 <= workers_cpu_s(system) <= truth * 1.05 + 0.02, (truth, host)
    assert host["cpu_util_pct"] < 30, host
    assert host["workers_max"] == 1 + others and 0.5 < host["workers_busy_avg"] <= 1.0
    assert max(host["per_core_util_pct_avg"]) > 30
    # The timeline holds the readings the figure averages: its peak cannot be below their mean.
    assert max(system["timeline"]["workers_cpu_util_pct"]) >= 0.9 * host["workers_cpu_util_pct"] > 0


def test_children_started_later_grandchildren_and_exited_ones_are_handled():
    # A child that spawns a busy grandchild after a while, and a short-lived child that exits mid-window.
    burn = BURN.format(s=0.6)
    parent = f"import subprocess, sys, time\ntime.sleep(0.3)\nsubprocess.run([sys.executable, '-c', {burn!r}])\n"
    before = children_cpu_s()
    handle = start_collectors(interval_s=0.05)
    short = subprocess.Popen([sys.executable, "-c", "pass"])
    outer = subprocess.Popen([sys.executable, "-c", parent])
    short.wait()
    outer.wait()
    time.sleep(0.1)
    system = handle.stop()
    truth = children_cpu_s() - before  # the grandchild's 0.6 s and three interpreter start-ups
    assert system["host"]["workers_max"] >= 2
    # Each of the three processes may lose its last partial interval when it exits.
    assert truth - 0.25 <= workers_cpu_s(system) <= truth * 1.05 + 0.02, (truth, system["host"])
    assert system["host"]["cpu_util_pct"] < 30
    assert not any("host collector stopped" in n for n in system["notes"])


def test_tree_rss_grows_when_a_child_allocates():
    base_mb = psutil.Process().memory_info().rss / 2**20
    code = "import sys, time\nblock = b'x' * (300 << 20)\nprint('allocated', flush=True)\nsys.stdin.read()\n"
    handle = start_collectors(interval_s=0.05)
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "allocated\n"  # however long a loaded machine takes to get there
    time.sleep(0.3)  # a few samples with the block held
    system = handle.stop()
    child.communicate("")
    assert system["host"]["peak_rss_mb"] > base_mb + 250


def test_procfs_and_psutil_readers_agree():
    sleeper = "import time; time.sleep(3)"
    code = f"import subprocess, sys, time\np = subprocess.Popen([sys.executable, '-c', {sleeper!r}])\ntime.sleep(3)\n"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 5
        while len(_psutil_child_pids(os.getpid())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        expected = sorted(_psutil_child_pids(os.getpid()))
        assert len(expected) == 2
        if os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"):
            assert sorted(_procfs_child_pids(os.getpid())) == expected
            for pid in [os.getpid(), *expected]:
                (cpu_a, rss_a), (cpu_b, rss_b) = _procfs_usage(pid), _psutil_usage(pid)
                assert cpu_a == pytest.approx(cpu_b, abs=0.05) and rss_a == pytest.approx(rss_b, rel=0.05)
    finally:
        for proc in psutil.Process(child.pid).children(recursive=True):
            proc.kill()
        child.kill()
        child.wait()


@pytest.mark.parametrize(
    ("files", "cgroup", "quota"),
    [
        ({"cpu.max": "150000 100000\n"}, "0::/\n", 1.5),
        ({"cpu.max": "max 100000\n"}, "0::/\n", None),
        ({"job/cpu.max": "max 100000\n", "cpu.max": "200000 100000\n"}, "0::/job\n", 2.0),  # the tighter ancestor
        ({"job/cpu.max": "50000 100000\n"}, "0::/job\n", 0.5),
        (
            {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
            "2:cpu,cpuacct:/\n",
            None,
        ),
        (
            {"cpu,cpuacct/cpu.cfs_quota_us": "250000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
            "2:cpu,cpuacct:/docker/abc\n1:name=systemd:/\n",  # the container's cgroup is the mount root
            2.5,
        ),
        ({}, "0::/\n", None),
    ],
)
def test_cgroup_cpu_quota(tmp_path, files, cgroup, quota):
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    root.mkdir(exist_ok=True)
    (tmp_path / "self_cgroup").write_text(cgroup)
    assert cgroup_cpu_quota(root, tmp_path / "self_cgroup") == quota


# -- sampler lifecycle ----------------------------------------------------------------------------------------------


class Counting:
    """A source that counts, or raises from its ``fail_at``-th read on."""

    name = "counting"

    def __init__(self, fail_at: int | None = None) -> None:
        self.notes: list[str] = []
        self.reads = 0
        self.fail_at = fail_at
        self.closed = False

    def start(self, now_s: float) -> None:
        self.t0 = now_s

    def read(self, now_s: float) -> dict[str, float]:
        self.reads += 1
        if self.fail_at is not None and self.reads >= self.fail_at:
            raise RuntimeError("sensor fell off")
        return {"sys/cpu_util": float(self.reads), "counting/t": now_s - self.t0}

    def section(self, stats: Any) -> dict[str, Any]:
        return {"reads": stats["counting/t"].n}

    def close(self) -> None:
        self.closed = True


def test_stop_joins_the_thread_and_is_idempotent():
    source = Counting()
    handle = Collectors([source], interval_s=0.05).start()
    thread = handle._thread
    assert thread is not None and thread.is_alive()
    time.sleep(0.3)
    first = handle.stop(steps=5)
    assert not handle.running and thread not in threading.enumerate()
    reads = source.reads
    time.sleep(0.15)
    second = handle.stop(steps=5)
    assert source.reads == reads and second == first and source.closed
    assert first["samples"] == first["counting"]["reads"] == reads >= 4


@pytest.mark.parametrize("inside", ["read", "fold"])
def test_a_stop_from_inside_a_sample_ends_the_sampler_without_an_error(caplog, monkeypatch, inside):
    # A Scope dropped without close() is collected by whichever thread's allocation runs the garbage collector, and
    # its finalizer stops its sampler: on the sampler's own thread, inside a sample, it once raised "cannot join
    # current thread" and lost the figures. The allocation can be the fold's too, which runs under the figures'
    # lock: the stop then takes the figures on the thread that holds it, and must not deadlock.
    from stepscope.collectors import sampler

    stopped: list[dict] = []

    def stop_at_the_third_sample() -> None:
        if not stopped and source.reads == 3:
            stopped.append(handle.stop(steps=3))

    class StoppedInside(Counting):
        def read(self, now_s: float) -> dict[str, float]:
            readings = super().read(now_s)
            if inside == "read":
                stop_at_the_third_sample()
            return readings

    real_fold = sampler.fold

    def fold(stats, readings):
        if inside == "fold":
            stop_at_the_third_sample()
        real_fold(stats, readings)

    monkeypatch.setattr(sampler, "fold", fold)
    source = StoppedInside()
    with caplog.at_level("WARNING", logger="stepscope"):
        handle = Collectors([source], interval_s=0.05).start()
        thread = handle._thread
        thread.join(5)
    assert not thread.is_alive(), "the sampler did not end (deadlocked on its own lock?)"
    assert source.closed and source.reads == 3
    assert stopped and stopped[0]["samples"] == 2 and not stopped[0]["notes"], stopped  # the figures before it
    assert handle.stop(steps=3) == stopped[0]
    assert not [r for r in caplog.records if "failed" in r.getMessage()], caplog.records


def test_peek_reports_so_far_and_sampling_goes_on():
    clock = FakeTime()
    collectors = Collectors([Counting()], clock=clock)
    for _ in range(3):
        clock.advance(1.0)
        collectors.sample()
    early = collectors.peek(steps=3)
    clock.advance(1.0)
    collectors.sample()
    final = collectors.stop()
    assert (early["samples"], early["duration_s"], early["counting"]) == (3, 3.0, {"reads": 3})
    assert (final["samples"], final["duration_s"]) == (4, 4.0)
    assert collectors.peek() == final


def test_a_hung_source_neither_blocks_snapshot_nor_stop_for_long():
    release = threading.Event()
    entered = threading.Event()

    class Hung(Counting):
        def read(self, now_s: float) -> dict[str, float]:
            if self.reads == 2:
                entered.set()
                release.wait(30)  # a driver call that does not return
            return super().read(now_s)

    handle = Collectors([Hung()], interval_s=0.05).start()
    assert entered.wait(5)
    t0 = time.monotonic()
    snap = handle.snapshot()
    assert time.monotonic() - t0 < 0.05 and snap == {"sys/cpu_util": 2.0}
    system = handle.stop()
    waited = time.monotonic() - t0
    release.set()
    assert waited < 0.05 + 2.0 + 0.5
    assert system["samples"] == 2
    assert any("did not stop within" in n for n in system["notes"])
    time.sleep(0.1)
    assert handle.stop()["samples"] == 2  # the sample that finished late was not folded into the frozen figures


def test_a_source_that_raises_is_dropped_with_a_note_and_the_others_go_on():
    clock = FakeTime()
    good, bad = Counting(), Counting(fail_at=3)
    bad.name = "flaky"
    collectors = Collectors([bad, good], clock=clock)
    for _ in range(6):
        clock.advance(1.0)
        collectors.sample()
    system = collectors.stop()
    assert good.reads == 6 and bad.reads == 3 and bad.closed
    assert system["samples"] == 6
    assert any("the flaky collector stopped at 3.0 s" in n and "sensor fell off" in n for n in system["notes"])


def test_a_source_that_cannot_start_is_left_out():
    class Broken(Counting):
        def start(self, now_s: float) -> None:
            raise OSError("no such sensor")

    system = Collectors([Broken()]).stop()
    assert system["samples"] == 0 and "counting" not in system
    assert any("could not start (OSError: no such sensor)" in n for n in system["notes"])


@pytest.mark.parametrize("interval", [0, -1.0, 0.01, 0.049, float("nan"), float("inf")])
def test_interval_out_of_bounds_is_a_value_error(interval):
    with pytest.raises(ValueError, match="interval_s"):
        start_collectors(interval_s=interval)
    with pytest.raises(ValueError, match="interval_s"):
        Collectors([], interval_s=interval)


def test_timeline_stays_bounded_and_spans_the_run():
    clock = FakeTime()
    collectors = Collectors([Counting()], clock=clock)
    for _ in range(10_007):
        clock.advance(1.0)
        collectors.sample()
    timeline = collectors.stop()["timeline"]
    assert 150 <= len(timeline["t_s"]) <= TIMELINE_POINTS
    assert all(len(v) == len(timeline["t_s"]) for v in timeline.values())
    assert timeline["t_s"][0] < 40 and timeline["t_s"][-1] > 9_960
    # cpu_util here is the read count, i.e. t: every point is the mean of its bucket, so it tracks t.
    assert all(abs(c - t) < 1e-6 for c, t in zip(timeline["cpu_util_pct"], timeline["t_s"], strict=True))
    assert timeline["gpu_util_pct"] == [None] * len(timeline["t_s"])


def test_a_short_run_still_gets_a_final_sample():
    handle = start_collectors(interval_s=60.0)
    time.sleep(1.3)  # past the fast start: the next sample would be a minute away
    system = handle.stop()
    assert system["samples"] >= 1 and system["host"]["peak_rss_mb"] > 0
    # 10 samples in the fast first second, then the final partial interval's: never the minute's.
    assert system["samples"] <= 12, system["samples"]


def test_the_first_second_is_sampled_fast_enough_for_the_signals():
    # A 0.4 s run at 1 Hz used to get one sample, and the signals need 3: it got none.
    handle = start_collectors(interval_s=1.0)
    time.sleep(0.4)
    system = handle.stop()
    assert system["samples"] >= MIN_SAMPLES, system["samples"]


# -- real NVML ------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_real_nvml_on_a_busy_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("pynvml")
    a = torch.randn(4096, 4096, device="cuda")
    device = torch.cuda.current_device()
    handle = start_collectors(interval_s=0.1, devices=[device])
    t0 = time.monotonic()
    while time.monotonic() - t0 < 2.0:
        for _ in range(20):
            a = (a @ a).tanh_()
        a.sum().item()  # the workload's own sync keeps the queue short
    system = handle.stop(steps=10)
    assert system["gpu"]["available"] is True, system["gpu"]["reason"]
    (dev,) = system["gpu"]["devices"]
    assert dev["index"] == device and dev["name"]
    assert dev["util_avg_pct"] > 50 and dev["power_avg_w"] > 0 and 0 < dev["sm_clock_ratio_avg"] <= 1.05
    assert dev["energy_j"] > 0 and dev["energy_source"] in ("counter", "integrated")
    assert dev["mem_peak_mb"] > 0 and dev["mem_total_mb"] >= dev["mem_peak_mb"]
    assert system["memory"]["max_allocated_mb"] >= 64 and system["memory"]["ooms"] == 0
    assert system["energy"]["per_step_j"] == pytest.approx(system["energy"]["total_j"] / 10, rel=0.01)
    json.dumps(system)


def test_pynvml_backend_falls_back_to_the_old_throttle_reasons_call(monkeypatch):
    import types

    from stepscope.collectors.nvml import NvmlUnsupported, PynvmlBackend

    class NVMLError(Exception):
        def __init__(self, value):
            super().__init__(f"NVML error {value}")
            self.value = value

    fake = types.SimpleNamespace(
        NVMLError=NVMLError,
        NVML_ERROR_NOT_SUPPORTED=3,
        NVML_ERROR_NO_PERMISSION=4,
        NVML_ERROR_FUNCTION_NOT_FOUND=13,
        calls=[],
    )

    def new_name(handle):  # a pynvml newer than the driver: the renamed function is not in the driver
        fake.calls.append("event")
        raise NVMLError(13)

    def old_name(handle):
        fake.calls.append("throttle")
        return 0x4

    fake.nvmlDeviceGetCurrentClocksEventReasons = new_name
    fake.nvmlDeviceGetCurrentClocksThrottleReasons = old_name
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    backend = PynvmlBackend()
    assert backend.throttle_reasons("h") == 0x4
    assert backend.throttle_reasons("h") == 0x4
    assert fake.calls == ["event", "throttle", "throttle"]  # the old name from then on

    def unsupported(handle):
        raise NVMLError(3)

    fake.nvmlDeviceGetCurrentClocksThrottleReasons = unsupported
    backend = PynvmlBackend()
    backend._old_reasons = unsupported
    backend._reasons = new_name
    with pytest.raises(NvmlUnsupported):
        backend.throttle_reasons("h")
