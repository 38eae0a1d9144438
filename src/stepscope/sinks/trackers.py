"""Sinks for the experiment trackers people already use: TensorBoard, MLflow, Weights & Biases.

Each is optional (``pip install 'stepscope[tensorboard]'``, ``[mlflow]``, ``[wandb]``); a missing package is a
``SinkUnavailable`` naming the extra to install. Metrics keep their ``perf/`` and ``sys/`` names and are tied to the
training step.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


class SinkUnavailable(ImportError):
    """A tracker sink whose client package is not installed; the message names the extra to install."""


def _missing(sink: str, package: str, extra: str) -> SinkUnavailable:
    return SinkUnavailable(f"{sink} needs the {package} package: pip install 'stepscope[{extra}]' (or {package}).")


class TensorBoardSink:
    """Scalars through ``torch.utils.tensorboard.SummaryWriter`` into ``log_dir`` (one event file per writer)."""

    def __init__(self, log_dir: str | Path, flush_secs: int = 10) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise _missing("TensorBoardSink", "tensorboard", "tensorboard") from None
        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=flush_secs)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


CONNECT_TIMEOUT_S = 5.0  # to open a connection to a tracking server; an MLflow client alone retries for minutes


def probe_server(uri: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Open (and close) one TCP connection to an http(s) tracking ``uri`` within ``timeout_s`` seconds; raises
    ConnectionError naming the server when it cannot. Other URIs (files, databases) are not probed."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise ConnectionError(f"cannot reach the tracking server {uri} within {timeout_s:g} s ({reason})") from None


class MLflowSink:
    """Metrics into an MLflow run through ``MlflowClient`` (any tracking URI: a file store, sqlite, a server).

    Logs into ``run_id`` when given, else into the active ``mlflow`` run, else into a new run of ``experiment``
    (created when missing), which ``close()`` ends; a run stepscope did not start is left open. The constructor
    touches no server: mlflow is imported, the server reached (``CONNECT_TIMEOUT_S``) and the run created at the
    first ``write``, which `SinkSet` makes from the sink's own thread, so a server that is down never holds up the
    script; it fails that write and the sink is dropped with one warning."""

    background = True  # a remote server may be slow or gone: written from its own thread (`Background`)

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str = "stepscope",
        run_id: str | None = None,
        run_name: str | None = None,
    ) -> None:
        import importlib.util
        import sys

        if importlib.util.find_spec("mlflow") is None:
            raise _missing("MLflowSink", "mlflow", "mlflow")
        # mlflow's active run is per thread and exists only where the script imported mlflow: read it here, in
        # the caller's thread, without importing mlflow (slow) when the script has not
        imported = sys.modules.get("mlflow")
        active = imported.active_run() if imported is not None and hasattr(imported, "active_run") else None
        self._owned = run_id is None and active is None
        self.run_id = run_id if run_id is not None else (active.info.run_id if active is not None else None)
        self._tracking_uri = tracking_uri
        self._experiment = experiment
        self._run_name = run_name
        self._client: Any = None
        self._metric: Any = None

    def _connect(self) -> None:
        import mlflow
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        probe_server(self._tracking_uri or mlflow.get_tracking_uri())
        client = MlflowClient(tracking_uri=self._tracking_uri)
        if self.run_id is None:
            found = client.get_experiment_by_name(self._experiment)
            experiment_id = found.experiment_id if found else client.create_experiment(self._experiment)
            self.run_id = client.create_run(experiment_id, run_name=self._run_name).info.run_id
        self._metric, self._client = Metric, client

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self._client is None:
            self._connect()
        now_ms = int(time.time() * 1000)
        batch = [self._metric(name, float(value), now_ms, step) for name, value in metrics.items()]
        self._client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        if self._owned and self._client is not None:
            self._client.set_terminated(self.run_id)


class WandbSink:
    """Metrics into a Weights & Biases run (``WANDB_MODE=offline`` works without a server), each tied to
    ``train/step`` with ``define_metric``. Uses ``run``, else the active ``wandb.run``, else starts one in
    ``project`` (``init`` keyword arguments pass through), which ``close()`` finishes."""

    def __init__(self, project: str | None = None, run: Any = None, **init: Any) -> None:
        try:
            import wandb
        except ImportError:
            raise _missing("WandbSink", "wandb", "wandb") from None
        active = run or wandb.run
        self._owned = active is None
        self._run = active if active is not None else wandb.init(project=project, **init)
        self._run.define_metric("train/step")
        for prefix in ("perf/*", "sys/*"):
            self._run.define_metric(prefix, step_metric="train/step")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log({**metrics, "train/step": step})

    def close(self) -> None:
        if self._owned:
            self._run.finish()


KINDS = {"jsonl": "a file path", "tensorboard": "a log folder", "mlflow": "a tracking URI", "wandb": "a project"}
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow"), "wandb": ("wandb", "wandb")}


def parse_spec(spec: str) -> tuple[str, str]:
    """``KIND:TARGET`` of a command-line sink, checked: a known kind, a target where one is needed, and the
    tracker's package installed (found, not imported). Raises ValueError or SinkUnavailable with the fix."""
    import importlib.util

    kind, _, target = spec.partition(":")
    kind = kind.strip().lower()
    if kind not in KINDS:
        raise ValueError(f"unknown sink {kind!r} in {spec!r}: use {', '.join(f'{k}:...' for k in KINDS)}")
    if kind in ("jsonl", "tensorboard") and not target:
        raise ValueError(f"the {kind} sink needs {KINDS[kind]}: --sink {kind}:...")
    if kind in PACKAGES and importlib.util.find_spec(PACKAGES[kind][0]) is None:
        package, extra = PACKAGES[kind]
        raise _missing(f"the {kind} sink", package, extra)
    return kind, target


def sink_from_spec(spec: str, rank: int | None = None) -> Any:
    """A sink from a command-line spec (see ``parse_spec``). With ``rank`` set (a launched rank), JSONL writes a
    file per rank ("{rank}" in the path, else a .rankN suffix) and TensorBoard into ``DIR/rankN``; MLflow and W&B
    are left to rank 0 (None is returned on the others), one tracker run per job."""
    kind, target = parse_spec(spec)
    if kind == "jsonl":
        from stepscope.sinks.jsonl import JsonlSink

        return JsonlSink(rank_file(target, rank))
    if kind == "tensorboard":
        return TensorBoardSink(target if rank is None else Path(target) / f"rank{rank}")
    if rank not in (None, 0):
        return None
    if kind == "mlflow":
        return MLflowSink(tracking_uri=target or None)
    return WandbSink(project=target or None)


def rank_file(path: str, rank: int | None) -> str:
    """``path`` for one rank: "{rank}" replaced (0 outside a launcher), else ".rankN" before the suffix."""
    if "{rank}" in path:
        return path.replace("{rank}", str(rank or 0))
    if rank is None:
        return path
    target = Path(path)
    return str(target.with_name(f"{target.stem}.rank{rank}{target.suffix}"))
