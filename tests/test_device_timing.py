"""Device timing through the EventSource seam: deferred, out-of-order harvesting, no sync in the loop, bounded."""

import io

import pytest
import torch

from stepscope import Scope
from stepscope.clock import HOST_ONLY, DeviceTimer


def approx(value):
    return pytest.approx(value, rel=1e-9, abs=1e-12)


def cuda_scope(clock, events, **kwargs):
    kwargs.setdefault("warmup", 0)
    kwargs.setdefault("window", 10)
    return Scope(clock=clock, events=events, timing="cuda", **kwargs)


def gpu_step(scope, clock, events, forward_gpu_ms, backward_gpu_ms, batch_size=4):
    """One step: forward (2 ms host, forward_gpu_ms on the GPU), backward (3 ms host, backward_gpu_ms on the GPU).

    Returns the events this step recorded, so the test can complete them whenever it likes."""
    with scope.phase("forward"):
        clock.advance(2)
        events.run(forward_gpu_ms)
    with scope.phase("backward"):
        clock.advance(3)
        events.run(backward_gpu_ms)
    scope.step(batch_size=batch_size)
    return events.take_recorded()


def records_by_index(scope):
    return {r.index: r for r in scope._recorder.recent}


def test_device_time_per_phase_in_summary(clock, events):
    scope = cuda_scope(clock, events)
    for f in (4, 6, 8, 10):
        gpu_step(scope, clock, events, f, 2 * f)
    s = scope.summary()
    assert s.meta.timing == "cuda"
    fwd, bwd = s.phases["forward"], s.phases["backward"]
    # forward on the GPU: 4 6 8 10 ms -> mean 7, median 7, p95 at rank 2.85 -> 8 + 0.85 * 2 = 9.7
    assert (fwd.device_mean_ms, fwd.device_median_ms, fwd.device_p95_ms) == (approx(7), approx(7), approx(9.7))
    assert (bwd.device_mean_ms, bwd.device_median_ms, bwd.device_p95_ms) == (approx(14), approx(14), approx(19.4))
    # host figures are the host clock's: 2 ms and 3 ms, 5 ms steps
    assert fwd.mean_ms == approx(2)
    assert bwd.mean_ms == approx(3)
    assert s.phases["total"].mean_ms == approx(5)
    # The host queued each step in 5 ms and the GPU took 3f ms (12, 18, 24, 30: first event to last): the host ran
    # ahead, so the step's pace is the GPU's, 84 ms over 4 steps, and the device shares are of that.
    assert fwd.device_share == approx(28 / 84)
    assert bwd.device_share == approx(56 / 84)
    assert s.throughput.step_time_ms == approx(21) and s.throughput.gpu_excess_ms == approx(16)
    assert s.throughput.steps_per_s == approx(4 / 0.084)
    assert s.throughput.samples_per_s == approx(16 / 0.084)
    assert s.series.step_ms == [approx(12), approx(18), approx(24), approx(30)]
    assert s.wall.steps_s == approx(0.084) and s.wall.window_s == approx(0.084)
    assert any("the host ran ahead of the GPU" in note for note in s.notes), s.notes
    assert s.invariants == []
    # phases without events carry no device figures
    assert s.phases["other"].device_mean_ms is None
    assert s.phases["total"].device_mean_ms is None


def test_auto_timing_uses_the_given_events(clock, events):
    scope = Scope(clock=clock, events=events, warmup=0)  # timing="auto"
    gpu_step(scope, clock, events, 5, 9)
    s = scope.summary()
    assert s.meta.timing == "cuda"
    assert s.phases["forward"].device_mean_ms == approx(5)
    assert s.phases["backward"].device_mean_ms == approx(9)


def test_host_timing_ignores_the_events(clock, events):
    scope = Scope(clock=clock, events=events, warmup=0, timing="host")
    gpu_step(scope, clock, events, 5, 9)
    s = scope.summary()
    assert s.meta.timing == "host"
    assert events.created == 0
    assert s.phases["forward"].device_mean_ms is None


def test_no_events_during_warmup(clock, events):
    scope = cuda_scope(clock, events, warmup=3)
    for _ in range(3):
        gpu_step(scope, clock, events, 100, 100)
    assert events.created == 0
    gpu_step(scope, clock, events, 5, 9)
    assert events.created == 4
    s = scope.summary()
    assert s.steps.measured == 1
    assert s.phases["forward"].device_mean_ms == approx(5)


