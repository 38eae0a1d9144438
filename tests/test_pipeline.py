"""PipelineMonitor against known ground truth.

Most tests drive the monitor with a fake clock in seconds (``Clock``) through a small discrete-event simulation
(``Sim``): engines are generators that hold ``with mon.infer()`` open across a simulated call, so several calls
overlap exactly as real engine slots do; the trainer blocks inside ``with mon.dispatch_wait()`` until the pool
holds a batch. Scenario figures are then exact: the scenarios use ``WINDOW = 100`` s, whose buckets are exactly
1 s, every event lands off the whole seconds, and a snapshot taken at a whole second sees the events of exactly the
last 99 s, a whole number of the scenario's periods. One test runs a real threaded pipeline with sleeping engines.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import queue
import sys
import threading
import time

import orjson
import pytest
from allocations import growth

from stepscope import NULL_SCOPE, RunSummary, Scope
from stepscope.pipeline import NULL_PIPELINE, NullPipeline, PipelineMonitor, PipelineSnapshot
from stepscope.pipeline.monitor import HISTORY_POINTS
from stepscope.pipeline.verdict import decide

WINDOW = 100.0  # s: buckets of exactly 1 s; a snapshot at a whole second covers exactly the last 99 s


def approx(value):
    return pytest.approx(value, rel=1e-9, abs=1e-12)


class Clock:
    """Seconds that move only when a test (or the simulation) moves them; ``ns`` is the same time in integer
    nanoseconds, for a Scope driven by the same timeline."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds

    def ns(self) -> int:
        return round(self.t * 1e9)


class Pool:
    """The samples pool of a simulation: counts what it holds and tells the monitor about puts and takes."""

    def __init__(self, mon: PipelineMonitor) -> None:
        self.mon = mon
        self.n = 0

    def put(self, samples: int) -> None:
        self.n += samples
        self.mon.pool_put(samples)

    def take(self, samples: int) -> None:
        assert self.n >= samples
        self.n -= samples
        self.mon.pool_take(samples)


class Sim:
    """Discrete events on the fake clock. A process is a generator that yields either a delay (s) to sleep, or a
    predicate to block on until it holds (re-checked after every step of any process). Processes due at the same
    time run in the order they were scheduled."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._heap: list = []
        self._seq = itertools.count()
        self._blocked: list = []

    def spawn(self, process, at: float) -> None:
        self._schedule(at, process)

    def _schedule(self, t: float, process) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), process))

    def run(self, until: float) -> None:
        while self._heap and self._heap[0][0] <= until:
            t, _, process = heapq.heappop(self._heap)
            self.clock.t = t
            self._step(process)
            still = []
            for predicate, blocked in self._blocked:
                if predicate():
                    self._schedule(t, blocked)
                else:
                    still.append((predicate, blocked))
            self._blocked = still
        self.clock.t = until

    def _step(self, process) -> None:
        try:
            command = next(process)
        except StopIteration:
            return
        if callable(command):
            if command():
                self._schedule(self.clock.t, process)
            else:
                self._blocked.append((command, process))
        else:
            self._schedule(self.clock.t + command, process)


def engine(clock: Clock, pool: Pool, call_s, batch: int, idle_s: float = 0.0):
    """One slot: engine calls of ``call_s`` seconds (or ``call_s(start)``) each producing ``batch`` samples into the
    pool, ``idle_s`` apart."""
    while True:
        duration = call_s(clock.t) if callable(call_s) else call_s
        with pool.mon.infer(batch_size=batch):
            yield duration
        pool.put(batch)
        if idle_s:
            yield idle_s


def trainer(pool: Pool, k: int, step_s: float):
    """Waits for ``k`` samples, takes them, trains ``step_s`` seconds, reports the step; forever."""
    mon = pool.mon
    while True:
        with mon.dispatch_wait():
            yield lambda: pool.n >= k
        pool.take(k)
        yield step_s
        mon.train_step(k, step_time=step_s)


def scope_trainer(pool: Pool, scope: Scope, k: int, data_s: float, h2d_s: float, forward_s: float, backward_s: float):
    """A trainer timed by a Scope: the dispatch wait inside ``data_wait`` (then ``data_s`` more of loading)."""
    mon = pool.mon
    while True:
        with scope.phase("data_wait"):
            with mon.dispatch_wait():
                yield lambda: pool.n >= k
            pool.take(k)
            yield data_s
        with scope.phase("h2d"):
            yield h2d_s
        with scope.phase("forward"):
            yield forward_s
        with scope.phase("backward"):
            yield backward_s
        scope.step(batch_size=k)


def fake_scope(clock: Clock, warmup: int = 0) -> Scope:
    return Scope(warmup=warmup, clock=clock.ns, system_interval_s=None, timing="host")


# -- scenarios ------------------------------------------------------------------------------------------------


def run_inference_bound():
    """4 slots, calls of 2 s for 8 samples (I = 8/2 × 4 = 16/s), staggered 0.5 s apart so one call ends every
    0.5 s; the trainer's steps take 0.25 s for 8 samples (T = 32/s), so it waits 0.25 s before each one."""
    clock = Clock()
    mon = PipelineMonitor(slots=4, window_s=WINDOW, clock=clock)
    pool, sim = Pool(mon), Sim(clock)
    for slot in range(4):
        sim.spawn(engine(clock, pool, 2.0, 8), at=0.125 + 0.5 * slot)
    sim.spawn(trainer(pool, 8, 0.25), at=0.125)
    sim.run(until=150.0)
    return mon, pool, sim


def test_inference_bound():
    mon, pool, _sim = run_inference_bound()
    snap = mon.snapshot()
    assert isinstance(snap, PipelineSnapshot)
    assert (snap.window_s, snap.slots) == (WINDOW, 4)
    assert snap.infer_capacity == approx(16.0)
    assert snap.train_capacity == approx(32.0)
    assert snap.infer_batch_time_s == approx(2.0)
    # consumption: 198 batches of 8 in the last 99 s -> 16/s = min(I, T)
    assert snap.thru == approx(16.0)
    assert snap.inflow == approx(16.0)
    assert snap.dispatch_wait_s == approx(0.25)  # 0.5 s between batches minus the 0.25 s step
    assert snap.pool == 0.0 == pool.n
    assert snap.pool_trend == approx(0.0)
    assert snap.slot_busy == approx(1.0)
    assert (snap.infer_calls, snap.infer_errors, snap.train_steps) == (198, 0, 198)
    # 4 engines: one call ends every 0.5 s from 2.125 to 149.625 -> 296 calls of 8; each is taken at once
    assert snap.samples_in == 296 * 8 == snap.samples_out
    assert snap.bottleneck == "inference"
    assert snap.confidence == "high"  # the trainer waits (50% of its time) and the pool does not fill
    assert snap.training_side is None
    first = snap.evidence[0]
    assert "inference capacity I=16.0 samples/s" in first and "training capacity T=32.0 samples/s" in first
    assert "2.00x" in first
    assert snap.evidence[1] == "the trainer waited 250 ms per step for samples (50% of its time)"
    assert snap.evidence[2] == "the pool holds 0 samples (trend +0.0 samples/s)"
    assert "add engines" in snap.evidence[3]
    assert len(snap.evidence) == 4  # slots busy all the time: no idle-slots line; enough events: no low-data line


