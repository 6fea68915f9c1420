"""The KV cache's element types (``--kv-cache-dtype``): the model's own, or 8-bit floats.

An fp8 cache holds each key and value in one byte, half a 16-bit model's (a quarter of a
float32 one's): twice the blocks in the same memory, and half the bytes a decode step's
attention reads. Values are stored unscaled (a scale of 1, vLLM's default when a checkpoint
carries no KV scales) and saturate at the format's largest finite value (448 for e4m3, 57,344
for e5m2), as vLLM's and SGLang's cache writes do (``satfinite``): the kernels and the twins
clamp before the cast, so both store the same byte. e4m3 keeps 3 mantissa bits (relative
error up to 1/16), e5m2 2 bits with a wider range. Every reader widens the bytes to the
query's dtype (the kernels) or float32 (the twins) before the dot products; nothing else in
the attention changes.

``to_cache`` (Triton) and ``to_cache_dtype`` (torch) are the one place a value becomes a
cache element: every cache write goes through one of them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.flags import KV_CACHE_DTYPE_CHOICES

_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
        "fp8_e5m2": torch.float8_e5m2}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype for a ``--kv-cache-dtype`` value. Raises ValueError (one line)
    for an unknown name."""
    if name == "auto":
        return model_dtype
    if name not in _FP8:
        raise ValueError(f"--kv-cache-dtype {name!r}: expected one of "
                         f"{', '.join(KV_CACHE_DTYPE_CHOICES)}")
    return _FP8[name]


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The dtype as the flag and the logs name it: fp8_e4m3, fp8_e5m2, bfloat16, ..."""
    return {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}.get(
        dtype, str(dtype).removeprefix("torch."))


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype and elements bit for bit (fp8 tensors compared as their bytes)."""
    if a.dtype != b.dtype:
        return False
    if a.element_size() == 1:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as cache elements of ``dtype``: an fp8 cache saturates (see the module
    docstring); any other is a plain cast. The twins' form of ``to_cache``."""
    if is_fp8(dtype):
        limit = torch.finfo(dtype).max
        return x.float().clamp(-limit, limit).to(dtype)
    return x.to(dtype)


def widen_e4m3_(t: torch.Tensor, out: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """e4m3 ``t`` (a CPU tensor, its last axis even and contiguous) as float32 into ``out``
    (contiguous, t's shape), two bytes a lookup through a table of every byte pair's two
    floats (65,536 x 8 bytes; ``index``: int32 scratch of t.numel() / 2). torch's own e4m3
    conversion on a CPU took 5.8 ms for a batch-32 layer's keys (1.6 M values, the 2-core
    VM), a 256-entry table 1.24, the pair table 0.96, against 0.90 for e5m2's own (the top
    byte of a float16)."""
    pairs = t.view(torch.int16)  # (the head dim is even: the strides divide by 2)
    index.view(pairs.shape).copy_(pairs)
    index.bitwise_and_(0xFFFF)  # the pair's bytes as an unsigned code
    torch.index_select(_E4M3_PAIRS, 0, index, out=out.view(-1).view(torch.int64))
    return out


def _e4m3_pairs() -> torch.Tensor:
    """[65,536] int64: entry c holds the two float32 values of the byte pair whose int16
    view is c (in memory order; the 0x7f and 0xff bytes are NaN, which a cache never holds:
    writes saturate)."""
    codes = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    values = codes.view(torch.uint8).view(torch.float8_e4m3fn).float()
    return values.view(65536, 2).contiguous().view(torch.int64).view(65536)


_E4M3_PAIRS = _e4m3_pairs()


@triton.jit
def _fp8_grid(x, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    """float32 ``x`` rounded to the nearest value with ``MANT`` mantissa bits and exponent
    >= ``MIN_EXP`` (below it, the subnormals' fixed step), ties to even: the fp8 value the
    cast will then store exactly. Done by hand because Triton's interpreter rounds a float32
    that carries into the next exponent down (1.96 to 1.0 in e4m3); compiled, it is the
    hardware's ``cvt.rn`` to the bit. The step 2^(e - MANT) comes from the exponent bits;
    x / step is below 2^(MANT + 1) in magnitude, and adding and taking away 1.5 * 2^23 rounds
    it to an integer, ties to even (float32 addition's own rounding); the sign is put back
    by its bit."""
    bits = x.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, MIN_EXP) - MANT
    step = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    y = (tl.abs(x) * inv + 12582912.0) - 12582912.0
    # the magnitude rounded, with x's sign bit (a tiny negative value stays -0.0)
    return ((y * step).to(tl.int32, bitcast=True) | (bits & -2147483648)).to(
        tl.float32, bitcast=True)


@triton.jit
def to_cache(x, cache_ptr):
    """``x`` as elements of the cache at ``cache_ptr``: an fp8 cache saturates at its
    largest finite value and rounds to nearest, ties to even: the same byte as
    ``to_cache_dtype``."""
    dt: tl.constexpr = cache_ptr.dtype.element_ty
    if dt == tl.float8e4nv:
        x = _fp8_grid(tl.clamp(x.to(tl.float32), -448.0, 448.0), 3, -6)
    elif dt == tl.float8e5:
        x = _fp8_grid(tl.clamp(x.to(tl.float32), -57344.0, 57344.0), 2, -14)
    return x.to(dt)
