"""JSONL: one line per logged step, flushed as it is written, so a crash loses at most the line being written."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import IO

import orjson


class JsonlSink:
    """Appends ``{"step": N, "time": unix_s, "perf/step_time": ..., ...}`` lines to ``path``.

    The folder is created and checked for writing at construction, so a wrong path is seen before training; the
    file itself is opened at the first line, so a process that never logs (a DataLoader worker started with
    ``spawn``) leaves no file behind. Lines are appended: a resumed run continues the same file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(self.path.parent, os.W_OK):
            raise PermissionError(f"cannot write metrics into {self.path.parent}: no write permission.")
        self._file: IO[bytes] | None = None
        self._closed = False

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """One line for ``step``; flushed to the OS at once."""
        if self._closed:
            raise ValueError(f"JsonlSink({self.path}) is closed")
        if self._file is None:
            self._file = self.path.open("ab")
        line = {"step": step, "time": round(time.time(), 3), **metrics}
        self._file.write(orjson.dumps(line, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
        self._file.flush()

    def close(self) -> None:
        self._closed = True
        if self._file is not None:
            self._file.close()
            self._file = None
