"""Compile every Triton kernel the launchers launch for an NVIDIA GPU, without one.

The kernel tests run in Triton's interpreter on a CPU, which executes the Python and never
meets the compiler: a construct the interpreter takes and the compiler refuses, or a
register/shared-memory budget a configuration exceeds, would first show on a GPU. Here each
launcher (kernels/ops.py and the modules behind it) is called with CPU tensors at the
shapes and dtypes the executor and the benchmarks use, every `kernel[grid](...)` it makes is
recorded instead of run, and each distinct launch (kernel, argument types, constexprs,
warps, stages) is compiled by `triton.compile` for the target (default sm_90, an H100/H200:
TTIR -> TTGIR -> LLVM -> PTX -> cubin with the ptxas Triton ships), and its shared memory
checked against the target's limit. Launches are specialised as Triton's launch path does
(16-byte aligned pointers, integers divisible by 16), so the code is the code a GPU would
run: each line also reports `registers` a thread and `stack_bytes` (register spills), read
from the cubin with the cuobjdump Triton ships (reported, not judged). No
device and no driver are touched; compiled kernels land in Triton's cache (a second run is
fast). Triton here may be newer than a GPU machine's (KINDS.md): a kernel that compiles
here can still fail there, but not for the reasons this catches first.

One JSON line per distinct launch (`case` = kernel, its constexprs, warps, stages,
`shared_bytes`, `registers`, `stack_bytes`, `ok`, `seconds`, `error`), then a summary.

    python scripts/compile_kernels.py [--arch 90] [--quick]

Against another Triton (the GPU machines' 3.6.0, say): `pip install --no-deps --target DIR
triton==3.6.0`, then `PYTHONPATH=DIR python scripts/compile_kernels.py`.

`--quick`: one dtype (bf16) and head dim (64) per kernel family (tests/test_kernels_compile.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the compiler's path, before any @triton.jit

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


class Recorder:
    """Replaces JITFunction.run: every launch's kernel, specialised as Triton's own launch
    path specialises it (argument types, 16-byte alignment of pointers and divisibility of
    integers by 16, constexprs, options), recorded, not run."""

    def __init__(self, target: GPUTarget) -> None:
        from triton.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature

        self.target = target
        self.backend = make_backend(target)
        self._binders: dict[JITFunction, object] = {}
        self._bind = create_function_from_signature
        self.launches: dict[tuple, tuple] = {}

    def run(self, fn: JITFunction, args: tuple, kwargs: dict) -> None:
        binder = self._binders.get(fn)
        if binder is None:
            binder = self._binders[fn] = self._bind(fn.signature, fn.params, self.backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(self.backend, kwargs, bound,
                                                              specialization, options)
        key = (fn.__name__, str(specialization), str(options))
        self.launches.setdefault(key, (fn, signature, constexprs, attrs, options.__dict__))


def _resource_usage(cubin: bytes | None) -> dict:
    """Registers a thread and bytes of stack (register spills) of a compiled kernel, from the
    cuobjdump Triton ships ({} when it is not there)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cubin or not tool.is_file():
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name],
                             capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return {"registers": int(m.group(1)), "stack_bytes": int(m.group(2))} if m else {}


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
            # the last partial tile in the loop of the whole ones (decode_rules.MASK_EVERY_TILE)
            for splits in (1, 4):
                decode_attention.paged_decode_attention_triton(*args, num_splits=splits,
                                                               mask_every_tile=True)
            # the rotary with the cache write in the launch (the model's decode steps on a
            # GPU, unless PAGEDSERVE_DECODE_FUSED_ROPE=0), plain and split-K
            num = decode.query.shape[0]
            rope = (torch.zeros(num, kv_heads, dim, dtype=dtype),
                    torch.zeros(num, kv_heads, dim, dtype=dtype),
                    torch.zeros(num, 2, dim, dtype=dtype), torch.arange(num))
            for splits in (1, 4):
                decode_attention.paged_decode_attention_triton(*args, num_splits=splits,
                                                               rope=rope)
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
    drive_fp8_cache(quick)
    # The split-K GEMM (kernels/linear_ops.py, benchmarks/kernels_gemm.py's sweep): the
    # largest tiles and stages of the sweep, split and not, with and without bias.
    from pagedserve.kernels.linear_ops import linear_triton

    x = torch.zeros(256, 896, dtype=torch.bfloat16)
    w = torch.zeros(896, 896, dtype=torch.bfloat16)
    for bm, bn, bk, split, stages in ((128, 128, 64, 1, 4), (64, 64, 64, 4, 4),
                                      (64, 64, 128, 2, 3)):
        for bias in (None, torch.zeros(896, dtype=torch.bfloat16)):
            linear_triton(x, w, bias, block_m=bm, block_n=bn, block_k=bk, split_k=split,
                          num_stages=stages)
    # the down projection with SiLU-and-multiply in its operand loads
    linear_triton(torch.zeros(256, 2 * 896, dtype=torch.bfloat16), w, block_m=64, block_n=64,
                  block_k=64, split_k=4, num_stages=4, silu_mul=True)
    rows = torch.zeros(4, 151_936)
    for bits in (1, 2, 4):
        sampling_ops.top_p_thresholds_triton(
            rows, torch.zeros(4, 1), torch.full((4,), 0.9), torch.zeros(4, 1),
            torch.ones(4, dtype=torch.bool), -87.0, radix_bits=bits)
    for bits, chunks in ((2, 64), (4, 256)):  # each row over pieces, a launch a pass
        sampling_ops.top_p_thresholds_triton(
            rows, torch.zeros(4, 1), torch.full((4,), 0.9), torch.zeros(4, 1),
            torch.ones(4, dtype=torch.bool), -87.0, radix_bits=bits, chunks=chunks)
    # the keyed draw (softmax, min-p, inverse CDF), with and without min-p
    from pagedserve.kernels.draw_ops import keyed_draw_triton

    u = torch.full((4,), 0.5, dtype=torch.float64)
    for min_p in (None, torch.zeros(4)):
        keyed_draw_triton(rows, min_p, u)
    # ... dividing 16-bit logits by the temperature itself, all rows and picked ones
    logits16 = torch.zeros(6, 151_936, dtype=torch.bfloat16)
    keyed_draw_triton(logits16[:4], None, u, temperature=torch.ones(4))
    keyed_draw_triton(logits16, torch.zeros(4), u, temperature=torch.ones(4),
                      rows=torch.tensor([5, 0, 2, 3]))
    # ... with a top-p floor a row (the threshold applied as the rows are read)
    keyed_draw_triton(rows, None, u, floor=torch.zeros(4))
    # a decode graph's inputs from its one staged buffer (tables 2,048 wide: 32k tokens)
    from pagedserve.kernels.graph_input_ops import graph_inputs_triton, stage_words

    graph_inputs_triton(torch.zeros(stage_words(256, 2048), dtype=torch.int32),
                        *(torch.zeros(256, dtype=torch.long) for _ in range(3)),
                        torch.zeros(256, dtype=torch.int32),
                        torch.zeros(256, 2048, dtype=torch.int32),
                        torch.zeros(256, dtype=torch.long))


