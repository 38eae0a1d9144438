"""``stepscope run``'s side of a measured run: start the command instrumented, wait, merge the ranks, report.

The command runs in a child process exactly as it would without stepscope (a script as ``__main__``, its
output and tracebacks unchanged), with ``instrument/site`` on PYTHONPATH so that every Python process it
starts — torchrun's ranks included — is instrumented (see bootstrap.py). Each process that trains writes its
summary into a private run folder; once the command has exited, the files are merged. Nothing here waits on a
rank: a rank that died leaves no file, and the merged summary says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil

from stepscope.collectors.malloc import INSTALL_HINT, TUNING_ENV, pooling_library, threshold_env
from stepscope.doctor.verdict import classify
from stepscope.instrument import LaunchError
from stepscope.instrument.bootstrap import ENV_CONFIG
from stepscope.instrument.collect import RANK_FILES, Gathered, MergeError, check_one_job, gather, wait_for_ranks
from stepscope.instrument.follow import HANG_AFTER, NO_PROGRESS, Follow, Progress, complete, stall_notes
from stepscope.instrument.merge import merge
from stepscope.instrument.pyspy import RecordedProcess
from stepscope.instrument.tracker import RunConfig
from stepscope.summary import Exit, RunSummary, read_summaries


@dataclass
class Target:
    """What to run: the argv, and whether it is a launcher that starts the training processes itself."""

    argv: list[str]
    launcher: bool


def script_target(script: str, args: list[str]) -> Target:
    """``python SCRIPT ARGS``; the script must exist."""
    path = Path(script)
    if not path.is_file():
        why = "it is a directory" if path.is_dir() else "no such file"
        raise LaunchError(f"cannot run {script}: {why}.")
    return Target([sys.executable, script, *args], launcher=False)


def module_target(module: str, args: list[str]) -> Target:
    """``python -m MODULE ARGS``."""
    return Target([sys.executable, "-m", module, *args], launcher=False)


def command_target(command: list[str]) -> Target:
    """Any launcher command (torchrun, accelerate launch, python ...); it must be found on PATH."""
    if not command:
        raise LaunchError("nothing to run after '--': give a command, e.g. -- torchrun --nproc-per-node 2 train.py")
    if shutil.which(command[0]) is None and not Path(command[0]).is_file():
        raise LaunchError(f"cannot run {command[0]!r}: not found on PATH.")
    return Target(list(command), launcher=True)


def _child_env(config: RunConfig, extra: dict[str, str] | None = None) -> dict[str, str]:
    import stepscope

    site = Path(__file__).parent / "site"
    package_root = Path(stepscope.__file__).resolve().parent.parent
    env = {**os.environ, **(extra or {})}
    existing = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(package_root), *([existing] if existing else [])])
    env[ENV_CONFIG] = json.dumps(dataclasses.asdict(config))
    for fix in config.apply:
        if fix["id"] == "malloc.mmap_threshold" and not any(name in env for name in TUNING_ENV):
            env.update(threshold_env(fix["value"]))  # the user's own malloc settings win; mallopt still runs
        if fix["id"] == "malloc.allocator":
            library = pooling_library(fix["value"])
            if library is None:
                raise LaunchError(
                    f"--apply malloc.allocator={fix['value']}: {fix['value']} is not installed on this machine "
                    f"({INSTALL_HINT[fix['value']]}, or your distribution's package of it)."
                )
            env["LD_PRELOAD"] = os.pathsep.join([library, *filter(None, [env.get("LD_PRELOAD")])])
    return env


@dataclass
class Stop:
    """The signal (SIGINT, SIGTERM) that asked this stepscope process to stop, during or after a run."""

    signum: int | None = None


STOP = Stop()
STOPPED_REASONS = ("interrupted", "terminated")  # a run's exit.reason when a signal stopped it
GRACE_S = 5.0  # after SIGTERM, how long a run's process tree has to end before SIGKILL


def stop_requested() -> int | None:
    """The signal (SIGINT, SIGTERM) that asked stepscope to stop, if one came: a command that runs the script
    several times (ab, doctor --verify) starts no run after it and reports what it measured."""
    return STOP.signum


def _tree(pid: int) -> list[psutil.Process]:
    """A process and all its descendants, those in sessions of their own too (torchrun starts its ranks so)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _signal_tree(processes: list[psutil.Process], signum: int) -> None:
    for process in processes:
        try:
            process.send_signal(signum)
        except psutil.Error:
            continue  # already gone


def end_tree(process: subprocess.Popen[bytes], grace_s: float = GRACE_S) -> int:
    """End a run's whole process tree: SIGTERM to every process in it (a launcher passes it on to its ranks and
    cleans up), then SIGKILL to whatever is left after ``grace_s``. Returns the run's exit code (its own process
    is reaped by ``process.wait``, so the code is kept)."""
    tree = _tree(process.pid)
    _signal_tree(tree, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace_s)
    left = {p.pid: p for p in [*tree, *_tree(process.pid)] if p.is_running()}
    _signal_tree(list(left.values()), signal.SIGKILL)
    return process.wait()


