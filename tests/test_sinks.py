"""Sinks: the JSONL file, the fan-out that drops a failing sink, a Scope's logging, and the config switch."""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import logging
import os
import time
from pathlib import Path

import orjson
import pytest
from run_helpers import RunResult, script, stepscope_here

from stepscope import NULL_SCOPE, Scope
from stepscope.sinks import JsonlSink, SinkSet


def lines(path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


class ListSink:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict]] = []
        self.closed = 0

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.rows.append((step, dict(metrics)))

    def close(self) -> None:
        self.closed += 1


class BrokenSink(ListSink):
    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if len(self.rows) + 1 >= self.fail_at:
            raise OSError(28, "No space left on device")
        super().write(step, metrics)


def test_jsonl_writes_one_flushed_line_per_step_and_appends(tmp_path):
    path = tmp_path / "deep" / "m.jsonl"
    sink = JsonlSink(path)
    assert path.parent.is_dir() and not path.exists()  # opened at the first line only
    sink.write(3, {"perf/step_time": 0.25})
    assert lines(path)[0]["step"] == 3 and lines(path)[0]["perf/step_time"] == 0.25  # readable before close
    sink.write(4, {"perf/step_time": 0.5})
    sink.close()
    again = JsonlSink(path)
    again.write(5, {"perf/step_time": 0.75})
    again.close()
    assert [row["step"] for row in lines(path)] == [3, 4, 5]
    assert all(isinstance(row["time"], float) for row in lines(path))
    with pytest.raises(ValueError, match="closed"):
        again.write(6, {})


def test_jsonl_refuses_a_folder_it_cannot_write(locked_folder):
    with pytest.raises(PermissionError, match="no write permission"):
        JsonlSink(locked_folder / "m.jsonl")
    assert list(locked_folder.iterdir()) == []


def test_a_failing_sink_is_dropped_once_and_the_others_go_on(caplog):
    good, bad = ListSink(), BrokenSink(fail_at=2)
    sinks = SinkSet([bad, good])
    with caplog.at_level(logging.WARNING, logger="stepscope"):
        for step in range(4):
            sinks.write(step, {"perf/step_time": float(step)})
    assert [s for s, _ in good.rows] == [0, 1, 2, 3]
    assert [s for s, _ in bad.rows] == [0] and bad.closed == 1
    assert len(caplog.records) == 1 and "BrokenSink sink failed and is dropped" in caplog.records[0].getMessage()
    assert sinks.dropped == ["BrokenSink: OSError: [Errno 28] No space left on device"]
    sinks.close()
    assert good.closed == 1 and not sinks


def test_scope_logs_measured_steps_every_n_and_closes_its_sinks(clock):
    sink = ListSink()
    scope = Scope(clock=clock, warmup=2, sinks=[sink], log_every=2, system_interval_s=None)
    for _ in range(8):
        with scope.phase("forward"):
            clock.advance(10)
        clock.advance(2)
        scope.step(batch_size=4)
    # Steps 0..7: step 0 has no start (untimed), 1 is warm-up, 2..7 are measured; every 2nd is logged.
    assert [step for step, _ in sink.rows] == [2, 4, 6]
    _, metrics = sink.rows[-1]
    assert metrics["perf/step_time"] == pytest.approx(0.012)
    assert metrics["perf/train_capacity"] == pytest.approx(4 / 0.012)
    scope.close()
    assert sink.closed == 1
    scope.step()
    assert [step for step, _ in sink.rows] == [2, 4, 6]  # closed: nothing more is logged


def test_a_scope_dropped_without_close_closes_its_sinks(clock):
    sink = ListSink()
    scope = Scope(clock=clock, warmup=0, sinks=[sink], system_interval_s=None)
    del scope
    gc.collect()
    assert sink.closed == 1


def test_log_every_must_be_positive():
    with pytest.raises(ValueError, match="log_every"):
        Scope(log_every=0)


@dataclasses.dataclass
class Debug:
    enable_perf_metrics: bool = False


@dataclasses.dataclass
class Config:
    debug: Debug = dataclasses.field(default_factory=Debug)