def test_events_completing_later_are_harvested_at_later_steps(clock, events):
    scope = cuda_scope(clock, events)
    step1 = gpu_step(scope, clock, events, 4, 8)
    step2 = gpu_step(scope, clock, events, 6, 12)
    m = scope.metrics()
    assert "perf/compute_time" not in m  # nothing harvested yet
    assert m["perf/step_time"] == approx(0.005)

    events.complete(step1)
    step3 = gpu_step(scope, clock, events, 8, 16)  # harvests step 1 when it closes
    assert scope.metrics()["perf/compute_time"] == approx(0.012)

    events.complete(step2 + step3)
    gpu_step(scope, clock, events, 10, 20)  # harvests steps 2 and 3
    assert scope.metrics()["perf/compute_time"] == approx((0.012 + 0.018 + 0.024) / 3)
    assert events.syncs == 0

    s = scope.summary()  # step 4 still in flight: one sync
    assert events.syncs == 1
    assert s.phases["forward"].device_mean_ms == approx(7)
    assert s.phases["backward"].device_mean_ms == approx(14)


def test_out_of_order_completion_goes_to_the_right_step(clock, events):
    scope = cuda_scope(clock, events)
    step1 = gpu_step(scope, clock, events, 3, 11)
    step2 = gpu_step(scope, clock, events, 7, 13)
    events.complete(step2)  # step 2 finishes first (another stream)
    gpu_step(scope, clock, events, 5, 17)

    records = records_by_index(scope)
    assert records[0].device_s is None  # step 1 is still in flight: nothing may be attributed to it
    # step 2 may be harvested now (any order) or wait for step 1 (oldest first); never with other figures
    assert records[1].device_s in (None, {"forward": approx(0.007), "backward": approx(0.013)})
    assert records[2].device_s is None
    assert scope.metrics().get("perf/compute_time", 0.020) == approx(0.020)

    events.complete(step1)
    gpu_step(scope, clock, events, 9, 19)  # harvests steps 1 and 2
    records = records_by_index(scope)
    assert records[0].device_s == {"forward": approx(0.003), "backward": approx(0.011)}
    assert records[1].device_s == {"forward": approx(0.007), "backward": approx(0.013)}
    assert records[2].device_s is None
    assert records[3].device_s is None
    assert scope.metrics()["perf/compute_time"] == approx((0.014 + 0.020) / 2)
    assert events.syncs == 0

    s = scope.summary()
    assert events.syncs == 1
    records = records_by_index(scope)
    assert records[2].device_s == {"forward": approx(0.005), "backward": approx(0.017)}
    assert records[3].device_s == {"forward": approx(0.009), "backward": approx(0.019)}
    assert s.phases["forward"].device_mean_ms == approx((3 + 7 + 5 + 9) / 4)
    assert s.phases["backward"].device_mean_ms == approx((11 + 13 + 17 + 19) / 4)


def test_compute_time_excludes_data_wait_and_nested_phases(clock, events):
    scope = cuda_scope(clock, events)
    for _ in range(2):
        with scope.phase("data_wait"):
            events.run(1)
        with scope.phase("forward"):
            events.run(4)
            with scope.phase("attention"):
                events.run(3)
        with scope.phase("optimizer"):
            events.run(2)
        scope.step()
        events.complete(events.take_recorded())
    # step 1 harvested when step 2 closed: forward 7 (includes attention) + optimizer 2
    assert scope.metrics()["perf/compute_time"] == approx(0.009)
    s = scope.summary()
    assert s.phases["attention"].device_mean_ms == approx(3)
    assert s.phases["forward"].device_mean_ms == approx(7)
    assert s.phases["data_wait"].device_mean_ms == approx(1)


def test_no_synchronize_inside_the_loop_and_at_most_one_in_summary(clock, events):
    scope = cuda_scope(clock, events)
    for k in range(50):
        gpu_step(scope, clock, events, 1 + k % 3, 2)
    assert events.syncs == 0
    assert events.queries > 0  # it polled, it did not wait
    s = scope.summary()
    assert events.syncs == 1
    assert s.phases["forward"].device_mean_ms == approx((17 * 1 + 17 * 2 + 16 * 3) / 50)
    scope.summary()
    scope.print_table(file=io.StringIO())
    assert events.syncs == 1  # nothing left in flight


