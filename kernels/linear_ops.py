"""A decode step's projections as a Triton GEMM with split-K (out = x @ weight^T + bias):
for A/B against cuBLAS, which torch's ``F.linear`` calls (benchmarks/kernels_gemm.py).

Why: at 256 decode tokens the Qwen2.5-0.5B layer's four projections took 30.6 us on an H200
(2026-11-27 trace) against ~7.5 us of weight reads and ~10 us of its arithmetic at peak: the
narrow ones (o_proj 896 x 896, QKV 1152 x 896) give cuBLAS few output tiles (2 x 7 at
128 x 128), so few SMs work through all of K; the down projection ran split-K with a second
launch for the reduction. Here the K range is cut into ``SPLIT_K`` parts too, and the part
that finishes last sums the others' fp32 partials in split order (deterministic whatever the
arrival order) and writes the output and bias: one launch, as the decode kernel's fused
split-K reduction does (decode_reduce.py).

Twin: ``torch.nn.functional.linear`` (fp32 accumulation; bf16 results differ from cuBLAS's
by the order of the sums). `linear_tuned` picks its launch configuration per (M, N, K) with
Triton's autotuner (the first call of a shape times `TUNED_CONFIGS`: an executor's graph
warm-up does it before capture); the model uses it for its projections with
PAGEDSERVE_DECODE_TRITON_GEMM=1 (executor/models/llama.py), an A/B switch until a GPU says
it beats cuBLAS.

Algorithm of ``_linear_kernel``, program (m tile, n tile, k part): acc = sum over the part's
BLOCK_K slices of x[m tile, k] @ weight[n tile, k]^T in fp32. One part: write acc (+ bias)
in the output dtype. Several: write acc to the fp32 workspace at (part, m, n); count in on
the (m, n) tile's counter (a barrier, then an acq_rel atomic: every thread's partial
stores before the count); the part that brings it to SPLIT_K reads the partials back from
L2 in part order, adds the bias, writes the output, and resets the counter to 0 for the
next launch (so it stays valid in CUDA graphs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
import triton.testing

from .counters import RETIRED, arrival_counters
from .host_math import INTERPRETING, cdiv, next_power_of_2
from .layer_ops import silu_times

# Arrival counters per device (counters.py), one per output tile.
_counters: dict[torch.device, torch.Tensor] = {}
_MIN_COUNTERS = 4096  # output tiles: no growth while CUDA graphs capture


def _tile_counters(device: torch.device, needed: int) -> torch.Tensor:
    return arrival_counters(_counters, device, needed, _MIN_COUNTERS)


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, counters_ptr,
    M, N, K,
    M_KEY,  # the autotuner's key for M: next_power_of_2(M) (unused in the body)
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    UPCAST: tl.constexpr,  # fp32 inputs (or the CPU interpreter): exact fp32 dots
    SILU_MUL: tl.constexpr = False,  # x is [M, 2K] gate | up: the A operand silu(gate) * up
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    part = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    per_part = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_lo = part * per_part
    k_hi = tl.minimum(k_lo + per_part, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    for k in range(k_lo, k_hi, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_hi
        x_mask = mask_m[:, None] & mask_k[None, :]
        if SILU_MUL:  # the SiLU-and-multiply kernel's own arithmetic: the same operand
            x = silu_times(tl.load(x_rows + offs_k[None, :], mask=x_mask, other=0.0),
                           tl.load(x_rows + K + offs_k[None, :], mask=x_mask, other=0.0))
        else:
            x = tl.load(x_rows + offs_k[None, :], mask=x_mask, other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    out_mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tile = (offs_m[:, None] * N + offs_n[None, :]).to(tl.int64)
        size = M * N
        tl.store(part_ptr + part * size + tile, acc, mask=out_mask)
        tl.debug_barrier()
        counter = counters_ptr + pid_m * tl.num_programs(1) + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            tl.store(counter, 0)
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for p in range(SPLIT_K):  # in part order: the same sum whoever arrives last
                total += tl.load(part_ptr + p * size + tile, mask=out_mask, other=0.0,
                                 cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(
                    tl.float32)[None, :]
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           split_k: int, silu_mul: bool = False) -> None:
    width = 2 * weight.shape[1] if weight.dim() == 2 and silu_mul else (
        weight.shape[1] if weight.dim() == 2 else -1)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"x [M, {'2K' if silu_mul else 'K'}] and weight [N, K] expected, got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need a contiguous last axis")
    if weight.dtype != x.dtype or (bias is not None and (bias.shape != (weight.shape[0],)
                                                         or bias.dtype != x.dtype)):
        raise TypeError(f"weight {weight.dtype} and bias must be [N] in x's dtype {x.dtype}")
    if split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")


def _output(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, split_k: int,
            silu_mul: bool) -> tuple[int, int, int, torch.Tensor]:
    """(M, N, K, the output [M, N]) of checked inputs."""
    _check(x, weight, bias, split_k, silu_mul)
    n, k = weight.shape
    return x.shape[0], n, k, torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  *, block_m: int = 64, block_n: int = 64, block_k: int = 64,
                  split_k: int = 1, num_warps: int = 4, num_stages: int = 3,
                  silu_mul: bool = False) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype, one launch; the
    launch configuration is the caller's (kernels_gemm sweeps it). ``silu_mul``: x is
    [M, 2K], gate then up, and the product is silu(gate) * up @ weight^T, the operand
    rounded as ``ops.silu_and_mul``'s kernel rounds it (no launch of its own)."""
    m, n, k, out = _output(x, weight, bias, split_k, silu_mul)
    if m == 0 or n == 0:
        return out
    grid = (cdiv(m, block_m), cdiv(n, block_n), split_k)
    if split_k > 1:
        part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
        counters = _tile_counters(x.device, grid[0] * grid[1])
    else:
        part = counters = out  # unused
    _linear_kernel[grid](
        x, weight, bias if bias is not None else out, out, part, counters,
        m, n, k, next_power_of_2(m), x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT_K=split_k, UPCAST=INTERPRETING or x.dtype == torch.float32, SILU_MUL=silu_mul,
        num_warps=num_warps, num_stages=1 if INTERPRETING else num_stages,
    )
    return out


