"""Each measured step's loss in the summary: read from the tensors backward began from, once at the end of the run,
against the values the loop itself read (the same process, and a real script under `stepscope run`); and tune's
side-by-side of the baseline's and the tuned run's loss where a kept setting changes numerics."""

from __future__ import annotations

import io
import math

import pytest
import torch
from run_helpers import script, stepscope_here
from torch import nn

from stepscope.analyses.ab import RunFigures, run_figures, variant_result
from stepscope.instrument.hooks import install
from stepscope.instrument.tracker import RunConfig, StopRun, Tracker
from stepscope.instrument.tune import TuneResult, compare_loss
from stepscope.report.tune import print_tune
from stepscope.report.tune_html import tune_html
from stepscope.scope import enabled_scope
from stepscope.summary import LossSeries, RunSummary

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


def plain_step(model, optimizer, i) -> float:
    """One training step on batch ``i``; returns the loop's own reading of its loss."""
    x, y = batch(i)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def test_the_measured_steps_losses_are_the_loops_own(tmp_path):
    summary, own = train(tmp_path, plain_step)
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


# -- end to end: the loss under `stepscope run`, and tune's side by side ----------------------------------------


def _own_losses(stdout: str) -> dict[int, float]:
    return {int(w[1]): float(w[2]) for w in (line.split() for line in stdout.splitlines()) if w[:1] == ["loss"]}


def test_run_keeps_the_scripts_own_loss_and_bf16_shows_beside_the_baseline(tmp_path):
    # The seeded script prints the loss it read after each step. Under `stepscope run` the summary's losses are
    # those very values; with --apply precision.bf16 they move by bf16's rounding only, and tune's comparison
    # names the setting that changed numerics.
    runs = [
        stepscope_here(tmp_path / name, *apply, script("seeded_loss.py"), warmup=2, steps=5)
        for name, apply in (("baseline", ()), ("bf16", ("--apply", "precision.bf16")))
    ]
    for r in runs:
        assert r.returncode == 0, r.describe()
    baseline, bf16 = (r.summary for r in runs)
    own = _own_losses(runs[0].stdout)
    assert baseline.loss is not None and baseline.loss.steps == [0, 1, 2, 3, 4], runs[0].describe()
    assert baseline.loss.values == [own[2 + i] for i in range(5)], (baseline.loss, own)
    assert bf16.loss is not None and bf16.loss.values == [_own_losses(runs[1].stdout)[2 + i] for i in range(5)]
    assert bf16.loss.values != baseline.loss.values
    sides = [variant_result(r.summary.meta.command or "", "", {}, [run_figures(r.summary, 0, 1)]) for r in runs]
    loss = compare_loss(*sides, ["precision.bf16"])
    assert loss is not None and loss.numerics == ["precision.bf16"] and loss.steps == [0, 1, 2, 3, 4]
    assert 0 < loss.max_rel_diff < 0.02, loss  # bf16 keeps 8 bits of mantissa: ~0.4% per rounding
    result = TuneResult(baseline_steps_per_s=100.0, best_apply=["precision.bf16"], speedup=1.2, loss=loss)
    out = io.StringIO()
    print_tune(result, baseline, ["train.py"], file=out)
    text = out.getvalue()
    assert "loss of the same steps (precision.bf16 changes numerics): largest difference" in text, text
    assert f"{baseline.loss.values[0]:.6g}" in text and f"{bf16.loss.values[-1]:.6g}" in text, text
    page = tune_html(result, ["train.py"])
    assert "the loss of the same steps" in page and "<title>tuned: " in page and "<title>baseline: " in page, page
    assert TuneResult.to_dict(result)["best"]["loss"]["numerics"] == ["precision.bf16"]


