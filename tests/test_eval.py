"""Validation passes kept apart from the training step: ``Scope.phase("eval")`` with a fake clock (exact figures),
and ``stepscope run`` telling validation forwards from training work in unmodified scripts (sleep-based ground
truth: the model's forward sleeps a known time)."""

from __future__ import annotations

import time

import pytest
import torch
from run_helpers import hooked, script, stepscope_here

from stepscope import Scope


def _train_step(scope: Scope, clock, data_ms: float = 2.0, forward_ms: float = 5.0) -> None:
    with scope.phase("data_wait"):
        clock.advance(data_ms)
    with scope.phase("forward"):
        clock.advance(forward_ms)
    clock.advance(1.0)  # the loop's own Python: other
    scope.step(batch_size=8)


def test_an_eval_phase_leaves_the_step_and_is_reported_apart(clock):
    scope = Scope(warmup=1, clock=clock, system_interval_s=None)
    _train_step(scope, clock)  # warm-up
    for i in range(6):
        _train_step(scope, clock)
        if i % 3 == 2:  # a validation pass after every third step: 4 fetches and 4 forwards
            with scope.phase("eval"):
                for _ in range(4):
                    with scope.phase("data_wait"):
                        clock.advance(3.0)
                    with scope.phase("forward"):
                        clock.advance(10.0)
                clock.advance(2.0)  # metric bookkeeping inside the pass
    summary = scope.summary()
    # The steps hold training alone: 2 + 5 + 1 ms, every one of them.
    assert summary.phases["total"].mean_ms == pytest.approx(8.0)
    assert summary.phases["total"].p95_ms == pytest.approx(8.0)
    assert summary.phases["forward"].mean_ms == pytest.approx(5.0)
    assert summary.phases["data_wait"].mean_ms == pytest.approx(2.0)
    assert summary.phases["other"].mean_ms == pytest.approx(1.0)
    assert "eval" not in summary.phases
    assert summary.throughput.samples_per_s == pytest.approx(8 / 8e-3)
    passes = summary.eval
    assert passes["passes"] == 2
    assert passes["mean_ms"] == pytest.approx(54.0) and passes["max_ms"] == pytest.approx(54.0)
    assert passes["phases_ms"] == pytest.approx({"data_wait": 12.0, "forward": 40.0, "other": 2.0})
    assert passes["share_of_wall"] == pytest.approx(108 / (108 + 6 * 8))
    assert passes["time_s"] == pytest.approx(0.108)
    # Each pass fell in the step open when it ran (series places 4 and 7; the warm-up step is place 0): where
    # another rank of a job waits for it (instrument/merge.py).
    assert passes["steps"] == [4, 7]


def test_an_eval_pass_in_the_middle_of_a_step_is_cut_out_of_it(clock):
    scope = Scope(warmup=0, clock=clock, system_interval_s=None)
    for _ in range(3):
        with scope.phase("data_wait"):
            clock.advance(2.0)
        with scope.phase("eval"), scope.phase("forward"):  # validation between the fetch and the forward
            clock.advance(30.0)
        with scope.phase("forward"):
            clock.advance(5.0)
        scope.step()
    summary = scope.summary()
    assert summary.phases["total"].mean_ms == pytest.approx(7.0)
    assert summary.phases["forward"].mean_ms == pytest.approx(5.0)
    assert "other" not in summary.phases or summary.phases["other"].mean_ms == pytest.approx(0.0)
    assert summary.eval["passes"] == 3 and summary.eval["phases_ms"]["forward"] == pytest.approx(30.0)


