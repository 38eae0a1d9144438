"""Lightning: ``StepscopeCallback`` times every training step of ``Trainer.fit`` and reports it to the loggers.

```python
from stepscope.integrations.lightning import StepscopeCallback

trainer = L.Trainer(callbacks=[StepscopeCallback(warmup=20)], ...)
trainer.fit(model, datamodule)     # perf/* reach trainer.loggers; the table prints when training ends
```

One phase is open at a time (time is exclusive, as in ``stepscope run``); each hook closes the open phase and
opens the next one:

=============  ==========================================================================================
data_wait      the batch fetch: Lightning's ``[_TrainingEpochLoop].train_dataloader_next`` profiler action, and
               from ``on_train_epoch_start`` to an epoch's first fetch (making the iterator starts the workers)
h2d            ``Strategy.batch_to_device`` (its profiler action)
forward        ``on_train_batch_start`` until the next hook: training_step, and in manual optimization the
               rest of training_step around backward and optimizer steps
zero_grad      ``on_before_zero_grad`` -> ``on_before_backward``
backward       ``on_before_backward`` -> ``on_after_backward``
optimizer      ``on_before_optimizer_step`` -> the end of the ``optimizer_step`` profiler action
clip           ``configure_gradient_clipping`` (its profiler action), inside the optimizer step
eval           validation run inside fit (``on_validation_start`` -> ``on_validation_end``)
other          the rest: logging, progress bar, checkpoints, LR schedulers, Lightning's own bookkeeping
=============  ==========================================================================================

No callback hook marks the fetch, the transfer, clipping or the end of the optimizer step, while the Trainer
brackets each with an action of its profiler (``Trainer(profiler=...)``, a pass-through by default); the callback
taps the profiler's ``start``/``stop`` for those actions and passes every call on unchanged.

A step ends at an optimizer step (``on_train_batch_end`` of a batch in which an optimizer stepped): with
``accumulate_grad_batches=k`` one step is k batches. In manual optimization, every batch is a step until an
optimizer is seen stepping, and from then on only batches in which one steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from stepscope.integrations import Measuring, Session, batch_samples, guarded, require
from stepscope.sinks.base import Sink

require("lightning", "lightning")

from lightning.pytorch import Callback, LightningModule, Trainer  # noqa: E402


class StepscopeCallback(Measuring, Callback):
    """Times each training step of ``Trainer.fit`` and logs ``perf/*`` (s, samples/s) to ``trainer.loggers``.

    Args:
        enabled: False (or ``STEPSCOPE=0`` in the environment) makes every hook a no-op; ``STEPSCOPE=1`` forces on.
        warmup: steps (optimizer steps) to run before measuring, >= 0.
        window: steps behind the live ``perf/*`` metrics.
        sinks: extra ``stepscope.sinks`` (JsonlSink, TensorBoardSink, ...) the Scope writes to; closed at the end.
        log_every: log to the loggers and sinks every this many steps; None follows
            ``Trainer(log_every_n_steps=...)``.
        system_interval_s: seconds between host/GPU system samples (``sys/*``); None samples nothing.
        json_path: write the RunSummary as JSON here when training ends (``{rank}`` in it: one file per rank).
        print_table: print the phase table when training ends (on global rank 0).

    After ``fit``, ``callback.summary`` holds the RunSummary.
    """

    HOOKS = (
        "on_train_start",
        "on_train_epoch_start",
        "on_train_batch_start",
        "on_before_zero_grad",
        "on_before_backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "on_train_batch_end",
        "on_validation_start",
        "on_validation_end",
    )

    def __init__(
        self,
        enabled: bool = True,
        warmup: int = 20,
        window: int = 20,
        sinks: Iterable[Sink] | None = None,
        log_every: int | None = None,
        system_interval_s: float | None = 1.0,
        json_path: str | Path | None = None,
        print_table: bool = True,
    ) -> None:
        super().__init__()
        self._tap: _ProfilerTap | None = None
        self._stepped = False  # an optimizer stepped in the batch in progress
        self._steps_at_optimizer = False  # steps end at optimizer steps (learned in manual optimization)
        self._manual = False
        self._configure(enabled, warmup, window, sinks, log_every, system_interval_s, json_path, print_table)

    # -- the run ------------------------------------------------------------------------------------------------

    @guarded
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._release()
        self._manual = not pl_module.automatic_optimization
        self._steps_at_optimizer = not self._manual
        self._stepped = False
        self._start_session(self.log_every or trainer.log_every_n_steps)
        self._tap = _ProfilerTap(trainer, pl_module, self)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._release()
        try:
            boundary = "optimizer.step" if self._steps_at_optimizer else "training_step"
            self._finish_session(boundary, trainer.global_rank, trainer.world_size, trainer.is_global_zero)
        except Exception as error:
            self._fail(error)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._release()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._release()

    def _release(self) -> None:
        tap, self._tap = self._tap, None
        if tap is not None:
            tap.remove()

    # -- phases from the hooks ----------------------------------------------------------------------------------

    @guarded
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A new epoch makes the loader's iterator (and starts its workers) before the first fetch: data time.
        self._begin_between_batches("data_wait")

    @guarded
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        session = self._session
        if session is None:
            return
        session.samples += batch_samples(batch)
        session.switch("forward")

    @guarded
    def on_before_zero_grad(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self._switch("zero_grad")

    @guarded
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Any) -> None:
        self._switch("backward")

    @guarded
    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Manual optimization goes back to the user's training_step; automatic to Lightning's closure.
        self._switch("forward" if self._manual else None)

    @guarded
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self._stepped = True
        self._steps_at_optimizer = True
        self._switch("optimizer")

    @guarded
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        session = self._session
        if session is None:
            return
        if self._steps_at_optimizer and not self._stepped:
            session.switch(None)  # a batch of gradient accumulation: the step goes on
            return
        self._stepped = False
        session.close_step()
        metrics = session.log_due(self.log_every or trainer.log_every_n_steps)
        if metrics:
            # The step Lightning's own metrics of this batch are logged at (LearningRateMonitor reads it so too).
            step = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    @guarded
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._switch("eval")

    @guarded
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._switch(None)

    # -- phases from the profiler's actions ---------------------------------------------------------------------

    @guarded
    def _begin_between_batches(self, name: str) -> None:
        """A fetch or transfer for the training loop: only between batches (validation fetches its own)."""
        if self._session is not None and self._session.phase is None:
            self._session.switch(name)

    @guarded
    def _end_between_batches(self, name: str) -> None:
        if self._session is not None and self._session.phase == name:
            self._session.switch(None)

    @guarded
    def _begin_clip(self) -> None:
        if self._session is not None and self._session.phase == "optimizer":
            self._session.switch("clip")

    @guarded
    def _end_clip(self) -> None:
        if self._session is not None and self._session.phase == "clip":
            self._session.switch("optimizer")

    @guarded
    def _end_optimizer(self) -> None:
        if self._session is not None and self._session.phase == "optimizer":
            self._session.switch("forward" if self._manual else None)

    def _switch(self, name: str | None) -> None:
        session: Session | None = self._session
        if session is not None:
            session.switch(name)


class _ProfilerTap:
    """Wraps ``start``/``stop`` of the Trainer's profiler, on the instance, to see the actions that bound phases no
    callback hook marks; every call still reaches the profiler. ``remove()`` restores the instance as it was."""

    def __init__(self, trainer: Trainer, pl_module: LightningModule, callback: StepscopeCallback) -> None:
        module = type(pl_module).__name__
        fetch = f"[{type(trainer.fit_loop.epoch_loop).__name__}].train_dataloader_next"
        transfer = f"[Strategy]{type(trainer.strategy).__name__}.batch_to_device"
        self._on_start: dict[str, Callable[[], None]] = {
            fetch: lambda: callback._begin_between_batches("data_wait"),
            transfer: lambda: callback._begin_between_batches("h2d"),
        }
        self._on_stop: dict[str, Callable[[], None]] = {
            fetch: lambda: callback._end_between_batches("data_wait"),
            transfer: lambda: callback._end_between_batches("h2d"),
            # The end of optimizer_step: the module hook in automatic optimization, LightningOptimizer.step in manual.
            f"[LightningModule]{module}.optimizer_step": callback._end_optimizer,
            "optimizer_step": callback._end_optimizer,
        }
        # Lightning calls the clipping hook at every optimizer step; it clips only when configured to.
        overridden = type(pl_module).configure_gradient_clipping is not LightningModule.configure_gradient_clipping
        if trainer.gradient_clip_val or overridden:
            clip = f"[LightningModule]{module}.configure_gradient_clipping"
            self._on_start[clip] = callback._begin_clip
            self._on_stop[clip] = callback._end_clip
        self._profiler = profiler = trainer.profiler
        self._saved = {name: profiler.__dict__[name] for name in ("start", "stop") if name in profiler.__dict__}
        start, stop = profiler.start, profiler.stop
        on_start, on_stop = self._on_start, self._on_stop

        def tapped_start(action_name: str) -> None:
            hook = on_start.get(action_name)
            if hook is not None:
                hook()
            start(action_name)

        def tapped_stop(action_name: str) -> None:
            stop(action_name)
            hook = on_stop.get(action_name)
            if hook is not None:
                hook()

        profiler.start = tapped_start
        profiler.stop = tapped_stop

    def remove(self) -> None:
        profiler = self._profiler
        for name in ("start", "stop"):
            if name in self._saved:
                setattr(profiler, name, self._saved[name])
            else:
                profiler.__dict__.pop(name, None)
