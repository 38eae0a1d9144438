"""The hooks that report an unmodified script's training events to a Tracker.

Each hook wraps one torch entry point and stays cheap where it does not apply: an inner module call or a
``.to()`` of a tensor that did not come from the loader costs one Python call and a check. The outermost module
call is found by wrapping ``nn.Module.__call__`` rather than with torch's global module hooks, which switch every
module call to the slow hook path (+1.9 us per module call measured on the dev machine, against +0.17 us here).
Inside a ``torch.compile`` trace every wrapper steps aside so that compiled graphs are unchanged. Events from
threads other than the one the steps run on (``Tracker.thread``) pass by; ``queue.Queue.get`` is wrapped too, for
the steps' wait on a prefetcher thread's batches.

``install`` returns a function that removes every hook (tests install and remove them in-process).
"""

from __future__ import annotations

import functools
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

from stepscope.instrument.tracker import Tracker


def patcher(undo: list[Callable[[], None]]) -> Callable[[Any, str, Callable[[Any], Any]], None]:
    """``patch(owner, name, make)``: replace ``owner.name`` by ``make(original)`` (with the original's name and
    docstring), appending to ``undo`` what puts the original back."""

    def patch(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = getattr(owner, name)
        wrapper = make(original)
        functools.update_wrapper(wrapper, original)
        setattr(owner, name, wrapper)
        undo.append(lambda: setattr(owner, name, original))

    return patch


def install(tracker: Tracker) -> Callable[[], None]:
    """Hook torch's training entry points to ``tracker``; returns the function that removes them."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    compiling = torch.compiler.is_compiling
    get_ident = threading.get_ident  # events from a thread other than the steps' (tracker.thread) pass by
    undo: list[Callable[[], None]] = []
    patch = patcher(undo)

    # data_wait, epochs, batch size ------------------------------------------------------------------------------
    def make_iter(original: Any) -> Any:
        def __iter__(self: Any) -> Any:
            # Making the iterator starts the loader's workers: data pipeline time, and the start of the epoch.
            if not tracker.active:
                return original(self)
            if capturing:
                tracker.capture(self)  # measures this loader (or the one asked for) and stops, or passes it by
            if get_ident() != tracker.thread:
                return tracker.iter_elsewhere(original, self)
            t0 = tracker.fetch_begin(self)
            try:
                iterator = original(self)
            finally:
                tracker.fetch_end(None, None, t0)
            tracker.epoch_begin(self, iterator, t0)
            return iterator

        return __iter__

    def make_next(original: Any) -> Any:
        def __next__(self: Any) -> Any:
            if not tracker.active:
                return original(self)
            if get_ident() != tracker.thread:
                return tracker.next_elsewhere(original, self)
            t0 = tracker.fetch_begin(self)
            try:
                batch = original(self)
            except StopIteration:
                tracker.fetch_end(self, None, t0, exhausted=True)
                raise
            except BaseException:
                tracker.fetch_end(self, None, t0)
                raise
            tracker.fetch_end(self, batch, t0)
            return batch

        return __next__

    def make_handover(original: Any) -> Any:
        def get(self: Any, *args: Any, **kwargs: Any) -> Any:
            # The steps' thread waiting for a batch that a thread iterating a loader hands over (a prefetcher's
            # queue) waits for data; inside a fetch it is the DataLoader's own queue (pin memory), timed already.
            if not tracker.loader_elsewhere or tracker.in_fetch or not tracker.active or get_ident() != tracker.thread:
                return original(self, *args, **kwargs)
            t0 = tracker.handover_begin(self)
            try:
                batch = original(self, *args, **kwargs)
            except BaseException:
                tracker.fetch_end(None, None, t0)
                raise
            tracker.fetch_end(None, batch, t0)  # the step's batch: its samples, and its tensors' copies are h2d
            return batch

        return get

    capturing = tracker.config.loader_job is not None
    if capturing:

        def make_loader_init(original: Any) -> Any:
            def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
                original(self, *args, **kwargs)
                tracker.constructed.append(weakref.ref(self))

            return __init__

        patch(DataLoader, "__init__", make_loader_init)
    patch(DataLoader, "__iter__", make_iter)
    patch(_BaseDataLoaderIter, "__next__", make_next)
    patch(queue.Queue, "get", make_handover)

    # h2d: copies of the loader's tensors ---------------------------------------------------------------------
    def make_copy(original: Any) -> Any:
        def copy(self: Any, *args: Any, **kwargs: Any) -> Any:
            # Every .to() in the program passes here: the id check comes first (batch_ids is empty when tracking
            # stops; inside a compile trace the ids are fake tensors', and id() causes no graph break).
            if id(self) not in tracker.batch_ids or compiling():
                return original(self, *args, **kwargs)
            tracker.enter("h2d")
            try:
                result = original(self, *args, **kwargs)
            finally:
                tracker.exit("h2d")
            tracker.h2d_copy(self, result, bool(kwargs.get("non_blocking")) or any(a is True for a in args))
            return result

        return copy

    if builds_for_a_device(torch):
        # A CPU-only build has no device to copy to, and every .to() in the program (clipping makes one per
        # gradient) would pay for the wrapper: none is installed.
        patch(torch.Tensor, "to", make_copy)
        patch(torch.Tensor, "cuda", make_copy)
        tracker.watch_copies = True

    # forward: the outermost module call ------------------------------------------------------------------------
    def make_call(original: Any) -> Any:
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            # Inner module calls leave here after three attribute checks; so do calls on another thread than the
            # steps' (a model in a thread of its own, a transform in a prefetcher's).
            if tracker.in_forward or tracker.in_fetch or not tracker.active or compiling():
                return original(self, *args, **kwargs)
            if get_ident() != tracker.thread or not tracker.forward_begin(self, args, kwargs):
                return original(self, *args, **kwargs)
            try:
                return original(self, *args, **kwargs)
            finally:
                tracker.forward_end()

        return __call__

    patch(nn.Module, "__call__", make_call)

    # backward ---------------------------------------------------------------------------------------------------
    def make_backward(original: Any) -> Any:
        def backward(*args: Any, **kwargs: Any) -> Any:
            root = args[0] if args else kwargs.get("tensors")  # the tensors (Tensor.backward passes its self)
            if compiling() or not tracker.active or get_ident() != tracker.thread or not tracker.backward_begin(root):
                return original(*args, **kwargs)
            try:
                return original(*args, **kwargs)
            finally:
                tracker.backward_end()

        return backward

    # Tensor.backward calls torch.autograd.backward (by attribute, at call time): one wrapper times both, and a
    # loss.backward() pays for one event, not two.
    patch(torch.autograd, "backward", make_backward)

    # plain phases: clip, zero_grad ------------------------------------------------------------------------------
    def make_phase(phase: str) -> Callable[[Any], Any]:
        def make(original: Any) -> Any:
            def timed(*args: Any, **kwargs: Any) -> Any:
                if compiling() or not tracker.active or get_ident() != tracker.thread:
                    return original(*args, **kwargs)
                tracker.enter(phase)
                try:
                    return original(*args, **kwargs)
                finally:
                    tracker.exit(phase)

            return timed

        return make

    import torch.nn.utils.clip_grad as clip_grad

    for name in ("clip_grad_norm_", "clip_grad_value_"):
        # Both modules export the function; a script may import it from either.
        patch(clip_grad, name, make_phase("clip"))
        patch(nn.utils, name, make_phase("clip"))
    patch(torch.amp.GradScaler, "unscale_", make_phase("clip"))
    # torch.autograd.grad is a backward pass that returns the gradients (a gradient penalty, a physics-informed
    # net's derivatives, meta-learning's inner step): backward time, left in `other` it read as the host's. Neither
    # a step's loss nor the gradients the optimizer steps with: a plain phase, not a backward event.
    patch(torch.autograd, "grad", make_phase("backward"))

    def make_zero_grad(original: Any) -> Any:
        timed = make_phase("zero_grad")(original)

        def zero_grad(self: Any, *args: Any, **kwargs: Any) -> Any:
            # set_to_none=False writes zeros into every gradient instead of dropping them (a fact for the doctor).
            tracker.zero_grad_set_to_none = bool(args[0] if args else kwargs.get("set_to_none", True))
            return timed(self, *args, **kwargs)

        return zero_grad

    patch(torch.optim.Optimizer, "zero_grad", make_zero_grad)
    patch(nn.Module, "zero_grad", make_zero_grad)

    # activation checkpointing and attention kernels: facts for the doctor -------------------------------------
    import torch.utils.checkpoint as checkpoint_module

    def make_checkpoint(original: Any) -> Any:
        def checkpoint(*args: Any, **kwargs: Any) -> Any:
            if tracker.active and not compiling():
                tracker.count("checkpoint_calls")
            return original(*args, **kwargs)

        return checkpoint

    patch(checkpoint_module, "checkpoint", make_checkpoint)

    def make_sdpa(original: Any) -> Any:
        def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> Any:
            if tracker.sdpa_probes_left and tracker.active and not compiling():
                query = args[0] if args else kwargs.get("query")
                if getattr(query, "is_cuda", False):
                    tracker.probe_sdpa(args, kwargs)
            return original(*args, **kwargs)

        return scaled_dot_product_attention

    patch(torch.nn.functional, "scaled_dot_product_attention", make_sdpa)

    # optimizer: each optimizer class's step, and construction (which decides the step boundary) --------------
    # torch wraps every optimizer class's step once (Optimizer.profile_hook_step: a record_function, the step
    # hooks, the profiler's entry point); its step hooks fire inside that wrapper, so timing from them leaves the
    # wrapper's own work, and global hooks registered around stepscope's, out of `optimizer`. stepscope wraps the
    # wrapper instead, so `optimizer` is what a timer around opt.step() reads.
    def make_step(original: Any) -> Any:
        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            # Under a compile trace the wrapper steps aside: a clock read would break the graph (an error with
            # fullgraph=True).
            if compiling() or not tracker.active or not tracker.optimizer_step_begin(self):
                return original(self, *args, **kwargs)
            try:
                result = original(self, *args, **kwargs)
            except BaseException:
                tracker.exit("optimizer")
                raise
            tracker.optimizer_step_end(self)
            return result

        return step

    def time_steps(cls: type) -> None:
        original = cls.step  # type: ignore[attr-defined]
        if getattr(original, "stepscope_timed", False):
            return  # timed already: this class, or the class it inherits step from
        timed = make_step(original)
        functools.update_wrapper(timed, original)  # copies torch's `hooked` mark, so torch does not wrap it again
        timed.stepscope_timed = True
        inherited = "step" not in vars(cls)
        cls.step = timed  # type: ignore[attr-defined]
        undo.append(lambda: delattr(cls, "step") if inherited else setattr(cls, "step", original))

    def make_init(original: Any) -> Any:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)  # torch wraps the class's step here, at its first construction
            tracker.optimizers_created += 1
            try:
                time_steps(type(self))
            except Exception as error:
                tracker.fail(error)

        return __init__

    patch(torch.optim.Optimizer, "__init__", make_init)

    # sync: host-device synchronisations, and .item()/.tolist() counts ------------------------------------------
    def make_scalar(original: Any) -> Any:
        # .item() and .tolist() take no argument: a fixed signature spares the ~20 calls a step that pass through
        # (torch's optimizers read their step counts) the packing of *args and **kwargs
        def scalar(self: Any) -> Any:
            if not tracker.count_scalars or compiling() or get_ident() != tracker.thread:
                return original(self)
            tracker.count("item_calls")
            if self.is_cpu:
                return original(self)
            return tracker.sync(original, self)

        return scalar

    def make_cpu(original: Any) -> Any:
        def cpu(self: Any, *args: Any, **kwargs: Any) -> Any:
            if compiling() or self.is_cpu or not tracker.active or tracker.in_fetch or get_ident() != tracker.thread:
                return original(self, *args, **kwargs)
            return tracker.sync(original, self, *args, **kwargs)

        return cpu

    def make_synchronize(original: Any) -> Any:
        def synchronize(*args: Any, **kwargs: Any) -> Any:
            if compiling() or not tracker.active or get_ident() != tracker.thread:
                return original(*args, **kwargs)
            return tracker.sync(original, *args, **kwargs)

        return synchronize

    patch(torch.Tensor, "item", make_scalar)
    patch(torch.Tensor, "tolist", make_scalar)
    patch(torch.Tensor, "cpu", make_cpu)
    patch(torch.cuda, "synchronize", make_synchronize)

    # comms: waiting in torch.distributed -----------------------------------------------------------------------
    import torch.distributed as dist

    if dist.is_available():
        _install_distributed(tracker, patch, undo)

    # `--apply`: last, so that its wrappers run first and the hooks above see (and record) the applied settings
    tracker.fixes.install(patch)

    def uninstall() -> None:
        while undo:
            undo.pop()()

    return uninstall


def builds_for_a_device(torch: Any) -> bool:
    """True unless this torch is a CPU-only build (no CUDA, ROCm, XPU or MPS support compiled in), read from its
    build flags: asking for a device would initialise its driver in every process that imports torch."""
    version = torch.version
    return bool(
        getattr(version, "cuda", None)
        or getattr(version, "hip", None)
        or getattr(version, "xpu", None)
        or torch.backends.mps.is_built()
    )


COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "broadcast",
    "reduce", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "gather", "scatter",
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_gather_object", "broadcast_object_list",
    "gather_object", "scatter_object_list", "send_object_list", "recv_object_list",
)  # fmt: skip
"""torch.distributed's Python entry points timed as ``comms`` (an async call's share is its launch; its
``Work.wait()`` is timed too)."""


def _install_distributed(tracker: Tracker, patch: Callable[..., None], undo: list[Callable[[], None]]) -> None:
    """Collectives, ``Work.wait`` and DDP's gradient all-reduce wait as ``comms`` time."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.nn.parallel import DistributedDataParallel

    compiling = torch.compiler.is_compiling

    def make_comms(original: Any) -> Any:
        def collective(*args: Any, **kwargs: Any) -> Any:
            # The tracker follows the training thread, and autograd's threads while it waits in backward (FSDP's
            # reduce-scatter runs in backward hooks); a collective on a thread of its own (async checkpointing) is
            # not the step's.
            if (
                compiling()
                or not tracker.active
                or (threading.get_ident() != tracker.thread and not tracker.backward_open)
            ):
                return original(*args, **kwargs)
            tracker.enter("comms")
            try:
                return original(*args, **kwargs)
            finally:
                tracker.exit("comms")

        return collective

    for name in COLLECTIVES:
        # Scripts call dist.X; torch's own code (FSDP, the *_object helpers) calls distributed_c10d.X.
        for module in (dist, c10d):
            if hasattr(module, name):
                patch(module, name, make_comms)
    patch(dist.Work, "wait", make_comms)

    def make_ddp_init(original: Any) -> Any:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            try:
                watch_ddp(self)
            except Exception as error:  # the model trains on, measured; only the split of its backward is lost
                tracker.facts_failure = f"DDP gradient hooks: {type(error).__name__}: {error}"

        return __init__

    def watch_ddp(model: Any) -> None:
        ddp = weakref.ref(model)
        for param in model.parameters():
            if param.requires_grad:
                key = id(param)

                def ready(_: Any, key: int = key) -> None:
                    if tracker.active and not compiling():
                        tracker.grad_ready(key, ddp)

                undo.append(param.register_post_accumulate_grad_hook(ready).remove)

    patch(DistributedDataParallel, "__init__", make_ddp_init)
