"""Block copies between caches in host memory, by runs of consecutive block ids.

Caches are ``[num_layers, 2, num_blocks, ...]``: a block is ``num_layers * 2`` strided
slabs. The twin's ``dst[:, :, dst_ids] = src[:, :, src_ids]`` goes through advanced
indexing, which on the CPU gathers and scatters element by element: 64 blocks of the
built-in model (23.6 MB) took 9-13 ms, 512 blocks 148-175 ms (one thread). Copying
``src[:, :, a:a+k]`` to ``dst[:, :, b:b+k]`` for each run of ids consecutive on both sides
is one strided memcpy per slab: 1.4-4.6 ms and 15-38 ms (the low figure when ids run
consecutively, as the block allocator mostly hands them out). One Python call per run: for
a single block, 0.01 ms against the twin's 0.14.

The runs are found with numpy (where either side's next id is not the previous one plus
one). Copies within one cache (copy-on-write) take this path only when no block is both a
source and a destination (the twin reads every source before writing any destination).
"""

from __future__ import annotations

import numpy as np
import torch


def block_runs(src_ids: np.ndarray, dst_ids: np.ndarray) -> list[tuple[int, int, int]]:
    """(first source id, first destination id, length) of each run of pairs whose ids
    both go up by one, in order."""
    n = len(src_ids)
    if n == 0:
        return []
    src = np.asarray(src_ids, dtype=np.int64)
    dst = np.asarray(dst_ids, dtype=np.int64)
    steps = (np.diff(src) == 1) & (np.diff(dst) == 1)
    starts = np.concatenate(([0], np.flatnonzero(~steps) + 1))
    ends = np.append(starts[1:], n)
    return [(int(src[s]), int(dst[s]), int(e - s))
            for s, e in zip(starts.tolist(), ends.tolist(), strict=True)]


def copy_blocks_by_runs(src_cache: torch.Tensor, dst_cache: torch.Tensor,
                        src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
    """``dst_cache[:, :, dst_ids] = src_cache[:, :, src_ids]`` (both in host memory, the
    same layout past dimension 2; either may be a strided view)."""
    for a, b, k in block_runs(src_ids, dst_ids):
        dst_cache[:, :, b:b + k].copy_(src_cache[:, :, a:a + k])


def mapping_ids(block_mapping: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """A (src, dst) mapping's two columns as int64 numpy arrays."""
    pairs = block_mapping.to("cpu", torch.int64).numpy()
    return pairs[:, 0], pairs[:, 1]


def swap_blocks_host(src_cache: torch.Tensor, dst_cache: torch.Tensor,
                     block_mapping: torch.Tensor) -> None:
    """``reference.swap_blocks`` for two caches in host memory."""
    if block_mapping.numel():
        copy_blocks_by_runs(src_cache, dst_cache, *mapping_ids(block_mapping))


def copy_blocks_host(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """``reference.copy_blocks`` for a cache in host memory (copy-on-write)."""
    if not block_mapping.numel():
        return
    src, dst = mapping_ids(block_mapping)
    if np.intersect1d(src, dst).size:  # a block read and written: the twin's order
        from .reference import copy_blocks
        copy_blocks(kv_cache, block_mapping)
        return
    copy_blocks_by_runs(kv_cache, kv_cache, src, dst)
