"""py-spy for stepscope: a flame graph of a whole run, and what every thread of a live run is doing right now.

``stepscope run --py-spy OUT.svg`` has py-spy *start* the command (``py-spy record --subprocesses -- ...``), so that
py-spy is an ancestor of every process it samples: Linux lets a process read its descendants' memory under the
default Yama setting (``ptrace_scope`` 1) without root or CAP_SYS_PTRACE, which attaching to a running pid needs.
One SVG covers the whole command: each process (torchrun's ranks, DataLoader workers) is a tower of its own, rooted
at a ``process PID:"command"`` frame, which stepscope renames ``rank N`` where a rank reported.

py-spy kills the process it started when it stops, and returns 0 whatever that process returned. So py-spy starts a
small holder (this file, run as a script) which starts the command, puts it back in stepscope's process group
(Ctrl-C at a terminal reaches the command, not py-spy) and writes its pid and exit code to a status file. stepscope
passes its signals to the command, reads the exit code from the file, and is the subreaper of the tree: should
py-spy die early (it kills the holder then), the command is adopted by stepscope and waited for, so py-spy can never
end or change the run.

``stepscope dump PID`` takes a few ``py-spy dump --json`` samples of the process and its descendants, a short
interval apart, and says per process whether the main thread is busy (running, or a stack that changes) or blocked
(idle in every sample with the same stack), and in what: a torch.distributed collective, a CUDA synchronize, a socket
recv, a lock, select/poll, a futex, a sleep or a child process. Blocked in one of the first ones looks hung.

This module imports only the standard library at the top: the holder runs it with ``python -S``.
"""

from __future__ import annotations

import contextlib
import json
import linecache
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INSTALL = "pip install 'stepscope[pyspy]' (or pip install py-spy)"
RECORD_HINT = "(`stepscope run --py-spy OUT.svg ...` needs none of this: py-spy starts the command itself.)"
RECORD_RATE_HZ = 100  # py-spy's default: one sample per 10 ms, cheap enough to leave the step times alone
PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
RUN_CONFIG = "STEPSCOPE_RUN"  # bootstrap.ENV_CONFIG: the holder cannot import stepscope (python -S)


class PySpyError(Exception):
    """py-spy is missing or may not read the process; the message says what to do."""


def find_pyspy() -> str:
    """The py-spy binary: the one installed with this Python (the ``[pyspy]`` extra), else the first on PATH."""
    beside = Path(sys.executable).with_name("py-spy.exe" if os.name == "nt" else "py-spy")
    if beside.is_file():
        return str(beside)
    found = shutil.which("py-spy")
    if found is None:
        raise PySpyError(f"py-spy is not installed: {INSTALL}.")
    return found


# -- ptrace permission ---------------------------------------------------------------------------------------------

CAP_SYS_PTRACE = 19  # bit in /proc/PID/status CapEff
_DENIED = re.compile(r"Permission Denied|Permission denied \(os error 13\)|Operation not permitted \(os error 1\)")


@dataclass
class PtraceFacts:
    """What decides whether this process may read another one's memory (Linux)."""

    yama_scope: int | None  # /proc/sys/kernel/yama/ptrace_scope; None without the Yama module
    cap_sys_ptrace: bool  # CAP_SYS_PTRACE in the effective set
    root: bool  # euid 0: "run as root" is no fix then
    container: bool

    @classmethod
    def here(cls) -> PtraceFacts:
        """The facts of the current process."""
        scope_file = Path("/proc/sys/kernel/yama/ptrace_scope")
        scope = int(scope_file.read_text()) if scope_file.is_file() else None
        return cls(
            yama_scope=scope, cap_sys_ptrace=_has_cap_sys_ptrace(), root=os.geteuid() == 0, container=_in_container()
        )


def _has_cap_sys_ptrace() -> bool:
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return False
    found = re.search(r"^CapEff:\s*([0-9a-f]+)$", status, re.MULTILINE)
    return bool(found) and bool(int(found.group(1), 16) >> CAP_SYS_PTRACE & 1)