def test_inference_bound_metrics_and_postfix():
    mon, _pool, _sim = run_inference_bound()
    assert mon.metrics() == {
        "perf/thru": approx(16.0),
        "perf/inflow": approx(16.0),
        "perf/infer_capacity": approx(16.0),
        "perf/pipeline_train_capacity": approx(32.0),
        "perf/infer_batch_time": approx(2.0),
        "perf/dispatch_wait": approx(0.25),
        "perf/pool": 0.0,
        "perf/pool_trend": approx(0.0),
        "perf/infer_errors": 0.0,
    }
    assert all(isinstance(v, float) for v in mon.metrics().values())
    assert mon.postfix() == "thru=16.0, I=16.0, T=32.0, wait=0.2s, pool=0"


def run_training_bound(clock: Clock, mon: PipelineMonitor, make_trainer):
    """4 slots, calls of 1 s for 8 samples (I = 32/s), staggered 0.25 s apart: one call ends every 0.25 s."""
    pool, sim = Pool(mon), Sim(clock)
    for slot in range(4):
        sim.spawn(engine(clock, pool, 1.0, 8), at=0.125 + 0.25 * slot)
    sim.spawn(make_trainer(pool), at=0.125)
    sim.run(until=150.0)
    return pool, sim


def test_training_bound():
    clock = Clock()
    mon = PipelineMonitor(slots=4, window_s=WINDOW, clock=clock)
    pool, _sim = run_training_bound(clock, mon, lambda pool: trainer(pool, 8, 0.5))  # T = 16/s
    snap = mon.snapshot()
    assert snap.infer_capacity == approx(32.0)
    assert snap.train_capacity == approx(16.0)
    assert snap.infer_batch_time_s == approx(1.0)
    assert snap.thru == approx(16.0)  # on consumption, not on the 32/s inflow
    assert snap.inflow == approx(32.0)
    assert snap.pool_trend == approx(16.0) == approx(snap.inflow - snap.thru)
    # puts: every 0.25 s from 1.125 to 149.875 (596 × 8); takes: every 0.5 s from 1.125 to 149.625 (298 × 8)
    assert snap.pool == 596 * 8 - 298 * 8 == pool.n
    assert snap.dispatch_wait_s == 0.0
    assert (snap.infer_calls, snap.train_steps) == (396, 198)
    assert snap.bottleneck == "training"
    assert snap.confidence == "high"
    assert snap.training_side is None  # no Scope linked
    first = snap.evidence[0]
    assert "inference capacity I=32.0 samples/s" in first and "training capacity T=16.0 samples/s" in first
    assert "2.00x" in first
    assert snap.evidence[1] == "the trainer waited 0 ms per step for samples (0% of its time)"
    assert snap.evidence[2] == "the pool holds 2384 samples (trend +16.0 samples/s)"
    assert "link a Scope" in snap.evidence[3]


def test_thru_falls_back_to_training_samples_without_pool_takes():
    """A pipeline that never reports ``pool_take``: thru is what the training steps consumed."""
    clock = Clock()
    mon = PipelineMonitor(slots=4, window_s=WINDOW, clock=clock)
    sim = Sim(clock)

    def steps():
        while True:
            yield 0.5
            mon.train_step(8, step_time=0.5)

    sim.spawn(steps(), at=0.25)
    sim.run(until=150.0)
    snap = mon.snapshot()
    assert snap.thru == approx(16.0)  # 198 steps of 8 in 99 s
    assert snap.train_capacity == approx(16.0)
    assert snap.samples_out == 0.0


@pytest.mark.parametrize(
    ("phases", "side", "share"),
    [
        ((0.25, 0.125, 0.0625, 0.0625), "data", "75%"),  # data_wait after the take 0.25 + h2d 0.125 of 0.5
        ((0.0625, 0.0625, 0.125, 0.25), "compute", "75%"),  # forward + backward 0.375 of 0.5
    ],
)
def test_training_bound_with_a_linked_scope(phases, side, share):
    clock = Clock()
    scope = fake_scope(clock)
    mon = PipelineMonitor(slots=4, window_s=WINDOW, scope=scope, clock=clock)
    pool, _sim = run_training_bound(clock, mon, lambda pool: scope_trainer(pool, scope, 8, *phases))
    snap = mon.snapshot()
    assert snap.infer_capacity == approx(32.0)
    assert snap.train_capacity == approx(16.0)  # the Scope's steps: 8 samples every 0.5 s
    assert snap.train_steps == 198
    assert snap.thru == approx(16.0)
    assert snap.dispatch_wait_s == 0.0
    assert snap.bottleneck == "training"
    assert snap.confidence == "high"
    assert snap.training_side == side
    assert snap.evidence[-1].startswith("within training, data fetch" if side == "data" else "within training, compute")
    assert f"{share} of the timed phases" in snap.evidence[-1]

    # the Scope's metrics carry the pipeline's, next to its own
    metrics = scope.metrics()
    assert metrics["perf/step_time"] == approx(0.5)
    assert metrics["perf/train_capacity"] == approx(16.0)
    assert metrics["perf/thru"] == approx(16.0)
    assert metrics["perf/infer_capacity"] == approx(32.0)
    assert metrics["perf/pipeline_train_capacity"] == approx(16.0)
    assert metrics["perf/pool"] == pool.n
    assert {k for k in metrics if k in mon.metrics()} == set(mon.metrics())

    # and its summary carries the snapshot, through JSON and back
    summary = scope.summary()
    assert summary.pipeline["bottleneck"] == "training"
    assert summary.pipeline["training_side"] == side
    assert summary.pipeline["train_capacity"] == approx(16.0)
    assert summary.pipeline["history"]
    assert summary.verdict.bound == "training"
    again = RunSummary.from_dict(orjson.loads(summary.to_json()))
    assert again.pipeline == summary.pipeline


def run_starved_scope_trainer():
    """One slot makes 8 samples in 0.25 s (I = 32/s), then idles 1.75 s; a Scope-timed trainer's step is 0.0625 s of
    loading and 0.5 s of compute (T = 8 / 0.5625), so it waits 1.4375 s for each batch, inside ``data_wait``."""
    clock = Clock()
    scope = fake_scope(clock)
    mon = PipelineMonitor(slots=1, window_s=WINDOW, scope=scope, clock=clock)
    pool, sim = Pool(mon), Sim(clock)
    sim.spawn(engine(clock, pool, 0.25, 8, idle_s=1.75), at=0.125)
    sim.spawn(scope_trainer(pool, scope, 8, 0.0625, 0.0, 0.25, 0.25), at=0.125)
    sim.run(until=150.0)
    return mon, scope, sim


