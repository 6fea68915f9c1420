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
   dimension is unpadded), the window's first tile and the last partial tile with it;
4. one split: write acc / l in the output dtype. Several: write the normalised fp32
   partial acc / l and its lse (base 2); they are combined either by ``_reduce_kernel`` (a
   second launch) or (up to ``FUSED_REDUCE_MAX_SPLITS`` splits) by the split that finishes
   last: each split counts itself in on a per-(seq, kv_head) counter after its partials are written, and the
   one that brings the count to ``num_splits`` reads every split's partials back, writes the
   output and resets the counter to 0 for the next launch (so it stays valid in CUDA graphs).

``ALL_KV_HEADS`` (program (seq, 0, split)): one program reads every KV head of a sequence,
for narrow KV (num_kv_heads * head_dim <= 256, e.g. Qwen2.5-0.5B's 2 x 64). A token's keys
of all KV heads are contiguous in the cache (256 B there, instead of two 128-byte halves
read by two programs at different times), and the block table is read once, not once per
KV head. The tile is [BLOCK_N, num_kv_heads * head_dim]; the query rows are every query
head, each holding its query in its own KV head's columns and zeros elsewhere (a
block-diagonal query), so one ``tl.dot`` scores every head against its own keys only; the
``p @ v`` product also fills the other heads' columns of a row, which the store drops. The
dots do num_kv_heads times the arithmetic, which a memory-bound decode has to spare.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .host_math import INTERPRETING, all_kv_heads_from_env, next_power_of_2
from .kv_tiles import load_kv_tile, softmax_update, tile_scores

