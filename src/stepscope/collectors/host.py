"""Host readings: CPU of the training process and, apart, of its children; cores; RSS; free memory; contention.

psutil everywhere; on Linux the per-process figures read every sample (children, CPU times, RSS) come straight
from /proc, at a fraction of psutil's cost. CPU percentages are computed from CPU-time deltas this source keeps
itself (not ``psutil.cpu_percent``, whose module-level state another psutil user in the same process would
disturb). 100% is one core.

Contention: how long this job's threads were runnable but waiting for a CPU (the run-queue delay in
``/proc/<pid>/task/<tid>/schedstat``) and how many waits that delay was spread over (the same file's timeslices: a
thread waits in the run queue, if only for microseconds, before each time it is put on a CPU), involuntary context
switches, steal time, the load average and the CPU other processes used. The delay per wait tells a thread kept
from a CPU (a timeslice of someone else's at a time: hundreds of µs to ms) from one that only wakes often (µs of
scheduling latency per wake-up). Where schedstat is missing (macOS, kernels without schedstats) run delay is not
measured and a note says so.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import psutil

from stepscope.collectors.stats import Stats, high, low, mean, rounded

MB = 1024 * 1024
BUSY_CHILD_PCT = 5.0  # of one core: a child below it is idle (e.g. torch.compile's pool of compile workers)
NO_RUN_DELAY = "run delay (time runnable but waiting for a CPU) is not measured here: no /proc/<pid>/schedstat."


class CoreTimes(NamedTuple):
    """Cumulative times of one logical core, in any one unit (ticks or seconds): only ratios are used."""

    busy: float
    total: float
    steal: float  # taken by the hypervisor for other virtual machines


class RunQueue(NamedTuple):
    """A thread's cumulative run-queue figures since it started (/proc/<pid>/task/<tid>/schedstat)."""

    delay_ns: int  # runnable but waiting for a CPU
    waits: int  # timeslices: times it was put on a CPU, each after a wait in the run queue (possibly 0 ns)