def test_summary_does_not_synchronize_when_nothing_is_pending(clock, events):
    scope = cuda_scope(clock, events)
    for f in (2, 4, 6):
        events.complete(gpu_step(scope, clock, events, f, 1))
    scope.step()  # a step with no phases: records no events, but harvests step 3
    assert scope._device.pending_steps == 0
    s = scope.summary()
    assert events.syncs == 0
    assert s.phases["forward"].device_mean_ms == approx(4)


def test_scope_drops_steps_beyond_max_pending_and_says_so(clock, events):
    scope = cuda_scope(clock, events)  # DeviceTimer default: 256 pending steps
    for k in range(1, 301):
        gpu_step(scope, clock, events, k, 1)
    assert events.syncs == 0
    s = scope.summary()
    assert s.steps.measured == 300
    assert any("device time missing for 44 step(s)" in note for note in s.notes)
    # the oldest 44 steps were dropped: device mean over steps 45..300
    assert s.phases["forward"].device_mean_ms == approx((45 + 300) / 2)
    # 256 pending steps of 4 events; the dropped steps' events were reused
    assert events.created == 257 * 4


def test_scope_recycles_events(clock, events):
    scope = cuda_scope(clock, events)
    for _ in range(20):
        events.complete(gpu_step(scope, clock, events, 2, 4))
    # step 1 creates 4, step 2 creates 4 (step 1 is harvested as step 2 closes); from then on the pool suffices
    assert events.created == 8


# -- DeviceTimer directly -------------------------------------------------------------------------------------


def timer_step(timer, events, token, gpu_ms):
    start = timer.start()
    events.run(gpu_ms)
    timer.stop("forward", start)
    timer.close_step(token)
    return events.take_recorded()


def test_device_timer_out_of_order(events):
    timer = DeviceTimer(events)
    first = timer_step(timer, events, "s1", 3)
    second = timer_step(timer, events, "s2", 7)
    assert timer.pending_steps == 2
    assert timer.harvest() == []
    events.complete(second)
    early = timer.harvest()
    # s2 either comes out now or waits for s1; s1 cannot come out before it completes
    assert early in ([], [("s2", {"forward": approx(0.007)}, approx(0.007), None, None)])
    assert timer.pending_steps == 2 - len(early)
    events.complete(first)
    late = timer.harvest()
    harvested = {done.token: done.seconds for done in early + late}
    assert len(early + late) == 2
    assert harvested == {"s1": {"forward": approx(0.003)}, "s2": {"forward": approx(0.007)}}
    assert timer.pending_steps == 0
    assert timer.harvest() == []
    assert events.syncs == 0


def test_device_timer_harvest_stops_at_the_first_step_in_flight(events):
    # DeviceTimer.harvest: "returns ... for the oldest pending steps whose events have all completed" and costs
    # O(completed + 1) queries however far the host runs ahead: with 50 steps in flight, one query suffices.
    timer = DeviceTimer(events)
    for k in range(50):
        timer_step(timer, events, k, 1)
    events.queries = 0
    assert timer.harvest() == []
    assert events.queries <= 2
    assert timer.pending_steps == 50


def test_host_only_timer_records_and_harvests_nothing():
    assert HOST_ONLY.start() is None
    assert HOST_ONLY.stop("forward", None) is None
    assert HOST_ONLY.close_step("token") is None
    assert HOST_ONLY.pending_steps == 0
    assert HOST_ONLY.dropped_steps == 0
    assert HOST_ONLY.harvest() == []
    assert HOST_ONLY.drain() == []


def timer_two_phases(timer, events, token, forward_ms, backward_ms):
    """One step of a forward and a backward on the timer itself; returns the events it recorded."""
    for phase, gpu_ms in (("forward", forward_ms), ("backward", backward_ms)):
        start = timer.start()
        events.run(gpu_ms)
        timer.stop(phase, start)
    timer.close_step(token)
    return events.take_recorded()


def test_device_timer_partial_step_waits_for_all_its_events(events):
    timer = DeviceTimer(events)
    recorded = timer_two_phases(timer, events, "s1", 2, 5)
    events.complete(recorded[:2])  # forward done, backward still running
    assert timer.harvest() == []
    events.complete(recorded[2:])
    # the step's span on the GPU runs from the forward's first event to the backward's last
    assert timer.harvest() == [("s1", {"forward": approx(0.002), "backward": approx(0.005)}, approx(0.007), None, None)]