# Whether this process was started with SIGINT ignored (nohup, a background job of a script): read once, at import,
# before stepscope sets any disposition of its own.
STARTED_IGNORING_SIGINT = signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def _record(signum: int, frame: object) -> None:
    STOP.signum = STOP.signum or signum


def expect_stops() -> None:
    """Before a run of several (ab, doctor --verify): SIGINT and SIGTERM only record a stop (``stop_requested``).
    A Python handler, not SIG_IGN, so that the run about to start does not inherit an ignored signal: handlers are
    reset to the default when a child execs, SIG_IGN is not."""
    signal.signal(signal.SIGINT, signal.SIG_IGN if STARTED_IGNORING_SIGINT else _record)
    signal.signal(signal.SIGTERM, _record)


def ignore_stops() -> None:
    """After the last run: SIGINT and SIGTERM are ignored for the rest of stepscope's life, which is the report. A
    signal to the whole process group (``timeout``, schedulers, CI cancellation) often comes again, and Python
    resets its own handlers to the default while it exits: only SIG_IGN keeps such a signal from costing the
    report or the exit code."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _wait(
    process: subprocess.Popen[bytes] | RecordedProcess,
    own_group: bool = False,
    timeout_s: float | None = None,
    more_runs: bool = False,
) -> tuple[int, bool]:
    """Wait for the command, and live to report; returns its exit code and whether it passed ``timeout_s`` (then
    its whole tree was ended, ``end_tree``).

    A SIGTERM sent to stepscope is passed on to the command. At a terminal, Ctrl-C reaches the command directly
    (same process group), so stepscope ignores its own copy; without a terminal (a job manager signalling
    stepscope's pid), SIGINT is passed on too. When stepscope was started with SIGINT ignored (a background job of
    a script, nohup), the command inherited that: neither reacts to SIGINT, as the command alone would not. Once
    the command has ended, both are ignored (``ignore_stops``), or, with ``more_runs`` (doctor's run before
    --verify), only record a stop (``expect_stops``), so that no run starts after one.

    With ``own_group`` (one run of several: ab, doctor --verify) the command runs in a process group of its own,
    so a terminal's Ctrl-C reaches stepscope only: SIGINT and SIGTERM are passed to the run's whole group, a
    second one kills its whole tree, and ``stop_requested`` says a stop was asked for. Once the run has ended they
    only record a stop (``expect_stops``), for the caller to start no other run; it calls ``ignore_stops`` after
    its last."""

    def forward(signum: int, frame: object) -> None:
        again = STOP.signum is not None
        _record(signum, frame)
        if not own_group:
            process.send_signal(signum)
        elif again and isinstance(process, subprocess.Popen):
            _signal_tree(_tree(process.pid), signal.SIGKILL)  # the second Ctrl-C: no more waiting
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signum)

    interactive = sys.stdin is not None and sys.stdin.isatty()
    if STARTED_IGNORING_SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGINT, signal.SIG_IGN if interactive and not own_group else forward)
    signal.signal(signal.SIGTERM, forward)
    timed_out = False
    try:
        if timeout_s is None or not isinstance(process, subprocess.Popen):
            code = process.wait()
        else:
            try:
                code = process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                code = end_tree(process)
    finally:
        if own_group or more_runs:
            expect_stops()
        else:
            ignore_stops()
    return (128 - code if code < 0 else code), timed_out  # killed by signal N: the shell's 128+N


def _job_ranks(out_dir: Path, own: list[RunSummary], wait_s: float) -> tuple[list[RunSummary], list[str]]:
    """With a shared ``--out`` folder: this node's ranks and those the job's other nodes wrote there, once each
    has written its final summary or ``wait_s`` has passed. Only this node's ranks when the job has no id."""
    job, world = own[0].meta.job_id, max((r.meta.world_size or 1 for r in own), default=1)
    if job is None or world <= len(own):
        return own, []
    missing = wait_for_ranks(out_dir, job, world, wait_s)
    if missing:
        print(
            f"stepscope: rank(s) {', '.join(map(str, missing))} of the job wrote no final summary into {out_dir} "
            f"within {wait_s:g} s; merging what is there (`stepscope merge {out_dir}` later merges them all).",
            file=sys.stderr,
        )
    try:  # the folder is shared: another node may have removed it, or left files this user cannot read
        found = gather([out_dir])
        ranks = [r for r in found.ranks if r.meta.job_id == job]
        check_one_job(Gathered(ranks, found.sources))
    except (MergeError, OSError) as error:
        return own, [f"this node's ranks only: {error}"]
    return ranks, found.notes


def _killed_early_note(code: int, ran_s: float) -> str:
    """Why a command killed by a signal left no figures: it was killed before any of its processes closed a step
    (a process's steps reach its step stream as they close; its summary is written at exit, which a kill skips)."""
    return (
        f"no figures survived: the command was killed by signal {code - 128} after {ran_s:.1f} s, before any of its "
        "processes closed a training step (each completed step is kept, whatever way the process dies)."
    )