_LOG2E = 1.4426950408889634
# ``ALL_KV_HEADS`` applies up to this many cache columns a token (num_kv_heads * head_dim,
# padded) and query heads (the dots' rows); off unless asked for (``all_kv_heads=True``, or
# PAGEDSERVE_DECODE_ALL_KV_HEADS=1 for every launch) until a GPU has measured it against
# the one-KV-head programs.
_ALL_KV_HEADS_MAX_WIDTH = 256
_ALL_KV_HEADS_MAX_ROWS = 64
ALL_KV_HEADS_DEFAULT = all_kv_heads_from_env()
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
        s = tile_scores(q, k, UPCAST) * qk_scale_log2
        if MASKED:
            s = tl.where(valid[None, :], s, float("-inf"))
        # Every tile holds at least one valid token, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        acc, l_i = softmax_update(acc, l_i, m_i, s, m_new, v, UPCAST)
        m_i = m_new
    return acc, l_i, m_i


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
    D_PAD: tl.constexpr,  # the tile's columns: HEAD_DIM padded, or KV_WIDTH padded
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,  # compute the dots in fp32 (fp32 inputs, or the CPU interpreter)
    FUSED_REDUCE: tl.constexpr,  # the last split to finish combines (no second launch)
    ALL_KV_HEADS: tl.constexpr,  # one program reads every KV head (see above)
    KV_WIDTH: tl.constexpr,  # the columns read: num_kv_heads * HEAD_DIM, else HEAD_DIM
    DN_PAD: tl.constexpr,  # HEAD_DIM padded: the partials' last axis
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

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    if ALL_KV_HEADS:
        # Rows: every query head; columns: every KV head's dims side by side, as a token's
        # keys lie in the cache. Row r holds its query in its KV head's columns, zeros in
        # the others', so q @ k^T scores it against its own KV head alone, and its row of
        # p @ v is right in those columns (the rest is dropped when stored).
        mask_g = offs_g < GROUP * (KV_WIDTH // HEAD_DIM)
        mask_d = offs_d < KV_WIDTH
        heads = offs_g
        cols = offs_d % HEAD_DIM  # the column's dim within its head
        io_mask = (mask_g[:, None] & mask_d[None, :]
                   & ((offs_d // HEAD_DIM)[None, :] == (offs_g // GROUP)[:, None]))
        part_mask = io_mask
    else:
        mask_g = offs_g < GROUP
        mask_d = offs_d < HEAD_DIM
        heads = kv_head * GROUP + offs_g
        cols = offs_d
        io_mask = mask_g[:, None] & mask_d[None, :]
        part_mask = mask_g[:, None] & (offs_d < D_PAD)[None, :]

    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + cols[None, :],
                mask=io_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D_PAD], tl.float32)

    # Tiles wholly inside [lo, seq_len) need no token mask: [full_lo, full_hi); the
    # window's first tile and the last partial one are masked. Same tiles, same order.
    full_lo = tl.minimum(tl.maximum(tl.cdiv(lo, BLOCK_N), tile_begin), tile_end)
    full_hi = tl.maximum(tl.minimum(seq_len // BLOCK_N, tile_end), full_lo)
    table_ptr = block_tables_ptr + seq * stride_bts
    acc, l_i, m_i = _decode_tiles(
        acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        offs_n, offs_d, mask_d, lo, seq_len, qk_scale_log2, tile_begin, full_lo,
        BLOCK_SIZE, BLOCK_N, True, KV_WIDTH == D_PAD, UPCAST)
    acc, l_i, m_i = _decode_tiles(
        acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        offs_n, offs_d, mask_d, lo, seq_len, qk_scale_log2, full_lo, full_hi,
        BLOCK_SIZE, BLOCK_N, False, KV_WIDTH == D_PAD, UPCAST)
    acc, l_i, m_i = _decode_tiles(
        acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        offs_n, offs_d, mask_d, lo, seq_len, qk_scale_log2, full_hi, tile_end,
        BLOCK_SIZE, BLOCK_N, True, KV_WIDTH == D_PAD, UPCAST)

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + cols[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        # Empty split (short sequence): l_i == 0, lse = -inf, and the reduction ignores it.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        base = seq * stride_ps + heads * stride_ph + split * stride_pk
        tl.store(part_out_ptr + base[:, None] + cols[None, :], out, mask=part_mask)
        # part_lse is part_out without its last axis: same index, strides divided by its
        # padded head dim.
        tl.store(part_lse_ptr + base // DN_PAD, lse, mask=mask_g)
        if FUSED_REDUCE:
            offs_p = tl.arange(0, DN_PAD)
            _combine_if_last(
                out_ptr, part_out_ptr, part_lse_ptr,
                split_counters_ptr + seq * tl.num_programs(1) + kv_head,
                seq, heads, mask_g, offs_p, offs_p < HEAD_DIM,
                stride_os, stride_oh, stride_ps, stride_ph, stride_pk,
                BLOCK_G, DN_PAD, NUM_SPLITS,
            )


@triton.jit
def _combine_if_last(
    out_ptr, part_out_ptr, part_lse_ptr, counter_ptr,
    seq, heads, mask_g, offs_d, mask_d,
    stride_os, stride_oh, stride_ps, stride_ph, stride_pk,
    BLOCK_G: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """Called by every split of (seq, kv_head) after writing its partials; the last to
    arrive combines them (out = sum_k 2^(lse_k - lse) out_k) and resets the counter.
    Ordering: the barrier puts every thread's partial stores before the counter's
    acq_rel increment (a release at GPU scope, cumulative over the CTA); the last
    arrival's acquire makes the other splits' stores visible to its loads, which go to L2
    (``.cg``), never to a possibly stale L1 line."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == NUM_SPLITS - 1:
        tl.store(counter_ptr, 0)  # every split has counted: nobody reads it in this launch
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D_PAD], tl.float32)
        for k in range(NUM_SPLITS):  # online: one split's partials in registers at a time
            base = seq * stride_ps + heads * stride_ph + k * stride_pk
            lse_k = tl.load(part_lse_ptr + base // D_PAD, mask=mask_g, other=float("-inf"),
                            cache_modifier=".cg")
            out_k = tl.load(part_out_ptr + base[:, None] + offs_d[None, :],
                            mask=mask_g[:, None] & mask_d[None, :], other=0.0,
                            cache_modifier=".cg")
            m_new = tl.maximum(m, lse_k)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # empty so far
            alpha = tl.exp2(m - m_safe)
            w = tl.exp2(lse_k - m_safe)  # 0 for an empty split
            l_sum = l_sum * alpha + w
            acc = acc * alpha[:, None] + out_k * w[:, None]
            m = m_new
        out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
        tl.store(
            out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mask_g[:, None] & mask_d[None, :],
        )


@triton.jit
def _reduce_kernel(
    out_ptr, part_out_ptr, part_lse_ptr,
    stride_os, stride_oh,
    stride_ps, stride_ph, stride_pk,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """Program (seq, head): out = sum_k 2^(lse_k - lse) * out_k with lse = log2 sum 2^lse_k."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_k = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask_k = offs_k < NUM_SPLITS
    base = seq * stride_ps + head * stride_ph + offs_k * stride_pk
    lse = tl.load(part_lse_ptr + base // D_PAD, mask=mask_k, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)  # 0 for empty splits
    total = tl.sum(w, 0)
    w = w / tl.where(total > 0, total, 1.0)
    parts = tl.load(part_out_ptr + base[:, None] + offs_d[None, :], mask=mask_k[:, None], other=0.0)
    out = tl.sum(parts * w[:, None], 0)
    tl.store(
        out_ptr + seq * stride_os + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


# --- launcher ---------------------------------------------------------------------------------

# Split-K rule. A plain decode launch has num_seqs * num_kv_heads programs, each walking a
# whole context. A GPU needs enough loads in flight per SM to hide memory latency, and a
# program's tile is BLOCK_N x head_dim: narrow heads need more programs for the same bytes.
#   * the target is _TARGET_PROGRAMS_PER_SM programs per SM for head dim 128, twice that for
#     head dim <= 64;
#   * splits = the target / the programs, rounded (1 when the grid is already about there: no
#     reduction pass, no partial-result traffic), never into pieces shorter than
#     _MIN_TOKENS_PER_SPLIT (below that the partial writes and the second kernel cost more
#     than the parallelism buys), and at most _MAX_SPLITS.
# Measured on an H100 (benchmarks/README, kernels_bench --cases tune, 2026-11-26): Qwen2.5-0.5B
# shape (2 KV heads, dim 64) at batch 64: 1 split 21.8 us, 3 (the old rule, 2 per SM for every
# head dim, rounded up) 14.1, 4 (this rule) 12.8, 6 12.75, 16 16.1 at 1k context, and 104 /
# 58.5 / 54.7 at 4k; 4 KV heads of dim 128 at batch 64: 1 split 53.2 us, 2 54.5 at 1k, 189.8
# and 185.8 at 4k (this rule: 1); at batch 256 one split was fastest for both shapes.
# The context length is bounded from the block-table width (max_blocks_per_seq * block_size),
# a host-side shape, so choosing needs no device-to-host read of seq_lens.
# Example (H100, 132 SMs): batch 1, 4 KV heads, 16k context -> 64 splits of 256 tokens;
# batch 64, 2 KV heads of dim 64 (128 programs, target 528) -> 4 splits; batch 256 -> 1.
_TARGET_PROGRAMS_PER_SM = 2
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 64


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 108  # a stand-in for the interpreter, so the rule behaves as on a mid-size GPU


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_context_len: int, num_sms: int, head_dim: int = 128,
) -> int:
    """Number of KV splits per sequence for split-K decode (1 = plain kernel). See above."""
    programs = max(1, num_seqs * num_kv_heads)
    per_sm = _TARGET_PROGRAMS_PER_SM * (2 if head_dim <= 64 else 1)
    wanted = round(per_sm * num_sms / programs)
    longest = max_context_len // _MIN_TOKENS_PER_SPLIT
    if wanted <= 1 or longest < 2:
        return 1
    return max(1, min(wanted, longest, _MAX_SPLITS))


# Tokens per tile. 64 keeps a program's K and V tiles (64 x D_PAD) in registers for D <= 128
# with 4 warps; 32 for wider heads. When the grid is small (at most _WIDE_TILE_PROGRAMS_PER_SM
# programs per SM after splitting) and the cache is 16-bit, 128-token tiles are faster: each
# program has twice the bytes in flight per loop iteration, which is what hides memory latency
# when there are few programs per SM; with many programs the extra registers cost occupancy.
# Measured on an H200 (132 SMs; benchmarks/README "GPU check", kernels_bench --cases tune,
# 2026-11-26, bf16, us, 64-token / 128-token tiles at the split rule's count): 4 KV heads of
# dim 128, batch 64 (256 programs): 45.6 / 38.3 at 1k, 169.3 / 133.1 at 4k; batch 256 (1,024
# programs, above 4 per SM): 130.8 / 140.7 and 508.5 / 537.2, so 64 stays; Qwen2.5-0.5B shape
# (2 KV heads of dim 64) batch 64 with 4 splits (512 programs): 12.25 / 11.34 at 1k, 44.85 /
# 40.33 at 4k; batch 256 (512 programs): 41.9 / 38.1 and 151.1 / 136.2. float32 keeps 64 (its
# tiles are twice the bytes; not swept). Compiled for sm_90 (scripts/compile_kernels.py), a
# 128-token program holds 38 KiB of shared memory at head dim 64 and 72 KiB at 128 (80 pads
# to 128): at most 3 fit an SM (227 KiB) there, so a grid of 3-4 a SM would run in two
# waves; the limit is 3 for heads wider than 64.
_WIDE_TILE_PROGRAMS_PER_SM = 4
_WIDE_TILE_PROGRAMS_PER_SM_D128 = 3


def choose_block_n(num_programs: int, num_sms: int, head_dim: int,
                   dtype: torch.dtype) -> int:
    """Tokens per tile of the decode kernel for a grid of ``num_programs``. See above."""
    d_pad = next_power_of_2(head_dim)
    if d_pad > 128:
        return 32
    per_sm = _WIDE_TILE_PROGRAMS_PER_SM if d_pad <= 64 else _WIDE_TILE_PROGRAMS_PER_SM_D128
    if dtype != torch.float32 and num_programs <= per_sm * num_sms:
        return 128
    return 64


# Split-K reduction in the attention launch (``_combine_if_last``) instead of a second
# launch: saves the second kernel's launch and ramp (a few us, against 11-45 us kernels at the
# split rule's shapes), costs the last split a serial read of the partials. Measured on an
# H200 (2026-11-27, kernels_bench --cases tune, 32 q / 4 kv heads, d128, batch 64/256, context
# 1k/4k): fused faster at 2-8 splits in 11 of 12 cases (by 0.5-16 us; one tie), slower at 16
# splits in all 4 (by 3-16 us: the last split's serial combine). So: fused up to this many
# splits, the second launch above it (0: never fused).
FUSED_REDUCE_MAX_SPLITS = 8
# Per-device arrival counters of the fused reduction: zero between launches (each launch's
# last splits reset theirs), so one buffer serves every launch on the device's stream —
# launches that overlap on two streams must not share it (the executor uses one stream).
_split_counters: dict[torch.device, torch.Tensor] = {}
_MIN_COUNTERS = 8192  # 256 sequences x 32 KV heads: no growth while CUDA graphs capture


def _counters(device: torch.device, needed: int) -> torch.Tensor:
    counters = _split_counters.get(device)
    if counters is None or counters.numel() < needed:
        counters = torch.zeros(max(needed, _MIN_COUNTERS), dtype=torch.int32, device=device)
        _split_counters[device] = counters
    return counters


def all_kv_heads_applies(num_heads: int, num_kv_heads: int, head_dim: int,
                         key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether one program can read every KV head of a sequence (module docstring): more
    than one KV head, narrow enough, and each token's heads side by side in both caches."""
    return (num_kv_heads > 1 and num_heads <= _ALL_KV_HEADS_MAX_ROWS
            and next_power_of_2(num_kv_heads * head_dim) <= _ALL_KV_HEADS_MAX_WIDTH
            and key_cache.stride(2) == head_dim and value_cache.stride(2) == head_dim)


def _check_inputs(query, key_cache, value_cache, block_tables, seq_lens, out):
    if query.dim() != 3:
        raise ValueError(f"query must be [num_seqs, num_heads, head_dim], got {tuple(query.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, "
            f"head_dim], got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    num_seqs, num_heads, head_dim = query.shape
    _, _, num_kv_heads, cache_head_dim = key_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"head_dim mismatch: query {head_dim}, cache {cache_head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"unsupported query dtype {query.dtype}")
    if key_cache.dtype != query.dtype or value_cache.dtype != query.dtype:
        raise TypeError(
            f"dtype mismatch: query {query.dtype}, caches {key_cache.dtype}/{value_cache.dtype}"
        )
    if query.stride(-1) != 1 or key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("the head_dim axis of query and caches must be contiguous (stride 1)")
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
    all_kv_heads: bool | None = None,
) -> torch.Tensor:
    """Launch plain (1 split) or split-K decode; ``num_splits=None`` applies the rule above.
    ``block_n`` (tokens per tile), ``num_warps``, ``num_stages`` and ``fused_reduce`` (split-K
    combined in the same launch; None: up to ``FUSED_REDUCE_MAX_SPLITS`` splits) override the
    launch configuration (benchmarks/kernels_bench.py ``--cases tune`` sweeps them);
    ``all_kv_heads`` (None: ``ALL_KV_HEADS_DEFAULT``) reads every KV head in one program
    where `all_kv_heads_applies`, else is ignored."""
    _check_inputs(query, key_cache, value_cache, block_tables, seq_lens, out)
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
    wide = (ALL_KV_HEADS_DEFAULT if all_kv_heads is None else all_kv_heads) and (
        all_kv_heads_applies(num_heads, num_kv_heads, head_dim, key_cache, value_cache))
    # The tile's columns and rows: one KV head's dims and its group, or all of them.
    tile_d = next_power_of_2(num_kv_heads * head_dim) if wide else d_pad
    block_g = max(16, next_power_of_2(num_heads if wide else group))
    if block_n is None:
        block_n = choose_block_n(num_seqs * num_kv_heads * num_splits, num_sms, head_dim,
                                 query.dtype)
        if wide:  # the same bytes a tile as the one-head program's
            block_n = max(16, block_n * d_pad // tile_d)
    upcast = interpreting or query.dtype == torch.float32
    window = int(sliding_window) if sliding_window and sliding_window > 0 else _NO_WINDOW
    qk_scale_log2 = float(scale) * _LOG2E

    fused = num_splits > 1 and (num_splits <= FUSED_REDUCE_MAX_SPLITS if fused_reduce is None
                                else fused_reduce)
    grid_heads = 1 if wide else num_kv_heads
    counters = _counters(query.device, num_seqs * grid_heads) if fused else out  # or unused
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

    grid = (num_seqs, grid_heads, num_splits)
    _decode_kernel[grid](
        query, key_cache, value_cache, block_tables, seq_lens,
        out, part_out, part_lse, counters,
        qk_scale_log2, window,
        *query.stride()[:2], *key_cache.stride()[:3], *value_cache.stride()[:3],
        block_tables.stride(0), *out.stride()[:2],
        *p_strides,
        GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, D_PAD=tile_d,
        BLOCK_G=block_g, BLOCK_N=block_n, NUM_SPLITS=num_splits, UPCAST=upcast,
        FUSED_REDUCE=fused, ALL_KV_HEADS=wide,
        KV_WIDTH=num_kv_heads * head_dim if wide else head_dim, DN_PAD=d_pad,
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