def test_device_timer_sums_a_phase_recorded_twice(events):
    timer = DeviceTimer(events)
    for gpu_ms in (2, 3):
        start = timer.start()
        events.run(gpu_ms)
        timer.stop("forward", start)
    timer.close_step("s1")
    assert timer.drain() == [("s1", {"forward": approx(0.005)}, approx(0.005), None, None)]
    assert events.syncs == 1


def test_device_timer_step_without_intervals_is_not_pending(events):
    timer = DeviceTimer(events)
    timer.close_step("empty")
    assert timer.pending_steps == 0
    assert timer.drain() == []
    assert events.syncs == 0


def test_device_timer_bounds_pending_steps_and_recycles_events(events):
    timer = DeviceTimer(events, max_pending_steps=4)
    for k in range(10):
        timer_step(timer, events, k, 1 + k)
    assert timer.pending_steps == 4
    assert timer.dropped_steps == 6
    # steps 0..4 each made 2 events; closing step 4 dropped step 0 and its events served step 5, and so on
    assert events.created == 10
    events.complete_all()
    done = timer.harvest()
    assert [token for token, *_ in done] == [6, 7, 8, 9]
    assert [step.seconds["forward"] for step in done] == [approx(0.007), approx(0.008), approx(0.009), approx(0.01)]
    for k in range(10, 15):
        events.complete(timer_step(timer, events, k, 1))
        assert timer.harvest() == [(k, {"forward": approx(0.001)}, approx(0.001), None, None)]
    assert events.created == 10  # the pool stopped new_event from growing
    assert timer.dropped_steps == 6
    assert events.syncs == 0


def test_device_timer_drain_synchronizes_once(events):
    timer = DeviceTimer(events)
    for k in range(3):
        timer_step(timer, events, k, 2)
    done = timer.drain()
    assert events.syncs == 1
    assert [token for token, *_ in done] == [0, 1, 2]
    assert timer.pending_steps == 0
    assert timer.drain() == []
    assert events.syncs == 1


# -- configuration --------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_timing_without_events_or_cuda_raises(clock):
    with pytest.raises(ValueError, match=r"timing='cuda' needs a CUDA device.*use timing='auto' or 'host'"):
        Scope(clock=clock, timing="cuda")


# -- the step's pace where the host runs ahead of the GPU ------------------------------------------------------


def paced_steps(scope, clock, events, host_ms, gpu_ms, batch_size=8):
    """Steps that never wait for the GPU: each queues its forward and backward in ``host_ms`` of host time while
    the GPU runs them in ``gpu_ms`` (a list, one value a step)."""
    for host, gpu in zip(host_ms, gpu_ms, strict=True):
        with scope.phase("forward"):
            clock.advance(0.4 * host)
            events.run(0.4 * gpu)
        with scope.phase("backward"):
            clock.advance(0.6 * host)
            events.run(0.6 * gpu)
        scope.step(batch_size=batch_size)


def test_a_loop_that_never_waits_for_the_gpu_is_timed_at_the_gpus_pace(clock, events):
    # The host queues a step in 1 ms, the GPU runs it in 10 ms: 20 steps take the GPU 200 ms, not the host's 20 ms.
    scope = cuda_scope(clock, events)
    paced_steps(scope, clock, events, [1] * 20, [10] * 20)
    s = scope.summary()
    assert s.phases["total"].mean_ms == approx(1)  # the host's time to queue a step
    assert s.throughput.step_time_ms == approx(10) and s.throughput.gpu_excess_ms == approx(9)
    assert s.throughput.steps_per_s == approx(100) and s.throughput.samples_per_s == approx(800)
    assert s.wall.window_s == approx(0.2) and s.throughput.wall_steps_per_s == approx(100)
    assert s.series.step_ms == [approx(10)] * 20
    assert s.phases["forward"].device_share == approx(0.4) and s.phases["backward"].device_share == approx(0.6)
    assert s.verdict.bound == "compute", s.verdict
    assert any("the host ran ahead of the GPU" in note for note in s.notes), s.notes
    assert s.invariants == [], s.invariants


