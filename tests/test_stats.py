"""StreamingStats: exact moments, exact quantiles up to exact_limit, bounded DDSketch-style quantiles beyond; the
bounded step-time series."""

import math

import numpy as np
import pytest

from stepscope.record import Recorder, SeriesBuilder, StepRecord, StreamingStats, summarize
from stepscope.summary import StepSeries

QS = (0.0, 0.1, 0.25, 0.5, 0.9, 0.95, 0.99, 1.0)


def filled(values, **kwargs):
    """One value at a time through add()."""
    stats = StreamingStats(**kwargs)
    for v in values:
        stats.add(float(v))
    return stats


def folded(values, chunk=256, **kwargs):
    """Batches through extend(), the way the recorder folds steps in (and fast enough for 200k values)."""
    stats = StreamingStats(**kwargs)
    values = np.asarray(values, dtype=np.float64)
    for start in range(0, values.size, chunk):
        stats.extend(values[start : start + chunk])
    return stats


def test_moments_exact_for_hand_values():
    stats = filled([3.0, 1.0, 4.0, 1.0, 5.0])
    assert stats.count == 5
    assert stats.total == 14.0
    assert stats.mean == pytest.approx(2.8)
    assert stats.min == 1.0
    assert stats.max == 5.0
    # Sorted: 1 1 3 4 5. Linear quantile: rank = q * 4.
    assert stats.quantile(0.5) == 3.0
    assert stats.quantile(0.0) == 1.0
    assert stats.quantile(1.0) == 5.0
    assert stats.quantile(0.25) == 1.0  # rank 1 -> second value
    assert stats.quantile(0.95) == pytest.approx(4.8)  # rank 3.8 -> 4 + 0.8 * (5 - 4)
    assert stats.quantile(0.6) == pytest.approx(3.4)  # rank 2.4 -> 3 + 0.4 * (4 - 3)


def test_moments_stay_exact_after_switching_to_sketch():
    values = [float(i) for i in range(1, 5001)]  # 1..5000
    stats = filled(values, exact_limit=100)
    assert not stats.exact
    assert stats.count == 5000
    assert stats.total == 5000 * 5001 / 2
    assert stats.mean == 2500.5
    assert stats.min == 1.0
    assert stats.max == 5000.0


def test_quantiles_match_numpy_linear_while_exact():
    rng = np.random.default_rng(7)
    values = rng.lognormal(mean=-3.0, sigma=0.6, size=999)
    stats = filled(values, exact_limit=1000)
    assert stats.exact
    assert stats.stored_values == 999
    for q in QS:
        assert stats.quantile(q) == pytest.approx(float(np.quantile(values, q)), rel=1e-12, abs=0)


def test_exactly_exact_limit_values_stay_exact():
    stats = filled(range(1, 11), exact_limit=10)
    assert stats.exact
    assert stats.stored_values == 10
    stats.add(11.0)
    assert not stats.exact


def test_crossing_exact_limit_switches_to_sketch_and_stays_bounded():
    rng = np.random.default_rng(1)
    values = rng.lognormal(mean=-2.0, sigma=1.0, size=200_000)
    stats = StreamingStats(exact_limit=1000)
    stats.extend(values[:1000])
    assert stats.exact
    assert stats.stored_values == 1000
    stats.add(float(values[1000]))
    assert not stats.exact
    for start in range(1001, values.size, 256):
        stats.extend(values[start : start + 256])
    assert not stats.exact
    assert stats.count == 200_000
    assert stats.stored_values < 2000


def _check_sketch(values, rel_err=0.01):
    stats = folded(values, exact_limit=1000, rel_err=rel_err)
    assert not stats.exact
    assert stats.stored_values < 2000
    for q in (0.5, 0.95, 0.99):
        truth = float(np.quantile(values, q))
        got = stats.quantile(q)
        assert abs(got - truth) <= rel_err * truth, (q, got, truth)
        # The promise: within rel_err of the true sample of the same rank.
        lower = float(np.quantile(values, q, method="lower"))
        assert abs(got - lower) <= rel_err * lower * (1 + 1e-9), (q, got, lower)
    return stats


