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


def batch_samples(tensors: list[Any]) -> int:
    """Samples in a batch: the first dimension of its first tensor (0 when it has none)."""
    for tensor in tensors:
        if tensor.dim() >= 1:
            return int(tensor.shape[0])
    return 0
