"""Prints the process-wide state a profiler could change, as JSON lines, at three moments: before any import, after
the script sets OMP_NUM_THREADS=1 and imports numpy (OpenBLAS starts its thread pool at load, reading that variable
then), and after it imports torch and trains a few steps."""

import gc
import json
import os
import signal
import sys
import threading


def state(moment: str) -> None:
    modules = ("numpy", "torch", "psutil", "rich", "stepscope.instrument.tracker")
    print(
        "state "
        + json.dumps(
            {
                "moment": moment,
                "modules": sorted(m for m in modules if m in sys.modules),
                "native_threads": len(os.listdir("/proc/self/task")),
                "gc": [gc.isenabled(), list(gc.get_threshold()), gc.get_freeze_count()],
                "signals": {s.name: str(signal.getsignal(s)) for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGPIPE)},
                "switch_interval": sys.getswitchinterval(),
                "recursion_limit": sys.getrecursionlimit(),
                "trace": [repr(sys.gettrace()), repr(sys.getprofile())],
                "stepscope_threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("stepscope")),
            }
        ),
        flush=True,
    )


state("start")
os.environ["OMP_NUM_THREADS"] = "1"
import numpy  # noqa: E402

state("numpy")
import torch  # noqa: E402

model = torch.nn.Linear(8, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(12):
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
state("trained")
print(f"torch_threads {torch.get_num_threads()} numpy {numpy.__version__}", flush=True)
