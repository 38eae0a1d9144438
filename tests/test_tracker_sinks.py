"""TensorBoard, MLflow and W&B sinks with their real clients, read back the way each tracker stores them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from run_helpers import free_port, run_env, script, stepscope_cmd, stepscope_here

from stepscope import Scope
from stepscope.sinks.trackers import (
    MLflowSink,
    SinkUnavailable,
    TensorBoardSink,
    WandbSink,
    parse_spec,
    sink_from_spec,
)
from stepscope.summary import RunSummary

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


# -- MLflow against a real tracking server -------------------------------------------------------------------------

# The server's own subprocesses (its job runner) and telemetry only slow the start; the client must fail at once
# when the server is gone (by default it retries with backoff for minutes, while the training step waits).
MLFLOW_QUIET = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1"}
MLFLOW_NO_RETRY = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
SERVER_START_S = 240  # a cold start imports mlflow twice and builds the sqlite schema: ~25 s on a busy 2-core box


@dataclass
class MlflowServer:
    """``mlflow server`` on a free local port, a sqlite store and an artifact folder under ``root``."""

    root: Path
    process: subprocess.Popen | None = None
    url: str = ""
    log: Path | None = None  # the server's stdout and stderr

    def start(self) -> None:
        """Start the server and wait until /health answers; fails the test with the server's stderr if not."""
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
        cmd += [
            "--backend-store-uri",
            f"sqlite:///{self.root / 'db'}",
            "--default-artifact-root",
            str(self.root / "art"),
        ]
        self.log = self.root / f"server-{port}.log"
        with self.log.open("wb") as log:
            # A session of its own: stop() ends the server and its workers by their process group, nothing else.
            self.process = subprocess.Popen(
                cmd, env={**os.environ, **MLFLOW_QUIET}, stdout=log, stderr=log, start_new_session=True
            )
        deadline = time.monotonic() + SERVER_START_S
        while not self._healthy():
            exited = self.process.poll()
            if exited is not None or time.monotonic() > deadline:
                self.stop()
                why = f"exited with code {exited}" if exited is not None else f"no answer after {SERVER_START_S} s"
                pytest.fail(f"mlflow server at {self.url}: {why}; its output:\n{self.log.read_text()[-4000:]}")
            time.sleep(0.25)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """End the server's process group (SIGTERM, then SIGKILL after 15 s; ``signum`` SIGKILL kills at once)."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signum)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    pytest.importorskip("sqlalchemy")
    pytest.importorskip("uvicorn")  # mlflow server's web server (the full mlflow package, not mlflow-skinny)
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def live_mlflow(mlflow_server):
    """The module's server, started on first use (again if a test killed it)."""
    if not mlflow_server.alive():
        mlflow_server.start()
    return mlflow_server


def test_mlflow_sink_logs_to_a_tracking_server(live_mlflow):
    from mlflow.tracking import MlflowClient

    sink = MLflowSink(tracking_uri=live_mlflow.url, experiment="stepscope-server")
    write_steps(sink)
    client = MlflowClient(tracking_uri=live_mlflow.url)
    history = client.get_metric_history(sink.run_id, "perf/step_time")
    assert [(m.step, m.value) for m in history] == list(STEPS.items())
    assert [m.value for m in client.get_metric_history(sink.run_id, "sys/cpu_util")] == [50.0] * 3
    assert client.get_run(sink.run_id).info.status == "FINISHED"


def runs_since(tracking_uri: str, experiment: str, since_ms: int) -> list:
    """The runs of ``experiment`` started at or after ``since_ms`` (ms since the epoch)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no experiment {experiment!r} at {tracking_uri}"
    return [run for run in client.search_runs([found.experiment_id]) if run.info.start_time >= since_ms]


def test_run_with_an_mlflow_server_sink(live_mlflow, tmp_path):
    from mlflow.tracking import MlflowClient

    jsonl = tmp_path / "m.jsonl"
    since_ms = int(time.time() * 1000)
    sinks = ("--sink", f"mlflow:{live_mlflow.url}", "--metrics-jsonl", str(jsonl))
    r = stepscope_here(tmp_path, *sinks, script("basic.py"), warmup=3, steps=12, env=MLFLOW_QUIET)
    assert r.returncode == 0, r.describe()
    (run,) = runs_since(live_mlflow.url, "stepscope", since_ms)
    history = MlflowClient(tracking_uri=live_mlflow.url).get_metric_history(run.info.run_id, "perf/step_time")
    rows = jsonl_rows(jsonl)
    assert len(rows) == r.summary.steps.measured == 12, r.describe()
    assert [(m.step, m.value) for m in history] == [(row["step"], row["perf/step_time"]) for row in rows]
    assert run.info.status == "FINISHED"


def jsonl_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


KILLED_RUN_STEPS = 300  # 20 ms each: the run outlasts the sink's connection, made in the sink's thread


def test_a_killed_server_drops_the_sink_and_training_goes_on(live_mlflow, tmp_path):
    # The server dies after a few steps: the MLflow sink fails once, is dropped with one warning, and the run and
    # its JSONL file go on to the last step.
    from mlflow.tracking import MlflowClient

    jsonl = tmp_path / "m.jsonl"
    since_ms = int(time.time() * 1000)
    sinks = ("--sink", f"mlflow:{live_mlflow.url}", "--metrics-jsonl", str(jsonl))
    cmd = stepscope_cmd(
        tmp_path / "s.json", *sinks, script("sleepy_forever.py"), "--sleep-ms", "20", warmup=2, steps=KILLED_RUN_STEPS
    )
    env = run_env({**MLFLOW_QUIET, **MLFLOW_NO_RETRY})
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.startswith("READY"):  # after 5 steps: 3 measured and logged
            line = proc.stdout.readline()
            assert line, f"no READY line; exit code {proc.poll()}: {proc.stderr.read()}"
        # The sink connects in its own thread at its first write: kill the server once the run has a first metric.
        store = f"sqlite:///{live_mlflow.root / 'db'}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            client = MlflowClient(tracking_uri=store)
            experiment = client.get_experiment_by_name("stepscope")
            runs = runs_since(store, "stepscope", since_ms) if experiment is not None else []
            if runs and client.get_metric_history(runs[0].info.run_id, "perf/step_time"):
                break
            assert proc.poll() is None, "the run ended before its MLflow run was created"
            time.sleep(0.1)
        logged_before = len(jsonl_rows(jsonl))
        live_mlflow.stop(signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert err.count("stepscope: the MLflowSink sink failed and is dropped") == 1, err
    summary = RunSummary.from_json(tmp_path / "s.json")
    rows = jsonl_rows(jsonl)
    assert len(rows) == summary.steps.measured == KILLED_RUN_STEPS, (len(rows), summary.steps)
    assert 0 < logged_before < KILLED_RUN_STEPS, "the server was not killed while the run logged to it"
    # The server's own store, read back: only the steps before the kill reached it, and the run was never ended.
    (run,) = runs_since(store, "stepscope", since_ms)
    assert run.info.status == "RUNNING"
    history = MlflowClient(tracking_uri=store).get_metric_history(run.info.run_id, "perf/step_time")
    # the sink writes from its own thread: what reached the server before the kill is a prefix of the JSONL steps
    assert 0 < len(history) < KILLED_RUN_STEPS, (logged_before, len(history))
    assert [m.step for m in history] == [row["step"] for row in rows[: len(history)]]
