"""Paged prefill/extend attention (varlen chunks of new tokens): Triton kernel and launcher.

Twin: ``reference.paged_prefill_attention`` (same signature plus ``max_query_len``).
One kernel serves full prefill, chunked prefill and prefix-cache hits: the new tokens' keys and
values are already in the cache (``reshape_and_cache`` first), so every key, cached or new, is
read through the block table, and "prefix" versus "self" differ only in the causal mask.
Hot path: nothing that synchronises with the device may be added when ``max_query_len`` is given.

Provenance of the ideas (the code is our own):
* Triton fused-attention tutorial (06-fused-attention.py): tiled online softmax in base 2,
  causal masking only where a key tile crosses the diagonal.
* vLLM's ``prefix_prefill`` / ``context_attention_fwd`` and SGLang's ``extend_attention``:
  queries of a chunk attending to keys gathered through the block table.
* Grouped-query packing as in SGLang/vLLM decode kernels: the rows of one program are
  ``BLOCK_Q`` tokens x the ``group`` query heads that share a KV head, so a K/V tile is loaded
  once for all of them.

Algorithm of ``_prefill_kernel``, program (seq, kv_head, q_tile):
1. q_len = query_start_loc[seq+1] - query_start_loc[seq]; the chunk's token i sits at
   position seq_len - q_len + i. The program takes tokens [q_tile*BLOCK_Q, +BLOCK_Q) (exits if
   past q_len); row r is token r // BLOCK_G, head r % BLOCK_G of the group.
2. keys needed: [max(0, first_pos - window + 1), last_pos + 1), walked in BLOCK_N tiles aligned
   to multiples of BLOCK_N; key position -> (block_tables[seq, pos // block_size],
   pos % block_size).
3. mask: key_pos <= q_pos, key_pos > q_pos - window; online softmax that tolerates rows with no
   admissible key in a tile (padding rows, window edges).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .host_math import INTERPRETING, cdiv, next_power_of_2
from .kv_tiles import check_query_and_caches, load_kv_tile, softmax_update, tile_scores

_LOG2E = 1.4426950408889634
# "No sliding window" is a window longer than any context: the kernel stays branch-free.
_NO_WINDOW = 1 << 30


@triton.jit
def _attend_tiles(
    acc, l_i, m_i, q, q_pos, row_valid,
    k_cache_ptr, v_cache_ptr, table_ptr,  # table_ptr: this sequence's block-table row
    kv_head, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    offs_n, offs_d, mask_d, lo, last_pos, sliding_window, qk_scale_log2,
    tile_lo, tile_hi,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,  # False: every key of every tile is admitted for every valid row
    EVEN_D: tl.constexpr,  # HEAD_DIM == D_PAD: no head-dim mask on the loads
    UPCAST: tl.constexpr,
):
    """Key tiles [tile_lo, tile_hi) into the running softmax (acc, l_i, m_i) of the rows.
    Unmasked tiles with an unpadded head dimension load with no mask at all."""
    for tile in range(tile_lo, tile_hi):
        pos = tile * BLOCK_N + offs_n
        key_valid = (pos >= lo) & (pos <= last_pos)  # read when MASKED only
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, table_ptr, pos, key_valid, kv_head,
                            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                            offs_d, mask_d, BLOCK_SIZE, MASKED, EVEN_D, UPCAST)
        k, v = k.to(q.dtype), v.to(q.dtype)  # an fp8 cache's bytes widened (else as loaded)
        s = tile_scores(q, k, UPCAST)
        if MASKED:
            allowed = key_valid[None, :] & (pos[None, :] <= q_pos[:, None]) & row_valid[:, None]
            allowed = allowed & (pos[None, :] > q_pos[:, None] - sliding_window)
            s = tl.where(allowed, s * qk_scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing yet
        else:
            s = s * qk_scale_log2
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = m_new  # finite: every key of the tile is admitted
        acc, l_i = softmax_update(acc, l_i, m_i, s, m_safe, v, UPCAST)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    qk_scale_log2,
    sliding_window,  # tokens; the launcher passes _NO_WINDOW when there is none
    stride_qt, stride_qh,  # query [T, H, D]
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bts,
    stride_ot, stride_oh,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_G: tl.constexpr,  # group padded to a power of two
    BLOCK_Q: tl.constexpr,  # query tokens per program; rows = BLOCK_Q * BLOCK_G
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):
    EVEN_D: tl.constexpr = HEAD_DIM == D_PAD
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    # The last query tiles attend to the most keys: launched first, so that the grid does
    # not end on a tail of long programs.
    q_tile = tl.num_programs(2) - 1 - tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # tokens before this chunk

    ROWS: tl.constexpr = BLOCK_Q * BLOCK_G
    offs_r = tl.arange(0, ROWS)
    tok = q_tile * BLOCK_Q + offs_r // BLOCK_G  # index within the chunk
    g = offs_r % BLOCK_G
    row_valid = (tok < q_len) & (g < GROUP)
    q_pos = ctx_len + tok
    heads = kv_head * GROUP + g
    offs_d = tl.arange(0, D_PAD)
    mask_d = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)

    q_rows = (q_start + tok).to(tl.int64) * stride_qt + heads * stride_qh
    q = tl.load(
        q_ptr + q_rows[:, None] + offs_d[None, :],
        mask=row_valid[:, None] & mask_d[None, :], other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    first_pos = ctx_len + q_tile * BLOCK_Q
    last_pos = tl.minimum(first_pos + BLOCK_Q, seq_len) - 1
    lo = tl.maximum(first_pos - sliding_window + 1, 0)
    tile_begin = lo // BLOCK_N
    tile_end = tl.cdiv(last_pos + 1, BLOCK_N)
    # Tiles every valid row admits whole (keys in [last_pos - window + 1, first_pos]) need
    # no mask: [full_lo, full_hi). Those before (the window's lower edge) and after (the
    # diagonal) are masked. Same tiles in the same order: the same sums as one masked loop.
    full_lo = tl.minimum(tl.cdiv(tl.maximum(last_pos - sliding_window + 1, 0), BLOCK_N),
                         tile_end)
    full_lo = tl.maximum(full_lo, tile_begin)
    full_hi = tl.minimum(tl.maximum((first_pos + 1) // BLOCK_N, full_lo), tile_end)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_PAD], tl.float32)
    table_ptr = block_tables_ptr + seq * stride_bts
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_pos, row_valid, k_cache_ptr, v_cache_ptr, table_ptr,
        kv_head, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        offs_n, offs_d, mask_d, lo, last_pos, sliding_window, qk_scale_log2,
        tile_begin, full_lo, BLOCK_SIZE, BLOCK_N, True, EVEN_D, UPCAST)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_pos, row_valid, k_cache_ptr, v_cache_ptr, table_ptr,
        kv_head, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        offs_n, offs_d, mask_d, lo, last_pos, sliding_window, qk_scale_log2,
        full_lo, full_hi, BLOCK_SIZE, BLOCK_N, False, EVEN_D, UPCAST)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_pos, row_valid, k_cache_ptr, v_cache_ptr, table_ptr,
        kv_head, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        offs_n, offs_d, mask_d, lo, last_pos, sliding_window, qk_scale_log2,
        full_hi, tile_end, BLOCK_SIZE, BLOCK_N, True, EVEN_D, UPCAST)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + heads * stride_oh
    tl.store(
        out_ptr + o_rows[:, None] + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & mask_d[None, :],
    )


def _check_inputs(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, out):
    check_query_and_caches(query, key_cache, value_cache, "num_tokens")
    num_seqs = block_tables.shape[0] if block_tables.dim() == 2 else -1
    if num_seqs < 0:
        raise ValueError(f"block_tables must be [num_seqs, max_blocks], got {tuple(block_tables.shape)}")
    if query_start_loc.shape != (num_seqs + 1,) or seq_lens.shape != (num_seqs,):
        raise ValueError(
            f"query_start_loc must be [num_seqs + 1] and seq_lens [num_seqs] (num_seqs={num_seqs}),"
            f" got {tuple(query_start_loc.shape)} and {tuple(seq_lens.shape)}"
        )
    for name, t in (("block_tables", block_tables), ("query_start_loc", query_start_loc),
                    ("seq_lens", seq_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32/int64, got {t.dtype}")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache),
                    ("block_tables", block_tables), ("query_start_loc", query_start_loc),
                    ("seq_lens", seq_lens)):
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, query on {query.device}")
    if out is not None and (out.shape != query.shape or out.stride(-1) != 1):
        raise ValueError(f"out must have the query's shape {tuple(query.shape)}, stride(-1) 1")


# Launch configuration: (rows per program = query tokens x the group padded to a power of two,
# tokens per key tile, warps). The fp32 accumulator is rows x D_PAD and must stay in registers;
# rows >= 16 so tl.dot maps onto tensor cores.
#   * 16-bit, D <= 128: 128-row programs (half as many programs, each K/V tile loaded once for
#     twice the queries). At D = 128 the 128 x 128 accumulator leaves room only for 32-key
#     tiles with 4 warps; at D <= 64 the accumulator is half that, and 64-key tiles with 8
#     warps are best. Measured on an H200 (kernels_bench --cases prefill_tune, 2026-11-26,
#     bf16, batch 8 x 2,048-token prompts, us): 32 heads / 4 KV heads of dim 128: 64 rows x
#     64 keys x 4 warps (the old default) 1,059, 128 x 32 x 4 911.8 (best of 8), 128 x 64 x 8
#     1,114; 14 / 2 heads of dim 64: 258.9, 279.2, 229.6 (best of 8).
#   * float32 (twice the bytes per tile; not swept) and D <= 128: 64 x 64, 4 warps;
#   * D > 128: 32 x 32, 4 warps.
def choose_prefill_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(rows per program, tokens per key tile, warps) for the prefill kernel. See above."""
    d_pad = next_power_of_2(head_dim)
    if d_pad > 128:
        return 32, 32, 4
    if dtype == torch.float32:
        return 64, 64, 4
    return (128, 64, 8) if d_pad <= 64 else (128, 32, 4)