def _in_container() -> bool:
    if Path("/.dockerenv").exists() or Path("/run/.containerenv").exists():
        return True
    try:
        return bool(re.search(r"docker|kubepods|containerd|libpod", Path("/proc/1/cgroup").read_text()))
    except OSError:
        return False


def is_permission_error(pyspy_stderr: str) -> bool:
    """Whether py-spy's error output says the kernel refused it access to the process (EPERM/EACCES)."""
    return bool(_DENIED.search(pyspy_stderr))


def permission_message(pid: int | None, facts: PtraceFacts) -> str:
    """What to tell a user whose py-spy may not read process ``pid`` (None: unknown): why, from ``facts``, and each
    fix."""
    if facts.yama_scope == 3:
        why = "kernel.yama.ptrace_scope is 3: ptrace is off for everyone until the next reboot"
    elif facts.yama_scope == 2:
        why = "kernel.yama.ptrace_scope is 2: only processes with CAP_SYS_PTRACE may read another process"
    elif facts.yama_scope == 1 and not facts.cap_sys_ptrace:
        why = (
            "kernel.yama.ptrace_scope is 1: a process may only read its own descendants, and py-spy is not an ancestor"
        )
    elif facts.container and not facts.cap_sys_ptrace:
        why = "this container lacks CAP_SYS_PTRACE"
    else:
        why = "the process belongs to another user, or a security module (seccomp, AppArmor) forbids ptrace"
    fixes = [] if facts.root else ['run as root: sudo env "PATH=$PATH" stepscope ...']
    fixes += [
        "in Docker, start the container with --cap-add SYS_PTRACE (Kubernetes: securityContext.capabilities.add: "
        '["SYS_PTRACE"])',
        "or allow reading non-child processes: echo 0 | sudo tee /proc/sys/kernel/yama/ptrace_scope",
    ]
    if facts.yama_scope == 3:
        fixes = ["reboot (ptrace_scope 3 cannot be lowered while the machine runs)"]
    target = "the process's" if pid is None else f"process {pid}'s"
    return f"py-spy may not read {target} memory ({why}). Fix: {'; '.join(fixes)}."


# -- recording a run -----------------------------------------------------------------------------------------------


@dataclass
class _Status:
    """The holder's status file: its own pid, the command's once started, then the command's exit code (shell
    style). Written whole each time (a reader never sees half of it); missing values are None."""

    path: Path

    def read(self) -> dict[str, int | None]:
        """``holder``, ``command`` and ``code``."""
        try:
            found = json.loads(self.path.read_text())
        except (OSError, ValueError):
            found = {}
        return {key: found.get(key) for key in ("holder", "command", "code")}

    def write(self, command: int | None, code: int | None = None) -> None:
        """Record the command's pid and exit code, with the writer's (the holder's) pid."""
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps({"holder": os.getpid(), "command": command, "code": code}))
        os.replace(partial, self.path)


