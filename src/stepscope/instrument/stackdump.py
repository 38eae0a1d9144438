"""`stepscope dump PID`: what every thread of a live run is doing right now, and whether it looks hung.

``stepscope dump PID`` takes a few ``py-spy dump --json`` samples of the process and its descendants, a short
interval apart, and says per process whether the main thread is busy (running, or a stack that changes) or blocked
(idle in every sample with the same stack), and in what: a torch.distributed collective, a CUDA synchronize, a socket
recv, a lock, select/poll, a futex, a sleep or a child process. Blocked in one of the first ones looks hung.
"""

from __future__ import annotations

import json
import linecache
import re
import subprocess
import sysconfig
import time
from dataclasses import dataclass, field
from typing import Any

from stepscope.instrument.pyspy import (
    RECORD_HINT,
    PtraceFacts,
    PySpyError,
    error_line,
    find_pyspy,
    is_permission_error,
    permission_message,
)


@dataclass
class Frame:
    """One frame of a py-spy stack: Python (file, line, the source line when readable) or native (a library)."""

    name: str
    file: str  # py-spy's short file name: "torch/distributed/distributed_c10d.py", "libc.so.6"
    line: int  # 0 for native frames
    native: bool
    path: str = ""  # the full file name
    code: str = ""  # the source line of a Python frame, stripped

    def is_users(self) -> bool:
        """A Python frame of the user's code: not the standard library's, not an installed package's."""
        library = (sysconfig.get_paths()["stdlib"], "site-packages", "dist-packages", "<frozen")
        return not self.native and not any(part in self.path for part in library)

    def where(self) -> str:
        """``name (file:line)`` as py-spy prints it."""
        return f"{self.name} ({self.file})" if self.native else f"{self.name} ({self.file}:{self.line})"


@dataclass
class ThreadSample:
    """One thread in one ``py-spy dump``: py-spy's idle/active flag and its stack, innermost frame first."""

    pid: int
    thread_id: int
    os_thread_id: int | None
    name: str
    active: bool
    frames: list[Frame]

    def python_key(self) -> tuple[tuple[str, str, int], ...]:
        """The Python stack, to compare samples (native frames are only dumped once)."""
        return tuple((f.name, f.file, f.line) for f in self.frames if not f.native)


def parse_dump(text: str) -> list[ThreadSample]:
    """The threads of ``py-spy dump --json`` output (one process)."""
    threads = []
    for raw in json.loads(text):
        frames = [_frame(f) for f in raw.get("frames") or []]
        threads.append(
            ThreadSample(
                pid=int(raw["pid"]),
                thread_id=int(raw["thread_id"]),
                os_thread_id=raw.get("os_thread_id"),
                name=raw.get("thread_name") or f"thread {raw['thread_id']:#x}",
                active=bool(raw.get("active")),
                frames=frames,
            )
        )
    return threads


def _frame(raw: dict[str, Any]) -> Frame:
    native = raw.get("module") is not None
    name, path, line = raw["name"], raw.get("filename") or "", int(raw.get("line") or 0)
    code = "" if native or not path else linecache.getline(path, line).strip()
    return Frame(name=name, file=raw.get("short_filename") or path, line=line, native=native, path=path, code=code)


@dataclass(frozen=True)
class Wait:
    """A place a thread blocks in, recognised from its frames (regular expressions; see ``WAITS``)."""

    kind: str
    label: str
    hung: bool  # stuck here suggests a hang; False for a sleep or a wait on a child process
    native: str = ""  # matched against native function names (py-spy --native)
    python: str = ""  # matched against "file:function" of the innermost Python frame
    code: str = ""  # matched against the source line of the innermost Python frame

    def matches(self, frames: list[Frame]) -> bool:
        """Whether a stack (innermost first) blocks here."""
        if self.native and any(f.native and re.search(self.native, f.name) for f in frames):
            return True
        inner = next((f for f in frames if not f.native), None)
        if inner is None:
            return False
        return bool(
            (self.python and re.search(self.python, f"{inner.file}:{inner.name}"))
            or (self.code and re.search(self.code, inner.code))
        )