def test_settings_that_keep_numerics_show_no_loss_table_and_gaps_are_skipped():
    def side(steps, values):
        figures = RunFigures(
            order=1, exit_code=0, exit_reason="stopped", measured_steps=len(steps), sec_per_step=0.01,
            samples_per_s=None, peak_mem_mb=None, peak_mem_source=None, per_rank_batch=None, global_batch=None,
            world_size=1, backend="single process", loss=LossSeries(steps, values),
        )  # fmt: skip
        return variant_result("v", "", {}, [figures])

    loss = compare_loss(side([0, 1, 2, 3], [2.0, None, 1.0, 1.0]), side([1, 2, 3, 4], [5.0, 1.1, 1.0, 9.0]), ["x=1"])
    assert loss is not None and loss.steps == [1, 2, 3] and loss.numerics == []
    assert loss.max_rel_diff == pytest.approx(0.1) and loss.max_rel_diff_step == 2 and loss.last_rel_diff == 0.0
    assert compare_loss(side([0], [1.0]), side([5], [1.0]), []) is None
    out = io.StringIO()
    print_tune(TuneResult(baseline_steps_per_s=1.0, best_apply=["x=1"], loss=loss), RunSummary(), ["t.py"], file=out)
    assert "loss of the same steps" not in out.getvalue()


def test_the_loss_buffer_sums_micro_batches_and_counts_no_item_call_of_the_script():
    from stepscope.instrument.loss import LossBuffer

    kept = LossBuffer(steps=4)
    with _counted_items() as counted:
        kept.add(0, torch.tensor(1.5))
        kept.add(0, torch.tensor([0.25], dtype=torch.bfloat16))  # a second micro-batch, another dtype and shape
        kept.add(2, torch.tensor(float("nan")))
        kept.add(4, torch.tensor(9.0))  # past the buffer: not kept
        for _ in range(100):
            kept.add(3, torch.tensor(0.01))
    assert counted == []  # read through the C method, under stepscope's .item() hook
    assert kept._sums == {}  # on the CPU nothing waits: no buffer on a device
    series = kept.series()
    assert series.steps == [0, 2, 3] and series.values[0] == 1.75 and series.values[1] is None
    assert series.values[2] == pytest.approx(1.0, rel=1e-5)
    assert LossBuffer().series() is None


class _counted_items:
    """``torch.Tensor.item`` replaced by a counting wrapper, as stepscope's hook does, for the ``with`` block."""

    def __enter__(self) -> list[int]:
        self.original, self.calls = torch.Tensor.item, []
        torch.Tensor.item = lambda t: self.calls.append(1) or self.original(t)
        return self.calls

    def __exit__(self, *exc) -> None:
        torch.Tensor.item = self.original


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_device_loss_is_summed_in_place_on_its_device_and_read_once():
    from stepscope.instrument.loss import LossBuffer

    kept = LossBuffer(steps=4)
    loss = torch.tensor(1.5, device="cuda")
    kept.add(0, loss)
    (sums,) = kept._sums.values()
    before = sums.data_ptr()
    kept.add(0, torch.tensor([0.25], device="cuda", dtype=torch.bfloat16))
    for _ in range(100):
        kept.add(3, torch.tensor(0.01, device="cuda"))
    assert sums.device.type == "cuda" and sums.data_ptr() == before  # one buffer, written in place
    series = kept.series()
    assert series.steps == [0, 3] and series.values[0] == 1.75
    assert series.values[1] == pytest.approx(1.0, rel=1e-5)


def test_a_device_loss_buffer_is_made_in_the_warm_up_not_in_a_measured_step(tmp_path, monkeypatch):
    # Making it (an allocation, a kernel's first launch) can wait for the GPU: on an H200 the first measured step
    # of a loop that never syncs waited 33 ms there. A loss on the meta device stands for a GPU's here.
    from stepscope.instrument.loss import LossBuffer

    step_of: list[int] = []
    made_in: list[int] = []

    def made(self, loss):  # where the buffer is made; a CPU one, so that the summary can read it
        made_in.append(step_of[-1])
        sums = self._sums[loss.device] = torch.zeros(self.steps)
        return sums

    monkeypatch.setattr(LossBuffer, "_buffer", made)

    def step(model, optimizer, i):
        step_of.append(i)
        if i < WARMUP:
            (torch.ones((), device="meta", requires_grad=True) * 2).backward()
        return plain_step(model, optimizer, i)

    summary, own = train(tmp_path, step)
    assert made_in == [0]  # once, in the first warm-up step
    assert summary.loss.values == pytest.approx(own[WARMUP : WARMUP + STEPS], rel=1e-6)