class HostSource:
    """Samples this process and its recursive children (DataLoader workers)."""

    name = "host"

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self.notes: list[str] = []  # nothing host-side needs explaining yet; the sampler reads every source's notes
        self._pid = self._proc.pid
        self._cores = usable_cores(self._proc)
        self._quota = cgroup_cpu_quota()
        procfs = _has_procfs()
        self._child_pids: Callable[[int], list[int]] = _procfs_child_pids if procfs else _psutil_child_pids
        self._usage: Callable[[int], tuple[float, int]] = _procfs_usage if procfs else _psutil_usage
        self._children: dict[int, float] = {}  # pid -> its CPU seconds at the previous sample
        self._core_keys: list[str] = []
        self._prev_t = 0.0
        self._prev_cpu_s = 0.0
        self._prev_cores: list[CoreTimes] = []
        self._schedstat = procfs and os.path.exists(f"/proc/{self._pid}/task/{self._pid}/schedstat")
        if not self._schedstat:
            self.notes.append(NO_RUN_DELAY)
        self._switches: Callable[[int], int | None] = _procfs_involuntary if procfs else _psutil_involuntary
        self._delays: dict[int, RunQueue] = {}  # tid -> its run queue figures at the previous sample, main and workers
        self._nvcsw: dict[int, int] = {}  # pid -> its involuntary context switches at the previous sample

    def start(self, now_s: float) -> None:
        """Take the baselines the first sample's deltas are measured from."""
        self._prev_t = now_s
        self._prev_cpu_s = self._usage(self._pid)[0]
        for pid in self._child_pids(self._pid):
            try:
                self._children[pid] = self._usage(pid)[0]
            except (OSError, psutil.Error):
                continue  # already gone
        self._prev_cores = _core_times()
        self._core_keys = [f"host/core/{i}" for i in range(len(self._prev_cores))]
        self._contention(list(self._children), 1.0)  # baselines; the figures of this call are dropped

    def read(self, now_s: float) -> dict[str, float]:
        """One sample: CPU % over the interval since the previous sample, RSS and available memory now."""
        dt = now_s - self._prev_t
        if dt <= 0:
            return {}
        self._prev_t = now_s
        cpu_s, rss = self._usage(self._pid)
        main_pct = 100.0 * (cpu_s - self._prev_cpu_s) / dt
        self._prev_cpu_s = cpu_s

        workers_s = 0.0
        busy = 0
        previous, alive = self._children, {}
        for pid in self._child_pids(self._pid):
            try:
                child_s, child_rss = self._usage(pid)
            except (OSError, psutil.Error):
                continue  # exited between the listing and the read: its last partial interval is lost
            # A child new since the previous sample started at 0 CPU seconds: all of it falls in this interval. So did
            # one that reused the pid of a child that exited (its CPU time is below the old one's).
            used_s = child_s - previous.get(pid, 0.0)
            if used_s < 0:
                used_s = child_s
            workers_s += used_s
            if used_s >= BUSY_CHILD_PCT / 100.0 * dt:
                busy += 1
            rss += child_rss
            alive[pid] = child_s
        self._children = alive

        readings = {
            "sys/cpu_util": main_pct,
            "sys/workers_cpu_util": 100.0 * workers_s / dt,
            "sys/rss_mb": rss / MB,
            "sys/mem_available_mb": psutil.virtual_memory().available / MB,
            "host/workers": float(len(alive)),
            "host/busy_workers": float(busy),
        }
        cores = _core_times()
        if len(cores) == len(self._prev_cores):  # a CPU hot-plugged mid-run: skip this sample's per-core figures
            total_pct = steal = ticks = 0.0
            for key, now, before in zip(self._core_keys, cores, self._prev_cores, strict=True):
                dt_ticks = now.total - before.total
                pct = max(0.0, 100.0 * (now.busy - before.busy) / dt_ticks) if dt_ticks > 0 else 0.0  # sums dip < 0
                readings[key] = pct
                total_pct += pct
                steal += now.steal - before.steal
                ticks += max(dt_ticks, 0.0)
            readings["sys/system_cpu_util"] = total_pct / len(cores)
            readings["host/steal_pct"] = max(0.0, 100.0 * steal / ticks) if ticks > 0 else 0.0
            # Everything busy on the machine that is not this job: other processes' load (and the kernel's).
            readings["host/others_cpu_util"] = max(0.0, total_pct - main_pct - readings["sys/workers_cpu_util"])
        self._prev_cores = cores
        readings.update(self._contention(list(alive), dt))
        return readings

    def _contention(self, workers: list[int], dt: float) -> dict[str, float]:
        """Run delay (% of the interval) and waits (timeslices per second) of the main thread, of all the training
        process's threads summed and of all the workers' threads summed; involuntary context switches per second;
        the 1-minute load average."""
        readings = {"host/load_1m": _load_1m()}
        switches = {}
        for pid in (self._pid, *workers):
            count = self._switches(pid)
            if count is not None:
                switches[pid] = count
        main = switches.get(self._pid)
        if main is not None and self._pid in self._nvcsw:
            readings["host/nvcsw_per_s"] = max(0, main - self._nvcsw[self._pid]) / dt
        readings["host/workers_nvcsw_per_s"] = (
            sum(max(0, n - self._nvcsw.get(pid, 0)) for pid, n in switches.items() if pid != self._pid) / dt
        )
        self._nvcsw = switches
        if not self._schedstat:
            return readings
        main_delays = _task_delays(self._pid)
        worker_delays: dict[int, RunQueue] = {}
        for pid in workers:
            worker_delays.update(_task_delays(pid))
        groups = {"process": main_delays, "workers": worker_delays}
        if self._pid in main_delays:
            groups["main"] = {self._pid: main_delays[self._pid]}
        for group, now in groups.items():
            delay, waits = _since(now, self._delays)
            readings[f"host/run_delay_{group}"] = 100.0 * delay / (1e9 * dt)
            readings[f"host/run_waits_{group}"] = waits / dt
        self._delays = {**main_delays, **worker_delays}
        return readings

    def section(self, stats: Stats) -> dict[str, Any]:
        """The ``host`` section of the system dict."""
        per_core = [mean(stats, key) for key in self._core_keys]
        return {
            "cpu_util_pct": rounded(mean(stats, "sys/cpu_util")),
            "workers_cpu_util_pct": rounded(mean(stats, "sys/workers_cpu_util")),
            "workers_max": int(high(stats, "host/workers") or 0),
            "workers_busy_avg": rounded(mean(stats, "host/busy_workers"), 2),
            "per_core_util_pct_avg": [rounded(v) for v in per_core] if None not in per_core else [],
            "system_cpu_util_pct": rounded(mean(stats, "sys/system_cpu_util")),
            "peak_rss_mb": rounded(high(stats, "sys/rss_mb")),
            "mem_available_min_mb": rounded(low(stats, "sys/mem_available_mb")),
            "cores": self._cores,
            "cpu_quota": rounded(self._quota, 2),
            "machine_cores": len(self._core_keys),
            "run_delay_main_thread_pct": rounded(mean(stats, "host/run_delay_main")),
            "run_delay_main_thread_max_pct": rounded(high(stats, "host/run_delay_main")),
            "run_delay_process_pct": rounded(mean(stats, "host/run_delay_process")),
            "run_delay_workers_pct": rounded(mean(stats, "host/run_delay_workers")),
            "run_delay_main_thread_per_wait_us": _per_wait(stats, "main"),
            "run_delay_process_per_wait_us": _per_wait(stats, "process"),
            "run_delay_workers_per_wait_us": _per_wait(stats, "workers"),
            "involuntary_switches_per_s": rounded(mean(stats, "host/nvcsw_per_s")),
            "workers_involuntary_switches_per_s": rounded(mean(stats, "host/workers_nvcsw_per_s")),
            "steal_pct": rounded(mean(stats, "host/steal_pct")),
            "others_cpu_util_pct": rounded(mean(stats, "host/others_cpu_util")),
            "load_avg_1m": rounded(mean(stats, "host/load_1m"), 2),
            "load_avg_1m_max": rounded(high(stats, "host/load_1m"), 2),
        }

    def close(self) -> None:
        """Nothing to release: /proc reads and psutil hold no handles between samples."""


