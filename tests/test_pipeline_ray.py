"""The Ray adapter on a real local Ray, and the pipeline example with and without Ray.

Engines are real Ray actors whose calls sleep a known time: the inference capacity read through the adapter must
be the engines' real rate, late-reported timings must land in the window, failed calls must be counted, and a Ray
queue used as the pool must be read as the pool's size.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stepscope.pipeline import PipelineMonitor
from stepscope.summary import RunSummary

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "pipeline" / "distill.py"


class SleepyEngine:
    """Takes ``seconds`` per call and returns ``n`` samples; every ``fail_every``-th call raises."""

    def __init__(self, seconds: float, fail_every: int = 0, queue=None) -> None:
        self.seconds = seconds
        self.fail_every = fail_every
        self.calls = 0
        self.queue = queue

    def ready(self) -> bool:
        return True

    def generate(self, n: int) -> list[int]:
        self.calls += 1
        time.sleep(self.seconds)
        if self.fail_every and self.calls % self.fail_every == 0:
            raise RuntimeError("engine overloaded")
        out = list(range(n))
        if self.queue is not None:
            self.queue.put_nowait_batch(out)
        return out


def test_reporter_needs_a_running_ray():
    from stepscope.pipeline.ray import RayReporter

    if ray.is_initialized():
        pytest.skip("Ray is running in this process")
    with pytest.raises(RuntimeError, match=r"ray.init\(\)"):
        RayReporter(PipelineMonitor(slots=1))


@pytest.fixture(scope="module")
def local_ray():
    # The engines below are classes of this module, which Ray's workers import by name: put tests/ on their path.
    path = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
    # Ray runs its workers at nice 15, under the driver: beside a busy loop per core (nice 0) an actor then gets ~3%
    # of a core, and its first call took 47 s. Here they run at the tests' own priority. The raylet reads this from
    # its environment when ray.init starts it (and ray.init adds variables of its own, which stay).
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_worker_niceness", "0")
        ray.init(
            num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": path}}
        )
    yield ray
    ray.shutdown()


def drive(engines, calls: int, n: int) -> float:
    """Each engine called ``calls`` times in turn, all engines at once (one slot each). Returns the longest a
    round took as the driver saw it (s): no engine call of it took longer, however busy the machine."""
    longest_s = 0.0
    for _ in range(calls):
        start = time.perf_counter()
        refs = [engine.generate.remote(n) for engine in engines]
        for ref in refs:
            with contextlib.suppress(ray.exceptions.RayTaskError):  # the failing engine's calls
                ray.get(ref)
        longest_s = max(longest_s, time.perf_counter() - start)
    return longest_s


def wait_for_reports(reporter, mon, samples: float, timeout_s: float = 20.0) -> None:
    """Poll until the engines' reports of ``samples`` samples have come in (a busy machine delays them)."""
    deadline = time.monotonic() + timeout_s
    while mon.snapshot().samples_in < samples and time.monotonic() < deadline:
        time.sleep(0.05)
        reporter.poll()


def test_inference_capacity_through_ray_is_the_engines_real_rate(local_ray):
    from stepscope.pipeline.ray import RayReporter

    mon = PipelineMonitor(slots=2, window_s=30.0)
    reporter = RayReporter(mon, engines_fill_pool=True, poll_s=0.2, flush_s=0.2)
    engine = ray.remote(num_cpus=0)(reporter.timed(SleepyEngine, "generate"))
    engines = [engine.remote(0.05) for _ in range(2)]
    ray.get([engine.ready.remote() for engine in engines])  # started: the rounds below time calls alone
    longest_s = drive(engines, calls=12, n=8)
    wait_for_reports(reporter, mon, samples=8 * 24)
    reporter.close()
    snap = mon.snapshot()
    assert snap.infer_calls == 24 and snap.infer_errors == 0
    # Each call sleeps 50 ms (never less) and ends within its round as the driver saw it: at most 8 / 0.05 samples/s
    # per slot, at least 8 / longest round (on a quiet machine, 320 samples/s for the 2 slots).
    assert 0.05 <= snap.infer_batch_time_s <= longest_s
    assert 2 * 8 / longest_s <= snap.infer_capacity <= 2 * 8 / 0.05


def test_failed_calls_are_counted_apart_and_a_ray_queue_is_read_as_the_pool(local_ray):
    from ray.util.queue import Queue

    from stepscope.pipeline.ray import RayReporter

    pool = Queue()
    mon = PipelineMonitor(slots=1, window_s=30.0)
    reporter = RayReporter(mon, pool=pool, engines_fill_pool=True, poll_s=0.2, flush_s=0.2)
    engine = ray.remote(num_cpus=0)(reporter.timed(SleepyEngine, "generate")).remote(0.02, fail_every=3, queue=pool)
    ray.get(engine.ready.remote())
    longest_s = drive([engine], calls=9, n=4)
    taken = pool.get_nowait_batch(5)
    mon.pool_take(len(taken))
    wait_for_reports(reporter, mon, samples=24)
    time.sleep(0.5)  # the failed calls' reports, which add no samples
    reporter.close()
    snap = mon.snapshot()
    assert (snap.infer_calls, snap.infer_errors) == (6, 3)
    assert snap.samples_in == 24  # the 6 calls that succeeded put 4 samples each
    assert snap.pool == 19  # read from the queue itself: 24 put, 5 taken
    # 4 samples per call of at least 20 ms, and no longer than the driver waited for it (200/s on a quiet machine).
    assert 4 / longest_s <= snap.infer_capacity <= 4 / 0.02


