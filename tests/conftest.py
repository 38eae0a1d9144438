"""Test doubles for the two seams of Scope: a fake nanosecond clock and a fake CUDA event source.

``FakeClock`` only moves when a test calls ``advance``, so every host duration is known exactly.

``FakeEvents`` models a GPU the test drives by hand. It keeps a fake GPU timeline (``gpu_ms``) that the test moves
with ``run(ms)``; an event recorded now is stamped with the timeline's current value. An event is *not* complete
when recorded: ``query()`` is False until the test marks it complete (``complete(...)``, ``complete_all()``) or
``synchronize()`` is called. ``take_recorded()`` hands the test the events recorded since the previous call, so a
test can grab one step's events and complete them before (or after) another step's: out-of-order completion.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# Every Python process the suite starts (and its xdist workers) runs tests/site/sitecustomize.py: torch without its
# import of torch._dynamo (~1.5 s of CPU) in the many short training processes that never compile; see that file.
HARNESS_SITE = Path(__file__).resolve().parent / "site"
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HARNESS_SITE), os.environ.get("PYTHONPATH", "")) if p)
# torch's OpenMP threads spin after each parallel op before they sleep. The suite's training scripts mostly sleep
# between small ops, and there the spinning kept a second core busy: dies.py's 5 ms sleeps took 6.9 s of CPU in 6.6 s
# (1.7 s with the threads waiting passively). Passive waits change no op's result or its thread count; set before
# any torch is loaded here (OpenMP reads it once) and inherited by every process the suite starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


class FakeClock:
    """A monotonic clock in integer nanoseconds that moves only on ``advance(ms)``."""

    def __init__(self, start_ns: int = 1_000_000_000) -> None:
        self.ns = start_ns
        self.calls = 0

    def __call__(self) -> int:
        self.calls += 1
        return self.ns

    def advance(self, ms: float) -> None:
        self.ns += round(ms * 1_000_000)


class FakeEvent:
    """One fake CUDA event: stamped with the source's GPU time when recorded, complete only when told."""

    def __init__(self, source: FakeEvents, serial: int) -> None:
        self.source = source
        self.serial = serial
        self.t_ms: float | None = None
        self.done = False
        self.records = 0

    def record(self) -> None:
        self.t_ms = self.source.gpu_ms
        self.done = False
        self.records += 1
        self.source.log.append(self)

    def query(self) -> bool:
        self.source.queries += 1
        return self.done

    def elapsed_time(self, end: FakeEvent) -> float:
        # torch raises when either event has not completed; so does the fake, to catch early reads.
        if not (self.done and end.done):
            raise RuntimeError("elapsed_time on an event that has not completed")
        return end.t_ms - self.t_ms

    def __repr__(self) -> str:
        return f"FakeEvent(#{self.serial}, t={self.t_ms}, done={self.done})"


class FakeEvents:
    """An EventSource whose events complete only when the test says so; counts ``new_event`` and ``synchronize``."""

    def __init__(self) -> None:
        self.gpu_ms = 0.0
        self.created = 0
        self.syncs = 0
        self.queries = 0
        self.log: list[FakeEvent] = []  # every record(), in order (a recycled event appears again)
        self._taken = 0

    # -- the EventSource protocol ----------------------------------------------------------------------------
    def new_event(self) -> FakeEvent:
        self.created += 1
        return FakeEvent(self, self.created)

    def record(self, event: FakeEvent) -> None:
        """Record ``event`` on the (fake) current stream; the same as ``event.record()``."""
        event.record()

    def synchronize(self) -> None:
        self.syncs += 1
        self.complete_all()

    # -- test controls ---------------------------------------------------------------------------------------
    def run(self, ms: float) -> None:
        """The GPU works for ``ms`` milliseconds: events recorded after this are stamped later."""
        self.gpu_ms += ms

    def take_recorded(self) -> list[FakeEvent]:
        """Events recorded since the previous call (e.g. exactly one step's events)."""
        events = self.log[self._taken :]
        self._taken = len(self.log)
        return events

    def complete(self, events: list[FakeEvent]) -> None:
        for event in events:
            event.done = True

    def complete_all(self) -> None:
        for event in self.log:
            event.done = True


@pytest.fixture(autouse=True)
def no_stepscope_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """STEPSCOPE=0/1 in the developer's environment would turn every Scope on or off; tests set it themselves."""
    monkeypatch.delenv("STEPSCOPE", raising=False)


# SIGINT and SIGTERM as the test process started with them.
STARTING_DISPOSITIONS = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}


@pytest.fixture(autouse=True)
def signal_dispositions() -> Iterator[None]:
    """A test that runs stepscope's launcher in this process leaves SIGINT/SIGTERM ignored (what stepscope does
    for its report, launch.ignore_stops): the next test's children would inherit that. Set them as the process
    started, before the test (a module-scoped fixture may have run the launcher) and after it, and clear the
    launcher's record of a stop."""
    from stepscope.instrument import launch

    for signum, handler in STARTING_DISPOSITIONS.items():
        signal.signal(signum, handler)
    # and not blocked: a blocked signal stays blocked in every child too (a library may block one while it starts
    # a helper process, and a thread of its may have been the one to run the test's code before)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STARTING_DISPOSITIONS)
    yield
    for signum, handler in STARTING_DISPOSITIONS.items():
        signal.signal(signum, handler)
    launch.STOP.signum = None


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def events() -> FakeEvents:
    return FakeEvents()


