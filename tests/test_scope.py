"""Scope with a fake clock: every figure below is computed by hand from the durations the test advances."""

import io
import logging
import time

import pytest
from conftest import FakeClock

from stepscope import Scope
from stepscope.scope import NO_COLLECTORS


def ms(seconds):
    return seconds * 1e3


def approx(value):
    return pytest.approx(value, rel=1e-9, abs=1e-9)


def run_steps(scope, clock, forward_ms, *, warmup_forward_ms=(), batch_size=32):
    """Warm-up steps with huge durations (they must not show), then steps of forward f, backward 2f, optimizer 5,
    and 1 ms outside any phase."""
    for f in [*warmup_forward_ms, *forward_ms]:
        with scope.phase("forward"):
            clock.advance(f)
        with scope.phase("backward"):
            clock.advance(2 * f)
        with scope.phase("optimizer"):
            clock.advance(5)
        clock.advance(1)
        scope.step(batch_size=batch_size)


# -- per-phase statistics -------------------------------------------------------------------------------------


def test_phase_statistics_hand_computed(clock):
    scope = Scope(clock=clock, warmup=2, timing="host")
    run_steps(scope, clock, [10, 20, 30, 40, 50], warmup_forward_ms=[1000, 900])
    s = scope.summary()

    assert list(s.phases) == ["forward", "backward", "optimizer", "other", "total"]
    # forward: 10 20 30 40 50 -> mean 30, median 30, p95 at rank 0.95*4 = 3.8 -> 40 + 0.8*10 = 48
    fwd = s.phases["forward"]
    assert (fwd.mean_ms, fwd.median_ms, fwd.p95_ms) == (approx(30), approx(30), approx(48))
    assert fwd.steps == 5
    assert fwd.nested is False
    # step times 3f + 6: 36 66 96 126 156, sum 480
    assert fwd.share == approx(150 / 480)
    bwd = s.phases["backward"]
    assert (bwd.mean_ms, bwd.median_ms, bwd.p95_ms, bwd.share) == (
        approx(60),
        approx(60),
        approx(96),
        approx(300 / 480),
    )
    opt = s.phases["optimizer"]
    assert (opt.mean_ms, opt.median_ms, opt.p95_ms, opt.share) == (approx(5), approx(5), approx(5), approx(25 / 480))
    other = s.phases["other"]
    assert (other.mean_ms, other.median_ms, other.p95_ms, other.share) == (
        approx(1),
        approx(1),
        approx(1),
        approx(5 / 480),
    )
    total = s.phases["total"]
    assert (total.mean_ms, total.median_ms, total.p95_ms) == (approx(96), approx(96), approx(150))
    assert total.share == 1.0
    assert total.steps == 5
    assert sum(p.share for n, p in s.phases.items() if n != "total") == approx(1.0)
    # host-timed: no device figures
    assert fwd.device_mean_ms is None and fwd.device_share is None
    assert s.meta.timing == "host"
    assert s.meta.device == "cpu"


def test_throughput_and_warmup_steps(clock):
    scope = Scope(clock=clock, warmup=2, timing="host")
    run_steps(scope, clock, [10, 20, 30, 40, 50], warmup_forward_ms=[1000, 900])
    s = scope.summary()
    assert s.steps.warmup == 2
    assert s.steps.measured == 5
    # 5 steps in 0.480 s; 5 * 32 samples in 0.480 s
    assert s.throughput.steps_per_s == approx(5 / 0.480)
    assert s.throughput.samples_per_s == approx(160 / 0.480)
    assert s.throughput.step_time_ms == approx(96)


def test_samples_per_s_counts_only_steps_with_a_batch_size(clock):
    scope = Scope(clock=clock, warmup=0, timing="host")
    for batch in (10, None, 30):
        with scope.phase("forward"):
            clock.advance(100)
        scope.step(batch_size=batch)
    s = scope.summary()
    assert s.throughput.steps_per_s == approx(3 / 0.3)
    assert s.throughput.samples_per_s == approx(20 * 3 / 0.3)  # 20 samples a sampled step, at every step's pace


