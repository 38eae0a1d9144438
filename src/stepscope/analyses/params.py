"""Parameter audit for DDP: which parameters get no gradient, a zero gradient, or are frozen.

DDP with ``find_unused_parameters=True`` walks the autograd graph every step to find parameters that will get no
gradient; people set it "to be safe". This watches a model's parameters across real backward passes and says
whether it can be turned off, and if not, which parameters are to blame.

A parameter is *reached* in a backward pass when autograd accumulates a gradient into it (a post-accumulate-grad
hook fires). That is exactly what DDP's reducer waits for, and it is not fooled by DDP itself, which marks
unreached parameters ready without touching them. Classes, over the audited backward passes:
UNUSED (requires_grad, never reached: DDP with ``find_unused_parameters=False`` rejects these), ZERO-GRAD
(reached, and the gradient arriving in each pass was all zeros; checked only on request, as it reads every
gradient),
FROZEN (requires_grad is False), USED; *conditional* are those reached in some passes but not all.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

# Parts that wrappers add to parameter names. torch.compile's, FSDP's and activation checkpointing's are private
# names, removed wherever they occur; DDP/DataParallel's "module." is removed only as a leading prefix, and only when
# such a wrapper is there (a model may well have an attribute of its own called "module").
PRIVATE_WRAPPER_PARTS = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
DATA_PARALLEL = ("DistributedDataParallel", "DataParallel")


@dataclass
class ParamInfo:
    """One parameter tensor: its name as the user wrote it, its module, its size, other names it goes by."""

    name: str
    module: str
    numel: int
    aliases: list[str] = field(default_factory=list)  # tied weights: the same tensor under other names
    reached_steps: int | None = None  # for conditional parameters: in how many audited passes it was reached


@dataclass
class ParamAudit:
    """The audit of one model over ``steps`` backward passes."""

    model: str
    steps: int
    used_count: int
    unused: list[ParamInfo]
    zero_grad: list[ParamInfo]
    frozen: list[ParamInfo]
    conditional: list[ParamInfo]
    ddp_find_unused: bool | None  # the DDP wrapper's find_unused_parameters, None when not DDP-wrapped
    zero_grad_checked: bool = False
    total_count: int = 0
    wrapped_in: list[str] = field(default_factory=list)  # wrappers around the model, outermost first

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def advice(self) -> str:
        """One sentence: whether find_unused_parameters=False is safe, from what was observed."""
        if self.steps == 0:
            return "no backward pass reached this model, so nothing can be said about unused parameters."
        if not self.unused and not self.conditional:
            tail = "" if self.ddp_find_unused is not True else " (the script sets it to True: turn it off)"
            return f"UNUSED is empty: find_unused_parameters=False is safe{tail}."
        names = ", ".join(p.name for p in (self.unused + self.conditional)[:3])
        return (
            f"keep find_unused_parameters=True, or fix {len(self.unused) + len(self.conditional)} tensor(s) ({names}"
            f"{', ...' if len(self.unused) + len(self.conditional) > 3 else ''}): freeze or delete them "
            "(requires_grad_(False)), or make every step's graph reach them."
        )


def strip_wrappers(name: str, data_parallel: bool = True) -> str:
    """A parameter name as the user wrote it: without torch.compile's, FSDP's and checkpointing's parts, and
    without DDP/DataParallel's leading ``module.`` when ``data_parallel`` (the model is wrapped in one)."""
    changed = True
    while changed:
        before = name
        for part in PRIVATE_WRAPPER_PARTS:
            if name.startswith(part):
                name = name[len(part) :]
            name = name.replace("." + part, ".")
        if data_parallel and name.startswith("module."):
            name = name[len("module.") :]
        changed = name != before
    return name


WRAPPERS = ("DistributedDataParallel", "DataParallel", "OptimizedModule", "FullyShardedDataParallel")


def unwrap(model: Any) -> tuple[Any, list[Any]]:
    """The model inside DDP / DataParallel / torch.compile / FSDP wrappers, and the wrappers, outermost first."""
    wrappers = []
    while type(model).__name__ in WRAPPERS and len(wrappers) < 8:
        wrappers.append(model)
        model = getattr(model, "_orig_mod", None) or getattr(model, "module", None) or model
        if model is wrappers[-1]:
            break
    return model, wrappers