def test_the_wait_inside_data_wait_is_not_data_loading():
    """One slot makes 8 samples in 0.25 s (I = 32/s), then idles 1.75 s; the trainer's step is 0.0625 s of
    loading and 0.5 s of compute (T = 8 / 0.5625), so it waits 1.4375 s for each batch, inside ``data_wait``.
    Training is the bottleneck by capacity, and compute dominates it: the wait is neither step time nor data."""
    mon, scope, _sim = run_starved_scope_trainer()
    snap = mon.snapshot()
    assert snap.infer_capacity == approx(32.0)
    assert snap.train_capacity == approx(8 / 0.5625)
    assert snap.dispatch_wait_s == approx(1.4375)
    assert snap.thru == approx(49 * 8 / 99)  # a batch every 2 s: 49 of them in the last 99 s
    assert snap.slot_busy == approx(49 * 0.25 / 99)
    assert snap.bottleneck == "training"
    assert snap.confidence == "medium"  # the trainer waits (72% of its time): the evidence disagrees
    assert snap.evidence[1] == "the trainer waited 1438 ms per step for samples (72% of its time)"
    assert snap.training_side == "compute"
    assert "compute (forward, backward, optimizer) takes 89% of the timed phases" in snap.evidence[-1]
    # the Scope itself still sees the whole 1.5 s in data_wait (75% of its steps), but its summary's verdict is
    # the pipeline's
    assert scope.metrics()["perf/data_time"] == approx(1.5)
    summary = scope.summary()
    assert summary.phases["data_wait"].share == pytest.approx(0.75, rel=0.01)
    assert summary.verdict.bound == "training"
    assert summary.verdict.confidence == "medium"
    assert summary.verdict.evidence[: len(snap.evidence)] == snap.evidence


def test_summary_verdict_does_not_call_a_starved_training_step_data_bound():
    _mon, scope, _sim = run_starved_scope_trainer()
    summary = scope.summary()
    assert summary.pipeline["training_side"] == "compute"
    # The Scope's raw phase shares still hold the dispatch wait inside data_wait (1.44 s per step): that is
    # inference starvation (docs/pipeline.md), so the verdict must not call the training step data-bound.
    assert not any("data-bound" in line for line in summary.verdict.evidence)


def test_wait_outside_any_phase_is_not_taken_out_of_data_loading():
    """The trainer waits for the pool before its ``data_wait`` phase (the wait falls in the Scope's ``other``),
    then spends 0.375 s preprocessing in ``data_wait`` and 0.125 s in compute: data loading dominates."""
    clock = Clock()
    scope = fake_scope(clock)
    mon = PipelineMonitor(slots=1, window_s=WINDOW, scope=scope, clock=clock)
    pool, sim = Pool(mon), Sim(clock)

    def loop():
        while True:
            with mon.dispatch_wait():
                yield lambda: pool.n >= 8
            pool.take(8)
            with scope.phase("data_wait"):
                yield 0.375
            with scope.phase("forward"):
                yield 0.0625
            with scope.phase("backward"):
                yield 0.0625
            scope.step(batch_size=8)

    sim.spawn(engine(clock, pool, 0.25, 8, idle_s=1.75), at=0.125)  # I = 32/s, one batch every 2 s
    sim.spawn(loop(), at=0.125)
    sim.run(until=150.0)
    snap = mon.snapshot()
    assert snap.train_capacity == approx(16.0)  # 8 / 0.5: the 1.5 s wait is out of the step time
    assert snap.bottleneck == "training"
    # The wait lies outside every phase (in "other"): the 0.375 s of data loading per step stays data loading.
    assert snap.training_side == "data"
    assert "75% of the timed phases" in snap.evidence[-1]


def run_balanced(tolerance: float = 0.10):
    """4 slots of 2 s calls for 8 samples (I = 16/s); steps of 0.5 s for 8 samples (T = 16/s)."""
    clock = Clock()
    mon = PipelineMonitor(slots=4, window_s=WINDOW, tolerance=tolerance, clock=clock)
    pool, sim = Pool(mon), Sim(clock)
    for slot in range(4):
        sim.spawn(engine(clock, pool, 2.0, 8), at=0.125 + 0.5 * slot)
    sim.spawn(trainer(pool, 8, 0.5), at=0.125)
    sim.run(until=150.0)
    return mon


def test_balanced():
    snap = run_balanced().snapshot()
    assert snap.infer_capacity == approx(16.0)
    assert snap.train_capacity == approx(16.0)
    assert snap.thru == approx(16.0)
    assert snap.dispatch_wait_s == 0.0
    assert snap.pool_trend == approx(0.0)
    assert snap.bottleneck == "balanced"
    assert snap.confidence == "high"
    assert snap.evidence[0] == (
        "inference capacity I=16.0 samples/s, training capacity T=16.0 samples/s: within 10% of each other"
    )


def capacities(infer: float, train: float, tolerance: float, slots: int = 4, events: int = 3):
    """A monitor whose window holds ``events`` engine calls giving I = ``infer`` and ``events`` steps giving T =
    ``train`` (1 s each), and no pool traffic."""
    clock = Clock(0.5)
    mon = PipelineMonitor(slots=slots, window_s=WINDOW, tolerance=tolerance, clock=clock)
    for _ in range(events):
        mon.record_infer(1.0, infer / slots)
        mon.train_step(train, step_time=1.0)
        clock.advance(1.0)
    return mon.snapshot()


@pytest.mark.parametrize(
    ("infer", "train", "bottleneck"),
    [
        (32.0, 24.0, "balanced"),  # |I - T| = 8 = 0.25 × max: on the boundary, balanced
        (32.0, 23.5, "training"),  # just outside
        (24.0, 32.0, "balanced"),
        (24.0, 32.5, "inference"),
        (32.0, 32.0, "balanced"),
    ],
)
def test_tolerance_boundary(infer, train, bottleneck):
    snap = capacities(infer, train, tolerance=0.25)
    assert snap.infer_capacity == approx(infer)
    assert snap.train_capacity == approx(train)
    assert snap.bottleneck == bottleneck
    assert snap.confidence in ("high", "medium")  # 3 calls and 3 steps: enough events


def test_tolerance_zero_and_few_events():
    assert capacities(32.0, 32.0, tolerance=0.0).bottleneck == "balanced"
    assert capacities(32.0, 31.5, tolerance=0.0).bottleneck == "training"
    few = capacities(16.0, 32.0, tolerance=0.1, events=2)
    assert few.bottleneck == "inference"
    assert few.confidence == "low"
    assert few.evidence[-1] == "only 2 engine call(s) and 2 training step(s) in the window"


def run_engines(idle_s: float):
    """4 slots starting together, calls of 0.75 s for 6 samples (per-slot rate 8/s: I = 32/s), ``idle_s`` between
    calls; the trainer's steps take 0.125 s for 8 samples (T = 64/s)."""
    clock = Clock()
    mon = PipelineMonitor(slots=4, window_s=WINDOW, clock=clock)
    pool, sim = Pool(mon), Sim(clock)
    for _ in range(4):
        sim.spawn(engine(clock, pool, 0.75, 6, idle_s=idle_s), at=0.5625)
    sim.spawn(trainer(pool, 8, 0.125), at=0.5625)
    sim.run(until=150.0)
    return mon.snapshot()