def test_samples_per_s_is_the_sampled_steps_batch_at_every_steps_pace(clock):
    # A loader cycled by itertools.cycle fetches (and reports a batch) in its first pass only, and those steps are
    # the slow ones: the others process a batch as large, faster. Read as the rate of the sampled steps' own time,
    # 8 samples in 100 ms, it was 80 samples/s against the 128 the steps processed.
    scope = Scope(clock=clock, warmup=0, timing="host")
    for batch, ms in ((8, 100), (None, 50), (None, 50), (None, 50)):
        with scope.phase("forward"):
            clock.advance(ms)
        scope.step(batch_size=batch)
    s = scope.summary()
    assert s.throughput.steps_per_s == approx(4 / 0.25)
    assert s.throughput.samples_per_s == approx(8 * 4 / 0.25)


def test_samples_per_s_takes_the_warm_ups_batch_when_no_measured_step_reported_one(clock):
    # A cycled loader whose only pass ended in the warm-up: every measured step replays a kept batch of 8.
    scope = Scope(clock=clock, warmup=2, timing="host")
    for batch in (8, 8, None, None):
        with scope.phase("forward"):
            clock.advance(50)
        scope.step(batch_size=batch)
    assert scope.summary().throughput.samples_per_s == approx(8 * 2 / 0.1)


def test_samples_per_s_is_none_without_batch_size(clock):
    scope = Scope(clock=clock, warmup=0, timing="host")
    for _ in range(3):
        with scope.phase("forward"):
            clock.advance(20)
        scope.step()
    s = scope.summary()
    assert s.throughput.samples_per_s is None
    assert s.throughput.steps_per_s == approx(50.0)


def test_warmup_steps_are_excluded(clock):
    scope = Scope(clock=clock, warmup=3, timing="host")
    for f in (500, 400, 300, 10, 10):
        with scope.phase("forward"):
            clock.advance(f)
        scope.step()
    s = scope.summary()
    assert s.steps.warmup == 3
    assert s.steps.measured == 2
    assert s.phases["forward"].mean_ms == approx(10)
    assert s.phases["forward"].steps == 2
    assert s.phases["total"].mean_ms == approx(10)


def test_nested_phases(clock):
    scope = Scope(clock=clock, warmup=0, timing="host")
    for _ in range(3):
        with scope.phase("forward"):
            clock.advance(6)
            with scope.phase("attention"):  # custom, nested
                clock.advance(4)
        with scope.phase("backward"):
            clock.advance(17)
            with scope.phase("sync"):  # canonical, nested
                clock.advance(3)
        clock.advance(2)
        scope.step()
    s = scope.summary()
    # canonical (in canonical order), then custom, then other
    assert list(s.phases) == ["forward", "backward", "sync", "attention", "other", "total"]
    assert s.phases["forward"].mean_ms == approx(10)  # parent includes its child
    assert s.phases["backward"].mean_ms == approx(20)
    assert s.phases["attention"].mean_ms == approx(4)
    assert s.phases["sync"].mean_ms == approx(3)
    assert s.phases["total"].mean_ms == approx(32)
    # other = step - top-level phases only = 32 - 10 - 20
    assert s.phases["other"].mean_ms == approx(2)
    assert s.phases["forward"].share == approx(10 / 32)
    assert s.phases["attention"].share == approx(4 / 32)
    assert s.phases["sync"].share == approx(3 / 32)
    assert s.phases["other"].share == approx(2 / 32)
    assert {n for n, p in s.phases.items() if p.nested} == {"attention", "sync"}
    top_level = sum(p.share for n, p in s.phases.items() if n != "total" and not p.nested)
    assert top_level == approx(1.0)


