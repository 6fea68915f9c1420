"""The launch-configuration sweeps of kernels_bench.py (`--cases tune`, `--cases
prefill_tune`: what the decode and prefill launchers' defaults, split rule and tile sizes
should be on a GPU), and what they share with its other cases (the JSON line, a batch of
paged prompts). kernels_bench.py's docstring describes the figures."""

from __future__ import annotations

import functools
import json

BENCH = "kernels_bench"
# Decode launch configurations swept by --cases tune: (block_n, num_warps, num_stages).
# The H200 run (2026-11-26) swept 32/64/128 x 4/8 warps x 2/3/4 stages at all 8 shapes: no
# 32-token tile and no 64-token tile with 8 warps came within 5% of a shape's best, so
# those 9 are no longer timed (the kernels stage's time goes to the split-K variants).
TUNE_GRID = [(64, 4, st) for st in (2, 3, 4)] + [(128, w, st) for w in (4, 8)
                                                 for st in (2, 3, 4)]
# The launcher's configuration before its tile rule (choose_block_n; 4 warps and 2 stages
# still are): the split sweep's first tile.
TUNE_DEFAULT = (64, 4, 2)
TUNE_SPLITS = (1, 2, 3, 4, 6, 8, 16)  # split counts swept by --cases tune
# Prefill launch configurations swept by --cases prefill_tune: (rows per program = query
# tokens x the group padded to a power of two, key tile, warps, pipeline stages); the first
# is the launcher's configuration before choose_prefill_config, the others what the Triton
# tutorial's and FlashAttention's Hopper settings suggest (128-row tiles, 8 warps, 3 stages).
# The last, added after the H200 run: the H200's best at head dim 128 (128 x 32 x 4 warps)
# spills 112 bytes a thread at 255 registers (scripts/compile_kernels.py, sm_90), the same
# tile with 8 warps takes 172 registers and spills nothing.
PREFILL_TUNE_GRID = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2), (64, 64, 8, 2),
                     (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 4, 2),
                     (128, 32, 8, 2)]


def emit(record: dict) -> None:
    print(json.dumps({"bench": BENCH, **record}), flush=True)


def latency_or_error(timed, call) -> float | str:
    """A swept configuration's p50 latency (us), or why it could not run (e.g. out of
    shared memory or registers for a large tile): the sweep goes on."""
    try:
        return round(timed(call), 2)
    except Exception as exc:  # noqa: BLE001 - recorded in the configuration's place
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"


def prompt_batch(torch, device, dtype, batch: int, q_len: int, seq_len: int,
                  block_size: int, heads: tuple[int, int, int]) -> tuple:
    """`batch` sequences of `seq_len` tokens whose last `q_len` are this chunk, in shuffled
    cache blocks: (key_cache, value_cache, block_tables, query, query_start_loc, seq_lens,
    out)."""
    num_heads, num_kv_heads, head_dim = heads
    blocks_per_seq = -(-seq_len // block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, device=device, dtype=dtype)
    value_cache = torch.randn(shape, device=device, dtype=dtype)
    tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).int()
    query = torch.randn(batch * q_len, num_heads, head_dim, device=device, dtype=dtype)
    starts = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device=device)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
    return key_cache, value_cache, tables, query, starts, seq_lens, torch.empty_like(query)


def bench_decode_tune(torch, device, dtype, timed, copy_gb_per_s: float, shapes: dict,
                      dry_run: bool) -> None:
    """Every TUNE_GRID configuration of the decode kernel at each target shape; one line per
    shape: the default's figures, the best configuration's, and all latencies."""
    from pagedserve.kernels.decode_attention import (
        _num_sms,
        choose_block_n,
        choose_num_splits,
        paged_decode_attention_triton,
    )

    grid = TUNE_GRID[:2] if dry_run else TUNE_GRID
    targets = [(2, 600)] if dry_run else [(64, 1024), (256, 1024), (64, 4096), (256, 4096)]
    block_size, elem = 16, torch.tensor([], dtype=dtype).element_size()
    # The GPU check's model shape (qwen2.5_0.5b) first: a sweep cut short by a stage's
    # budget has then measured the shape the executor runs.
    ordered = sorted(shapes.items(), key=lambda item: not item[0].startswith("qwen"))
    for shape_name, (num_heads, num_kv_heads, head_dim) in ordered:
        for batch, context in targets:
            blocks_per_seq = (context + block_size - 1) // block_size
            num_blocks = batch * blocks_per_seq
            cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
            key_cache = torch.randn(cache_shape, device=device, dtype=dtype)
            value_cache = torch.randn(cache_shape, device=device, dtype=dtype)
            tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).int()
            seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
            query = torch.randn(batch, num_heads, head_dim, device=device, dtype=dtype)
            out = torch.empty_like(query)
            kv_bytes = 2 * batch * context * num_kv_heads * head_dim * elem
            latencies: dict[str, float] = {}
            for block_n, warps, stages in grid:
                name = f"n{block_n}_w{warps}_s{stages}"
                call = functools.partial(
                    paged_decode_attention_triton, query, key_cache, value_cache, tables,
                    seq_lens, head_dim**-0.5, out=out, block_n=block_n, num_warps=warps,
                    num_stages=stages)
                latencies[name] = latency_or_error(timed, call)
            # Split counts at the default tile, and at 128-token tiles (faster for head dim
            # 64 at the old rule's 3 splits on an H100: is it with the new rule's 4?).
            # And with the split-K reduction in the attention launch (``K_n128_fused``).
            split_latencies: dict[str, float | str] = {}
            variants = [(TUNE_DEFAULT[0], False), (128, False), (128, True)]
            for block_n, fused in variants:
                for splits in TUNE_SPLITS[:2] if dry_run else TUNE_SPLITS:
                    if fused and splits == 1:
                        continue
                    key = str(splits) if block_n == TUNE_DEFAULT[0] else f"{splits}_n{block_n}"
                    key += "_fused" if fused else ""
                    call = functools.partial(
                        paged_decode_attention_triton, query, key_cache, value_cache, tables,
                        seq_lens, head_dim**-0.5, out=out, num_splits=splits, block_n=block_n,
                        fused_reduce=fused)
                    split_latencies[key] = latency_or_error(timed, call)
            timings = {k: v for k, v in latencies.items() if isinstance(v, float)}
            rule_splits = choose_num_splits(batch, num_kv_heads, blocks_per_seq * block_size,
                                            _num_sms(device), head_dim)
            record = {"case": f"tune/{shape_name}/b{batch}/ctx{context}",
                      "dtype": str(dtype).removeprefix("torch."), "configs": latencies,
                      "splits": split_latencies, "rule_splits": rule_splits,
                      "rule_block_n": choose_block_n(batch * num_kv_heads * rule_splits,
                                                     _num_sms(device), head_dim, dtype)}
            if timings:
                best = min(timings, key=timings.get)
                record.update(best=best, best_latency_us_p50=timings[best],
                              best_copy_bw_ratio=float(
                                  f"{kv_bytes / timings[best] / 1e3 / copy_gb_per_s:.4g}"))
            # "default": the launcher with no override (the split and tile rules), as the
            # executor runs it.
            default_us = round(timed(functools.partial(
                paged_decode_attention_triton, query, key_cache, value_cache, tables, seq_lens,
                head_dim**-0.5, out=out)), 2)
            record.update(default_latency_us_p50=default_us, copy_bw_ratio=float(
                f"{kv_bytes / default_us / 1e3 / copy_gb_per_s:.4g}"))
            emit(record)
            del key_cache, value_cache
            if device.type == "cuda":
                torch.cuda.empty_cache()


