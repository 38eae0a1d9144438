"""Where per-step metrics go: one small ``Sink`` protocol and its implementations (JSONL, TensorBoard, MLflow,
Weights & Biases; the trackers' packages are optional extras).

A sink receives ``write(step, metrics)`` for the logged steps (``perf/*`` and ``sys/*`` keys, seconds and
samples/s, see ``Scope.metrics``) and ``close()`` once. ``SinkSet`` fans out to several and isolates them: a sink
that fails warns once and is dropped, and training goes on.
"""

from stepscope.sinks.base import NO_SINKS, Sink, SinkSet
from stepscope.sinks.jsonl import JsonlSink
from stepscope.sinks.trackers import MLflowSink, SinkUnavailable, TensorBoardSink, WandbSink

__all__ = ["NO_SINKS", "JsonlSink", "MLflowSink", "Sink", "SinkSet", "SinkUnavailable", "TensorBoardSink", "WandbSink"]