def test_bursty_engines_keep_their_capacity_and_show_idle_slots():
    bursty = run_engines(idle_s=2.25)  # a burst of 4 calls every 3 s: 24 samples, 3 batches
    steady = run_engines(idle_s=0.0)
    # burstiness does not change capacity: the per-slot rate while working is the same
    assert bursty.infer_capacity == approx(32.0) == steady.infer_capacity
    assert bursty.infer_batch_time_s == approx(0.75) == steady.infer_batch_time_s
    assert bursty.train_capacity == approx(64.0) == steady.train_capacity
    # ...but the slots idle 3/4 of the time, and the realised throughput shows it
    assert bursty.slot_busy == approx(0.25)
    assert steady.slot_busy == approx(1.0)
    assert bursty.thru == approx(8.0)
    assert steady.thru == approx(32.0)
    # each burst feeds 3 steps: the trainer waits 2.625 s before the first and nothing before the two others
    assert bursty.dispatch_wait_s == approx(2.625 / 3)
    assert (bursty.infer_calls, bursty.train_steps) == (132, 99)
    assert bursty.bottleneck == steady.bottleneck == "inference"
    idle = [line for line in bursty.evidence if "slot time" in line]
    assert idle == [
        "the engines were busy only 25% of their slot time: requests do not keep every slot fed, so dispatch "
        "more requests concurrently before adding engines"
    ]
    assert not any("slot time" in line for line in steady.evidence)


def test_idle_slots_line_only_below_80_percent_and_only_when_inference_bound():
    def snap(busy: float, train: float):
        clock = Clock(0.5)
        mon = PipelineMonitor(slots=1, window_s=WINDOW, clock=clock)
        for _ in range(4):  # 4 calls of 1 s (8 samples: I = 8/s) in every 1/busy seconds
            mon.record_infer(1.0, 8)
            mon.train_step(train, step_time=1.0)
            clock.advance(1.0 / busy)
        return mon.snapshot()

    at_80 = snap(0.8, 32.0)
    below = snap(0.5, 32.0)
    assert below.slot_busy == approx(0.5)
    assert below.bottleneck == "inference"
    assert any("busy only 50% of their slot time" in line for line in below.evidence)
    assert at_80.slot_busy == approx(0.8)
    assert not any("slot time" in line for line in at_80.evidence)
    training = snap(0.5, 4.0)
    assert training.bottleneck == "training"
    assert not any("slot time" in line for line in training.evidence)


# -- the sliding window ---------------------------------------------------------------------------------------


def test_figures_follow_a_change_of_engine_speed_within_one_window():
    """Calls of 2 s (I = 16/s) until t = 60, then of 1 s (I = 32/s); the trainer could take 64/s."""
    clock = Clock()
    mon = PipelineMonitor(slots=4, window_s=WINDOW, clock=clock)
    pool, sim = Pool(mon), Sim(clock)
    for slot in range(4):
        sim.spawn(engine(clock, pool, lambda t: 2.0 if t < 60 else 1.0, 8), at=0.125 + 0.5 * slot)
    sim.spawn(trainer(pool, 8, 0.125), at=0.125)

    sim.run(until=59.0)
    before = mon.snapshot()
    assert before.infer_capacity == approx(16.0)
    assert before.infer_batch_time_s == approx(2.0)

    sim.run(until=110.0)  # the window [11, 110] holds both speeds
    mixed = mon.snapshot()
    assert 16.0 < mixed.infer_capacity < 32.0
    assert 1.0 < mixed.infer_batch_time_s < 2.0

    sim.run(until=165.0)  # the last slow call ended before 62: one window later only fast calls remain
    after = mon.snapshot()
    assert after.infer_capacity == approx(32.0)
    assert after.infer_batch_time_s == approx(1.0)
    assert after.thru == approx(32.0)
    assert after.inflow == approx(32.0)
    assert after.slot_busy == approx(1.0)
    assert after.bottleneck == "inference"


@pytest.mark.parametrize("offset", [0.0, 0.03, 0.0625, 0.1, 0.1249])
def test_window_edge_is_exact_to_one_percent(offset):
    """An event at e counts while now < e + 0.99 × window_s and no longer from e + window_s."""
    window_s = 12.5  # buckets of 0.125 s
    clock = Clock(100.0 + offset)
    mon = PipelineMonitor(slots=4, window_s=window_s, clock=clock)
    mon.record_infer(1.0, 8)
    event = clock.t
    clock.t = event + 0.99 * window_s - 1e-9
    snap = mon.snapshot()
    assert snap.infer_calls == 1
    assert snap.infer_capacity == approx(32.0)
    clock.t = event + window_s
    snap = mon.snapshot()
    assert snap.infer_calls == 0
    assert snap.infer_capacity is None
    assert snap.bottleneck == "unknown"


def test_span_of_a_window_not_yet_full_starts_at_the_first_event():
    clock = Clock(10.0)
    mon = PipelineMonitor(slots=1, window_s=WINDOW, clock=clock)
    mon.pool_put(40)
    clock.t = 14.0
    mon.pool_take(20)
    clock.t = 20.0
    snap = mon.snapshot()
    assert snap.inflow == approx(4.0)  # 40 samples over the 10 s since the first event
    assert snap.thru == approx(2.0)
    assert snap.pool == 20.0
    assert snap.pool_trend == approx(2.0)


def test_record_infer_ended_ago_lands_in_its_own_time():
    window_s = 12.5  # buckets of 0.125 s
    clock = Clock(0.0625)
    mon = PipelineMonitor(slots=4, window_s=window_s, clock=clock)
    mon.pool_put(1)
    clock.t = 10.0625
    mon.record_infer(1.0, 8, ended_ago_s=8.0)  # ended at 2.0625: drops out at 14.5
    mon.record_infer(1.0, 16)  # ended now, at 10.0625: drops out at 22.5
    clock.t = 14.4375
    both = mon.snapshot()
    assert both.infer_calls == 2
    assert both.infer_capacity == approx(24 / 2 * 4)
    clock.t = 14.5625
    late_gone = mon.snapshot()
    assert late_gone.infer_calls == 1
    assert late_gone.infer_capacity == approx(16 * 4)
    clock.t = 22.5625
    assert mon.snapshot().infer_calls == 0


def test_record_infer_older_than_the_window_is_not_counted():
    clock = Clock(0.0625)
    mon = PipelineMonitor(slots=4, window_s=12.5, clock=clock)
    mon.pool_put(1)
    clock.t = 20.0625
    mon.pool_put(1)
    # A call that ended 15 s ago, before the 12.5 s window began, is older than every kept bucket: dropped, not
    # put into the oldest kept bucket (which is inside the window).
    mon.record_infer(1.0, 8, ended_ago_s=15.0)
    snap = mon.snapshot()
    assert snap.infer_calls == 0
    assert snap.infer_capacity is None


# -- faults ---------------------------------------------------------------------------------------------------


def test_engine_call_that_raises_is_counted_and_excluded():
    clock = Clock(1.0)
    mon = PipelineMonitor(slots=2, window_s=WINDOW, clock=clock)
    with mon.infer(batch_size=8):
        clock.advance(1.0)
    with pytest.raises(RuntimeError, match="engine died"), mon.infer(batch_size=8):
        clock.advance(3.0)  # a slow call that fails: left out of the rate
        raise RuntimeError("engine died")
    for _ in range(2):
        with mon.infer(batch_size=8):
            clock.advance(1.0)
    clock.advance(1.0)
    snap = mon.snapshot()
    assert snap.infer_calls == 3
    assert snap.infer_errors == 1
    assert snap.infer_capacity == approx(16.0)  # 24 samples / 3 s × 2 slots
    assert snap.infer_batch_time_s == approx(1.0)
    assert snap.slot_busy == approx(6.0 / (2 * 6.0))  # the failed call still occupied its slot (span from 2 to 8)
    assert "1 engine call(s) raised in the window and are left out of the inference capacity" in snap.evidence
    assert mon.metrics()["perf/infer_errors"] == 1.0


