"""``stepscope run --apply FIX[=VALUE]``: apply a fix of the catalogue to an unmodified script, at runtime.

``parse_fixes`` turns the command line's words into validated ``{id, value}`` entries (RunConfig.apply) before the
script starts; an unknown id or a bad value is one sentence. In the instrumented process, an ``Injector`` patches
the places each fix needs — DataLoader and optimizer construction, ``zero_grad``, DDP construction, the outermost
module call, torch's global flags — and records where each fix took effect (``RunSummary.applied``). A fix that
cannot apply somewhere (a loader without workers for ``loader.prefetch``, CPU-only torch for ``pin_memory``) is
recorded with why, and the constructor runs as the script wrote it: a failed injection never breaks the script.
Fixes that set a global flag also guard it: the script's own later attempt to set it back is ignored and recorded.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepscope.analyses.loader import WORKER_COUNT_WARNING
from stepscope.collectors.malloc import (
    GLIBC_MAX_MMAP_THRESHOLD,
    PRELOADABLE,
    allocator,
    set_thresholds,
    threshold_env,
)
from stepscope.collectors.stacks import USER, CodeKinds
from stepscope.summary import describe_value

BOOL_WORDS = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False, "0": False}
PRECISIONS = ("highest", "high", "medium")  # torch.set_float32_matmul_precision's values


@dataclass(frozen=True)
class Appliable:
    """A catalogue fix that ``--apply`` can inject: its value's kind, the value without ``=VALUE`` (the fix's
    direction; None when a value is required), and what it changes, where."""

    id: str
    kind: str  # "bool", "count" (an int >= minimum), "precision" (highest/high/medium, or on/off) or "choice"
    default: Any
    injects: str
    minimum: int = 0
    maximum: int | None = None  # a fixed bound for a count; loader.num_workers's depends on the machine
    choices: tuple[str, ...] = ()  # a choice's values


FIXES = (
    Appliable("loader.num_workers", "count", None, "DataLoader(num_workers=N) at construction"),
    Appliable("loader.persistent_workers", "bool", True, "DataLoader(persistent_workers=...) where it has workers"),
    Appliable("loader.pin_memory", "bool", True, "DataLoader(pin_memory=...) where an accelerator exists"),
    Appliable(
        "loader.prefetch", "count", 4, "DataLoader(prefetch_factor=N) where it has workers", minimum=1, maximum=64
    ),
    Appliable("tf32", "precision", "high", "torch.set_float32_matmul_precision and cuDNN's allow_tf32, at import"),
    Appliable("cudnn.benchmark", "bool", True, "torch.backends.cudnn.benchmark, at import"),
    Appliable("debug.anomaly", "bool", False, "torch.set_anomaly_enabled, at import"),
    Appliable("debug.deterministic", "bool", False, "torch.use_deterministic_algorithms and cudnn.deterministic"),
    Appliable("optimizer.fused", "bool", True, "fused=... at torch.optim construction, where the class has it"),
    Appliable("optimizer.foreach", "bool", True, "foreach=... at torch.optim construction, where the class has it"),
    Appliable("zero_grad.set_to_none", "bool", True, "set_to_none=... in every optimizer/module zero_grad()"),
    Appliable("ddp.gradient_as_bucket_view", "bool", True, "DistributedDataParallel(gradient_as_bucket_view=...)"),
    Appliable("ddp.find_unused_parameters", "bool", False, "DistributedDataParallel(find_unused_parameters=...)"),
    Appliable("ddp.static_graph", "bool", True, "DistributedDataParallel(static_graph=...)"),
    Appliable("precision.bf16", "bool", True, "torch.autocast(bfloat16) around each model's outermost call"),
    Appliable(
        "host.threads", "count", None, "torch.set_num_threads(N) (intra-op threads), at import", minimum=1, maximum=256
    ),
    Appliable(
        "malloc.mmap_threshold",
        "count",
        GLIBC_MAX_MMAP_THRESHOLD,
        "glibc's mmap threshold at N bytes and its trim threshold at 2N (environment, and mallopt at import)",
        minimum=128 * 1024,
        maximum=GLIBC_MAX_MMAP_THRESHOLD,
    ),
    Appliable(
        "malloc.allocator",
        "choice",
        "jemalloc",
        "LD_PRELOAD of the pooling allocator (installed on the machine) for every process of the command",
        choices=tuple(PRELOADABLE),
    ),
)
APPLIABLE: dict[str, Appliable] = {fix.id: fix for fix in FIXES}
# The names issue 20 (and habit) use for the same fixes.
ALIASES = {
    "loader.prefetch_factor": "loader.prefetch",
    "torch.tf32": "tf32",
    "matmul.precision": "tf32",
    "optimizer.set_to_none": "zero_grad.set_to_none",
    "autocast.bf16": "precision.bf16",
}
LOADER_FIXES = ("loader.num_workers", "loader.persistent_workers", "loader.pin_memory", "loader.prefetch")
OPTIMIZER_FIXES = ("optimizer.fused", "optimizer.foreach")
DDP_KWARGS = {
    "ddp.gradient_as_bucket_view": "gradient_as_bucket_view",
    "ddp.find_unused_parameters": "find_unused_parameters",
    "ddp.static_graph": "static_graph",
}
# Why a requested fix never applied, when nothing it patches ever ran.
NEVER = {
    **dict.fromkeys(LOADER_FIXES, "the script built no DataLoader after importing torch"),
    **dict.fromkeys(OPTIMIZER_FIXES, "the script built no torch.optim optimizer that takes foreach/fused"),
    "zero_grad.set_to_none": "the script never called zero_grad()",
    **dict.fromkeys(DDP_KWARGS, "the script built no DistributedDataParallel model"),
    "precision.bf16": "the script called no module with parameters",
}
UNPROVEN = (
    "applied without proof: every parameter must get a gradient in every step, or DDP raises at the next step; "
    "`stepscope params` (or the doctor's audit) checks it"
)


class ApplyError(ValueError):
    """A ``--apply`` word that names no appliable fix, or a value the fix does not take."""


def parse_fixes(texts: list[str]) -> list[dict[str, Any]]:
    """``["loader.num_workers=2,loader.persistent_workers", "optimizer.foreach"]`` into ``[{"id", "value"}]``
    (catalogue ids, values of the fix's kind; a comma joins the settings of one fix, as the doctor's ``apply``
    gives them); raises ApplyError with the reason (and the appliable ids, for an unknown one)."""
    fixes: list[dict[str, Any]] = []
    for text in (part for word in texts for part in word.split(",")):
        name, sep, raw = text.strip().partition("=")
        fix_id = ALIASES.get(name, name)
        fix = APPLIABLE.get(fix_id)
        if fix is None:
            known = ", ".join(APPLIABLE)
            raise ApplyError(f"--apply {text}: {name!r} is not a fix stepscope can apply; appliable: {known}.")
        value = _value(fix, raw.strip(), text) if sep else fix.default
        if value is None:
            raise ApplyError(f"--apply {text}: {fix.id} needs a value, e.g. --apply {fix.id}=2.")
        if name == "matmul.precision" and not sep:
            raise ApplyError(f"--apply {text}: give the precision, e.g. --apply matmul.precision=high.")
        if any(f["id"] == fix.id for f in fixes):
            raise ApplyError(f"--apply {text}: {fix.id} is given more than once.")
        fixes.append({"id": fix.id, "value": value})
    chosen = {f["id"]: f["value"] for f in fixes}
    if chosen.get("optimizer.fused") and chosen.get("optimizer.foreach"):
        raise ApplyError("--apply optimizer.fused and optimizer.foreach exclude each other: pick one.")
    if "malloc.allocator" in chosen and "malloc.mmap_threshold" in chosen:
        raise ApplyError(
            "--apply malloc.allocator and malloc.mmap_threshold exclude each other (glibc's thresholds do nothing to "
            "another allocator): pick one."
        )
    return fixes


WORKERS_PER_CORE = 4  # loader workers per usable core at most: past that they only contend for the cores
# ... but as many on any machine as the loader sweep may measure (analyses/loader.py's MAX_WORKERS): workers that
# wait on storage use no core, and the sweep's best must be one --verify can apply (a 32-worker best on 2 cores
# was left unverified against a bound of 16)
WORKERS_ANYWHERE = 32
FILES_PER_WORKER = 8  # open files the training process holds per loader worker (torch's queues take ~4), with room
FILES_KEPT = 64  # open files left to the script itself


def worker_limit() -> tuple[int, str]:
    """The most loader workers ``--apply loader.num_workers`` may ask of one DataLoader on this machine, and why
    in words: 4 per usable core (cgroup quota, else CPU affinity), at least 32, and no more than the open-file limit
    allows (each worker holds files in the training process: past the limit, worker start-up fails with "Too many
    open files")."""
    import math

    from stepscope.collectors.host import cgroup_cpu_quota, usable_cores

    try:
        quota = cgroup_cpu_quota()
    except Exception:  # an unreadable cgroup: the affinity still says
        quota = None
    cores = math.ceil(quota) if quota else usable_cores()
    limit = max(WORKERS_PER_CORE * cores, WORKERS_ANYWHERE)
    why = f"{WORKERS_PER_CORE} per usable core, at least {WORKERS_ANYWHERE}; {cores} core(s) here"
    try:
        import resource

        files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]  # RLIM_INFINITY is -1
    except (ImportError, OSError, ValueError):  # no such limit (Windows)
        files = -1
    if files >= 0 and (files - FILES_KEPT) // FILES_PER_WORKER < limit:
        limit = max(1, (files - FILES_KEPT) // FILES_PER_WORKER)
        why = f"the open-file limit here, {files} (`ulimit -n`), allows about {FILES_PER_WORKER} files per worker"
    return limit, why


def _count(fix: Appliable, raw: str, text: str) -> int:
    """A count as ASCII digits (no sign, no other script's digits, no superscripts), within the fix's bounds."""
    maximum, why = worker_limit() if fix.id == "loader.num_workers" else (fix.maximum, "")
    span = f"at least {fix.minimum}" if maximum is None else f"from {fix.minimum} to {maximum}"
    wanted = f"{fix.id} takes a whole number in digits 0-9, {span}" + (f" ({why})" if why else "")
    if not (raw.isascii() and raw.isdigit()):
        raise ApplyError(f"--apply {text}: {wanted}; {raw!r} is not one.")
    value = int(raw) if len(raw) <= 9 else None  # 10**9 is past any bound; int() refuses very long digit strings
    if value is None or value < fix.minimum or (maximum is not None and value > maximum):
        raise ApplyError(f"--apply {text}: {wanted}; {raw} is out of range.")
    return value


def _value(fix: Appliable, raw: str, text: str) -> Any:
    word = raw.lower()
    if fix.kind == "count":
        return _count(fix, raw, text)
    if fix.kind == "precision":
        if word in PRECISIONS:
            return word
        if word in BOOL_WORDS:
            return "high" if BOOL_WORDS[word] else "highest"
        raise ApplyError(f"--apply {text}: {fix.id} takes {', '.join(PRECISIONS)} (or on/off), not {raw!r}.")
    if fix.kind == "choice":
        if word not in fix.choices:
            raise ApplyError(f"--apply {text}: {fix.id} takes {' or '.join(fix.choices)}, not {raw!r}.")
        return word
    if word not in BOOL_WORDS:
        raise ApplyError(f"--apply {text}: {fix.id} takes on or off, not {raw!r}.")
    return BOOL_WORDS[word]


class Injector:
    """The fixes one process was asked to apply: ``install`` patches what they need (nothing at all without
    fixes), ``results`` says where each applied and why not elsewhere."""

    def __init__(self, fixes: list[dict[str, Any]]) -> None:
        self.fixes: dict[str, Any] = {f["id"]: f["value"] for f in fixes}
        self._where: dict[str, list[str]] = {i: [] for i in self.fixes}
        self._why: dict[str, list[str]] = {i: [] for i in self.fixes}
        self._ignored: dict[str, list[str]] = {i: [] for i in self.fixes}
        self._loaders = 0
        self._optimizers = 0

    def install(self, patch: Callable[[Any, str, Callable[[Any], Any]], None]) -> None:
        """Patch torch for the requested fixes with ``patch(owner, name, make)`` (hooks.py's: removable)."""
        if not self.fixes:
            return
        for ids, install in (
            (LOADER_FIXES, self._install_loader),
            (OPTIMIZER_FIXES, self._install_optimizer),
            (("zero_grad.set_to_none",), self._install_zero_grad),
            (tuple(DDP_KWARGS), self._install_ddp),
            (("precision.bf16",), self._install_autocast),
            (("tf32", "cudnn.benchmark", "debug.anomaly", "debug.deterministic", "host.threads"), self._install_flags),
            (("malloc.mmap_threshold",), self._install_malloc),
            (("malloc.allocator",), self._check_allocator),
        ):
            wanted = {i: self.fixes[i] for i in ids if i in self.fixes}
            if not wanted:
                continue
            try:
                install(patch, wanted)
            except Exception as error:  # the script runs as written; the summary says why the fix is missing
                self._fail(wanted, f"stepscope could not install it ({type(error).__name__}: {error})")

    def results(self) -> list[dict[str, Any]]:
        """One entry per requested fix: {id, value, applied, where, why}, with ``ignored`` (the script's attempts to
        set a guarded flag back) and ``note`` where there is something to say."""
        out = []
        for fix_id, value in self.fixes.items():
            where, why = self._where[fix_id], self._why[fix_id]
            entry: dict[str, Any] = {
                "id": fix_id,
                "value": value,
                "applied": bool(where),
                "where": "; ".join(where) or None,
                "why": "; ".join(why) or (None if where else NEVER.get(fix_id, "it never had a chance to apply")),
            }
            if self._ignored[fix_id]:
                entry["ignored"] = list(self._ignored[fix_id])
            if fix_id == "ddp.find_unused_parameters" and where and value is False:
                entry["note"] = UNPROVEN
            out.append(entry)
        return out

    # -- bookkeeping -------------------------------------------------------------------------------------------

    def _fail(self, wanted: dict[str, Any], why: str) -> None:
        for fix_id in wanted:
            self._why[fix_id].append(why)

    @functools.cached_property
    def _kinds(self) -> CodeKinds:
        # built at the first site asked for, from inside a patched torch call: torch is imported by then, so its
        # folder counts as library code wherever it is installed
        return CodeKinds()

    def _site(self) -> str:
        """``file.py:LINE`` of the user's frame that led here (the innermost outside installed libraries and stepscope:
        the line of the script or of its own package, not of Lightning or torch); ``?`` when none is (``python -c``)."""
        frame = sys._getframe(1)
        while frame is not None and self._kinds.kind(frame.f_code) != USER:
            frame = frame.f_back
        if frame is None:
            return "?"
        return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"

    # -- DataLoader ----------------------------------------------------------------------------------------------

    def _install_loader(self, patch: Callable[..., None], wanted: dict[str, Any]) -> None:
        from torch.utils.data import DataLoader

        def make(original: Any) -> Any:
            signature = inspect.signature(original)

            def __init__(loader: Any, *args: Any, **kwargs: Any) -> None:
                try:
                    bound = signature.bind(loader, *args, **kwargs)
                    label = f"DataLoader #{self._loaders} ({self._site()})"
                    self._loaders += 1
                    done = self._loader_kwargs(bound.arguments, signature.parameters, wanted, label)
                except Exception as error:
                    self._fail(wanted, f"stepscope could not read a DataLoader's arguments ({error})")
                    return original(loader, *args, **kwargs)
                try:
                    if "loader.num_workers" not in done:
                        return original(*bound.args, **bound.kwargs)
                    # The worker count was asked for (workers that wait need no core): torch's warning that it
                    # exceeds the cores, at construction and at each new iterator, is stepscope's doing, not the
                    # script's.
                    with warnings.catch_warnings():
                        warnings.filterwarnings("ignore", message=WORKER_COUNT_WARNING, category=UserWarning)
                        original(*bound.args, **bound.kwargs)
                    loader.check_worker_number_rationality = lambda: None
                    return None
                except Exception as error:  # torch refused the combination: build the loader as written
                    for fix_id in done:
                        self._where[fix_id].remove(label)
                        self._why[fix_id].append(f"{label}: torch refused it ({type(error).__name__}: {error})")
                    return original(loader, *args, **kwargs)

            return __init__

        patch(DataLoader, "__init__", make)

    def _loader_kwargs(
        self, arguments: dict[str, Any], parameters: Any, wanted: dict[str, Any], label: str
    ) -> list[str]:
        """Set the requested loader arguments in ``arguments`` (kept valid: no prefetch or persistent workers
        without workers); returns the fixes applied."""
        import torch
        from torch.utils.data import IterableDataset

        def get(name: str) -> Any:
            return arguments.get(name, parameters[name].default)

        done = []
        workers = get("num_workers")
        if "loader.num_workers" in wanted:
            count = wanted["loader.num_workers"]
            if count > 0 and isinstance(get("dataset"), IterableDataset):
                self._why["loader.num_workers"].append(
                    f"{label}: an IterableDataset yields its data once per worker unless it splits it by "
                    "get_worker_info(); the loader keeps its own workers"
                )
            else:
                arguments["num_workers"] = workers = count
                done.append("loader.num_workers")
        if workers == 0:  # no workers: the settings that need them must be off, or torch refuses the loader
            arguments["persistent_workers"] = False
            arguments["prefetch_factor"] = None
        for fix_id, name in (
            ("loader.persistent_workers", "persistent_workers"),
            ("loader.prefetch", "prefetch_factor"),
        ):
            if fix_id not in wanted:
                continue
            if workers == 0:
                self._why[fix_id].append(f"{label}: it needs worker processes and the loader has num_workers=0")
            else:
                arguments[name] = wanted[fix_id]
                done.append(fix_id)
        if "loader.pin_memory" in wanted:
            pin = wanted["loader.pin_memory"]
            if pin and not torch.accelerator.is_available():
                self._why["loader.pin_memory"].append(f"{label}: no accelerator, so there is nothing to pin for")
            else:
                arguments["pin_memory"] = pin
                done.append("loader.pin_memory")
        for fix_id in done:
            self._where[fix_id].append(label)
        return done

    # -- optimizers ----------------------------------------------------------------------------------------------

    def _install_optimizer(self, patch: Callable[..., None], wanted: dict[str, Any]) -> None:
        import torch

        classes = []
        for value in vars(torch.optim).values():
            if isinstance(value, type) and issubclass(value, torch.optim.Optimizer) and "__init__" in vars(value):
                names = inspect.signature(value.__init__).parameters
                if "foreach" in names or "fused" in names:
                    classes.append(value)
        patched = frozenset(classes)
        for cls in classes:
            patch(cls, "__init__", self._make_optimizer_init(cls, patched, wanted))

    def _make_optimizer_init(self, cls: type, patched: frozenset[type], wanted: dict[str, Any]) -> Any:
        def make(original: Any) -> Any:
            signature = inspect.signature(original)

            def __init__(optimizer: Any, *args: Any, **kwargs: Any) -> None:
                # AdamW's constructor calls Adam's: only the outermost patched class applies (and records).
                if next(c for c in type(optimizer).__mro__ if c in patched) is not cls:
                    return original(optimizer, *args, **kwargs)
                try:
                    bound = signature.bind(optimizer, *args, **kwargs)
                    params = bound.arguments["params"] = _materialize(bound.arguments["params"])
                    as_written = dict(bound.arguments)
                    label = f"{type(optimizer).__name__} #{self._optimizers} ({self._site()})"
                    self._optimizers += 1
                    done = self._optimizer_kwargs(bound.arguments, signature.parameters, params, wanted, label)
                except Exception as error:
                    self._fail(wanted, f"stepscope could not read an optimizer's arguments ({error})")
                    return original(optimizer, *args, **kwargs)
                try:
                    return original(*bound.args, **bound.kwargs)
                except Exception as error:  # torch refused it (differentiable=True, ...): build it as written
                    for fix_id in done:
                        self._where[fix_id].remove(label)
                        self._why[fix_id].append(f"{label}: torch refused it ({type(error).__name__}: {error})")
                    bound.arguments.clear()
                    bound.arguments.update(as_written)
                    return original(*bound.args, **bound.kwargs)

            return __init__

        return make

    def _optimizer_kwargs(
        self, arguments: dict[str, Any], parameters: Any, params: list[Any], wanted: dict[str, Any], label: str
    ) -> list[str]:
        done = []
        if "optimizer.foreach" in wanted:
            on = wanted["optimizer.foreach"]
            if "foreach" not in parameters:
                self._why["optimizer.foreach"].append(f"{label}: the class has no foreach implementation")
            else:
                arguments["foreach"] = on
                if on and arguments.get("fused"):
                    arguments["fused"] = False  # torch refuses both at once
                done.append("optimizer.foreach")
        if "optimizer.fused" in wanted:
            on = wanted["optimizer.fused"]
            unfit = _unfused(params) if on else None
            if "fused" not in parameters:
                self._why["optimizer.fused"].append(f"{label}: the class has no fused kernel")
            elif unfit:
                self._why["optimizer.fused"].append(f"{label}: {unfit}")
            else:
                arguments["fused"] = on
                if on and arguments.get("foreach"):
                    arguments["foreach"] = False
                done.append("optimizer.fused")
        for fix_id in done:
            self._where[fix_id].append(label)
        return done

    # -- zero_grad -----------------------------------------------------------------------------------------------

    def _install_zero_grad(self, patch: Callable[..., None], wanted: dict[str, Any]) -> None:
        import torch

        to_none = wanted["zero_grad.set_to_none"]
        seen: set[type] = set()

        def make(original: Any) -> Any:
            def zero_grad(owner: Any, set_to_none: bool = True) -> Any:
                if type(owner) not in seen:  # where, once per class: the stack walk is not per call
                    seen.add(type(owner))
                    self._where["zero_grad.set_to_none"].append(f"{type(owner).__name__}.zero_grad ({self._site()})")
                return original(owner, to_none)

            return zero_grad

        patch(torch.optim.Optimizer, "zero_grad", make)
        patch(torch.nn.Module, "zero_grad", make)

    # -- DistributedDataParallel ---------------------------------------------------------------------------------

    def _install_ddp(self, patch: Callable[..., None], wanted: dict[str, Any]) -> None:
        import torch.distributed as dist

        if not dist.is_available():
            self._fail(wanted, "this torch build has no torch.distributed")
            return
        from torch.nn.parallel import DistributedDataParallel

        def make(original: Any) -> Any:
            signature = inspect.signature(original)

            def __init__(model: Any, *args: Any, **kwargs: Any) -> None:
                try:
                    bound = signature.bind(model, *args, **kwargs)
                    inner = bound.arguments.get("module")
                    label = f"DistributedDataParallel({type(inner).__name__}) ({self._site()})"
                    for fix_id, value in wanted.items():
                        bound.arguments[DDP_KWARGS[fix_id]] = value
                except Exception as error:
                    self._fail(wanted, f"stepscope could not read DistributedDataParallel's arguments ({error})")
                    return original(model, *args, **kwargs)
                try:
                    result = original(*bound.args, **bound.kwargs)
                except TypeError as error:
                    # Raised before DDP's first collective (an argument this torch lacks): safe to build it again.
                    self._fail(wanted, f"{label}: torch refused it ({error})")
                    return original(model, *args, **kwargs)
                for fix_id in wanted:
                    self._where[fix_id].append(label)
                return result

            return __init__

        patch(DistributedDataParallel, "__init__", make)

    # -- bf16 autocast -------------------------------------------------------------------------------------------

    def _install_autocast(self, patch: Callable[..., None], wanted: dict[str, Any]) -> None:
        import torch

        if not wanted["precision.bf16"]:
            self._fail(wanted, "off is the default: there is nothing to apply")
            return
        compiling = torch.compiler.is_compiling
        autocast_on = torch.is_autocast_enabled
        devices: dict[int, str] = {}  # module id -> its parameters' device type ("" without parameters)

        def make(original: Any) -> Any:
            def __call__(module: Any, *args: Any, **kwargs: Any) -> Any:
                device = devices.get(id(module))
                if device is None:
                    device = devices[id(module)] = self._autocast_device(module)
                if not device or compiling() or autocast_on(device):
                    return original(module, *args, **kwargs)  # inner calls run inside the outer one's autocast
                with torch.autocast(device, dtype=torch.bfloat16):
                    return original(module, *args, **kwargs)

            return __call__

        patch(torch.nn.Module, "__call__", make)

    def _autocast_device(self, module: Any) -> str:
        param = next(module.parameters(), None)
        if param is None:
            return ""
        self._where["precision.bf16"].append(f"{type(module).__name__} on {param.device.type} ({self._site()})")
        return param.device.type

    # -- torch's global flags ------------------------------------------------------------------------------------

    def _install_flags(self, patch: Callable[..., None], wanted: dict[str, Any]) -> None:
        """Set each flag now, then guard it: the script's later call to set it back is ignored and recorded."""
        import torch

        cudnn_props = vars(type(torch.backends.cudnn))

        def guard(fix_id: str, owner: Any, name: str, want: Any, said: Callable[[Any], str]) -> None:
            def make(original: Any) -> Any:
                def setter(value: Any, *args: Any, **kwargs: Any) -> Any:
                    if value != want:
                        self._ignored[fix_id].append(f"{said(value)} at {self._site()}")
                        value = want
                    return original(value, *args, **kwargs)

                return setter

            patch(owner, name, make)

        if "tf32" in wanted:
            precision = wanted["tf32"]
            torch.set_float32_matmul_precision(precision)
            torch.backends.cudnn.allow_tf32 = precision != "highest"
            guard(
                "tf32",
                torch,
                "set_float32_matmul_precision",
                precision,
                lambda v: f"set_float32_matmul_precision({v!r})",
            )
            guard(
                "tf32", cudnn_props["allow_tf32"], "setter", precision != "highest", lambda v: f"cudnn.allow_tf32={v}"
            )
            self._where["tf32"].append(f"float32 matmul precision {precision!r} from torch's import on")
        if "cudnn.benchmark" in wanted:
            on = wanted["cudnn.benchmark"]
            torch.backends.cudnn.benchmark = on
            guard("cudnn.benchmark", cudnn_props["benchmark"], "setter", on, lambda v: f"cudnn.benchmark={v}")
            self._where["cudnn.benchmark"].append(f"cudnn.benchmark={on} from torch's import on")
        if "debug.anomaly" in wanted:
            on = wanted["debug.anomaly"]
            torch.set_anomaly_enabled(on)
            guard(
                "debug.anomaly",
                torch,
                "set_anomaly_enabled",
                on,
                lambda v: f"anomaly detection turned {describe_value(v)}",
            )
            self._where["debug.anomaly"].append(f"anomaly detection {describe_value(on)} from torch's import on")
        if "debug.deterministic" in wanted:
            on = wanted["debug.deterministic"]
            torch.use_deterministic_algorithms(on)
            torch.backends.cudnn.deterministic = on
            guard("debug.deterministic", torch, "use_deterministic_algorithms", on, lambda v: f"deterministic={v}")
            guard(
                "debug.deterministic", cudnn_props["deterministic"], "setter", on, lambda v: f"cudnn.deterministic={v}"
            )
            self._where["debug.deterministic"].append(
                f"deterministic algorithms {describe_value(on)} from torch's import on"
            )
        if "host.threads" in wanted:
            threads = wanted["host.threads"]
            torch.set_num_threads(threads)
            guard("host.threads", torch, "set_num_threads", threads, lambda v: f"set_num_threads({v})")
            self._where["host.threads"].append(f"{threads} intra-op thread(s) from torch's import on")

    # -- the allocator -------------------------------------------------------------------------------------------

    def _install_malloc(self, patch: Callable[..., None], wanted: dict[str, Any]) -> None:
        """Fix glibc's thresholds now: the script's allocations from here on (and its forked loader workers') keep
        their pages instead of giving them back to the kernel at every free."""
        threshold = wanted["malloc.mmap_threshold"]
        running = allocator()
        if running != "glibc":
            self._why["malloc.mmap_threshold"].append(f"the process runs on {running}, not glibc's malloc")
            return
        set_thresholds(threshold)
        from_start = threshold_env(threshold).items() <= os.environ.items()  # launch.py set them for the child
        since = "the process's start (environment)" if from_start else "torch's import on"
        self._where["malloc.mmap_threshold"].append(
            f"glibc's mmap threshold {threshold:,} bytes and trim threshold {2 * threshold:,} from {since}"
        )

    def _check_allocator(self, patch: Callable[..., None], wanted: dict[str, Any]) -> None:
        """The allocator was preloaded before the interpreter started (launch.py's LD_PRELOAD): say whether this
        process runs on it."""
        name, running = wanted["malloc.allocator"], allocator()
        if running == name:
            self._where["malloc.allocator"].append(f"the process runs on {name} (LD_PRELOAD)")
        else:
            self._why["malloc.allocator"].append(
                f"the process runs on {running}: the LD_PRELOAD of {name} did not take (a launcher that clears the "
                "environment, or a setuid program)"
            )

    def mmap_threshold(self) -> list[int]:
        """The mmap threshold ``--apply malloc.mmap_threshold`` set in this process ([] when none)."""
        fix = "malloc.mmap_threshold"
        return [self.fixes[fix]] if fix in self.fixes and self._where[fix] else []


def _materialize(params: Any) -> Any:
    """An optimizer's ``params`` as a list (a generator can be read only once: the fused check reads it first)."""
    import torch

    if isinstance(params, torch.Tensor):
        return params  # torch's own error for a bare tensor stays torch's
    items = list(params)
    return [{**g, "params": _materialize(g["params"])} if isinstance(g, dict) else g for g in items]


def _unfused(params: list[Any]) -> str | None:
    """Why torch's fused kernels cannot take these parameters (None: they can): they need floating-point tensors
    on a device that has the kernels (torch checks only at the first step, by raising)."""
    import torch

    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        supported = _get_fused_kernels_supported_devices()
    except ImportError:  # an older torch: CUDA was the only device with them
        supported = ["cuda"]
    groups = [p["params"] if isinstance(p, dict) else [p] for p in params]
    tensors = [t for g in groups for t in ([g] if isinstance(g, torch.Tensor) else g) if isinstance(t, torch.Tensor)]
    for tensor in tensors:
        if tensor.device.type not in supported or not torch.is_floating_point(tensor):
            return (
                f"fused needs floating-point parameters on {', '.join(supported)}; "
                f"found {str(tensor.dtype).removeprefix('torch.')} on {tensor.device.type}"
            )
    return None