def drive_fp8_cache(quick: bool) -> None:
    """The launchers that read or write the KV cache, on fp8 caches (`--kv-cache-dtype`)
    under a bf16 model (quick: e4m3 only; e5m2 differs in two constants) and a float16 and
    float32 one: every write rounds and saturates (kv_dtypes.py), every read widens."""
    from pagedserve.kernels import decode_attention, ops
    from pagedserve.kernels.testing import make_paged_batch

    heads, kv_heads, dim = 14, 2, 64
    pairs = [(torch.bfloat16, torch.float8_e4m3fn)] if quick else [
        (dtype, kv_dtype) for dtype in (torch.bfloat16, torch.float16, torch.float32)
        for kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]
    for dtype, kv_dtype in pairs:
        decode = make_paged_batch([(1, 1000), (1, 37)], num_kv_heads=kv_heads,
                                  group=heads // kv_heads, head_dim=dim, block_size=16,
                                  dtype=dtype, device="cpu", kv_dtype=kv_dtype)
        args = (decode.query, decode.key_cache, decode.value_cache, decode.block_tables,
                decode.seq_lens, decode.scale)
        num = decode.query.shape[0]
        rope = (torch.zeros(num, kv_heads, dim, dtype=dtype),
                torch.zeros(num, kv_heads, dim, dtype=dtype),
                torch.zeros(num, 2, dim, dtype=dtype), torch.arange(num))
        for splits in (1, 4):
            decode_attention.paged_decode_attention_triton(*args, num_splits=splits)
            decode_attention.paged_decode_attention_triton(*args, num_splits=splits, rope=rope)
        prefill = make_paged_batch([(64, 64), (17, 300)], num_kv_heads=kv_heads,
                                   group=heads // kv_heads, head_dim=dim, block_size=16,
                                   dtype=dtype, device="cpu", kv_dtype=kv_dtype)
        ops.paged_attention(prefill.query, prefill.key_cache, prefill.value_cache,
                            prefill.block_tables, prefill.query_start_loc, prefill.seq_lens,
                            prefill.scale, max_query_len=prefill.max_query_len,
                            backend="triton")
        tokens = 8
        q = torch.zeros(tokens, heads, dim, dtype=dtype)
        k = torch.zeros(tokens, kv_heads, dim, dtype=dtype)
        slots = torch.arange(tokens)
        ops.rotary_embedding_and_cache(q, k, k, torch.zeros(tokens, 2, dim, dtype=dtype),
                                       decode.key_cache, decode.value_cache, slots,
                                       backend="triton")
        ops.reshape_and_cache(k, k, decode.key_cache, decode.value_cache, slots,
                              backend="triton")
        kv = torch.zeros(2, 2, 16, 16, 2, 64, dtype=kv_dtype)
        ops.copy_blocks(kv, torch.tensor([[0, 3], [1, 2]]), backend="triton")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10")
    ap.add_argument("--quick", action="store_true", help="bf16, head dim 64 only")
    ap.add_argument("--max-shared", type=int, default=232_448,
                    help="shared memory a block may use (H100/H200: 227 KiB)")
    args = ap.parse_args(argv)
    target = GPUTarget("cuda", args.arch, 32)
    recorder = Recorder(target)
    JITFunction.run = lambda self, *a, grid=None, warmup=False, **kw: recorder.run(self, a, kw)
    drive_launchers(args.quick)
    failed = 0
    t_all = time.perf_counter()
    for (name, _, _), (fn, signature, constexprs, attrs, options) in recorder.launches.items():
        t0 = time.perf_counter()
        record = {"bench": "compile_kernels", "case": name, "arch": f"sm_{args.arch}",
                  "constexprs": {fn.arg_names[k[0]]: v for k, v in constexprs.items()},
                  "num_warps": options["num_warps"], "num_stages": options["num_stages"],
                  # an fp8 KV cache among its pointers (its element type)
                  "fp8": sorted({t.lstrip("*") for t in signature.values()
                                 if isinstance(t, str) and t.startswith("*fp8")})}
        try:
            compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                                      target=target, options=options)
            record["shared_bytes"] = shared = compiled.metadata.shared
            # bfloat16 fmas: a product and a sum contracted into one rounding (the rotary
            # arithmetic must keep two: layer_ops.rotated).
            record["fma_bf16"] = compiled.asm.get("ptx", "").count("fma.rn.bf16")
            record.update(_resource_usage(compiled.asm.get("cubin")))
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
