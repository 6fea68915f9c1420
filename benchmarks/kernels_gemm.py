"""kernels_bench.py's `--cases gemm`: the projections of one Qwen2.5-0.5B decoder layer and
its vocabulary head as a decode step runs them (``torch.nn.functional.linear`` on M tokens:
64 and 256), under each BLAS library torch can prefer on CUDA (cuBLAS, the default, and
cuBLASLt: ``torch.backends.cuda.preferred_blas_library``), graph-timed. On the H200
(2026-11-27, fifth run's trace) the four projections took 30.6 us a layer at 256 tokens (734
us of a 2.15 ms step) against ~7.5 us of weight reads: which library, if either, is nearer?

Per case: ``latency_us_p50`` per library, ``tflop_per_s``, ``weight_read_us`` (the weight's
bytes at the measured copy bandwidth: the floor were it memory-bound), and the fastest
library. Then ``gemm/qwen2.5_0.5b/step_m{M}``: the step's total (24 layers' four
projections plus the head) per library: what preferring one would save a step."""

from __future__ import annotations

from kernels_tune import emit

# (name, out_features, in_features, bias) of Qwen2.5-0.5B: hidden 896, 14 q + 2 kv heads of 64
# (QKV fused, with bias), MLP 4864 (gate and up fused), vocabulary 151,936 (tied head).
QWEN_05B_LINEARS = [("qkv", 1152, 896, True), ("o_proj", 896, 896, False),
                    ("gate_up", 9728, 896, False), ("down", 896, 4864, False)]
QWEN_05B_HEAD = ("lm_head", 151_936, 896, False)
QWEN_05B_LAYERS = 24
LIBRARIES = ("cublas", "cublaslt")


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
            totals = dict.fromkeys(libraries, 0.0)
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
                record["weight_read_us"] = round(n * k * elem / copy_gb_per_s / 1e3, 2)
                record["fastest"] = min(libraries, key=lambda lib: record[f"{lib}_latency_us_p50"])
                emit(record)
            emit({"case": f"gemm/qwen2.5_0.5b/step_m{tokens}", "layers": QWEN_05B_LAYERS,
                  **{f"{lib}_step_us": round(total, 1) for lib, total in totals.items()},
                  "fastest": min(libraries, key=totals.get)})
    finally:
        if cuda:
            torch.backends.cuda.preferred_blas_library(before)