def test_sketch_quantiles_within_rel_err_lognormal():
    rng = np.random.default_rng(2)
    _check_sketch(rng.lognormal(mean=-3.0, sigma=0.8, size=200_000))


def test_sketch_quantiles_within_rel_err_uniform():
    rng = np.random.default_rng(3)
    _check_sketch(rng.uniform(0.010, 0.050, size=100_000))


def test_sketch_quantiles_within_rel_err_bimodal():
    # 70% fast steps near 20 ms, 30% slow steps near 200 ms: the median is in the fast mode, p95/p99 in the slow.
    rng = np.random.default_rng(4)
    fast = rng.normal(0.020, 0.002, size=70_000)
    slow = rng.normal(0.200, 0.010, size=30_000)
    values = rng.permutation(np.concatenate([fast, slow]))
    stats = _check_sketch(values)
    assert stats.quantile(0.5) < 0.03
    assert stats.quantile(0.95) > 0.17


def test_sketch_coarser_rel_err_is_honoured():
    rng = np.random.default_rng(5)
    values = rng.lognormal(mean=0.0, sigma=1.5, size=50_000)
    stats = _check_sketch(values, rel_err=0.05)
    fine = folded(values, exact_limit=1000, rel_err=0.01)
    # Wider buckets: fewer of them.
    assert stats.stored_values < fine.stored_values


def test_add_and_extend_agree():
    rng = np.random.default_rng(8)
    values = rng.lognormal(mean=-4.0, sigma=0.5, size=3000)
    one = filled(values, exact_limit=500)
    many = folded(values, chunk=97, exact_limit=500)
    assert one.count == many.count == 3000
    assert one.total == pytest.approx(many.total, rel=1e-12)
    assert (one.min, one.max) == (many.min, many.max)
    assert one.stored_values == many.stored_values
    for q in QS:
        assert one.quantile(q) == many.quantile(q)


def test_extend_empty_array_changes_nothing():
    stats = filled([2.0, 4.0])
    stats.extend(np.array([], dtype=np.float64))
    assert (stats.count, stats.total, stats.min, stats.max) == (2, 6.0, 2.0, 4.0)


def test_sketch_extreme_quantiles_are_min_and_max():
    rng = np.random.default_rng(6)
    values = rng.lognormal(size=5000)
    stats = filled(values, exact_limit=100)
    assert stats.quantile(0.0) == pytest.approx(values.min(), rel=0.01)
    assert stats.quantile(1.0) == pytest.approx(values.max(), rel=0.01)
    assert values.min() <= stats.quantile(0.0) <= values.max()
    assert values.min() <= stats.quantile(1.0) <= values.max()


def test_zeros_exact_mode():
    stats = filled([0.0, 0.0, 0.0, 2.0])
    assert stats.min == 0.0
    assert stats.mean == 0.5
    assert stats.quantile(0.5) == 0.0
    assert stats.quantile(1.0) == 2.0


def test_zeros_sketch_mode():
    # 600 zeros then 400 values of 0.5: past the limit the zeros have their own counter (log(0) is undefined).
    values = [0.0] * 600 + [0.5] * 400
    stats = filled(values, exact_limit=10)
    assert not stats.exact
    assert stats.count == 1000
    assert stats.min == 0.0
    assert stats.max == 0.5
    assert stats.total == pytest.approx(200.0)
    assert stats.quantile(0.0) == 0.0
    assert stats.quantile(0.5) == 0.0  # rank 499.5 < 600 zeros
    assert stats.quantile(0.59) == 0.0
    assert stats.quantile(0.7) == pytest.approx(0.5, rel=0.01)
    assert stats.quantile(1.0) == 0.5


def test_all_zeros_sketch_mode():
    stats = filled([0.0] * 50, exact_limit=5)
    assert not stats.exact
    for q in (0.0, 0.5, 1.0):
        assert stats.quantile(q) == 0.0
    assert stats.stored_values == 1


