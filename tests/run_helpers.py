"""Helpers for the end-to-end tests of ``stepscope run``: launch it as a subprocess (or its training process in
this one), read back its summary."""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import logging
import os
import runpy
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from stepscope.invariants import broken
from stepscope.summary import RunSummary

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
SRC = REPO / "src"
SCRIPTS = TESTS / "scripts"

# Every phase the run command may time on its own; `total` is the whole step.
PHASES = ("data_wait", "h2d", "forward", "backward", "comms", "clip", "optimizer", "zero_grad", "sync", "other")
OWN_PHASE = "stepscope"  # stepscope's own time outside the phases (record.OWN_PHASE)


# For a test of the process's own heap (page faults, the allocator): its Python processes start as a user's would,
# without the suite's tests/site/sitecustomize.py, which spares most processes torch's import of torch._dynamo and
# with it the heap that import leaves (under jemalloc, a churning script faulted 0.3 times a step after that import
# and 2,050 times without it).
AS_USERS_START = {"PYTHONPATH": str(SRC)}


def run_env(extra: dict[str, str] | None = None, pythonpath: tuple[str, ...] = ()) -> dict[str, str]:
    """The current environment with stepscope importable (then ``pythonpath``), one thread per process, and no
    STEPSCOPE/CI overrides."""
    env = dict(os.environ)
    env.pop("STEPSCOPE", None)
    env.pop("CI", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), *pythonpath, env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    if extra:
        env.update(extra)
    return env