@pytest.fixture
def burner() -> Iterator[list[int]]:
    """One process spinning on each usable core, killed at the end by its pid. Started detached (the shell that
    starts it exits at once), so that it is another process's load, not a child of this one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    spin = f"{sys.executable} -c 'while True: pass' </dev/null >/dev/null 2>&1 & echo $!"
    pids = [int(subprocess.run(["sh", "-c", spin], capture_output=True, text=True).stdout) for _ in range(cores)]
    time.sleep(0.3)
    try:
        yield pids
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # it cannot exit on its own, but be safe
                os.kill(pid, signal.SIGKILL)


def _cannot_create_in(folder: Path) -> bool:
    """Whether this process is refused both by access(2) (what stepscope checks) and by an actual file creation."""
    if os.access(folder, os.W_OK):
        return False
    probe = folder / ".probe"
    try:
        probe.touch()
    except OSError:
        return True
    probe.unlink()
    return False


def _lock_as_root(folder: Path) -> tuple[list[str] | None, list[str]]:
    """Make ``folder`` unwritable for root, which ignores modes: the immutable attribute (chattr +i), else a
    read-only bind mount. Returns the command that undoes it (None when nothing worked) and why each way failed."""
    tried: list[str] = []
    ways = (
        ([["chattr", "+i", str(folder)]], ["chattr", "-i", str(folder)]),
        (
            [["mount", "--bind", str(folder), str(folder)], ["mount", "-o", "remount,bind,ro", str(folder)]],
            ["umount", str(folder)],
        ),
    )
    for steps, undo in ways:
        name = steps[0][0]
        done = []
        for step in steps:
            try:
                result = subprocess.run(step, capture_output=True, text=True, timeout=30)
            except (OSError, subprocess.TimeoutExpired) as error:
                result = subprocess.CompletedProcess(step, 1, "", str(error))
            if result.returncode != 0:
                tried.append(f"{' '.join(step)}: {(result.stderr or result.stdout).strip() or result.returncode}")
                break
            done.append(step)
        if done and len(done) == len(steps) and _cannot_create_in(folder):
            return undo, tried
        if done:  # half done, or done and still writable: take it back before the next way
            subprocess.run(undo, capture_output=True, timeout=30)
            if len(done) == len(steps):
                tried.append(f"{name}: the folder stayed writable")
    return None, tried


@pytest.fixture
def locked_folder(tmp_path: Path) -> Iterator[Path]:
    """An empty folder this test process cannot create files in, also as root (CI runs as root): mode 0o500 for a
    user; as root, the immutable attribute (``chattr +i``), else a read-only bind mount. Skips, saying why, only
    where none works. Always made writable again afterwards, so that pytest can remove its temporary folders."""
    folder = tmp_path / "locked"
    folder.mkdir(mode=0o500)
    undo: list[str] | None = None
    try:
        if os.geteuid() == 0:
            undo, tried = _lock_as_root(folder)
            if undo is None:
                pytest.skip(f"no way to make a folder unwritable for root here: {'; '.join(tried)}")
        assert _cannot_create_in(folder), f"{folder} is still writable"
        yield folder
    finally:
        if undo is not None:
            subprocess.run(undo, check=True, capture_output=True, timeout=30)
        folder.chmod(0o700)


# The suite's longest tests (10-30 s each: a loader sweep, two-node jobs, a doctor beside a burner, a hung DDP job),
# started first: xdist hands out tests in collection order, and these, alphabetically late, otherwise left one worker
# running alone at the end.
SLOW_FIRST = (
    "tests/test_doctor.py::test_doctor_sweep_ranks_the_loader_settings_by_the_runs_own_step",
    "tests/test_multinode.py::test_a_two_node_torchrun_job_merges_into_one",
    "tests/test_scenarios.py::test_beside_a_cpu_burner_the_doctor_is_right_or_says_the_machine_is_busy"
    "[workers-oversubscribed]",
    "tests/test_scenarios.py::test_doctor_names_the_bound_and_the_first_fix[workers-oversubscribed]",
    "tests/test_multinode.py::test_a_two_node_job_through_a_shared_out_folder",
    "tests/test_hang.py::test_ddp_a_hung_rank_is_named_with_its_line_and_its_waiting_peer_is_not_the_straggler",
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Start the slowest tests first (``SLOW_FIRST``), and keep a module's tests that read a module-scoped fixture
    (a training run they share) on one xdist worker (`make test` runs ``--dist loadgroup``): split across two, the
    run would start twice. Every other test is spread freely, so no worker is left with a whole file at the end."""
    items.sort(key=lambda item: SLOW_FIRST.index(item.nodeid) if item.nodeid in SLOW_FIRST else len(SLOW_FIRST))
    for item in items:
        infos = getattr(item, "_fixtureinfo", None)
        if infos is None:
            continue
        shared = any(
            defs[-1].scope == "module" and defs[-1].baseid.split("::")[0] == item.nodeid.split("::")[0]
            for defs in infos.name2fixturedefs.values()
            if defs
        )
        if shared:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def pytest_configure(config: pytest.Config) -> None:
    """With ``--dist loadgroup``, stop before the run if pytest-xdist cannot group tests with this pytest (it marks
    a grouped test by rewriting ``Node._nodeid``; pytest 9.2 reads ``Node._id`` instead): each shared module
    fixture (a training run, a server, the Ray cluster) would silently run once per worker."""
    if config.getoption("dist", "no") != "loadgroup":
        return
    from _pytest.nodes import Node

    probe = object.__new__(Node)
    probe._nodeid = "probe@group"
    try:
        grouped = probe.nodeid == "probe@group"
    except AttributeError:
        grouped = False
    if not grouped:
        raise pytest.UsageError(
            f"pytest-xdist's --dist loadgroup cannot group tests with pytest {pytest.__version__}: install the "
            "versions pyproject.toml's dev extra allows (make .venv/.installed)"
        )