def test_errors_are_reported_even_with_no_data():
    clock = Clock(1.0)
    mon = PipelineMonitor(slots=2, clock=clock)
    mon.record_infer(1.0, 8, ok=False)
    snap = mon.snapshot()
    assert snap.infer_errors == 1
    assert snap.infer_capacity is None
    assert snap.bottleneck == "unknown"
    assert snap.evidence == [
        "no engine call produced samples and no training step with samples in the last window: not enough data",
        "1 engine call(s) raised in the window and are left out of the inference capacity",
    ]


def test_no_data_gives_unknown_with_a_reason():
    clock = Clock(5.0)
    mon = PipelineMonitor(slots=2, clock=clock)
    snap = mon.snapshot()
    assert (snap.infer_capacity, snap.train_capacity, snap.thru, snap.inflow) == (None, None, None, None)
    assert (snap.infer_batch_time_s, snap.dispatch_wait_s, snap.pool_trend, snap.slot_busy) == (None,) * 4
    assert snap.pool == 0.0
    assert (snap.bottleneck, snap.confidence, snap.training_side) == ("unknown", "low", None)
    assert snap.evidence == [
        "no engine call produced samples and no training step with samples in the last window: not enough data"
    ]
    assert mon.metrics() == {"perf/pool": 0.0, "perf/infer_errors": 0.0}
    assert mon.postfix() == "thru=-, I=-, T=-, wait=-s, pool=0"


def test_zero_samples_give_no_capacity():
    clock = Clock(5.0)
    mon = PipelineMonitor(slots=2, clock=clock)
    for _ in range(3):
        with mon.infer():  # batch size never given
            clock.advance(1.0)
        mon.train_step(8, step_time=0.5)
    snap = mon.snapshot()
    assert snap.infer_capacity is None
    assert snap.infer_batch_time_s is None
    assert snap.infer_calls == 0
    assert snap.train_capacity == approx(16.0)
    assert snap.bottleneck == "unknown"
    assert snap.evidence == ["no engine call produced samples in the last window: not enough data"]

    clock = Clock(5.0)
    mon = PipelineMonitor(slots=2, clock=clock)
    mon.record_infer(1.0, 8)
    mon.train_step(0, step_time=0.5)
    snap = mon.snapshot()
    assert snap.train_capacity is None
    assert snap.train_steps == 0
    assert snap.evidence == ["no training step with samples in the last window: not enough data"]


def test_clock_going_backwards_cannot_corrupt_the_window():
    clock = Clock(96.0)
    mon = PipelineMonitor(slots=4, window_s=12.5, clock=clock)
    mon.pool_put(8)
    clock.t = 100.0
    mon.record_infer(1.0, 8)
    mon.train_step(8, step_time=0.5)  # also starts the clock of steps without a time
    with mon.infer(batch_size=8):
        clock.t = 51.0  # the clock steps 49 s back during the call: timed at zero, left out of the capacity
    clock.t = 52.0
    mon.pool_put(8)  # counts at 100, the monitor's latest time
    mon.train_step(8)  # since the previous step: 0 s, not -48 s
    snap = mon.snapshot()
    assert snap.infer_calls == 1
    assert snap.infer_capacity == approx(32.0)
    assert snap.infer_batch_time_s == approx(1.0)
    assert snap.train_steps == 1
    assert snap.train_capacity == approx(16.0)
    assert snap.slot_busy == approx(1.0 / (4 * 4.0))  # the zero-length call adds no busy time
    assert snap.inflow == approx(16 / 4.0)
    assert snap.pool == 16.0
    # the clock comes back: events land after t = 100 and age out on time
    clock.t = 105.0
    mon.record_infer(2.0, 8)
    mon.train_step(8)  # 5 s since the step at 100
    snap = mon.snapshot()
    assert snap.infer_calls == 2
    assert snap.infer_capacity == approx(16 / 3 * 4)
    assert snap.train_capacity == approx(16 / 5.5)
    clock.t = 113.0  # the events at 100 have left the window, those at 105 have not
    snap = mon.snapshot()
    assert snap.infer_calls == 1
    assert snap.infer_capacity == approx(16.0)
    assert snap.train_capacity == approx(8 / 5.0)
    assert snap.inflow == 0.0  # the puts recorded at 100 are gone too
    clock.t = 118.0
    assert mon.snapshot().infer_calls == 0


def test_regions_entered_after_the_clock_stepped_back_are_not_inflated():
    clock = Clock(100.0)
    mon = PipelineMonitor(slots=4, window_s=WINDOW, clock=clock)
    mon.record_infer(1.0, 8)
    mon.train_step(8, step_time=0.5)
    clock.t = 50.0  # the clock steps 50 s back, then a 1 s engine call and a 1 s wait run on it
    with mon.infer(batch_size=8):
        clock.t = 51.0
    with mon.dispatch_wait():
        clock.t = 52.0
    snap = mon.snapshot()
    # Entered at raw 50 while the monitor's time is already 100: the region is timed on the raw clock (1 s), not
    # from 50 to the clamped 100.
    assert snap.infer_capacity == approx(32.0)
    assert snap.infer_batch_time_s == approx(1.0)
    assert snap.dispatch_wait_s <= 1.0


def test_infer_never_exited_records_nothing():
    clock = Clock(1.0)
    mon = PipelineMonitor(slots=2, window_s=WINDOW, clock=clock)
    hung = mon.infer(batch_size=100)
    hung.__enter__()
    clock.advance(1.0)
    with mon.infer(batch_size=8):
        clock.advance(2.0)
    clock.advance(7.0)
    snap = mon.snapshot()
    assert snap.infer_calls == 1
    assert snap.infer_capacity == approx(8.0)  # 8 / 2 s × 2 slots: the hung call adds neither samples nor time
    assert snap.infer_batch_time_s == approx(2.0)
    assert snap.slot_busy == approx(2.0 / (2 * 7.0))  # span from the first event (the call's end at 4)
    assert snap.infer_errors == 0


def test_validation():
    with pytest.raises(ValueError, match="slots"):
        PipelineMonitor(slots=0)
    with pytest.raises(ValueError, match="slots"):
        PipelineMonitor(slots=2.5)
    with pytest.raises(ValueError, match="tolerance"):
        PipelineMonitor(slots=1, tolerance=1.0)
    with pytest.raises(ValueError, match="window_s"):
        PipelineMonitor(slots=1, window_s=0)


# -- API ------------------------------------------------------------------------------------------------------


