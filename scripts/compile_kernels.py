"""Compile every Triton kernel the launchers launch for an NVIDIA GPU, without one.

The kernel tests run in Triton's interpreter on a CPU, which executes the Python and never
meets the compiler: a construct the interpreter takes and the compiler refuses, or a
register/shared-memory budget a configuration exceeds, would first show on a GPU. Here each
launcher (kernels/ops.py and the modules behind it) is called with CPU tensors at the
shapes and dtypes the executor and the benchmarks use, every `kernel[grid](...)` it makes is
recorded instead of run, and each distinct launch (kernel, argument types, constexprs,
warps, stages) is compiled by `triton.compile` for the target (default sm_90, an H100/H200:
TTIR -> TTGIR -> LLVM -> PTX -> cubin with the ptxas Triton ships), and its shared memory
checked against the target's limit (registers are only known once a driver loads it). No
device and no driver are touched; compiled kernels land in Triton's cache (a second run is
fast). Triton here may be newer than a GPU machine's (KINDS.md): a kernel that compiles
here can still fail there, but not for the reasons this catches first.

One JSON line per distinct launch (`kernel`, `ok`, `seconds`, `error`), then a summary.

    python scripts/compile_kernels.py [--arch 90] [--quick]

`--quick`: one dtype (bf16) and head dim (64) per kernel family (tests/test_kernels_compile.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # the compiler's path, before any @triton.jit

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
           torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.uint8: "u8",
           torch.int8: "i8",
           torch.bool: "i1"}
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")


class Recorder:
    """Replaces JITFunction.run: every launch's kernel, arguments and options, not run."""

    def __init__(self) -> None:
        self.launches: dict[tuple, tuple] = {}

    def run(self, fn: JITFunction, args: tuple, kwargs: dict) -> None:
        names = fn.arg_names
        bound = dict(zip(names, args, strict=False))
        bound.update({k: v for k, v in kwargs.items() if k in names})
        options = {k: kwargs[k] for k in _LAUNCH_OPTIONS if k in kwargs}
        signature, constexprs = {}, {}
        for param in fn.params:
            value = bound[param.name]
            if param.is_constexpr:
                signature[param.name] = "constexpr"
                constexprs[param.name] = value
            else:
                signature[param.name] = _type_of(value)
        key = (fn.__name__, tuple(signature.items()), tuple(sorted(constexprs.items())),
               tuple(sorted(options.items())))
        self.launches.setdefault(key, (fn, signature, constexprs, options))


