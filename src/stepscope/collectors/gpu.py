"""GPU readings through an NVML backend, for the CUDA devices this process uses.

Energy comes from the device's energy counter where it has one; where it has none, or the counter goes backwards
(a driver reload) or stops answering, the rest of the run is integrated from the power samples (trapezoids between
sample times) and the device's ``energy_source`` says "integrated".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from stepscope.collectors.nvml import NvmlBackend, NvmlUnsupported, nvml_index
from stepscope.collectors.stats import Stats, high, mean, rounded

log = logging.getLogger("stepscope")

# NVML clocks-event reason bits that mean the clocks were held down by power or heat. GPU idle, application clocks,
# sync boost and display clock bits are not slow-downs of a busy GPU and are ignored.
THROTTLE_BITS = {
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
}

_COUNTER_MODULUS = 2**64  # nvmlDeviceGetTotalEnergyConsumption is an unsigned 64-bit mJ count
_FALLBACK_MAX_W = 2000.0  # above any single GPU's draw: bounds a plausible counter step when the limit is unknown

_warned = False


def warn_once(reason: str) -> None:
    """Log why GPU figures are missing, once per process."""
    global _warned
    if not _warned:
        _warned = True
        log.warning("stepscope: %s GPU figures are left out; everything else is measured.", reason)


@dataclass
class _Device:
    index: int  # CUDA index, as the user knows it
    handle: Any
    name: str
    keys: dict[str, str]  # reading name -> "gpu<index>/<name>", built once
    max_sm_mhz: float | None = None
    power_limit_w: float | None = None
    mem_total_mb: float | None = None
    unsupported: set[str] = field(default_factory=set)
    counter: bool = False  # energy still taken from the device counter
    energy_source: str = "counter"  # "integrated" once any interval's energy came from power samples
    energy_gap: bool = False  # an interval had neither counter nor power: the energy is unknown
    last_mj: int = 0
    last_t: float = 0.0
    last_w: float | None = None
    counter_j: float = 0.0
    integrated_j: float = 0.0


class GpuSource:
    """Samples utilisation, SM clock, power, energy, memory, temperature and throttle reasons of some devices."""

    name = "gpu"

    def __init__(self, backend: NvmlBackend, devices: Sequence[int], visible: str | None = None) -> None:
        """Open ``devices`` (CUDA indices) on an initialised ``backend``; ``visible`` is CUDA_VISIBLE_DEVICES.

        Raises when no device can be opened; a device that cannot be opened while others can is left out with a
        note."""
        self._nv = backend
        self._events: list[str] = []
        self._devices: list[_Device] = []
        uuids: list[str] = []

        def nvml_uuids() -> list[str]:
            if not uuids:
                uuids.extend(backend.uuid(backend.handle(i)) for i in range(backend.device_count()))
            return uuids

        failures = []
        for cuda_index in devices:
            try:
                index, note = nvml_index(cuda_index, visible, nvml_uuids)
                if note:
                    self._events.append(note)
                handle = backend.handle(index)
                self._devices.append(_Device(cuda_index, handle, backend.name(handle), _keys(cuda_index)))
            except Exception as error:
                failures.append(f"CUDA device {cuda_index} ({type(error).__name__}: {error})")
        if failures and not self._devices:
            raise RuntimeError(f"NVML could not open {', '.join(failures)}")
        if failures:
            self._events.append(f"GPU figures leave out {', '.join(failures)}.")

    @classmethod
    def open(cls, backend: NvmlBackend, devices: Sequence[int]) -> GpuSource:
        """Initialise ``backend`` and open ``devices``, honouring this process's CUDA_VISIBLE_DEVICES."""
        backend.init()
        try:
            return cls(backend, devices, os.environ.get("CUDA_VISIBLE_DEVICES"))
        except Exception:
            backend.shutdown()
            raise

    @property
    def notes(self) -> list[str]:
        """What the reader should know about these figures: guessed device mapping, energy fallbacks, gaps."""
        gaps = [
            f"GPU {dev.index} does not report: {', '.join(sorted(dev.unsupported))}."
            for dev in self._devices
            if dev.unsupported
        ]
        return self._events + gaps

    def start(self, now_s: float) -> None:
        """Read what does not change (limits, totals) and the energy and power baselines."""
        nv = self._nv
        for dev in self._devices:
            dev.max_sm_mhz = self._query(dev, "max SM clock", nv.max_sm_clock_mhz) or None
            dev.power_limit_w = self._query(dev, "power limit", nv.power_limit_w) or None
            memory = self._query(dev, "memory", nv.memory_mb)
            dev.mem_total_mb = memory[1] if memory else None
            dev.last_t = now_s
            dev.last_w = self._query(dev, "power", nv.power_w)
            mj = self._query(dev, "energy counter", nv.energy_mj)
            dev.counter = mj is not None
            dev.energy_source = "counter" if dev.counter else "integrated"
            dev.last_mj = mj or 0

    def read(self, now_s: float) -> dict[str, float]:
        """One sample of every device; also the ``sys/`` aggregates (mean util and clock ratio, summed power and
        memory, hottest temperature)."""
        nv = self._nv
        out: dict[str, float] = {}
        utils, ratios, powers, used, temps = [], [], [], [], []
        for dev in self._devices:
            keys = dev.keys
            rates = self._query(dev, "utilization", nv.utilization)
            if rates is not None:
                out[keys["util"]], out[keys["mem_util"]] = rates
                utils.append(rates[0])
            if dev.max_sm_mhz:
                clock = self._query(dev, "SM clock", nv.sm_clock_mhz)
                if clock is not None:
                    out[keys["sm_clock_ratio"]] = ratio = clock / dev.max_sm_mhz
                    ratios.append(ratio)
            power = self._query(dev, "power", nv.power_w)
            if power is not None:
                out[keys["power_w"]] = power
                powers.append(power)
            self._account_energy(dev, now_s, power)
            memory = self._query(dev, "memory", nv.memory_mb)
            if memory is not None:
                out[keys["mem_used_mb"]] = memory[0]
                used.append(memory[0])
            temp = self._query(dev, "temperature", nv.temperature_c)
            if temp is not None:
                out[keys["temp_c"]] = temp
                temps.append(temp)
            reasons = self._query(dev, "throttle reasons", nv.throttle_reasons)
            if reasons is not None:
                out[keys["throttle"]] = 1.0  # counts the samples the reasons were read in
                for bit, word in THROTTLE_BITS.items():
                    if reasons & bit:
                        out[keys[word]] = 1.0
        if utils:
            out["sys/gpu_util"] = sum(utils) / len(utils)
        if ratios:
            out["sys/sm_clock_ratio"] = sum(ratios) / len(ratios)
        if powers:
            out["sys/power_w"] = sum(powers)
        if used:
            out["sys/gpu_mem_used_mb"] = sum(used)
        if temps:
            out["sys/gpu_temp_c"] = max(temps)
        return out

    def section(self, stats: Stats) -> dict[str, Any]:
        """The ``gpu`` section of the system dict."""
        devices = []
        for dev in self._devices:
            keys = dev.keys
            reads = stats.get(keys["throttle"])
            throttle = {}
            if reads is not None:
                for word in THROTTLE_BITS.values():
                    hits = stats.get(keys[word])
                    if hits is not None:
                        throttle[word] = round(hits.n / reads.n, 3)
            energy = self._energy_j(dev)
            devices.append(
                {
                    "index": dev.index,
                    "name": dev.name,
                    "util_avg_pct": rounded(mean(stats, keys["util"])),
                    "mem_util_avg_pct": rounded(mean(stats, keys["mem_util"])),
                    "sm_clock_ratio_avg": rounded(mean(stats, keys["sm_clock_ratio"]), 3),
                    "power_avg_w": rounded(mean(stats, keys["power_w"])),
                    "power_limit_w": rounded(dev.power_limit_w),
                    "energy_j": rounded(energy),
                    "energy_source": None if energy is None else dev.energy_source,
                    "mem_peak_mb": rounded(high(stats, keys["mem_used_mb"])),
                    "mem_total_mb": rounded(dev.mem_total_mb),
                    "temp_max_c": rounded(high(stats, keys["temp_c"])),
                    "throttle": throttle,
                }
            )
        return {"available": True, "reason": None, "devices": devices}

    def close(self) -> None:
        self._nv.shutdown()

    @staticmethod
    def _energy_j(dev: _Device) -> float | None:
        """Energy of ``dev`` over the sampled time (J), None when some interval had neither counter nor power."""
        return None if dev.energy_gap else dev.counter_j + dev.integrated_j

    def _account_energy(self, dev: _Device, now_s: float, power_w: float | None) -> None:
        dt = now_s - dev.last_t
        counted = False
        if dev.counter:
            mj = self._query(dev, "energy counter", self._nv.energy_mj)
            step_mj = None if mj is None else (mj - dev.last_mj) % _COUNTER_MODULUS
            # A counter that wrapped past 2**64 moves by a plausible step (at most twice the limit, in mJ); one that was
            # reset moves by ~2**64.
            if step_mj is not None and step_mj <= 2000 * (dev.power_limit_w or _FALLBACK_MAX_W) * max(dt, 1.0):
                dev.counter_j += step_mj / 1000.0
                dev.last_mj = mj  # type: ignore[assignment]
                counted = True
            else:
                dev.counter = False
                if mj is None:
                    what = "stopped answering"
                else:
                    what = f"{'went backwards' if mj < dev.last_mj else 'jumped'} ({dev.last_mj} -> {mj} mJ)"
                self._events.append(
                    f"the energy counter of GPU {dev.index} {what}; its energy from then on is integrated from power."
                )
        if not counted:
            if power_w is not None and dev.last_w is not None:
                dev.integrated_j += 0.5 * (power_w + dev.last_w) * dt
                dev.energy_source = "integrated"
            else:
                dev.energy_gap = True
        dev.last_t = now_s
        if power_w is not None:
            dev.last_w = power_w

    @staticmethod
    def _query(dev: _Device, what: str, fn: Callable[[Any], Any]) -> Any:
        if what in dev.unsupported:
            return None
        try:
            return fn(dev.handle)
        except NvmlUnsupported:
            dev.unsupported.add(what)
            return None


def _keys(index: int) -> dict[str, str]:
    names = ("util", "mem_util", "sm_clock_ratio", "power_w", "mem_used_mb", "temp_c", "throttle")
    keys = {name: f"gpu{index}/{name}" for name in names}
    keys.update({word: f"gpu{index}/throttle/{word}" for word in THROTTLE_BITS.values()})
    return keys