# --- autotuned, for the model's projections -------------------------------------------------

# (block_m, block_n, block_k, split_k, num_warps, num_stages): square 64-tiles at every
# split, taller and wider tiles with fewer splits, deeper K slices.
TUNED_CONFIGS = ([(64, 64, 64, sk, 4, 4) for sk in (1, 2, 4, 8)]
                 + [(128, 64, 64, sk, 4, 4) for sk in (1, 2, 4)]
                 + [(128, 128, 64, sk, 8, 4) for sk in (1, 2)]
                 + [(64, 64, 128, sk, 4, 3) for sk in (2, 4)])
# Split-K writes SPLIT_K x M x N fp32 partials: only for outputs up to this wide (the
# narrow projections, where it pays: few output tiles).
SPLIT_MAX_N = 4096
_MAX_SPLIT = max(c[3] for c in TUNED_CONFIGS)
_workspaces: dict[torch.device, torch.Tensor] = {}


def _workspace(device: torch.device, numel: int) -> torch.Tensor:
    """The fp32 partials' buffer, shared by every launch on the device's one stream (grown
    by a graph's warm-up run before its capture, never during it; a buffer replaced by a
    larger one is kept alive for the graphs captured with it: counters.RETIRED)."""
    buf = _workspaces.get(device)
    if buf is None or buf.numel() < numel:
        if buf is not None:
            RETIRED.append(buf)
        buf = _workspaces[device] = torch.empty(numel, dtype=torch.float32, device=device)
    return buf


def _prune(configs, named_args, **kwargs):
    n = named_args["N"]
    k = named_args["K"]
    return [c for c in configs if c.kwargs["SPLIT_K"] == 1 or (
        n <= SPLIT_MAX_N and k // (c.kwargs["BLOCK_K"] * c.kwargs["SPLIT_K"]) >= 2)]


_linear_tuned_kernel = triton.autotune(
    configs=[triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk},
                           num_warps=warps, num_stages=stages)
             for bm, bn, bk, sk, warps, stages in TUNED_CONFIGS],
    # Tuned per power-of-two M (a decode graph's 35 batch sizes are 9 keys a shape), each
    # configuration timed for ~10 ms: ~5 s of an executor's start for the four projections.
    key=["M_KEY", "N", "K"], prune_configs_by={"early_config_prune": _prune},
    do_bench=lambda fn, quantiles: triton.testing.do_bench(fn, warmup=2, rep=10,
                                                          quantiles=quantiles),
)(_linear_kernel)


def linear_tuned(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 *, silu_mul: bool = False) -> torch.Tensor:
    """`linear_triton` with the launch configuration the autotuner picked for this (M, N,
    K); on the interpreter, one fixed configuration (tuning there would time nothing real)."""
    if INTERPRETING:
        return linear_triton(x, weight, bias, block_m=16, block_n=16, block_k=16, split_k=2,
                             silu_mul=silu_mul)
    m, n, k, out = _output(x, weight, bias, 1, silu_mul)
    if m == 0 or n == 0:
        return out
    part = _workspace(x.device, (_MAX_SPLIT * m * n) if n <= SPLIT_MAX_N else 1)
    counters = _tile_counters(x.device, cdiv(m, 64) * cdiv(n, 64))

    def grid(meta):
        return (cdiv(m, meta["BLOCK_M"]), cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])

    _linear_tuned_kernel[grid](
        x, weight, bias if bias is not None else out, out, part, counters,
        m, n, k, next_power_of_2(m), x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, UPCAST=x.dtype == torch.float32, SILU_MUL=silu_mul,
    )
    return out
