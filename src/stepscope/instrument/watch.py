"""``stepscope watch DIR``: follow a running job from its run folder, from another terminal or node.

Reading the folder is all it takes (``stepscope run --out DIR``): no connection to the job, no signal to it. It
follows the step streams of the newest job there (its ranks on every node that writes into the folder), shows the
same progress as ``stepscope run``, and ends when every process of the job has ended: its stream closed (the final
summary is written), or, on this host, the process gone. Ctrl-C ends the watch, never the job. The job's summary
then comes from the ranks' final summaries, and from the streams of those that left none.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import psutil

from stepscope.doctor.verdict import classify
from stepscope.instrument.collect import RANK_FILES
from stepscope.instrument.follow import POLL_S, Follow, Progress, complete, stall_notes
from stepscope.instrument.merge import merge
from stepscope.stream import Followed
from stepscope.summary import RunSummary, is_final, read_summaries


class WatchError(Exception):
    """The folder to watch cannot be read."""


def watch(folder: Path, progress: Progress, hang_after: float) -> tuple[RunSummary | None, bool]:
    """Follow the job in ``folder`` until it ends or Ctrl-C; returns its summary (None when no step was ever
    written) and whether the job ended (False: the watch was interrupted)."""
    if not folder.is_dir():
        raise WatchError(f"cannot watch {folder}: no such folder.")
    follow = Follow(folder, None, progress, hang_after)
    ended = False
    try:
        while True:
            follow.poll()
            progress.update(follow)
            if follow.streams and all(_ended(folder, f) for f in follow.streams.values()):
                ended = True
                break
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        pass
    finally:
        progress.close(follow)
    follow.poll()
    ranks = complete(_final_summaries(folder, follow), follow, code=None, launcher=False) if ended else []
    if not ended:
        ranks = follow.summaries()
    if not ranks:
        return None, ended
    summary = merge(ranks)
    summary.notes += stall_notes(follow)
    summary.verdict = classify(summary)
    return summary, ended


def _ended(folder: Path, followed: Followed) -> bool:
    """A process has ended: it closed its stream, wrote its final summary, or (on this host) is gone."""
    if followed.reader.closed:
        return True
    meta = followed.meta
    if meta.get("hostname") == socket.gethostname():
        pid = meta.get("pid")
        return pid is not None and not psutil.pid_exists(pid)
    written, _ = read_summaries(folder.glob(f"rank*-pid{meta.get('pid')}.json"), lambda s: _same(s, meta))
    return any(is_final(s) for s in written)


def _same(summary: RunSummary, meta: dict[str, Any]) -> bool:
    return (summary.meta.hostname, summary.meta.pid) == (meta.get("hostname"), meta.get("pid"))


def _final_summaries(folder: Path, follow: Follow) -> list[RunSummary]:
    """The summaries the followed processes wrote into the folder (final ones, or their last checkpoint)."""
    wanted = {(f.meta.get("hostname"), f.meta.get("pid")) for f in follow.streams.values()}
    found, _ = read_summaries(sorted(folder.glob(RANK_FILES)), lambda s: (s.meta.hostname, s.meta.pid) in wanted)
    return found
