"""What the decode and prefill kernels share (decode_attention.py, prefill_attention.py): one
tile of keys and values read through a block table, its scores, and the online-softmax
update of the running rows with it; and their launchers' checks of the query and caches."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_dtypes import is_fp8


def check_query_and_caches(query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, rows: str) -> None:
    """Raise ValueError/TypeError unless ``query`` is [rows, num_heads, head_dim] and both
    caches [num_blocks, block_size, num_kv_heads, head_dim] with its head dim and dtype (or
    both one fp8 dtype: kv_dtypes.py),
    num_kv_heads dividing num_heads, and every last axis contiguous (``rows``: the query's
    first axis as the messages name it)."""
    if query.dim() != 3:
        raise ValueError(f"query must be [{rows}, num_heads, head_dim], got {tuple(query.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, "
            f"head_dim], got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    _, num_heads, head_dim = query.shape
    _, _, num_kv_heads, cache_head_dim = key_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"head_dim mismatch: query {head_dim}, cache {cache_head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"unsupported query dtype {query.dtype}")
    if key_cache.dtype != value_cache.dtype or (
            key_cache.dtype != query.dtype and not is_fp8(key_cache.dtype)):
        raise TypeError(
            f"dtype mismatch: query {query.dtype}, caches {key_cache.dtype}/{value_cache.dtype} "
            "(the caches hold the query's dtype or an fp8 one)"
        )
    if query.stride(-1) != 1 or key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("the head_dim axis of query and caches must be contiguous (stride 1)")


@triton.jit
def load_kv_tile(
    k_cache_ptr, v_cache_ptr, table_ptr,  # table_ptr: this sequence's block-table row
    pos, valid,  # [BLOCK_N] key positions; which are in range (read when MASKED only)
    kv_head, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    offs_d, mask_d,
    BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr,  # False: every position of the tile is in range
    EVEN_D: tl.constexpr,  # HEAD_DIM == D_PAD: no head-dim mask
    UPCAST: tl.constexpr,  # float32 tiles (fp32 inputs, or the CPU interpreter)
):
    """(k, v) [BLOCK_N, D_PAD] of the keys at ``pos``: position -> (block_tables[pos //
    block_size], pos % block_size) -> cache row. Out-of-range positions read as 0; a tile
    wholly in range with an unpadded head dimension loads with no mask at all."""
    in_block = pos % BLOCK_SIZE
    if MASKED:
        block_ids = tl.load(table_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    else:
        block_ids = tl.load(table_ptr + pos // BLOCK_SIZE).to(tl.int64)
    k_ptrs = (k_cache_ptr + block_ids[:, None] * stride_kb + in_block[:, None] * stride_kt
              + kv_head * stride_kh + offs_d[None, :])
    v_ptrs = (v_cache_ptr + block_ids[:, None] * stride_vb + in_block[:, None] * stride_vt
              + kv_head * stride_vh + offs_d[None, :])
    if MASKED:
        kv_mask = valid[:, None] & mask_d[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=mask_d[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=mask_d[None, :], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def tile_scores(q, k, UPCAST: tl.constexpr):
    """q @ k^T: [rows, BLOCK_N] (float32 dots when UPCAST)."""
    if UPCAST:
        return tl.dot(q, tl.trans(k), input_precision="ieee")
    return tl.dot(q, tl.trans(k))


@triton.jit
def softmax_update(acc, l_i, m_i, s, m_ref, v, UPCAST: tl.constexpr):
    """The running softmax of the rows after one tile: scores ``s`` (base 2, -inf where not
    admitted), their values ``v``, every term rescaled from the old reference max ``m_i``
    to ``m_ref`` (finite). Returns (acc, l_i)."""
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if UPCAST:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, l_i