def ddp_find_unused(model: Any) -> bool | None:
    """The ``find_unused_parameters`` of a DDP wrapper around ``model`` (through torch.compile), or None."""
    for wrapper in unwrap(model)[1]:
        if type(wrapper).__name__ == "DistributedDataParallel":
            return bool(getattr(wrapper, "find_unused_parameters", False))
    return None


def _module_name(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


class ParamWatch:
    """Watches one model's parameters across backward passes (see the module docstring)."""

    def __init__(self, model: Any, include_zero_grad: bool = False) -> None:
        self.model = model
        self.include_zero_grad = include_zero_grad
        self.steps = 0
        self._names: dict[int, list[str]] = {}
        self._params: dict[int, Any] = {}
        data_parallel = any(type(w).__name__ in DATA_PARALLEL for w in unwrap(model)[1])
        for name, param in model.named_parameters(remove_duplicate=False):
            key = id(param)
            self._params[key] = param
            clean = strip_wrappers(name, data_parallel)
            if clean not in self._names.setdefault(key, []):
                self._names[key].append(clean)
        self._reached_now: set[int] = set()
        self._nonzero_now: set[int] = set()
        self._reached: dict[int, int] = dict.fromkeys(self._params, 0)
        self._zero: dict[int, int] = dict.fromkeys(self._params, 0)
        self._hooked: set[int] = set()
        self._handles: list[Any] = []
        self.refresh()

    def refresh(self) -> None:
        """Hook every parameter that requires grad and is not hooked yet: one unfrozen since (a layer thawed at
        epoch N) is watched from the next backward pass on. Called before each pass."""
        for key, param in self._params.items():
            if key in self._hooked or not param.requires_grad:
                continue
            self._hooked.add(key)
            self._handles.append(param.register_post_accumulate_grad_hook(self._on_grad))
            if self.include_zero_grad:
                # The gradient arriving in this pass, before accumulation: .grad may hold older gradients.
                self._handles.append(param.register_hook(functools.partial(self._on_incoming, key)))

    @property
    def has_parameters(self) -> bool:
        return bool(self._params)

    def _on_grad(self, param: Any) -> None:
        self._reached_now.add(id(param))

    def _on_incoming(self, key: int, grad: Any) -> None:
        if bool(grad.any()):
            self._nonzero_now.add(key)

    def end_backward(self) -> bool:
        """Close one backward pass; returns True when it reached this model."""
        reached = self._reached_now
        if reached:
            self.steps += 1
            for key in reached:
                self._reached[key] += 1
                if self.include_zero_grad and key not in self._nonzero_now:
                    self._zero[key] += 1
        self._reached_now, self._nonzero_now = set(), set()
        return bool(reached)

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def audit(self) -> ParamAudit:
        """The classes so far. With no backward pass yet, only FROZEN can be told: the other lists stay empty."""
        unused, zero, frozen, conditional = [], [], [], []
        used = 0
        for key, param in self._params.items():
            names = self._names[key]
            info = ParamInfo(names[0], _module_name(names[0]), int(param.numel()), names[1:])
            reached = self._reached[key]
            if not param.requires_grad:
                frozen.append(info)
            elif self.steps == 0:
                continue
            elif reached == 0:
                unused.append(info)
            elif self.include_zero_grad and self._zero[key] == reached:
                zero.append(info)
            elif reached < self.steps:
                info.reached_steps = reached
                conditional.append(info)
            else:
                used += 1
        inner, wrappers = unwrap(self.model)
        return ParamAudit(
            model=type(inner).__name__,
            steps=self.steps,
            used_count=used,
            unused=unused,
            zero_grad=zero,
            frozen=frozen,
            conditional=conditional,
            ddp_find_unused=ddp_find_unused(self.model),
            zero_grad_checked=self.include_zero_grad,
            total_count=len(self._params),
            wrapped_in=[type(w).__name__ for w in wrappers],
        )


def audit_params(model: Any, step_fn: Callable[[], Any], steps: int = 3, include_zero_grad: bool = False) -> ParamAudit:
    """Run ``step_fn`` (one forward + backward of ``model``) ``steps`` times and classify every parameter.

    More steps find parameters that are only conditionally reached. ``include_zero_grad`` also checks whether
    each gradient is all zeros (reads every gradient: a device sync per parameter on GPU). Gradients the model had
    before are left in place; the hooks are removed afterwards.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    watch = ParamWatch(model, include_zero_grad)
    if not watch.has_parameters:
        raise ValueError(f"{type(model).__name__} has no parameters: there is nothing to audit.")
    try:
        for _ in range(steps):
            watch.refresh()
            step_fn()
            watch.end_backward()
    finally:
        watch.close()
    return watch.audit()


class ModelAuditor:
    """Audits every model of a running script: each outermost module with parameters that is called gets a
    ParamWatch; after ``steps`` backward passes the audit is complete."""

    def __init__(self, steps: int, include_zero_grad: bool = False) -> None:
        self.steps = steps
        self.include_zero_grad = include_zero_grad
        self.backwards = 0
        self._watches: dict[int, ParamWatch] = {}

    def see(self, module: Any) -> None:
        """An outermost module call: watch the module from now on (once)."""
        if id(module) not in self._watches:
            self._watches[id(module)] = ParamWatch(module, self.include_zero_grad)

    def begin_backward(self) -> None:
        """A backward pass begins: parameters unfrozen since the last one get their hooks now."""
        for watch in self._watches.values():
            watch.refresh()

    def end_backward(self) -> bool:
        """A backward pass ended; returns True once ``steps`` of them have been audited."""
        self.backwards += 1
        for watch in self._watches.values():
            watch.end_backward()
        return self.backwards >= self.steps

    def close(self) -> None:
        """Remove every hook: the audit is complete and the run goes on unwatched."""
        for watch in self._watches.values():
            watch.close()

    def audits(self) -> list[ParamAudit]:
        """One audit per model that has parameters and received a backward (all such models when none did)."""
        watches = [w for w in self._watches.values() if w.has_parameters]
        reached = [w for w in watches if w.steps > 0]
        return sorted((w.audit() for w in reached or watches), key=lambda a: -a.total_count)


class NoAudit:
    """The auditor of an ordinary run: sees nothing, never completes."""

    backwards = 0

    def see(self, module: Any) -> None:
        return None

    def begin_backward(self) -> None:
        return None

    def end_backward(self) -> bool:
        return False

    def audits(self) -> list[ParamAudit]:
        return []


NO_AUDIT = NoAudit()


def combine(rank_audits: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    """The result of `stepscope params` from each rank's audits (dicts), primary model first.

    Top-level fields are the primary model's (the one with the most parameter tensors) on the lowest rank; with
    several ranks, ``unused``, ``zero_grad`` and ``conditional`` are the union over ranks, since DDP rejects a
    parameter that is unused on any rank, and ``ranks`` holds each rank's primary audit.
    """
    if not rank_audits or not any(rank_audits.values()):
        return {"models": []}
    first_rank = min(r for r, audits in rank_audits.items() if audits)
    models = rank_audits[first_rank]
    result: dict[str, Any] = {"models": models, **models[0]}
    if len(rank_audits) > 1:
        result["ranks"] = {str(r): audits[0] for r, audits in sorted(rank_audits.items()) if audits}
        unused = _union(rank_audits, "unused")
        unused_names = {item["name"] for item in unused}
        result["unused"] = unused
        result["zero_grad"] = _union(rank_audits, "zero_grad")
        result["conditional"] = [i for i in _union(rank_audits, "conditional") if i["name"] not in unused_names]
        not_used = len(result["frozen"]) + len(unused) + len(result["conditional"]) + len(result["zero_grad"])
        result["used_count"] = models[0]["total_count"] - not_used
    return result


def _union(rank_audits: dict[int, list[dict[str, Any]]], key: str) -> list[dict[str, Any]]:
    """The primary model's ``key`` list over all ranks, each parameter once (first rank's entry)."""
    seen: dict[str, dict[str, Any]] = {}
    for _, audits in sorted(rank_audits.items()):
        for item in audits[0][key] if audits else []:
            seen.setdefault(item["name"], item)
    return list(seen.values())
