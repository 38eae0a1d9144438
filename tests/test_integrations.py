"""The Lightning and Hugging Face Trainer callbacks, with the real frameworks on CPU and tiny models built here.

Ground truth comes from sleeps: a dataset whose samples take ``SAMPLE_MS`` to load and a model whose forward takes
``FORWARD_MS``. ``time.sleep`` never returns early, so each phase's median is at least its sleep; the upper bounds
leave room for a loaded 2-core machine but are below what the phase would show if the other sleep leaked into it.
"""

from __future__ import annotations

import csv
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from stepscope.integrations import require

SAMPLE_MS = 2.5  # per sample: 10 ms per batch of 4
FORWARD_MS = 10.0
BATCH = 4
FEATURES = 8


class SlowDataset(Dataset):
    """Samples that take ``sample_ms`` each to load; ``as_dict`` gives the Hugging Face form."""

    def __init__(self, length: int, sample_ms: float = SAMPLE_MS, as_dict: bool = False) -> None:
        self.length = length
        self.sample_ms = sample_ms
        self.as_dict = as_dict

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        time.sleep(self.sample_ms / 1e3)
        x, y = torch.randn(FEATURES), torch.randn(1)
        return {"x": x, "labels": y} if self.as_dict else (x, y)


def median_ms(summary, phase: str) -> float:
    return summary.phases[phase].median_ms


# -- Lightning ---------------------------------------------------------------------------------------------------


@pytest.fixture
def lightning():
    pytest.importorskip("lightning")
    import lightning.pytorch as pl

    return pl


def lightning_module(pl, forward_ms: float = FORWARD_MS, manual: bool = False):
    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(FEATURES, 1)
            self.automatic_optimization = not manual

        def training_step(self, batch, batch_idx):
            time.sleep(forward_ms / 1e3)
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            if not manual:
                return loss
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
            return None

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Tiny()


def lightning_trainer(pl, callback, max_steps: int, **kwargs):
    options = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "accelerator": "cpu",
        "devices": 1,
        "num_sanity_val_steps": 0,
        **kwargs,
    }
    return pl.Trainer(max_steps=max_steps, callbacks=[callback], **options)


def test_lightning_phases_match_the_sleeps_and_reach_the_csv_logger(lightning, tmp_path, capsys):
    from lightning.pytorch.loggers import CSVLogger

    from stepscope.integrations.lightning import StepscopeCallback

    callback = StepscopeCallback(warmup=3, json_path=tmp_path / "run.json", system_interval_s=None, log_every=4)
    trainer = lightning_trainer(
        lightning, callback, max_steps=15, logger=CSVLogger(tmp_path), profiler="simple", gradient_clip_val=1.0
    )
    # Loading takes twice the forward, so the verdict is data.
    loader = DataLoader(SlowDataset(BATCH * 40, sample_ms=2 * SAMPLE_MS), batch_size=BATCH)
    trainer.fit(lightning_module(lightning), loader)

    summary = callback.summary
    assert summary.steps.measured == 15 - 3 and summary.steps.boundary == "optimizer.step"
    data_ms, forward_ms = BATCH * 2 * SAMPLE_MS, FORWARD_MS
    assert data_ms <= median_ms(summary, "data_wait") < data_ms + 0.9 * forward_ms
    assert forward_ms <= median_ms(summary, "forward") < forward_ms + 0.9 * data_ms
    assert {"h2d", "backward", "clip", "optimizer", "zero_grad"} <= set(summary.phases)
    assert summary.throughput.samples_per_s == pytest.approx(BATCH * summary.throughput.steps_per_s)
    assert summary.verdict.bound == "data"
    assert (tmp_path / "run.json").exists()
    out = capsys.readouterr().out
    assert "data_wait" in out and "bound: data" in out

    # perf/* at the steps Lightning logs this batch's own metrics at: every 4th step, from the first measured one.
    rows = list(csv.DictReader(next(Path(tmp_path).rglob("metrics.csv")).open()))
    logged = {int(row["step"]): float(row["perf/step_time"]) for row in rows if row.get("perf/step_time")}
    assert sorted(logged) == [3, 7, 11]
    assert all((data_ms + forward_ms) / 1e3 <= seconds < 1.0 for seconds in logged.values())

    # The profiler was tapped, not replaced: the user's SimpleProfiler saw the fetches, and is itself again.
    assert any("train_dataloader_next" in action for action in trainer.profiler.recorded_durations)
    assert "start" not in vars(trainer.profiler) and "stop" not in vars(trainer.profiler)


