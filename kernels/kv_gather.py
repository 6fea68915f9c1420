"""Keys and values gathered from the paged cache into dense scratch tensors, widened to
float32: what the attention twins (decode_twin.py, prefill_twin.py) compute on. Layout:
reference.py's docstring."""

from __future__ import annotations

import threading

import torch

from .kv_dtypes import widen_e4m3_
from .step_memo import memoized


class _Scratch(threading.local):
    """Per-thread buffers the gathers below reuse across layers and steps.

    A decode step gathers every sequence's keys and values into a dense tensor, layer after
    layer: megabytes each time. Fresh tensors that size come from the C allocator's mmap and
    go back to the kernel when freed, so every gather paid page faults and the kernel's
    zeroing of fresh pages (a fresh 64 MB tensor filled at 1.2 GB/s on the 2-core VM, an
    existing one at 8 GB/s). A buffer per (slot, dtype, device) grows to the largest gather
    seen and is reused; what a gather returns is a view into it, valid until the same slot's
    next gather on this thread. The memory stays held: at most what the old code allocated
    afresh for its largest step (decode groups keep a gather within about twice the keys
    or values of the context it covers)."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, slot: int, numel: int, dtype: torch.dtype, device: torch.device):
        key = (slot, dtype, device)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:  # 25% headroom: contexts grow step by step
            # a normal tensor even in inference mode (the executor's), so that a later call
            # outside it may write into it too
            with torch.inference_mode(False):
                buf = torch.empty(numel + numel // 4, dtype=dtype, device=device)
            self.buffers[key] = buf
        return buf[:numel]


_scratch = _Scratch()


def _gather_context(
    cache: torch.Tensor, block_tables: torch.Tensor, max_len: int, slot: int,
    table: torch.Tensor | None = None,
) -> torch.Tensor:
    """[num_seqs, max_len, num_kv_heads, head_dim] gathered through the block tables, a view
    into this thread's scratch buffer ``slot``. One ``index_select`` of whole blocks (rows
    of ``block_size * num_kv_heads * head_dim`` contiguous elements); table entries past a
    sequence's end are clamped to block 0 and masked by the caller. ``table``: the block
    list `_gather_table` gives (when the caller has it)."""
    num_seqs = block_tables.shape[0]
    num_blocks, block_size = cache.shape[:2]
    if table is None:
        table = _gather_table(block_tables, max_len, block_size)
    flat = cache.view(num_blocks, -1)
    out = _scratch.get(slot, table.numel() * flat.shape[1], cache.dtype, cache.device)
    torch.index_select(flat, 0, table, out=out.view(table.numel(), flat.shape[1]))
    return out.view(num_seqs, table.numel() // max(num_seqs, 1) * block_size,
                    *cache.shape[2:])[:, :max_len]


def _gather_pair(
    key_cache: torch.Tensor, value_cache: torch.Tensor, table: torch.Tensor, num_seqs: int,
    max_len: int, slot: int,
) -> torch.Tensor | None:
    """[2, num_seqs, max_len, num_kv_heads, head_dim]: the keys then the values of
    `_gather_context` (``table`` its block list) by one ``index_select``, when the value
    cache follows the key cache in one tensor (a layer's ``kv_cache[layer]``, [2, blocks,
    ...]): the rows ``table`` and ``table + num_blocks`` of that tensor. None when the two
    are apart (the caller gathers each)."""
    num_blocks = key_cache.shape[0]
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()
            and key_cache.shape == value_cache.shape and key_cache.dtype == value_cache.dtype
            and value_cache.data_ptr() == key_cache.data_ptr()
            + key_cache.numel() * key_cache.element_size()):
        return None
    row = key_cache[0].numel()
    both = key_cache.as_strided((2 * num_blocks, row), (row, 1))
    rows = memoized("pair_table", (table,), lambda: torch.cat((table, table + num_blocks)))
    out = _scratch.get(slot, rows.numel() * row, key_cache.dtype, key_cache.device)
    torch.index_select(both, 0, rows, out=out.view(rows.numel(), row))
    per_seq = table.numel() // max(num_seqs, 1) * key_cache.shape[1]
    return out.view(2, num_seqs, per_seq, *key_cache.shape[2:])[:, :, :max_len]


def _gather_table(block_tables: torch.Tensor, max_len: int, block_size: int) -> torch.Tensor:
    """int64 [num_seqs * blocks]: the blocks holding each sequence's first ``max_len``
    positions, row after row (entries past a table's end, -1, as block 0)."""
    num_blocks_needed = (max_len + block_size - 1) // block_size
    return block_tables[:, :num_blocks_needed].reshape(-1).long().clamp_min(0)


def _in_float32(t: torch.Tensor, slot: int, copy: bool = False) -> torch.Tensor:
    """``t`` itself when float32 (unless ``copy``), else its float32 copy in scratch buffer
    ``slot``, contiguous in ``t``'s shape: the twins compute half-precision and fp8 caches
    in float32, as the kernels accumulate.

    e4m3 bytes on a CPU: kv_dtypes.widen_e4m3_ (a table of byte pairs)."""
    if t.dtype == torch.float32 and not copy:
        return t
    out = _scratch.get(slot, t.numel(), torch.float32, t.device).view(t.shape)
    if t.dtype != torch.float8_e4m3fn or t.device.type != "cpu" or t.shape[-1] % 2:
        return out.copy_(t)
    return widen_e4m3_(t, out, _scratch.get(slot, t.numel() // 2, torch.int32, t.device))