@pytest.mark.parametrize(
    ("config", "on"),
    [
        ({"debug": {"enable_perf_metrics": True}}, True),
        ({"debug": {"enable_perf_metrics": "true"}}, True),
        ({"debug": {"enable_perf_metrics": "false"}}, False),
        ({"debug": {}}, False),
        ({}, False),
        (Config(Debug(True)), True),
        (Config(), False),
    ],
)
def test_from_config_reads_the_switch(config, on, monkeypatch):
    monkeypatch.delenv("STEPSCOPE", raising=False)
    scope = Scope.from_config(config, system_interval_s=None)
    assert (scope is not NULL_SCOPE) is on


def test_environment_overrides_the_config(monkeypatch):
    monkeypatch.setenv("STEPSCOPE", "0")
    assert Scope.from_config({"debug": {"enable_perf_metrics": True}}) is NULL_SCOPE
    monkeypatch.setenv("STEPSCOPE", "1")
    assert Scope.from_config({}, system_interval_s=None) is not NULL_SCOPE


@dataclasses.dataclass
class SinksRun:
    result: RunResult
    jsonl: Path
    mlflow_uri: str | None  # the unreachable MLflow server the run also logged to (None without mlflow)
    took_s: float


@pytest.fixture(scope="module")
def sinks_run(tmp_path_factory) -> SinksRun:
    """basic.py with a JSONL file and, where mlflow is installed, an MLflow server that is down: one run serves the
    test of the JSONL lines and the test that a down server holds nothing up (the fan-out drops the failing sink
    alone, so the JSONL file must still get every measured step)."""
    tmp = tmp_path_factory.mktemp("sinks_run")
    jsonl = tmp / "metrics.jsonl"
    uri = f"http://127.0.0.1:{_closed_loopback_port()}" if importlib.util.find_spec("mlflow") else None
    mlflow = ("--sink", f"mlflow:{uri}") if uri else ()
    start = time.monotonic()
    r = stepscope_here(tmp, "--metrics-jsonl", str(jsonl), *mlflow, script("basic.py"), warmup=2, steps=20)
    return SinksRun(r, jsonl, uri, time.monotonic() - start)


def test_run_writes_a_line_per_measured_step(sinks_run):
    r = sinks_run.result
    assert r.returncode == 0, r.describe()
    rows = lines(sinks_run.jsonl)
    assert len(rows) == r.summary.steps.measured == 20, rows
    assert all(row["perf/step_time"] > 0 and "perf/train_capacity" in row for row in rows)
    assert [row["step"] for row in rows] == sorted({row["step"] for row in rows})


