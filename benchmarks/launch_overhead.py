"""Host time of the kernel launchers (kernels/ops.py down to the Triton launch), with every
Triton kernel replaced by a no-op: what pagedserve's own Python costs per launch, which an
eager step pays ~120 times and a step replayed as graph pieces ~24 times (attention).
Runs on a CPU (the tensors are CPU tensors; nothing is computed). Triton's own launch cost
is not in it (a GPU's: executor_bench --profile, ``host_profile_*``).

Cases (JSON lines, DESIGN §8): one per entry point, the Qwen2.5-0.5B sizes at 256 decode
tokens (the prefill case: 8 chunks of 64; argmax_rows and keyed_draw: 256 rows of its
151,936-entry vocabulary): ``us_per_call`` (mean of ``--calls``).

    python benchmarks/launch_overhead.py [--calls 20000]
"""

from __future__ import annotations

import argparse
import json
import os
import time


class _NoLaunch:
    """Stands in for a `@triton.jit` function: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # the launchers' GPU path (no interpreter)
    import torch
    from pagedserve.kernels import (
        decode_attention,
        draw_ops,
        layer_ops,
        ops,
        prefill_attention,
        sampling_ops,
    )

    for module, names in ((decode_attention, ["_decode_kernel", "_reduce_kernel"]),
                          (prefill_attention, ["_prefill_kernel"]),
                          (sampling_ops, ["_argmax_chunks_kernel", "_argmax_rows_kernel"]),
                          (draw_ops, ["_chunk_max_kernel", "_chunk_mass_kernel",
                                      "_chunk_pick_kernel"]),
                          (layer_ops, ["_rms_norm_kernel", "_rotary_kernel",
                                       "_rotary_cache_kernel", "_silu_and_mul_kernel"])):
        for name in names:
            setattr(module, name, _NoLaunch())

    tokens, heads, kv_heads, dim, block, hidden, inter = 256, 14, 2, 64, 16, 896, 4864
    bf16 = torch.bfloat16
    q = torch.randn(tokens, heads, dim).to(bf16)
    k = torch.randn(tokens, kv_heads, dim).to(bf16)
    kc = torch.zeros(64, block, kv_heads, dim, dtype=bf16)
    vc = torch.zeros_like(kc)
    tables = torch.zeros(tokens, 66, dtype=torch.int32)
    lens = torch.full((tokens,), 1000, dtype=torch.int32)
    starts = torch.arange(tokens + 1, dtype=torch.int32)
    chunk_starts = torch.arange(0, tokens + 1, 64 // 2, dtype=torch.int32)[:9]
    x = torch.randn(tokens, hidden).to(bf16)
    residual = torch.randn(tokens, hidden).to(bf16)
    weight = torch.randn(hidden).to(bf16)
    cos_sin = torch.randn(tokens, 2, dim).to(bf16)
    gate_up = torch.randn(tokens, 2 * inter).to(bf16)
    slots = torch.arange(tokens)
    logits = torch.zeros(tokens, 151936, dtype=bf16)  # Qwen2.5's vocabulary
    keys, temps = torch.full((tokens,), 0.5, dtype=torch.float64), torch.ones(tokens)
    cases = {
        "paged_attention_decode": lambda: ops.paged_attention(
            q, kc, vc, tables, starts, lens, 0.125, max_query_len=1, backend="triton"),
        "paged_attention_prefill": lambda: ops.paged_attention(
            q, kc, vc, tables[:8], chunk_starts, lens[:8], 0.125, max_query_len=64,
            backend="triton"),
        "rotary_embedding_and_cache": lambda: ops.rotary_embedding_and_cache(
            q, k, k, cos_sin, kc, vc, slots, backend="triton"),
        "rms_norm_residual": lambda: ops.rms_norm(x, weight, 1e-6, residual, backend="triton"),
        "silu_and_mul": lambda: ops.silu_and_mul(gate_up, backend="triton"),
        # the sampler's greedy tokens, eager when a decode graph does not compute them
        # (cuda_graphs.py: since the thirteenth session it does, for plain greedy steps)
        "argmax_rows": lambda: ops.argmax_rows(logits, backend="triton"),
        # the sampler's keyed draw of 256 temperature-only rows (three launches)
        "keyed_draw": lambda: ops.keyed_draw_(logits, None, keys, temperature=temps,
                                              backend="triton"),
    }
    for name, call in cases.items():
        call()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            call()
        us = (time.perf_counter() - t0) / args.calls * 1e6
        print(json.dumps({"bench": "launch_overhead", "case": name,
                          "us_per_call": round(us, 2), "calls": args.calls}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
