"""What auto-instrumentation knows about a running script: which phase owns the clock, where steps end, what
the loaders did.

Hooks (hooks.py) report events — a fetch began, the outermost module call ended, an optimizer stepped — and the
tracker turns them into phase time on a Scope. Time is exclusive: the innermost open phase owns the clock, so an
``.item()`` inside forward is ``sync`` time and the forward/backward that LBFGS runs inside ``optimizer.step``
are forward and backward time.

Step boundary: the optimizer step. With several optimizers (a GAN), one step is one round: the step closes after
the last optimizer of the round (learned while running). A script that never builds an optimizer is stepped by
its backward calls: the step closes when the next iteration begins (next fetch, forward or backward).
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from stepscope.analyses.batches import batch_samples, batch_tensors
from stepscope.analyses.params import NO_AUDIT, ModelAuditor, NoAudit
from stepscope.clock import HOST_ONLY
from stepscope.collectors.malloc import allocator, minor_faults, threshold_env, tuned_in_env, us_per_fault
from stepscope.doctor import facts
from stepscope.doctor.verdict import classify
from stepscope.instrument import DEFAULT_STACK_HZ
from stepscope.instrument.apply import Injector
from stepscope.instrument.evaluation import EvalDetector
from stepscope.instrument.loss import LossBuffer
from stepscope.instrument.own_cost import overhead, own_threads_cpu_ns, threads_cpu_between
from stepscope.record import EVAL_PHASE, NO_STEP_MARK
from stepscope.scope import Scope, own_scope_note, script_scopes
from stepscope.stream import NO_STREAM
from stepscope.summary import MAX_LOSS_STEPS, Epoch, Exit, LoaderInfo, Overhead, RunSummary

HOST_PHASES = frozenset({"data_wait"})
# Scalar reads (.item(), .tolist()) made here are not the script's own: torch's optimizer and clipping code (Adam
# reads its step counters) and the data pipeline.
QUIET_PHASES = frozenset({"optimizer", "clip", "zero_grad", "data_wait"})
COUNTERS = (
    "batches",
    "forward_calls",
    "backward_calls",
    "optimizer_steps",
    "item_calls",
    "host_syncs",
    "checkpoint_calls",
)
# The events that begin a step: once the requested steps are measured, the first of them ends the script.
STOP_EVENTS = ("fetch_begin", "forward_begin", "backward_begin", "optimizer_step_begin")
# Backward calls with an optimizer made but never stepped, after which each backward ends a step: the script updates
# its parameters by other means (a hand-written update beside an optimizer it only reads its learning rate from).
# Far above a first step's gradient accumulation. Without it, such a script waited for its first step until killed.
UNSTEPPED_BACKWARDS = 100
PROBES = 8  # forward passes (and attention calls) probed for runtime facts at the start of the measured window


class StopRun(SystemExit):
    """Ends the script like ``sys.exit(0)`` once the requested steps are measured. A SystemExit, so a script's
    ``except Exception`` does not swallow it and ``finally`` blocks still run."""

    def __init__(self) -> None:
        super().__init__(0)


@dataclass
class RunConfig:
    """What ``stepscope run`` asks of each instrumented process (passed through the environment as JSON)."""

    out_dir: str
    warmup: int = 20
    steps: int = 200
    stop: bool = True
    batch_size: int | None = None
    launcher: bool = False  # a launcher command: only processes that train write a summary
    parent_pid: int = 0  # stepscope's own pid: its direct child is the script (script and -m modes)
    launch_id: str | None = None  # this `stepscope run`'s own id: its processes' summaries carry it
    checkpoint_s: float = 30.0  # write the summary so far this often, so a killed process leaves its figures
    params_steps: int | None = None  # `stepscope params`: audit parameters over this many backward passes, then stop
    include_zero_grad: bool = False
    audit_continue: bool = False  # `stepscope doctor`: after the audit's backward passes, go on training unwatched
    system_interval_s: float | None = 1.0  # host/GPU sampling period over the measured steps; None: no sampling
    stack_sample_hz: float | None = DEFAULT_STACK_HZ  # training-thread stack samples per second (hotspots); None: none
    sinks: list[str] = field(default_factory=list)  # per-step metrics: "jsonl:PATH", "tensorboard:DIR", ...
    # `stepscope dataloader`: {batches, warmup, device, sweep, budget_s, sweep_batches, sweep_warmup, loader}; the
    # first iteration of a DataLoader (or of the chosen one) is measured alone and the script stopped
    loader_job: dict[str, Any] | None = None
    ceiling_batches: int | None = None  # `stepscope doctor`: after the measured steps, the loader alone this long
    ceiling_time_s: float = 20.0
    # `stepscope doctor --sweep`: after the ceiling, sweep that loader's settings within this many seconds, ranked by
    # the rate the measured steps would reach with each; None: no sweep
    ceiling_sweep_s: float | None = None
    # `--trace DIR`: a torch.profiler window {dir, wait, warmup, active, repeat, record_shapes, with_stack}
    profile: dict[str, Any] | None = None
    nvtx: bool = False  # phases as NVTX ranges
    nsys_window: str | None = None  # "START:STOP": cudaProfilerStart/Stop around those steps
    apply: list[dict[str, Any]] = field(default_factory=list)  # `--apply`: fixes to inject, each {id, value}


class _Mark(NamedTuple):
    """Counters at one end of the measured window: stepscope's handler time, its threads' CPU, the page faults."""

    hook_ns: int
    threads_ns: dict[int, int] | None
    faults: int


MIN_FAULTS_TO_PRICE = 5  # page faults a step below which their cost is not measured (it cannot matter)


@dataclass
class _LoaderState:
    info: LoaderInfo
    loader: weakref.ref[Any]
    epochs: int = 0
    epoch_start_ns: int = 0
    epoch_batches: int = 0
    epoch_samples: int = 0
    epoch_stall_ns: int | None = None
    epoch_open: bool = False
    done: list[Epoch] = field(default_factory=list)
    step_at: int = -1  # the step its last fetch was in (the recorder's count of steps seen then)
    step_fetches: int = 0  # its batches fetched in that step, outside validation passes


def _guarded(method: Callable[..., Any]) -> Callable[..., Any]:
    """An event handler whose own errors stop measurement instead of reaching the user's script. Its time outside
    every phase (before the phase it opens, after the last one it closes) is stepscope's own, which the step holds
    as its ``stepscope`` phase: left in ``other``, it read as the script's time (20-80 µs an event beside busy
    loops). Inside a phase it stays that phase's, as it does for a timer around the call."""

    @functools.wraps(method)
    def guarded(self: Tracker, *args: Any, **kwargs: Any) -> Any:
        entered = self._clock()
        self._own_since = None if self._stack else entered
        try:
            return method(self, *args, **kwargs)
        except Exception as error:
            self.fail(error)
            return None
        finally:
            left = self._clock()
            self.hook_ns += left - entered  # stepscope's cost (summary.overhead), wherever the phases put it
            since = self._own_since
            if since is not None:
                self._own_since = None
                self.scope._add_own(left - since)

    return guarded


