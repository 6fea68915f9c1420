"""kernels_bench.py's `--cases gemm`: the projections of one Qwen2.5-0.5B decoder layer and
its vocabulary head as a decode step runs them (``torch.nn.functional.linear`` on M tokens:
64 and 256), under each BLAS library torch can prefer on CUDA (cuBLAS, the default, and
cuBLASLt: ``torch.backends.cuda.preferred_blas_library``), and the split-K Triton GEMM
(kernels/linear_ops.py) at the best of ``TRITON_GRID``, graph-timed. On the H200
(2026-11-27, fifth run's trace) the four projections took 30.6 us a layer at 256 tokens (734
us of a 2.15 ms step) against ~7.5 us of weight reads: which library, if either, is nearer?

Per case: ``latency_us_p50`` per library, ``tflop_per_s``, ``weight_read_us`` (the weight's
bytes at the measured copy bandwidth: the floor were it memory-bound), and the fastest
library (``triton``: the best Triton configuration, ``triton_config``). Then
``gemm/qwen2.5_0.5b/step_m{M}``: the step's total (24 layers' four projections plus the
head) per library: what preferring one would save a step."""

from __future__ import annotations

import functools
import sys

from kernels_tune import emit

# (name, out_features, in_features, bias) of Qwen2.5-0.5B: hidden 896, 14 q + 2 kv heads of 64
# (QKV fused, with bias), MLP 4864 (gate and up fused), vocabulary 151,936 (tied head).
QWEN_05B_LINEARS = [("qkv", 1152, 896, True), ("o_proj", 896, 896, False),
                    ("gate_up", 9728, 896, False), ("down", 896, 4864, False)]
QWEN_05B_HEAD = ("lm_head", 151_936, 896, False)
QWEN_05B_LAYERS = 24
LIBRARIES = ("cublas", "cublaslt")
# The split-K Triton GEMM's launch configurations swept at each shape (kernels/linear_ops.py):
# (block_m, block_n, block_k, split_k, num_warps, num_stages).
TRITON_GRID = [(bm, bn, 64, sk, 8 if bm * bn > 64 * 128 else 4, 4) for bm in (64, 128)
               for bn in (64, 128) for sk in (1, 2, 4, 8)] + [
                   (64, 64, 128, sk, 4, 3) for sk in (2, 4)]


CONFIG_KEYS = ("block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages")
DRY_RUN_GRID = [(16, 16, 16, 2, 4, 1)]


def _best_triton(timed, x, w, b, grid, silu_mul: bool = False):
    """(latency, configuration) of the fastest launch of the split-K GEMM over ``grid``
    (None when none ran)."""
    from pagedserve.kernels.linear_ops import linear_triton

    best = None
    for config in grid:
        bm, bn, bk, sk, warps, stages = config
        launch = functools.partial(linear_triton, x, w, b, block_m=bm, block_n=bn, block_k=bk,
                                   split_k=sk, num_warps=warps, num_stages=stages,
                                   silu_mul=silu_mul)
        try:
            latency = timed(launch)
        except Exception as exc:  # noqa: BLE001 - a configuration the device cannot run
            print(f"linear_triton {config}: {type(exc).__name__}: {exc}"[:200], file=sys.stderr)
            continue
        if best is None or latency < best[0]:
            best = (latency, config)
    return best


def _down_with_silu(torch, timed, tokens: int, dtype, device, dry_run: bool):
    """The down projection with SiLU-and-multiply inside the Triton GEMM's operand loads,
    against the SiLU-and-multiply kernel then torch's linear (the model's path without the
    Triton GEMM): the launch and the [M, 4864] intermediate saved. None off CUDA (the
    interpreter would time nothing real)."""
    if device.type != "cuda" and not dry_run:
        return None
    from pagedserve.kernels import ops

    inter, hidden = (76, 14) if dry_run else (4864, 896)
    gate_up = torch.randn(tokens, 2 * inter, device=device, dtype=dtype)
    w = torch.randn(hidden, inter, device=device, dtype=dtype) * inter ** -0.5
    two = timed(lambda: torch.nn.functional.linear(ops.silu_and_mul(gate_up), w))
    best = _best_triton(timed, gate_up, w, None, DRY_RUN_GRID if dry_run else [
        c for c in TRITON_GRID if c[0] * c[1] <= 64 * 128], silu_mul=True)
    if best is None:
        return None
    return {"case": f"gemm/qwen2.5_0.5b/down_silu/m{tokens}",
            "silu_then_linear_latency_us_p50": round(two, 2),
            "triton_silu_mul_latency_us_p50": round(best[0], 2),
            "triton_config": dict(zip(CONFIG_KEYS, best[1], strict=True)),
            "saved_us_x24": round(24 * (two - best[0]), 1)}


def bench_gemm(torch, device, dtype, timed, copy_gb_per_s: float, dry_run: bool) -> None:
    cuda = device.type == "cuda"
    libraries = LIBRARIES if cuda else ("default",)
    linears = QWEN_05B_LINEARS + [QWEN_05B_HEAD]
    if dry_run:  # the same shapes, scaled down for the CPU
        linears = [(name, max(8, n // 64), max(8, k // 64), bias) for name, n, k, bias in linears]
    elem = torch.tensor([], dtype=dtype).element_size()
    before = torch.backends.cuda.preferred_blas_library() if cuda else None
    try:
        for tokens in (4,) if dry_run else (64, 256):
            totals = dict.fromkeys((*libraries, "triton"), 0.0)
            for name, n, k, bias in linears:
                x = torch.randn(tokens, k, device=device, dtype=dtype)
                w = torch.randn(n, k, device=device, dtype=dtype) * k ** -0.5
                b = torch.randn(n, device=device, dtype=dtype) if bias else None
                record = {"case": f"gemm/qwen2.5_0.5b/{name}/m{tokens}",
                          "dtype": str(dtype).removeprefix("torch."), "n": n, "k": k,
                          "bias": bias}
                for lib in libraries:
                    if cuda:
                        torch.backends.cuda.preferred_blas_library(lib)
                    latency = timed(lambda x=x, w=w, b=b: torch.nn.functional.linear(x, w, b))
                    record[f"{lib}_latency_us_p50"] = round(latency, 2)
                    record[f"{lib}_tflop_per_s"] = round(2 * tokens * n * k / latency / 1e6, 1)
                    totals[lib] += latency * (1 if name == "lm_head" else QWEN_05B_LAYERS)
                best = _best_triton(timed, x, w, b, DRY_RUN_GRID if dry_run else TRITON_GRID)
                if best is not None:
                    totals["triton"] += best[0] * (1 if name == "lm_head" else QWEN_05B_LAYERS)
                    record["triton_latency_us_p50"] = round(best[0], 2)
                    record["triton_config"] = dict(zip(CONFIG_KEYS, best[1], strict=True))
                record["weight_read_us"] = round(n * k * elem / copy_gb_per_s / 1e3, 2)
                record["fastest"] = min(
                    (*libraries, "triton"),
                    key=lambda lib: record.get(f"{lib}_latency_us_p50", float("inf")))
                emit(record)
            record = _down_with_silu(torch, timed, tokens, dtype, device, dry_run)
            if record is not None:
                emit(record)
            emit({"case": f"gemm/qwen2.5_0.5b/step_m{tokens}", "layers": QWEN_05B_LAYERS,
                  **{f"{lib}_step_us": round(total, 1) for lib, total in totals.items()},
                  "fastest": min(libraries, key=totals.get)})
    finally:
        if cuda:
            torch.backends.cuda.preferred_blas_library(before)
