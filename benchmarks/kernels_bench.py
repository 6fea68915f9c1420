"""Paged attention kernels: latency, achieved bandwidth, share of the device's copy bandwidth,
and time relative to torch SDPA on the same keys/values stored contiguously (DESIGN §8).

    python benchmarks/kernels_bench.py             # GPU: the full grid below
    python benchmarks/kernels_bench.py --dry-run   # CPU: tiny sizes through the Triton
                                                   # interpreter, to check the script itself
    python benchmarks/kernels_bench.py --cases decode,prefill,cache   # a subset (default all)
    python benchmarks/kernels_bench.py --cases tune   # decode launch configurations (GPU)
    python benchmarks/kernels_bench.py --cases prefill_tune   # prefill launch configurations
    python benchmarks/kernels_bench.py --cases layer  # fused layer kernels vs torch forms (GPU)

Grid: batch 1/8/64/256 x context 128/1k/4k/16k x two head shapes (32 q / 4 kv heads, head dim
128, i.e. GQA 8:1; and Qwen2.5-0.5B, 14 q / 2 kv heads, head dim 64), block size 16, bf16.
Every sequence of a case has the full context. Without CUDA (and without --dry-run) it prints
one JSON line saying it was skipped and exits 0.

Figures: ``latency_us_p50`` (CUDA events around replays of a CUDA graph of GRAPH_CALLS calls,
per call; ``--eager-timing``: single eager calls, Python's launch path included), ``gb_per_s`` = bytes of K and V read /
latency (the decode lower bound on traffic), ``copy_bw_ratio`` = gb_per_s / the device's copy
bandwidth, measured here as (read + write bytes) / time of a 1 GiB device-to-device copy,
``paged_vs_contiguous_ratio`` = our latency / SDPA latency on contiguous [B, Hkv, L, D] K/V.
Targets (H100-class): copy_bw_ratio >= 0.85 for batch >= 64 and context >= 1k; >= 0.60 with
split-K at batch 1, context 16k; paged_vs_contiguous_ratio <= 1.10.

Prefill cases (``prefill/...``): whole prompts (causal) of batch x length through the paged
prefill kernel, ``tflop_per_s`` (causal attention: 2 * 2 * B * H * L^2 * D / 2 flops) and
``paged_vs_contiguous_ratio`` against SDPA with is_causal on contiguous K/V; ``extend/...``:
a chunk of new tokens after a cached prefix (no SDPA twin: a non-square causal mask).
Tune cases (``tune/...``, only when asked for): the decode kernel at the shapes its targets
name (batch 64 and 256, context 1k and 4k, both head shapes) under every launch configuration
of ``kernels_tune.TUNE_GRID`` (tokens per tile x warps x pipeline stages, the split count from the rule),
one line per shape with the default configuration's and the best one's latency and
``copy_bw_ratio``, and the best configuration: what to make the launcher's default; then the
default configuration at each split count of ``kernels_tune.TUNE_SPLITS``, and with 128-token tiles
(``splits``: latency per count, keys ``K`` and ``K_n128``, and ``K_n128_fused`` with the
split-K reduction done by the last split in the same launch; ``rule_splits``, what
choose_num_splits picks): what to make the split-K rule, the tile size and
``decode_attention.FUSED_REDUCE_MAX_SPLITS``.
Prefill tune cases (``prefill_tune/...``, only when asked for): the prefill kernel on batch 8
x 2048-token prompts under every configuration of ``kernels_tune.PREFILL_TUNE_GRID`` (rows per program x
key tile x warps x stages), one line per head shape with the default's latency, the best
configuration and the best one's ratio to SDPA: what to make the prefill launcher's default.
Layer cases (``layer/...``, only when asked for): the fused RMSNorm-with-residual, rotary and
SiLU-and-multiply kernels (layer_ops.py) and the four of them as one layer's set, against
their torch forms at the Qwen2.5-0.5B sizes for 256 decode tokens: ``fused_speedup_ratio``.
Sampling cases (``argmax/...``, ``top_p/...``, only when asked for: ``--cases sampling``):
the sampler's kernels (sampling_ops.py) at the Qwen2.5 vocabulary — the greedy argmax of
bf16 logits against torch's, and the whole-row top-p threshold on 256 rows with 0, 1, 8 or
all rows needing it, against the sort it replaces (benchmarks/kernels_sampling.py).
GEMM cases (``gemm/...``, only when asked for: ``--cases gemm``): the layer's projections
and the head at the Qwen2.5-0.5B sizes under cuBLAS and cuBLASLt (benchmarks/kernels_gemm.py).
Decode-rope cases (``decode_rope/...``, only when asked for): the rotary embedding and the
cache write inside the decode launch against the two launches (benchmarks/kernels_fusions.py).
Decode-tail cases (``decode_tail/...``, only when asked for): the decode kernel at contexts
ending inside a tile, the tail in its own loop or in the whole tiles' loop, 64- or 128-token
tiles, beside a copy of the same bytes (benchmarks/kernels_tail.py).
Decode-wide cases (``decode_wide/...``, only when asked for): a 1k context through a table
as wide as a decode graph's (its split count from the width), against the context's own
table (benchmarks/kernels_tail.py).
Decode-fp8 cases (``decode_fp8/...``, only when asked for): the decode kernel on an fp8 KV
cache beside the bf16 one, and its tile choices (benchmarks/kernels_fp8.py).

Cache cases: ``reshape_and_cache`` (new tokens' K and V written by slot) and ``copy_blocks``
(copy-on-write pairs over every layer), ``gb_per_s`` counting bytes read and written, and
``copy_bw_ratio`` against the same copy bandwidth.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # kernels_tune, also under PYTHONSAFEPATH
from kernels_fp8 import bench_decode_fp8  # noqa: E402
from kernels_fusions import bench_decode_rope  # noqa: E402
from kernels_gemm import bench_gemm  # noqa: E402
from kernels_sampling import bench_sampling  # noqa: E402
from kernels_tail import bench_decode_tail, bench_decode_wide  # noqa: E402
from kernels_tune import (  # noqa: E402
    bench_decode_tune,
    bench_prefill_tune,
    emit,
    prompt_batch,
)

GRAPH_CALLS = 20  # calls per captured graph when timing on CUDA


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true",
                   help="tiny sizes on CPU through TRITON_INTERPRET=1 (checks the script only)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--eager-timing", action="store_true",
                   help="time single eager calls (Python launch included) instead of replays "
                   "of a CUDA graph of GRAPH_CALLS calls")
    p.add_argument("--max-gib", type=float, default=24.0,
                   help="skip cases whose paged K/V (plus the contiguous copy) exceeds this")
    p.add_argument("--cases", default="decode,prefill,cache",
                   help="comma-separated subset of decode, prefill, cache, tune, "
                   "prefill_tune, layer, sampling, gemm, decode_rope (the last six: not in the default)")
    return p.parse_args()


def main() -> int:
    args = _parse()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any @triton.jit is defined
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        emit({"case": "skipped", "reason": "no CUDA device (use --dry-run to check the script)"})
        return 0

    from pagedserve.kernels import ops
    from pagedserve.kernels.decode_attention import _num_sms, choose_num_splits

    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    if args.dry_run:
        batches, contexts, iters = [1, 2], [17, 600], 2  # 600: split-K path
        shapes = {"gqa8_d128": (8, 1, 128), "qwen2.5_0.5b": (14, 2, 64)}
    else:
        batches, contexts, iters = [1, 8, 64, 256], [128, 1024, 4096, 16384], args.iters
        shapes = {"gqa8_d128": (32, 4, 128), "qwen2.5_0.5b": (14, 2, 64)}
    block_size = 16
    graph_timing = not args.eager_timing

    def timed(fn, graph: bool = True) -> float:
        """p50 of per-call latency in microseconds. On CUDA the calls are captured in a CUDA
        graph (GRAPH_CALLS of them back to back) and the replays timed with events: a single
        eager call of a few-microsecond kernel measures Python's launch path, not the kernel
        (the executor replays decode steps from graphs too). Eager where capture fails or
        `graph` is False. A dry run (the Triton interpreter: its figures mean nothing) calls
        `fn` twice, the second timed: the script's path, at a fraction of the tests' time."""
        if device.type != "cuda" and args.dry_run:
            fn()
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6
        fn()
        fn()
        if device.type == "cuda" and graph_timing and graph:
            torch.cuda.synchronize()
            try:
                graph = torch.cuda.CUDAGraph()
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    fn()  # warm-up on the side stream, as capture wants
                    torch.cuda.synchronize()
                    with torch.cuda.graph(graph, stream=stream):
                        for _ in range(GRAPH_CALLS):
                            fn()
                torch.cuda.current_stream().wait_stream(stream)
                calls, run = GRAPH_CALLS, graph.replay
            except RuntimeError as exc:
                print(f"graph capture failed, timing eagerly: {exc}", file=sys.stderr)
                torch.cuda.synchronize()
                calls, run = 1, fn
        else:
            calls, run = 1, fn
        run()
        samples = []
        for _ in range(iters):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) * 1e3 / calls)
            else:
                t0 = time.perf_counter()
                run()
                samples.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(samples)

    # Device copy bandwidth: (read + write) bytes of a large device-to-device copy.
    copy_bytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    # Eager: a 1 GiB copy is launch-free in effect, and a graph's memcpy node ran 18% slower
    # than the eager copy on an H100 (2,438 vs 2,968 GB/s), which would flatter every ratio.
    copy_us = timed(lambda src=src, dst=dst: dst.copy_(src), graph=False)
    copy_gb_per_s = 2 * copy_bytes / copy_us / 1e3
    del src, dst
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"
    emit({"case": "device_copy", "device": device_name, "bytes": copy_bytes,
           "latency_us_p50": round(copy_us, 2), "gb_per_s": round(copy_gb_per_s, 1)})

    cases = {c.strip() for c in args.cases.split(",") if c.strip()}
    if "decode" in cases:
        elem = torch.tensor([], dtype=dtype).element_size()
        for shape_name, (num_heads, num_kv_heads, head_dim) in shapes.items():
            for context in contexts:
                for batch in batches:
                    case = f"decode/{shape_name}/b{batch}/ctx{context}"
                    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * elem
                    if 2 * kv_bytes > args.max_gib * (1 << 30):
                        emit({"case": case, "skipped": f"needs > {args.max_gib} GiB"})
                        continue
                    blocks_per_seq = (context + block_size - 1) // block_size
                    num_blocks = batch * blocks_per_seq
                    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
                    key_cache = torch.randn(cache_shape, device=device, dtype=dtype)
                    value_cache = torch.randn(cache_shape, device=device, dtype=dtype)
                    # Shuffled block ids: pages scattered across the cache as in a live server.
                    block_tables = torch.randperm(num_blocks, device=device).view(
                        batch, blocks_per_seq).int()
                    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
                    query = torch.randn(batch, num_heads, head_dim, device=device, dtype=dtype)
                    out = torch.empty_like(query)
                    scale = head_dim**-0.5
                    num_splits = choose_num_splits(batch, num_kv_heads, blocks_per_seq * block_size,
                                                   _num_sms(device), head_dim)

                    def paged(splits=None, query=query, key_cache=key_cache,
                              value_cache=value_cache, block_tables=block_tables,
                              seq_lens=seq_lens, out=out, scale=scale):
                        ops.paged_decode_attention(query, key_cache, value_cache, block_tables,
                                                   seq_lens, scale, out=out, backend="triton",
                                                   num_splits=splits)

                    latency = timed(paged)
                    record = {
                        "case": case, "dtype": str(dtype).removeprefix("torch."),
                        "block_size": block_size, "num_splits": num_splits,
                        "latency_us_p50": round(latency, 2),
                        "gb_per_s": float(f"{kv_bytes / latency / 1e3:.4g}"),
                    }
                    record["copy_bw_ratio"] = float(f"{kv_bytes / latency / 1e3 / copy_gb_per_s:.4g}")
                    if num_splits > 1:
                        plain = timed(lambda paged=paged: paged(1))
                        record["plain_latency_us_p50"] = round(plain, 2)
                        record["split_k_speedup_ratio"] = round(plain / latency, 3)

                    # The same K/V stored contiguously, [B, Hkv, L, D], through SDPA (GQA native).
                    table = block_tables.long()
                    k_contig = key_cache[table].reshape(batch, -1, num_kv_heads, head_dim)[
                        :, :context].transpose(1, 2).contiguous()
                    v_contig = value_cache[table].reshape(batch, -1, num_kv_heads, head_dim)[
                        :, :context].transpose(1, 2).contiguous()
                    q_sdpa = query[:, :, None, :]
                    try:
                        def sdpa(q_sdpa=q_sdpa, k_contig=k_contig, v_contig=v_contig, scale=scale):
                            torch.nn.functional.scaled_dot_product_attention(
                                q_sdpa, k_contig, v_contig, scale=scale, enable_gqa=True)

                        sdpa_latency = timed(sdpa)
                        record["sdpa_latency_us_p50"] = round(sdpa_latency, 2)
                        record["paged_vs_contiguous_ratio"] = round(latency / sdpa_latency, 3)
                    except (RuntimeError, TypeError) as exc:  # old torch without enable_gqa, OOM
                        record["sdpa_error"] = str(exc).splitlines()[0][:120]
                    emit(record)
                    print(f"{case:40s} {latency:10.1f} us {record['gb_per_s']:8.1f} GB/s "
                          f"{record['copy_bw_ratio']:6.1%} of copy, splits {num_splits}",
                          file=sys.stderr)
                    del key_cache, value_cache, k_contig, v_contig
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    if "prefill" in cases:
        bench_prefill(torch, ops, device, dtype, timed, shapes, args.dry_run)
    if "cache" in cases:
        bench_cache(torch, ops, device, dtype, timed, copy_gb_per_s, args.dry_run)
    # The sweeps last: on an H200 (2026-11-27) the decode sweep alone outran the kernels
    # stage's budget, and the cases after it never ran.
    if "layer" in cases:
        bench_layer_ops(torch, ops, device, dtype, timed, args.dry_run)
    if "sampling" in cases:
        bench_sampling(torch, ops, device, dtype, timed, args.dry_run)
    if "gemm" in cases:
        bench_gemm(torch, device, dtype, timed, copy_gb_per_s, args.dry_run)
    if "decode_rope" in cases:
        bench_decode_rope(torch, device, dtype, timed, args.dry_run)
    if "decode_tail" in cases:
        bench_decode_tail(torch, device, dtype, timed, copy_gb_per_s, args.dry_run)
    if "decode_wide" in cases:
        bench_decode_wide(torch, device, dtype, timed, args.dry_run)
    if "decode_fp8" in cases:
        bench_decode_fp8(torch, device, dtype, timed, copy_gb_per_s, args.dry_run)
    if "prefill_tune" in cases:
        bench_prefill_tune(torch, device, dtype, timed, shapes, args.dry_run)
    if "tune" in cases:
        bench_decode_tune(torch, device, dtype, timed, copy_gb_per_s, shapes, args.dry_run)
    return 0


def bench_layer_ops(torch, ops, device, dtype, timed, dry_run: bool) -> None:
    """The fused layer kernels (layer_ops.py) against their torch forms at the Qwen2.5-0.5B
    sizes (hidden 896, 14/2 heads of 64, MLP 4864) for a decode batch of 256 tokens, and the
    whole per-layer set of them (2 norms with residual, rotary, SiLU-and-multiply)."""
    tokens, hidden, heads, kv_heads, dim, inter = ((4, 32, 2, 1, 16, 48) if dry_run else
                                                   (256, 896, 14, 2, 64, 4864))
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, device=device, dtype=dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=device, dtype=dtype)
    q = qkv[:, :heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    angles = torch.rand(tokens, 1, dim // 2, device=device) * 100
    emb = torch.cat((angles, angles), dim=-1)
    cos_sin = torch.cat((emb.cos(), emb.sin()), dim=1).to(dtype)
    gate_up = torch.randn(tokens, 2 * inter, device=device, dtype=dtype)

    def layer(backend):
        # The residual buffer is updated in place by the fused form: the figures stay finite
        # because each norm divides by its own scale.
        h, r = ops.rms_norm(x, weight, 1e-6, residual, backend=backend)
        ops.rotary_embedding(q, k, cos_sin, backend=backend)
        ops.silu_and_mul(gate_up, backend=backend)
        ops.rms_norm(h, weight, 1e-6, r, backend=backend)

    cases = {
        "rms_norm_residual": lambda b: ops.rms_norm(x, weight, 1e-6, residual, backend=b),
        "rotary_embedding": lambda b: ops.rotary_embedding(q, k, cos_sin, backend=b),
        "silu_and_mul": lambda b: ops.silu_and_mul(gate_up, backend=b),
        "layer_set": layer,
    }
    for name, run in cases.items():
        fused = timed(lambda run=run: run("triton"))
        torch_forms = timed(lambda run=run: run("torch"))
        emit({"case": f"layer/{name}/t{tokens}", "dtype": str(dtype).removeprefix("torch."),
               "latency_us_p50": round(fused, 2), "torch_latency_us_p50": round(torch_forms, 2),
               "fused_speedup_ratio": round(torch_forms / fused, 3)})
    # The rotary with the KV-cache write in one launch, against the two Triton launches it
    # replaced (rotary, then reshape_and_cache).
    v = qkv[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    num_blocks = tokens // 16 + 4
    key_cache = torch.zeros(num_blocks, 16, kv_heads, dim, device=device, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.randperm(num_blocks * 16, device=device)[:tokens]

    def two_launches():
        ops.rotary_embedding(q, k, cos_sin, backend="triton")
        ops.reshape_and_cache(k, v, key_cache, value_cache, slots, backend="triton")

    one = timed(lambda: ops.rotary_embedding_and_cache(q, k, v, cos_sin, key_cache,
                                                       value_cache, slots, backend="triton"))
    two = timed(two_launches)
    emit({"case": f"layer/rotary_and_cache/t{tokens}", "dtype": str(dtype).removeprefix("torch."),
          "latency_us_p50": round(one, 2), "two_launches_latency_us_p50": round(two, 2),
          "fused_speedup_ratio": round(two / one, 3)})


def bench_prefill(torch, ops, device, dtype, timed, shapes, dry_run: bool) -> None:
    """Whole prompts through the paged prefill kernel against SDPA (is_causal) on contiguous
    K/V, then a chunk after a cached prefix (extend)."""
    block_size = 16
    grid = ([(1, 40), (2, 19)] if dry_run else [(1, 8192), (8, 2048), (32, 512)])
    extend = [(1, 8, 40)] if dry_run else [(1, 512, 8192), (16, 256, 2048)]
    for shape_name, (num_heads, num_kv_heads, head_dim) in shapes.items():
        scale = head_dim**-0.5
        for batch, q_len, prefix in [(b, n, 0) for b, n in grid] + extend:
            seq_len = prefix + q_len
            key_cache, value_cache, tables, query, starts, seq_lens, out = prompt_batch(
                torch, device, dtype, batch, q_len, seq_len, block_size,
                (num_heads, num_kv_heads, head_dim))

            def paged(query=query, key_cache=key_cache, value_cache=value_cache, tables=tables,
                      starts=starts, seq_lens=seq_lens, out=out, scale=scale, q_len=q_len):
                ops.paged_prefill_attention(query, key_cache, value_cache, tables, starts,
                                            seq_lens, scale, out=out, backend="triton",
                                            max_query_len=q_len)

            latency = timed(paged)
            # Causal: query i attends to prefix + i + 1 keys; 2 matmuls of 2 flops per MAC.
            macs = batch * num_heads * head_dim * (q_len * prefix + q_len * (q_len + 1) / 2)
            kind = "extend" if prefix else "prefill"
            record = {"case": f"{kind}/{shape_name}/b{batch}/q{q_len}/ctx{seq_len}",
                      "dtype": str(dtype).removeprefix("torch."), "block_size": block_size,
                      "latency_us_p50": round(latency, 2),
                      "tflop_per_s": float(f"{4 * macs / latency / 1e6:.4g}")}
            if not prefix:
                table = tables.long()
                k = key_cache[table].reshape(batch, -1, num_kv_heads, head_dim)[
                    :, :seq_len].transpose(1, 2).contiguous()
                v = value_cache[table].reshape(batch, -1, num_kv_heads, head_dim)[
                    :, :seq_len].transpose(1, 2).contiguous()
                q = query.view(batch, q_len, num_heads, head_dim).transpose(1, 2).contiguous()
                try:
                    def sdpa(q=q, k=k, v=v, scale=scale):
                        torch.nn.functional.scaled_dot_product_attention(
                            q, k, v, scale=scale, is_causal=True, enable_gqa=True)

                    sdpa_latency = timed(sdpa)
                    record["sdpa_latency_us_p50"] = round(sdpa_latency, 2)
                    record["paged_vs_contiguous_ratio"] = round(latency / sdpa_latency, 3)
                except (RuntimeError, TypeError) as exc:  # old torch without enable_gqa, OOM
                    record["sdpa_error"] = str(exc).splitlines()[0][:120]
                del k, v, q
            emit(record)
            print(f"{record['case']:40s} {latency:10.1f} us {record['tflop_per_s']:8.1f} "
                  f"TFLOP/s", file=sys.stderr)
            del key_cache, value_cache, query, out
            if device.type == "cuda":
                torch.cuda.empty_cache()


def bench_cache(torch, ops, device, dtype, timed, copy_gb_per_s: float, dry_run: bool) -> None:
    """reshape_and_cache and copy_blocks: bytes read + written per second."""
    block_size, num_kv_heads, head_dim = 16, 2, 64  # Qwen2.5-0.5B's K/V per layer
    elem = torch.tensor([], dtype=dtype).element_size()
    for num_tokens in ([17, 100] if dry_run else [256, 4096, 32768]):
        num_blocks = 2 * num_tokens // block_size + 8
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        key_cache = torch.zeros(shape, device=device, dtype=dtype)
        value_cache = torch.zeros_like(key_cache)
        key = torch.randn(num_tokens, num_kv_heads, head_dim, device=device, dtype=dtype)
        value = torch.randn_like(key)
        slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]

        def write(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                  slots=slots):
            ops.reshape_and_cache(key, value, key_cache, value_cache, slots, backend="triton")

        latency = timed(write)
        moved = 2 * 2 * key.numel() * elem  # K and V, read and written
        gb_per_s = moved / latency / 1e3
        emit({"case": f"reshape_and_cache/t{num_tokens}", "dtype": str(dtype).removeprefix(
               "torch."), "latency_us_p50": round(latency, 2),
               "gb_per_s": float(f"{gb_per_s:.4g}"),
               "copy_bw_ratio": float(f"{gb_per_s / copy_gb_per_s:.4g}")})
        del key_cache, value_cache, key, value
    num_layers = 2 if dry_run else 24
    for pairs in ([3] if dry_run else [16, 256]):
        num_blocks = 2 * pairs + 4
        kv_cache = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim,
                               device=device, dtype=dtype)
        perm = torch.randperm(num_blocks, device=device)
        mapping = torch.stack([perm[:pairs], perm[pairs:2 * pairs]], dim=1)
        latency = timed(lambda kv_cache=kv_cache, mapping=mapping: ops.copy_blocks(
            kv_cache, mapping, backend="triton"))
        moved = 2 * pairs * num_layers * 2 * block_size * num_kv_heads * head_dim * elem
        gb_per_s = moved / latency / 1e3
        emit({"case": f"copy_blocks/p{pairs}/l{num_layers}",
               "dtype": str(dtype).removeprefix("torch."), "latency_us_p50": round(latency, 2),
               "gb_per_s": float(f"{gb_per_s:.4g}"),
               "copy_bw_ratio": float(f"{gb_per_s / copy_gb_per_s:.4g}")})
        del kv_cache


if __name__ == "__main__":
    sys.exit(main())