@pytest.mark.parametrize("q", [-0.01, 1.01, -1.0, 2.0])
def test_quantile_outside_unit_interval_raises(q):
    stats = filled([1.0, 2.0])
    with pytest.raises(ValueError, match="quantile must be between 0 and 1"):
        stats.quantile(q)


def test_quantile_outside_unit_interval_raises_even_when_empty():
    with pytest.raises(ValueError):
        StreamingStats().quantile(1.5)


def test_empty_stats_give_nan():
    stats = StreamingStats()
    assert stats.count == 0
    assert stats.total == 0.0
    assert math.isnan(stats.mean)
    for q in (0.0, 0.5, 1.0):
        assert math.isnan(stats.quantile(q))
    assert stats.exact
    assert stats.stored_values == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"exact_limit": 0}, "exact_limit must be at least 1"),
        ({"exact_limit": -5}, "exact_limit must be at least 1"),
        ({"rel_err": 0.0}, "rel_err must be between 0 and 1"),
        ({"rel_err": 1.0}, "rel_err must be between 0 and 1"),
        ({"rel_err": -0.1}, "rel_err must be between 0 and 1"),
        ({"rel_err": 1.5}, "rel_err must be between 0 and 1"),
    ],
)
def test_invalid_constructor_args_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StreamingStats(**kwargs)


def test_smallest_valid_constructor_args_work():
    stats = StreamingStats(exact_limit=1, rel_err=0.5)
    stats.add(1.0)
    assert stats.exact
    stats.add(2.0)
    assert not stats.exact
    assert stats.count == 2


def test_series_keeps_every_step_until_full_then_merges_neighbours_in_pairs():
    builder = SeriesBuilder(points=4)
    assert builder.series() is None
    for ms in range(1, 8):  # 7 steps of 1..7 ms: below 2 * points, kept one by one
        builder.add(ms * 1_000_000)
    assert builder.series() == StepSeries(stride=1, step_ms=[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    builder.add(8_000_000)  # the 8th step fills 2 * points: pairs merge, the stride doubles
    assert builder.series() == StepSeries(stride=2, step_ms=[1.5, 3.5, 5.5, 7.5])
    builder.add(9_000_000)  # a half-filled point is the mean of the steps it has
    assert builder.series() == StepSeries(stride=2, step_ms=[1.5, 3.5, 5.5, 7.5, 9.0])


def test_series_memory_is_bounded_and_its_mean_is_exact_over_a_long_run():
    builder = SeriesBuilder(points=64)
    steps = np.random.default_rng(0).integers(1_000_000, 50_000_000, size=100_003)
    for ns in steps.tolist():
        builder.add(ns)
    series = builder.series()
    assert series is not None and 64 <= len(series.step_ms) <= 129
    full = len(steps) // series.stride
    assert sum(series.step_ms[:full]) * series.stride == pytest.approx(steps[: full * series.stride].sum() / 1e6)


def test_recorder_series_includes_warmup_steps_and_reaches_the_summary():
    recorder = Recorder(warmup=2, window=4)
    for i, ms in enumerate([50, 40, 10, 10, 10]):
        recorder.add(StepRecord(i, ms * 1_000_000, {}))
    summary = summarize(recorder, "host")
    assert summary.series == StepSeries(stride=1, step_ms=[50.0, 40.0, 10.0, 10.0, 10.0])
    assert summary.steps.warmup == 2


def test_a_fold_of_steps_with_other_phases_of_the_same_count_keeps_each_phases_values():
    # The fold reads every row's phases by the first row's keys when all rows hold as many: a row holding another
    # phase in place of one of the first's must still give each phase its own values, in step order.
    from stepscope.record import _columns

    rows = [{"forward": 1, "backward": 2}, {"forward": 3, "eval": 4}, {"forward": 5, "backward": 6}]
    assert _columns(rows, {"forward", "backward", "eval"}) == {"forward": [1, 3, 5], "backward": [2, 6], "eval": [4]}
    same = [{"forward": 1, "other": 2}, {"other": 3, "forward": 4}]
    assert _columns(same, {"forward", "other"}) == {"forward": [1, 4], "other": [2, 3]}
    assert _columns([], {"forward"}) == {}