def test_postfix_with_known_figures():
    clock = Clock(0.0)
    mon = PipelineMonitor(slots=1, window_s=WINDOW, clock=clock)
    mon.pool_put(145)
    clock.t = 1.0
    with mon.dispatch_wait():
        clock.t = 1.125
    mon.pool_take(121)
    mon.record_infer(2.0, 37)  # I = 18.5
    mon.train_step(66, step_time=5.0)  # T = 13.2
    clock.t = 10.0
    snap = mon.snapshot()
    assert (snap.thru, snap.infer_capacity, snap.train_capacity) == (approx(12.1), approx(18.5), approx(13.2))
    assert (snap.dispatch_wait_s, snap.pool) == (approx(0.125), 24.0)
    assert mon.postfix() == "thru=12.1, I=18.5, T=13.2, wait=0.1s, pool=24"


def test_train_step_without_step_time_uses_the_time_between_steps_minus_the_waits():
    clock = Clock(0.0)
    mon = PipelineMonitor(slots=1, window_s=WINDOW, clock=clock)
    mon.train_step(8)  # only starts the clock
    assert mon.snapshot().train_steps == 0
    clock.t = 0.25
    with mon.dispatch_wait():
        clock.t = 0.5
    clock.t = 1.0
    mon.train_step(8)  # 1.0 s since the previous step, 0.25 s of it waiting
    snap = mon.snapshot()
    assert snap.train_steps == 1
    assert snap.train_capacity == approx(8 / 0.75)
    assert snap.dispatch_wait_s == approx(0.25)
    with mon.dispatch_wait():
        clock.t = 1.5
    clock.t = 2.0
    mon.train_step(8)  # 1.0 s, 0.5 s waiting
    snap = mon.snapshot()
    assert snap.train_capacity == approx(16 / 1.25)
    assert snap.dispatch_wait_s == approx(0.75 / 2)
    clock.t = 2.5
    mon.train_step(8, step_time=0.125)  # an explicit time wins
    assert mon.snapshot().train_capacity == approx(24 / 1.375)


def test_samples_set_inside_the_block():
    clock = Clock(1.0)
    mon = PipelineMonitor(slots=4, window_s=WINDOW, clock=clock)
    with mon.infer() as call:
        clock.advance(2.0)
        call.samples = 8
    with mon.infer(batch_size=100) as call:
        clock.advance(2.0)
        call.samples = 4  # known only at the end: overrides the batch size
    snap = mon.snapshot()
    assert snap.infer_calls == 2
    assert snap.infer_capacity == approx(12 / 4 * 4)


def test_async_with():
    clock = Clock(0.0)
    mon = PipelineMonitor(slots=2, window_s=WINDOW, clock=clock)

    async def main():
        done_a, done_b = asyncio.Event(), asyncio.Event()

        async def call(done, samples):
            async with mon.infer(batch_size=samples):
                await done.wait()

        a = asyncio.create_task(call(done_a, 8))
        await asyncio.sleep(0)  # a enters at 0
        clock.t = 0.5
        b = asyncio.create_task(call(done_b, 8))
        await asyncio.sleep(0)  # b enters at 0.5, while a is in flight
        clock.t = 2.0
        done_a.set()
        await a
        clock.t = 2.5
        done_b.set()
        await b
        with pytest.raises(ValueError):
            async with mon.infer(batch_size=8):
                clock.t = 3.0
                raise ValueError("bad request")
        async with mon.dispatch_wait() as wait:
            clock.t = 3.25
        return wait

    wait = asyncio.run(main())
    assert wait is not None
    clock.t = 4.0
    snap = mon.snapshot()
    assert snap.infer_calls == 2
    assert snap.infer_errors == 1
    assert snap.infer_capacity == approx(16 / 4 * 2)  # two overlapping 2 s calls of 8
    assert snap.infer_batch_time_s == approx(2.0)
    assert snap.dispatch_wait_s == approx(0.25)  # no training steps: per wait


def test_pool_level_overrides_counting_and_gives_the_trend():
    clock = Clock(0.0)
    mon = PipelineMonitor(slots=1, window_s=12.5, clock=clock)
    mon.pool_put(100)  # counting alone would say 100
    for second in range(21):  # the pool's own size: +2 samples/s for 20 s
        clock.t = float(second)
        mon.pool_level(2.0 * second)
    snap = mon.snapshot()
    assert snap.pool == 40.0
    assert snap.pool_trend == approx(2.0)
    for second in range(21, 41):  # then flat for 20 s, longer than the window
        clock.t = float(second)
        mon.pool_level(40.0)
    snap = mon.snapshot()
    assert snap.pool == 40.0
    assert snap.pool_trend == approx(0.0)
    assert mon.metrics()["perf/pool"] == 40.0


def test_history_is_spaced_a_tenth_of_the_window_at_first():
    clock = Clock()
    mon = PipelineMonitor(slots=1, window_s=10.0, clock=clock)
    for i in range(81):  # a put every 0.25 s for 20 s
        clock.t = 1000.0 + i * 0.25
        mon.pool_put(1)
    history = mon.history()
    assert [p["t_s"] for p in history] == [float(s) for s in range(1, 21)]
    assert history[0] == {
        "t_s": 1.0,
        "infer_capacity": None,
        "train_capacity": None,
        "thru": 0.0,
        "inflow": approx(5.0),  # 5 puts in the first second
        "pool": 5.0,
    }
    assert history[-1]["pool"] == 81.0


def test_history_is_bounded_over_a_very_long_run():
    clock = Clock()
    mon = PipelineMonitor(slots=1, window_s=1.0, clock=clock)  # a point every 0.1 s at first
    end = 1000.0
    for i in range(16_001):  # a put every 1/16 s for 1000 s: 10,000 windows
        clock.t = 5.0 + i / 16
        mon.pool_put(1)
    times = [p["t_s"] for p in mon.history()]
    assert HISTORY_POINTS // 2 <= len(times) <= HISTORY_POINTS
    assert times == sorted(set(times))
    assert times[0] < 1.0  # the start of the run is still there...
    # ...evenly thinned: the interval is now 0.1 s doubled 5 times (3.2 s); events every 1/16 s round each gap up
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert min(gaps) >= 3.2 and max(gaps) <= 2 * 3.2
    assert times[-1] >= end - 3.2 - 1 / 16  # ...and so is its end


def test_history_times_count_from_a_first_event_at_zero():
    clock = Clock(0.0)
    mon = PipelineMonitor(slots=1, window_s=10.0, clock=clock)
    for i in range(13):
        clock.t = i * 0.25
        mon.pool_put(1)
    # A first event at t = 0.0 is a first event like any other: the points count from it.
    assert [p["t_s"] for p in mon.history()] == [1.0, 2.0, 3.0]


def test_summary_window_ends_at_the_last_event():
    """A summary is written after the pipeline stopped: the idle time since must not read as a slowdown."""
    mon, _pool, sim = run_inference_bound()
    sim.clock.t = 180.0  # the pipeline stopped at 150: 30 s idle
    live = mon.snapshot()
    assert live.thru == approx(138 * 8 / 99)  # window [81, 180]: the 138 batches taken from 81.125 to 149.625
    assert live.infer_capacity == approx(16.0)
    data = mon.to_summary()  # the window ends at the last event (the step ending at 149.875)
    assert data["thru"] == pytest.approx(16.0, rel=0.01)
    assert data["inflow"] == pytest.approx(16.0, rel=0.01)
    assert data["slot_busy"] == pytest.approx(1.0, rel=0.01)
    assert (data["infer_capacity"], data["train_capacity"]) == (approx(16.0), approx(32.0))
    assert data["dispatch_wait_s"] == approx(0.25)
    assert data["bottleneck"] == "inference"
    assert data["confidence"] == "high"

    mon, _pool, _sim = run_inference_bound()
    data = mon.to_summary()
    assert set(data) == {*PipelineSnapshot(window_s=1.0, slots=1).to_dict(), "history"}
    assert data["bottleneck"] == "inference"
    assert data["infer_capacity"] == approx(16.0)
    assert len(data["history"]) > 0
    summary = RunSummary(pipeline=data)
    again = RunSummary.from_dict(orjson.loads(summary.to_json()))
    assert again.pipeline == data