class RecordedProcess:
    """The command running under ``py-spy record``, standing in for its ``Popen`` in ``launch._wait``:
    ``send_signal`` reaches the command, ``wait`` returns the command's exit code (shell style: 128+N for signal N),
    and neither depends on py-spy doing well. ``finish`` checks the flame graph and names the ranks in it."""

    def __init__(self, argv: list[str], env: dict[str, str], out: Path, rate_hz: int = RECORD_RATE_HZ) -> None:
        self.argv = argv
        self.out = out
        self.warning = ""  # one sentence once py-spy failed: the run went on without (all of) the flame graph
        self._env = env
        self._plain: subprocess.Popen[bytes] | None = None  # the command started without py-spy, after a failure
        out.unlink(missing_ok=True)  # a graph from an earlier run must not pass for this one's
        self._work = Path(tempfile.mkdtemp(prefix="stepscope-pyspy-"))
        self._status = _Status(self._work / "status")
        self._log = self._work / "py-spy.log"
        _become_subreaper()
        command = [find_pyspy(), "record", "--output", str(out), "--format", "flamegraph", "--rate", str(rate_hz)]
        # py-spy's own messages go to a log; the holder gets the user's stdout and stderr back through two copies
        # that py-spy inherits. py-spy gets a process group of its own: the terminal's Ctrl-C is the command's.
        streams = (os.dup(1), os.dup(2))
        try:
            with self._log.open("wb") as log:
                self._pyspy: subprocess.Popen[bytes] | None = subprocess.Popen(
                    [*command, "--subprocesses", "--", *self._holder(argv, streams)],
                    env=env,
                    stdout=log,
                    stderr=log,
                    pass_fds=streams,
                    preexec_fn=os.setpgrp,
                )
        except OSError as error:  # a broken py-spy install: the run goes on without it
            self.warning = f"py-spy could not start ({error.strerror})"
            self._pyspy = None
            self._plain = subprocess.Popen(argv, env=env)
        finally:
            for fd in streams:
                os.close(fd)

    def _holder(self, argv: list[str], streams: tuple[int, int]) -> list[str]:
        # -S: no site, so no sitecustomize: the holder itself is not instrumented, and starts in milliseconds.
        group = str(os.getpgrp())
        return [sys.executable, "-S", __file__, "hold", str(self._status.path), group, *map(str, streams), "--", *argv]

    def send_signal(self, signum: int) -> None:
        """Pass a signal to the command; one that comes before the holder started it waits for it (milliseconds)."""
        if self._plain is not None:
            self._plain.send_signal(signum)
            return
        assert self._pyspy is not None
        deadline = time.monotonic() + 5
        while (pid := self._status.read()["command"]) is None and self._pyspy.poll() is None:
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.kill(pid, signum)

    def wait(self) -> int:
        """Wait for the command; its exit code, shell style (128+N when a signal N ended it)."""
        if self._pyspy is not None:
            pyspy_code = self._pyspy.wait()
            status = self._status.read()
            if status["code"] is not None:
                if pyspy_code != 0:
                    self._failed("py-spy failed", pyspy_code)
                return status["code"]
            self._failed("py-spy stopped before the command ended", pyspy_code)
            if status["command"] is not None:
                return _wait_adopted(self._status)
            # py-spy gave up before the holder started the command: run it plainly, as without --py-spy.
            self._plain = subprocess.Popen(self.argv, env=self._env)
        assert self._plain is not None
        return _shell_code(self._plain.wait())

    def _failed(self, what: str, pyspy_code: int) -> None:
        how = f"killed by signal {-pyspy_code}" if pyspy_code < 0 else f"exit code {pyspy_code}"
        log = self._log.read_text(errors="replace") if self._log.is_file() else ""
        if is_permission_error(log):
            why = ": " + permission_message(self._status.read()["holder"], PtraceFacts.here())
        else:
            errors = [line.strip() for line in log.splitlines() if line.startswith("Error:")]
            why = f": {errors[0]}" if errors else ""
        self.warning = f"{what} ({how}){why}"

    def finish(self, ranks: dict[int, int]) -> str:
        """After the run: name the ranks' towers (``ranks``: pid -> rank), clean up; one line for the user."""
        log = self._log.read_text(errors="replace") if self._log.is_file() else ""
        holder = self._status.read()["holder"]
        shutil.rmtree(self._work, ignore_errors=True)
        if not self.out.is_file():
            why = self.warning or f"py-spy: {_error_line(log)}"
            return f"stepscope: no flame graph was written ({why}); the run itself went on."
        _relabel(self.out, holder, ranks, self.argv)
        found = re.search(r"Samples: (\d+) Errors: (\d+)", log)
        counts = f" ({found.group(1)} samples, {found.group(2)} errors)" if found else ""
        warning = f" {self.warning}." if self.warning else ""
        return f"stepscope: py-spy flame graph written to {self.out}{counts}.{warning}"


