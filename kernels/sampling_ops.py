"""The top-p (nucleus) threshold of whole vocabulary rows on the device, with no host read:
Triton kernel and launcher.

Twin: ``reference.top_p_thresholds_`` (sorts the rows it is given; which rows, it reads on
the host). The sampler first takes the threshold from each row's best 256 tokens; a row whose
nucleus reaches past them ("unresolved") needs the whole row. Finding those rows on the host
(`bool(unresolved.any())`) waits for the forward that produced the logits, which is what
the executor's overlapped steps must not do: here every row gets a program, the settled
ones return at once, and nothing is read back.

Algorithm of ``_top_p_threshold_kernel``, program = one row of logits x (fp32) with its
log-sum-exp ``lse`` and ``p`` = top_p. A token of logit v weighs e(v) = exp(max(v - lse,
EXP_FLOOR)), as in the twin's sorted cumulative sum. Map each logit to u(v) = its float's
bits as an ordered 32-bit key (the low 31 bits flipped when negative) plus 2^31, in
[0, 2^32): u orders as the logits do. Let f(k) = the mass of the tokens with u > k
(non-increasing in k). The twin keeps the tokens in descending order while the mass before
them is < p; with ties that is every token >= t*, t* = the smallest logit whose f(u) < p. So:
1. find the smallest k with f(k) < p by a radix search: the interval (lo, lo + width]
   starts as (-1, 2^32 - 1] (f(-1) is the whole mass, f(2^32 - 1) = 0 < p); each pass cuts
   it into 2^RADIX_BITS equal parts, sums the mass above every cut in one read of the row
   (from L2), and keeps the part where f falls below p: 32 / RADIX_BITS passes (fewer reads
   of the row for more arithmetic per element; kernels_bench --cases top_p times each);
2. t* = the smallest logit whose u is >= that k (one more pass).
The masses above the cuts are sums of nested sets of positive terms in one order, so they
are monotone in the cut as computed, and a cut measured twice gives the same sum. They are
summed in another order than the twin's cumulative sum, so the two can differ when a
prefix's mass lies within rounding of p (as the sampler's docstring allows across device
kinds); each is deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .host_math import INTERPRETING, cdiv, next_power_of_2

_HALF_RANGE: tl.constexpr = tl.constexpr(1 << 31)  # ordered int32 key -> [0, 2^32)
# Elements of a row read per iteration, by radix: the [BLOCK, 2^RADIX_BITS] mass tile stays
# at 16k elements (64 registers a thread with 8 warps).
_BLOCK_BY_RADIX = {1: 4096, 2: 4096, 4: 1024}
# The default: 16 reads of the row. Timed on an H200 (2026-11-27, 256 rows x 151,936,
# kernels_bench `sampling`): 1 / 8 / 256 rows past their best 256 tokens took 1.64 / 1.64 /
# 2.83 ms at 1 bit, 1.06 / 1.06 / 2.85 at 2 bits and 1.27 / 1.28 / 3.26 at 4 bits.
RADIX_BITS = 2
# Pieces a row is spread over (1: one program a row, the single launch): 1 until a GPU has
# timed the pieces (kernels_bench --cases sampling, ``chunksC_latency_us_p50``).
TOP_P_CHUNKS = 1


@triton.jit
def _ordered_key(x):
    """fp32 -> int32 whose signed order is the floats' order."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _mass_above(base, begin, end, lse, exp_floor, cuts, BLOCK: tl.constexpr,
                PARTS: tl.constexpr):
    """[PARTS]: the mass (e(v) a logit) of the logits at [begin, end) whose key is above
    each cut, summed in one order (per-lane running sums over BLOCK-wide tiles, then across
    the lanes)."""
    offs = tl.arange(0, BLOCK)
    mass = tl.zeros([BLOCK, PARTS], tl.float32)
    for start in range(begin, end, BLOCK):
        idx = start + offs
        valid = idx < end
        x = tl.load(base + idx, mask=valid, other=0.0)
        weight = tl.where(valid, tl.exp(tl.maximum(x - lse, exp_floor)), 0.0)
        above = _ordered_key(x).to(tl.int64)[:, None] + _HALF_RANGE > cuts[None, :]
        mass += tl.where(above, weight[:, None], 0.0)
    return tl.sum(mass, 0)