def bench_prefill_tune(torch, device, dtype, timed, shapes, dry_run: bool) -> None:
    """Every PREFILL_TUNE_GRID configuration of the prefill kernel on whole prompts (batch 8
    x 2048 tokens, the middle prefill case), both head shapes; one line per shape: the
    default's latency, the best configuration's and its ratio to SDPA (is_causal)."""
    from pagedserve.kernels.prefill_attention import (
        choose_prefill_config,
        paged_prefill_attention_triton,
    )

    batch, q_len, block_size = (2, 19, 16) if dry_run else (8, 2048, 16)
    grid = PREFILL_TUNE_GRID[:2] if dry_run else PREFILL_TUNE_GRID
    for shape_name, (num_heads, num_kv_heads, head_dim) in shapes.items():
        group = num_heads // num_kv_heads
        block_g = 1 << (group - 1).bit_length()
        key_cache, value_cache, tables, query, starts, seq_lens, out = prompt_batch(
            torch, device, dtype, batch, q_len, q_len, block_size,
            (num_heads, num_kv_heads, head_dim))
        latencies: dict[str, float | str] = {}
        for rows, block_n, warps, stages in grid:
            name = f"r{rows}_n{block_n}_w{warps}_s{stages}"
            call = functools.partial(
                paged_prefill_attention_triton, query, key_cache, value_cache, tables, starts,
                seq_lens, head_dim**-0.5, out=out, max_query_len=q_len,
                block_q=max(1, rows // block_g), block_n=block_n, num_warps=warps,
                num_stages=stages)
            latencies[name] = latency_or_error(timed, call)
        table = tables.long()
        k = key_cache[table].reshape(batch, -1, num_kv_heads, head_dim).transpose(1, 2).contiguous()
        v = value_cache[table].reshape(batch, -1, num_kv_heads, head_dim).transpose(1, 2).contiguous()
        q = query.view(batch, q_len, num_heads, head_dim).transpose(1, 2).contiguous()
        record = {"case": f"prefill_tune/{shape_name}/b{batch}/q{q_len}",
                  "dtype": str(dtype).removeprefix("torch."), "configs": latencies}
        try:
            record["sdpa_latency_us_p50"] = round(timed(functools.partial(
                torch.nn.functional.scaled_dot_product_attention, q, k, v,
                scale=head_dim**-0.5, is_causal=True, enable_gqa=True)), 2)
        except (RuntimeError, TypeError) as exc:
            record["sdpa_error"] = str(exc).splitlines()[0][:120]
        timings = {n: t for n, t in latencies.items() if isinstance(t, float)}
        # "default": the launcher with no override (choose_prefill_config), as the executor
        # runs it.
        record["default"] = "r{}_n{}_w{}".format(*choose_prefill_config(head_dim, dtype))
        record["default_latency_us_p50"] = round(timed(functools.partial(
            paged_prefill_attention_triton, query, key_cache, value_cache, tables, starts,
            seq_lens, head_dim**-0.5, out=out, max_query_len=q_len)), 2)
        if timings:
            best = min(timings, key=timings.get)
            record.update(best=best, best_latency_us_p50=timings[best])
            if "sdpa_latency_us_p50" in record:
                record["best_vs_sdpa_ratio"] = round(
                    timings[best] / record["sdpa_latency_us_p50"], 3)
        emit(record)
        del key_cache, value_cache, k, v, q, query, out
        if device.type == "cuda":
            torch.cuda.empty_cache()