def test_late_reports_land_at_the_time_the_call_ended(local_ray):
    from stepscope.pipeline.ray import RayReporter

    mon = PipelineMonitor(slots=1, window_s=2.0)
    reporter = RayReporter(mon, engines_fill_pool=True, poll_s=60, flush_s=0.1)  # polled by hand below
    engine = ray.remote(num_cpus=0)(reporter.timed(SleepyEngine, "generate")).remote(0.01)
    drive([engine], calls=5, n=2)
    time.sleep(3.0)  # these calls end more than one window before they are drained
    last_call = time.monotonic()
    drive([engine], calls=1, n=2)
    wait_for_reports(reporter, mon, samples=12)
    snap = mon.snapshot()
    taken_s = time.monotonic() - last_call
    reporter.close()
    # The first five ended 3 s or more before the snapshot, however late their reports came: never in the window.
    # The last ended after last_call: in the window when the snapshot came within 2 s of that (a machine short of
    # CPU can delay Ray's processes longer).
    assert snap.infer_calls == (1 if taken_s < 2.0 else snap.infer_calls) <= 1, (snap.infer_calls, taken_s)


def test_a_report_long_in_transit_is_as_old_as_its_call():
    # On a busy machine a report can wait seconds for the collector: its calls must not look recent for that.
    from stepscope.pipeline.ray import _Collector

    collector = _Collector()
    ended = time.monotonic()
    collector.report([(0.01, 2.0, True, ended)], sent_at=ended, sent_wall=time.time() - 2.0)
    (record,), drained_wall = collector.drain()
    assert record[3] == pytest.approx(2.0, abs=0.05)
    assert drained_wall == pytest.approx(time.time(), abs=0.05)


def test_timed_refuses_an_actor_class_and_a_missing_method(local_ray):
    from stepscope.pipeline.ray import RayReporter

    reporter = RayReporter(PipelineMonitor(slots=1))
    try:
        with pytest.raises(TypeError, match="plain class"):
            reporter.timed(ray.remote(SleepyEngine), "generate")
        with pytest.raises(AttributeError, match="no method 'decode'"):
            reporter.timed(SleepyEngine, "decode")
    finally:
        reporter.close()


def run_example(tmp_path: Path, *args: str) -> RunSummary:
    out = tmp_path / "pipeline.json"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return RunSummary.from_json(out)


@pytest.mark.parametrize("with_ray", [False, True], ids=["threads", "ray"])
def test_example_is_inference_bound_with_slow_engines(tmp_path, request, with_ray):
    args = ["--engine-s", "0.2", "--engines", "2", "--seconds", "5", "--window-s", "3"]
    if with_ray:  # the example joins this module's Ray rather than starting its own (a minute of start-up under load)
        args += ["--ray", "--ray-address", request.getfixturevalue("local_ray").get_runtime_context().gcs_address]
    summary = run_example(tmp_path, *args)
    pipeline = summary.pipeline
    assert pipeline["bottleneck"] == "inference" and summary.verdict.bound == "inference"
    # 2 engines x 8 samples per 0.2 s call = 80 samples/s; the trainer can take far more.
    assert pipeline["infer_capacity"] == pytest.approx(80, rel=0.2)
    assert pipeline["train_capacity"] > 3 * pipeline["infer_capacity"]
    # What the trainer took is what the engines made while busy: each slot's call also waits on its dispatch (a Ray
    # round trip, slower on a busy machine), so the rate is the capacity times the slots' busy share.
    assert pipeline["thru"] == pytest.approx(pipeline["infer_capacity"] * pipeline["slot_busy"], rel=0.15)
    assert pipeline["slot_busy"] > 0.5
    assert pipeline["dispatch_wait_s"] > 0.1
    assert pipeline["history"]


def test_example_is_training_bound_with_slow_steps(tmp_path):
    summary = run_example(tmp_path, "--engine-s", "0.02", "--train-s", "0.05", "--seconds", "4", "--window-s", "3")
    pipeline = summary.pipeline
    assert pipeline["bottleneck"] == "training" and pipeline["training_side"] == "compute"
    assert pipeline["pool_trend"] > 0 and pipeline["dispatch_wait_s"] < 0.005
    # 16 samples per step of at least 50 ms: at most 320 samples/s.
    assert 150 < pipeline["train_capacity"] <= 320