def test_a_gpu_that_keeps_up_leaves_the_host_figures_as_they_are(clock, events):
    scope = cuda_scope(clock, events)
    paced_steps(scope, clock, events, [5] * 10, [2] * 10)
    s = scope.summary()
    assert s.throughput.step_time_ms == approx(5) and s.throughput.gpu_excess_ms is None
    assert s.throughput.steps_per_s == approx(200)
    assert s.series.step_ms == [approx(5)] * 10
    assert not any("ran ahead" in note for note in s.notes)


def test_a_full_launch_queue_adds_no_time_for_the_jitter_between_host_and_gpu(clock, events):
    # Once CUDA's launch queue is full the host waits in its launches and keeps the GPU's pace: step by step the
    # two differ by jitter alone (here ±1 ms, alternating), and the mean pace is the host's 10 ms. Taking the larger
    # of the two each step would read 11 ms.
    scope = cuda_scope(clock, events)
    host = [10 + (1 if k % 2 else -1) for k in range(40)]
    gpu = [10 + (-1 if k % 2 else 1) for k in range(40)]
    paced_steps(scope, clock, events, host, gpu)
    s = scope.summary()
    assert s.throughput.step_time_ms == pytest.approx(10, rel=0.01)
    assert not any("ran ahead" in note for note in s.notes)


def test_the_gpu_catching_up_gives_back_what_the_host_got_ahead(clock, events):
    # 10 steps where the GPU is the slower (1 ms host, 5 ms GPU), then 10 where the host is (9 ms host, 1 ms GPU):
    # the GPU's backlog of 40 ms drains over the second half, so the whole window is the host's 100 ms, and each
    # step of the series still has a non-negative time that adds up to it.
    scope = cuda_scope(clock, events)
    paced_steps(scope, clock, events, [1] * 10 + [9] * 10, [5] * 10 + [1] * 10)
    s = scope.summary()
    assert s.throughput.step_time_ms == approx(5) and s.throughput.gpu_excess_ms is None
    assert sum(s.series.step_ms) == approx(100) and min(s.series.step_ms) >= 0
    assert s.series.step_ms[:10] == [approx(5)] * 10  # while the GPU was behind, its pace


def test_series_points_take_time_added_after_their_steps():
    from stepscope.record import SeriesBuilder

    series = SeriesBuilder(points=2)
    for _ in range(5):
        series.add(1_000_000)  # 1 ms steps: 4 points merge into 2 of stride 2, then one step pending
    series.add_late(0, 2_000_000)  # the first step, now in the first point
    series.add_late(4, 1_000_000)  # the pending step
    got = series.series()
    assert got.stride == 2 and got.step_ms == [approx(2), approx(1), approx(2)]


def test_on_one_stream_a_step_is_complete_once_its_last_event_is(events):
    # A stream runs its work in order: the last event of a step completing means every earlier one did. One query
    # a step instead of two per phase; a source that used several streams (or cannot tell) is asked about each.
    events.single_stream = True
    timer = DeviceTimer(events)
    for k in range(5):
        timer_two_phases(timer, events, k, 1, 2)
    events.complete_all()
    events.queries = 0
    done = timer.harvest()
    assert [h.token for h in done] == [0, 1, 2, 3, 4] and events.queries == 5
    assert done[0].seconds == {"forward": approx(0.001), "backward": approx(0.002)}

    events.single_stream = False
    for k in range(5):
        timer_step(timer, events, k, 1)
    events.complete_all()
    events.queries = 0
    assert len(timer.harvest()) == 5 and events.queries == 10


# -- where the GPU only follows the host ----------------------------------------------------------------------


class QueueEvent:
    def __init__(self, gpu):
        self.gpu = gpu
        self.at_ns = None

    def record(self):
        self.gpu.record(self)

    def query(self):
        return self.at_ns is not None and self.at_ns <= self.gpu.clock.ns

    def elapsed_time(self, end):
        if not (self.query() and end.query()):
            raise RuntimeError("elapsed_time on an event that has not completed")
        return (end.at_ns - self.at_ns) / 1e6


