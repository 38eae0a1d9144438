"""The step stream end to end, with real processes: a process that dies without its exit handlers (os._exit,
SIGKILL, a segfault, an abort) keeps every step it completed, alone or as one rank of a 2-rank gloo job;
`stepscope watch` follows that job from its folder to its end; `--progress plain` shows a run moving."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess

import psutil
import pytest
from run_helpers import (
    cli_here,
    run_env,
    script,
    stepscope_cmd,
    stepscope_here,
    stepscope_run,
    terminal_signals,
    torchrun,
)

from stepscope.invariants import broken
from stepscope.record import StepRecord
from stepscope.stream import StepStream, stream_name
from stepscope.summary import RunSummary

DIES_AT = 40
WARMUP = 5


@pytest.mark.parametrize(
    ("how", "code", "reason", "said"),
    [
        ("exit", 4, "error", "the process left with code 4 without writing its summary (os._exit, or a native crash)"),
        ("kill", 137, "killed", "the process was killed by SIGKILL"),
        ("segv", 139, "killed", "the process was killed by SIGSEGV"),
    ],
)
def test_a_process_that_dies_without_its_exit_keeps_every_step_it_completed(tmp_path, how, code, reason, said):
    r = stepscope_run(
        tmp_path,
        script("dies.py"), "--how", how, "--at", str(DIES_AT),
        warmup=WARMUP, steps=1000,
    )  # fmt: skip
    assert r.returncode == code, r.describe()  # the script's own exit code, as without stepscope
    s = r.summary
    assert (s.steps.warmup, s.steps.measured) == (WARMUP, DIES_AT - WARMUP), r.describe()
    assert s.exit.reason == reason and s.exit.error.endswith(f"after step {DIES_AT}"), s.exit
    assert s.notes[0].startswith(f"from the step stream: {said} after step {DIES_AT};"), s.notes
    assert s.phases["total"].steps == DIES_AT - WARMUP
    assert broken(s) == []


def test_sigkill_at_any_moment_after_the_first_measured_step_keeps_the_steps_done_by_then(tmp_path):
    json_path = tmp_path / "s.json"
    cmd = stepscope_cmd(json_path, "--progress", "none", script("dies.py"), "--step-ms", "5", warmup=WARMUP, steps=5000)
    run = subprocess.Popen(cmd, cwd=tmp_path, env=run_env(), stdout=subprocess.PIPE, text=True)
    kill_after = WARMUP + 1 + random.randrange(30)
    done = 0
    try:
        for line in run.stdout:
            if line.startswith("step "):
                done = int(line.split()[1])
                if done >= kill_after:
                    break
        (training,) = psutil.Process(run.pid).children()  # the script's process, not stepscope's
        training.send_signal(signal.SIGKILL)
        rest = run.stdout.read()
        run.wait(timeout=60)
    finally:
        run.kill()
    printed = max([done, *(int(x.split()[1]) for x in rest.splitlines() if x.startswith("step "))])
    s = RunSummary.from_json(json_path)
    kept = s.steps.warmup + s.steps.measured
    # Every step done when the kill came; one more when the kill fell between a step's close (its optimizer step)
    # and the script's print of it.
    assert done <= kept <= printed + 1, (done, kept, printed, rest[-2000:])
    assert run.returncode == 137 and s.exit.reason == "killed", s.exit


def test_one_rank_killed_in_a_gloo_job_keeps_its_steps_and_a_watch_follows_the_job_to_its_end(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    launcher = [*torchrun(), script("dies.py"), "--how", "kill", "--rank", "1", "--at", str(DIES_AT)]
    json_path = tmp_path / "s.json"
    cmd = stepscope_cmd(json_path, "--out", str(out), "--out-wait-s", "0", "--", *launcher, warmup=WARMUP, steps=1000)
    job = subprocess.Popen(cmd, cwd=tmp_path, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watched = tmp_path / "watched.json"
    watch_cmd = [*stepscope_cmd(None, warmup=None, steps=None, verb="watch"), str(out), "--json", str(watched)]
    try:
        watch = subprocess.run(
            [*watch_cmd, "--progress", "plain"], env=run_env(), capture_output=True, text=True, timeout=180
        )
        stdout, stderr = job.communicate(timeout=180)
    finally:
        job.kill()
    described = f"--- run ---\n{stdout[-3000:]}\n{stderr[-3000:]}\n--- watch ---\n{watch.stdout}\n{watch.stderr}"
    assert job.returncode != 0, described
    s = RunSummary.from_json(json_path)
    ranks = {r.meta.rank: r for r in s.ranks}
    assert sorted(ranks) == [0, 1], described
    killed = ranks[1]
    assert (killed.steps.warmup, killed.steps.measured) == (WARMUP, DIES_AT - WARMUP), described
    assert killed.notes[-1].startswith(
        f"from the step stream: rank 1 ended without writing its summary (the command exited with code 1) after "
        f"step {DIES_AT};"
    ), killed.notes
    assert s.exit.cause_rank == 1, (s.exit, described)  # the killed rank, not the peer whose collective broke
    assert broken(s) == [], described

    assert watch.returncode == 0, described  # the job ended, and the watch with it
    w = RunSummary.from_json(watched)
    assert sorted(r.meta.rank for r in w.ranks) == [0, 1], described
    (seen,) = [r for r in w.ranks if r.meta.rank == 1]
    assert seen.steps.measured == DIES_AT - WARMUP, described
    assert "rank 1" in watch.stdout and "ranks: 2 of 2 reported" in watch.stdout, described


def test_plain_progress_shows_the_run_moving_every_few_seconds(tmp_path):
    # 11 s of 5 ms steps: at least two lines, 5 s apart.
    r = stepscope_here(
        tmp_path, "--progress", "plain", script("dies.py"), "--step-ms", "5", "--seconds", "11", "--steps", "1000000",
        warmup=WARMUP, steps=100_000,
    )  # fmt: skip
    assert r.returncode == 0, r.describe()
    lines = [line for line in r.stderr.splitlines() if line.startswith("stepscope: ") and " s · step " in line]
    assert len(lines) >= 2, r.describe()
    first = lines[0]
    assert "/100000 · " in first and " steps/s · " in first and "bound so far: " in first, first
    steps = [int(line.split(" · step ")[1].split("/")[0]) for line in lines]
    assert steps == sorted(steps) and steps[-1] > steps[0], lines


def test_watch_refuses_a_folder_that_is_not_there(tmp_path):
    missing = tmp_path / "nowhere"
    code, _, err = cli_here(tmp_path, [*stepscope_cmd(None, warmup=None, steps=None, verb="watch"), str(missing)])
    assert code == 2, err
    assert f"cannot watch {missing}: no such folder." in err
    assert not missing.exists()


def test_ctrl_c_ends_the_watch_not_the_job_and_prints_the_figures_so_far(tmp_path):
    # A job whose process is alive (this test's own) and wrote 30 steps: the watch waits for it until its SIGINT.
    stream = StepStream(tmp_path / stream_name(socket.gethostname(), os.getpid()), {
        "pid": os.getpid(), "hostname": socket.gethostname(), "rank": 0, "launch_id": "L", "warmup": 2, "steps": 100,
    })  # fmt: skip
    for index in range(30):
        stream.step(StepRecord(index, 4_000_000, {"forward": 1_000_000, "other": 3_000_000}, 8), measured=index >= 2)
    cmd = [*stepscope_cmd(None, warmup=None, steps=None, verb="watch"), str(tmp_path), "--progress", "plain"]
    watch = subprocess.Popen(  # as from a terminal: a suite started in the background ignores SIGINT
        cmd, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=terminal_signals
    )
    # Its first progress line says it follows the job. A fixed wait is not enough: on a loaded machine the watch
    # can still be importing when it ends, and an interpreter that is starting up is not yet the watch's to stop.
    first = watch.stderr.readline()
    assert first.startswith("stepscope: ") and watch.poll() is None, (first, watch.communicate())
    signals = _signal_masks(watch.pid)  # what it ignores, blocks or catches, for the message if it goes on
    watch.send_signal(signal.SIGINT)
    try:
        stdout, stderr = watch.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        watch.kill()
        stdout, stderr = watch.communicate()
        mine = _signal_masks(os.getpid())
        raise AssertionError(f"the watch went on after Ctrl-C: its {signals}; this test's {mine}\n{stderr}") from None
    stderr = first + stderr
    assert watch.returncode == 130, stderr
    assert "Traceback" not in stderr, stderr
    assert "throughput: 250.00 steps/s, 2000.0 samples/s over 28 measured steps (warm-up 2)" in stdout, stdout
    assert "stopped by Ctrl-C; the job runs on, and these are its figures so far" in stdout, stdout
    stream.step(StepRecord(30, 4_000_000, {"other": 4_000_000}), measured=True)  # the job was not touched


def _signal_masks(pid: int) -> str:
    """A process's blocked, ignored and caught signals, as /proc shows them (hex masks; SIGINT is bit 1)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return ", ".join(line.strip() for line in status if line.startswith(("SigBlk", "SigIgn", "SigCgt")))
    except OSError as error:
        return f"no /proc status ({error.strerror})"