def terminal_signals() -> None:
    """``preexec_fn`` for a process started as from a terminal: SIGINT and SIGTERM at their default actions. A suite
    started in the background of a script (a shell's `&`, as CI runners do) ignores SIGINT, and every process it
    starts would inherit that, which Python and stepscope rightly honour: a test's Ctrl-C would never reach it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def stepscope_cmd(
    json_path: Path | None, *args: str, warmup: int | None = 3, steps: int | None = 20, verb: str = "run"
) -> list[str]:
    """``python -m stepscope.cli VERB [--warmup W] [--steps S] [--json PATH] ARGS...`` (VERB: run or doctor)."""
    cmd = [sys.executable, "-m", "stepscope.cli", verb]
    if warmup is not None:
        cmd += ["--warmup", str(warmup)]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    if json_path is not None:
        cmd += ["--json", str(json_path)]
    return [*cmd, *args]


def script(name: str) -> str:
    return str(SCRIPTS / name)


@dataclass
class RunResult:
    cmd: list[str]
    returncode: int
    stdout: str
    stderr: str
    json_path: Path

    @property
    def summary(self) -> RunSummary:
        assert self.json_path.exists(), f"no summary written at {self.json_path}\n{self.describe()}"
        return RunSummary.from_json(self.json_path)

    def describe(self) -> str:
        """Everything needed to understand a failure, for assertion messages."""
        return (
            f"command: {' '.join(self.cmd)}\nexit code: {self.returncode}\n"
            f"--- stdout ---\n{self.stdout[-6000:]}\n--- stderr ---\n{self.stderr[-6000:]}"
        )


def stepscope_run(
    tmp_path: Path,
    *args: str,
    warmup: int | None = 3,
    steps: int | None = 20,
    cwd: Path | None = None,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    pythonpath: tuple[str, ...] = (),
    verb: str = "run",
) -> RunResult:
    """Run ``stepscope run`` (or ``doctor``) to completion with ``--json tmp_path/s.json``."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    json_path = tmp_path / "s.json"
    cmd = stepscope_cmd(json_path, *args, warmup=warmup, steps=steps, verb=verb)
    proc = subprocess.run(
        cmd,
        cwd=cwd or tmp_path,
        env=run_env(env, pythonpath),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return RunResult(cmd, proc.returncode, proc.stdout, proc.stderr, json_path)


# torch's intra-op threads in a process started with this environment (read before any test sets its own).
FRESH_THREADS = torch.get_num_threads()


class _ScriptHere:
    """Stands in for the ``subprocess.Popen`` of the training process in ``launch.run``: the script runs in this
    process, instrumented by bootstrap's own ``instrument``, and writes its summary with bootstrap's own writer, as
    the child would at exit. Only the interpreter start (torch's import: ~2.5 s of CPU a run) is left out."""

    def __init__(self, argv: list[str], env: dict[str, str], start_new_session: bool = False) -> None:
        from stepscope.instrument import bootstrap
        from stepscope.summary import Exit

        assert argv[0] == sys.executable and argv[1] != "-m", f"only a script runs in this process: {argv}"
        self.pid = os.getpid()
        code = 0
        with _script_state(argv[1], env):
            tracker, undo = bootstrap.instrument(json.loads(env[bootstrap.ENV_CONFIG]))
            at_exit: list[Any] = []

            def register(function: Any, *args: Any, **kwargs: Any) -> Any:
                if getattr(function, "__module__", None) != "__main__":  # torch's, a library's: this process's
                    return real_register(function, *args, **kwargs)
                at_exit.append((function, args, kwargs))
                return function

            real_register = atexit.register
            try:
                sys.argv = argv[1:]
                with mock.patch.object(atexit, "register", register):
                    runpy.run_path(argv[1], run_name="__main__")
            except SystemExit as end:  # StopRun among them
                code = end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
            except Exception as error:  # what the child's exit hook records, and Python prints
                tracker.outcome = Exit(reason="error", code=1, error=f"{type(error).__name__}: {error}", at=time.time())
                traceback.print_exc()
                code = 1
            finally:
                undo()
            for function, args, kwargs in reversed(at_exit):  # the script's exit handlers run before stepscope's
                try:
                    function(*args, **kwargs)
                except Exception:  # printed, and the next handler runs, as at a process's exit
                    traceback.print_exc()
            bootstrap._write_summary(tracker, final=True)
        self.returncode = code

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode

    def poll(self) -> int:
        return self.returncode

    def send_signal(self, signum: int) -> None:
        pass


@contextlib.contextmanager
def _script_state(path: str, env: dict[str, str]) -> Iterator[None]:
    """The process state a script run here sees, put back afterwards: its environment (the child's: what an A/B
    variant sets, say, though not what takes effect at a process's start, such as OMP_NUM_THREADS or malloc's
    thresholds), argv, the import path and the modules it imported from its own folder, torch's thread count and
    anomaly mode, and no Scope or compilation of earlier tests."""
    from stepscope import scope

    saved_env = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    saved_argv, saved_path, threads = list(sys.argv), list(sys.path), torch.get_num_threads()
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or FRESH_THREADS))  # what torch starts a process with
    anomaly, modules, scopes = torch.is_anomaly_enabled(), set(sys.modules), set(scope._SCOPES)
    scope._SCOPES.clear()
    dynamo = sys.modules.get("torch._dynamo.utils")  # what earlier tests compiled: a fresh process counts nothing
    compiled = dynamo.counters.copy() if dynamo is not None else None
    if dynamo is not None:
        dynamo.counters.clear()
    sys.path.insert(0, str(Path(path).resolve().parent))  # as `python SCRIPT` puts it first
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv[:], sys.path[:] = saved_argv, saved_path
        for other in scopes:  # the Scopes of tests before: a fresh process has none
            scope._SCOPES.add(other)
        if dynamo is not None:
            dynamo.counters.clear()
            dynamo.counters.update(compiled)
        torch.set_num_threads(threads)
        torch.autograd.set_detect_anomaly(anomaly)
        for name in set(sys.modules) - modules:
            if getattr(sys.modules[name], "__file__", None) and str(SCRIPTS) in sys.modules[name].__file__:
                del sys.modules[name]


class _SubprocessHere:
    """The ``subprocess`` module as ``launch`` sees it during ``stepscope_here``: Popen runs the script here."""

    Popen = _ScriptHere

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)


def cli_here(tmp_path: Path, cmd: list[str]) -> tuple[int, str, str]:
    """``python -m stepscope.cli VERB ...`` (``cmd``) with its training process run in this one: the CLI, its
    options, the launcher's merge and the report are the real ones; the script runs here under the hooks bootstrap
    installs in a child (``_ScriptHere``). For tests of what stepscope measures on a loop; the process itself (argv,
    signals, exit codes, launchers, what a process starts with) needs a real ``stepscope`` process. Returns the
    exit code, stdout and stderr."""
    from stepscope import cli

    assert cmd[:3] == [sys.executable, "-m", "stepscope.cli"], cmd
    tmp_path.mkdir(parents=True, exist_ok=True)
    stdout, stderr = io.StringIO(), io.StringIO()
    saved_cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), scripts_here():
            try:
                code = cli.main(cmd[3:])
            except SystemExit as end:  # argparse's refusals
                code = end.code if isinstance(end.code, int) else 1
    finally:
        os.chdir(saved_cwd)
    return code, stdout.getvalue(), stderr.getvalue()


