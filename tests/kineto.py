"""A Kineto-like (torch.profiler) trace built event by event, for the trace analyser's and the report's tests."""

from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path
from typing import Any

ORIGIN_US = 1_700_000_000_000_000  # an absolute timestamp in µs, like Kineto's


class Kineto:
    """A Kineto-like trace built event by event. Times are µs from the trace's start; written as .json or .json.gz.

    ``kernel`` writes what Kineto writes for one launch: the runtime call on the host thread, the kernel on its
    stream (linked by ``args.correlation``) and the flow arrows between them.
    """

    def __init__(self, rank: int | None = 0, device: str | None = "NVIDIA A100-SXM4-80GB", origin: float = ORIGIN_US):
        self.origin = origin
        self.meta: dict[str, Any] = {
            "schemaVersion": 1,
            "deviceProperties": [{"id": 0, "name": device, "totalGlobalMem": 85_000_000_000}] if device else [],
        }
        if rank is not None:
            self.meta["distributedInfo"] = {"backend": "nccl", "rank": rank, "world_size": 8}
        self.trailer: dict[str, Any] = {
            "traceName": "synthetic.pt.trace.json",
            "displayTimeUnit": "ms",
            "baseTimeNanoseconds": 1_700_000_000_000_000_000,
        }
        self.events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "ts": int(origin), "pid": 100, "tid": 0, "args": {"name": "python"}},
            {"name": "thread_name", "ph": "M", "ts": int(origin), "pid": 100, "tid": 1, "args": {"name": "main"}},
        ]
        self._correlation = itertools.count(1)

    def _x(self, cat: str, name: str, ts: float, dur: float, pid: int, tid: int, args: dict | None = None) -> dict:
        event = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": self.origin + ts, "dur": dur}
        if args is not None:
            event["args"] = args
        self.events.append(event)
        return event

    def step(self, n: int, ts: float, dur: float, tid: int = 1) -> None:
        self._x("user_annotation", f"ProfilerStep#{n}", ts, dur, 100, tid)

    def host(self, name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op") -> None:
        self._x(cat, name, ts, dur, 100, tid, {"External id": 1})

    def kernel(
        self, name: str, ts: float, dur: float, *, launch: float | None = None, stream: int = 7,
        cat: str = "kernel", launcher: str = "cudaLaunchKernel",
    ) -> None:  # fmt: skip
        """A device event on ``stream`` and the runtime call that launched it (5 µs earlier unless ``launch``)."""
        corr = next(self._correlation)
        launch = ts - 5 if launch is None else launch
        self._x("cuda_runtime", launcher, launch, 2, 100, 1, {"cbid": 211, "correlation": corr})
        self._x(cat, name, ts, dur, 0, stream, {"device": 0, "stream": stream, "correlation": corr, "grid": [1, 1, 1]})
        flow = {"id": corr, "cat": "ac2g", "name": "ac2g"}
        self.events.append({"ph": "s", "pid": 100, "tid": 1, "ts": self.origin + launch, **flow})
        self.events.append({"ph": "f", "pid": 0, "tid": stream, "ts": self.origin + ts, "bp": "e", **flow})

    def memcpy(self, ts: float, dur: float, **kw: Any) -> None:
        self.kernel("Memcpy HtoD (Pageable -> Device)", ts, dur, cat="gpu_memcpy", launcher="cudaMemcpyAsync", **kw)

    def document(self, events_at: str = "middle") -> dict[str, Any]:
        """The trace as one JSON object, with ``traceEvents`` first, in the middle (Kineto's place) or last."""
        meta, trailer = dict(self.meta), dict(self.trailer)
        if events_at == "first":
            return {"traceEvents": self.events, **meta, **trailer}
        if events_at == "last":
            return {**meta, **trailer, "traceEvents": self.events}
        return {**meta, "traceEvents": self.events, **trailer}

    def text(self, layout: str = "kineto", events_at: str = "middle") -> bytes:
        """Kineto's pretty-printed layout (an event over several lines) or one compact line."""
        doc = self.document(events_at)
        if layout == "compact":
            return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
        lines = []
        for key, value in doc.items():
            if key == "traceEvents":
                events = ",\n".join("  " + json.dumps(e, indent=4, ensure_ascii=False) for e in value)
                lines.append(f'  "traceEvents": [\n{events}\n]')
            else:
                lines.append(f"  {json.dumps(key)}: {json.dumps(value, indent=2)}")
        return ("{\n" + ",\n".join(lines) + "\n}\n").encode()

    def write(self, path: Path, layout: str = "kineto", events_at: str = "middle") -> Path:
        data = self.text(layout, events_at)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
        return path