def test_run_refuses_a_metrics_path_it_cannot_write(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = stepscope_here(tmp_path, "--metrics-jsonl", str(blocker / "m.jsonl"), script("basic.py"))
    assert r.returncode == 2, r.describe()
    assert f"--sink jsonl:{blocker / 'm.jsonl'}" in r.stderr and "Traceback" not in r.stderr


def test_rank_file_names_each_rank():
    from stepscope.sinks.trackers import rank_file

    assert rank_file("out/m.jsonl", None) == "out/m.jsonl"
    assert rank_file("out/m-{rank}.jsonl", None) == "out/m-0.jsonl"
    assert rank_file("out/m.jsonl", 3) == os.path.join("out", "m.rank3.jsonl")
    assert rank_file("out/m-{rank}.jsonl", 3) == "out/m-3.jsonl"


@pytest.mark.parametrize(("override", "lines_expected"), [([], None), (["debug.enable_perf_metrics=true"], 55)])
def test_example_config_switch(tmp_path, override, lines_expected):
    import subprocess
    import sys

    from run_helpers import REPO, run_env

    config = tmp_path / "config.yaml"
    config.write_text((REPO / "examples" / "config.yaml").read_text())
    cmd = [sys.executable, str(REPO / "examples" / "config_train.py"), "--config", str(config), *override]
    done = subprocess.run(cmd, cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    metrics = tmp_path / "out" / "config-train-metrics.jsonl"
    if lines_expected is None:
        assert "perf metrics: off" in done.stdout and not metrics.exists()
    else:
        assert len(lines(metrics)) == lines_expected  # 60 steps, 5 of warm-up


class _SlowSink:
    """A sink whose every write takes 0.2 s, like a far or overloaded tracking server."""

    background = True

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.closed = False

    def write(self, step: int, metrics: dict[str, float]) -> None:
        time.sleep(0.2)
        self.steps.append(step)

    def close(self) -> None:
        self.closed = True


def test_a_slow_server_sink_does_not_stall_the_step_and_keeps_every_step():
    slow = _SlowSink()
    sinks = SinkSet([slow])
    start = time.perf_counter()
    for step in range(5):
        sinks.write(step, {"perf/step_time": 0.1})
    queued_s = time.perf_counter() - start
    assert queued_s < 0.1, f"writing 5 steps to a 0.2 s/write sink took {queued_s:.3f} s in the training thread"
    sinks.close()  # waits for the queue to drain
    assert slow.steps == [0, 1, 2, 3, 4] and slow.closed


class _BrokenServerSink(_SlowSink):
    def write(self, step: int, metrics: dict[str, float]) -> None:
        if step >= 2:
            raise ConnectionError("server gone")
        self.steps.append(step)


def test_a_background_sink_that_fails_is_dropped_with_its_own_name(caplog):
    broken = _BrokenServerSink()
    sinks = SinkSet([broken])
    for step in range(4):
        sinks.write(step, {"perf/step_time": 0.1})
        time.sleep(0.05)  # let the writer thread meet the error
    assert not sinks, "the failing sink is dropped"
    assert sinks.dropped == ["_BrokenServerSink: ConnectionError: server gone"]
    assert broken.steps == [0, 1]


def _closed_loopback_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def loopback_only(monkeypatch) -> list:
    """Every address a socket connects to, recorded; any but the loopback interface is refused."""
    import socket

    contacted: list = []
    connect = socket.socket.connect

    def guarded(self, address):
        contacted.append(address)
        if address[0] not in ("127.0.0.1", "::1"):
            raise AssertionError(f"a test tried to reach {address}")
        return connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    return contacted


def test_an_mlflow_server_that_is_down_never_holds_up_the_script(loopback_only, caplog):
    import threading

    pytest.importorskip("mlflow")
    from stepscope.sinks import MLflowSink

    uri = f"http://127.0.0.1:{_closed_loopback_port()}"
    made: list[SinkSet] = []

    def start_and_log() -> None:  # what the training thread does: make the sink, log the first steps
        sinks = SinkSet([MLflowSink(tracking_uri=uri)])
        for step in range(3):
            sinks.write(step, {"perf/step_time": 0.1})
        made.append(sinks)

    caller = threading.Thread(target=start_and_log, daemon=True)
    caller.start()
    caller.join(5.0)
    assert made, "making the MLflow sink and logging 3 steps did not return within 5 s with the server down"
    (sinks,) = made
    deadline = time.monotonic() + 90  # the sink's thread imports mlflow first: slow on a loaded machine
    with caplog.at_level(logging.WARNING, logger="stepscope"):
        step = 3
        while sinks and time.monotonic() < deadline:
            time.sleep(0.1)
            sinks.write(step, {"perf/step_time": 0.1})
            step += 1
        sinks.close()
    assert not sinks, "the sink of an unreachable server was never dropped"
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "the MLflowSink sink failed and is dropped" in warnings[0], warnings
    assert f"cannot reach the tracking server {uri} within 5 s (Connection refused)" in warnings[0]
    assert loopback_only and {address[0] for address in loopback_only} == {"127.0.0.1"}


def test_run_with_an_mlflow_sink_whose_server_is_down_is_not_held_up(sinks_run):
    pytest.importorskip("mlflow")
    r, took_s = sinks_run.result, sinks_run.took_s
    assert sinks_run.mlflow_uri is not None
    assert r.returncode == 0, r.describe()
    assert r.summary.steps.measured == 20
    assert r.stderr.count("stepscope: the MLflowSink sink") == 1, r.describe()
    assert "cannot reach the tracking server" in r.stderr, r.describe()
    assert took_s < 120, f"the run took {took_s:.0f} s"  # an MLflow client left to retry takes ~250 s