def _error_line(pyspy_output: str) -> str:
    """py-spy's error, in one line: its "Error: ..." line, else its last line."""
    lines = [line.strip() for line in pyspy_output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("Error:")]
    if errors:
        return errors[0]
    return lines[-1] if lines else "py-spy said nothing"


def _become_subreaper() -> None:
    """Orphans of the command's tree come to this process (Linux): if py-spy kills the holder, stepscope can still
    wait for the command and learn its exit code."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _wait_adopted(status: _Status) -> int:
    """The command outlived its holder (py-spy killed it) and was adopted by this subreaper: reap until it ends."""
    while (code := status.read()["code"]) is None:
        try:
            pid, raw = os.waitpid(-1, 0)
        except ChildProcessError:
            return 1  # nothing left to wait for and no exit code: the command's fate is unknown
        if pid == status.read()["command"]:
            return _shell_code(os.waitstatus_to_exitcode(raw))
    return code


def _shell_code(code: int) -> int:
    return 128 - code if code < 0 else code


def _relabel(svg: Path, holder: int | None, ranks: dict[int, int], argv: list[str]) -> None:
    """Make the graph speak of the run, not of its plumbing: the title is the user's command, the holder's root
    frame "stepscope run", and the ranks' ``process PID:"cmd"`` frames ``rank N (pid PID):"cmd"``."""
    from html import escape

    text = svg.read_text()
    title = escape(f"stepscope run: {shlex.join(argv)}", quote=False)
    text = re.sub(r'(<text id="title"[^>]*>)[^<]*', lambda m: m.group(1) + title, text, count=1)
    if holder is not None:
        # In titles the command line is whole, and followed by the sample count; in labels it may be cut short.
        text = re.sub(rf"process {holder}:&quot;[^<]*?&quot;(?= \()", "stepscope run", text)
        text = re.sub(rf"process {holder}:[^<]*", "stepscope run", text)
    for pid, rank in ranks.items():
        text = text.replace(f"process {pid}:", f"rank {rank} (pid {pid}):")
    svg.write_text(text)


def _hold(status: _Status, group: int, streams: tuple[int, int], argv: list[str]) -> int:
    """The holder py-spy starts: run the command in ``group`` (stepscope's process group, so that the terminal's
    Ctrl-C reaches it and not py-spy), on the user's stdout and stderr (``streams``), and record its exit code."""
    for target, fd in zip((1, 2), streams, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    env = dict(os.environ)
    if RUN_CONFIG in env:  # bootstrap tells the script from other processes by its parent: this holder, not stepscope
        env[RUN_CONFIG] = json.dumps({**json.loads(env[RUN_CONFIG]), "parent_pid": os.getpid()})
    try:
        child = subprocess.Popen(argv, env=env, preexec_fn=lambda: os.setpgid(0, group))
    except OSError as error:
        print(f"stepscope: cannot start {argv[0]!r}: {error.strerror}.", file=sys.stderr)
        status.write(None, 127)
        return 127
    status.write(child.pid)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: None)  # stepscope signals the command itself
    code = _shell_code(child.wait())
    status.write(child.pid, code)
    return code


# -- dumping a live run --------------------------------------------------------------------------------------------


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
        raise PySpyError(f"py-spy could not read process {pid}: {_error_line(found.errors[pid])}")
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
        return ProcessReport(pid, command, "unknown", error=_error_line(message))
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


def _main(argv: list[str]) -> int:
    if argv[:1] == ["hold"] and "--" in argv and argv.index("--") == 5:
        status, group, out_fd, err_fd = argv[1:5]
        return _hold(_Status(Path(status)), int(group), (int(out_fd), int(err_fd)), argv[6:])
    print("usage: pyspy.py hold STATUS_FILE PROCESS_GROUP STDOUT_FD STDERR_FD -- COMMAND...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
