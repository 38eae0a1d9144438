"""Read one large trace with two processes: each decodes every other run of events, and the parent merges them.

Decoding JSON into Python objects is most of a large trace's read time, and it holds the GIL, so threads cannot share
it. A forked child and the parent both decompress and cut the whole file (cheap next to decoding; both cut it at the
same places) and each decodes and sorts alternate runs; the parent merges the runs in file order, so the result is
what one reader makes. Anything unusual (a cheap cut that does not decode, an error in either process, a child that
dies) gives up, and the caller reads the file alone, which finds the same events or raises the same error.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from stepscope.analyses.trace.stream import Decode, TraceFile, iter_decoded

if TYPE_CHECKING:
    import queue
    from multiprocessing.connection import Connection

R = TypeVar("R")


class _GiveUp(Exception):
    """The child failed or died: the file is read alone."""


def read_in_shares(
    path: Path, trace: TraceFile, decode: Decode, collect: Callable[[list[Any]], R], merge: Callable[[R], None]
) -> bool:
    """Read ``path`` with a forked child: ``collect`` turns each decoded run into a result (picklable), and
    ``merge`` gets the results of all runs in file order. ``trace`` gets the metadata and the events of both.
    Returns False, having merged any number of runs, when the file must be read alone instead."""
    # imported here: multiprocessing and queue cost ~15 ms, which a small trace's reading does not need
    import multiprocessing
    import queue
    import threading

    context = multiprocessing.get_context("fork")  # the child starts with everything imported: ~10 ms
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(send, path, decode, collect), daemon=True)
    child.start()
    send.close()
    results: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
    # a thread takes the child's results off the pipe as they come, so that the child never waits on the parent
    reader = threading.Thread(target=_receive, args=(receive, results), daemon=True)
    reader.start()
    try:
        for own, batch in enumerate(iter_decoded(path, decode, trace, share=(0, 2))):
            result = collect(batch)
            if own:  # the child's run before this one (runs alternate: the parent's are 0, 2, 4, ...)
                merge(_next(results))
            merge(result)
        kind, value = results.get()
        while kind == "run":  # the child may hold the last run
            merge(value)
            kind, value = results.get()
        if kind != "done":
            raise _GiveUp
        trace.events += value
        return True
    except Exception:
        return False
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        reader.join()
        receive.close()


def _next(results: queue.SimpleQueue[tuple[str, Any]]) -> Any:
    kind, value = results.get()
    if kind != "run":
        raise _GiveUp
    return value


def _receive(connection: Connection, results: queue.SimpleQueue[tuple[str, Any]]) -> None:
    try:
        while True:
            kind, value = connection.recv()
            results.put((kind, value))
            if kind != "run":
                return
    except (EOFError, OSError):  # the child died, or was stopped
        results.put(("error", None))


def _child(connection: Connection, path: Path, decode: Decode, collect: Callable[[list[Any]], Any]) -> None:
    try:
        trace = TraceFile(path)
        for batch in iter_decoded(path, decode, trace, share=(1, 2)):
            connection.send(("run", collect(batch)))
        connection.send(("done", trace.events))
    except Exception:
        with contextlib.suppress(OSError):  # the parent has gone
            connection.send(("error", None))
    finally:
        connection.close()


def json_bytes(path: Path) -> int:
    """The decompressed size of a trace file (bytes): a gzip file's trailer holds it (modulo 4 GiB, for its last
    member only: an estimate), a plain file is its size. 0 when it cannot be read."""
    try:
        with open(path, "rb") as handle:
            if handle.read(2) != b"\x1f\x8b":
                return os.fstat(handle.fileno()).st_size
            handle.seek(-4, os.SEEK_END)
            return int.from_bytes(handle.read(4), "little")
    except OSError:
        return 0


def usable_cores() -> int:
    """Cores this process may run on: the affinity `stepscope.collectors.host.usable_cores` reads, without importing
    psutil (~10 ms) on the trace path."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def idle_cores() -> float:
    """Usable cores less the 1-minute load average (which counts this process, when it has been running)."""
    return usable_cores() - os.getloadavg()[0]
