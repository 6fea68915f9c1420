"""Paged decode attention (one query token per sequence): Triton kernels and launcher.

Twin: ``reference.paged_decode_attention`` (same signature minus ``num_splits``).
Hot path: nothing that synchronises with the device may be added to the launcher.

Provenance of the ideas (the code is our own):
* vLLM PagedAttention v1/v2 (csrc/attention): walk each sequence's block table; v2 splits the
  context into partitions and reduces them with their log-sum-exp in a second kernel.
* Flash-decoding (Dao et al., 2023) and SGLang's ``decode_attention`` Triton kernels: a fixed
  number of KV splits per sequence chosen on the host, and grouped-query decode where one
  program serves every query head that shares a KV head (rows of a ``tl.dot``), so each K/V
  tile is read from memory once per KV head, not once per query head.
* Triton fused-attention tutorial: online softmax with ``exp2`` and a rescaled accumulator.

Algorithm of ``_decode_kernel``, program (seq, kv_head, split):
1. rows = the ``group`` query heads of this KV head (padded to ``BLOCK_G`` >= 16 for tl.dot);
2. the attended range is [lo, seq_len) with lo = seq_len - sliding_window (or 0); it is cut
   into ``BLOCK_N``-token tiles aligned to multiples of BLOCK_N, and the tiles are dealt to
   ``num_splits`` splits in contiguous runs;
3. per tile, token -> (block_tables[seq, pos // block_size], pos % block_size) gives the cache
   row; scores = q @ k^T, online softmax, acc += p @ v; the tiles wholly inside
   [lo, seq_len) run without the token mask (and without any load mask when the head
   dimension is unpadded), the window's first tile and the last partial tile with it
   (``MASK_EVERY_TILE``: every tile from the first whole one on with it, in one loop);
4. one split: write acc / l in the output dtype. Several: write the normalised fp32
   partial acc / l and its lse (base 2; an empty split, one past the sequence's tiles,
   writes lse = -inf alone: in CUDA graphs the split count comes from the table width, the
   model's longest context, so a short sequence leaves most splits empty); they are
   combined, over the sequence's non-empty splits only, either by ``_reduce_kernel`` (a
   second launch) or (up to ``FUSED_REDUCE_MAX_SPLITS`` splits) by the split that finishes
   last: each split counts itself in on a per-(seq, kv_head) counter after its partials are written, and the
   one that brings the count to ``num_splits`` reads every split's partials back, writes the
   output and resets the counter to 0 for the next launch (so it stays valid in CUDA graphs).

``ROPE`` (the launcher's ``rope=``, a decode step's new token a sequence): q and the new
keys arrive as the QKV projection left them; the program rotates its query rows and its KV
head's new keys (neox, with the rotary kernel's roundings: the same values to the bit),
writes the new keys and values at the token's slot (every split of a sequence alike; a
padding row's slot -1 writes nothing), and a barrier puts those writes before its own reads
of the cache, whose last tile holds the token. One launch a layer fewer than the rotary
kernel and then this one. The same values to the bit needs the rotation's roundings kept
apart: compiled for a GPU, LLVM narrows the float32 products and sums of bfloat16 values to
bfloat16 and contracts them into fma.rn.bf16 instructions, one rounding where the rotary
kernel (or a different contraction) makes two; ``layer_ops.rotated`` is written so that no
contraction is possible (its docstring).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_reduce import _combine_if_last, _reduce_kernel
from .decode_rules import (  # noqa: F401 - the rules are read through this module too
    FUSED_REDUCE_MAX_SPLITS,
    MASK_EVERY_TILE,
    _counters,
    _num_sms,
    _split_counters,
    choose_block_n,
    choose_num_splits,
)
from .host_math import INTERPRETING, next_power_of_2
from .kv_dtypes import is_fp8, to_cache
from .kv_tiles import check_query_and_caches, load_kv_tile, softmax_update, tile_scores
from .layer_ops import rotated

_LOG2E = 1.4426950408889634
# "No sliding window" is a window longer than any context: the kernels stay branch-free.
_NO_WINDOW = 1 << 30


@triton.jit
def _decode_tiles(
    acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    offs_n, offs_d, mask_d, lo, seq_len, qk_scale_log2, tile_lo, tile_hi,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,  # False: every token of every tile is in [lo, seq_len)
    EVEN_D: tl.constexpr,  # HEAD_DIM == D_PAD: no head-dim mask
    UPCAST: tl.constexpr,
):
    """Tiles [tile_lo, tile_hi) into the running softmax (acc, l_i, m_i) of the group's
    query rows; unmasked tiles of an unpadded head dimension load with no mask at all."""
    for tile in range(tile_lo, tile_hi):
        pos = tile * BLOCK_N + offs_n
        valid = (pos >= lo) & (pos < seq_len)  # read when MASKED only
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, table_ptr, pos, valid, kv_head,
                            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                            offs_d, mask_d, BLOCK_SIZE, MASKED, EVEN_D, UPCAST)
        k, v = k.to(q.dtype), v.to(q.dtype)  # an fp8 cache's bytes widened (else as loaded)
        s = tile_scores(q, k, UPCAST) * qk_scale_log2
        if MASKED:
            s = tl.where(valid[None, :], s, float("-inf"))
        # Every tile holds at least one valid token, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        acc, l_i = softmax_update(acc, l_i, m_i, s, m_new, v, UPCAST)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _rotated(ptr, partner_ptr, mask, cos, sin, first):
    """Rotary embedding (neox) of the values at ``ptr``, whose other-half partners are at
    ``partner_ptr`` (``first``: the column is in the first half): the rotary kernel's own
    arithmetic (layer_ops.rotated), so its result to the bit."""
    xp = tl.load(partner_ptr, mask=mask, other=0.0).to(tl.float32)
    return rotated(tl.load(ptr, mask=mask, other=0.0), tl.where(first, -xp, xp), cos, sin)


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    split_counters_ptr,  # int32 [>= S * Hkv], zero between launches (fused reduction only)
    qk_scale_log2,  # softmax scale * log2(e)
    sliding_window,  # tokens; the launcher passes _NO_WINDOW when there is none
    stride_qs, stride_qh,  # query [S, H, D], last dim contiguous
    stride_kb, stride_kt, stride_kh,  # key cache [blocks, block_size, Hkv, D]
    stride_vb, stride_vt, stride_vh,
    stride_bts,  # block_tables [S, max_blocks]
    stride_os, stride_oh,  # out [S, H, D]
    stride_ps, stride_ph, stride_pk,  # partial out [S, H, splits, D_PAD]; lse [S, H, splits]
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,  # HEAD_DIM padded to a power of two: the tile's columns
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,  # compute the dots in fp32 (fp32 inputs, or the CPU interpreter)
    FUSED_REDUCE: tl.constexpr,  # the last split to finish combines (no second launch)
    # ROPE: q, the new token's keys (k_new) and values (v_new) arrive as the QKV projection
    # left them; rotated here and the new token cached at its slot (see above).
    k_new_ptr, v_new_ptr, cos_sin_ptr, slot_ptr,
    stride_kns, stride_knh, stride_vns, stride_vnh, stride_cs, stride_cc,
    ROPE: tl.constexpr,
    # True: the unmasked middle tiles and the last partial one in one masked loop (the
    # tail's loads pipelined behind the tile before it, every tile paying the mask);
    # False: the tail in a loop of its own (see the launcher's ``mask_every_tile``).
    MASK_EVERY_TILE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    lo = tl.maximum(seq_len - sliding_window, 0)
    lo_tile = lo // BLOCK_N
    num_tiles = tl.cdiv(seq_len, BLOCK_N) - lo_tile
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_begin = lo_tile + split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, lo_tile + num_tiles)
    # The splits with a tile, the first ``active`` (0 for a padding row); the others are
    # empty (a context shorter than the table width the split count was chosen for).
    active = tl.cdiv(num_tiles, tl.maximum(tiles_per_split, 1))

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    io_mask = mask_g[:, None] & mask_d[None, :]

    q_rows = q_ptr + seq * stride_qs + heads[:, None] * stride_qh
    if ROPE:
        half = HEAD_DIM // 2
        first = offs_d < half
        partner = tl.where(first, offs_d + half, offs_d - half)
        cos_row = cos_sin_ptr + seq * stride_cs + offs_d
        cos = tl.load(cos_row, mask=mask_d, other=0.0).to(tl.float32)
        sin = tl.load(cos_row + stride_cc, mask=mask_d, other=0.0).to(tl.float32)
        q = _rotated(q_rows + offs_d[None, :], q_rows + partner[None, :], io_mask,
                     cos[None, :], sin[None, :], first[None, :])
        # The new token's keys of this program's KV head, rotated, and its values, written
        # at its slot (-1: a padding row, nothing written) by every split of the sequence
        # alike; the barrier puts the writes before this program's reads of the cache (the
        # last tile holds the token).
        k_row = k_new_ptr + seq * stride_kns + kv_head * stride_knh
        k_new = _rotated(k_row + offs_d, k_row + partner, mask_d, cos, sin, first)
        v_new = tl.load(v_new_ptr + seq * stride_vns + kv_head * stride_vnh + offs_d, mask=mask_d,
                        other=0.0)
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        write = mask_d & (offs_d.to(tl.int64) * 0 + slot >= 0)  # a [D_PAD] mask
        slot = tl.maximum(slot, 0)
        block_id = slot // BLOCK_SIZE
        in_block = slot % BLOCK_SIZE
        tl.store(k_cache_ptr + block_id * stride_kb + in_block * stride_kt + kv_head * stride_kh
                 + offs_d, to_cache(k_new, k_cache_ptr), mask=write)
        tl.store(v_cache_ptr + block_id * stride_vb + in_block * stride_vt + kv_head * stride_vh
                 + offs_d, to_cache(v_new, v_cache_ptr), mask=write)
        tl.debug_barrier()
    else:
        q = tl.load(q_rows + offs_d[None, :], mask=io_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D_PAD], tl.float32)

    # Tiles wholly inside [lo, seq_len) need no token mask: [full_lo, full_hi); the
    # window's first tile and the last partial one are masked. Same tiles, same order.
    full_lo = tl.minimum(tl.maximum(tl.cdiv(lo, BLOCK_N), tile_begin), tile_end)
    full_hi = tl.maximum(tl.minimum(seq_len // BLOCK_N, tile_end), full_lo)
    if MASK_EVERY_TILE:
        full_hi = full_lo  # [full_lo, tile_end) in the masked loop below
    table_ptr = block_tables_ptr + seq * stride_bts
    acc, l_i, m_i = _decode_tiles(
        acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        offs_n, offs_d, mask_d, lo, seq_len, qk_scale_log2, tile_begin, full_lo,
        BLOCK_SIZE, BLOCK_N, True, HEAD_DIM == D_PAD, UPCAST)
    acc, l_i, m_i = _decode_tiles(
        acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        offs_n, offs_d, mask_d, lo, seq_len, qk_scale_log2, full_lo, full_hi,
        BLOCK_SIZE, BLOCK_N, False, HEAD_DIM == D_PAD, UPCAST)
    acc, l_i, m_i = _decode_tiles(
        acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        offs_n, offs_d, mask_d, lo, seq_len, qk_scale_log2, full_hi, tile_end,
        BLOCK_SIZE, BLOCK_N, True, HEAD_DIM == D_PAD, UPCAST)

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        # Empty split (split >= active): lse = -inf and no partial output written; the
        # reductions read only the active splits' (the same sums: an empty split's weight
        # is 0).
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        base = seq * stride_ps + heads * stride_ph + split * stride_pk
        # every padded column too (zeros): the reduction reads whole rows
        filled = mask_g & (offs_g * 0 + split < active)  # a [BLOCK_G] mask
        tl.store(part_out_ptr + base[:, None] + offs_d[None, :], out, mask=filled[:, None])
        # part_lse is part_out without its last axis: same index, strides divided by its
        # padded head dim.
        tl.store(part_lse_ptr + base // D_PAD, lse, mask=mask_g)
        if FUSED_REDUCE:
            _combine_if_last(
                out_ptr, part_out_ptr, part_lse_ptr,
                split_counters_ptr + seq * tl.num_programs(1) + kv_head,
                seq, heads, mask_g, offs_d, mask_d, active,
                stride_os, stride_oh, stride_ps, stride_ph, stride_pk,
                BLOCK_G, D_PAD, NUM_SPLITS,
            )


# --- launcher (its rules: decode_rules.py) ----------------------------------------------------


def _check_inputs(query, key_cache, value_cache, block_tables, seq_lens, out):
    check_query_and_caches(query, key_cache, value_cache, "num_seqs")
    num_seqs = query.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be [num_seqs={num_seqs}, max_blocks], got {tuple(block_tables.shape)}"
        )
    if block_tables.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"block_tables must be int32/int64, got {block_tables.dtype}")
    if seq_lens.shape != (num_seqs,) or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be int32/int64 [num_seqs={num_seqs}]")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache),
                    ("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, query on {query.device}")
    if out is not None and (out.shape != query.shape or out.stride(-1) != 1):
        raise ValueError(f"out must have the query's shape {tuple(query.shape)}, stride(-1) 1")


def _check_rope(query, key_cache, value_cache, key, value, cos_sin, slot_mapping) -> None:
    from .cache_ops import check_cache_write

    check_cache_write(key, value, key_cache, value_cache, slot_mapping)
    num_seqs, _, head_dim = query.shape
    if key.shape[0] != num_seqs or key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(f"rope: key and value must be [{num_seqs}, Hkv, {head_dim}] in the "
                         f"query's dtype {query.dtype}")
    if head_dim % 2:
        raise ValueError(f"rope: head_dim must be even, got {head_dim}")
    if cos_sin.shape != (num_seqs, 2, head_dim) or cos_sin.stride(-1) != 1 \
            or cos_sin.dtype != query.dtype:
        raise ValueError(f"rope: cos_sin must be [{num_seqs}, 2, {head_dim}] in "
                         f"{query.dtype}, last axis contiguous, got {tuple(cos_sin.shape)}")
    for name, t in (("key", key), ("value", value), ("cos_sin", cos_sin),
                    ("slot_mapping", slot_mapping)):
        if t.device != query.device:
            raise ValueError(f"rope: {name} is on {t.device}, query on {query.device}")


def paged_decode_attention_triton(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # [num_seqs]
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    fused_reduce: bool | None = None,
    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    mask_every_tile: bool | None = None,
) -> torch.Tensor:
    """Launch plain (1 split) or split-K decode; ``num_splits=None`` applies the rule above.
    ``block_n`` (tokens per tile), ``num_warps``, ``num_stages`` and ``fused_reduce`` (split-K
    combined in the same launch; None: up to ``FUSED_REDUCE_MAX_SPLITS`` splits) override the
    launch configuration (benchmarks/kernels_bench.py ``--cases tune`` sweeps them).
    ``mask_every_tile`` (None: ``MASK_EVERY_TILE``): the last partial tile read in the same
    loop as the whole ones, every tile masked (the same tiles in the same order: equal to
    the bit under the interpreter; compiled, within a bf16 ulp, the two loops' code
    differing), instead of in a loop of its own (``--cases decode_tail`` times both).
    ``rope`` = (key, value, cos_sin,
    slot_mapping) of the new tokens (one a sequence, [S, Hkv, D], [S, Hkv, D], [S, 2, D],
    [S]): ``query`` and ``key`` are not yet rotated; the kernel rotates them, as
    ``ops.rotary_embedding_and_cache`` would, and writes the new keys and values into the
    caches at their slots before attending (module docstring), in this one launch."""
    _check_inputs(query, key_cache, value_cache, block_tables, seq_lens, out)
    if rope is not None:
        _check_rope(query, key_cache, value_cache, *rope)
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out

    interpreting = INTERPRETING
    num_sms = _num_sms(query.device)
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size
        if sliding_window is not None and sliding_window > 0:
            max_context = min(max_context, sliding_window)
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context,
                                       num_sms, head_dim)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")

    d_pad = next_power_of_2(head_dim)
    block_g = max(16, next_power_of_2(group))
    if block_n is None:
        block_n = choose_block_n(num_seqs * num_kv_heads * num_splits, num_sms, head_dim,
                                 query.dtype, is_fp8(key_cache.dtype))
    upcast = interpreting or query.dtype == torch.float32
    window = int(sliding_window) if sliding_window and sliding_window > 0 else _NO_WINDOW
    qk_scale_log2 = float(scale) * _LOG2E

    fused = num_splits > 1 and (num_splits <= FUSED_REDUCE_MAX_SPLITS if fused_reduce is None
                                else fused_reduce)
    counters = _counters(query.device, num_seqs * num_kv_heads) if fused else out  # or unused
    if num_splits == 1:
        part_out = part_lse = out  # unused
        p_strides = (0, 0, 0)
    else:
        part_out = torch.empty(
            (num_seqs, num_heads, num_splits, d_pad), dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty(
            (num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device
        )
        p_strides = part_out.stride()[:3]

    if rope is None:
        k_new = v_new = cos_sin = slots = query  # unused
        rope_strides = (0,) * 6
    else:
        k_new, v_new, cos_sin, slots = rope
        rope_strides = (*k_new.stride()[:2], *v_new.stride()[:2], *cos_sin.stride()[:2])
    grid = (num_seqs, num_kv_heads, num_splits)
    _decode_kernel[grid](
        query, key_cache, value_cache, block_tables, seq_lens,
        out, part_out, part_lse, counters,
        qk_scale_log2, window,
        *query.stride()[:2], *key_cache.stride()[:3], *value_cache.stride()[:3],
        block_tables.stride(0), *out.stride()[:2],
        *p_strides,
        GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_G=block_g, BLOCK_N=block_n, NUM_SPLITS=num_splits, UPCAST=upcast,
        FUSED_REDUCE=fused,
        k_new_ptr=k_new, v_new_ptr=v_new, cos_sin_ptr=cos_sin, slot_ptr=slots,
        stride_kns=rope_strides[0], stride_knh=rope_strides[1], stride_vns=rope_strides[2],
        stride_vnh=rope_strides[3], stride_cs=rope_strides[4], stride_cc=rope_strides[5],
        ROPE=rope is not None,
        MASK_EVERY_TILE=MASK_EVERY_TILE if mask_every_tile is None else mask_every_tile,
        num_warps=num_warps,
        num_stages=1 if interpreting else (2 if num_stages is None else num_stages),
    )
    if num_splits > 1 and not fused:
        _reduce_kernel[(num_seqs, num_heads)](
            out, part_out, part_lse,
            out.stride(0), out.stride(1),
            *p_strides,
            HEAD_DIM=head_dim, D_PAD=d_pad, NUM_SPLITS=num_splits,
            SPLITS_PAD=next_power_of_2(num_splits),
            num_warps=4,
        )
    return out