class QueueGpu:
    """One stream on the host's fake clock: the GPU runs what was launched in order and reaches an event once it
    finished the work before it and the host recorded it; an event is complete once the clock passed that time.
    ``launch(ms)`` queues work; with ``queue_ms`` the host blocks in a launch while the GPU is further behind than
    that (CUDA's launch queue is full). ``synchronize`` waits for the GPU on the host's clock."""

    single_stream = True

    def __init__(self, clock, queue_ms=None):
        self.clock = clock
        self.free_ns = 0
        self.queue_ns = None if queue_ms is None else round(queue_ms * 1e6)

    def new_event(self):
        return QueueEvent(self)

    def record(self, event):
        self._wait_for_room()
        event.at_ns = self.free_ns = max(self.free_ns, self.clock.ns)

    def launch(self, ms):
        self._wait_for_room()
        self.free_ns = max(self.free_ns, self.clock.ns) + round(ms * 1e6)

    def _wait_for_room(self):
        if self.queue_ns is not None and self.free_ns - self.clock.ns > self.queue_ns:
            self.clock.ns = self.free_ns - self.queue_ns

    def synchronize(self):
        self.clock.ns = max(self.clock.ns, self.free_ns)


def queue_step(scope, clock, gpu, phases, sync=False):
    """One step of (phase, host ms before its launch, GPU ms launched, host ms after it) with a 2 ms data wait
    first, and the loss read (a sync) last when ``sync``."""
    with scope.phase("data_wait"):
        clock.advance(2)
    for name, host_before_ms, gpu_ms, host_after_ms in phases:
        with scope.phase(name):
            clock.advance(host_before_ms)
            gpu.launch(gpu_ms)
            clock.advance(host_after_ms)
    if sync:
        with scope.phase("sync"):
            gpu.synchronize()
    scope.step(batch_size=8)


def test_a_phase_whose_gpu_only_followed_the_host_is_host_time(clock):
    # A forward that sleeps 3 ms on the host around a 0.05 ms layer (prefetch_thread.py's with a device): the GPU is
    # idle between the phase's events, so they span the host's 3 ms. Read as GPU work it made the step compute-bound
    # ("forward is 40% GPU time") where a faster GPU would save nothing. No sync: the steps' last events had
    # completed when they were harvested, which bounds the lag.
    gpu = QueueGpu(clock)
    scope = cuda_scope(clock, gpu)
    for _ in range(20):
        queue_step(
            scope, clock, gpu, [("forward", 1.5, 0.05, 1.5), ("backward", 0.5, 0.15, 0), ("optimizer", 0.2, 0.01, 0.2)]
        )
    s = scope.summary()
    forward = s.phases["forward"]
    assert forward.device_mean_ms == pytest.approx(3.0)  # the span between its events, as measured
    assert forward.device_host_paced == approx(1.0) and s.phases["optimizer"].device_host_paced == approx(1.0)
    # the backward's last 0.15 ms of work ran after the host ended it (FOLLOW_NS is 0.1 ms): its span is GPU work
    assert s.phases["backward"].device_host_paced == 0.0
    assert forward.gpu_work_share() == approx(0.0)
    assert s.verdict.bound == "host", s.verdict
    assert any("forward: the GPU kept up with the host's launches (100% of its 3.0 ms" in e for e in s.verdict.evidence)
    assert any("forward's GPU time (3.00 ms) is mostly the host's" in note for note in s.notes), s.notes
    assert s.invariants == []


def test_without_a_sync_or_a_done_last_event_no_step_is_probed(clock):
    # The same forward, but the optimizer's 0.5 ms of work still runs when the step closes and nothing syncs: no
    # event's lag is known, so nothing is said and the spans stay GPU time (the figures as they were).
    gpu = QueueGpu(clock)
    scope = cuda_scope(clock, gpu)
    for _ in range(20):
        queue_step(scope, clock, gpu, [("forward", 1.5, 0.05, 1.5), ("optimizer", 0.2, 0.5, 0)])
    s = scope.summary()
    assert all(stats.device_host_paced is None for stats in s.phases.values())
    assert s.phases["forward"].gpu_work_share() == s.phases["forward"].device_share