def test_custom_phases_after_canonical_before_other(clock):
    scope = Scope(clock=clock, warmup=0, timing="host")
    for name, duration in [("my_custom", 1), ("forward", 2), ("data_wait", 3), ("zz_custom", 4), ("backward", 5)]:
        with scope.phase(name):
            clock.advance(duration)
    clock.advance(6)
    scope.step()
    s = scope.summary()
    assert list(s.phases) == ["data_wait", "forward", "backward", "my_custom", "zz_custom", "other", "total"]
    assert [s.phases[n].mean_ms for n in s.phases] == [
        approx(3),
        approx(2),
        approx(5),
        approx(1),
        approx(4),
        approx(6),
        approx(21),
    ]


def test_same_phase_twice_in_a_step_sums(clock):
    scope = Scope(clock=clock, warmup=0, timing="host")
    for first, second in [(3, 4), (2, 2)]:
        with scope.phase("forward"):
            clock.advance(first)
        with scope.phase("backward"):
            clock.advance(1)
        with scope.phase("forward"):
            clock.advance(second)
        scope.step()
    s = scope.summary()
    fwd = s.phases["forward"]
    assert fwd.steps == 2
    assert fwd.mean_ms == approx(5.5)  # (3+4 + 2+2) / 2
    assert fwd.median_ms == approx(5.5)
    assert s.phases["total"].mean_ms == approx(6.5)
    assert s.phases["other"].mean_ms == approx(0)


def test_phase_whose_body_raises_still_closes(clock):
    scope = Scope(clock=clock, warmup=0, timing="host")
    with pytest.raises(RuntimeError, match="model blew up"), scope.phase("forward"):
        clock.advance(5)
        raise RuntimeError("model blew up")
    with scope.phase("backward"):
        clock.advance(2)
    scope.step()
    with scope.phase("forward"):
        clock.advance(5)
    with scope.phase("backward"):
        clock.advance(2)
    scope.step()
    s = scope.summary()
    assert s.steps.measured == 2
    assert s.phases["forward"].mean_ms == approx(5)
    assert s.phases["forward"].steps == 2
    # the raise left no phase open: backward is top level and other is 0
    assert s.phases["backward"].nested is False
    assert s.phases["other"].mean_ms == approx(0)
    assert s.phases["total"].mean_ms == approx(7)
    assert not s.notes


def test_step_without_phases_is_all_other(clock):
    scope = Scope(clock=clock, warmup=1, timing="host")
    scope.step()  # warm-up: starts the clock
    for duration in (25, 35):
        clock.advance(duration)
        scope.step(batch_size=5)
    s = scope.summary()
    assert list(s.phases) == ["other", "total"]
    assert s.phases["other"].mean_ms == approx(30)
    assert s.phases["other"].share == approx(1.0)
    assert s.phases["total"].mean_ms == approx(30)
    assert s.phases["total"].median_ms == approx(30)
    assert s.throughput.samples_per_s == approx(10 / 0.060)


def test_first_step_without_phases_is_not_reported_as_zero(clock):
    # warmup=0 and no phases: each step is 10 ms of work. Whatever the first step is measured from, no step
    # took 0 ms, so the mean step time must be 10 ms (a 0 ms first step would give 6.67 ms).
    scope = Scope(clock=clock, warmup=0, timing="host")
    for _ in range(3):
        clock.advance(10)
        scope.step()
    s = scope.summary()
    assert s.phases["total"].mean_ms == approx(10)
    assert s.phases["other"].mean_ms == approx(10)


def test_zero_measured_steps(clock):
    scope = Scope(clock=clock, warmup=5, timing="host")
    for _ in range(3):
        with scope.phase("forward"):
            clock.advance(10)
        scope.step()
    s = scope.summary()
    assert s.phases == {}
    assert s.steps.measured == 0
    assert s.steps.warmup == 3
    assert any("no measured steps: warm-up was 5" in note for note in s.notes)
    assert s.throughput.steps_per_s is None
    assert scope.metrics() == {}
    assert scope.postfix() == "warm-up 3/5"
    out = io.StringIO()
    scope.print_table(file=out)
    text = out.getvalue()
    assert "no measured steps: warm-up was 5" in text
    assert "throughput" not in text