def test_lightning_gradient_accumulation_is_one_step_per_optimizer_step(lightning):
    from stepscope.integrations.lightning import StepscopeCallback

    callback = StepscopeCallback(warmup=1, system_interval_s=None, print_table=False)
    trainer = lightning_trainer(lightning, callback, max_steps=5, accumulate_grad_batches=3)
    loader = DataLoader(SlowDataset(BATCH * 60, sample_ms=0.0), batch_size=BATCH)
    trainer.fit(lightning_module(lightning), loader)

    summary = callback.summary
    assert trainer.global_step == 5 and summary.steps.measured == 4
    assert 3 * FORWARD_MS <= median_ms(summary, "forward") < 5 * FORWARD_MS  # three micro-batches per step
    assert summary.throughput.samples_per_s == pytest.approx(3 * BATCH * summary.throughput.steps_per_s)
    assert summary.phases["zero_grad"].steps == 4  # once per step, on its first micro-batch


def test_lightning_manual_optimization_and_validation(lightning):
    from stepscope.integrations.lightning import StepscopeCallback

    callback = StepscopeCallback(warmup=2, system_interval_s=None, print_table=False)
    trainer = lightning_trainer(lightning, callback, max_steps=8, val_check_interval=3, limit_val_batches=2)
    loader = DataLoader(SlowDataset(BATCH * 40), batch_size=BATCH)
    val_loader = DataLoader(SlowDataset(BATCH * 2, sample_ms=10.0), batch_size=BATCH)
    trainer.fit(lightning_module(lightning, manual=True), loader, val_loader)

    summary = callback.summary
    assert summary.steps.measured == 6 and summary.steps.boundary == "optimizer.step"
    assert FORWARD_MS <= median_ms(summary, "forward") < FORWARD_MS + 0.9 * BATCH * SAMPLE_MS
    assert summary.phases["optimizer"].steps == 6
    # Two validation runs of 2 batches x 4 samples x 10 ms: reported apart, not data or host time (had one
    # leaked into data_wait, the two steps with one would put its p95 above 80 ms).
    assert summary.eval["passes"] == 2 and summary.eval["mean_ms"] >= 80 and "eval" not in summary.phases
    assert summary.phases["data_wait"].p95_ms < BATCH * SAMPLE_MS + 40
    assert summary.phases["other"].p95_ms < 40


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_lightning_disabled_costs_no_hook_and_gives_no_summary(lightning, monkeypatch, how):
    from stepscope.integrations import _noop
    from stepscope.integrations.lightning import StepscopeCallback

    if how == "environment":
        monkeypatch.setenv("STEPSCOPE", "0")
    callback = StepscopeCallback(enabled=how == "environment")
    assert not callback.enabled
    assert all(getattr(callback, hook) is _noop for hook in StepscopeCallback.HOOKS)
    trainer = lightning_trainer(lightning, callback, max_steps=3)
    trainer.fit(lightning_module(lightning, forward_ms=0), DataLoader(SlowDataset(BATCH * 8, 0), batch_size=BATCH))
    assert trainer.global_step == 3 and callback.summary is None
    assert "start" not in vars(trainer.profiler)


def test_lightning_error_inside_stepscope_does_not_stop_training(lightning, monkeypatch, caplog):
    import stepscope.integrations.lightning as integration

    def broken(batch):
        raise RuntimeError("boom")

    monkeypatch.setattr(integration, "batch_samples", broken)
    callback = integration.StepscopeCallback(warmup=0, system_interval_s=None, print_table=False)
    trainer = lightning_trainer(lightning, callback, max_steps=4)
    with caplog.at_level(logging.WARNING, logger="stepscope"):
        trainer.fit(lightning_module(lightning, forward_ms=0), DataLoader(SlowDataset(BATCH * 8, 0), batch_size=BATCH))
    assert trainer.global_step == 4
    assert [r.getMessage() for r in caplog.records].count(
        "stepscope stopped measuring after an internal error (RuntimeError: boom); training continues."
    ) == 1
    assert any("RuntimeError: boom" in note for note in callback.summary.notes)
    assert "start" not in vars(trainer.profiler)


# -- Hugging Face Trainer ----------------------------------------------------------------------------------------