def test_gpu_work_the_host_waits_for_at_a_sync_stays_gpu_time(clock):
    # The host launches 10 + 20 ms of GPU work in 2 ms and waits for it in the loss's sync: the forward and backward
    # end far behind the host, so their spans are GPU work. The sync's events span nothing: nothing to judge.
    gpu = QueueGpu(clock)
    scope = cuda_scope(clock, gpu)
    for _ in range(12):
        queue_step(scope, clock, gpu, [("forward", 0, 10, 1), ("backward", 0, 20, 1)], sync=True)
    s = scope.summary()
    assert s.phases["forward"].device_mean_ms == approx(10) and s.phases["backward"].device_mean_ms == approx(20)
    assert s.phases["forward"].device_host_paced == 0.0 and s.phases["backward"].device_host_paced == 0.0
    assert s.phases["sync"].device_mean_ms == 0.0 and s.phases["sync"].device_host_paced is None
    assert s.verdict.bound == "compute", s.verdict
    assert not any("mostly the host's" in note for note in s.notes), s.notes


def test_a_sync_tells_a_host_phase_from_a_gpu_phase_in_the_same_step(clock):
    # The forward sleeps 3 ms around a tiny layer (the GPU follows); the backward launches 8 ms of work in 1 ms,
    # waited for at the sync; the optimizer's 2 ms of work after it still runs when the step closes. The sync's end
    # bounds every lag: forward is host time, backward and optimizer GPU work.
    gpu = QueueGpu(clock)
    scope = cuda_scope(clock, gpu)
    for _ in range(12):
        with scope.phase("data_wait"):
            clock.advance(2)
        for name, host_before_ms, gpu_ms, host_after_ms in (("forward", 1.5, 0.05, 1.5), ("backward", 1, 8, 0)):
            with scope.phase(name):
                clock.advance(host_before_ms)
                gpu.launch(gpu_ms)
                clock.advance(host_after_ms)
        with scope.phase("sync"):
            gpu.synchronize()
        with scope.phase("optimizer"):
            clock.advance(0.2)
            gpu.launch(2)
        scope.step(batch_size=8)
    s = scope.summary()
    forward, backward, optimizer = s.phases["forward"], s.phases["backward"], s.phases["optimizer"]
    assert forward.device_host_paced == approx(1.0)
    assert backward.device_host_paced == 0.0 and optimizer.device_host_paced == 0.0
    assert s.verdict.bound == "compute", s.verdict
    assert not any(line.startswith("forward is") for line in s.verdict.evidence), s.verdict.evidence


def test_a_full_launch_queue_is_never_read_as_the_gpu_following_the_host(clock):
    # Host 1 ms a step, GPU 10 ms, no sync: once the launch queue is full the host waits in its launches and the
    # events span what the host spans, as where the GPU follows the host. But the GPU is far behind the host, so
    # no step's last event has completed when it is harvested: no step is probed, and the GPU work stays GPU work.
    gpu = QueueGpu(clock, queue_ms=30)
    scope = cuda_scope(clock, gpu)
    for _ in range(40):
        queue_step(scope, clock, gpu, [("forward", 0.2, 4, 0), ("backward", 0.3, 6, 0)])
    s = scope.summary()
    assert s.phases["forward"].device_host_paced is None and s.phases["backward"].device_host_paced is None
    assert s.verdict.bound == "compute", s.verdict
    assert s.throughput.step_time_ms == pytest.approx(10, rel=0.1)


def test_the_probe_reads_each_phases_lag_behind_the_host_exactly(clock):
    # Straight on the timer, an idle GPU: phase a's work ends 0.05 ms after the host ends a, b's 0.15 ms after b
    # (FOLLOW_NS is 0.1 ms), and c has no work (the GPU catches up). Every PROBE_EVERY-th harvested step is probed.
    from stepscope.clock import FOLLOW_NS, PROBE_EVERY

    assert FOLLOW_NS == 100_000
    gpu = QueueGpu(clock)
    timer = DeviceTimer(gpu, clock=clock)
    harvested = []
    for k in range(2 * PROBE_EVERY):
        for phase, gpu_ms, host_ms in (("a", 1.05, 1.0), ("b", 1.0, 0.9), ("c", 0.0, 0.5)):
            start = timer.start()
            gpu.launch(gpu_ms)
            clock.advance(host_ms)
            timer.stop(phase, start)
        timer.close_step(k)
        harvested += timer.harvest()
    probed = {done.token: done for done in harvested if done.judged_s is not None}
    assert list(probed) == [0, PROBE_EVERY]
    spans = {"a": approx(0.00105), "b": approx(0.001), "c": approx(0.00035)}
    assert probed[0].seconds == spans and probed[0].judged_s == spans
    assert probed[0].followed_s == {"a": approx(0.00105), "c": approx(0.00035)}