def test_zero_steps_at_all(clock):
    scope = Scope(clock=clock, warmup=2, timing="host")
    s = scope.summary()
    assert s.phases == {}
    assert s.steps.warmup == 0
    assert any("no measured steps: warm-up was 2" in note for note in s.notes)
    assert scope.postfix() == "warm-up 0/2"
    assert scope.metrics() == {}


class SlowLoader:
    """An iterator whose __next__ costs a known time on the fake clock; the fetch that ends it costs 2 ms."""

    def __init__(self, clock, items, fetch_ms):
        self.clock = clock
        self.items = list(items)
        self.fetch_ms = fetch_ms
        self.position = 0

    def __len__(self):
        return len(self.items)

    def __iter__(self):
        return self

    def __next__(self):
        if self.position == len(self.items):
            self.clock.advance(2)
            raise StopIteration
        self.clock.advance(self.fetch_ms)
        item = self.items[self.position]
        self.position += 1
        return item


def test_data_times_next_as_data_wait(clock):
    scope = Scope(clock=clock, warmup=0, timing="host")
    items = [object() for _ in range(4)]
    loader = SlowLoader(clock, items, fetch_ms=7)
    wrapped = scope.data(loader)
    assert len(wrapped) == 4
    seen = []
    for batch in wrapped:
        seen.append(batch)
        with scope.phase("forward"):
            clock.advance(3)
        scope.step(batch_size=2)
    assert len(seen) == 4
    assert all(a is b for a, b in zip(seen, items, strict=True))
    s = scope.summary()
    assert s.steps.measured == 4
    assert list(s.phases) == ["data_wait", "forward", "other", "total"]
    assert s.phases["data_wait"].mean_ms == approx(7)
    assert s.phases["data_wait"].share == approx(0.7)
    assert s.phases["forward"].mean_ms == approx(3)
    assert s.phases["other"].mean_ms == approx(0)
    assert s.phases["total"].mean_ms == approx(10)
    assert scope.metrics()["perf/data_time"] == approx(0.007)

    # The fetch that ended the epoch (2 ms) belongs to the next step.
    scope.step()
    s = scope.summary()
    assert s.phases["data_wait"].steps == 5
    assert s.phases["data_wait"].mean_ms == approx((4 * 7 + 2) / 5)
    assert s.phases["forward"].steps == 4
    assert s.phases["total"].mean_ms == approx((4 * 10 + 2) / 5)


def test_data_of_a_list_preserves_len_and_items(clock):
    scope = Scope(clock=clock, warmup=0, timing="host")
    items = [1, 2, 3]
    wrapped = scope.data(items)
    assert len(wrapped) == 3
    assert list(wrapped) == [1, 2, 3]


def feed(scope, clock, data_ms, compute_ms, batch_size):
    for d, c in zip(data_ms, compute_ms, strict=True):
        with scope.phase("data_wait"):
            clock.advance(d)
        with scope.phase("forward"):
            clock.advance(c)
        scope.step(batch_size=batch_size)


def test_metrics_over_window(clock):
    scope = Scope(clock=clock, warmup=1, window=3, timing="host")
    feed(scope, clock, [100], [100], 16)  # warm-up
    assert scope.metrics() == {}
    feed(scope, clock, [5], [20], 16)
    m = scope.metrics()
    assert m["perf/step_time"] == approx(0.025)
    assert m["perf/data_time"] == approx(0.005)
    assert m["perf/compute_time"] == approx(0.020)
    assert m["perf/train_capacity"] == approx(16 / 0.025)
    feed(scope, clock, [10, 15, 20, 25], [20, 30, 30, 40], 16)
    m = scope.metrics()
    # the last 3 steps: data 15 20 25, compute 30 30 40 -> steps 45 50 65
    assert set(m) == {"perf/step_time", "perf/data_time", "perf/compute_time", "perf/train_capacity"}
    assert m["perf/step_time"] == approx(0.160 / 3)
    assert m["perf/data_time"] == approx(0.020)
    assert m["perf/compute_time"] == approx(0.100 / 3)
    assert m["perf/train_capacity"] == approx(48 / 0.160)