@triton.jit
def _smallest_above(base, begin, end, lo, BLOCK: tl.constexpr):
    """The smallest logit at [begin, end) whose key is above ``lo`` (inf: none)."""
    offs = tl.arange(0, BLOCK)
    smallest = tl.full([BLOCK], float("inf"), tl.float32)
    for start in range(begin, end, BLOCK):
        idx = start + offs
        valid = idx < end
        x = tl.load(base + idx, mask=valid, other=0.0)
        kept = valid & (_ordered_key(x).to(tl.int64) + _HALF_RANGE > lo)
        smallest = tl.minimum(smallest, tl.where(kept, x, float("inf")))
    return tl.min(smallest, 0)


@triton.jit
def _top_p_threshold_kernel(
    logits_ptr, lse_ptr, top_p_ptr, thresholds_ptr, unresolved_ptr,
    vocab, stride_row,
    exp_floor,
    BLOCK: tl.constexpr,
    RADIX_BITS: tl.constexpr,  # 1, 2 or 4: the search keeps 1 of 2^RADIX_BITS parts a pass
):
    row = tl.program_id(0)
    if tl.load(unresolved_ptr + row) == 0:
        return
    lse = tl.load(lse_ptr + row)
    p = tl.load(top_p_ptr + row)
    base = logits_ptr + row.to(tl.int64) * stride_row
    parts = tl.arange(0, 1 << RADIX_BITS)

    lo = tl.full([], -1, tl.int64)  # f(lo) >= p (else every token is kept: lo stays -1)
    width = tl.full([], 1 << 32, tl.int64)  # f(lo + width) < p
    for _ in range(32 // RADIX_BITS):
        width = width >> RADIX_BITS
        cuts = lo + (parts + 1).to(tl.int64) * width  # the last cut is the known upper end
        mass = _mass_above(base, 0, vocab, lse, exp_floor, cuts, BLOCK, 1 << RADIX_BITS)
        # f falls below p after the cuts that still hold >= p: keep the part after them.
        lo += tl.sum((mass >= p).to(tl.int64), 0) * width
    tl.store(thresholds_ptr + row, _smallest_above(base, 0, vocab, lo, BLOCK))


# --- the same search with a row's work spread over many programs ----------------------------
#
# One program per row walks its row 32 / RADIX_BITS times: ~1 ms for a single unresolved row
# of 151,936 logits on an H200 (2026-11-27), whatever the other rows do. With ``chunks`` the
# row is cut into that many pieces, a program each, and the search runs one launch a pass:
# each program first reduces the previous pass's per-piece masses (the pieces in order: every
# program of the row gets the same sums, deterministic) to the interval this pass cuts, then
# sums its piece's mass above this pass's cuts. A last launch finds each piece's smallest
# kept logit, and a tiny one the row's. 32 / RADIX_BITS + 2 launches, each short.
# A piece's [BLOCK, 2^RADIX_BITS] mass tile stays at 4k elements with 4 warps (32 registers
# a thread; at 16k the sm_90 compile spilled).
_CHUNK_BLOCK_BY_RADIX = {1: 2048, 2: 1024, 4: 256}


@triton.jit
def _chunk_interval(part_ptr, lo_ptr, row, num_chunks, p, width,
                    CHUNKS_PAD: tl.constexpr, PARTS: tl.constexpr):
    """The interval's low end after the pass whose per-piece masses are at ``part_ptr``
    (cut width ``width``), from its own low end at ``lo_ptr``."""
    offs_c = tl.arange(0, CHUNKS_PAD)
    parts = tl.arange(0, PARTS)
    masses = tl.load(part_ptr + (row * num_chunks + offs_c)[:, None] * PARTS + parts[None, :],
                     mask=(offs_c < num_chunks)[:, None], other=0.0)
    total = tl.sum(masses, 0)
    return tl.load(lo_ptr + row) + tl.sum((total >= p).to(tl.int64), 0) * width


@triton.jit
def _top_p_pass_kernel(
    logits_ptr, lse_ptr, top_p_ptr, unresolved_ptr, part_prev_ptr, part_next_ptr,
    lo_prev_ptr, lo_next_ptr, vocab, stride_row, chunk_size, num_chunks, exp_floor, pass_index,
    BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr, CHUNKS_PAD: tl.constexpr,
):
    """Program (row, piece) of pass ``pass_index``: this pass's interval, then the piece's
    mass above each of its cuts."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    if tl.load(unresolved_ptr + row) == 0:
        return
    p = tl.load(top_p_ptr + row)
    width = tl.full([], 1 << 32, tl.int64) >> (RADIX_BITS * pass_index)  # the last pass's
    if pass_index == 0:
        lo = tl.full([], -1, tl.int64)
    else:
        lo = _chunk_interval(part_prev_ptr, lo_prev_ptr, row, num_chunks, p, width,
                             CHUNKS_PAD, 1 << RADIX_BITS)
    if chunk == 0:
        tl.store(lo_next_ptr + row, lo)
    width = width >> RADIX_BITS
    parts = tl.arange(0, 1 << RADIX_BITS)
    cuts = lo + (parts + 1).to(tl.int64) * width
    base = logits_ptr + row.to(tl.int64) * stride_row
    begin = chunk * chunk_size
    end = tl.minimum(begin + chunk_size, vocab)
    tl.store(part_next_ptr + (row * num_chunks + chunk) * (1 << RADIX_BITS) + parts,
             _mass_above(base, begin, end, tl.load(lse_ptr + row), exp_floor, cuts, BLOCK,
                         1 << RADIX_BITS))


@triton.jit
def _top_p_piece_min_kernel(
    logits_ptr, top_p_ptr, unresolved_ptr, part_ptr, lo_ptr, mins_ptr,
    vocab, stride_row, chunk_size, num_chunks, last_width,
    BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr, CHUNKS_PAD: tl.constexpr,
):
    """Program (row, piece): the search's end (the last pass's interval, narrowed), then the
    piece's smallest logit whose key is above it."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    if tl.load(unresolved_ptr + row) == 0:
        return
    p = tl.load(top_p_ptr + row)
    lo = _chunk_interval(part_ptr, lo_ptr, row, num_chunks, p, last_width, CHUNKS_PAD,
                         1 << RADIX_BITS)
    base = logits_ptr + row.to(tl.int64) * stride_row
    begin = chunk * chunk_size
    end = tl.minimum(begin + chunk_size, vocab)
    tl.store(mins_ptr + row * num_chunks + chunk, _smallest_above(base, begin, end, lo, BLOCK))


