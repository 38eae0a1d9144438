"""`stepscope doctor` on runs shaped like real jobs, each with known ground truth: the bound and the first fix.

The bottlenecks are sleeps (a read in ``__getitem__``, a forward, a checkpoint write) so that a loaded machine
cannot change which one dominates. The scenarios whose reasoning is about CPUs (the job's own loader workers
filling the cores; a straggler rank whose peer waits in the all-reduce) also run while a CPU burner keeps every
core busy. There the doctor must still name the right bound, or state the contention with lowered confidence:
never a confident wrong verdict. (The quiet runs of the DDP straggler, the checkpoint and the workers-beside-threads
scenarios are in test_comms.py, test_hotspots.py and test_contention.py. A data-bound loader beside a burner is in
test_contention.py; validation, accumulation and checkpoint shapes beside a busy loop on each core are scored over
200 generated loops by ``bench/truth.py --load``, figures in docs/benchmarks.md: each of those runs here cost ~11 s
of a test worker and two burning cores.)
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from run_helpers import RunResult, script, stepscope_here, stepscope_run, torchrun

from stepscope.doctor.verdict import OVERSUBSCRIBED


@dataclass(frozen=True)
class Scenario:
    args: tuple[str, ...]
    bound: str
    first_fix: str
    steps: int = 40
    torchrun: bool = False
    never: tuple[str, ...] = ()  # fixes that would be wrong advice here


SCENARIOS = {
    # 4 micro-batches per step, each 8 samples x 1.5 ms of reading: 48 ms of data against well under 1 ms of model.
    "accumulation-starved": Scenario(
        ("slow_loader.py", "--accum", "4", "--sample-ms", "1.5"), "data", "loader.num_workers", steps=25
    ),
    # A forward of 8 ms; every 10 steps 20 validation forwards without gradients (160 ms): kept out of the step.
    "periodic-validation": Scenario(("validation.py", "--val-batches", "20"), "compute", "eval.frequency"),
    # A 15 ms save_checkpoint() after every optimizer step.
    "checkpoint-every-step": Scenario(
        ("hotspot_checkpoint.py", "--sleep-ms", "15"), "host", "host.checkpoint_every_step"
    ),
    # 4 loader workers each burning 2 ms of CPU per sample on a 2-core machine: the loader is CPU-bound and its
    # workers already fill the cores, so "more workers" is wrong advice; fewer (no more than cores) comes first.
    "workers-oversubscribed": Scenario(
        ("contention_loader.py", "--num-workers", "4", "--threads", "1", "--sample-cpu-ms", "2"),
        "data",
        "loader.too_many_workers",
        steps=100,  # ~2 s: enough of the doctor's 4 samples a second for the workers' CPU to be measured
        never=("loader.num_workers",),
    ),
    # Rank 1's loader reads 10 ms more per batch; rank 0 waits for it in DDP's all-reduce.
    "ddp-straggler": Scenario(
        ("ddp.py", "--sample-ms", "0", "--extra-ms", "1.25"), "data", "loader.num_workers", steps=25, torchrun=True
    ),
}
QUIET = (
    "accumulation-starved",
    "periodic-validation",
    "workers-oversubscribed",
)  # the others' quiet runs are in their own test files


def doctor(tmp_path, scenario: Scenario) -> RunResult:
    name, *args = scenario.args
    command = [*torchrun(), script(name), *args] if scenario.torchrun else [script(name), *args]
    options = ["--ceiling-batches", "0", "--"] if scenario.torchrun else []
    if scenario.torchrun:
        return stepscope_run(tmp_path, *options, *command, warmup=5, steps=scenario.steps, timeout=240, verb="doctor")
    return stepscope_here(tmp_path, *command, warmup=5, steps=scenario.steps, verb="doctor")  # a process saved


def contention_stated(r: RunResult) -> bool:
    verdict = r.summary.verdict
    return verdict.confidence != "high" and bool(verdict.evidence) and verdict.evidence[0].startswith(OVERSUBSCRIBED)


@pytest.mark.parametrize("name", QUIET)
def test_doctor_names_the_bound_and_the_first_fix(tmp_path, name):
    scenario = SCENARIOS[name]
    r = doctor(tmp_path, scenario)
    assert r.returncode == 0, r.describe()
    s = r.summary
    assert s.verdict.bound == scenario.bound, (s.verdict, r.describe())
    first = next(iter(s.fixes), None)
    assert first is not None and first.id == scenario.first_fix, ([f.id for f in s.fixes], r.describe())
    assert not {f.id for f in s.fixes} & set(scenario.never), ([f.id for f in s.fixes], r.describe())


BURNED = ("workers-oversubscribed", "ddp-straggler")


@pytest.mark.parametrize("name", BURNED)
def test_beside_a_cpu_burner_the_doctor_is_right_or_says_the_machine_is_busy(tmp_path, burner, name):
    scenario = SCENARIOS[name]
    r = doctor(tmp_path, scenario)
    assert r.returncode == 0, r.describe()
    s = r.summary
    assert not {f.id for f in s.fixes} & set(scenario.never), ([f.id for f in s.fixes], r.describe())
    if s.verdict.bound == scenario.bound:
        first = next(iter(s.fixes), None)
        assert first is not None and first.id == scenario.first_fix, ([f.id for f in s.fixes], r.describe())
    else:
        assert contention_stated(r), (s.verdict, r.describe())
