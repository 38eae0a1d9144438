"""Verdict v1 from phase shares: each bound, the thresholds, CUDA timing, and thin evidence."""

import pytest

from stepscope.doctor.verdict import classify, group_shares
from stepscope.summary import Meta, PhaseStats, RunSummary, Steps


def summary(shares: dict[str, float], step_ms: float = 100.0, measured: int = 50, timing: str = "host", **device):
    phases = {
        name: PhaseStats(
            mean_ms=share * step_ms,
            median_ms=share * step_ms,
            p95_ms=share * step_ms,
            share=share,
            steps=measured,
            device_share=device.get(name),
            device_mean_ms=None if device.get(name) is None else device[name] * step_ms,
        )
        for name, share in shares.items()
    }
    phases["total"] = PhaseStats(step_ms, step_ms, step_ms, 1.0, measured)
    return RunSummary(steps=Steps(warmup=5, measured=measured), phases=phases, meta=Meta(timing=timing))


def test_data_bound_with_high_confidence_cites_the_share_and_times():
    verdict = classify(summary({"data_wait": 0.62, "forward": 0.2, "backward": 0.15, "other": 0.03}, step_ms=40))
    assert (verdict.bound, verdict.confidence) == ("data", "high")
    assert verdict.evidence == ["data_wait is 62% of the step (24.8 ms of a 40.0 ms step)"]


def test_h2d_counts_as_data():
    assert group_shares(summary({"data_wait": 0.3, "h2d": 0.2, "forward": 0.5}))["data"] == pytest.approx(0.5)


def test_compute_optimizer_and_host_bounds():
    assert classify(summary({"forward": 0.3, "backward": 0.4, "other": 0.3})).bound == "compute"
    assert classify(summary({"optimizer": 0.45, "zero_grad": 0.05, "forward": 0.5 - 0.2, "other": 0.2})).bound == (
        "optimizer"
    )
    host = classify(summary({"sync": 0.3, "other": 0.35, "forward": 0.35}))
    assert host.bound == "host"
    assert host.confidence == "high"


def test_medium_confidence_between_the_thresholds():
    verdict = classify(summary({"data_wait": 0.45, "forward": 0.3, "other": 0.25}))
    assert (verdict.bound, verdict.confidence) == ("data", "medium")


def test_no_group_reaching_forty_percent_is_balanced():
    verdict = classify(summary({"data_wait": 0.35, "forward": 0.33, "other": 0.32}))
    assert verdict.bound == "balanced"
    assert "data 35%" in verdict.evidence[0]


def test_too_few_steps_is_unknown():
    verdict = classify(summary({"data_wait": 0.9, "other": 0.1}, measured=2))
    assert (verdict.bound, verdict.confidence) == ("unknown", "low")
    assert "only 2 measured step(s)" in verdict.evidence[0]


def test_nested_phases_are_not_counted_twice():
    s = summary({"data_wait": 0.3, "forward": 0.7})
    s.phases["attention"] = PhaseStats(60, 60, 60, 0.6, 50, nested=True)
    assert group_shares(s)["compute"] == pytest.approx(0.7)


def test_cuda_timing_uses_gpu_time_for_compute_and_idle_gpu_for_host():
    # The host only launched kernels (forward 5%), but the GPU was busy 80% of the step in backward + forward.
    gpu_bound = summary(
        {"data_wait": 0.05, "forward": 0.05, "backward": 0.05, "other": 0.85},
        timing="cuda",
        forward=0.3,
        backward=0.5,
    )
    assert classify(gpu_bound).bound == "compute"
    # The GPU was busy 20% of the step and the loader 5%: the rest is the host failing to feed it.
    starved = summary(
        {"data_wait": 0.05, "forward": 0.45, "backward": 0.45, "other": 0.05}, timing="cuda", forward=0.1, backward=0.1
    )
    shares = group_shares(starved)
    assert shares["host"] == pytest.approx(0.75)
    verdict = classify(starved)
    assert verdict.bound == "host"
    assert any("no work for 75%" in line for line in verdict.evidence)
