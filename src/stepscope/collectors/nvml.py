"""The NVML seam: a small backend protocol, the real backend over pynvml, and CUDA-index to NVML-index mapping.

Tests and benchmarks pass a fake backend with scripted readings; everything above this module sees only the
protocol. Units are those the rest of stepscope uses: W, J via mJ counters, MB (2**20 bytes), MHz, °C, percent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

NOT_INSTALLED = (
    "NVML is not available: the nvidia-ml-py package is not installed (pip install 'stepscope[gpu]' or nvidia-ml-py)."
)


class NvmlUnavailable(Exception):
    """NVML cannot be used at all in this process; the message is a sentence for the person reading the report."""


class NvmlUnsupported(Exception):
    """This query is not supported on this device (or not permitted): stop asking for it."""


class NvmlBackend(Protocol):
    """What the GPU source asks of NVML. Handles are opaque; every query may raise NvmlUnsupported."""

    def init(self) -> None: ...  # raises NvmlUnavailable with a reason sentence
    def shutdown(self) -> None: ...
    def device_count(self) -> int: ...
    def handle(self, nvml_index: int) -> Any: ...
    def uuid(self, handle: Any) -> str: ...  # "GPU-8932f937-..."
    def name(self, handle: Any) -> str: ...
    def utilization(self, handle: Any) -> tuple[float, float]: ...  # (% time a kernel ran, % time memory was busy)
    def sm_clock_mhz(self, handle: Any) -> float: ...
    def max_sm_clock_mhz(self, handle: Any) -> float: ...
    def power_w(self, handle: Any) -> float: ...
    def power_limit_w(self, handle: Any) -> float: ...
    def energy_mj(self, handle: Any) -> int: ...  # millijoules since the driver loaded (unsigned 64-bit)
    def memory_mb(self, handle: Any) -> tuple[float, float]: ...  # (used, total), whole device
    def temperature_c(self, handle: Any) -> float: ...
    def throttle_reasons(self, handle: Any) -> int: ...  # NVML clocks-event reason bit mask


class PynvmlBackend:
    """The real backend: nvidia-ml-py (module ``pynvml``). Construction raises NvmlUnavailable when it is missing."""

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError:
            raise NvmlUnavailable(NOT_INSTALLED) from None
        self._nv = pynvml
        # Renamed in drivers >= 535 ("clocks event reasons"); the bits are the same. A newer pynvml on an older
        # driver finds no such function there, and falls back to the old name at the first call.
        self._old_reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
        self._reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or self._old_reasons

    def init(self) -> None:
        nv = self._nv
        try:
            nv.nvmlInit()
        except nv.NVMLError as error:
            raise NvmlUnavailable(init_failure_reason(nv, error)) from error

    def shutdown(self) -> None:
        self._nv.nvmlShutdown()  # reference-counted by NVML: a user's own nvmlInit stays valid

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        nv = self._nv
        try:
            return fn(*args)
        except nv.NVMLError as error:
            unsupported = (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_NO_PERMISSION, nv.NVML_ERROR_FUNCTION_NOT_FOUND)
            if error.value in unsupported:  # FUNCTION_NOT_FOUND: a driver older than this pynvml
                raise NvmlUnsupported(str(error)) from error
            raise

    def device_count(self) -> int:
        return self._call(self._nv.nvmlDeviceGetCount)

    def handle(self, nvml_index: int) -> Any:
        return self._call(self._nv.nvmlDeviceGetHandleByIndex, nvml_index)

    def uuid(self, handle: Any) -> str:
        return _text(self._call(self._nv.nvmlDeviceGetUUID, handle))

    def name(self, handle: Any) -> str:
        return _text(self._call(self._nv.nvmlDeviceGetName, handle))

    def utilization(self, handle: Any) -> tuple[float, float]:
        rates = self._call(self._nv.nvmlDeviceGetUtilizationRates, handle)
        return float(rates.gpu), float(rates.memory)

    def sm_clock_mhz(self, handle: Any) -> float:
        return float(self._call(self._nv.nvmlDeviceGetClockInfo, handle, self._nv.NVML_CLOCK_SM))

    def max_sm_clock_mhz(self, handle: Any) -> float:
        return float(self._call(self._nv.nvmlDeviceGetMaxClockInfo, handle, self._nv.NVML_CLOCK_SM))

    def power_w(self, handle: Any) -> float:
        return self._call(self._nv.nvmlDeviceGetPowerUsage, handle) / 1000.0

    def power_limit_w(self, handle: Any) -> float:
        return self._call(self._nv.nvmlDeviceGetEnforcedPowerLimit, handle) / 1000.0

    def energy_mj(self, handle: Any) -> int:
        return int(self._call(self._nv.nvmlDeviceGetTotalEnergyConsumption, handle))

    def memory_mb(self, handle: Any) -> tuple[float, float]:
        info = self._call(self._nv.nvmlDeviceGetMemoryInfo, handle)
        return info.used / 2**20, info.total / 2**20

    def temperature_c(self, handle: Any) -> float:
        return float(self._call(self._nv.nvmlDeviceGetTemperature, handle, self._nv.NVML_TEMPERATURE_GPU))

    def throttle_reasons(self, handle: Any) -> int:
        try:
            return int(self._call(self._reasons, handle))
        except NvmlUnsupported:
            if self._old_reasons is None or self._reasons is self._old_reasons:
                raise
            self._reasons = self._old_reasons
            return int(self._call(self._reasons, handle))


def init_failure_reason(nv: Any, error: Exception) -> str:
    """A sentence saying why nvmlInit failed, from a pynvml error."""
    value = getattr(error, "value", None)
    if isinstance(error, getattr(nv, "NVMLError_LibraryNotFound", ())) or value == nv.NVML_ERROR_LIBRARY_NOT_FOUND:
        return "NVML is not available: the NVIDIA driver library libnvidia-ml.so was not found."
    if value == nv.NVML_ERROR_DRIVER_NOT_LOADED:
        return "NVML is not available: the NVIDIA driver is not loaded."
    if value == nv.NVML_ERROR_NO_PERMISSION:
        return "NVML is not available: this process has no permission to query the GPU."
    return f"NVML is not available: nvmlInit failed ({error})."


def nvml_index(cuda_index: int, visible: str | None, uuids: Callable[[], list[str]]) -> tuple[int, str | None]:
    """The NVML index of CUDA device ``cuda_index`` and, when it had to be guessed, a note saying so.

    ``visible`` is CUDA_VISIBLE_DEVICES (None when unset): entry ``cuda_index`` names the device by NVML index
    ("2") or by UUID or a unique UUID prefix ("GPU-8932f937"); ``uuids()`` lists NVML's UUIDs in index order and
    is called only for UUID entries. Entries CUDA cannot use (MIG instances, unknown UUIDs, too few entries)
    fall back to the same index, with the note.
    """
    if visible is None:
        return cuda_index, None
    entries = [e.strip() for e in visible.split(",")]
    if cuda_index >= len(entries) or not entries[cuda_index]:
        return cuda_index, (
            f"CUDA device {cuda_index} is not in CUDA_VISIBLE_DEVICES={visible!r}; assuming NVML device {cuda_index}."
        )
    entry = entries[cuda_index]
    if entry.isdigit():
        return int(entry), None
    if entry.startswith("GPU-"):
        matches = [i for i, uuid in enumerate(uuids()) if uuid.startswith(entry)]
        if len(matches) == 1:
            return matches[0], None
    return cuda_index, (
        f"CUDA_VISIBLE_DEVICES entry {entry!r} of CUDA device {cuda_index} names no single NVML GPU; "
        f"assuming NVML device {cuda_index}."
    )


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value  # older pynvml returns bytes