def no_samples_note(summary: RunSummary) -> str:
    """Why a run has no samples/s, and the ``--batch-size`` that would give it: the model's first input's first
    dimension times the backward passes a step (one per micro-batch; forwards would count a loss module's call too),
    where the facts hold that input (a guess the user confirms: a sequence-first model's first dimension is not its
    batch)."""
    said = "no samples/s: no batch size was known (no DataLoader batch reached the training loop)"
    inputs = summary.facts.get("inputs") or []
    shape = inputs[0].get("shape") if inputs else None
    if not shape:
        return f"{said}; `stepscope run --batch-size N` (samples per optimizer step) gives it."
    micro = round(summary.counters.get("backward_calls", 1.0), 3) or 1.0
    per_step = round(shape[0] * micro)
    count = f"{shape[0]} × {micro:g} backward passes a step" if micro != 1 else f"{shape[0]} a step"
    return (
        f"{said}; the model's first input was {tuple(shape)}: if its first dimension is the batch, "
        f"`stepscope run --batch-size {per_step}` ({count}) gives samples/s."
    )


class Tracker:
    """Turns hook events into exclusive phase time, step boundaries, loader epochs and per-step counters."""

    def __init__(self, scope: Scope, config: RunConfig) -> None:
        self.scope = scope
        self.config = config
        self._clock = scope._clock
        self.active = True
        self._stack: list[str] = []
        self._own_since: int | None = None  # during an event, outside every phase: when stepscope's own time began
        self.evals = EvalDetector()  # validation passes between steps: kept out of the step (see evaluation.py)
        self._fetch_loader: int | None = None
        self.watch_copies = False  # hooks.install: .to()/.cuda() are hooked, and look for the batch's tensors
        self._grad_enabled: Callable[[], bool] = sys.modules["torch"].is_grad_enabled
        self._tensor: type = sys.modules["torch"].Tensor
        self._losses = LossBuffer()  # each measured step's loss, kept without a sync
        # stepscope's own cost (own_cost.py): its handlers' time, its threads' CPU, at the measured window's ends
        self.hook_ns = 0
        self._training_thread = threading.get_native_id()  # whose page faults are the step's (malloc facts)
        # The thread the steps run on: the one that closes them (the main thread until one closes). The hooks pass
        # other threads' events by (a prefetcher's fetches, a model called in a thread of its own): the tracker's
        # phases are one thread's time line.
        self.thread = threading.main_thread().ident
        self._window_start = self._mark()
        self._window_end: _Mark | None = None
        scope._phase_of = self.phase_at  # the stack sampler reads the phase stack, not the Scope's phases
        # profiler/NVTX ranges around phases (`stepscope run --trace/--nvtx`); no-ops otherwise
        self._range_push = scope._ranges.push
        self._range_pop = scope._ranges.pop
        self._segment_start = 0
        self._segment_event: Any = None
        # step boundary
        self.boundary: str | None = None
        self.optimizers_created = 0
        self._round: set[int] = set()
        self._wrappers: dict[int, bool] = {}  # by optimizer id: whether it holds an optimizer it steps
        self._inner_stepped = False  # an optimizer stepped inside the open optimizer step
        self._closer: int | None = None
        self._backward_pending = False
        self._unstepped_backwards = 0  # backward calls while no optimizer has stepped yet
        # DDP's gradient all-reduce wait: the tail of backward after the last DDP gradient was accumulated
        self._ddp_tail: int | None = None  # the parameter whose gradient came last in the previous backward
        self._ddp_last: int | None = None  # the last one so far in this backward
        self._tail_split = False  # backward's open segment began at that gradient: it is comms, not backward
        # counters: cumulative over the run; snapshots at the last closed step and where measuring began
        self.seen = dict.fromkeys(COUNTERS, 0)
        self._seen_closed = dict(self.seen)
        self._seen_at_measure = dict(self.seen)
        self._step_samples = 0
        # the samples of batches fetched on other threads since the last step closed: the step's, when it got no
        # batch itself (a prefetcher that hands them over by other means than a queue); fetched ahead of the steps,
        # they overstate a short window's rate by what fills the prefetchers' buffers
        self._elsewhere_samples = 0
        self.loader_elsewhere = False  # a loader was iterated on another thread: the hooks time the hand-over
        self._handovers: dict[int, int] = {}  # id of a queue handing batches over -> its loader key (-1, -2, ...)
        self.stopped = False  # ended by StopRun
        self.stop_due = False  # the requested steps are measured: StopRun at the next step's first event
        self.outcome: Exit | None = None  # how the process ended, when known (error, signal)
        self.failure: str | None = None  # stepscope's own error that stopped measuring
        self.stream: Any = NO_STREAM  # the process's step stream (bootstrap opens one under `stepscope run`)
        # loaders
        self._loaders: dict[int, _LoaderState] = {}
        self._iterators: weakref.WeakKeyDictionary[Any, _LoaderState] = weakref.WeakKeyDictionary()
        self.in_fetch = False
        self.in_forward = False
        self.count_scalars = True  # the .item() hook's one check: active, and not inside QUIET_PHASES
        self.batch_ids: frozenset[int] = frozenset()
        self._last_checkpoint_ns = self._clock()
        self.on_checkpoint: Callable[[], None] | None = None
        self.audit: ModelAuditor | NoAudit = (
            NO_AUDIT if config.params_steps is None else ModelAuditor(config.params_steps, config.include_zero_grad)
        )
        # runtime facts for the doctor: probed at the first forward passes of the measured window
        self.probes_left = PROBES
        self.sdpa_probes_left = PROBES
        self._probed: dict[str, Any] = {}
        # Described when first seen: by exit time a script's main() has returned and its objects are gone.
        self._models: dict[int, dict[str, Any]] = {}
        self._optimizers: dict[int, dict[str, Any]] = {}
        # graphs compiled when measuring began; with no warm-up that is now, before torch.compile could run
        self._graphs_at_measure: int | None = 0 if scope._recorder.measuring else None
        self._h2d = {"copies": 0, "non_blocking": 0, "to_cuda": 0, "pinned_source": 0}
        self.zero_grad_set_to_none: bool | None = None
        self.facts_failure: str | None = None
        self.audited: list[Any] | None = None  # the parameter audits, once complete
        # model FLOPs: counted during the second warm-up step (the first one compiles and allocates)
        self._flop_counter: Any = None
        self._flops_state = "waiting" if config.warmup >= 2 else "off"
        self.peak_label: str | None = None  # the peak MFU is measured against, in words
        # `stepscope dataloader`
        self.constructed: list[weakref.ref[Any]] = []  # DataLoaders built so far, in order
        self.loader_result: dict[str, Any] | None = None
        self.fixes = Injector(config.apply)  # `--apply`: hooks.install installs what it needs (nothing without)

    # -- exclusive phase time ----------------------------------------------------------------------------------

    def _enter(self, name: str) -> None:
        """A phase begins; it owns the clock until it ends or an inner phase begins."""
        now = self._clock()
        if self.scope._step_start_ns is None:
            self.scope._step_start_ns = now
        if self._own_since is not None:
            self.scope._add_own(now - self._own_since)
            self._own_since = None
        if self._stack:
            self._close_segment(now)
        self._stack.append(name)
        self._range_push(name)
        self._open_segment(now)
        self.count_scalars = self.active and name not in QUIET_PHASES

    def _exit(self, name: str) -> None:
        """A phase ends; the phase it interrupted (if any) owns the clock again. Phases opened above it whose end
        was never reported (a hook that did not fire after an exception) end with it."""
        stack = self._stack
        if name not in stack:
            return  # already closed at a step boundary
        now = self._clock()
        self._close_segment(now)
        while True:
            self._range_pop()
            if stack.pop() == name:
                break
        if stack:
            self._open_segment(now)
        else:
            self._own_since = now  # the rest of this event is stepscope's own time
        self.count_scalars = self.active and not (stack and stack[-1] in QUIET_PHASES)

    def _open_segment(self, now: int) -> None:
        self._segment_start = now
        device = self.scope._device
        # Waiting for data launches no GPU work: events around it would only measure an idle GPU.
        self._segment_event = None if device is HOST_ONLY or self._stack[-1] in HOST_PHASES else device.start()

    def _close_segment(self, now: int, phase: str | None = None) -> None:
        top = phase or self._stack[-1]
        self.scope._add(top, now - self._segment_start)
        if self._segment_event is not None:
            self.scope._device.stop(top, self._segment_event)
            self._segment_event = None

    def phase_at(self, frame: Any) -> str | None:
        """The phase that owns the clock now (called from the stack sampler's thread): the innermost open phase,
        ``other`` when none is open, None once tracking stopped (a loader ceiling run is not the script's step)."""
        if not self.active:
            return None
        if self.scope._eval_window is not None:
            return EVAL_PHASE
        try:
            return self._stack[-1]
        except IndexError:
            return "other"

    def _count(self, counter: str) -> None:
        self.seen[counter] += 1

    def _loader_key(self, source: Any) -> int | None:
        """The index of the loader behind ``source`` (an iterator of it, or the loader), None for a new one."""
        state = self._iterators.get(source) if source is not None else None
        if state is None:
            state = self._loaders.get(id(source))
        return None if state is None else state.info.index

    def take_from_step(self, batches: int, samples: int) -> None:
        """Batches already counted in this step that a validation pass turned out to own."""
        self.seen["batches"] -= batches
        self._step_samples -= samples

    def give_to_step(self, forwards: int, batches: int, samples: int) -> None:
        """What a stretch thought to be a validation pass counted, back in the step (it was training work)."""
        self.seen["forward_calls"] += forwards
        self.seen["batches"] += batches
        self._step_samples += samples

    # The hooks' entry points: an error inside stops measurement instead of reaching the script. Methods of the
    # tracker call the unguarded versions, so each hook event pays for one guard.
    enter = _guarded(_enter)
    exit = _guarded(_exit)
    count = _count  # one increment: the guard's two clock reads would cost more than it

    # -- events from the hooks ---------------------------------------------------------------------------------

    @_guarded
    def epoch_begin(self, loader: Any, iterator: Any, start_ns: int) -> None:
        """``iter(loader)``, begun at ``start_ns``: a fresh pass over a DataLoader."""
        self._begin_epoch(loader, iterator, start_ns)

    def _begin_epoch(self, loader: Any, iterator: Any, start_ns: int) -> None:
        state = self._loaders.get(id(loader))
        if state is None:
            info = _describe_loader(loader, len(self._loaders))
            state = self._loaders[id(loader)] = _LoaderState(info, weakref.ref(loader))
        if state.epoch_open:
            self._end_epoch(state, complete=False)
        state.epoch_open = True
        state.epoch_start_ns = start_ns
        state.epoch_batches = state.epoch_samples = 0
        state.epoch_stall_ns = None
        self._iterators[iterator] = state

    @_guarded
    def fetch_begin(self, source: Any = None) -> int:
        """A fetch from ``source`` (a loader iterator, or the loader for ``iter(loader)``) begins."""
        return self._begin_fetch(self._loader_key(source))

    @_guarded
    def handover_begin(self, handover: Any) -> int:
        """The steps' thread waits for a batch that a thread iterating a loader hands over through ``handover`` (a
        queue): a fetch (``fetch_end`` gets what the queue gave), counted as the step's where the loader's other
        figures were counted on the other thread. The queue stands for its loader, so that the validation passes
        tell a training prefetcher's batches from a validation one's."""
        key = self._handovers.setdefault(id(handover), -1 - len(self._handovers))
        return self._begin_fetch(key)

    def _begin_fetch(self, loader: int | None) -> int:
        self._close_backward_step()
        self._fetch_loader = loader
        self.evals.fetch_begin(self, loader, self._clock())
        self.in_fetch = True
        self._enter("data_wait")
        return self._clock()

    @_guarded
    def fetch_end(self, iterator: Any, batch: Any, t0: int, exhausted: bool = False) -> None:
        self._exit("data_wait")
        self.in_fetch = False
        now = self._clock()
        state = None if iterator is None else self._iterators.get(iterator)
        samples = 0
        if batch is not None:
            if self.watch_copies:
                self.batch_ids = frozenset(map(id, batch_tensors(batch)))
            samples = batch_samples(batch)
        in_pass = self.evals.fetch_end(self._fetch_loader, t0, now, samples, batch is not None)
        if not in_pass and batch is not None:
            self._step_samples += samples  # a validation pass's batches are not the step's
            self._count("batches")
        if state is not None:
            self._count_fetch(state, t0, now, samples, batch, exhausted, in_pass)
            if batch is not None and not in_pass and state.info.num_workers:
                self._count_burst(state, now - t0)

    def _count_fetch(
        self, state: _LoaderState, t0: int, now: int, samples: int, batch: Any, exhausted: bool, in_pass: bool
    ) -> None:
        """A loader's fetch from ``t0`` to ``now`` (ns) into its figures: a batch of ``samples`` unless ``batch`` is
        None."""
        got = batch is not None
        if got and not state.info.tensors_per_batch:  # its first batch's (a walk of the batch: once)
            state.info.tensors_per_batch = len(batch_tensors(batch))
        state.info.fetch_s += (now - t0) / 1e9
        if in_pass:
            state.info.eval_fetch_s += (now - t0) / 1e9
            state.info.eval_batches += got
        if state.epoch_stall_ns is None:
            state.epoch_stall_ns = now - state.epoch_start_ns  # from iter(loader) to the first batch
        if got:
            state.info.batches += 1
            state.info.samples += samples
            state.epoch_batches += 1
            state.epoch_samples += samples
        if exhausted and state.epoch_open:
            self._end_epoch(state, complete=True)

    def _count_burst(self, state: _LoaderState, wait_ns: int) -> None:
        """A batch of a loader with workers fetched by the steps' thread: past the batches its workers hold ready, a
        fetch waits for one to be made (a burst, which the per-step data_wait does not show)."""
        step = self.scope._recorder.steps_seen
        if state.step_at != step:
            state.step_at, state.step_fetches = step, 0
        info = state.info
        if state.step_fetches >= info.num_workers * (info.prefetch_factor or 2):
            info.burst_fetches += 1
            info.burst_fetch_s += wait_ns / 1e9
        state.step_fetches += 1

    # A loader iterated on a thread other than the steps' (a prefetcher that hands batches over through a queue):
    # its epochs, batches and samples are counted, and a step that got no batch (through a queue) takes the samples
    # fetched meanwhile; no phase opens, the steps' time line is another thread's. Not guarded: the guard's account
    # of stepscope's own time belongs to the steps' thread (an error stops measuring all the same).

    def iter_elsewhere(self, make_iterator: Callable[[Any], Any], loader: Any) -> Any:
        """``iter(loader)`` on another thread: a new epoch of ``loader``; returns the iterator."""
        t0 = self._clock()
        iterator = make_iterator(loader)
        self._elsewhere(lambda: self._begin_epoch(loader, iterator, t0))
        return iterator

    def next_elsewhere(self, fetch: Callable[[Any], Any], iterator: Any) -> Any:
        """``next(iterator)`` of a loader's iterator on another thread; returns the batch."""
        t0 = self._clock()
        try:
            batch = fetch(iterator)
        except StopIteration:
            self._elsewhere(lambda: self._count_elsewhere(iterator, None, t0))
            raise
        self._elsewhere(lambda: self._count_elsewhere(iterator, batch, t0))
        return batch

    def _elsewhere(self, count: Callable[[], None]) -> None:
        try:
            self.loader_elsewhere = True
            count()
        except Exception as error:
            self.fail(error)

    def _count_elsewhere(self, iterator: Any, batch: Any, t0: int) -> None:
        samples = 0 if batch is None else batch_samples(batch)
        self._elsewhere_samples += samples
        state = self._iterators.get(iterator)
        if state is not None:
            self._count_fetch(state, t0, self._clock(), samples, batch, batch is None, in_pass=False)

    @_guarded
    def forward_begin(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """The outermost module call begins; returns False when it is not to be timed (inside one already)."""
        if self.in_forward or self.in_fetch or (self._stack and self._stack[-1] == "backward"):
            return False  # inside a forward already, a fetch, or backward's recomputation of checkpointed layers
        self.audit.see(module)
        self._close_backward_step()
        evaluating = self.evals.forward(self, module, self._grad_enabled(), self._clock())
        if not evaluating:
            if self.probes_left:
                self._probe(module, args, kwargs)
            self._count("forward_calls")
        self.in_forward = True
        self._enter("forward")
        return True

    @_guarded
    def forward_end(self) -> None:
        self.in_forward = False
        self._exit("forward")

    @_guarded
    def backward_begin(self, root: Any = None) -> bool:
        """A backward pass begins from ``root`` (the tensor, or the sequence of tensors, it differentiates)."""
        if self._stack and self._stack[-1] == "backward":
            return False  # a backward run inside one (from an autograd hook): part of it
        self._close_backward_step()
        self._keep_loss(root)
        self.evals.training(self, self._clock())
        self._count("backward_calls")
        self.audit.begin_backward()
        self._enter("backward")
        return True

    def _keep_loss(self, root: Any) -> None:
        """Keep a measured step's loss for the summary: the scalar a backward begins from, in ``LossBuffer`` (on its
        device until the run ends, so that no step waits for it; a CPU loss at once). In the warm-up, a device loss
        has its buffer made, which can wait for the device once."""
        recorder = self.scope._recorder
        step = recorder.measured
        if step >= MAX_LOSS_STEPS:
            return
        if isinstance(root, (list, tuple)) and len(root) == 1:
            root = root[0]
        if isinstance(root, self._tensor) and root.numel() == 1:
            if recorder.measuring:
                self._losses.add(step, root)
            else:
                self._losses.prepare(root)

    @property
    def backward_open(self) -> bool:
        """True while a backward pass runs (autograd's device threads may then report events)."""
        return "backward" in self._stack

    @_guarded
    def grad_ready(self, key: int, ddp: weakref.ref[Any]) -> None:
        """DDP parameter ``key``'s gradient was accumulated; DDP's reducer marks it ready right after.

        Once the last gradient is ready the reducer launches the last bucket's all-reduce, and backward ends by
        waiting for every bucket's all-reduce: from the last gradient to the end of backward, backward waits for
        the other ranks and the network, which is ``comms`` time. Which parameter comes last is fixed by the graph,
        so it is learned from the previous backward pass, and only its hook splits the phase (one clock read per
        other gradient). Should the order change, a later gradient puts the time since back into backward."""
        self._ddp_last = key
        if key == self._ddp_tail or self._tail_split:
            module = ddp()
            syncing = key == self._ddp_tail and getattr(module, "require_backward_grad_sync", True)
            if self._stack and self._stack[-1] == "backward":
                now = self._clock()
                self._close_segment(now)
                self._open_segment(now)
                self._tail_split = syncing

    @_guarded
    def backward_end(self) -> None:
        if self._ddp_last is not None:
            self._ddp_tail, self._ddp_last = self._ddp_last, None
        if self._tail_split:
            self._tail_split = False
            if self._stack and self._stack[-1] == "backward":
                now = self._clock()
                self._close_segment(now, "comms")
                # backward itself ended at the last gradient: the rest of it is the wait just counted
                self._segment_start, self._segment_event = now, None
        self._exit("backward")
        if self.boundary != "optimizer.step":
            self._unstepped_backwards += 1
            if self.optimizers_created == 0 or self._unstepped_backwards >= UNSTEPPED_BACKWARDS:
                self.boundary = "backward"
                self._backward_pending = True
        if self.audit.end_backward():
            self.audited = self.audit.audits()
            if self.config.audit_continue:
                self.audit.close()
                self.audit = NO_AUDIT
                return
            self.stopped = True
            self.stop_tracking()
            raise StopRun()

    @_guarded
    def optimizer_step_begin(self, optimizer: Any) -> bool:
        """``optimizer.step`` begins; returns False when it is not to be timed: it runs inside another optimizer's
        step (ZeroRedundancyOptimizer steps its local optimizer), whose time and step boundary it is part of."""
        if "optimizer" in self._stack:
            self._see_optimizer(optimizer)  # the local optimizer's settings are the ones the doctor advises on
            self._inner_stepped = True
            return False
        self._inner_stepped = False
        self.evals.training(self, self._clock())
        self._enter("optimizer")
        return True

    @_guarded
    def optimizer_step_end(self, optimizer: Any) -> None:
        """After ``optimizer.step``: close the step when this optimizer ends a round. A wrapper whose step stepped
        no optimizer it holds (one that accumulates: the loop calls its step every micro-batch, and it steps its
        inner optimizer every N-th) ends nothing: its micro-batches are one step's."""
        self._exit("optimizer")
        if not self._inner_stepped and self._wraps(optimizer):
            return
        self._count("optimizer_steps")
        self.boundary = "optimizer.step"
        self._backward_pending = False
        key = id(optimizer)
        self._see_optimizer(optimizer)
        if key not in self._round:
            # A new optimizer joins the round after those seen so far: it is now the one that ends a round.
            self._round.add(key)
            self._closer = key
        if key == self._closer:
            self.close_step()

    def _wraps(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` holds another optimizer (``self.optimizer``, ``self.base_optimizer``...)."""
        key = id(optimizer)
        wraps = self._wrappers.get(key)
        if wraps is None:
            base = sys.modules["torch"].optim.Optimizer
            held = vars(optimizer).values() if hasattr(optimizer, "__dict__") else ()
            wraps = self._wrappers[key] = any(isinstance(x, base) and x is not optimizer for x in held)
        return wraps

    def _see_optimizer(self, optimizer: Any) -> None:
        if id(optimizer) not in self._optimizers:
            self._optimizers[id(optimizer)] = self._describe(facts.describe_optimizer, optimizer)

    def fail(self, error: BaseException) -> None:
        """Stop measuring after an internal error, said once; the script runs on."""
        if self.failure is None:
            self.failure = f"{type(error).__name__}: {error}"
            print(
                f"stepscope: measurement stopped after an internal error ({self.failure}); the script runs on.",
                file=sys.stderr,
            )
        self.stop_tracking()

    def stop_tracking(self) -> None:
        """Hooks pass straight through from now on."""
        self.end_window()
        self.active = False
        self.count_scalars = False
        self.batch_ids = frozenset()

    def end_window(self) -> None:
        """The measured window has ended (the steps are measured, or the process is leaving): stepscope's own cost
        is counted up to here, before its threads stop (the first call counts)."""
        if self._window_end is None:
            self._window_end = self._mark()

    def _mark(self) -> _Mark:
        return _Mark(self.hook_ns, own_threads_cpu_ns(), minor_faults(self._training_thread))

    def _window(self) -> tuple[_Mark, _Mark]:
        """The measured window's counters at its start and its end (now, while it is still open)."""
        return self._window_start, self._window_end or self._mark()

    def _overhead(self, measured: int, step_ms: float | None) -> Overhead | None:
        start, end = self._window()
        threads_ns = threads_cpu_between(start.threads_ns, end.threads_ns)
        return overhead(end.hook_ns - start.hook_ns, threads_ns, measured, step_ms)

    def _malloc_tuning(self) -> list[str]:
        """The malloc settings in force: the environment's, less what ``--apply malloc.mmap_threshold`` put there
        itself (named once, as the fix)."""
        applied = self.fixes.mmap_threshold()
        own = {f"{name}={value}" for v in applied for name, value in threshold_env(v).items()}
        return [x for x in tuned_in_env() if x not in own] + [f"malloc.mmap_threshold={v}" for v in applied]

    def _malloc_facts(self, measured: int) -> dict[str, Any]:
        """The allocator and its page faults over the measured steps; a fault's cost is measured here (once, after
        the window: ~5 ms) only when there are enough faults for it to matter."""
        start, end = self._window()
        per_step = (end.faults - start.faults) / measured if measured else None
        found: dict[str, Any] = {
            "allocator": allocator(),
            "faults_per_step": None if per_step is None else round(per_step, 1),
            "us_per_fault": None,
            "tuned": self._malloc_tuning(),
        }
        if per_step is not None and per_step >= MIN_FAULTS_TO_PRICE:
            found["us_per_fault"] = round(us_per_fault(), 3)
        return found

    def sync(self, op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a host-device synchronisation as the ``sync`` phase (the op's own errors propagate)."""
        self._count("host_syncs")
        self._enter("sync")
        try:
            return op(*args, **kwargs)
        finally:
            self._exit("sync")

    # -- steps ---------------------------------------------------------------------------------------------------

    def _close_backward_step(self) -> None:
        """A script without an optimizer: its step closes where the next iteration's first event comes."""
        if self._backward_pending:
            self._backward_pending = False
            self.close_step()
            if self.stop_due:
                self._stop_run()  # the event that closed it begins the next step

    def close_step(self) -> None:
        """End the current step; once the requested steps are measured, arm the stop at the next step's first
        event (``_stop_at_next_event``)."""
        scope = self.scope
        open_phases = bool(self._stack)
        if open_phases:
            self._close_segment(self._clock())
        warming_up = not scope._recorder.measuring
        if warming_up:
            self._seen_at_measure = dict(self.seen)  # a warm-up step: measured counts start after it
        closed_before, self._seen_closed = self._seen_closed, dict(self.seen)
        self.thread = threading.get_ident()
        elsewhere, self._elsewhere_samples = self._elsewhere_samples, 0
        samples = self._step_samples or elsewhere or self.config.batch_size
        profiled = scope._recorder.profiled
        if self._own_since is not None:  # the ending step's share of this event
            scope._add_own(self._clock() - self._own_since)
        scope.step(batch_size=samples or None)
        if self._own_since is not None:
            self._own_since = scope._step_start_ns  # the rest is the next step's (from wherever it starts)
        self.evals.step_closed(self)
        if scope._recorder.profiled != profiled:  # a step recorded by torch.profiler: left out of the counts too
            for name in COUNTERS:
                self._seen_at_measure[name] += self._seen_closed[name] - closed_before[name]
        if self._flops_state != "off":
            self._count_flops()
        if warming_up and scope._recorder.measuring:
            self._begin_measuring()
        self._step_samples = 0
        if scope._failed:
            self.stop_tracking()
            return
        if self.on_checkpoint is not None and self._clock() - self._last_checkpoint_ns > self.config.checkpoint_s * 1e9:
            self._checkpoint(self.on_checkpoint)
        if open_phases:
            self._open_segment(scope._step_start_ns or self._clock())
        if self.config.stop and scope._recorder.measured >= self.config.steps:
            self.stop_tracking()
            self._measure_ceiling()
            self._stop_at_next_event()

    def _checkpoint(self, write: Callable[[], None]) -> None:
        """Write the figures so far (``on_checkpoint``) between two steps. The write is stepscope's time, not the
        script's: the next step's clock starts once it is done."""
        write()
        now = self._clock()
        self._last_checkpoint_ns = now
        if self.scope._step_start_ns is not None:
            self.scope._step_start_ns = now
            if self._own_since is not None:
                self._own_since = now  # the next step begins after the write

    def _stop_at_next_event(self) -> None:
        """The requested steps are measured: end the script with StopRun at the next step's first event (a fetch,
        forward, backward or optimizer step), not here, so that the last step's tail runs as it would (torch's
        optimizer wrapper, the script's own code after ``optimizer.step``). A script whose loop ends first just
        finishes. Only the thread that closed the step stops: a loader or model used from another thread (a
        prefetcher) goes on unwatched."""
        thread = threading.get_ident()
        for name in STOP_EVENTS:
            setattr(self, name, self._stop_or(getattr(self, name), thread))
        self.stop_due = True
        self.active = True  # for the hooks to reach the armed events; what is timed now is in no recorded step

    def _stop_or(self, event: Callable[..., Any], thread: int) -> Callable[..., Any]:
        def stop_here(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != thread:
                return event(*args, **kwargs)
            self._stop_run()

        return stop_here

    def _stop_run(self) -> None:
        self.stopped = True
        self.stop_tracking()
        raise StopRun()

    def _measure_ceiling(self) -> None:
        """`stepscope doctor`: the measured steps are done; iterate the loader the steps waited on most (its
        fetches took the most time outside validation passes) alone for a few batches (its ceiling), while every
        hook passes through. Not the one that gave most batches: loaders fetched in turn give as many each, and a
        prefetcher's slowest loader gives fewest, ahead of the steps by less than the others."""
        batches = self.config.ceiling_batches
        states = [s for s in self._loaders.values() if s.info.batches > 0]
        if not batches or not states:
            return
        state = max(states, key=lambda s: s.info.step_fetch_s)
        loader = state.loader()
        if loader is None:
            return
        from stepscope.analyses.loader import run_loader_job

        # the run's system figures (host CPU, loader workers seen, hotspots) are its steps', not the loader's alone
        self.scope.close()
        warmup = max(1, batches // 10)
        if state.info.length:  # short epochs: keep most of one epoch for measuring
            warmup = min(warmup, max(1, state.info.length // 5))
        job: dict[str, Any] = {"batches": batches, "warmup": warmup, "time_limit_s": self.config.ceiling_time_s}
        if self.config.ceiling_sweep_s is not None:
            from stepscope.analyses.loader import sweep_trials, trainer_ms_per_sample

            job.update(
                sweep_trials(batches, warmup),
                sweep=True,
                budget_s=self.config.ceiling_sweep_s,
                # the sweep ranks the settings by this rank's own measured step (its time besides the data wait)
                trainer_ms_per_sample=trainer_ms_per_sample(self.scope.summary(drain=True)),
            )
        self.loader_result = run_loader_job(loader, job, state.info.index)

    # -- `stepscope dataloader` ----------------------------------------------------------------------------------

    def capture(self, loader: Any) -> None:
        """``iter(loader)`` in loader-capture mode: measure the loader asked for alone, then stop the script.

        Loaders are numbered in the order the script builds them. Without ``loader`` in the job, the first
        iteration measures the largest loader built so far (a train loader built next to a validation one); with
        it, the script runs on until that loader exists."""
        from stepscope.analyses.loader import dataset_length, run_loader_job

        job = self.config.loader_job or {}
        built = [ref() for ref in self.constructed]
        if not any(c is loader for c in built):
            built.append(loader)  # built before the hooks went in
        wanted = job.get("loader")
        if wanted is None:
            index = max(range(len(built)), key=lambda i: _or_unknown(dataset_length(built[i])))
        elif wanted < len(built) and built[wanted] is not None:
            index = wanted
        else:
            return  # the loader asked for is not built yet: the script goes on
        target = built[index]
        self.stop_tracking()  # the measurement iterates the loader itself: every hook passes through
        self.loader_result = run_loader_job(target, job, index)
        self.loader_result["built"] = len(built)
        self.stopped = True
        raise StopRun()

    # -- model FLOPs ---------------------------------------------------------------------------------------------

    def _count_flops(self) -> None:
        """Count one warm-up step's FLOPs: start when the first step has closed, stop when the next one does."""
        try:
            if self._flops_state == "waiting" and self.scope._recorder.steps_seen == 1:
                if any(m.get("compiled") for m in self._models.values()):
                    self._flops_state = "off"  # a dispatch mode inside a compiled region would force a retrace
                    return
                from stepscope.analyses.flops import StepFlopCounter

                self._flop_counter = StepFlopCounter()
                self._flop_counter.start()
                self._flops_state = "counting"
            elif self._flops_state == "counting":
                self._flops_state = "done"
                self.scope.flops_per_step = self._flop_counter.stop() or None
                self._set_peak()
        except Exception as error:  # FLOPs are extras: measuring goes on without them
            self._flops_state = "off"
            self.facts_failure = f"FLOP counting: {type(error).__name__}: {error}"

    def _set_peak(self) -> None:
        """Give the Scope the GPU's peak for the training dtype, so that perf/mfu is in its metrics from now on."""
        from stepscope.analyses.flops import gpu_peak, training_dtype

        device = facts.device()
        seen = {**self._probed, "models": [m for m in self._models.values() if m]}
        peak = gpu_peak(device and device["name"], training_dtype(seen))
        if peak is not None:
            self.scope.peak_tflops, self.peak_label = peak

    # -- runtime facts -----------------------------------------------------------------------------------------

    def _begin_measuring(self) -> None:
        """The measured window starts: the facts describe it, not the warm-up; so does stepscope's own cost."""
        self._window_start = self._mark()
        self.probes_left = self.sdpa_probes_left = PROBES
        self._probed = {}
        dynamo = facts.dynamo_counters()
        self._graphs_at_measure = 0 if dynamo is None else dynamo["graphs"]

    def _probe(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Read the settings that only hold while the script's context managers are open."""
        self.probes_left -= 1
        try:
            self._read_probe(module, args, kwargs)
        except Exception as error:  # facts are extras: a failure ends probing, not measuring
            self.probes_left = self.sdpa_probes_left = 0
            self.facts_failure = f"{type(error).__name__}: {error}"

    def _read_probe(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        probed = self._probed
        flags = facts.torch_flags()
        own = self.scope._profiler
        if own is not None and own.recording:  # stepscope's own capture (--trace) is not the script's profiler
            flags["profiler"] = False
        for name in ("anomaly", "profiler"):  # on in any probed pass counts
            flags[name] = flags[name] or probed.get("torch", {}).get(name, False)
        probed["torch"] = flags
        probed.setdefault("autocast", {}).update(facts.autocast_state())
        if next(module.parameters(), None) is not None and len(self._models) < 4:
            if id(module) not in self._models:
                self._models[id(module)] = self._describe(facts.describe_model, module)
            shape = facts.first_input(args, kwargs)
            if shape is not None:
                shape["model"] = type(module).__name__
                inputs = probed.setdefault("inputs", [])
                if shape not in inputs:
                    inputs.append(shape)

    def probe_sdpa(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """An attention call on CUDA: which fused kernels could take it."""
        self.sdpa_probes_left -= 1
        try:
            self._read_sdpa(args, kwargs)
        except Exception as error:
            self.sdpa_probes_left = 0
            self.facts_failure = f"{type(error).__name__}: {error}"

    def _read_sdpa(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
        values = dict(zip(names, args, strict=False))
        values.update({k: v for k, v in kwargs.items() if k in names})
        values.setdefault("attn_mask", None)
        values.setdefault("dropout_p", 0.0)
        values.setdefault("is_causal", False)
        fact = facts.sdpa_kernels(**values)
        calls = self._probed.setdefault("sdpa", [])
        if fact not in calls:
            calls.append(fact)

    @_guarded
    def h2d_copy(self, source: Any, result: Any, non_blocking: bool) -> None:
        """A copy of a loader tensor: was it non-blocking, to the GPU, from pinned memory?"""
        counts = self._h2d
        counts["copies"] += 1
        counts["non_blocking"] += non_blocking
        if getattr(result, "is_cuda", False):
            counts["to_cuda"] += 1
            if counts["to_cuda"] <= PROBES:  # is_pinned asks the allocator: sample it
                counts["pinned_source"] += bool(source.is_pinned())

    def _describe(self, describe: Callable[[Any], dict[str, Any]], thing: Any) -> dict[str, Any]:
        try:
            return describe(thing)
        except Exception as error:  # facts are extras: measuring goes on without this one
            self.facts_failure = f"{type(error).__name__}: {error}"
            return {}

    def runtime_facts(self) -> dict[str, Any]:
        """Everything the doctor's rules read about this process (see doctor/facts.py)."""
        found: dict[str, Any] = dict(self._probed)
        found["models"] = [m for m in self._models.values() if m]
        found["optimizers"] = [o for o in self._optimizers.values() if o]
        found["threads"] = facts.threads()
        if self.zero_grad_set_to_none is not None:
            found["zero_grad"] = {"set_to_none": self.zero_grad_set_to_none}
        if self._h2d["copies"]:
            found["h2d"] = dict(self._h2d)
        dynamo = facts.dynamo_counters()
        if dynamo is not None:
            at_start = self._graphs_at_measure
            dynamo["graphs_in_window"] = None if at_start is None else dynamo["graphs"] - at_start
            found["dynamo"] = dynamo
        device = facts.device()
        if device is not None:
            found["device"] = device
        return found

    # -- results ------------------------------------------------------------------------------------------------

    @property
    def trained(self) -> bool:
        """True once this process did training work (a backward or an optimizer step), or measured a loader."""
        return bool(self.seen["backward_calls"] or self.seen["optimizer_steps"] or self.loader_result is not None)

    def summary(self, drain: bool = True) -> RunSummary:
        """The run's RunSummary so far; ``drain=False`` never waits on the GPU (for checkpoints)."""
        summary = self.scope.summary(drain=drain)
        summary.steps.boundary = self.boundary
        measured = summary.steps.measured
        if measured:
            summary.counters = {c: (self._seen_closed[c] - self._seen_at_measure[c]) / measured for c in COUNTERS}
        states = list(self._loaders.values())
        summary.loaders = [s.info for s in states]
        summary.epochs = [e for s in states for e in s.done]
        now = self._clock()
        summary.epochs += [self._epoch(s, now, complete=False) for s in states if s.epoch_open]
        summary.exit = self.outcome or Exit(reason="stopped" if self.stopped else "finished")
        job = self.config.loader_job
        if self.loader_result is not None:
            summary.dataloader = self.loader_result
        elif job is not None and job.get("loader") is not None:
            built = len(self.constructed)
            summary.dataloader = {
                "index": job["loader"],
                "built": built,
                "error": f"--loader {job['loader']} was never built: the script built {built} DataLoader(s) "
                f"(numbered from 0 in build order) before it ended",
            }
        summary.applied = self.fixes.results()
        summary.overhead = self._overhead(measured, summary.throughput.step_time_ms)
        if drain:
            try:
                summary.loss = self._losses.series()
            except Exception as error:  # the loss is an extra: reading it must not cost the figures
                summary.notes.append(f"the steps' loss could not be read ({type(error).__name__}: {error})")
        audits = self.audit.audits() if self.audited is None else self.audited
        summary.params = [a.to_dict() for a in audits]
        try:
            summary.facts = self.runtime_facts()
            if drain:  # the fault pricing maps memory: at the end only, never in a checkpoint between steps
                summary.facts["malloc"] = self._malloc_facts(measured)
        except Exception as error:  # a fact that cannot be read must not cost the figures
            self.facts_failure = f"{type(error).__name__}: {error}"
        if summary.throughput.mfu is not None:
            summary.throughput.mfu_peak = self.peak_label
        if self.facts_failure:
            summary.notes.append(f"some runtime settings could not be read ({self.facts_failure})")
        if self.failure:
            summary.notes.append(f"measurement stopped early after an internal error: {self.failure}")
        summary.notes += [own_scope_note(scope) for scope in script_scopes(self.scope)]
        if measured and summary.throughput.steps_per_s and summary.throughput.samples_per_s is None:
            summary.notes.append(no_samples_note(summary))
        if self.boundary == "backward" and self.optimizers_created:
            summary.notes.append(
                f"the script made {self.optimizers_created} optimizer(s) but none stepped in its first "
                f"{UNSTEPPED_BACKWARDS} backward calls: each backward ends a step, as in a script without one"
            )
        if self.scope._recorder.steps_seen == 0 and job is None:
            seen = self.seen
            # Replaces the Scope's note, whose advice is about calling scope.step().
            summary.notes = [n for n in summary.notes if NO_STEP_MARK not in n]
            # Forwards without gradients and no training after them are an open validation pass: count them too.
            batches, forwards = seen["batches"] + self.evals.batches, seen["forward_calls"] + self.evals.forwards
            summary.notes.append(
                f"no training step was seen: the script fetched {batches} batch(es) and ran "
                f"{forwards} forward pass(es), but never called backward() or optimizer.step(); "
                "stepscope ends a step at an optimizer step (or at a backward call when there is no optimizer)."
            )
        summary.verdict = classify(summary)  # again: the facts, loaders and ceiling added here inform it
        return summary

    def _epoch(self, state: _LoaderState, end_ns: int, complete: bool) -> Epoch:
        return Epoch(
            loader=state.info.index,
            index=state.epochs,
            time_s=(end_ns - state.epoch_start_ns) / 1e9,
            batches=state.epoch_batches,
            samples=state.epoch_samples,
            start_stall_ms=None if state.epoch_stall_ns is None else state.epoch_stall_ns / 1e6,
            complete=complete,
        )

    def _end_epoch(self, state: _LoaderState, complete: bool) -> None:
        state.done.append(self._epoch(state, self._clock(), complete))
        state.epochs += 1
        state.epoch_open = False


def _or_unknown(length: int | None) -> int:
    return -1 if length is None else length


def _describe_loader(loader: Any, index: int) -> LoaderInfo:
    from torch.utils.data import IterableDataset

    dataset = loader.dataset
    try:
        length: int | None = len(loader)
    except TypeError:
        length = None
    workers = int(loader.num_workers)
    return LoaderInfo(
        index=index,
        dataset=type(dataset).__name__,
        batch_size=loader.batch_size,
        num_workers=workers,
        pin_memory=bool(loader.pin_memory),
        persistent_workers=bool(loader.persistent_workers),
        prefetch_factor=loader.prefetch_factor if workers > 0 else None,
        drop_last=bool(loader.drop_last),
        iterable=isinstance(dataset, IterableDataset),
        length=length,
    )