def test_linked_monitor_counts_the_scopes_measured_steps_only():
    clock = Clock(1.0)
    scope = fake_scope(clock, warmup=2)
    mon = PipelineMonitor(slots=1, window_s=WINDOW, scope=scope, clock=clock)
    for forward_s in (4.0, 4.0, 0.25, 0.25, 0.25):  # two slow warm-up steps
        with scope.phase("data_wait"):
            with mon.dispatch_wait():
                pass
            mon.pool_take(8)
        with scope.phase("forward"):
            clock.advance(forward_s)
        scope.step(batch_size=8)
    snap = mon.snapshot()
    assert snap.train_steps == 3
    assert snap.train_capacity == approx(32.0)
    assert snap.thru is not None


def test_linked_monitor_warmup_waits_do_not_leak_into_measured_steps():
    clock = Clock(1.0)
    scope = fake_scope(clock, warmup=2)
    mon = PipelineMonitor(slots=1, window_s=WINDOW, scope=scope, clock=clock)
    for _ in range(5):  # each step: 1 s waiting for samples, 0.25 s forward
        with scope.phase("data_wait"):
            with mon.dispatch_wait():
                clock.advance(1.0)
            mon.pool_take(8)
        with scope.phase("forward"):
            clock.advance(0.25)
        scope.step(batch_size=8)
    snap = mon.snapshot()
    # The waits of the warm-up steps (not counted) are neither taken out of the first measured step nor divided
    # among the measured steps.
    assert snap.train_steps == 3
    assert snap.train_capacity == approx(32.0)
    assert snap.dispatch_wait_s == approx(1.0)


def test_linked_monitor_ignores_train_step_with_a_warning(caplog):
    clock = Clock(1.0)
    scope = fake_scope(clock)
    mon = PipelineMonitor(slots=1, window_s=WINDOW, scope=scope, clock=clock)
    with caplog.at_level(logging.WARNING, logger="stepscope"):
        mon.train_step(8, step_time=0.5)
    assert mon.snapshot().train_steps == 0
    assert mon.snapshot().train_capacity is None
    assert any("train_step ignored" in r.getMessage() for r in caplog.records)


def test_disabled_scope_is_not_linked():
    clock = Clock(1.0)
    mon = PipelineMonitor(slots=1, window_s=WINDOW, scope=NULL_SCOPE, clock=clock)
    mon.train_step(8, step_time=0.5)
    assert mon.snapshot().train_capacity == approx(16.0)


def test_disabled_monitor_does_not_link_the_scope():
    clock = Clock(1.0)
    scope = fake_scope(clock)
    mon = PipelineMonitor(slots=1, scope=scope, enabled=False)
    assert mon is NULL_PIPELINE
    with scope.phase("forward"):
        clock.advance(0.5)
    scope.step(batch_size=8)
    with scope.phase("forward"):
        clock.advance(0.5)
    scope.step(batch_size=8)
    assert scope.metrics()["perf/step_time"] == approx(0.5)
    assert not any(k in scope.metrics() for k in ("perf/thru", "perf/pool", "perf/infer_errors"))
    assert scope.summary().pipeline == {}


def test_no_lock_is_held_during_user_work():
    mon = PipelineMonitor(slots=1)

    def work():
        with mon.infer(batch_size=1):
            mon.snapshot()  # the lock is not re-entrant: this would deadlock if held
            mon.pool_put(1)
            with mon.dispatch_wait():
                mon.metrics()
                mon.postfix()

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(5.0)
    assert not thread.is_alive()


# -- the null object ------------------------------------------------------------------------------------------


def test_disabled_monitor_is_the_null_pipeline(monkeypatch):
    assert PipelineMonitor(slots=4, enabled=False) is NULL_PIPELINE
    assert isinstance(NULL_PIPELINE, NullPipeline)
    assert NULL_PIPELINE.enabled is False
    assert PipelineMonitor(slots=4, window_s=3.0, tolerance=0.5, enabled=False) is NULL_PIPELINE
    monkeypatch.setenv("STEPSCOPE", "0")
    assert PipelineMonitor(slots=4) is NULL_PIPELINE
    monkeypatch.setenv("STEPSCOPE", "1")
    assert isinstance(PipelineMonitor(slots=4, enabled=False), PipelineMonitor)


def test_enabled_cannot_be_given_by_position():
    # __new__ decides on the null object from `enabled`: by position it would be missed, so it is keyword-only.
    with pytest.raises(TypeError):
        PipelineMonitor(4, 10.0, None, 0.1, False)


def test_null_pipeline_methods_are_no_ops():
    mon = NULL_PIPELINE
    call = mon.infer(batch_size=8)
    assert mon.infer() is call
    assert mon.dispatch_wait() is call
    with mon.infer(batch_size=8) as inside:
        inside.samples = 3
    assert inside.samples == 0
    with pytest.raises(KeyError), mon.infer():
        raise KeyError("propagates")
    with mon.dispatch_wait():
        pass

    async def main():
        async with mon.infer(batch_size=2) as c:
            c.samples = 3
        async with mon.dispatch_wait():
            pass

    asyncio.run(main())
    assert mon.record_infer(1.0, 8) is None
    assert mon.record_infer(1.0, 8, ok=False, ended_ago_s=3.0) is None
    assert mon.pool_put(3) is None
    assert mon.pool_take(3) is None
    assert mon.pool_level(3) is None
    assert mon.train_step(8) is None
    assert mon.train_step(8, step_time=0.1) is None
    assert mon.snapshot() is None
    assert mon.history() == []
    assert mon.metrics() == {}
    assert mon.postfix() == ""
    assert mon.to_summary() == {}


def _null_loop(mon, n):
    for _ in itertools.repeat(None, n):
        with mon.infer(batch_size=8) as call:
            call.samples = 3
        with mon.dispatch_wait():
            pass
        mon.pool_put(8)
        mon.pool_take(8)
        mon.train_step(8)
        mon.record_infer(0.5, 8)


def test_null_pipeline_allocates_nothing_per_call():
    mon = PipelineMonitor(slots=4, enabled=False)
    grown = growth(lambda n: _null_loop(mon, n), 10_000)
    assert grown.grown_files == []
    assert grown.kept < 4096
    assert grown.peak < 4096  # 60k calls: one 16-byte block per call would be ~1 MB


# -- threads --------------------------------------------------------------------------------------------------


