"""Each measured step's loss in the summary: read from the tensors backward began from, once at the end of the run,
against the values the loop itself read (same process, same tensors)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from stepscope.instrument.hooks import install
from stepscope.instrument.tracker import RunConfig, StopRun, Tracker
from stepscope.scope import enabled_scope
from stepscope.summary import RunSummary

WARMUP, STEPS = 2, 6


def train(tmp_path, step, steps: int = STEPS) -> tuple[RunSummary, list[float]]:
    """Run ``step(model, optimizer, i)`` under stepscope's hooks until the run stops; returns the summary and
    what each call returned (the loop's own reading of its loss)."""
    torch.manual_seed(0)
    scope = enabled_scope(warmup=WARMUP, system_interval_s=None)
    tracker = Tracker(scope, RunConfig(out_dir=str(tmp_path), warmup=WARMUP, steps=steps))
    undo = install(tracker)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    own: list[float] = []
    try:
        for i in range(WARMUP + steps + 1):
            own.append(step(model, optimizer, i))
    except StopRun:
        pass
    finally:
        undo()
    return tracker.summary(), own


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


def test_the_measured_steps_losses_are_the_loops_own(tmp_path):
    def step(model, optimizer, i):
        x, y = batch(i)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    summary, own = train(tmp_path, step)
    assert summary.steps.measured == STEPS
    assert summary.loss is not None
    assert summary.loss.steps == list(range(STEPS))  # the warm-up's are not kept
    assert summary.loss.values == pytest.approx(own[WARMUP : WARMUP + STEPS], rel=1e-6)
    # Kept as read: the loop's own .item() calls are the only read-backs counted per step.
    assert summary.counters["item_calls"] == pytest.approx(1)


def test_micro_batches_add_up_and_other_backward_roots_are_left_out(tmp_path):
    # Two micro-batches, each loss halved (a step's loss is their sum: the mean); then a backward from a
    # non-scalar output with its gradient given, which is no loss; and autograd.backward of a one-tensor list.
    def step(model, optimizer, i):
        x, y = batch(i)
        halves = [nn.functional.mse_loss(model(x[k::2]), y[k::2]) / 2 for k in (0, 1)]
        for half in halves:
            half.backward()
        out = model(x)
        out.backward(torch.ones_like(out))
        extra = model(x).mean() * 0.0
        torch.autograd.backward([extra])
        optimizer.step()
        optimizer.zero_grad()
        return sum(h.item() for h in halves) + extra.item()

    summary, own = train(tmp_path, step)
    assert summary.loss is not None and summary.loss.steps == list(range(STEPS))
    assert summary.loss.values == pytest.approx(own[WARMUP : WARMUP + STEPS], rel=1e-6)


def test_a_loss_that_is_not_finite_is_null_and_the_summary_stays_strict_json(tmp_path):
    def step(model, optimizer, i):
        x, y = batch(i)
        loss = nn.functional.mse_loss(model(x), y)
        if i == WARMUP + 1:
            loss = loss * float("nan")
        loss.backward()
        optimizer.zero_grad()  # the nan gradient is dropped: the next steps train on
        optimizer.step()
        return loss.item()

    summary, own = train(tmp_path, step)
    assert summary.loss is not None
    assert summary.loss.values[1] is None and math.isnan(own[WARMUP + 1])
    assert all(v is not None for i, v in enumerate(summary.loss.values) if i != 1)
    path = tmp_path / "s.json"
    summary.to_json(path)
    assert "NaN" not in path.read_text()
    assert RunSummary.from_json(path).loss == summary.loss


def test_a_run_without_a_scalar_backward_has_no_loss(tmp_path):
    def step(model, optimizer, i):
        x, _ = batch(i)
        out = model(x)
        out.backward(torch.ones_like(out))
        optimizer.step()
        optimizer.zero_grad()
        return 0.0

    summary, _ = train(tmp_path, step)
    assert summary.steps.measured == STEPS
    assert summary.loss is None


def test_a_summary_of_schema_6_reads_with_no_loss(tmp_path):
    data = RunSummary().to_dict()
    data.pop("loss")
    data["schema_version"] = 6
    assert RunSummary.from_dict(data).loss is None
