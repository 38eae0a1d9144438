"""The test suite's start-up for every Python process it launches (put on PYTHONPATH by tests/conftest.py).

torch imports ``torch._dynamo`` (~1.5 s of CPU on this project's machines, as much as ``import torch``) the first
time a training script builds an optimizer or calls its ``step``: ``torch._compile._disable_dynamo`` (on
``add_param_group``, ``zero_grad``) imports it so that a compiled region cannot trace into them, and the optimizers'
``_use_grad_for_differentiable`` (on ``step``) imports it to place graph breaks. In a process that never compiles,
both are no-ops around the call, and the suite starts hundreds of such processes. Here both wrappers call the
function as torch would without compiling while ``torch._dynamo`` has not been imported; once a script compiles
(which imports dynamo) every call goes through torch's own wrapper. A torch whose wrappers differ from these is
left as it is. Nothing else of torch is touched, and stepscope never does this in a user's process.
"""

import contextlib
import functools
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any


def _patch_disable(compile_module: ModuleType) -> None:
    original = compile_module._disable_dynamo

    def _disable_dynamo(fn: Callable[..., Any] | None = None, recursive: bool = True) -> Any:
        if fn is None:
            return functools.partial(_disable_dynamo, recursive=recursive)
        disabled = original(fn, recursive)

        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            if "torch._dynamo" not in sys.modules:  # nothing is compiling: disabling dynamo changes nothing
                return fn(*args, **kwargs)
            return disabled(*args, **kwargs)

        return inner

    compile_module._disable_dynamo = _disable_dynamo


def _patch_optimizer(optimizer_module: ModuleType) -> None:
    original = optimizer_module._use_grad_for_differentiable
    inner = [c for c in original.__code__.co_consts if hasattr(c, "co_names")]
    if len(inner) != 1 or not {"graph_break", "set_grad_enabled"} <= set(inner[0].co_names):
        return  # not the wrapper this was written for (another torch): left as it is

    def _use_grad_for_differentiable(func: Callable[..., Any]) -> Callable[..., Any]:
        wrapped = original(func)

        def _use_grad(*args: Any, **kwargs: Any) -> Any:
            if "torch._dynamo" in sys.modules:
                return wrapped(*args, **kwargs)
            torch = sys.modules["torch"]
            prev_grad = torch.is_grad_enabled()
            try:  # torch's wrapper without its graph breaks
                torch.set_grad_enabled(args[0].defaults["differentiable"])
                return func(*args, **kwargs)
            finally:
                torch.set_grad_enabled(prev_grad)

        functools.update_wrapper(_use_grad, func)
        return _use_grad

    optimizer_module._use_grad_for_differentiable = _use_grad_for_differentiable


PATCHES = {"torch._compile": _patch_disable, "torch.optim.optimizer": _patch_optimizer}


class _PatchOnImport:
    """Patches each module of ``PATCHES`` as it is imported, before the modules that take names from it."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        patch = PATCHES.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            load(module)
            with contextlib.suppress(Exception):  # torch as it is: only slower to start
                patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _PatchOnImport())
