"""py-spy for stepscope: finding it, permission messages, and a flame graph of a whole run (`stackdump` reads a
live run's stacks).

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

This module imports only the standard library at the top: the holder runs it with ``python -S``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

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

    def finish(self, ranks: dict[int, tuple[int, str]]) -> str:
        """After the run: name the ranks' towers (``ranks``: pid -> (rank, its command)), clean up; one line for the
        user."""
        log = self._log.read_text(errors="replace") if self._log.is_file() else ""
        status = self._status.read()
        shutil.rmtree(self._work, ignore_errors=True)
        if not self.out.is_file():
            why = self.warning or f"py-spy: {error_line(log)}"
            return f"stepscope: no flame graph was written ({why}); the run itself went on."
        _relabel(self.out, status["holder"], status["command"], ranks, self.argv)
        found = re.search(r"Samples: (\d+) Errors: (\d+)", log)
        counts = f" ({found.group(1)} samples, {found.group(2)} errors)" if found else ""
        warning = f" {self.warning}." if self.warning else ""
        return f"stepscope: py-spy flame graph written to {self.out}{counts}.{warning}"


def error_line(pyspy_output: str) -> str:
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


def _relabel(
    svg: Path, holder: int | None, command: int | None, ranks: dict[int, tuple[int, str]], argv: list[str]
) -> None:
    """Make the graph speak of the run, not of its plumbing: the title is the user's command, the holder's root
    frame "stepscope run", the command's (pid ``command``) ``process PID:"argv"`` and each rank's ``rank N (pid
    PID):"its command"``."""
    from html import escape

    text = svg.read_text()
    title = escape(f"stepscope run: {shlex.join(argv)}", quote=False)
    text = re.sub(r'(<text id="title"[^>]*>)[^<]*', lambda m: m.group(1) + title, text, count=1)
    # In titles the command line is whole, and followed by the sample count; in labels it may be cut short.
    if holder is not None:
        text = re.sub(rf"process {holder}:&quot;[^<]*?&quot;(?= \()", "stepscope run", text)
        text = re.sub(rf"process {holder}:[^<]*", "stepscope run", text)
    # py-spy reads a process's command line once, when it first sees it: between a fork and its exec that is the
    # parent's, during the exec it is empty (both seen on a loaded machine). The command's (argv) and the ranks'
    # (their summaries) are known: name them from those.
    names = {command: f'process {command}:"{shlex.join(argv)}"'} if command is not None else {}
    names.update({pid: f'rank {rank} (pid {pid}):"{cmd}"' for pid, (rank, cmd) in ranks.items()})
    for pid, name in names.items():
        label = escape(name).replace("\\", "\\\\")  # a replacement template: backslashes stand for themselves
        text = re.sub(rf"(<title>)process {pid}:&quot;[^<]*?&quot;(?= \()", rf"\g<1>{label}", text)
        text = re.sub(rf"(<text[^>]*>)process {pid}:[^<]*", rf"\g<1>{label}", text)
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


def _main(argv: list[str]) -> int:
    if argv[:1] == ["hold"] and "--" in argv and argv.index("--") == 5:
        status, group, out_fd, err_fd = argv[1:5]
        return _hold(_Status(Path(status)), int(group), (int(out_fd), int(err_fd)), argv[6:])
    print("usage: pyspy.py hold STATUS_FILE PROCESS_GROUP STDOUT_FD STDERR_FD -- COMMAND...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
