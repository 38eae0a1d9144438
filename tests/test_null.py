"""A disabled Scope is the shared null object: no work, no allocation, and the environment can flip it."""

import io

import pytest
from allocations import growth

import stepscope
from stepscope import NULL_SCOPE, NullScope, Scope


def test_disabled_scope_is_the_null_scope():
    scope = Scope(enabled=False)
    assert scope is stepscope.NULL_SCOPE
    assert isinstance(scope, NullScope)
    assert scope.enabled is False
    # other arguments are accepted and ignored
    assert Scope(enabled=False, warmup=3, timing="cuda") is NULL_SCOPE


def test_null_phase_is_one_shared_object_for_any_name():
    first = NULL_SCOPE.phase("forward")
    assert NULL_SCOPE.phase("forward") is first
    assert NULL_SCOPE.phase("backward") is first
    assert NULL_SCOPE.phase("some custom name") is first
    with first as value:
        assert value is None


def test_null_phase_lets_exceptions_propagate():
    with pytest.raises(KeyError), NULL_SCOPE.phase("forward"):
        raise KeyError("x")


def test_null_data_returns_the_iterable_itself():
    loader = [1, 2, 3]
    assert NULL_SCOPE.data(loader) is loader
    generator = iter(range(3))
    assert NULL_SCOPE.data(generator) is generator


def test_null_step_and_readers():
    assert NULL_SCOPE.step() is None
    assert NULL_SCOPE.step(batch_size=32) is None
    assert NULL_SCOPE.metrics() == {}
    assert NULL_SCOPE.postfix() == ""
    summary = NULL_SCOPE.summary()
    assert summary.phases == {}
    assert summary.steps.measured == 0
    assert any("disabled" in note for note in summary.notes)
    out = io.StringIO()
    assert NULL_SCOPE.print_table(file=out) is None
    assert out.getvalue() == ""


@pytest.mark.parametrize("value", ["0", "false", "off", "no", " OFF "])
def test_env_disables_even_when_enabled(monkeypatch, value):
    monkeypatch.setenv("STEPSCOPE", value)
    assert Scope(enabled=True) is NULL_SCOPE
    assert Scope() is NULL_SCOPE


@pytest.mark.parametrize("value", ["1", "true", "on", "yes"])
def test_env_enables_even_when_disabled(monkeypatch, clock, value):
    monkeypatch.setenv("STEPSCOPE", value)
    scope = Scope(enabled=False, clock=clock, warmup=0, timing="host")
    assert scope is not NULL_SCOPE
    assert isinstance(scope, Scope)
    assert scope.enabled is True
    with scope.phase("forward"):
        clock.advance(5)
    scope.step()
    assert scope.summary().phases["forward"].mean_ms == pytest.approx(5)


def test_unrecognised_env_value_leaves_the_argument_in_charge(monkeypatch, clock):
    monkeypatch.setenv("STEPSCOPE", "maybe")
    assert Scope(enabled=False) is NULL_SCOPE
    assert isinstance(Scope(enabled=True, clock=clock), Scope)


def _loop(scope, n):
    data = [None]
    for _ in range(n):
        with scope.phase("forward"):
            pass
        with scope.phase("backward"):
            pass
        scope.data(data)
        scope.step()


def test_disabled_scope_allocates_nothing_per_call():
    scope = Scope(enabled=False)
    grown = growth(lambda n: _loop(scope, n), 10_000)
    assert grown.grown_files == []
    # 40k calls: even one retained 16-byte block per call would be 640 kB; allow only bookkeeping noise.
    assert grown.kept < 4096
    assert grown.peak < 4096


def test_enabled_scope_is_seen_by_the_allocation_check(clock):
    """The measurement above can fail: an enabled scope that keeps per-step records grows by thousands of blocks."""
    scope = Scope(clock=clock, warmup=0, window=10_000, exact_limit=100_000, timing="host")
    assert growth(lambda n: _loop(scope, n), 2_000).kept > 50_000