def test_a_pass_that_takes_its_loaders_first_fetch_leaves_the_step_what_it_claimed_beside_it(clock):
    # `stepscope run` moves a validation loader's first fetch (made before the pass's first forward) into the pass.
    # The step claimed 2 ms between that fetch and the pass (a copy, or stepscope's own hooks on a loaded machine):
    # the step keeps them, and its phases never add up to more than the step.
    scope = Scope(warmup=0, clock=clock, system_interval_s=None)
    for _ in range(3):
        fetch_start = clock.ns
        with scope.phase("data_wait"):  # the validation loader's first batch, in the step until the pass ends
            clock.advance(3.0)
        with scope.phase("h2d"):
            clock.advance(2.0)
        scope._begin_eval(clock.ns)
        with scope.phase("forward"):
            clock.advance(10.0)
        scope._end_eval(clock.ns, forwards=1, batches=1, moved={"data_wait": 3_000_000}, moved_start_ns=fetch_start)
        with scope.phase("forward"):
            clock.advance(5.0)
        scope.step()
    summary = scope.summary()
    assert summary.phases["total"].mean_ms == pytest.approx(7.0)
    assert summary.phases["h2d"].mean_ms == pytest.approx(2.0) and summary.phases["forward"].mean_ms == pytest.approx(5)
    assert "data_wait" not in summary.phases or summary.phases["data_wait"].mean_ms == pytest.approx(0.0)
    assert summary.eval["mean_ms"] == pytest.approx(13.0), summary.eval
    assert summary.eval["phases_ms"] == pytest.approx({"data_wait": 3.0, "forward": 10.0, "other": 0.0}), summary.eval
    assert summary.invariants == [], summary.invariants


def test_eval_during_warm_up_is_cut_out_but_not_counted_and_nested_eval_is_one_pass(clock):
    scope = Scope(warmup=2, clock=clock, system_interval_s=None)
    with scope.phase("eval"):  # before any step: the first step begins after it
        clock.advance(100.0)
    for _ in range(2):
        _train_step(scope, clock)
    with scope.phase("eval"):
        clock.advance(40.0)
        with scope.phase("eval"):
            clock.advance(20.0)
    for _ in range(3):
        _train_step(scope, clock)
    summary = scope.summary()
    assert summary.phases["total"].mean_ms == pytest.approx(8.0)
    assert summary.eval["passes"] == 1 and summary.eval["mean_ms"] == pytest.approx(60.0)


def test_without_eval_the_summary_has_no_eval_and_the_verdict_is_decided_by_the_scope(clock):
    scope = Scope(warmup=0, clock=clock, system_interval_s=None)
    for _ in range(5):
        _train_step(scope, clock, data_ms=30.0, forward_ms=2.0)
    summary = scope.summary()
    assert summary.eval == {}
    # Scope.summary() runs the same verdict rules as the CLI: data_wait is 30 of 33 ms.
    assert (summary.verdict.bound, summary.verdict.confidence) == ("data", "high")


# -- stepscope run on unmodified scripts ---------------------------------------------------------------------------

FORWARD_MS = 8.0


@pytest.mark.parametrize(
    ("where", "teacher"),
    [("end", False), ("start", False), ("tensors", False), ("train-batches", False), ("end", True)],
    ids=[
        "after-the-step-from-a-loader",
        "before-the-forward-from-a-loader",
        "from-tensors",
        "from-the-training-loaders-next-batches",
        "beside-a-teacher",
    ],
)
def test_run_keeps_validation_passes_out_of_the_training_step(tmp_path, where, teacher):
    # 40 measured steps, a pass of 10 no_grad forwards every 10 steps. A teacher's no_grad forward inside every
    # step (4 ms) is training work and must stay in it. Validation on the training loader's next batches fetches
    # each of them before its forward, as a step does: no training work used them, so they are the pass's (counted
    # as the steps', they read 1.25 batches a step and samples/s as much too high), and it is one pass, not ten.
    args = ["--where", where, "--val-every", "10", "--val-batches", "10", "--forward-ms", str(FORWARD_MS)]
    r = stepscope_here(tmp_path, script("validation.py"), *args, *(["--teacher"] if teacher else []), steps=40)
    assert r.returncode == 0, r.describe()
    summary = r.summary
    passes = summary.eval
    assert passes["passes"] == 4, passes
    assert passes["forwards_per_pass"] == pytest.approx(10.0)
    assert passes["batches_per_pass"] == pytest.approx(0.0 if where == "tensors" else 10.0)
    # Sleep-based: load makes a sleep longer, never shorter. The same forward inside the passes calibrates what one
    # takes on this machine now (a loaded one oversleeps by milliseconds).
    per_forward_ms = passes["phases_ms"]["forward"] / 10
    assert per_forward_ms >= FORWARD_MS, passes
    forward = summary.phases["forward"]
    ratio = 1.5 if teacher else 1.0  # the teacher's forward sleeps half as long, inside the step
    assert forward.median_ms >= ratio * FORWARD_MS, r.describe()
    assert forward.median_ms == pytest.approx(ratio * per_forward_ms, rel=0.35), (per_forward_ms, r.describe())
    # A pass counted inside a step would put 10 forwards into every tenth step: the mean far above the median.
    assert forward.mean_ms <= 1.3 * forward.median_ms, r.describe()
    assert summary.counters["forward_calls"] == pytest.approx(2.0 if teacher else 1.0)
    assert summary.counters["batches"] == pytest.approx(1.0)  # validation batches are not the step's samples
    assert summary.throughput.samples_per_s == pytest.approx(8 * summary.throughput.steps_per_s, rel=1e-6)
    assert 0.25 <= passes["share_of_wall"] <= 0.7, passes  # 4 × 10 forwards against 40 × 1–1.5 forwards
    assert summary.verdict.bound == "compute", r.describe()
    assert "eval: 4 validation pass(es) between steps" in r.stdout, r.stdout


