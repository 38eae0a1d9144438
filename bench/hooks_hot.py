"""The tracker's handlers of one CPU training step, called in a tight loop with no torch work between them.

`stepscope run`'s own figure for its hooks (``summary.overhead.hooks_us_per_step``) is 125-260 µs a step on
bench/workloads/cpu_train.py on the 2-core dev VM; between torch's ops every handler runs with cold caches. This
times the same handlers (a fetch, two forwards, a backward, clip, the optimizer step that closes the step,
zero_grad, a scalar read) back to back, caches warm: the Python floor of the handlers' own work, precise to a few
percent, so that a change to them can be measured in one run against another commit's (run it with PYTHONPATH at
each tree, alternately):

    PYTHONPATH=src python bench/hooks_hot.py [--steps 3000] [--repeats 9]

It prints the wall µs a step (median and min over repeats) and the tracker's own ``hook_ns`` figure a step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from stepscope.instrument.hooks import install
from stepscope.instrument.tracker import RunConfig, Tracker
from stepscope.scope import enabled_scope


class _Iterator:
    """Stands for a DataLoader iterator (the tracker keys its loaders by it)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000, help="steps a repeat")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    model = nn.Linear(2, 2)
    tracker = Tracker(enabled_scope(warmup=5, system_interval_s=None), RunConfig(out_dir="", stop=False))
    undo = install(tracker)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # built under the hooks: its step closes the step
    batch = (torch.ones(2, 2), torch.ones(2))
    loss = torch.ones(())
    source = _Iterator()

    def one_step() -> None:
        t0 = tracker.fetch_begin(source)
        tracker.fetch_end(source, batch, t0)
        for _ in range(2):  # the model, and the loss module
            tracker.forward_begin(model, (batch[0],), {})
            tracker.forward_end()
        tracker.backward_begin(loss)
        tracker.backward_end()
        tracker.enter("clip")
        tracker.exit("clip")
        tracker.optimizer_step_begin(optimizer)
        tracker.optimizer_step_end(optimizer)
        tracker.enter("zero_grad")
        tracker.exit("zero_grad")
        tracker.count("item_calls")

    try:
        for _ in range(300):
            one_step()
        wall_us, hooks_us = [], []
        for _ in range(args.repeats):
            hook_ns, start = tracker.hook_ns, time.perf_counter_ns()
            for _ in range(args.steps):
                one_step()
            wall_us.append((time.perf_counter_ns() - start) / args.steps / 1e3)
            hooks_us.append((tracker.hook_ns - hook_ns) / args.steps / 1e3)
    finally:
        undo()
    print(
        f"hot handlers: {statistics.median(wall_us):.2f} µs a step (min {min(wall_us):.2f}), "
        f"their own hook_ns {statistics.median(hooks_us):.2f} µs a step"
    )


if __name__ == "__main__":
    main()
