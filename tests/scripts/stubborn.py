"""A command for the child-runner tests (no torch: it starts in milliseconds).

Each run appends its number to FOLDER: ``run-N.status`` holds the signal dispositions it started with (the
``SigIgn`` line of /proc/self/status), ``run-N.pids`` its pid and, with ``--grandchild``, the pid of a sleeping
child of its own. Then it sleeps ``--sleep-s`` (ignoring SIGINT with ``--ignore-int``), and exits 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def record(folder: Path, grandchild: bool = False) -> int:
    """Write this run's ``run-N.status`` and ``run-N.pids`` into ``folder``; returns N."""
    run = len(list(folder.glob("run-*.status"))) + 1
    status = Path("/proc/self/status").read_text()
    ignored = next(line for line in status.splitlines() if line.startswith("SigIgn:"))
    pids = [str(os.getpid())]
    if grandchild:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        pids.append(str(child.pid))
    (folder / f"run-{run}.pids").write_text(" ".join(pids))
    (folder / f"run-{run}.status").write_text(ignored)
    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("--sleep-s", type=float, default=0.0)
    parser.add_argument("--grandchild", action="store_true")
    parser.add_argument("--ignore-int", action="store_true")
    args = parser.parse_args()
    if args.ignore_int:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    record(args.folder, args.grandchild)
    time.sleep(args.sleep_s)


if __name__ == "__main__":
    main()