def _type_of(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def drive_launchers(quick: bool) -> None:
    """Call every launcher the executor uses, at its shapes, on CPU tensors."""
    from pagedserve.kernels import decode_attention, ops, sampling_ops
    from pagedserve.kernels.testing import make_paged_batch

    dtypes = [torch.bfloat16] if quick else [torch.bfloat16, torch.float16, torch.float32]
    shapes = [(14, 2, 64)] if quick else [(14, 2, 64), (32, 4, 128), (8, 2, 80)]
    for dtype in dtypes:
        for heads, kv_heads, dim in shapes:
            group = heads // kv_heads
            decode = make_paged_batch([(1, 1000), (1, 37)], num_kv_heads=kv_heads,
                                      group=group, head_dim=dim, block_size=16, dtype=dtype,
                                      device="cpu")
            args = (decode.query, decode.key_cache, decode.value_cache,
                    decode.block_tables, decode.seq_lens, decode.scale)
            for splits in (1, 4):
                for fused in (False, True):
                    decode_attention.paged_decode_attention_triton(
                        *args, num_splits=splits, fused_reduce=fused)
            # the launcher's own tile rule on a small and a large grid
            decode_attention.paged_decode_attention_triton(*args)
            prefill = make_paged_batch([(64, 64), (17, 300)], num_kv_heads=kv_heads,
                                       group=group, head_dim=dim, block_size=16, dtype=dtype,
                                       device="cpu")
            ops.paged_attention(prefill.query, prefill.key_cache, prefill.value_cache,
                                prefill.block_tables, prefill.query_start_loc,
                                prefill.seq_lens, prefill.scale,
                                max_query_len=prefill.max_query_len, backend="triton")
            ops.paged_attention(prefill.query, prefill.key_cache, prefill.value_cache,
                                prefill.block_tables, prefill.query_start_loc,
                                prefill.seq_lens, prefill.scale, sliding_window=33,
                                max_query_len=prefill.max_query_len, backend="triton")
            tokens = 8
            q = torch.zeros(tokens, heads, dim, dtype=dtype)
            k = torch.zeros(tokens, kv_heads, dim, dtype=dtype)
            cos_sin = torch.zeros(tokens, 2, dim, dtype=dtype)
            slots = torch.arange(tokens)
            ops.rotary_embedding(q, k, cos_sin, backend="triton")
            ops.rotary_embedding_and_cache(q, k, k, cos_sin, decode.key_cache,
                                           decode.value_cache, slots, backend="triton")
            ops.reshape_and_cache(k, k, decode.key_cache, decode.value_cache, slots,
                                  backend="triton")
            hidden = heads * dim
            x, w = torch.zeros(tokens, hidden, dtype=dtype), torch.zeros(hidden, dtype=dtype)
            ops.rms_norm(x, w, 1e-6, backend="triton")
            ops.rms_norm(x, w, 1e-6, torch.zeros_like(x), backend="triton")
            ops.rms_norm(q, w[:dim], 1e-6, backend="triton")  # Qwen3's per-head norm
            ops.silu_and_mul(torch.zeros(tokens, 2 * 4864, dtype=dtype), backend="triton")
        kv = torch.zeros(2, 2, 16, 16, 2, 64, dtype=dtype)
        ops.copy_blocks(kv, torch.tensor([[0, 3], [1, 2]]), backend="triton")
        logits = torch.zeros(4, 151_936, dtype=dtype)
        ops.argmax_rows(logits, backend="triton")
    rows = torch.zeros(4, 151_936)
    for bits in (1, 2, 4):
        sampling_ops.top_p_thresholds_triton(
            rows, torch.zeros(4, 1), torch.full((4,), 0.9), torch.zeros(4, 1),
            torch.ones(4, dtype=torch.bool), -87.0, radix_bits=bits)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10")
    ap.add_argument("--quick", action="store_true", help="bf16, head dim 64 only")
    ap.add_argument("--max-shared", type=int, default=232_448,
                    help="shared memory a block may use (H100/H200: 227 KiB)")
    args = ap.parse_args(argv)
    recorder = Recorder()
    JITFunction.run = lambda self, *a, grid=None, warmup=False, **kw: recorder.run(self, a, kw)
    drive_launchers(args.quick)
    target = GPUTarget("cuda", args.arch, 32)
    failed = 0
    t_all = time.perf_counter()
    for (name, _, _, _), (fn, signature, constexprs, options) in recorder.launches.items():
        t0 = time.perf_counter()
        record = {"bench": "compile_kernels", "case": name, "arch": f"sm_{args.arch}",
                  "constexprs": {k: v for k, v in constexprs.items()}, **options}
        try:
            compiled = triton.compile(ASTSource(fn, signature, constexprs), target=target,
                                      options=options)
            record["shared_bytes"] = shared = compiled.metadata.shared
            record["ok"] = shared <= args.max_shared
            if not record["ok"]:
                failed += 1
                record["error"] = f"{shared} bytes of shared memory (at most {args.max_shared})"
        except Exception as exc:  # noqa: BLE001 - reported per kernel
            failed += 1
            record["ok"] = False
            record["error"] = f"{type(exc).__name__}: {str(exc).strip()[-600:]}"
        record["seconds"] = round(time.perf_counter() - t0, 2)
        print(json.dumps(record, default=str), flush=True)
    print(json.dumps({"bench": "compile_kernels", "case": "summary", "ok": failed == 0,
                      "launches": len(recorder.launches), "failed": failed,
                      "triton": triton.__version__, "arch": f"sm_{args.arch}",
                      "seconds": round(time.perf_counter() - t_all, 1)}), flush=True)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
