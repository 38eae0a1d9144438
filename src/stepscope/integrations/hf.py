"""Hugging Face Trainer: ``StepscopeCallback`` times every optimizer step of ``Trainer.train`` and adds ``perf/*``
to the Trainer's logs.

```python
from stepscope.integrations.hf import StepscopeCallback

trainer = Trainer(model=model, args=args, train_dataset=dataset)
StepscopeCallback(warmup=20).attach(trainer)   # perf/* reach report_to (TensorBoard, W&B, MLflow, ...)
trainer.train()                                # the table prints when training ends
```

One phase is open at a time (time is exclusive, as in ``stepscope run``); each hook closes the open phase and
opens the next:

=============  ==========================================================================================
data_wait      from the last hook of the previous step (``on_step_end``, ``on_log``, ``on_save``,
               ``on_evaluate``, or ``on_epoch_begin``) to ``on_step_begin``: the Trainer fetches every
               micro-batch of the step there, moved to the device by accelerate's loader (so ``h2d`` is in it)
forward        the model's forward (a forward pre-hook and hook on the model), and the Trainer's input
               preparation from ``on_step_begin`` / ``on_substep_end`` to it
backward       from the end of the model's forward to ``on_substep_end`` (a micro-batch of gradient
               accumulation) or ``on_pre_optimizer_step``: the loss scaling, backward, the Trainer's loss
               bookkeeping and, when ``max_grad_norm > 0``, gradient clipping
optimizer      ``on_pre_optimizer_step`` -> ``on_optimizer_step``: ``optimizer.step()``
zero_grad      ``on_optimizer_step`` -> ``on_step_end``: the LR scheduler's step and ``model.zero_grad()``
eval           an evaluation inside train, from the hook before its first prediction step to ``on_evaluate``
other          the rest: logging, checkpoints, other callbacks' step-end work
=============  ==========================================================================================

The Trainer calls no hook between backward and clipping, so clipping stays in ``backward``; nor before a step's
fetch, so the Trainer's own work after the last hook of a step (the progress bar, the checks that decide whether
to log or save) is counted in ``data_wait``: microseconds, next to any real wait for data.

A step is an optimizer step (``on_step_begin`` -> ``on_step_end``): with ``gradient_accumulation_steps=k`` it
holds k micro-batches, and its samples are those of every micro-batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from stepscope.clock import now_ns
from stepscope.integrations import Measuring, batch_samples, guarded, require
from stepscope.sinks.base import Sink

require("transformers", "hf")

import torch  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments  # noqa: E402


class StepscopeCallback(Measuring, TrainerCallback):
    """Times each optimizer step of ``Trainer.train`` and adds ``perf/*`` (s, samples/s) to the Trainer's logs.

    Args:
        enabled: False (or ``STEPSCOPE=0`` in the environment) makes every hook a no-op; ``STEPSCOPE=1`` forces on.
        warmup: optimizer steps to run before measuring, >= 0.
        window: steps behind the live ``perf/*`` metrics.
        sinks: extra ``stepscope.sinks`` (JsonlSink, TensorBoardSink, ...) the Scope writes to; closed at the end.
        log_every: write to the sinks every this many steps; None follows ``logging_steps``. The Trainer's logs get
            ``perf/*`` whenever the Trainer logs.
        system_interval_s: seconds between host/GPU system samples (``sys/*``); None samples nothing.
        json_path: write the RunSummary as JSON here when training ends (``{rank}`` in it: one file per rank).
        print_table: print the phase table when training ends (on the main process).

    Add it with ``attach(trainer)``, or ``Trainer(callbacks=[...])``: then ``perf/*`` reach ``log_history`` and
    the callbacks after it, but not the ``report_to`` integrations, which log before it. After ``train``,
    ``callback.summary`` holds the RunSummary.
    """

    HOOKS = (
        "on_train_begin",
        "on_epoch_begin",
        "on_step_begin",
        "on_substep_end",
        "on_pre_optimizer_step",
        "on_optimizer_step",
        "on_step_end",
        "on_log",
        "on_prediction_step",
        "on_evaluate",
        "on_save",
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
        self._handles: list[Any] = []
        self._mark_ns = 0  # the last hook after which the Trainer may fetch the next step's batches
        self._in_step = False
        self._in_eval = False
        self._count_batch = False  # the next forward starts a micro-batch: count its samples
        self._micro_batches = 0  # micro-batches in the step so far
        self._logged_step = -1
        self._configure(enabled, warmup, window, sinks, log_every, system_interval_s, json_path, print_table)

    def attach(self, trainer: Trainer) -> StepscopeCallback:
        """Add this callback to ``trainer`` after every other callback (so its step ends after theirs) and a
        companion before them that puts ``perf/*`` into the logs ahead of the ``report_to`` integrations."""
        handler = trainer.callback_handler
        # Once only, also when it was given in Trainer(callbacks=[...]) too: its hooks must not run twice a step.
        handler.callbacks = [
            c for c in handler.callbacks if c is not self and not (isinstance(c, _PerfLogs) and c.owner is self)
        ]
        trainer.add_callback(self)
        handler.callbacks.insert(0, _PerfLogs(self))
        return self

    # -- the run ------------------------------------------------------------------------------------------------

    @guarded
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model: Any = None, **kwargs: Any
    ) -> None:
        self._release()
        self._start_session(self.log_every or max(1, int(state.logging_steps)))
        self._in_step = self._in_eval = False
        self._logged_step = -1
        if model is not None:
            self._handles = [
                model.register_forward_pre_hook(self._forward_begins, with_kwargs=True),
                model.register_forward_hook(self._forward_ends),
            ]
        self._mark_ns = now_ns()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._release()
        try:
            self._finish_session("optimizer.step", args.process_index, args.world_size, state.is_world_process_zero)
        except Exception as error:
            self._fail(error)

    def _release(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    # -- the step -----------------------------------------------------------------------------------------------

    @guarded
    def on_epoch_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._mark_ns = now_ns()

    @guarded
    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        session = self._session
        if session is None:
            return
        session.switch("data_wait", since_ns=self._mark_ns)
        session.switch("forward")
        self._in_step = True
        self._count_batch = True
        self._micro_batches = 1

    def _forward_begins(self, module: Any, args: tuple, kwargs: dict) -> None:
        # A traced hook would break a compiled graph; compiled code runs without it.
        if self._in_step and not torch.compiler.is_compiling():
            self._enter_forward(args, kwargs)

    def _forward_ends(self, module: Any, args: tuple, output: Any) -> None:
        if self._in_step and not torch.compiler.is_compiling():
            self._leave_forward()

    @guarded
    def _enter_forward(self, args: tuple, kwargs: dict) -> None:
        session = self._session
        if session is None:
            return
        if self._count_batch:
            session.samples += batch_samples((args, kwargs))
            self._count_batch = False
        session.switch("forward")

    @guarded
    def _leave_forward(self) -> None:
        if self._session is not None:
            self._session.switch("backward")

    @guarded
    def on_substep_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._session is not None:
            self._session.switch("forward")
            self._count_batch = True
            self._micro_batches += 1

    @guarded
    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._session is not None:
            self._session.switch("optimizer")

    @guarded
    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._session is not None:
            self._session.switch("zero_grad")

    @guarded
    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        session = self._session
        if session is None:
            return
        self._in_step = False
        if not session.samples:
            # No forward hook ran (a compiled model runs without them): the configured batch size, an upper bound
            # for an epoch's last, partial batch.
            session.samples = args.per_device_train_batch_size * self._micro_batches
        session.close_step()
        self._mark_ns = now_ns()

    # -- between steps ------------------------------------------------------------------------------------------

    @guarded
    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if logs is not None:
            self._add_metrics(state, logs)
        self._mark_ns = now_ns()

    @guarded
    def on_prediction_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        session = self._session
        if session is None or self._in_step or self._in_eval:
            return
        # The evaluation began after the last hook; its first prediction step is the first sign of it.
        self._in_eval = True
        session.switch("eval", since_ns=self._mark_ns)

    @guarded
    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self._session is not None and self._in_eval:
            self._in_eval = False
            self._session.switch(None)
        self._mark_ns = now_ns()

    @guarded
    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._mark_ns = now_ns()

    def _add_metrics(self, state: TrainerState, logs: dict[str, Any]) -> None:
        """Add ``perf/*`` to a training log (once per step; not to evaluation logs) and to its ``log_history``
        entry, which the Trainer copied from ``logs`` just before calling the callbacks."""
        session = self._session
        if session is None or self._in_eval or state.global_step == self._logged_step:
            return
        metrics = session.scope.metrics()
        if not metrics:
            return
        self._logged_step = state.global_step
        logs.update(metrics)
        if state.log_history:
            state.log_history[-1].update(metrics)


class _PerfLogs(TrainerCallback):
    """Put ``perf/*`` into the Trainer's logs before the ``report_to`` integrations read them (``attach``)."""

    def __init__(self, owner: StepscopeCallback) -> None:
        self.owner = owner

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        owner = self.owner
        if logs is None or not owner.enabled or owner._failure is not None:
            return
        try:
            owner._add_metrics(state, logs)
        except Exception as error:
            owner._fail(error)
