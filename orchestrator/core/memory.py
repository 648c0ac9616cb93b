"""What an object holds in tensors: the bytes of every tensor storage reachable from it, each counted once.

The outer optimizer's resident memory is a formula of the model's size (docs/outer.md); this is how the
test that keeps the default's footprint independent of the number of islands (tests/engine/test_outer_memory.py)
and benchmarks/outer_memory.py measure it, without trusting the object to say what it keeps: a copy held
anywhere inside it is counted, wherever it hides.
"""

from __future__ import annotations

import gc
import types
from typing import Any

import torch

__all__ = ["retained_tensor_bytes"]

# Shared by everything, never a copy an object made: not walked into.
_SKIP = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.CodeType, types.FrameType)


def retained_tensor_bytes(root: Any, *, by_kind: bool = False) -> int | dict[str, int]:
    """Bytes of the distinct tensor storages reachable from `root` through the objects it refers to.

    A storage shared by several tensors (views, the same tensor in two places) counts once, at its full
    size. With `by_kind`, a dict {dtype name: bytes} instead of the total (wire tensors show as int8/uint8).
    Objects, containers and tensors are followed through ``gc.get_referents``; classes, modules, functions
    and code are not.
    """
    seen: set[int] = set()
    storages: dict[int, tuple[str, int]] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _SKIP):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages.setdefault(storage.data_ptr(), (str(obj.dtype).removeprefix("torch."), storage.nbytes()))
            continue
        stack.extend(gc.get_referents(obj))
    if not by_kind:
        return sum(n for _, n in storages.values())
    out: dict[str, int] = {}
    for kind, n in storages.values():
        out[kind] = out.get(kind, 0) + n
    return out