def paged_prefill_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    seq_lens: torch.Tensor,  # [num_seqs]
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    max_query_len: int | None = None,
    block_q: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> torch.Tensor:
    """Launch the prefill/extend kernel. ``max_query_len=None`` reads it from
    ``query_start_loc`` (a device-to-host sync on CUDA: pass it from the step plan).
    ``block_q``, ``block_n``, ``num_warps`` and ``num_stages`` override the launch
    configuration (kernels_bench's prefill sweep); the defaults are what the executor runs."""
    _check_inputs(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, out)
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = block_tables.shape[0]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len <= 0:
        return out

    interpreting = INTERPRETING
    d_pad = next_power_of_2(head_dim)
    block_g = next_power_of_2(group)
    # Query tokens per program = rows / group (a GQA-8 program of 128 rows covers 16 tokens x
    # 8 heads), no more than the longest chunk needs, and rows >= 16.
    rows, default_block_n, default_warps = choose_prefill_config(head_dim, query.dtype)
    if block_q is None:
        block_q = max(1, rows // block_g)
        block_q = min(block_q, next_power_of_2(max_query_len))
        block_q = max(block_q, max(1, 16 // block_g))  # keep rows >= 16
    if block_n is None:
        block_n = default_block_n
    if num_warps is None:
        num_warps = default_warps
    upcast = interpreting or query.dtype == torch.float32
    window = int(sliding_window) if sliding_window and sliding_window > 0 else _NO_WINDOW

    grid = (num_seqs, num_kv_heads, cdiv(max_query_len, block_q))
    _prefill_kernel[grid](
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, out,
        float(scale) * _LOG2E, window,
        *query.stride()[:2], *key_cache.stride()[:3], *value_cache.stride()[:3],
        block_tables.stride(0), *out.stride()[:2],
        GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_G=block_g, BLOCK_Q=block_q, BLOCK_N=block_n, UPCAST=upcast,
        num_warps=num_warps, num_stages=1 if interpreting else num_stages,
    )
    return out
