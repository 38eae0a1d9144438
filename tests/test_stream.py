"""The step stream (stream.py) and following it (instrument/follow.py): what a process writes is what a reader folds,
the ring's losses are counted, a process that never trains leaves no file, and a stall is seen from outside."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from stepscope.instrument.collect import check_one_job, gather
from stepscope.instrument.follow import Follow, complete, from_stream, stall_notes
from stepscope.invariants import broken
from stepscope.record import EvalPasses, Recorder, StepRecord, summarize
from stepscope.stream import (
    MAX_LAYOUTS,
    Followed,
    ProcessStream,
    StepStream,
    StreamError,
    StreamReader,
    find_streams,
    stream_name,
)
from stepscope.summary import Exit, RunSummary

META = {"pid": 4242, "hostname": "node7", "rank": 1, "launch_id": "L1", "warmup": 2, "steps": 10}


def _steps(n: int) -> list[StepRecord]:
    """Steps of known phases: every third has a custom phase, every fifth no data wait (three layouts)."""
    records = []
    for i in range(n):
        phases = {"forward": 1_000_000 + i, "backward": 2_000_000, "optimizer": 500_000, "other": 7}
        if i % 5:
            phases = {"data_wait": 300_000 + 10 * i, **phases}
        if i % 3 == 0:
            phases["metrics"] = 250_000
        records.append(StepRecord(i, sum(phases.values()), phases, samples=32))
    return records


def _stream(tmp_path: Path, records: list[StepRecord], warmup: int, capacity: int = 8192) -> StepStream:
    stream = StepStream(tmp_path / stream_name("node7", 4242), META, capacity=capacity)
    for record in records:
        stream.step(record, measured=record.index >= warmup)
    return stream


def test_a_reader_folds_the_figures_the_process_kept(tmp_path: Path) -> None:
    records = _steps(40)
    _stream(tmp_path, records, warmup=2)
    passes = [(9_000_000, {"forward": 8_000_000}, 4), (11_000_000, {"forward": 10_000_000, "data_wait": 5}, 5)]
    stream = StepStream(tmp_path / "passes.steps", META)
    for wall_ns, phases_ns, batches in passes:
        stream.eval_pass(wall_ns, phases_ns, batches)

    followed = Followed(StreamReader(tmp_path / stream_name("node7", 4242)))
    assert followed.poll() == 40
    expected = Recorder(warmup=2)
    for record in records:
        expected.add(record)
    want = summarize(expected, "host")
    got = followed.summary()
    assert (got.steps.warmup, got.steps.measured) == (2, 38)
    assert set(got.phases) == set(want.phases)
    for name, stats in want.phases.items():
        assert got.phases[name].mean_ms == pytest.approx(stats.mean_ms, rel=1e-12), name
        assert got.phases[name].steps == stats.steps, name
    assert got.throughput.samples_per_s == pytest.approx(want.throughput.samples_per_s)
    assert (got.meta.rank, got.meta.pid, got.meta.hostname, got.meta.launch_id) == (1, 4242, "node7", "L1")
    assert got.series is not None and sum(got.series.step_ms) == pytest.approx(sum(r.step_ns for r in records) / 1e6)
    assert broken(got) == []
    assert followed.poll() == 0  # nothing new

    evals = Followed(StreamReader(tmp_path / "passes.steps"))
    evals.poll()
    reference = EvalPasses()
    for wall_ns, phases_ns, batches in passes:
        reference.add(wall_ns, phases_ns, batches=batches)
    assert evals.passes.to_dict(1.0) == reference.to_dict(1.0)


def test_the_ring_keeps_the_last_records_and_counts_what_a_late_reader_missed(tmp_path: Path) -> None:
    records = _steps(20)
    path = tmp_path / stream_name("node7", 4242)
    stream = StepStream(path, META, capacity=8)
    late = StreamReader(path)
    on_time = Followed(StreamReader(path))
    for record in records:
        stream.step(record, measured=True)
        on_time.poll()
    rows = late.rows()
    assert [row.index for row in rows] == list(range(12, 20))
    assert late.lost == 12
    assert on_time.reader.lost == 0 and on_time.recorder.measured == 20
    missed = Followed(StreamReader(path))
    missed.poll()
    assert missed.summary().notes == [
        "12 step(s) of the stream were overwritten before they were read; the figures leave them out."
    ]


def test_past_the_layouts_the_header_holds_a_step_keeps_its_time_with_custom_phases_in_other(tmp_path: Path) -> None:
    path = tmp_path / "many.steps"
    stream = StepStream(path, META)
    for i in range(MAX_LAYOUTS + 5):
        stream.step(StepRecord(i, 3_000, {"forward": 1_000, f"custom{i}": 2_000}), measured=True)
    rows = StreamReader(path).rows()
    assert len(rows) == MAX_LAYOUTS + 5
    assert rows[0].phases_ns == {"forward": 1_000, "custom0": 2_000}
    assert rows[-1].phases_ns == {"forward": 1_000, "other": 2_000}  # the fixed layout: no slot for custom104
    assert all(sum(row.phases_ns.values()) == row.wall_ns for row in rows)


def test_a_file_that_is_not_a_stream_is_refused_in_one_sentence(tmp_path: Path) -> None:
    path = tmp_path / stream_name("node7", 1)
    path.write_bytes(b"not a stream" * 4000)
    with pytest.raises(StreamError, match="is not a step stream of this stepscope"):
        StreamReader(path)
    path.write_bytes(b"short")
    with pytest.raises(StreamError, match="shorter than its header"):
        StreamReader(path)
    follow = Follow(tmp_path)
    follow.poll()  # skipped, not raised: a run folder may hold anything
    assert follow.streams == {}


def test_a_process_opens_its_stream_at_its_first_kept_step_and_a_forked_child_gets_its_own(tmp_path: Path) -> None:
    recorder, passes = Recorder(warmup=1), EvalPasses()
    stream = ProcessStream(recorder, passes, tmp_path, lambda: {**META, "pid": os.getpid(), "hostname": "h"})
    assert find_streams(tmp_path) == []  # nothing kept yet: a launcher or a loader worker leaves no file
    recorder.add(StepRecord(0, 10, {"other": 10}))
    recorder.add(StepRecord(1, 20, {"other": 20}))
    (mine,) = find_streams(tmp_path)
    child = os.fork()
    if child == 0:  # the child: one step of its own, then leave without any exit handler
        try:
            recorder.add(StepRecord(2, 30, {"other": 30}))
        finally:
            os._exit(0)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert [row.wall_ns for row in StreamReader(mine).rows()] == [10, 20]  # the child wrote elsewhere
    theirs = tmp_path / stream_name("h", child)
    assert [row.wall_ns for row in StreamReader(theirs).rows()] == [30]
    stream.close()
    assert StreamReader(mine).closed


def test_a_process_that_stops_closing_steps_is_seen_stalled_from_outside(tmp_path: Path) -> None:
    stream = _stream(tmp_path, _steps(30), warmup=2)
    follow = Follow(tmp_path, launch_id="L1", hang_after=20, min_hang_s=0.2)
    follow.poll()
    assert follow.stalled() == []
    time.sleep(0.3)  # 300 ms without a step: over 20 median steps (3.8 ms each) and over min_hang_s
    follow.poll()
    (stall,) = follow.stalled()
    assert (stall.rank, stall.pid, stall.steps) == (1, 4242, 30)
    assert stall.describe().startswith("rank 1 (pid 4242) has closed no step for 0.3 s after step 30")
    assert stall_notes(follow)[0].startswith("hung: rank 1 (pid 4242) has closed no step")
    # Once a checkpoint found the training thread waiting (after --checkpoint-s without a step), the stall says where.
    checkpoint = RunSummary(exit=Exit(reason="running", hung={"where": "train.py:42", "calls": "dist.all_reduce"}))
    checkpoint.meta.hostname, checkpoint.meta.pid = "node7", 4242
    checkpoint.to_json(tmp_path / "rank00001-node7-pid4242.json")
    follow.poll()
    assert follow.stalled()[0].describe().endswith(", waiting in dist.all_reduce at train.py:42")
    stream.step(StepRecord(30, 1000, {"other": 1000}), measured=True)
    follow.poll()
    assert follow.stalled() == []
    assert stall_notes(follow)[0].startswith("stalled, then went on: rank 1 (pid 4242)")


def test_a_run_folder_follows_only_its_own_launch_and_a_watch_the_newest_job(tmp_path: Path) -> None:
    StepStream(tmp_path / stream_name("a", 1), {**META, "pid": 1, "launch_id": "old", "job_id": None})
    time.sleep(0.01)
    StepStream(tmp_path / stream_name("a", 2), {**META, "pid": 2, "launch_id": "new", "job_id": "slurm:7"})
    StepStream(tmp_path / stream_name("b", 3), {**META, "pid": 3, "launch_id": "other-node", "job_id": "slurm:7"})
    run = Follow(tmp_path, launch_id="new")
    run.poll()
    assert [f.meta["pid"] for f in run.streams.values()] == [2]
    watch = Follow(tmp_path)
    watch.poll()
    assert sorted(f.meta["pid"] for f in watch.streams.values()) == [2, 3]  # one job, both nodes' launches


def test_a_process_without_a_summary_gets_one_from_its_stream_over_its_checkpoint(tmp_path: Path) -> None:
    _stream(tmp_path, _steps(30), warmup=2)
    follow = Follow(tmp_path)
    follow.poll()
    checkpoint = RunSummary()
    checkpoint.meta.hostname, checkpoint.meta.pid = "node7", 4242
    checkpoint.exit = Exit(reason="running", hung={"where": "train.py:42", "collective": True})
    checkpoint.notes.append("the checkpoint's own note")
    checkpoint.steps.measured = 12
    finished = RunSummary()
    finished.meta.hostname, finished.meta.pid = "node7", 99

    (rebuilt, kept) = complete([checkpoint, finished], follow, code=137, launcher=False)
    assert kept is finished
    assert (rebuilt.steps.warmup, rebuilt.steps.measured) == (2, 28)
    assert rebuilt.exit.reason == "killed" and rebuilt.exit.error == "killed by SIGKILL after step 30"
    assert rebuilt.exit.hung == {"where": "train.py:42", "collective": True}  # where the checkpoint saw it wait
    assert rebuilt.exit.at is not None and abs(rebuilt.exit.at - time.time()) < 60
    assert rebuilt.notes[0] == "the checkpoint's own note"
    assert rebuilt.notes[-1] == (
        "from the step stream: the process was killed by SIGKILL after step 30; the figures are its 28 measured "
        "step(s) (its last checkpoint had 12)."
    )
    assert broken(rebuilt) == []

    (followed,) = follow.streams.values()
    alone = from_stream(followed, None, code=4, launcher=False)
    assert alone.exit.reason == "error"
    assert alone.exit.error.startswith("the process left with code 4 without writing its summary")
    assert from_stream(followed, None, code=1, launcher=True).exit.error == (
        "rank 1 ended without writing its summary (the command exited with code 1) after step 30"
    )


def test_a_merge_of_a_run_folder_adds_the_ranks_that_left_only_a_stream(tmp_path: Path) -> None:
    job = {"job_id": "slurm:7", "world_size": 2, "hostname": "node7", "warmup": 2}
    finished = StepStream(tmp_path / stream_name("node7", 1), {**job, "rank": 0, "pid": 1, "launch_id": "a"})
    killed = StepStream(tmp_path / stream_name("node8", 2), {**job, "rank": 1, "pid": 2, "launch_id": "b"})
    other_job = StepStream(tmp_path / stream_name("node9", 3), {**job, "job_id": "slurm:8", "rank": 1, "pid": 3})
    for record in _steps(20):
        for stream in (finished, killed, other_job):
            stream.step(record, measured=record.index >= 2)
    finished.close()
    rank0 = RunSummary(exit=Exit(reason="finished"))
    rank0.meta.rank, rank0.meta.world_size, rank0.meta.job_id = 0, 2, "slurm:7"
    rank0.meta.hostname, rank0.meta.pid, rank0.meta.launch_id = "node7", 1, "a"
    rank0.steps.measured = 18
    rank0.to_json(tmp_path / "rank00000-node7-pid1.json")

    found = gather([tmp_path])
    assert [(r.meta.rank, r.meta.pid) for r in found.ranks] == [(0, 1), (1, 2)]  # not the other job's rank 1
    assert check_one_job(found) == 2
    rebuilt = found.ranks[1]
    assert rebuilt.exit.reason == "running" and rebuilt.steps.measured == 18  # it may still run: not called dead
    assert rebuilt.notes[-1].startswith("from the step stream: the process wrote no final summary")


def test_a_loop_the_gpu_lags_is_paced_in_its_stream_as_in_its_own_summary(tmp_path: Path) -> None:
    # The host queues a 2 ms step; the GPU runs it in 10 ms, and its events complete two steps later. The process's
    # summary paces the steps at the GPU's 100 steps/s; a reader of its stream (the live line, a killed process's
    # summary) must too, not read the host's 500.
    recorder = Recorder(warmup=2)
    ProcessStream(recorder, EvalPasses(), tmp_path, lambda: {**META, "pid": 1, "hostname": "h"})
    kept: list[StepRecord] = []
    for i in range(40):
        record = StepRecord(i, 2_000_000, {"forward": 1_500_000, "other": 500_000}, samples=8)
        if recorder.add(record):
            kept.append(record)
        if len(kept) > 2:
            recorder.add_device(kept[-3], {"forward": 0.01}, span_s=0.01)
    for record in kept[-2:]:
        recorder.add_device(record, {"forward": 0.01}, span_s=0.01)
    want = summarize(recorder, "cuda")
    assert want.throughput.steps_per_s == pytest.approx(100, rel=0.01)

    (path,) = find_streams(tmp_path)
    followed = Followed(StreamReader(path))
    followed.poll()
    got = followed.summary()
    assert got.steps.measured == 38
    assert got.throughput.steps_per_s == pytest.approx(want.throughput.steps_per_s, rel=1e-9)
    assert got.throughput.samples_per_s == pytest.approx(want.throughput.samples_per_s, rel=1e-9)
    assert got.series.step_ms == pytest.approx(want.series.step_ms, rel=1e-9)
    assert got.wall.steps_s == pytest.approx(38 * 0.01, rel=0.01)
    assert broken(got) == []
