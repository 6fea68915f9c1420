"""Fused per-layer elementwise kernels (Triton): RMSNorm with the residual add, rotary
embedding of q and k in place (alone, or with the rotated k and v written into the KV cache
in the same launch), SiLU-and-multiply. Twins: ``reference.rms_norm``,
``reference.rotary_embedding`` (then ``reference.reshape_and_cache``),
``reference.silu_and_mul``.

Why: a decode step at batch 256 of a small model is a string of tiny kernels. The torch
forms launch about 37 kernels a layer (each RMSNorm 8: upcast, square, mean, add eps, rsqrt,
scale, downcast, weight; rotary 5 per tensor; SiLU and multiply 2; 2 residual adds), each a
few microseconds even replayed from a CUDA graph: on an H100 the Qwen2.5-0.5B-shape step took
5.1 ms where attention was 1.3 ms and the weights 0.35 ms of reads (benchmarks/README, GPU
check). These cut a layer to about 10 launches; vLLM's fused_add_rms_norm, rotary_embedding
and silu_and_mul CUDA ops are the model (the code is our own).

Rounding follows the twins step for step: every intermediate the torch form rounds to the
model's dtype is rounded here too (cast down and back up), so bf16 outputs differ from the
twin only where the reduction order of the mean differs.

Hot path: no host synchronisation; outputs are allocated once per call (the residual and
the rotated q/k are written in place).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cache_ops import check_cache_write
from .host_math import cdiv, next_power_of_2
from .kv_dtypes import to_cache


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    stride_xt, stride_xh, stride_rt, stride_ot, stride_oh,
    heads, n, eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program = one row (token t, head h) of n elements. With a residual: h = x + residual,
    rounded to x's dtype, written back into the residual, then normalised."""
    row = tl.program_id(0)
    t = row // heads
    h = row % heads
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + t * stride_rt + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + t * stride_rt + offs, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / n
    normed = (xf * (1.0 / tl.sqrt(variance + eps))).to(x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs, out.to(out_ptr.dtype.element_ty),
             mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last axis of x ([T, N], or [T, H, N] with any strides whose last is 1:
    a per-head norm of a fused projection's view). With ``residual`` ([T, N], contiguous, x's
    dtype): x + residual is normalised and also returned, written into ``residual``."""
    if x.stride(-1) != 1 or x.dim() not in (2, 3):
        raise ValueError(f"x must be [T, N] or [T, H, N] with a contiguous last axis, got "
                         f"shape {tuple(x.shape)} strides {x.stride()}")
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight must be [{n}], got {tuple(weight.shape)}")
    heads = x.shape[1] if x.dim() == 3 else 1
    tokens = x.shape[0]
    if residual is not None and (x.dim() != 2 or residual.shape != x.shape
                                 or residual.stride(-1) != 1 or residual.dtype != x.dtype):
        raise ValueError("residual must be [T, N] like x, same dtype, contiguous last axis")
    out = torch.empty(x.shape, dtype=torch.result_type(weight, x), device=x.device)
    if x.numel() == 0:
        return (out, residual) if residual is not None else out
    stride_xh = x.stride(1) if x.dim() == 3 else 0
    stride_oh = out.stride(1) if x.dim() == 3 else 0
    r = residual if residual is not None else x
    _rms_norm_kernel[(tokens * heads,)](
        x, r, weight, out,
        x.stride(0), stride_xh, r.stride(0), out.stride(0), stride_oh,
        heads, n, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=next_power_of_2(n),
        num_warps=4 if n <= 2048 else 8,
    )
    return (out, residual) if residual is not None else out


@triton.jit
def rotated(x, partner, cos, sin):
    """One rotary-embedded value: x * cos + partner * sin (``partner``: float32, the other
    half's value, negated for the first half), each product and the sum rounded to x's
    dtype as the twin rounds them; also the decode kernel's own rotation
    (decode_attention.py, ``ROPE``).

    Each product is an fma with a +0.0 addend: the same value (a product of two 16-bit
    values is exact in float32; only a -0.0 product comes out +0.0, equal to it), but no
    fmul for LLVM to narrow to bfloat16 and then contract with the sum into one fma.rn.bf16
    (a single rounding where the twin makes two; compiled for sm_90 a plain ``x * cos``
    became exactly that, differently in different kernels)."""
    dt = x.dtype
    return (tl.fma(x.to(tl.float32), cos, 0.0).to(dt).to(tl.float32)
            + tl.fma(partner, sin, 0.0).to(dt).to(tl.float32)).to(dt)


@triton.jit
def _rotate_heads(ptr, stride_t, stride_h, t, heads, c1, c2, s1, s2,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rotate one token's heads in place; returns the two rotated halves (for a copy into
    the KV cache)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < heads)[:, None] & (offs_d < HALF)[None, :]
    base = ptr + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    # The twin: x * cos + cat(-x2, x1) * sin, each product and the sum rounded to dt.
    o1 = rotated(x1, -x2.to(tl.float32), c1, s1)
    o2 = rotated(x2, x1.to(tl.float32), c2, s2)
    tl.store(base, o1, mask=mask)
    tl.store(base + HALF, o2, mask=mask)
    return o1, o2


@triton.jit
def _cos_sin(cos_sin_ptr, t, stride_ct, stride_cc, HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    """Token t's cos and sin halves, float32, as [1, BLOCK_D] rows."""
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HALF
    cos = cos_sin_ptr + t * stride_ct
    sin = cos + stride_cc
    c1 = tl.load(cos + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos + HALF + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin + HALF + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    return c1, c2, s1, s2


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_cc,
    num_q_heads, num_k_heads,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program = one token: every q head and k head rotated in place (neox style)."""
    t = tl.program_id(0)
    c1, c2, s1, s2 = _cos_sin(cos_sin_ptr, t, stride_ct, stride_cc, HALF, BLOCK_D)
    _rotate_heads(q_ptr, stride_qt, stride_qh, t, num_q_heads, c1, c2, s1, s2,
                  HALF, BLOCK_HQ, BLOCK_D)
    _rotate_heads(k_ptr, stride_kt, stride_kh, t, num_k_heads, c1, c2, s1, s2,
                  HALF, BLOCK_HK, BLOCK_D)


@triton.jit
def _rotary_cache_kernel(
    q_ptr, k_ptr, v_ptr, cos_sin_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_cc,
    stride_ks, stride_kch, stride_vs, stride_vch,
    num_q_heads, num_k_heads,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Program = one token: q and k rotated in place as `_rotary_kernel` does, the rotated
    k and the value written into the KV cache at the token's slot (none for slot -1, a
    padding row), as `reshape_and_cache` would after it."""
    t = tl.program_id(0)
    c1, c2, s1, s2 = _cos_sin(cos_sin_ptr, t, stride_ct, stride_cc, HALF, BLOCK_D)
    _rotate_heads(q_ptr, stride_qt, stride_qh, t, num_q_heads, c1, c2, s1, s2,
                  HALF, BLOCK_HQ, BLOCK_D)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HALF
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # A padding row (slot -1) writes no head: the masks below see 0 heads.
    cached_heads = tl.where(slot >= 0, num_k_heads, 0)
    slot = tl.maximum(slot, 0)
    k1, k2 = _rotate_heads(k_ptr, stride_kt, stride_kh, t, num_k_heads, c1, c2, s1, s2,
                           HALF, BLOCK_HK, BLOCK_D)
    offs_h = tl.arange(0, BLOCK_HK)
    kmask = (offs_h < cached_heads)[:, None] & dmask[None, :]
    kdst = key_cache_ptr + slot * stride_ks + offs_h[:, None] * stride_kch + offs_d[None, :]
    tl.store(kdst, to_cache(k1, key_cache_ptr), mask=kmask)
    tl.store(kdst + HALF, to_cache(k2, key_cache_ptr), mask=kmask)
    offs_v = tl.arange(0, BLOCK_DV)
    vmask = (offs_h < cached_heads)[:, None] & (offs_v < HEAD_DIM)[None, :]
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_v[None, :],
                mask=vmask, other=0.0)
    tl.store(value_cache_ptr + slot * stride_vs + offs_h[:, None] * stride_vch
             + offs_v[None, :], to_cache(v, value_cache_ptr), mask=vmask)


def rotary_embedding_and_cache_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor,
    key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_embedding_triton` and then `reshape_and_cache` of the rotated k and of v, in
    one launch: q and k rotated in place (returned), k and v written at their slots of the
    caches [num_blocks, block_size, Hkv, D] (slot -1: not written)."""
    _check_rotary(q, k, cos_sin)
    check_cache_write(k, v, key_cache, value_cache, slot_mapping)
    tokens, _, dim = q.shape
    if tokens == 0:
        return q, k
    half = dim // 2
    _rotary_cache_kernel[(tokens,)](
        q, k, v, cos_sin, key_cache, value_cache, slot_mapping,
        *q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *cos_sin.stride()[:2],
        *key_cache.stride()[1:3], *value_cache.stride()[1:3],
        q.shape[1], k.shape[1],
        HALF=half, HEAD_DIM=dim, BLOCK_HQ=next_power_of_2(q.shape[1]),
        BLOCK_HK=next_power_of_2(k.shape[1]), BLOCK_D=next_power_of_2(half),
        BLOCK_DV=next_power_of_2(dim), num_warps=4,
    )
    return q, k


def _check_rotary(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must be [T, H, D] and [T, Hkv, D], got {tuple(q.shape)} "
                         f"and {tuple(k.shape)}")
    tokens, _, dim = q.shape
    if dim % 2 or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("head_dim must be even and the last axes of q and k contiguous")
    if cos_sin.shape != (tokens, 2, dim) or cos_sin.stride(-1) != 1:
        raise ValueError(f"cos_sin must be [{tokens}, 2, {dim}], got {tuple(cos_sin.shape)}")
    if q.dtype != k.dtype or cos_sin.dtype != q.dtype:
        raise TypeError(f"dtype mismatch: q {q.dtype}, k {k.dtype}, cos_sin {cos_sin.dtype}")


def rotary_embedding_triton(
    q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, Hkv, D] (views of a fused projection are fine: the last
    axis contiguous) in place by cos_sin [T, 2, D] (cos then sin, in q's dtype)."""
    _check_rotary(q, k, cos_sin)
    tokens, _, dim = q.shape
    if tokens == 0:
        return q, k
    half = dim // 2
    _rotary_kernel[(tokens,)](
        q, k, cos_sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0),
        cos_sin.stride(1),
        q.shape[1], k.shape[1],
        HALF=half, BLOCK_HQ=next_power_of_2(q.shape[1]),
        BLOCK_HK=next_power_of_2(k.shape[1]), BLOCK_D=next_power_of_2(half),
        num_warps=4,
    )
    return q, k


@triton.jit
def silu_times(gate, up):
    """silu(gate) * up in the inputs' dtype, rounded as the twin rounds it (the SiLU, then
    the product); also the split-K GEMM's operand (linear_ops.py, ``SILU_MUL``)."""
    dt = gate.dtype
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    return (silu * up.to(tl.float32)).to(dt)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_xt, stride_ot, n, BLOCK: tl.constexpr):
    """Program = (token, BLOCK columns): out = silu(x[:, :n]) * x[:, n:]."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(x_ptr + t * stride_xt + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + t * stride_xt + n + offs, mask=mask, other=0.0)
    tl.store(out_ptr + t * stride_ot + offs, silu_times(gate, up), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2n] (gate then up, last axis contiguous) -> silu(gate) * up, [T, n]."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, 2n] with a contiguous last axis, got {tuple(x.shape)}")
    tokens, n = x.shape[0], x.shape[1] // 2
    out = torch.empty((tokens, n), dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    block = min(1024, next_power_of_2(n))
    _silu_and_mul_kernel[(tokens, cdiv(n, block))](
        x, out, x.stride(0), out.stride(0), n, BLOCK=block, num_warps=4)
    return out
