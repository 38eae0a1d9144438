"""Framework integrations: callbacks that time each training step from a framework's own hooks.

- ``stepscope.integrations.lightning.StepscopeCallback``: Lightning ``Trainer.fit`` (``pip install
  'stepscope[lightning]'``).
- ``stepscope.integrations.hf.StepscopeCallback``: the Hugging Face ``Trainer`` (``pip install 'stepscope[hf]'``).

A framework calls hooks at instants rather than around code, so a callback keeps one phase open at a time and
switches it at each hook (``Session.switch``); time between hooks that open no phase is ``other``. This module
holds what the two callbacks share and imports neither framework, so ``import stepscope`` never needs them.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from stepscope.analyses.batches import batch_samples  # noqa: F401 (the callbacks' samples; tests patch it there)
from stepscope.clock import now_ns
from stepscope.scope import enabled_scope, env_enabled
from stepscope.sinks.base import Sink
from stepscope.summary import RunSummary

log = logging.getLogger("stepscope")

F = TypeVar("F", bound=Callable[..., Any])


def require(module: str, extra: str) -> ModuleType:
    """Import ``module``, or raise an ImportError that names the stepscope extra installing it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"stepscope's {extra} integration needs the '{module}' package: pip install 'stepscope[{extra}]'"
        ) from error


class BackdatingClock:
    """``perf_counter_ns``, except that the next reading can be set to an earlier instant.

    Some spans are known only when they end: the Hugging Face Trainer fetches the next batch between the hooks
    of two steps, and only ``on_step_begin`` says that the wait since the last hook was the fetch. Setting the
    next reading to that hook's instant lets ``Session.switch`` open the phase where the span began.
    """

    __slots__ = ("next_ns",)

    def __init__(self) -> None:
        self.next_ns: int | None = None

    def __call__(self) -> int:
        if self.next_ns is None:
            return now_ns()
        reading, self.next_ns = self.next_ns, None
        return reading


class Session:
    """One measured training run: its Scope, the phase open now, and the samples of the step in progress.

    Args:
        scope_options: keyword arguments of ``Scope`` (warmup, window, sinks, log_every, ...).
    """

    def __init__(self, scope_options: dict[str, Any]) -> None:
        self.clock = BackdatingClock()
        self.scope = enabled_scope(clock=self.clock, **scope_options)
        self.phase: str | None = None  # the name of the open phase
        self._held: Any = None  # the open phase's context manager, entered by hand
        self.samples = 0  # samples (first dimension of the batch) in the step so far
        self.steps = 0  # steps closed

    def switch(self, name: str | None, since_ns: int | None = None) -> None:
        """Close the open phase and open ``name`` (None: none, so the time until the next switch is ``other``).

        ``since_ns`` opens it at that earlier instant (a ``perf_counter_ns`` reading), for a span known only at
        its end."""
        held, self._held = self._held, None
        if held is not None:
            held.__exit__(None, None, None)
        self.phase = name
        if name is None:
            return
        phase = self.scope.phase(name)
        self.clock.next_ns = since_ns
        phase.__enter__()
        self.clock.next_ns = None  # a scope stopped by an error hands out a phase that reads no clock
        self._held = phase

    def close_step(self) -> None:
        """Close the step in progress with the samples counted since the last one."""
        self.switch(None)
        self.scope.step(self.samples or None)
        self.samples = 0
        self.steps += 1

    def log_due(self, every: int) -> dict[str, float]:
        """``Scope.metrics()`` when the step just closed is a multiple of ``every``, else nothing (s, samples/s)."""
        return self.scope.metrics() if self.steps % every == 0 else {}

    def finish(self, boundary: str, rank: int, world_size: int, failure: str | None) -> RunSummary:
        """Close the scope (sampler, sinks) and return the run's summary, with the verdict, for this rank;
        ``boundary`` says what closed a step (``steps.boundary``)."""
        self.switch(None)
        self.scope.close()
        summary = self.scope.summary()
        summary.steps.boundary = boundary
        if world_size > 1:
            summary.meta.rank, summary.meta.world_size = rank, world_size
        if failure:
            summary.notes.append(f"the callback stopped measuring after an internal error: {failure}")
        return summary


