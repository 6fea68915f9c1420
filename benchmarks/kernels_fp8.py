"""kernels_bench.py's `--cases decode_fp8`: the decode kernel on an fp8 KV cache
(`--kv-cache-dtype fp8`, kernels/kv_dtypes.py) beside the same launch on the bf16 cache.
An fp8 cache halves the bytes a decode step's attention reads; the question for a GPU is
how much of that the kernel turns into time, and which tile the rule should pick (the
fp8 tile of 64 tokens came from the sm_90 compile's register count, not a timing).

Per shape (the Qwen2.5-0.5B attention, 14 q / 2 KV heads of 64; 32 q / 4 KV of 128), batch 64
and 256, contexts 1,024 and 4,096, the launcher's split rule, bf16 queries (graph-timed, us):

  ``bf16_latency_us_p50``         the bf16 cache, the default launch;
  ``latency_us_p50``              the e4m3 cache, the default launch (64-token tiles);
  ``n128_latency_us_p50``, ``n128_s3_latency_us_p50``   the e4m3 cache with 128-token tiles
                                  at 2 and 3 stages (spills registers at head dim 64, sm_90);
  ``n32_latency_us_p50``          the e4m3 cache with 32-token tiles;
  ``e5m2_latency_us_p50``         the e5m2 cache, the default launch;
  ``speedup_vs_bf16_ratio``       bf16 / e4m3 default latency (2.0: every byte saved is time);
  ``copy_bw_ratio``               the e4m3 cache's K/V bytes / latency against the 1 GiB
                                  copy's bandwidth (the decode cases' measure).
"""

from __future__ import annotations

from kernels_tune import emit


def bench_decode_fp8(torch, device, dtype, timed, copy_gb_per_s: float, dry_run: bool) -> None:
    from pagedserve.kernels.decode_attention import _num_sms, choose_num_splits
    from pagedserve.kernels.decode_attention import paged_decode_attention_triton as attend
    from pagedserve.kernels.testing import make_paged_batch

    if dry_run:
        shapes, batches, contexts = {"qwen2.5_0.5b": (14, 2, 64)}, (2,), (101,)
    else:
        shapes = {"qwen2.5_0.5b": (14, 2, 64), "gqa8_d128": (32, 4, 128)}
        batches, contexts = (64, 256), (1024, 4096)
    for shape_name, (num_heads, num_kv_heads, head_dim) in shapes.items():
        for batch in batches:
            for context in contexts:
                record = {"case": f"decode_fp8/{shape_name}/b{batch}/ctx{context}",
                          "dtype": str(dtype).removeprefix("torch."),
                          "num_splits": choose_num_splits(batch, num_kv_heads, context,
                                                          _num_sms(device), head_dim)}
                for label, kv_dtype, launch in (
                        ("bf16_latency_us_p50", dtype, {}),
                        ("latency_us_p50", torch.float8_e4m3fn, {}),
                        ("n128_latency_us_p50", torch.float8_e4m3fn, {"block_n": 128}),
                        ("n128_s3_latency_us_p50", torch.float8_e4m3fn,
                         {"block_n": 128, "num_stages": 3}),
                        ("n32_latency_us_p50", torch.float8_e4m3fn, {"block_n": 32}),
                        ("e5m2_latency_us_p50", torch.float8_e5m2, {})):
                    b = make_paged_batch([(1, context)] * batch, num_kv_heads=num_kv_heads,
                                         group=num_heads // num_kv_heads, head_dim=head_dim,
                                         block_size=16, dtype=dtype, device=device, seed=1,
                                         kv_dtype=kv_dtype)
                    out = torch.empty_like(b.query)
                    args = (b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
                            b.scale)
                    try:
                        record[label] = round(timed(
                            lambda args=args, out=out, launch=launch: attend(
                                *args, out=out, **launch)), 2)
                    except Exception as exc:  # noqa: BLE001 - a configuration that fails
                        record[label.replace("latency_us_p50", "error")] = str(exc)[:200]
                    del b, args, out
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                latency = record.get("latency_us_p50")
                if latency:
                    kv_bytes = 2 * batch * context * num_kv_heads * head_dim  # one byte each
                    record["copy_bw_ratio"] = float(
                        f"{kv_bytes / latency / 1e3 / copy_gb_per_s:.4g}")
                    if record.get("bf16_latency_us_p50"):
                        record["speedup_vs_bf16_ratio"] = round(
                            record["bf16_latency_us_p50"] / latency, 3)
                emit(record)