def _since(now: dict[int, RunQueue], previous: dict[int, RunQueue]) -> RunQueue:
    """Run delay (ns) and waits of these threads since ``previous``, summed; a thread new since then counts from 0."""
    delay = waits = 0
    for tid, figures in now.items():
        before = previous.get(tid, RunQueue(0, 0))
        if figures.delay_ns < before.delay_ns or figures.waits < before.waits:
            before = RunQueue(0, 0)  # a reused thread id starts again from 0
        delay += figures.delay_ns - before.delay_ns
        waits += figures.waits - before.waits
    return RunQueue(delay, waits)


def per_wait_us(delay_pct: float | None, waits_per_s: float | None) -> float | None:
    """Mean run-queue delay per wait (µs) from a delay in % of wall time and the waits per second over the same
    time; None when either is unknown or nothing waited."""
    if delay_pct is None or not waits_per_s:
        return None
    return delay_pct / 100.0 * 1e6 / waits_per_s


def _per_wait(stats: Stats, group: str) -> float | None:
    """A group's delay per wait (µs) over the whole run: the ratio of the two means, i.e. of the summed delay to
    the summed waits (samples are evenly spaced), not a mean of per-sample ratios that a quiet sample would skew."""
    return rounded(per_wait_us(mean(stats, f"host/run_delay_{group}"), mean(stats, f"host/run_waits_{group}")))


def usable_cores(proc: psutil.Process | None = None) -> int:
    """Cores this process may run on (its CPU affinity), or all logical cores where affinity is unknown."""
    try:
        return len((proc or psutil.Process()).cpu_affinity())
    except (AttributeError, psutil.Error, OSError):  # no cpu_affinity on macOS
        return os.cpu_count() or 1


def cgroup_cpu_quota(
    root: str | Path = "/sys/fs/cgroup", proc_cgroup: str | Path = "/proc/self/cgroup"
) -> float | None:
    """The CPU quota of this process's cgroup in cores (e.g. 1.5), or None when unlimited or not on Linux.

    cgroup v2: ``cpu.max`` ("max 100000" or "150000 100000"); v1: ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``
    (quota -1 means unlimited). The process's own cgroup and each of its ancestors are checked, the tightest wins;
    inside a container the cgroup often shows as "/", i.e. the mount root itself.
    """
    root = Path(root)
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        lines = []
    quotas = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            quotas += [_v2_quota(d) for d in _ancestors(root, path)]
        elif "cpu" in controllers.split(","):
            for mount in (root / controllers, root / "cpu", root / "cpu,cpuacct"):
                if mount.is_dir():
                    quotas += [_v1_quota(d) for d in _ancestors(mount, path)]
                    break
    if not lines:
        quotas += [_v2_quota(root), _v1_quota(root / "cpu")]
    limits = [q for q in quotas if q is not None]
    return min(limits) if limits else None