# Most specific first: a gloo barrier also sits in a futex, a lock in a futex, a DataLoader queue in poll.
WAITS = (
    Wait(
        "collective",
        "a torch.distributed collective (another rank has not joined it)",
        hung=True,
        native=r"c10d::|gloo::|ProcessGroup|nccl",
        python=r"^torch/distributed/(?!elastic/)",
        code=r"\b(barrier|all_reduce|all_gather|reduce_scatter|broadcast|all_to_all)\w*\(",
    ),
    Wait(
        "cuda",
        "a CUDA synchronize (a kernel or NCCL collective that does not finish)",
        hung=True,
        native=r"^cu(da)?(Stream|Event|Device|Ctx)Synchronize",
        python=r"^torch/cuda/.*:synchronize$",
    ),
    Wait(
        "socket",
        "a socket recv (waiting for a peer to send)",
        hung=True,
        native=r"^(recv|recvfrom|recvmsg|accept4?|sock_recv\w*|sock_accept)$",
        python=r"^socket\.py:(socket\.accept|SocketIO\.readinto)$",
        code=r"\.(recv|recv_into|recvfrom|recvmsg|accept)\(",
    ),
    Wait(
        "lock",
        "a lock acquire (another thread holds it)",
        hung=True,
        native=r"^(PyThread_acquire_lock\w*|lock_PyThread_acquire_lock|pthread_mutex_lock|sem_\w*wait)$",
        python=r"^threading\.py:(Condition\.wait|Event\.wait|Semaphore\.acquire|Barrier\.wait|Thread\.join|"
        r"Thread\._wait_for_tstate_lock)$|^queue\.py:Queue\.(get|put|join)$",
        code=r"\.acquire\(",
    ),
    Wait(
        "poll",
        "select/poll (waiting on a pipe, a queue or a socket)",
        hung=True,
        native=r"^(select|poll|__poll|ppoll|pselect\w*|epoll_wait)$",
        python=r"^(selectors|multiprocessing/connection|multiprocessing/queues)\.py:",
    ),
    Wait(
        "futex",
        "a futex (a native lock or condition variable)",
        hung=True,
        native=r"pthread_cond_\w*wait|condition_variable::\w*wait|futex",
    ),
    Wait(
        "child",
        "a wait for a child process",
        hung=False,
        native=r"^(waitpid|wait4|__wait4|waitid)$",
        python=r"^(subprocess|multiprocessing/popen_\w+)\.py:|^torch/distributed/elastic/",
    ),
    Wait(
        "sleep",
        "time.sleep",
        hung=False,
        native=r"^(clock_nanosleep|nanosleep|time_sleep)$",
        code=r"\bsleep\(",
    ),
)


def blocked_in(frames: list[Frame]) -> Wait | None:
    """Where a stack (innermost frame first) blocks, the most specific ``WAITS`` entry that matches; None if none."""
    return next((wait for wait in WAITS if wait.matches(frames)), None)


@dataclass
class ThreadReport:
    """A thread over the samples: running (py-spy saw it active, or its stack changed) or blocked, and where."""

    thread_id: int
    name: str
    main: bool  # the process's main thread
    state: str  # "running" or "blocked"
    wait: str  # what it blocks in (a Wait label), "" when running or not recognised
    wait_kind: str
    hung: bool  # blocked in a wait that suggests a hang
    frames: list[Frame]  # the last sample's stack (with native frames where they could be read), innermost first


@dataclass
class ProcessReport:
    """A process over the samples; ``state`` is its main thread's: busy, hung (blocked in a wait that suggests a
    hang) or idle (sleeping, waiting for a child, or blocked somewhere not recognised); error when unreadable."""

    pid: int
    command: str
    state: str
    threads: list[ThreadReport] = field(default_factory=list)
    error: str = ""

    def main(self) -> ThreadReport | None:
        """The main thread, if py-spy saw it."""
        return next((t for t in self.threads if t.main), None)


@dataclass
class DumpReport:
    """``stepscope dump``: every Python process under ``pid``, and the verdict (hung, busy or idle)."""

    pid: int
    verdict: str
    headline: str
    samples: int
    seconds: float  # from the first sample to the last
    processes: list[ProcessReport]


def _pids(pid: int) -> dict[int, str]:
    """``pid`` and its descendants, each with its command line ("[rank N] " first for a launched rank)."""
    import psutil

    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        raise PySpyError(f"no process {pid}: is the run still going? (ps -ef | grep python)") from None
    found = {}
    for process in [root, *root.children(recursive=True)]:
        try:
            command = " ".join(process.cmdline())
        except psutil.Error:
            continue  # ended meanwhile
        try:
            rank = process.environ().get("RANK")  # set by torchrun and most launchers
        except psutil.Error:
            rank = None
        found[process.pid] = f"[rank {rank}] {command}" if rank is not None else command
    return found