def test_metrics_without_batch_size_has_no_capacity(clock):
    scope = Scope(clock=clock, warmup=0, window=5, timing="host")
    feed(scope, clock, [10, 10], [30, 30], None)
    m = scope.metrics()
    assert "perf/train_capacity" not in m
    assert m["perf/step_time"] == approx(0.040)


def test_postfix_exact_string(clock):
    scope = Scope(clock=clock, warmup=2, window=5, timing="host")
    feed(scope, clock, [10, 10], [30, 30], 8)
    assert scope.postfix() == "warm-up 2/2"
    feed(scope, clock, [10, 10, 10], [30, 30, 30], 8)
    assert scope.postfix() == "step=40ms data=25% thru=200.0/s"


def test_postfix_without_batch_size_gives_steps_per_second(clock):
    scope = Scope(clock=clock, warmup=0, window=5, timing="host")
    feed(scope, clock, [10, 10], [30, 30], None)
    assert scope.postfix() == "step=40ms data=25% thru=25.00 step/s"


def test_postfix_after_a_zero_length_step_does_not_raise(clock):
    # Two step() calls with no time between them close a step of 0 ns (the first is untimed: no start yet).
    scope = Scope(clock=clock, warmup=0, window=1, timing="host")
    scope.step()
    scope.step()
    text = scope.postfix()
    assert isinstance(text, str)
    assert text.startswith("step=0ms")


def test_long_run_memory_is_bounded(clock):
    scope = Scope(clock=clock, warmup=0, window=20, exact_limit=1000, timing="host")
    n = 50_000
    for i in range(n):
        with scope.phase("forward"):
            clock.advance(1 + (i % 100) * 0.1)
        clock.advance(0.5)
        scope.step(batch_size=4)
    recorder = scope._recorder
    assert len(recorder.recent) == 20
    s = scope.summary()
    assert s.steps.measured == n
    assert recorder.step_stats.count == n
    assert not recorder.step_stats.exact
    assert recorder.step_stats.stored_values < 2000
    for track in recorder.phases.values():
        assert track.host.stored_values < 2000
    fwd = s.phases["forward"]
    assert fwd.mean_ms == pytest.approx(1 + 0.1 * 49.5, rel=1e-9)  # exact even past exact_limit
    # true median: 500 copies each of 1.0 .. 10.9; the sample of rank 24999 is 5.9 ms; the sketch is within 1%
    assert fwd.median_ms == pytest.approx(5.9, rel=0.01)
    assert fwd.p95_ms == pytest.approx(10.4, rel=0.01)  # rank 47499.05 -> 10.4 ms
    assert s.phases["other"].mean_ms == pytest.approx(0.5, rel=1e-9)
    assert s.throughput.samples_per_s == pytest.approx(4 / (6.45e-3), rel=1e-9)


# -- internal errors ------------------------------------------------------------------------------------------


class BrokenEvents:
    def new_event(self):
        raise RuntimeError("boom: no events today")

    def synchronize(self):
        raise AssertionError("never reached")


def stepscope_warnings(caplog):
    return [r for r in caplog.records if r.name == "stepscope" and r.levelno >= logging.WARNING]


