"""Tells validation passes from training work in an unmodified script's events.

A validation pass is forwards without gradients (``torch.no_grad``/``inference_mode``) or of a module in
``eval()`` mode, between training steps: they begin before the step has done any training work (a forward with
gradients, a backward, an optimizer step). From the first such forward the time is the pass's (``Scope``'s eval
window: phases go to the pass, and its wall time leaves the step) until training resumes.

Training resumes at a fetch from a *training* loader (one whose batches fed a backward), or at a training
forward, backward or optimizer step. In the second case the stretch may have been part of the step after all: a
frozen teacher's forward before the student's, a model kept in ``eval()`` while fine-tuning. It is kept apart
only when it fetched batches between its forwards (a validation loop over a loader), ran at least
``MIN_PASS_FORWARDS`` forwards, or ran on nothing fetched since the step's training work (tensors in memory);
otherwise its time goes back into the step. The validation loader's fetches
just before the first forward (``iter(val_loader)`` and its first batch) belong to the pass and move into it when
it fetches from that loader again. So does a batch of a training loader fetched just before the first forward when
the pass ends at the next fetch from a training loader: an evaluation on the training loader's next batches, which
no training work used (counted as the step's, they overstated samples/s by the share of batches evaluated), with the
epoch restart that fetching it began with (the exhausted iterator's end and ``iter(loader)``, which starts workers).

Validation recurs now and then; work that recurs in every step is step work, whatever its grad mode: a reference
model's or teacher's forward, metrics, an EMA update, test-time augmentation. So a kept stretch is only
*tentatively* a pass: when the next step cuts out a stretch too, both go back into their steps (the Scope holds
the first step back until then), and from then on, while every step has such a stretch, none is cut out at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MIN_PASS_FORWARDS = 4  # forwards without a validation loader that make a pass rather than part of a step


@dataclass(slots=True)
class _Fetch:
    loader: int | None
    start_ns: int
    ns: int
    samples: int
    batch: bool


@dataclass
class EvalDetector:
    """The state machine behind ``stepscope run``'s eval phase; the tracker reports events to it and applies what
    it decides to the Scope (``_begin_eval``/``_end_eval``) and to the step's counts."""

    training_loaders: set[int] = field(default_factory=set)
    open: bool = False
    fresh: bool = True  # no training work since the step closed
    forwards: int = 0  # in the open pass
    batches: int = 0
    samples: int = 0
    fetched: bool = False  # the open pass fetched a batch after its first forward: a loop over a loader
    # Stretches of evaluation recur step after step: they are step work, and no pass is opened for them.
    recurring: bool = False
    _side_now: bool = False  # this step had such a stretch (kept as a pass, or left in the step while recurring)
    _side_before: bool = False  # so did the step before it
    _forwards_now: int = 0  # forwards of the stretches kept as passes in this step
    _forwards_before: int = 0  # and in the step before
    _before: list[_Fetch] = field(default_factory=list)  # fetches from loaders aside just before the open pass
    _pass_loaders: set[int | None] = field(default_factory=set)  # loaders the open pass fetched from
    _step_loaders: set[int] = field(default_factory=set)  # loaders fetched from in this step, outside passes
    _fetches: list[_Fetch] = field(default_factory=list)  # this step's fetches since its last training event
    # The last pass ended at a training loader's fetch, and no training work came since: a pass that begins now
    # goes on that one (an evaluation over the training loader's next batches is one pass, not one per batch)
    _resumable: bool = False
    _resumes: bool = False  # the open pass goes on the last one
    _side_ns: int = 0  # when this step's recurring side work last ran a forward

    def fetch_begin(self, tracker: Any, loader: int | None, now: int) -> None:
        """A fetch from ``loader`` begins: one from a training loader ends an open pass."""
        if self.open and self._trains(loader):
            self._end(tracker, now, keep=True, by_fetch=True)

    def fetch_end(self, loader: int | None, start_ns: int, end_ns: int, samples: int, batch: bool) -> bool:
        """A fetch ended; True when it belongs to an open pass (its batch and samples are not the step's)."""
        if self.open:
            self.fetched = True
            self._pass_loaders.add(loader)
            self.batches += batch
            self.samples += samples
            return True
        if loader is not None:
            self._step_loaders.add(loader)
        self._fetches.append(_Fetch(loader, start_ns, end_ns - start_ns, samples, batch))
        return False

    def forward(self, tracker: Any, module: Any, grad_enabled: bool, now: int) -> bool:
        """An outermost forward begins; True when it is part of a validation pass."""
        evaluating = not grad_enabled or not getattr(module, "training", True)
        if self.open:
            if evaluating:
                self.forwards += 1
                return True
            self._end(tracker, now, keep=self._kept())
        elif evaluating and self.fresh:
            # While every step has such a stretch it stays in the step, unless it loops over a loader of its own
            # (a validation pass after the step's recurring side work: the validation loader's first fetch came
            # before this forward), or follows that side work with a training loader's batch of its own (a
            # validation on the training loader's next batches).
            if not self.recurring or self._aside() or self._after_side_work():
                self._begin(tracker, now)
                self.forwards = 1
                return True
            self._side_now = True
            self._side_ns = now
        if not evaluating:
            self._trained()
        return False

    def training(self, tracker: Any, now: int) -> None:
        """A backward or an optimizer step begins: training work."""
        if self.open:
            self._end(tracker, now, keep=self._kept())
        self._trained()

    def step_closed(self, tracker: Any) -> None:
        """The step closed. Two steps in a row with a stretch of evaluation make it recurring step work: the
        Scope puts both back into their steps, and the forwards they held count as the steps' own."""
        if self._side_now and self._side_before and not self.recurring:
            tracker.give_to_step(self._forwards_before + self._forwards_now, 0, 0)
        self.recurring = self._side_now and (self._side_before or self.recurring)
        self._side_before, self._side_now = self._side_now, False
        self._forwards_before, self._forwards_now = self._forwards_now, 0
        self.fresh = True
        self._resumable = False
        self._fetches.clear()
        self._step_loaders.clear()

    def _trained(self) -> None:
        self.fresh = False
        self._resumable = False
        self.training_loaders |= self._step_loaders
        self._fetches.clear()

    def _trains(self, loader: int | None) -> bool:
        """Whether ``loader`` is a training loader: its batches fed a backward (None, a source that is no loader's,
        never is)."""
        return loader is not None and loader in self.training_loaders

    def _aside(self) -> list[_Fetch]:
        """This step's fetches since its last training event from loaders that do not feed training."""
        return [f for f in self._fetches if not self._trains(f.loader)]

    def _after_side_work(self) -> bool:
        """This step's recurring side work ran, and a training loader's batch was fetched after it."""
        return self._side_now and any(
            f.batch and self._trains(f.loader) and f.start_ns > self._side_ns for f in self._fetches
        )

    def _owns(self, fetch: _Fetch, by_fetch: bool) -> bool:
        """Whether a fetch made just before the pass was the pass's: one from a loader aside that the pass fetched
        from again, or a training loader's batch that no training work used before the next training fetch."""
        if self._trains(fetch.loader):
            return by_fetch and fetch.batch
        return fetch.loader in self._pass_loaders

    def _owned(self, by_fetch: bool) -> list[_Fetch]:
        """The fetches made just before the pass that were the pass's (``_owns``), with what fetching an owned
        training batch took before it: the end of the loader's exhausted iterator and ``iter(loader)``, where an
        epoch restart starts its workers (left in the step, they held most of the batch's wait)."""
        owned: list[_Fetch] = []
        batch_of: set[int | None] = set()  # loaders whose owned batch came later
        for fetch in reversed(self._before):
            if self._owns(fetch, by_fetch):
                owned.append(fetch)
                if fetch.batch:
                    batch_of.add(fetch.loader)
            elif not fetch.batch and fetch.loader in batch_of:
                owned.append(fetch)
            else:
                batch_of.discard(fetch.loader)  # a batch the step kept: what came before it was its fetch
        return owned[::-1]

    def _is_pass(self) -> bool:
        return self.fetched or self.forwards >= MIN_PASS_FORWARDS

    def _kept(self) -> bool:
        """Whether a stretch that training work ended is kept apart (tentatively, as every pass is): it looped over
        a loader or ran ``MIN_PASS_FORWARDS`` forwards; or no batch was fetched since the step's last training work
        (tensors in memory, batches ``itertools.cycle`` replays), so it is no side work on the step's own batch: a
        validation every N steps, or work that recurs every step, which the next step tells apart."""
        return self._is_pass() or not any(f.batch for f in self._before)

    def _begin(self, tracker: Any, now: int) -> None:
        # `for x in val_loader` fetches before its first forward: those fetches join the pass at its end if it
        # fetched from the same loader again (a loop over it), and stay in the step otherwise (the training batch
        # that side work ran on before the training forward). A training loader's batch fetched before the pass
        # joins it when the pass ends at the next fetch from a training loader: no training work ever used that
        # batch (an evaluation on the training loader's next batches).
        self._before = list(self._fetches)
        self._fetches.clear()
        self._resumes, self._resumable = self._resumable, False
        tracker.scope._begin_eval(now)
        self.open = True
        self.fetched = False
        self.batches = self.samples = 0
        self._pass_loaders = set()

    def _end(self, tracker: Any, now: int, keep: bool, by_fetch: bool = False) -> None:
        """The open pass ends at ``now``: at a fetch from a training loader (``by_fetch``), or at training work."""
        moved = self._owned(by_fetch) if keep else []
        if moved:
            batches, samples = sum(f.batch for f in moved), sum(f.samples for f in moved)
            self.batches += batches
            self.samples += samples
            tracker.take_from_step(batches, samples)
            # the pass's loaders, not training's
            self._step_loaders -= {f.loader for f in moved if not self._trains(f.loader)}
        tracker.scope._end_eval(
            now,
            keep=keep,
            forwards=self.forwards,
            batches=self.batches,
            tentative=True,
            moved={"data_wait": sum(f.ns for f in moved)} if moved else None,
            moved_start_ns=min((f.start_ns for f in moved), default=None),
            resumes=self._resumes and keep,
        )
        self._resumable = by_fetch and keep
        # Kept as a pass or given back as too short for one, this step had a stretch of evaluation: work that
        # recurs every step (a metric, a teacher) is step work, also in a step where a validation pass follows it
        self._side_now = True
        if keep:
            self._forwards_now += self.forwards
        else:
            tracker.give_to_step(self.forwards, self.batches, self.samples)
        self.open = False
        self.forwards = self.batches = self.samples = 0
        self._before = []
        self._pass_loaders = set()