def test_thread_safety_under_contention():
    ticks = itertools.count()

    def clock():  # strictly increasing across threads: 1 ms per read
        return next(ticks) * 1e-3

    mon = PipelineMonitor(slots=8, window_s=10_000.0, clock=clock)
    per_thread, writers = 400, 8
    errors: list[BaseException] = []
    done = threading.Event()
    start = threading.Barrier(writers + 1)
    reads = [0]

    def writer():
        try:
            start.wait()
            for _ in range(per_thread):
                with mon.infer(batch_size=2):
                    pass
                mon.record_infer(0.001, 1)
                mon.pool_put(3)
                with mon.dispatch_wait():
                    pass
                mon.pool_take(3)
                mon.train_step(3, step_time=0.001)
        except BaseException as error:
            errors.append(error)

    def reader():
        try:
            start.wait()
            while not done.is_set():
                mon.snapshot()
                mon.metrics()
                mon.postfix()
                mon.history()
                reads[0] += 1
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=writer) for _ in range(writers)]
    observer = threading.Thread(target=reader)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show
    try:
        for thread in [*threads, observer]:
            thread.start()
        for thread in threads:
            thread.join(30)
        done.set()
        observer.join(30)
    finally:
        sys.setswitchinterval(switch)
    assert errors == []
    assert reads[0] > 0
    total = per_thread * writers
    snap = mon.snapshot()
    assert snap.samples_in == 3 * total
    assert snap.samples_out == 3 * total
    assert snap.pool == 0.0
    assert snap.infer_calls == 2 * total  # every timed call had a positive duration: the clock never stood still
    assert snap.infer_errors == 0
    assert snap.train_steps == total
    assert snap.train_capacity == approx(3 / 0.001)
    assert snap.inflow == approx(snap.thru)
    assert len(mon.history()) <= HISTORY_POINTS


# -- a real threaded pipeline ---------------------------------------------------------------------------------


def run_threaded(slots, call_s, batch, k, step_s, seconds=2.5, window_s=2.0):
    """``slots + 1`` engine threads behind a semaphore of ``slots``, each call sleeping ``call_s`` for ``batch``
    samples put into a queue (one item per call); a trainer taking ``k`` samples (``k`` a multiple of ``batch``) per
    step of ``step_s``. Snapshot after ``seconds``."""
    assert k % batch == 0
    mon = PipelineMonitor(slots=slots, window_s=window_s)
    pool: queue.Queue = queue.Queue()
    semaphore = threading.Semaphore(slots)
    stop = threading.Event()
    errors: list[BaseException] = []

    def engine_thread():
        try:
            while not stop.is_set():
                with semaphore, mon.infer(batch_size=batch):
                    time.sleep(call_s)
                pool.put([0] * batch)
                mon.pool_put(batch)
        except BaseException as error:
            errors.append(error)

    def trainer_thread():
        try:
            while not stop.is_set():
                got = 0
                with mon.dispatch_wait():
                    while got < k:
                        try:
                            got += len(pool.get(timeout=0.05))
                        except queue.Empty:
                            if stop.is_set():
                                return
                mon.pool_take(k)
                time.sleep(step_s)
                mon.train_step(k)  # the time since the previous step minus the wait
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=engine_thread, daemon=True) for _ in range(slots + 1)]
    threads.append(threading.Thread(target=trainer_thread, daemon=True))
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    snap = mon.snapshot()
    stop.set()
    for thread in threads:
        thread.join(5)
    assert errors == []
    return snap


def test_real_threaded_pipeline_inference_bound():
    # I = 2 slots × 8 / 0.08 s = 200/s; T = 8 / 0.02 s = 400/s
    snap = run_threaded(slots=2, call_s=0.08, batch=8, k=8, step_s=0.02)
    assert snap.bottleneck == "inference"
    assert snap.infer_capacity == pytest.approx(200.0, rel=0.25)
    assert snap.train_capacity == pytest.approx(400.0, rel=0.25)
    assert snap.thru == pytest.approx(200.0, rel=0.25)
    assert snap.infer_batch_time_s == pytest.approx(0.08, rel=0.25)
    assert snap.dispatch_wait_s > 0.01  # it waits ~20 ms for each batch of 8
    assert snap.pool < 4 * 8


def test_real_threaded_pipeline_training_bound():
    # I = 2 slots × 16 / 0.05 s = 640/s; T = 16 / 0.08 s = 200/s
    snap = run_threaded(slots=2, call_s=0.05, batch=16, k=16, step_s=0.08)
    assert snap.bottleneck == "training"
    assert snap.infer_capacity == pytest.approx(640.0, rel=0.25)
    assert snap.train_capacity == pytest.approx(200.0, rel=0.25)
    assert snap.thru == pytest.approx(200.0, rel=0.25)
    assert snap.inflow == pytest.approx(640.0, rel=0.25)  # the slots are kept busy
    assert snap.pool_trend == approx(snap.inflow - snap.thru)
    assert snap.dispatch_wait_s < 0.005
    assert snap.pool > 500


# -- the verdict's agreement checks (pure: verdict.decide) ---------------------------------------------------------


def starved(pool_trend: float | None, inflow: float | None = 100.0) -> PipelineSnapshot:
    """An inference-bound window (I=100 < T=400) with the given pool trend and inflow."""
    return PipelineSnapshot(
        window_s=WINDOW,
        slots=1,
        infer_capacity=100.0,
        train_capacity=400.0,
        dispatch_wait_s=0.1,
        pool=32,
        pool_trend=pool_trend,
        inflow=inflow,
        slot_busy=1.0,
        infer_calls=10,
        infer_errors=0,
        train_steps=10,
    )


@pytest.mark.parametrize(
    ("trend", "confidence"),
    [(0.0, "high"), (9.9, "high"), (-9.9, "high"), (10.1, "medium"), (None, "high")],
)
def test_a_pool_trend_within_a_tenth_of_the_inflow_is_not_filling(trend, confidence):
    # A batch or two more in the pool at the window's edge is not the pool filling: inference stays high-confidence.
    verdict = decide(starved(trend), tolerance=0.1, wait_share=0.5)
    assert (verdict.bottleneck, verdict.confidence) == ("inference", confidence)


@pytest.mark.parametrize(("trend", "confidence"), [(-9.9, "high"), (-10.1, "medium"), (50.0, "high")])
def test_a_draining_pool_contradicts_a_training_bound_verdict(trend, confidence):
    snap = starved(trend)
    snap.infer_capacity, snap.train_capacity = 400.0, 100.0
    verdict = decide(snap, tolerance=0.1, wait_share=0.0)
    assert (verdict.bottleneck, verdict.confidence) == ("training", confidence)


def test_a_warming_up_scope_still_shows_the_linked_pipelines_metrics():
    clock = Clock(1.0)
    scope = fake_scope(clock, warmup=5)
    mon = PipelineMonitor(slots=2, window_s=WINDOW, scope=scope, clock=clock)
    for _ in range(3):
        with mon.infer(batch_size=8):
            clock.advance(0.5)
        mon.pool_put(8)
    metrics = scope.metrics()
    assert "perf/step_time" not in metrics  # no measured step yet
    assert metrics["perf/infer_capacity"] == approx(32.0) and metrics["perf/pool"] == 24.0
    assert Scope(warmup=5, system_interval_s=None).metrics() == {}