def test_a_short_validation_between_steps_that_fetch_nothing_is_kept_apart(tmp_path):
    # Training on batches already in memory (no fetch: `itertools.cycle`'s replays, a tensor dataset indexed by
    # hand) and every 10 steps 2 forwards without gradients: too few to be a loop, and no training fetch ends them.
    # Nothing was fetched since the step's training work, so they are no side work on the step's batch: kept apart
    # tentatively, they are passes since the next step has none. They stayed in the step: every tenth step 2
    # forwards longer (the truth generator's c045 and c064).
    class Slow(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.004)
            return self.linear(x)

    batches = [torch.randn(4, 8) for _ in range(5)]
    with hooked(tmp_path, warmup=3, steps=40) as tracker:
        model = Slow()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(1000):
            model(batches[step % 5]).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            if step % 10 == 9:
                model.eval()
                with torch.no_grad():
                    for x in batches[:2]:
                        model(x)
                model.train()
    summary = tracker.summary()
    passes = summary.eval
    assert passes["passes"] == 4 and passes["forwards_per_pass"] == pytest.approx(2.0), passes
    assert summary.counters["forward_calls"] == pytest.approx(1.0)  # 1.2 while every tenth step held three


# -- work that recurs every step is step work -----------------------------------------------------------------------


def _own_rates(timer_path, warmup: int, steps: int) -> tuple[float, float]:
    """The script's own step rate (its validation left out) and wall rate over the measured steps (steps/s)."""
    import json

    timer = json.loads(timer_path.read_text())
    ends, val_s = timer["ends"], timer["val_s"]
    # Step i ends at ends[i]; the measured ones are warmup .. warmup + steps - 1, each since the end of the one before.
    # The script is stopped at the first event after the last measured step, which may come before its own timer
    # reads the end of that step: the rates are over the measured steps it timed.
    n = min(steps, len(ends) - warmup)
    window = ends[warmup + n - 1] - ends[warmup - 1]
    own_val = sum(val_s[warmup : warmup + n])
    return n / (window - own_val), n / window


@pytest.mark.parametrize("where", ["after", "before"])
def test_no_grad_forwards_in_every_step_stay_in_the_step(tmp_path, where):
    # Six no_grad forwards of a second model (1 ms each) in every step, beside a 4 ms training forward: a metric or
    # a reference model, not validation. Cut out as validation they made the run read 2.5x its own steps/s.
    timer = tmp_path / "timer.json"
    args = ["--where", where, "--side-forwards", "6", "--side-ms", "1", "--forward-ms", "4", "--timer", str(timer)]
    r = stepscope_here(tmp_path, script("side_work.py"), *args, warmup=5, steps=40)
    assert r.returncode == 0, r.describe()
    summary = r.summary
    assert summary.eval == {}, summary.eval
    step_rate, wall_rate = _own_rates(timer, warmup=5, steps=40)
    assert summary.throughput.steps_per_s == pytest.approx(step_rate, rel=0.05), r.describe()
    assert summary.throughput.wall_steps_per_s == pytest.approx(wall_rate, rel=0.05), r.describe()
    # The 7 forwards of a step are its own: 10 ms of sleep at least.
    assert summary.phases["forward"].median_ms >= 10.0, r.describe()
    assert summary.counters["forward_calls"] == pytest.approx(7.0, abs=0.1)
    assert summary.counters["batches"] == pytest.approx(1.0)
    assert summary.throughput.samples_per_s == pytest.approx(8 * summary.throughput.steps_per_s, rel=0.01)
    assert summary.invariants == []


