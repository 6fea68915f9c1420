"""What the torch twins derive from a step's metadata, derived once a forward, not once a
layer.

Every layer of a forward hands the twins the same block tables, context lengths and slot
mapping, and each layer derived the same things from them again: the gather's block list,
the decode mask, the rows' grouping by length, the cache write's slots. On a CPU each of
those is a few small tensor operations (a few microseconds each): a dozen a layer, about a
millisecond a step on the built-in model's 30 layers, where a decode step of one sequence
takes ~35 ms.

``forward_scope()`` opens a memo for one forward (the model's ``forward`` opens it); inside
it, ``memoized(name, tensors, compute)`` computes once per (name, the tensors' identities)
and returns the same value to every later layer. The memo holds the tensors it was keyed by,
so no other tensor can take their identity while it is open; the scope closes with the
forward, so a step's metadata never meets the next step's (whose tensors may reuse buffers
in place). Outside a scope (a twin called on its own, as the kernel tests call them) every
call computes afresh."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch


class _Memo(threading.local):
    def __init__(self) -> None:
        self.values: dict[tuple, tuple[Any, tuple[torch.Tensor, ...]]] | None = None


_memo = _Memo()


@contextlib.contextmanager
def forward_scope() -> Iterator[None]:
    """One forward's memo (nested scopes share the outer one)."""
    if _memo.values is not None:
        yield
        return
    _memo.values = {}
    try:
        yield
    finally:
        _memo.values = None


def memoized(name: str, tensors: tuple[torch.Tensor, ...], compute: Callable[[], Any]) -> Any:
    """``compute()``, once per scope for ``name`` and these tensor objects."""
    values = _memo.values
    if values is None:
        return compute()
    key = (name, *map(id, tensors))
    hit = values.get(key)
    if hit is None:
        hit = values[key] = (compute(), tensors)
    return hit[0]