@pytest.fixture
def transformers(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the models are built here
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import transformers

    return transformers


class SleepyRegressor(nn.Module):
    """A model in the Trainer's form: keyword inputs, a dict with the loss."""

    def __init__(self, forward_ms: float = FORWARD_MS) -> None:
        super().__init__()
        self.net = nn.Linear(FEATURES, 1)
        self.forward_ms = forward_ms

    def forward(self, x, labels=None):
        if self.forward_ms:
            time.sleep(self.forward_ms / 1e3)
        out = self.net(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


def hf_args(transformers, tmp_path, **kwargs):
    options = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": BATCH,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "use_cpu": True,
        "dataloader_num_workers": 0,
        **kwargs,
    }
    return transformers.TrainingArguments(**options)


def log_capture(transformers):
    class Capture(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.logs: list[dict] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs))

    return Capture()


def test_hf_phases_match_the_sleeps_with_gradient_accumulation(transformers, tmp_path):
    from stepscope.integrations.hf import StepscopeCallback

    args = hf_args(transformers, tmp_path, max_steps=12, gradient_accumulation_steps=2, logging_steps=4)
    capture = log_capture(transformers)
    trainer = transformers.Trainer(
        model=SleepyRegressor(), args=args, train_dataset=SlowDataset(BATCH * 100, as_dict=True), callbacks=[capture]
    )
    callback = StepscopeCallback(warmup=2, system_interval_s=None, json_path=tmp_path / "run.json").attach(trainer)
    trainer.train()

    summary = callback.summary
    assert summary.steps.measured == 12 - 2 and summary.steps.boundary == "optimizer.step"
    data_ms, forward_ms = 2 * BATCH * SAMPLE_MS, 2 * FORWARD_MS  # two micro-batches per step
    assert data_ms <= median_ms(summary, "data_wait") < data_ms + 0.9 * forward_ms
    assert forward_ms <= median_ms(summary, "forward") < forward_ms + 0.9 * data_ms
    assert {"backward", "optimizer", "zero_grad"} <= set(summary.phases)
    assert summary.throughput.samples_per_s == pytest.approx(2 * BATCH * summary.throughput.steps_per_s)
    assert (tmp_path / "run.json").exists()

    # perf/* in every training log after the warm-up, and in the Trainer's log_history.
    training_logs = [log for log in capture.logs if "loss" in log]
    assert [("perf/step_time" in log) for log in training_logs] == [True, True, True]
    assert all((data_ms + forward_ms) / 1e3 <= log["perf/step_time"] < 1.0 for log in training_logs)
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in history if "perf/train_capacity" in entry] == [4, 8, 12]


def test_hf_metrics_reach_tensorboard_from_a_gpt2_model(transformers, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from stepscope.integrations.hf import StepscopeCallback

    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    tokens = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (64, 16))]
    args = hf_args(transformers, tmp_path, max_steps=8, logging_steps=2, report_to="tensorboard")
    callback = StepscopeCallback(warmup=2, system_interval_s=None, print_table=False)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=tokens, callbacks=[callback])
    callback.attach(trainer).attach(trainer)
    assert [type(c).__name__ for c in trainer.callback_handler.callbacks].count("StepscopeCallback") == 1
    assert [type(c).__name__ for c in trainer.callback_handler.callbacks].count("_PerfLogs") == 1
    trainer.train()

    assert callback.summary.steps.measured == 6
    assert callback.summary.throughput.samples_per_s == pytest.approx(BATCH * callback.summary.throughput.steps_per_s)
    events = EventAccumulator(str(next(Path(args.output_dir).rglob("events.out.tfevents*")).parent))
    events.Reload()
    # The TensorBoard integration logs training keys under train/; at step 2 the warm-up had just ended.
    assert [event.step for event in events.Scalars("train/perf/step_time")] == [4, 6, 8]
    assert all(event.value > 0 for event in events.Scalars("train/perf/train_capacity"))
    assert not model._forward_hooks and not model._forward_pre_hooks  # removed at the end of training