def report(summary: RunSummary, json_path: str | Path | None, print_table: bool, rank: int, is_main: bool) -> None:
    """Print the summary's table on the main process and write its JSON: a path with ``{rank}`` is written by
    every rank, any other path by the main process only."""
    if print_table and is_main:
        from stepscope.report.terminal import print_summary

        print_summary(summary)
    if json_path is None:
        return
    path = str(json_path)
    if "{rank}" in path:
        summary.to_json(path.format(rank=rank))
    elif is_main:
        summary.to_json(path)


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


class Measuring:
    """What both callbacks share: the options, the enabled switch, and stopping after an internal error.

    A subclass names its measuring hooks in ``HOOKS``; when disabled (argument or ``STEPSCOPE=0``) or after an
    internal error they are replaced on the instance by a no-op, so they cost one call and nothing else.
    """

    HOOKS: tuple[str, ...] = ()

    def _configure(
        self,
        enabled: bool,
        warmup: int,
        window: int,
        sinks: Iterable[Sink] | None,
        log_every: int | None,
        system_interval_s: float | None,
        json_path: str | Path | None,
        print_table: bool,
    ) -> None:
        self.enabled = env_enabled(enabled)
        self.json_path = json_path
        self.print_table = print_table
        self.log_every = log_every  # None: the trainer's own logging interval, read when training starts
        self.summary: RunSummary | None = None
        self._scope_options: dict[str, Any] = {
            "warmup": warmup,
            "window": window,
            "sinks": list(sinks) if sinks else None,
            "system_interval_s": system_interval_s,
        }
        self._session: Session | None = None
        self._failure: str | None = None
        if not self.enabled:
            self._silence()
            return
        _check_options({**self._scope_options, "log_every": log_every or 1})

    def _start_session(self, log_every: int) -> Session:
        """A new Session whose Scope writes its sinks every ``log_every`` steps."""
        self._failure = None
        self._session = Session({**self._scope_options, "log_every": log_every})
        return self._session

    def _finish_session(self, boundary: str, rank: int, world_size: int, is_main: bool) -> None:
        session, self._session = self._session, None
        if session is None:
            return
        self.summary = session.finish(boundary, rank, world_size, self._failure)
        report(self.summary, self.json_path, self.print_table, rank, is_main)

    def _silence(self) -> None:
        for name in self.HOOKS:
            setattr(self, name, _noop)

    def _release(self) -> None:
        """Undo what the callback installed in the framework (hooks, taps); a subclass extends it."""

    def _fail(self, error: BaseException) -> None:
        """Stop measuring after an internal error; training goes on and the summary says why it stopped."""
        if self._failure is None:
            self._failure = f"{type(error).__name__}: {error}"
            log.warning("stepscope stopped measuring after an internal error (%s); training continues.", self._failure)
        self._silence()
        try:
            self._release()
        except Exception as again:
            log.debug("stepscope could not undo its hooks: %r", again)


def guarded(hook: F) -> F:
    """Run a callback hook so that an error inside stepscope stops measuring instead of reaching training."""

    @functools.wraps(hook)
    def run(self: Measuring, *args: Any, **kwargs: Any) -> Any:
        try:
            return hook(self, *args, **kwargs)
        except Exception as error:
            self._fail(error)
            return None

    return run  # type: ignore[return-value]


def _check_options(options: dict[str, Any]) -> None:
    """Raise the Scope's own ValueError for a bad option now, at construction, not in the middle of training."""
    from stepscope.collectors.sampler import check_interval

    if options["system_interval_s"] is not None:
        check_interval(options["system_interval_s"])
    enabled_scope(**{**options, "sinks": None, "system_interval_s": None})