@contextlib.contextmanager
def scripts_here() -> Iterator[None]:
    """Within: every training process ``launch.run`` starts for a script runs in this process (``_ScriptHere``), for
    tests that call stepscope's functions (``verify``, ``run_ab``) rather than its CLI."""
    from stepscope.instrument import launch

    saved_subprocess = launch.subprocess
    # The launcher leaves SIGINT/SIGTERM ignored for its report; a later child of this process would inherit that.
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    launch.subprocess = _SubprocessHere()  # type: ignore[assignment]
    # stepscope's warnings reach stderr as in a process with no logging set up (Python's last-resort handler), not
    # pytest's capture on the root logger.
    logger = logging.getLogger("stepscope")
    to_stderr = logging.StreamHandler(sys.stderr)
    to_stderr.setLevel(logging.WARNING)
    propagate, logger.propagate = logger.propagate, False
    logger.addHandler(to_stderr)
    try:
        yield
    finally:
        launch.subprocess = saved_subprocess
        launch.STOP.signum = None
        logger.removeHandler(to_stderr)
        logger.propagate = propagate
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def stepscope_here(
    tmp_path: Path,
    *args: str,
    warmup: int | None = 3,
    steps: int | None = 20,
    verb: str = "run",
    env: dict[str, str] | None = None,
) -> RunResult:
    """``stepscope_run`` with the training process run in this one (``cli_here``); ``env`` adds to the environment
    of stepscope and the script."""
    json_path = tmp_path / "s.json"
    cmd = stepscope_cmd(json_path, *args, warmup=warmup, steps=steps, verb=verb)
    with mock.patch.dict(os.environ, env or {}):
        return RunResult(cmd, *cli_here(tmp_path, cmd), json_path)


@contextlib.contextmanager
def hooked(tmp_path: Path, warmup: int, steps: int) -> Iterator[Any]:
    """``stepscope run``'s hooks and tracker in this process (without the system sampler); yields the tracker. The
    run's stop after ``steps`` measured steps (StopRun, at the next step's first event) ends the block; the hooks
    are removed on the way out."""
    from stepscope.instrument.hooks import install
    from stepscope.instrument.tracker import RunConfig, StopRun, Tracker
    from stepscope.scope import enabled_scope

    scope = enabled_scope(warmup=warmup, system_interval_s=None)
    tracker = Tracker(scope, RunConfig(out_dir=str(tmp_path), warmup=warmup, steps=steps))
    undo = install(tracker)
    try:
        yield tracker
    except StopRun:
        pass
    finally:
        undo()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int = 2) -> list[str]:
    """The command prefix of a one-machine torchrun with ``nproc`` processes on a free local port."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
    ]  # fmt: skip


def line_starting(text: str, word: str) -> str | None:
    """The first line whose first whitespace-separated field is ``word`` (None when there is none)."""
    for line in text.splitlines():
        if line.split()[:1] == [word]:
            return line
    return None


def check_consistent(summary: RunSummary, result: RunResult | None = None) -> None:
    """Invariants every single-rank summary with measured steps must hold (the product's own, and these)."""
    msg = result.describe() if result is not None else ""
    assert broken(summary) == [], f"{broken(summary)}\n{msg}"
    phases = summary.phases
    assert "total" in phases, msg
    assert phases["total"].share == 1.0 or abs(phases["total"].share - 1.0) < 1e-9, msg
    shares = sum(p.share for name, p in phases.items() if name != "total" and not p.nested)
    assert abs(shares - 1.0) < 0.02, f"phase shares sum to {shares:.4f}, not ~1 (exclusive time): {phases}\n{msg}"
    for name, stats in phases.items():
        assert stats.mean_ms >= 0, (name, stats)
        assert stats.steps >= 1, f"phase {name} is listed but ran in no measured step\n{msg}"
        assert name in PHASES or name in ("total", OWN_PHASE), f"unexpected phase name {name!r}\n{msg}"
    assert phases["total"].steps == summary.steps.measured, msg
    mean_sum = sum(p.mean_ms * p.steps for n, p in phases.items() if n != "total") / phases["total"].steps
    assert abs(mean_sum - phases["total"].mean_ms) <= 0.02 * phases["total"].mean_ms + 0.01, (
        f"exclusive phase times add up to {mean_sum:.3f} ms per step, step is {phases['total'].mean_ms:.3f} ms\n{msg}"
    )
    assert summary.verdict.bound in {"data", "compute", "comms", "optimizer", "host", "balanced", "unknown"}, msg
    assert summary.verdict.confidence in {"high", "medium", "low"}, msg