def test_internal_error_is_logged_once_and_the_loop_goes_on(clock, caplog):
    caplog.set_level(logging.WARNING, logger="stepscope")
    scope = Scope(clock=clock, warmup=1, timing="cuda", events=BrokenEvents())
    ran = 0
    for batch in scope.data([1, 2, 3, 4, 5, 6]):
        with scope.phase("forward"):
            clock.advance(10)
        with scope.phase("backward"):
            clock.advance(20)
        scope.step(batch_size=batch)
        ran += 1
    assert ran == 6
    records = stepscope_warnings(caplog)
    assert len(records) == 1
    assert "boom: no events today" in records[0].getMessage()
    s = scope.summary()
    assert any("internal error" in note and "boom: no events today" in note for note in s.notes)
    # measurement stopped at the first measured step: nothing after it was recorded
    assert s.steps.measured == 0
    assert scope.metrics() == {}
    assert len(stepscope_warnings(caplog)) == 1


def test_error_while_harvesting_stops_measuring_but_keeps_earlier_steps(clock, events, caplog):
    caplog.set_level(logging.WARNING, logger="stepscope")

    def broken_elapsed(end):
        raise ValueError("corrupt event")

    scope = Scope(clock=clock, warmup=0, timing="cuda", events=events)
    with scope.phase("forward"):
        clock.advance(10)
    scope.step()
    for event in events.take_recorded():
        event.done = True
        event.elapsed_time = broken_elapsed
    # step 2 is recorded, then harvesting step 1 fails inside step()
    for _ in range(4):
        with scope.phase("forward"):
            clock.advance(10)
        scope.step()
    records = stepscope_warnings(caplog)
    assert len(records) == 1
    assert "corrupt event" in records[0].getMessage()
    s = scope.summary()
    assert s.steps.measured == 2
    assert s.phases["forward"].mean_ms == approx(10)
    assert any("corrupt event" in note for note in s.notes)
    assert events.syncs == 0


# -- constructor ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"timing": "gpu"}, "timing must be one of"),
        ({"warmup": -1}, "warmup must be >= 0"),
        ({"window": 0}, "window must be >= 1"),
    ],
)
def test_invalid_arguments_raise(clock, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Scope(clock=clock, **kwargs)


def test_positional_arguments_follow_the_signature(clock):
    # Scope(enabled, warmup, window, ...) as __init__ declares them.
    scope = Scope(True, 3, 2, clock=clock, timing="host")
    for _ in range(5):
        with scope.phase("forward"):
            clock.advance(1)
        scope.step()
    assert scope.summary().steps.warmup == 3


def test_scope_samples_the_system_from_the_first_measured_step_until_close():
    import threading

    scope = Scope(warmup=1, system_interval_s=0.05)
    assert scope._collectors is NO_COLLECTORS  # warming up: nothing sampled yet
    for _ in range(3):
        with scope.phase("forward"):
            time.sleep(0.05)
        scope.step(batch_size=4)
    thread = scope._collectors._thread
    assert thread.is_alive()
    scope.close()
    assert not thread.is_alive()
    system = scope.summary().system
    assert system["samples"] >= 1 and system["host"]["cores"] >= 1
    assert system["gpu"] == {"available": False, "reason": "this process uses no CUDA device.", "devices": []}
    assert scope.summary().system == system  # closed: the figures no longer change
    before = {t for t in threading.enumerate() if t.name == "stepscope-collectors"}
    off = Scope(warmup=0, system_interval_s=None)
    off.step()
    assert off.summary().system == {}
    # No new sampler thread (samplers of scopes dropped by earlier tests may stop meanwhile: only additions count).
    assert {t for t in threading.enumerate() if t.name == "stepscope-collectors"} - before == set()


def test_a_scope_dropped_without_close_stops_its_sampler():
    import gc

    scope = Scope(warmup=0, system_interval_s=0.05)
    thread = scope._collectors._thread
    assert thread.is_alive()
    del scope
    gc.collect()
    thread.join(timeout=3)
    assert not thread.is_alive()


@pytest.mark.parametrize("interval", [0, -1, 0.01])
def test_system_interval_is_checked_up_front(interval):
    with pytest.raises(ValueError):
        Scope(system_interval_s=interval)


def test_metrics_carry_the_latest_system_readings():
    scope = Scope(warmup=0, window=5, system_interval_s=0.05)
    for _ in range(3):
        with scope.phase("forward"):
            time.sleep(0.04)
        scope.step(batch_size=2)
    deadline = time.monotonic() + 3
    while "sys/cpu_util" not in scope.metrics() and time.monotonic() < deadline:
        time.sleep(0.05)
    metrics = scope.metrics()
    scope.close()
    assert metrics["sys/cpu_util"] >= 0 and "perf/step_time" in metrics
    assert not any(key.startswith("sys/gpu") for key in metrics)  # no GPU in use: absent, not zero
    assert not any(key.startswith("sys/") for key in scope.metrics())  # closed: no live readings


# -- phase names -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "error", "shown"),
    [
        (123, TypeError, "int 123"),
        (None, TypeError, "NoneType None"),
        (("a", "b"), TypeError, "tuple ('a', 'b')"),
        (1.5, TypeError, "float 1.5"),
        (["forward"], TypeError, "list ['forward']"),
        (b"forward", TypeError, "bytes b'forward'"),
        ("", ValueError, "''"),
        ("  ", ValueError, "'  '"),
        ("total", ValueError, "'total'"),
        ("other", ValueError, "'other'"),
    ],
)
def test_a_phase_name_that_is_not_a_usable_string_is_refused_at_the_call(clock, name, error, shown):
    scope = Scope(clock=clock, warmup=0, timing="host")
    with pytest.raises(error) as raised:
        scope.phase(name)
    assert shown in str(raised.value)
    # Refused names leave nothing behind: the summary still serialises, with the good phases only.
    with scope.phase("forward"):
        clock.advance(2)
    scope.step(batch_size=4)
    with pytest.raises(error):
        scope.phase(name)  # refused again, not cached
    summary = scope.summary()
    assert list(summary.phases) == ["forward", "other", "total"]
    assert '"forward"' in summary.to_json()


