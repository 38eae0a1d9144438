"""What a batch holds: its tensors and its samples, read the same way by the hooks, the loader analysis and the
trainer integrations."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from typing import Any


def batch_tensors(batch: Any, limit: int = 64) -> list[Any]:
    """The tensors in a batch (a tensor, or tuples/lists/mappings/dataclasses of them three levels deep), at most
    ``limit``."""
    Tensor = sys.modules["torch"].Tensor  # imported by the script by now; an import statement here costs µs a step
    if isinstance(batch, Tensor):
        return [batch]
    if type(batch) in (tuple, list) and all(map(isinstance, batch, (Tensor,) * len(batch))):
        return list(batch[:limit])  # (inputs, targets): most batches, without the walk (nor a generator's frame)
    found: list[Any] = []
    todo = [(batch, 0)]
    while todo and len(found) < limit:
        item, depth = todo.pop(0)
        if isinstance(item, Tensor):
            found.append(item)
        elif depth < 3 and isinstance(item, (list, tuple)):
            todo.extend((x, depth + 1) for x in item)
        elif depth < 3 and isinstance(item, Mapping):
            todo.extend((x, depth + 1) for x in item.values())
        elif depth < 3 and is_dataclass(item) and not isinstance(item, type):
            # a batch class of its own (``@dataclass class Batch: images: Tensor; labels: Tensor``)
            todo.extend((getattr(item, f.name), depth + 1) for f in fields(item))
    return found


def batch_samples(batch: Any) -> int:
    """Samples in a batch (0 when nothing in it tells): a tensor's first dimension; for a batch of fields (a tuple,
    mapping or dataclass) the count its fields agree on, where a field is a batched tensor (its first dimension) or
    a sequence of per-sample items (its length: detection's images of different sizes and target dicts,
    ``collate_fn=lambda b: tuple(zip(*b))``; a list of sequences left unpadded). Without agreement, the first
    field's count."""
    Tensor = sys.modules["torch"].Tensor
    if isinstance(batch, Tensor):
        return int(batch.shape[0]) if batch.dim() >= 1 else 0
    if type(batch) in (tuple, list) and all(map(isinstance, batch, (Tensor,) * len(batch))):
        return _first_dim(batch)  # (inputs, targets): most batches
    return next(iter(_counts(batch, 0, Tensor)), 0)


def _first_dim(tensors: Any) -> int:
    for tensor in tensors:
        if tensor.dim() >= 1:
            return int(tensor.shape[0])
    return 0


def _counts(item: Any, depth: int, Tensor: type) -> list[int]:
    """The sample counts ``item`` is consistent with, most likely first."""
    if isinstance(item, Tensor):
        return [int(item.shape[0])] if item.dim() >= 1 else []
    if depth >= 3 or isinstance(item, (str, bytes)):
        return []
    if isinstance(item, (dict, Mapping)):  # dict first: a dict skips the ABC's slower check
        return _agreed([_counts(x, depth + 1, Tensor) for x in item.values()])
    if is_dataclass(item) and not isinstance(item, type):
        return _agreed([_counts(getattr(item, f.name), depth + 1, Tensor) for f in fields(item)])
    if not isinstance(item, (tuple, list)) or not item:
        return []
    if depth == 0:  # the batch's own fields
        return _agreed([_counts(x, 1, Tensor) for x in item])
    # A field that is a sequence: batched tensors side by side (a model's two inputs, each [B, ...]: their first
    # dimension, which tensors of different first dimensions cannot be) or one item per sample (its length); the
    # other fields tell which. Plain values (ids, file names) tell nothing: a batch of them alone has no samples/s.
    if all(map(isinstance, item, (Tensor,) * len(item))):
        firsts = {x.shape[0] for x in item if x.dim() >= 1}
        return [int(firsts.pop()), len(item)] if len(firsts) == 1 else [len(item)]
    # per-sample items are alike: the first tells (each is walked on every fetch)
    return [len(item)] if _counts(item[0], depth + 1, Tensor) else []


def _agreed(options: list[list[int]]) -> list[int]:
    """The counts every field with any agrees on, else the first such field's (most likely first)."""
    known = [x for x in options if x]
    if not known:
        return []
    shared = [n for n in known[0] if all(n in x for x in known[1:])]
    return shared or known[0]
