"""TensorBoard, MLflow and W&B sinks with their real clients, read back the way each tracker stores them."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from stepscope import Scope
from stepscope.sinks.trackers import (
    MLflowSink,
    SinkUnavailable,
    TensorBoardSink,
    WandbSink,
    parse_spec,
    sink_from_spec,
)

STEPS = {10: 0.5, 11: 0.25, 12: 0.125}


def write_steps(sink) -> None:
    for step, seconds in STEPS.items():
        sink.write(step, {"perf/step_time": seconds, "sys/cpu_util": 50.0})
    sink.close()


def test_tensorboard_scalars_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    write_steps(TensorBoardSink(tmp_path / "tb"))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"perf/step_time", "sys/cpu_util"}
    assert [(e.step, e.value) for e in events.Scalars("perf/step_time")] == list(STEPS.items())


def test_mlflow_metrics_read_back_and_the_run_is_ended(tmp_path):
    pytest.importorskip("sqlalchemy")  # the sqlite store needs the full mlflow package
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sink = MLflowSink(tracking_uri=uri, experiment="stepscope-test")
    write_steps(sink)
    client = MlflowClient(uri)
    history = client.get_metric_history(sink.run_id, "perf/step_time")
    assert [(m.step, m.value) for m in history] == list(STEPS.items())
    run = client.get_run(sink.run_id)
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "stepscope-test"


def test_mlflow_logs_into_a_run_it_did_not_start_and_leaves_it_open(tmp_path):
    pytest.importorskip("sqlalchemy")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("mine")).info.run_id
    write_steps(MLflowSink(tracking_uri=uri, run_id=run_id))
    assert len(client.get_metric_history(run_id, "sys/cpu_util")) == 3
    assert client.get_run(run_id).info.status == "RUNNING"


def wandb_records(path: Path):
    """The records of a .wandb file (a LevelDB-style log: 7-byte header, then crc32/length/type-framed chunks in
    32 KiB blocks), as wandb's protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, block, chunks = 7, 32768, []
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:
            position += left
            continue
        length = int.from_bytes(data[position + 4 : position + 6], "little")
        kind = data[position + 6]
        if position + 7 + length > len(data):
            break  # a record still being written
        payload = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 2):  # full, first
            chunks = [payload]
        elif kind in (3, 4):  # middle, last
            chunks.append(payload)
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            yield record


def test_wandb_offline_history_is_tied_to_the_training_step(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    write_steps(WandbSink(project="stepscope-test"))
    (run_file,) = tmp_path.glob("wandb/offline-run-*/*.wandb")
    deadline = time.monotonic() + 20
    while True:  # wandb's service process may still be writing the log after finish() returns, on a busy machine
        rows, metrics = [], {}
        for record in wandb_records(run_file):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                rows.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
            elif kind == "metric":
                metrics[record.metric.name or record.metric.glob_name] = record.metric.step_metric
        if len(rows) >= len(STEPS) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    kinds = [r.WhichOneof("record_type") for r in wandb_records(run_file)]
    assert [(row["train/step"], row["perf/step_time"]) for row in rows] == list(STEPS.items()), kinds
    assert metrics == {"train/step": "", "perf/*": "train/step", "sys/*": "train/step"}


def test_a_scope_feeds_tensorboard(tmp_path, clock):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scope = Scope(clock=clock, warmup=0, sinks=[TensorBoardSink(tmp_path)], system_interval_s=None)
    for _ in range(4):
        with scope.phase("forward"):
            clock.advance(5)
        scope.step(batch_size=2)
    scope.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [e.step for e in events.Scalars("perf/step_time")] == [0, 1, 2, 3]
    assert events.Scalars("perf/step_time")[-1].value == pytest.approx(0.005)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("csv:out.csv", "unknown sink 'csv'"),
        ("tensorboard", "the tensorboard sink needs a log folder"),
        ("jsonl:", "the jsonl sink needs a file path"),
    ],
)
def test_bad_specs_say_what_to_write(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(spec)


def test_a_missing_tracker_package_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(SinkUnavailable, match=r"pip install 'stepscope\[wandb\]'"):
        parse_spec("wandb:proj")


def test_specs_per_rank(tmp_path):
    pytest.importorskip("tensorboard")
    jsonl = sink_from_spec(f"jsonl:{tmp_path / 'm.jsonl'}", rank=2)
    assert jsonl.path == tmp_path / "m.rank2.jsonl"
    board = sink_from_spec(f"tensorboard:{tmp_path / 'tb'}", rank=1)
    assert board.log_dir == tmp_path / "tb" / "rank1"
    board.close()
    assert sink_from_spec("wandb:proj", rank=1) is None and sink_from_spec("mlflow:", rank=3) is None