def _dump_all(pyspy: str, pids: list[int], native: bool) -> dict[int, tuple[str, str]]:
    """One ``py-spy dump --json`` of each pid, all at once: (stdout, "") or ("", py-spy's error output)."""
    extra = ["--native"] if native else []
    running = {
        pid: subprocess.Popen(
            [pyspy, "dump", "--json", "--pid", str(pid), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in pids
    }
    results = {}
    for pid, process in running.items():
        out, err = process.communicate()
        results[pid] = (out, "") if process.returncode == 0 else ("", err or f"py-spy exited with {process.returncode}")
    return results


@dataclass
class Samples:
    """py-spy's raw output for a process tree, as ``classify`` reads it (tests keep real ones under tests/data)."""

    pid: int
    commands: dict[int, str]  # pid -> command line, the tree under (and with) ``pid``
    seconds: float  # from the first dump to the last
    rounds: list[dict[int, str]]  # per sample: pid -> ``py-spy dump --json`` stdout
    native: dict[int, str] = field(default_factory=dict)  # the same with --native, once, where a thread blocks
    errors: dict[int, str] = field(default_factory=dict)  # pid -> py-spy's error output, for unreadable processes


def sample(pid: int, samples: int = 5, interval_s: float = 0.5) -> Samples:
    """Dump ``pid`` and its descendants ``samples`` times, ``interval_s`` seconds apart, then once more with native
    frames where a thread looks blocked. Raises PySpyError: py-spy missing, no such process, ptrace not permitted."""
    pyspy = find_pyspy()
    found = Samples(pid, _pids(pid), 0.0, [])
    started = time.monotonic()
    last_error: dict[int, str] = {}
    for n in range(samples):
        if n:
            time.sleep(interval_s)
        results = _dump_all(pyspy, list(found.commands), native=False)
        last_error.update({p: err for p, (_, err) in results.items() if err})
        found.rounds.append({p: out for p, (out, err) in results.items() if not err})
    found.seconds = round(time.monotonic() - started, 2)
    # py-spy fails now and then on a process that changes under it: only one that never answered is unreadable.
    answered = {p for round_ in found.rounds for p in round_}
    found.errors = {p: err for p, err in last_error.items() if p not in answered}
    if pid in found.errors and is_permission_error(found.errors[pid]):
        raise PySpyError(f"{permission_message(pid, PtraceFacts.here())} {RECORD_HINT}")
    if len(found.errors) == len(found.commands):
        raise PySpyError(f"py-spy could not read process {pid}: {error_line(found.errors[pid])}")
    blocked = sorted({p for p, _ in _blocked(_parse_rounds(found.rounds))})
    found.native = {p: out for p, (out, err) in _dump_all(pyspy, blocked, native=True).items() if not err}
    return found


def dump(pid: int, samples: int = 5, interval_s: float = 0.5) -> DumpReport:
    """``sample`` then ``classify``: what every thread under ``pid`` does, and whether the run looks hung."""
    return classify(sample(pid, samples, interval_s))


def classify(found: Samples) -> DumpReport:
    """Each process's state from its main thread, each thread's from its samples, and the run's verdict."""
    rounds = _parse_rounds(found.rounds)
    native = {p: parse_dump(text) for p, text in found.native.items()}
    processes = [
        _process_report(p, command, rounds, native.get(p), found.errors.get(p, ""))
        for p, command in found.commands.items()
        if not _not_python(found.errors.get(p, ""))
    ]
    verdict, headline = _verdict(processes, found.seconds, len(rounds))
    return DumpReport(found.pid, verdict, headline, len(rounds), found.seconds, processes)


def _parse_rounds(rounds: list[dict[int, str]]) -> list[dict[int, list[ThreadSample]]]:
    return [{p: parse_dump(text) for p, text in round_.items()} for round_ in rounds]


def _not_python(error: str) -> bool:
    """py-spy's error for a process that runs no Python (a shell, py-spy itself): left out of the report."""
    return "python version" in error or "python interpreter" in error.lower()


def _history(rounds: list[dict[int, list[ThreadSample]]], pid: int) -> dict[int, list[ThreadSample]]:
    """Each thread of ``pid`` (by thread id) over the rounds it was seen in."""
    seen: dict[int, list[ThreadSample]] = {}
    for round_ in rounds:
        for thread in round_.get(pid, []):
            seen.setdefault(thread.thread_id, []).append(thread)
    return seen


def _is_blocked(history: list[ThreadSample], rounds: int) -> bool:
    """Seen in every one of its process's ``rounds`` samples (two at least) with one and the same Python stack, and
    idle in most: py-spy's idle flag is the kernel's thread state, which a sleeping thread woken for a moment (or
    short of CPU) misses now and then."""
    active = sum(t.active for t in history)
    same = len({t.python_key() for t in history}) == 1
    return rounds >= 2 and len(history) == rounds and 2 * active < rounds and same


def _blocked(rounds: list[dict[int, list[ThreadSample]]]) -> set[tuple[int, int]]:
    pids = {p for round_ in rounds for p in round_}
    return {
        (p, thread_id)
        for p in pids
        for thread_id, history in _history(rounds, p).items()
        if _is_blocked(history, _answered(rounds, p))
    }


def _answered(rounds: list[dict[int, list[ThreadSample]]], pid: int) -> int:
    """In how many samples py-spy could read ``pid``."""
    return sum(pid in round_ for round_ in rounds)


def _process_report(
    pid: int,
    command: str,
    rounds: list[dict[int, list[ThreadSample]]],
    native: list[ThreadSample] | None,
    error: str,
) -> ProcessReport:
    if error:
        message = "py-spy may not read it (ptrace not permitted)" if is_permission_error(error) else error
        return ProcessReport(pid, command, "unknown", error=error_line(message))
    with_native = {t.thread_id: t for t in native or []}
    report = ProcessReport(pid, command, "gone")  # seen in no sample: it ended meanwhile
    for thread_id, history in _history(rounds, pid).items():
        report.threads.append(_thread_report(history, _answered(rounds, pid), with_native.get(thread_id)))
    main = report.main()
    if main is not None:
        report.state = "busy" if main.state == "running" else "hung" if main.hung else "idle"
    return report


def _thread_report(history: list[ThreadSample], rounds: int, native: ThreadSample | None) -> ThreadReport:
    last = history[-1]
    is_main = last.os_thread_id == last.pid or last.name == "MainThread"
    if not _is_blocked(history, rounds):
        return ThreadReport(last.thread_id, last.name, is_main, "running", "", "", False, last.frames)
    frames = native.frames if native is not None else last.frames
    wait = blocked_in(frames)
    if wait is None:
        return ThreadReport(last.thread_id, last.name, is_main, "blocked", "", "", False, frames)
    return ThreadReport(last.thread_id, last.name, is_main, "blocked", wait.label, wait.kind, wait.hung, frames)


_KIND_ORDER = {wait.kind: n for n, wait in enumerate(WAITS)}


def _verdict(processes: list[ProcessReport], seconds: float, samples: int) -> tuple[str, str]:
    """The run's verdict and its one-line headline."""
    busy = [p for p in processes if p.state == "busy"]
    hung = sorted((p for p in processes if p.state == "hung"), key=_priority)
    if busy:
        names = ", ".join(str(p.pid) for p in busy)
        who = f"process {names} runs" if len(busy) == 1 else f"processes {names} run"
        line = f"busy: {who} Python code (py-spy saw it active, or its stack changed)"
        if hung:
            line += f"; {_blocked_text(hung[0], seconds, samples)}: maybe it waits for the busy one"
        return "busy", line + "."
    if hung:
        more = f" (and {len(hung) - 1} more process(es))" if len(hung) > 1 else ""
        return "hung", f"looks hung: {_blocked_text(hung[0], seconds, samples)}{more}."
    return (
        "idle",
        "idle: no main thread runs or blocks in a wait that suggests a hang (they sleep or wait for children).",
    )


def _priority(process: ProcessReport) -> int:
    """Collectives first: the most telling hung process leads the headline."""
    main = process.main()
    return _KIND_ORDER.get(main.wait_kind, len(WAITS)) if main else len(WAITS)


def _blocked_text(process: ProcessReport, seconds: float, samples: int) -> str:
    main = process.main()
    assert main is not None
    # The line of the user's code that made the call says more than the library's frame that blocks.
    inner = next((f for f in main.frames if f.is_users()), None) or next((f for f in main.frames if not f.native), None)
    where = "" if inner is None else f" at {inner.where()}" + (f": {inner.code}" if inner.code else "")
    return (
        f"process {process.pid} is blocked in {main.wait} for at least {seconds:.1f} s "
        f"(the same stack in {samples} samples){where}"
    )


def format_report(report: DumpReport) -> str:
    """The report as text: each process, each thread's state and stack, then the verdict line."""
    lines = []
    for process in report.processes:
        lines.append(f"process {process.pid} [{process.state}]: {process.command}")
        if process.error:
            lines.append(f"  {process.error}")
        for thread in process.threads:
            state = thread.state if not thread.wait else f"blocked in {thread.wait}"
            lines.append(f"  thread {thread.name!r}: {state}")
            for frame in thread.frames:
                if frame.native and frame.name.startswith("0x"):
                    continue  # an unnamed address says nothing
                code = f"   {frame.code}" if frame.code else ""
                lines.append(f"      {_shorten(frame.where())}{code}")
        lines.append("")
    lines.append(report.headline)
    return "\n".join(lines)


def _shorten(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