@triton.jit
def _top_p_row_min_kernel(unresolved_ptr, mins_ptr, thresholds_ptr, num_chunks,
                          CHUNKS_PAD: tl.constexpr):
    row = tl.program_id(0)
    if tl.load(unresolved_ptr + row) == 0:
        return
    offs = tl.arange(0, CHUNKS_PAD)
    mins = tl.load(mins_ptr + row * num_chunks + offs, mask=offs < num_chunks,
                   other=float("inf"))
    tl.store(thresholds_ptr + row, tl.min(mins, 0))


def _top_p_chunked(logits, lse, top_p, thresholds, unresolved, exp_floor, radix_bits,
                   chunks) -> None:
    num_rows, vocab = logits.shape
    device = logits.device
    chunk_size = cdiv(vocab, chunks)
    num_chunks = cdiv(vocab, chunk_size)
    parts = 1 << radix_bits
    block = min(_CHUNK_BLOCK_BY_RADIX[radix_bits], next_power_of_2(chunk_size))
    chunks_pad = max(2, next_power_of_2(num_chunks))
    masses = torch.empty(2, num_rows * num_chunks * parts, dtype=torch.float32, device=device)
    los = torch.empty(2, num_rows, dtype=torch.int64, device=device)
    flags = unresolved.to(torch.uint8)
    warps = 1 if INTERPRETING else 4
    passes = 32 // radix_bits
    for j in range(passes):
        _top_p_pass_kernel[(num_rows, num_chunks)](
            logits, lse, top_p, flags, masses[(j + 1) % 2], masses[j % 2],
            los[(j + 1) % 2], los[j % 2], vocab, logits.stride(0), chunk_size, num_chunks,
            float(exp_floor), j, BLOCK=block, RADIX_BITS=radix_bits, CHUNKS_PAD=chunks_pad,
            num_warps=warps)
    mins = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=device)
    last = (passes - 1) % 2
    _top_p_piece_min_kernel[(num_rows, num_chunks)](
        logits, top_p, flags, masses[last], los[last], mins, vocab, logits.stride(0),
        chunk_size, num_chunks, 1 << (32 - radix_bits * passes),
        BLOCK=block, RADIX_BITS=radix_bits, CHUNKS_PAD=chunks_pad, num_warps=warps)
    _top_p_row_min_kernel[(num_rows,)](flags, mins, thresholds, num_chunks,
                                       CHUNKS_PAD=chunks_pad, num_warps=1)


def top_p_thresholds_triton(
    logits: torch.Tensor,  # [R, V] float32
    lse: torch.Tensor,  # [R, 1] float32: logsumexp of each row
    top_p: torch.Tensor,  # [R] float32
    thresholds: torch.Tensor,  # [R, 1] float32, written for the unresolved rows
    unresolved: torch.Tensor,  # [R] bool
    exp_floor: float,
    *,
    radix_bits: int = RADIX_BITS,
    chunks: int | None = None,
) -> None:
    """Launch one program per row (see the module docstring); nothing is read back.
    ``radix_bits`` (1, 2 or 4) overrides the search's radix (kernels_bench sweeps it);
    ``chunks`` > 1 (None: ``TOP_P_CHUNKS``) spreads each row over that many programs, one
    launch a pass (above)."""
    if radix_bits not in _BLOCK_BY_RADIX:
        raise ValueError(f"radix_bits must be one of {sorted(_BLOCK_BY_RADIX)}")
    num_rows, vocab = logits.shape
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError("logits must be float32 with a contiguous last axis")
    for name, t in (("lse", lse), ("thresholds", thresholds)):
        if t.dtype != torch.float32 or t.numel() != num_rows or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32 with one value per row")
    if top_p.shape != (num_rows,) or unresolved.shape != (num_rows,):
        raise ValueError(f"top_p and unresolved must be [{num_rows}]")
    if num_rows == 0:
        return
    chunks = TOP_P_CHUNKS if chunks is None else chunks
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    if chunks > 1:
        _top_p_chunked(logits, lse, top_p.to(torch.float32), thresholds, unresolved,
                       exp_floor, radix_bits, chunks)
        return
    interpreting = INTERPRETING
    block = min(_BLOCK_BY_RADIX[radix_bits], next_power_of_2(vocab))
    _top_p_threshold_kernel[(num_rows,)](
        logits, lse, top_p.to(torch.float32), thresholds, unresolved.to(torch.uint8),
        vocab, logits.stride(0), float(exp_floor),
        BLOCK=block, RADIX_BITS=radix_bits, num_warps=1 if interpreting else 8,
    )


# --- greedy: the argmax of each row ------------------------------------------------------------
#
# torch's argmax over [256, 151,936] bf16 logits ran at ~1.2 TB/s on an H200 (63 us a step,
# benchmarks/README "GPU check"): one program walks a row. Here a row is cut into
# ARGMAX_CHUNK-element chunks, one program each (~5k programs at 256 rows), each writing its
# chunk's largest value (widened to fp32: exact) and that value's first index; a second
# launch takes, per row, the first chunk holding the row's largest value. So ties go to the
# first index, as torch's argmax does. (NaN logits: undefined here; torch picks the first
# NaN.)
ARGMAX_CHUNK = 8192
_ARGMAX_MAX_CHUNKS = 64  # rows up to 524,288 entries: the second launch reads them at once


@triton.jit
def _argmax_chunks_kernel(logits_ptr, part_val_ptr, part_idx_ptr, vocab, stride_row,
                          num_chunks, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    idx = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + idx, mask=idx < vocab,
                other=float("-inf")).to(tl.float32)
    best, at = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(part_val_ptr + row * num_chunks + chunk, best)
    tl.store(part_idx_ptr + row * num_chunks + chunk, chunk * CHUNK + at)


@triton.jit
def _argmax_rows_kernel(part_val_ptr, part_idx_ptr, out_ptr, num_chunks,
                        CHUNKS_PAD: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, CHUNKS_PAD)
    valid = offs < num_chunks
    vals = tl.load(part_val_ptr + row * num_chunks + offs, mask=valid, other=float("-inf"))
    _, first = tl.max(vals, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(part_idx_ptr + row * num_chunks + first).to(tl.int64))


def argmax_rows_triton(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [R]: the first index of each row's largest logit (fp32/fp16/bf16 [R, V], last
    axis contiguous; into ``out``, int64 [R] contiguous, when given). Two launches,
    nothing read back."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError("logits must be [R, V] with a contiguous last axis")
    if logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"unsupported logits dtype {logits.dtype}")
    num_rows, vocab = logits.shape
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    elif out.shape != (num_rows,) or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(f"out must be int64 [{num_rows}] contiguous")
    chunk = min(ARGMAX_CHUNK, next_power_of_2(max(vocab, 16)))
    num_chunks = cdiv(vocab, chunk)
    if num_chunks > _ARGMAX_MAX_CHUNKS:
        raise ValueError(f"rows of {vocab} entries: at most {_ARGMAX_MAX_CHUNKS * chunk}")
    if num_rows == 0 or vocab == 0:
        return out.zero_()
    part_val = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=logits.device)
    _argmax_chunks_kernel[(num_rows, num_chunks)](
        logits, part_val, part_idx, vocab, logits.stride(0), num_chunks, CHUNK=chunk,
        num_warps=8)
    _argmax_rows_kernel[(num_rows,)](
        part_val, part_idx, out, num_chunks,
        CHUNKS_PAD=max(2, next_power_of_2(num_chunks)), num_warps=1)
    return out