def test_a_custom_phase_name_is_checked_once_not_per_call(clock, monkeypatch):
    import stepscope.scope as scope_module

    checked = []
    real = scope_module.check_phase_name
    monkeypatch.setattr(scope_module, "check_phase_name", lambda name: checked.append(name) or real(name))
    scope = Scope(clock=clock, warmup=0, timing="host")
    for _ in range(50):
        with scope.phase("my phase"):
            clock.advance(1)
        scope.step()
    assert checked == ["my phase"]


class TickingClock(FakeClock):
    """The fake clock, moving ``tick_ms`` after every read as well: each read stepscope makes costs time, as it does."""

    def __init__(self, tick_ms: float) -> None:
        super().__init__()
        self.tick_ns = round(tick_ms * 1e6)

    def __call__(self) -> int:
        now = super().__call__()
        self.ns += self.tick_ns
        return now


def test_stepscopes_own_time_at_the_boundary_is_its_phase_not_the_scripts_other():
    # Closing a step (records, statistics) happens after the step's end clock, so the next step holds it: without
    # its own phase it read as the script's `other`. Every clock read here costs 0.25 ms; the one after closing
    # the step measures the close itself.
    clock = TickingClock(0.25)
    scope = Scope(clock=clock, warmup=1, timing="host")
    for _ in range(6):
        with scope.phase("forward"):
            clock.advance(5)
        clock.advance(1)  # the script's own time between its phases
        scope.step(batch_size=4)
    s = scope.summary()
    assert list(s.phases) == ["forward", "other", "stepscope", "total"]
    assert s.phases["stepscope"].mean_ms == approx(0.25)
    # its 1 ms, and the ticks after two reads that end a span: the forward's exit and the close's own measure
    assert s.phases["other"].mean_ms == approx(1.5)
    parts = sum(stats.mean_ms for name, stats in s.phases.items() if name != "total")
    assert parts == approx(s.phases["total"].mean_ms)


def test_the_stepscope_phase_name_is_reserved(clock):
    with pytest.raises(ValueError, match="computed by stepscope"):
        Scope(clock=clock, warmup=0, timing="host").phase("stepscope")