def _ancestors(mount: Path, path: str) -> list[Path]:
    """The cgroup directory of ``path`` under ``mount`` and each parent up to ``mount`` itself."""
    parts = [p for p in path.split("/") if p]
    return [mount.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _v2_quota(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _procfs_usage(pid: int) -> tuple[float, int]:
    """(CPU seconds, RSS bytes) of ``pid`` from one read of /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rpartition(b")")[2].split()  # the command name before ")" may hold spaces
    # utime and stime only: reaped children's time (cutime, cstime) must not count as the parent's.
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK, int(fields[21]) * _PAGE


def _psutil_usage(pid: int) -> tuple[float, int]:
    proc = psutil.Process(pid)
    times = proc.cpu_times()
    return times.user + times.system, proc.memory_info().rss


def _core_times() -> list[CoreTimes]:
    """Busy, total and steal time per logical core, system-wide: /proc/stat on Linux, psutil elsewhere."""
    try:
        with open("/proc/stat") as f:
            cores = parse_proc_stat(f.read())
        if cores:
            return cores
    except OSError:
        pass
    out = []
    for t in psutil.cpu_times(percpu=True):
        total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)  # guest time is inside user/nice
        out.append(CoreTimes(total - t.idle - getattr(t, "iowait", 0.0), total, getattr(t, "steal", 0.0)))
    return out


def parse_proc_stat(text: str) -> list[CoreTimes]:
    """Per-core times (ticks) from /proc/stat's ``cpuN user nice system idle iowait irq softirq steal guest
    guest_nice`` lines; guest time is already inside user and nice, so it is not added again."""
    cores = []
    for line in text.splitlines():
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        fields = [int(x) for x in line.split()[1:9]]
        fields += [0] * (8 - len(fields))  # old kernels end before iowait, irq, softirq or steal
        total = float(sum(fields))
        cores.append(CoreTimes(total - fields[3] - fields[4], total, float(fields[7])))
    return cores


def thread_busy_ns() -> int | None:
    """The calling thread's time on a CPU plus its time runnable but waiting for one (ns), from
    ``/proc/thread-self/schedstat``; None where the kernel does not report it. Over an interval, busy time that
    nearly fills it means the thread computed (however busy the machine), little means it waited (I/O, a sleep)."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            on_cpu, waiting = f.read().split()[:2]
        return int(on_cpu) + int(waiting)
    except (OSError, ValueError):
        return None


def parse_on_cpu(text: str) -> int:
    """Time on a CPU (ns) from a schedstat line (its first field)."""
    return int(text.split()[0])


def parse_schedstat(text: str) -> int:
    """Run-queue delay (ns) from a schedstat line: ``<ns on a CPU> <ns runnable but waiting> <timeslices>``."""
    return int(text.split()[1])


def parse_timeslices(text: str) -> int:
    """Timeslices from a schedstat line (its third field): how many times the thread was put on a CPU."""
    return int(text.split()[2])


def parse_involuntary_switches(status: str) -> int | None:
    """``nonvoluntary_ctxt_switches`` from a /proc/<pid>/status text (None when the kernel does not report it)."""
    for line in status.splitlines():
        if line.startswith("nonvoluntary_ctxt_switches:"):
            return int(line.split(":", 1)[1])
    return None


def _task_delays(pid: int) -> dict[int, RunQueue]:
    """Run delay (ns) and waits of each thread of ``pid``; {} when the process is gone."""
    found: dict[int, RunQueue] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                text = f.read().decode()
            found[int(tid)] = RunQueue(parse_schedstat(text), parse_timeslices(text))
        except (OSError, ValueError, IndexError):
            continue  # a thread that exited between the listing and the read
    return found


def _procfs_involuntary(pid: int) -> int | None:
    """Involuntary context switches of ``pid``'s main thread (the kernel reports them per thread)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return parse_involuntary_switches(f.read())
    except (OSError, ValueError):
        return None


def _psutil_involuntary(pid: int) -> int | None:
    try:
        return int(psutil.Process(pid).num_ctx_switches().involuntary)
    except (psutil.Error, OSError, AttributeError, NotImplementedError):
        return None


def _load_1m() -> float:
    """The machine's 1-minute load average: runnable (and, on Linux, uninterruptible) tasks, decayed."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows: psutil emulates it
        return psutil.getloadavg()[0]


def _has_procfs() -> bool:
    """Linux with /proc/<pid>/task/<tid>/children (kernels built without CONFIG_PROC_CHILDREN lack it)."""
    return os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


def _procfs_child_pids(pid: int) -> list[int]:
    """Recursive children from /proc/<pid>/task/<tid>/children: tens of µs, where psutil's children() reads every
    process on the machine (milliseconds, growing with the machine's process count)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tids = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def _psutil_child_pids(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []
