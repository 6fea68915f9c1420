"""The sampler's keyed inverse-CDF draw on the device: Triton kernels and launcher.

Twin: ``reference.keyed_draw_`` (probabilities exp(x - max) written over the row, zeroed
below exp(-86.5) and below min_p of the best, their cumulative sum written over them, and a
search of it). Over [256, 151,936] fp32 rows the twin runs ~8 elementwise kernels, each
reading and writing the whole [R, V] buffer (~155 MB a pass at 256 rows), plus a scan and
two searches. Here each row is cut into CHUNK-element chunks, a program each, and three
launches read it twice and one chunk of it a third time, writing only per-chunk figures and
the tokens. A row's values are x's float32 rows, or (``temperature=``) the model's logits
of any float dtype, row r being x[rows[r]], divided by temperature[r] as they are read
(IEEE division, as torch's): no tempered copy is written at all.

1. ``_chunk_max_kernel``: each chunk's largest logit;
2. ``_chunk_mass_kernel``: the row's max m (from the chunks' maxima); each chunk's mass,
   the sum of p = exp(max(x - m, EXP_FLOOR)), with p zeroed where it is <= exp(EXP_FLOOR +
   0.5) or below ``min_p`` (the best token's p is exactly 1), as the twin makes them;
3. ``_chunk_pick_kernel``: the chunks' inclusive cumulative masses (one scan, in chunk
   order, that every program of a row computes alike: the same values), the total, and the
   target = u * total (in float64, rounded to float32 as the twin rounds it; the scan's
   prefixes kept non-decreasing by a running maximum: natively a tree of additions, whose
   rounding left a row with no chunk holding the target on an H100). The one chunk
   whose interval [cum before it, cum through it) holds the target recomputes its p, scans
   them from the cum before it, and writes the first token whose cumulative mass exceeds the
   target. When the target is not below the total (u * total rounded up to it: the twin's
   "over" case), the last chunk that added mass takes the row's last token with mass; and
   when rounding between the chunk's own scan and its mass leaves the target past the
   chunk's end, the chunk's last token with mass. So the token always has p > 0, and it is
   the twin's except where the two sums' different orders round a token's edge across the
   target (probability ~1e-7 a draw). Deterministic: the same inputs give the same token.
   A row with no mass at all (every logit -inf) gets token 0, as the twin does.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .host_math import INTERPRETING, cdiv, next_power_of_2
from .reference import EXP_FLOOR

# Elements of a row a program reads: 19 chunks a row of Qwen2.5's 151,936 tokens, ~4.9k
# programs at 256 rows; its [CHUNK] scan in the pick kernel stays in registers (8 warps).
CHUNK = 8192
_MAX_CHUNKS = 256  # rows up to 2M entries: the chunk figures of a row are read at once


@triton.jit
def _values(x_ptr, rows_ptr, temp_ptr, floor_ptr, row, idx, vocab, stride_row,
            HAS_ROWS: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_FLOOR: tl.constexpr):
    """Row ``row``'s values at ``idx`` (-inf past the vocabulary), in float32: x[rows[row]]
    (HAS_ROWS) or x[row], divided by temperature[row] (HAS_TEMP; IEEE-rounded, as torch's
    division), -inf below floor[row] (HAS_FLOOR: a top-p threshold)."""
    if HAS_ROWS:
        src = tl.load(rows_ptr + row).to(tl.int64)
    else:
        src = row.to(tl.int64)
    x = tl.load(x_ptr + src * stride_row + idx, mask=idx < vocab,
                other=float("-inf")).to(tl.float32)
    if HAS_TEMP:
        x = tl.div_rn(x, tl.load(temp_ptr + row))
    if HAS_FLOOR:
        x = tl.where(x < tl.load(floor_ptr + row), float("-inf"), x)
    return x


@triton.jit
def _chunk_max_kernel(x_ptr, rows_ptr, temp_ptr, floor_ptr, max_ptr, vocab, stride_row,
                      num_chunks, CHUNK: tl.constexpr, HAS_ROWS: tl.constexpr,
                      HAS_TEMP: tl.constexpr, HAS_FLOOR: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    idx = chunk * CHUNK + tl.arange(0, CHUNK)
    x = _values(x_ptr, rows_ptr, temp_ptr, floor_ptr, row, idx, vocab, stride_row, HAS_ROWS,
                HAS_TEMP, HAS_FLOOR)
    tl.store(max_ptr + row * num_chunks + chunk, tl.max(x, 0))


@triton.jit
def _probs(x_ptr, rows_ptr, temp_ptr, floor_ptr, max_ptr, min_p_ptr, row, chunk, vocab,
           stride_row, num_chunks, exp_floor, zero_below, CHUNK: tl.constexpr,
           CHUNKS_PAD: tl.constexpr, HAS_MIN_P: tl.constexpr, HAS_ROWS: tl.constexpr,
           HAS_TEMP: tl.constexpr, HAS_FLOOR: tl.constexpr):
    """(this chunk's p [CHUNK], their indices): the twin's probabilities of the chunk."""
    offs_c = tl.arange(0, CHUNKS_PAD)
    m = tl.max(tl.load(max_ptr + row * num_chunks + offs_c, mask=offs_c < num_chunks,
                       other=float("-inf")), 0)
    idx = chunk * CHUNK + tl.arange(0, CHUNK)
    x = _values(x_ptr, rows_ptr, temp_ptr, floor_ptr, row, idx, vocab, stride_row, HAS_ROWS,
                HAS_TEMP, HAS_FLOOR)
    p = tl.exp(tl.maximum(x - m, exp_floor))
    p = tl.where(p > zero_below, p, 0.0)
    if HAS_MIN_P:
        p = tl.where(p < tl.load(min_p_ptr + row), 0.0, p)
    return p, idx


@triton.jit
def _chunk_mass_kernel(x_ptr, rows_ptr, temp_ptr, floor_ptr, max_ptr, min_p_ptr, mass_ptr,
                       vocab, stride_row, num_chunks, exp_floor, zero_below,
                       CHUNK: tl.constexpr, CHUNKS_PAD: tl.constexpr, HAS_MIN_P: tl.constexpr,
                       HAS_ROWS: tl.constexpr, HAS_TEMP: tl.constexpr,
                       HAS_FLOOR: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    p, _ = _probs(x_ptr, rows_ptr, temp_ptr, floor_ptr, max_ptr, min_p_ptr, row, chunk, vocab,
                  stride_row, num_chunks, exp_floor, zero_below, CHUNK, CHUNKS_PAD,
                  HAS_MIN_P, HAS_ROWS, HAS_TEMP, HAS_FLOOR)
    tl.store(mass_ptr + row * num_chunks + chunk, tl.sum(p, 0))


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _chunk_pick_kernel(x_ptr, rows_ptr, temp_ptr, floor_ptr, max_ptr, min_p_ptr, mass_ptr,
                       u_ptr, out_ptr, vocab, stride_row, num_chunks, exp_floor, zero_below,
                       CHUNK: tl.constexpr, CHUNKS_PAD: tl.constexpr,
                       HAS_MIN_P: tl.constexpr, HAS_ROWS: tl.constexpr,
                       HAS_TEMP: tl.constexpr, HAS_FLOOR: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs_c = tl.arange(0, CHUNKS_PAD)
    mass = tl.load(mass_ptr + row * num_chunks + offs_c, mask=offs_c < num_chunks, other=0.0)
    # Inclusive cumulative masses in chunk order, then their running maximum: a compiled
    # scan adds in a tree, so one prefix may round below the one before it (and a padding
    # lane's sum above the last chunk's); the running maximum makes the chunks' intervals
    # disjoint and contiguous, and the total is the last real chunk's (the pads are not
    # the row's). Every program of the row computes the same vector.
    cum = tl.associative_scan(tl.associative_scan(mass, 0, _add), 0, _max)
    # one element picked out of a vector of zeros: exact
    total = tl.sum(tl.where(offs_c == num_chunks - 1, cum, 0.0), 0)
    cum_before = tl.sum(tl.where(offs_c == chunk - 1, cum, 0.0), 0)
    cum_through = tl.sum(tl.where(offs_c == chunk, cum, 0.0), 0)
    target = (tl.load(u_ptr + row) * total.to(tl.float64)).to(tl.float32)
    holds = (cum_before <= target) & (target < cum_through)
    # u * total rounded up to the total: the last chunk that added mass
    over = (target >= total) & (cum_before < cum_through) & (cum_through == total)
    if holds | over:
        p, idx = _probs(x_ptr, rows_ptr, temp_ptr, floor_ptr, max_ptr, min_p_ptr, row, chunk,
                        vocab, stride_row, num_chunks, exp_floor, zero_below, CHUNK,
                        CHUNKS_PAD, HAS_MIN_P, HAS_ROWS, HAS_TEMP, HAS_FLOOR)
        walked = cum_before + tl.associative_scan(p, 0, _add)
        # (p > 0: the chunk's scan is a tree too, so a token without mass could round
        # across the target)
        first = tl.min(tl.where((walked > target) & (p > 0.0), idx, 2147483647), 0)
        last = tl.max(tl.where(p > 0.0, idx, -1), 0)
        token = tl.where(first < 2147483647, first, last)
        if over:
            token = last
        tl.store(out_ptr + row, token.to(tl.int64))
    if (total <= 0.0) & (chunk == 0):  # no token has mass (every logit -inf): token 0,
        tl.store(out_ptr + row, tl.zeros([], tl.int64))  # as the twin's search gives


def keyed_draw_triton(x: torch.Tensor, min_p: torch.Tensor | None, u: torch.Tensor,
                      *, temperature: torch.Tensor | None = None,
                      rows: torch.Tensor | None = None, floor: torch.Tensor | None = None,
                      chunk: int = CHUNK) -> torch.Tensor:
    """int64 [R]: see the module docstring (``x`` is read, not written). With
    ``temperature`` [R] (float32), row r is x[rows[r]] (``rows`` int64 [R]; None: x[r]) in
    float32 divided by temperature[r], x of any float dtype — the logits as the model left
    them, no tempered copy made; without, x is the float32 rows themselves. ``floor`` [R]
    (float32): values below it are excluded, as a top-p threshold's fill would (-inf: none).
    ``chunk`` (a
    power of two) overrides the elements a program reads (tests cut small rows into several
    chunks with it)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError("x must be [N, V] with a contiguous last axis")
    if temperature is None and (x.dtype != torch.float32 or rows is not None):
        raise ValueError("x must be float32 [R, V] (rows= only with temperature=)")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be a float tensor, got {x.dtype}")
    if rows is not None and rows.dim() != 1:
        raise ValueError("rows must be int64 [R]")
    num_rows, vocab = (x.shape[0] if rows is None else rows.shape[0]), x.shape[1]
    if u.shape != (num_rows,) or u.dtype != torch.float64:
        raise ValueError(f"u must be float64 [{num_rows}]")
    for name, t, dtype in (("min_p", min_p, torch.float32),
                           ("temperature", temperature, torch.float32),
                           ("rows", rows, torch.int64), ("floor", floor, torch.float32)):
        if t is not None and (t.shape != (num_rows,) or t.dtype != dtype):
            raise ValueError(f"{name} must be {str(dtype).removeprefix('torch.')} "
                             f"[{num_rows}]")
    if chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two, got {chunk}")
    out = torch.empty(num_rows, dtype=torch.int64, device=x.device)
    if num_rows == 0:
        return out
    chunk = min(chunk, next_power_of_2(max(vocab, 16)))
    num_chunks = cdiv(vocab, chunk)
    if num_chunks > _MAX_CHUNKS:
        raise ValueError(f"rows of {vocab} entries: at most {_MAX_CHUNKS * chunk}")
    chunks_pad = max(2, next_power_of_2(num_chunks))
    maxima = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=x.device)
    masses = torch.empty_like(maxima)
    flags = dict(HAS_ROWS=rows is not None, HAS_TEMP=temperature is not None,
                 HAS_FLOOR=floor is not None)
    has_min_p = min_p is not None
    # (unused pointers stand in for the absent ones)
    min_p, rows, temperature, floor = (u if t is None else t
                                       for t in (min_p, rows, temperature, floor))
    exp_floor, zero_below = float(EXP_FLOOR), math.exp(EXP_FLOOR + 0.5)
    warps = 1 if INTERPRETING else 8
    grid = (num_rows, num_chunks)
    _chunk_max_kernel[grid](x, rows, temperature, floor, maxima, vocab, x.stride(0),
                            num_chunks, CHUNK=chunk, **flags, num_warps=warps)
    _chunk_mass_kernel[grid](x, rows, temperature, floor, maxima, min_p, masses, vocab,
                             x.stride(0), num_chunks, exp_floor, zero_below, CHUNK=chunk,
                             CHUNKS_PAD=chunks_pad, HAS_MIN_P=has_min_p, **flags,
                             num_warps=warps)
    # (16 warps: the chunk's scan holds a few [CHUNK] vectors; at 8 the sm_90 build of the
    # temperature form spilled)
    _chunk_pick_kernel[grid](x, rows, temperature, floor, maxima, min_p, masses, u, out,
                             vocab, x.stride(0), num_chunks, exp_floor, zero_below, CHUNK=chunk,
                             CHUNKS_PAD=chunks_pad, HAS_MIN_P=has_min_p, **flags,
                             num_warps=1 if INTERPRETING else 16)
    return out