def run(
    target: Target,
    config: RunConfig,
    py_spy: Path | None = None,
    env: dict[str, str] | None = None,
    out: Path | None = None,
    out_wait_s: float = 30.0,
    own_group: bool = False,
    timeout_s: float | None = None,
    more_runs: bool = False,
    progress: Progress = NO_PROGRESS,
    hang_after: float = HANG_AFTER,
) -> tuple[int, RunSummary]:
    """Run the target instrumented; returns its exit code and the (merged) summary. With ``py_spy``, py-spy
    records a flame graph of the whole command there (see pyspy.py); it never changes the run. ``env`` adds to
    (or overrides) stepscope's own environment for the command, as ``VAR=VALUE command`` does in a shell.

    With ``out`` (a folder every node of the job can write, ``run --out``), each process writes its summary there
    and it is kept; once the command ends, the job's ranks from the other nodes are awaited up to ``out_wait_s``
    seconds and merged with this node's.

    ``own_group`` runs the command in a session of its own (one run of several: see ``_wait``); past ``timeout_s``
    seconds its whole tree is ended and the summary's exit reason is ``timeout``.

    The processes' step streams are followed while the command runs (``progress`` shows them; a process with no step
    for ``hang_after`` median steps is noted as stalled), and a process that wrote no summary gets one from its
    stream (see follow.py)."""
    out_dir = out.resolve() if out is not None else Path(tempfile.mkdtemp(prefix="stepscope-run-"))
    launch_id = uuid.uuid4().hex
    config = dataclasses.replace(
        config, out_dir=str(out_dir), launcher=target.launcher, parent_pid=os.getpid(), launch_id=launch_id
    )
    try:
        child_env = _child_env(config, env)
        follow = Follow(out_dir, launch_id, progress, hang_after)
        started = time.monotonic()
        follow.start()
        try:
            try:
                process: subprocess.Popen[bytes] | RecordedProcess
                if own_group:
                    expect_stops()  # a previous run's SIG_IGN must not pass to this one
                if py_spy is None:
                    process = subprocess.Popen(target.argv, env=child_env, start_new_session=own_group)
                else:
                    process = RecordedProcess(target.argv, child_env, py_spy)
            except OSError as error:
                raise LaunchError(f"cannot start {target.argv[0]!r}: {error.strerror}.") from error
            code, timed_out = _wait(process, own_group, timeout_s, more_runs)
        finally:
            follow.stop()
        ran_s = time.monotonic() - started
        # A shared --out folder also holds other nodes' and other runs' files: this launch's processes' only.
        summaries, notes = read_summaries(sorted(out_dir.glob(RANK_FILES)), lambda s: s.meta.launch_id == launch_id)
        summaries = complete(summaries, follow, code, target.launcher)
        notes += stall_notes(follow)
        if isinstance(process, RecordedProcess):
            pids = {r.meta.pid: (r.meta.rank or 0, r.meta.command) for r in summaries if r.meta.pid is not None}
            print(process.finish(pids if target.launcher else {}), file=sys.stderr)
        if out is not None and summaries:
            summaries, more = _job_ranks(out_dir, summaries, out_wait_s)
            notes += more
    finally:
        if out is None:
            shutil.rmtree(out_dir, ignore_errors=True)
    if summaries:
        summary = merge(summaries)
    elif code > 128:
        summary = RunSummary(notes=[_killed_early_note(code, ran_s)])
        summary.meta.command = " ".join(target.argv)
        summary.exit = Exit(
            reason="killed", error=f"killed by signal {code - 128} after {ran_s:.1f} s; no figures survived"
        )
    else:
        summary = RunSummary(
            notes=[
                "no process of the command reported a summary: it ended before importing torch, or no process "
                "ran a training step (with a launcher, only processes that call backward() or optimizer.step() "
                "report), or it left with os._exit(), which skips the exit handlers that write the figures."
            ]
        )
        summary.meta.command = " ".join(target.argv)
    summary.notes += notes
    exit_info = summary.exit or Exit()
    if exit_info.reason == "running":
        # Only a checkpoint survived: the process never reached its exit handlers.
        how = f"killed by signal {code - 128}" if code > 128 else f"ended with code {code} before writing its summary"
        # Keep where a stalled process waited (exit.hung), and a merged run's first failure: why it was killed.
        error = exit_info.error if exit_info.cause_rank is not None else f"{how}; figures up to its last checkpoint"
        exit_info = dataclasses.replace(exit_info, reason="killed", error=error)
    elif exit_info.reason == "finished" and code != 0:
        exit_info = Exit(reason="error", error=exit_info.error or f"the command exited with code {code}")
    if timed_out:
        exit_info = Exit(
            reason="timeout",
            error=f"still running after the {timeout_s:g} s time limit of a run: it was ended with its whole "
            "process tree",
        )
    summary.exit = dataclasses.replace(exit_info, code=code)
    if summary.ranks:
        summary.verdict = classify(summary)
    return code, summary