def test_hf_evaluation_is_its_own_phase(transformers, tmp_path):
    from stepscope.integrations.hf import StepscopeCallback

    args = hf_args(transformers, tmp_path, max_steps=8, eval_strategy="steps", eval_steps=3, logging_steps=3)
    trainer = transformers.Trainer(
        model=SleepyRegressor(),
        args=args,
        train_dataset=SlowDataset(BATCH * 40, as_dict=True),
        eval_dataset=SlowDataset(2 * BATCH, sample_ms=10.0, as_dict=True),
    )
    callback = StepscopeCallback(warmup=2, system_interval_s=None, print_table=False).attach(trainer)
    trainer.train()

    summary = callback.summary
    # Evaluations of 8 samples x 10 ms, after steps 3, 6 and 8: three passes reported apart; the first two are cut
    # out of the measured steps they fell in, outside data_wait and forward.
    assert summary.eval["passes"] == 3 and summary.eval["mean_ms"] >= 80 and "eval" not in summary.phases
    # Had an evaluation leaked into them, the two steps with one would put p95 above 80 ms.
    assert summary.phases["data_wait"].p95_ms < BATCH * SAMPLE_MS + 40
    assert summary.phases["forward"].p95_ms < FORWARD_MS + 40
    eval_logs = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    assert len(eval_logs) == 3 and not any("perf/step_time" in entry for entry in eval_logs)


def test_hf_compiled_model_counts_its_samples_without_forward_hooks(transformers, tmp_path):
    from stepscope.integrations.hf import StepscopeCallback

    args = hf_args(
        transformers, tmp_path, max_steps=6, logging_steps=3, torch_compile=True, torch_compile_backend="eager"
    )
    model = SleepyRegressor(forward_ms=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=SlowDataset(BATCH * 8, 0, as_dict=True))
    callback = StepscopeCallback(warmup=2, system_interval_s=None, print_table=False).attach(trainer)
    trainer.train()

    summary = callback.summary
    assert summary.steps.measured == 4
    assert "backward" not in summary.phases  # the compiled graph runs no module hook: forward holds both
    assert summary.throughput.samples_per_s == pytest.approx(BATCH * summary.throughput.steps_per_s)


def test_hf_disabled_adds_no_hook_and_gives_no_summary(transformers, tmp_path, monkeypatch):
    from stepscope.integrations import _noop
    from stepscope.integrations.hf import StepscopeCallback

    monkeypatch.setenv("STEPSCOPE", "0")
    model = SleepyRegressor(forward_ms=0)
    hooks_seen: list[int] = []

    class Watch(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            hooks_seen.append(len(model._forward_hooks) + len(model._forward_pre_hooks))

    args = hf_args(transformers, tmp_path, max_steps=3, logging_steps=1)
    capture = log_capture(transformers)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=SlowDataset(BATCH * 4, 0, as_dict=True), callbacks=[Watch(), capture]
    )
    callback = StepscopeCallback().attach(trainer)
    assert all(getattr(callback, hook) is _noop for hook in StepscopeCallback.HOOKS)
    trainer.train()
    assert hooks_seen == [0, 0, 0] and callback.summary is None
    assert not any("perf/step_time" in log for log in capture.logs)


def test_hf_error_inside_stepscope_does_not_stop_training(transformers, tmp_path, monkeypatch, caplog):
    import stepscope.integrations.hf as integration

    def broken(batch):
        raise RuntimeError("boom")

    monkeypatch.setattr(integration, "batch_samples", broken)
    model = SleepyRegressor(forward_ms=0)
    args = hf_args(transformers, tmp_path, max_steps=4, logging_steps=1)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=SlowDataset(BATCH * 8, 0, as_dict=True))
    callback = integration.StepscopeCallback(warmup=0, system_interval_s=None, print_table=False).attach(trainer)
    with caplog.at_level(logging.WARNING, logger="stepscope"):
        trainer.train()
    assert trainer.state.global_step == 4
    warnings = [r.getMessage() for r in caplog.records if "stepscope stopped measuring" in r.getMessage()]
    assert warnings == ["stepscope stopped measuring after an internal error (RuntimeError: boom); training continues."]
    assert any("RuntimeError: boom" in note for note in callback.summary.notes)
    assert not model._forward_hooks and not model._forward_pre_hooks


# -- both --------------------------------------------------------------------------------------------------------


def test_bad_option_raises_at_construction():
    from stepscope.integrations import Measuring

    class Probe(Measuring):
        pass

    with pytest.raises(ValueError, match="warmup must be >= 0"):
        Probe()._configure(True, -1, 20, None, None, None, None, True)
    with pytest.raises(ValueError, match="interval_s"):
        Probe()._configure(True, 0, 20, None, None, 0.001, None, True)


def test_a_missing_framework_names_the_extra():
    with pytest.raises(ImportError, match=r"pip install 'stepscope\[lightning\]'"):
        require("stepscope_no_such_module", "lightning")


def test_import_stepscope_needs_no_framework():
    code = (
        "import sys, stepscope, stepscope.integrations; "
        "print(sorted(m for m in ('lightning', 'transformers', 'accelerate') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