@pytest.mark.parametrize("source", ["loader", "train"])
def test_validation_after_every_steps_side_work_is_still_validation(tmp_path, source):
    # The same side work every step, and every 10 steps a validation pass over its own loader (5 batches), or over
    # the training loader's next 5 batches: the passes are kept apart, the side work stays in the step, and the wall
    # rate counts both. (The training loader's batches stayed in the step, fetched as its own are: its rate read 20%
    # low and its samples/s 25% high.)
    timer = tmp_path / "timer.json"
    args = ["--val-every", "10", "--val-batches", "5", "--forward-ms", "4", "--timer", str(timer)]
    args += ["--val-source", source]
    r = stepscope_here(tmp_path, script("side_work.py"), *args, warmup=5, steps=40)
    assert r.returncode == 0, r.describe()
    summary = r.summary
    assert summary.eval["passes"] == 4 and summary.eval["batches_per_pass"] == pytest.approx(5.0), summary.eval
    step_rate, wall_rate = _own_rates(timer, warmup=5, steps=40)
    assert summary.throughput.steps_per_s == pytest.approx(step_rate, rel=0.05), r.describe()
    assert summary.throughput.wall_steps_per_s == pytest.approx(wall_rate, rel=0.05), r.describe()
    wall = summary.wall
    assert wall.window_s == pytest.approx(wall.steps_s + wall.eval_s + wall.between_s)
    assert wall.eval_s == pytest.approx(summary.eval["time_s"])
    assert summary.throughput.samples_per_s == pytest.approx(8 * summary.throughput.steps_per_s, rel=1e-6)
    assert summary.invariants == []


def _start_slowly(_: int) -> None:
    time.sleep(0.05)  # a worker's start: dataset shards opened, caches warmed (the epoch restart's known stall)


def test_an_epoch_restart_inside_a_validation_on_training_batches_is_the_passs(tmp_path):
    # Epochs of 3 batches from a loader whose worker starts in 50 ms (not persistent: every epoch starts it again),
    # iterated `while True: yield from loader`, and every 5 steps a validation over the loader's next 4 batches: a
    # pass crosses an epoch end. Its batch after the restart moved into the pass, but the end of the exhausted
    # iterator and `iter(loader)` stayed in the step before (seed 2037's c016: 13% low steps/s, its data_wait 26%
    # high). The script's own timers are the ground truth.
    dataset = torch.utils.data.TensorDataset(torch.randn(24, 8))
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, num_workers=1, worker_init_fn=_start_slowly)

    def epochs():
        while True:
            yield from loader

    batches = epochs()
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    val_s, step_s = [], []
    with hooked(tmp_path, warmup=5, steps=40) as tracker:
        last = time.perf_counter()
        for step in range(1000):
            (x,) = next(batches)
            time.sleep(0.004)
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            now = time.perf_counter()
            step_s.append(now - last)
            if step % 5 == 4:
                with torch.no_grad():
                    for _ in range(4):
                        model(next(batches)[0])
                last = time.perf_counter()
                val_s.append(last - now)
            else:
                last = now
    summary = tracker.summary()
    passes = summary.eval
    assert passes["passes"] == 8 and passes["batches_per_pass"] == pytest.approx(4.0), passes
    # Every pass crosses at least one restart: the restarts are in the passes' time as in the script's own.
    own_val_ms = 1e3 * sum(val_s[:8]) / 8  # the pass after warm-up step 4 falls in measured step 5
    assert passes["mean_ms"] == pytest.approx(own_val_ms, rel=0.05), (passes, own_val_ms)
    own_step_ms = 1e3 * sum(step_s[5:45]) / 40
    assert summary.phases["total"].mean_ms == pytest.approx(own_step_ms, rel=0.05), summary.phases["total"]
