"""Hung ranks and the first failure: checkpoints written on time from a thread, the stack of a stalled training
thread, and the merged headline naming the rank that failed first (the others' errors follow from it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from run_helpers import run_env, script, stepscope_cmd, stepscope_run, torchrun

from stepscope.collectors.stacks import CodeKinds
from stepscope.instrument.checkpoint import where_blocked
from stepscope.instrument.merge import first_failure, merge
from stepscope.report.terminal import exit_line
from stepscope.summary import Exit, Meta, PhaseStats, RunSummary, Steps, Throughput

T0 = 1_800_000_000.0  # a Unix time


def rank(r: int, end: Exit, data_wait_ms: float = 5.0, measured: int = 20) -> RunSummary:
    phases_ms = {"data_wait": data_wait_ms, "forward": 1.0, "backward": 2.0, "comms": 1.0, "other": 0.5}
    step_ms = sum(phases_ms.values())
    phases = {n: PhaseStats(ms, ms, ms, ms / step_ms, measured) for n, ms in phases_ms.items()}
    phases["total"] = PhaseStats(step_ms, step_ms, step_ms, 1.0, measured)
    return RunSummary(
        steps=Steps(warmup=3, measured=measured, boundary="optimizer.step"),
        phases=phases,
        throughput=Throughput(steps_per_s=1e3 / step_ms, samples_per_s=100.0, step_time_ms=step_ms),
        meta=Meta(rank=r, world_size=2, command="train.py"),
        exit=end,
    )


def hung(since: float, collective: bool, where: str = "/job/train.py:42", calls: str | None = None) -> dict:
    return {"since": since, "steps": 23, "where": where, "code": "x", "calls": calls, "collective": collective,
            "stack": [f"{where} main"], "phase": "comms" if collective else "other"}  # fmt: skip


# -- the cause is the first failure in time ---------------------------------------------------------------------


def test_the_rank_that_raised_first_is_the_cause_not_the_peer_whose_connection_closed():
    peer = Exit(reason="error", code=1, error="RuntimeError: Connection closed by peer", at=T0 + 0.3)
    own = Exit(reason="error", code=1, error="RuntimeError: boom", at=T0)
    merged = merge([rank(0, peer), rank(1, own)])
    assert merged.exit.cause_rank == 1, merged.exit
    assert merged.exit.error == "rank 1: RuntimeError: boom"
    assert any(n.startswith("rank 0: RuntimeError: Connection closed") and "followed rank 1" in n for n in merged.notes)
    line = exit_line(merged)
    assert line.startswith("the run failed: first rank 1: RuntimeError: boom; rank 0 failed after it"), line
    # The same failures the other way round in time: rank 0 is the cause.
    swapped = merge(
        [rank(0, Exit(reason="error", error="A", at=T0)), rank(1, Exit(reason="error", error="B", at=T0 + 1))]
    )
    assert swapped.exit.cause_rank == 0 and swapped.exit.error == "rank 0: A"


def test_a_rank_hung_outside_a_collective_is_the_cause_of_the_peer_that_timed_out_waiting_for_it():
    # Rank 0 waits in the all-reduce from the moment rank 1 stops (its stall even starts a hair earlier), then times
    # out; torchrun's SIGTERM ends rank 1. Rank 1 stopped; rank 0 waited.
    waiting = Exit(reason="error", code=1, error="RuntimeError: Timed out", at=T0 + 5, hung=hung(T0 - 0.001, True))
    stuck = Exit(reason="terminated", code=143, error="SIGTERM", at=T0 + 5.1, hung=hung(T0, False, calls="time.sleep"))
    ranks = [rank(0, waiting, data_wait_ms=9.0), rank(1, stuck)]  # rank 0 even looks slower before the hang
    merged = merge(ranks)
    assert first_failure(ranks) is ranks[1]
    assert merged.exit.cause_rank == 1
    assert merged.exit.error == "rank 1 hung in time.sleep at train.py:42 (x) after 23 steps"
    assert merged.exit.hung["where"] == "/job/train.py:42"
    # The rank that waited for the hung one is not its straggler.
    assert merged.cluster.straggler is None
    assert any("its stack, innermost first: /job/train.py:42 main" in n for n in merged.notes)


def test_when_every_failure_waits_in_a_collective_the_earliest_stall_is_the_cause():
    a = Exit(reason="running", hung=hung(T0 + 2, True))
    b = Exit(reason="running", hung=hung(T0, True, calls="torch.distributed.distributed_c10d.all_reduce"))
    merged = merge([rank(0, a), rank(1, b)])
    assert merged.exit.cause_rank == 1
    assert merged.exit.error.startswith("rank 1 hung in torch.distributed.distributed_c10d.all_reduce at train.py:42")


def test_no_failure_no_cause_and_a_straggler_stays():
    ranks = [rank(0, Exit(reason="stopped")), rank(1, Exit(reason="stopped"), data_wait_ms=15.0)]
    merged = merge(ranks)
    assert first_failure(ranks) is None and merged.exit.cause_rank is None
    assert merged.cluster.straggler is not None and merged.cluster.straggler.rank == 1


def test_the_fields_round_trip_through_json(tmp_path):
    merged = merge(
        [rank(0, Exit(reason="error", error="A", at=T0)), rank(1, Exit(reason="running", hung=hung(T0, False)))]
    )
    merged.to_json(tmp_path / "s.json")
    back = RunSummary.from_json(tmp_path / "s.json")
    assert back.exit == merged.exit and back.ranks[1].exit.hung == hung(T0, False)


# -- where a blocked thread is -----------------------------------------------------------------------------------


def _blocked_here(event: threading.Event, started: threading.Event) -> None:
    started.set()
    event.wait()  # the line where_blocked must name


def test_where_blocked_names_the_users_line_and_the_library_call():
    event, started = threading.Event(), threading.Event()
    thread = threading.Thread(target=_blocked_here, args=(event, started), daemon=True)
    thread.start()
    started.wait(10)
    try:
        deadline = time.monotonic() + 10
        while True:  # until the thread is inside Event.wait
            found = where_blocked(sys._current_frames()[thread.ident], CodeKinds())
            if found["calls"] == "threading.Event.wait" or time.monotonic() > deadline:
                break
            time.sleep(0.01)
    finally:
        event.set()
        thread.join()
    line = _blocked_here.__code__.co_firstlineno + 2
    assert found["where"] == f"{__file__}:{line}", found
    assert found["code"] == "event.wait()  # the line where_blocked must name"
    assert found["calls"] == "threading.Event.wait"
    assert found["collective"] is False
    assert found["stack"][0] == f"{__file__}:{line} _blocked_here"


# -- end to end --------------------------------------------------------------------------------------------------


def test_a_process_hung_in_c_leaves_a_checkpoint_that_says_where(tmp_path):
    # 10 steps of ~4 ms, then a socket recv nobody answers: no step closes again and no signal handler runs; only a
    # checkpoint written on time (not at a step) carries the figures out past the SIGKILL.
    json_path = tmp_path / "s.json"
    cmd = stepscope_cmd(json_path, "--checkpoint-s", "1", script("hang_after.py"), "--steps", "10", warmup=2, steps=100)
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pid = None
        for line in proc.stdout:
            if line.startswith("HANGING"):
                pid = int(line.split()[1])
                break
        assert pid is not None, f"no HANGING line; exit code {proc.poll()}"
        time.sleep(3.5)  # a stall is noticed after 1 s without a step, and written at the next tick (every 0.5 s)
        os.kill(pid, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert json_path.exists(), f"no summary; exit code {proc.returncode}\n{stderr}"
    s = RunSummary.from_json(json_path)
    assert s.exit.reason == "killed", s.exit
    assert s.steps.measured == 8, s.steps  # the 10 steps, less the 2 of warm-up
    stall = s.exit.hung
    assert stall is not None, s.exit
    assert stall["where"].endswith("hang_after.py:27"), stall  # mine.recv(1024) in wait_for_bytes
    assert stall["calls"] is None and stall["code"] == "mine.recv(1024)", stall  # a C method: no Python frame
    assert stall["steps"] == 10 and stall["collective"] is False, stall
    assert stall["stack"][0].endswith("hang_after.py:27 wait_for_bytes"), stall


def _ddp(tmp_path, how: str):
    return stepscope_run(
        tmp_path, "--checkpoint-s", "1", "--", *torchrun(), script("ddp_fail.py"), "--how", how, "--fail-at", "12",
        warmup=3, steps=1000, timeout=120,
    )  # fmt: skip


def test_ddp_the_rank_that_raises_is_the_cause_not_its_peers_closed_connection(tmp_path):
    r = _ddp(tmp_path, "raise")
    assert r.returncode != 0, r.describe()
    s = r.summary
    assert s.exit.cause_rank == 1, (s.exit, r.describe())
    assert s.exit.error == "rank 1: RuntimeError: rank 1 failed at step 12", s.exit
    assert "the run failed: first rank 1: RuntimeError: rank 1 failed at step 12" in r.stdout, r.describe()
    by_rank = {x.meta.rank: x for x in s.ranks}
    assert by_rank[1].exit.at is not None and by_rank[0].exit.at is not None, [x.exit for x in s.ranks]
    assert by_rank[1].exit.at < by_rank[0].exit.at


def test_ddp_a_hung_rank_is_named_with_its_line_and_its_waiting_peer_is_not_the_straggler(tmp_path):
    # Rank 1 sleeps forever after step 12; rank 0 waits in DDP's all-reduce until the 5 s process-group timeout.
    r = _ddp(tmp_path, "hang")
    assert r.returncode != 0, r.describe()
    s = r.summary
    assert s.exit.cause_rank == 1, (s.exit, r.describe())
    assert s.exit.error == "rank 1 hung at ddp_fail.py:40 (time.sleep(1e6)) after 12 steps", s.exit
    by_rank = {x.meta.rank: x for x in s.ranks}
    waiting = by_rank[0].exit.hung
    assert waiting is not None and waiting["collective"] is True, by_rank[0].exit  # stalled in backward's all-reduce
    assert s.cluster.straggler is None or s.cluster.straggler.rank == 1, s.cluster.straggler
    assert "first rank 1 hung at ddp_fail.py:40" in r.stdout, r.describe()
