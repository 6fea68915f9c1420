"""Arrival counters of the kernels whose last program to finish a piece of work combines the
others' partial results (decode_reduce.py's split-K decode, linear_ops.py's split-K GEMM):
int32 zeros, per device, left at zero by every launch (its last arrivals reset theirs), so
one buffer serves every launch on the device's one stream. Grown, never shrunk; sized ahead
so that no growth (a new allocation) happens while a CUDA graph is captured. A buffer
replaced by a larger one is kept alive (`RETIRED`): a graph captured before still points at
it, and must not find its memory handed to another tensor."""

from __future__ import annotations

import torch

RETIRED: list[torch.Tensor] = []  # replaced device buffers some captured graph may still use


def arrival_counters(store: dict[torch.device, torch.Tensor], device: torch.device,
                     needed: int, minimum: int) -> torch.Tensor:
    """``store``'s counters on ``device``, at least ``needed`` (and ``minimum``) of them."""
    counters = store.get(device)
    if counters is None or counters.numel() < needed:
        if counters is not None:
            RETIRED.append(counters)
        counters = torch.zeros(max(needed, minimum), dtype=torch.int32, device=device)
        store[device] = counters
    return counters
