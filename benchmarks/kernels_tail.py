"""kernels_bench.py's `--cases decode_tail`: the decode kernel at contexts that end inside a
tile, as a serving step's do, beside the whole-tile contexts kernels_bench's decode cases
use. Why: on the H200 (2026-11-27) the model's attention ran at 0.73 of copy bandwidth (batch
256, contexts 1,025-1,061, 44 us a layer) where kernels_bench's decode case at exactly 1,024
tokens ran at 0.82 (39 us): 1,061 tokens are eight 128-token tiles and a ninth for 37, read
in a masked loop of its own after the others.

Per shape (the Qwen2.5-0.5B attention, 14 q / 2 KV heads of 64; 32 q / 4 KV of 128), batch 64
and 256, contexts 1,024 and 4,096 (whole tiles) and 37 and 64 tokens past them, the
launcher's rule for splits and tiles, latencies (graph-timed, us):

  ``latency_us_p50``               the default launch (the tail in its own loop);
  ``every_tile_latency_us_p50``    ``mask_every_tile=True``: the tail in the loop of the whole
                                   tiles (decode_rules.MASK_EVERY_TILE);
  ``n64_latency_us_p50``, ``n64_every_tile_latency_us_p50``   the same with 64-token tiles
                                   (a smaller last tile: less of it wasted);
  ``copy_bw_ratio``                the default's K/V bytes / latency against the 1 GiB copy's
                                   bandwidth, as the decode cases;
  ``same_size_copy_gb_per_s``, ``copy_bw_ratio_same_size``   a device copy of the K/V's
                                   bytes, graph-timed like the kernel: the bandwidth a launch
                                   of this size reaches at all (the ceiling of the short
                                   kernels the decode target misses on).
"""

from __future__ import annotations

from kernels_tune import emit


def bench_decode_tail(torch, device, dtype, timed, copy_gb_per_s: float, dry_run: bool) -> None:
    from pagedserve.kernels.decode_attention import _num_sms, choose_num_splits
    from pagedserve.kernels.decode_attention import paged_decode_attention_triton as attend
    from pagedserve.kernels.testing import make_paged_batch

    if dry_run:
        shapes, batches, contexts = {"qwen2.5_0.5b": (14, 2, 64)}, (2,), (64, 101)
    else:
        shapes = {"qwen2.5_0.5b": (14, 2, 64), "gqa8_d128": (32, 4, 128)}
        batches, contexts = (64, 256), (1024, 1061, 1088, 4096, 4133)
    elem = torch.tensor([], dtype=dtype).element_size()
    for shape_name, (num_heads, num_kv_heads, head_dim) in shapes.items():
        for batch in batches:
            for context in contexts:
                b = make_paged_batch([(1, context)] * batch, num_kv_heads=num_kv_heads,
                                     group=num_heads // num_kv_heads, head_dim=head_dim,
                                     block_size=16, dtype=dtype, device=device, seed=1)
                args = (b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
                        b.scale)
                out = torch.empty_like(b.query)
                kv_bytes = 2 * batch * context * num_kv_heads * head_dim * elem

                def variant(block_n=None, every=False, args=args, out=out):
                    return lambda: attend(*args, out=out, block_n=block_n,
                                          mask_every_tile=every)

                record = {
                    "case": f"decode_tail/{shape_name}/b{batch}/ctx{context}",
                    "dtype": str(dtype).removeprefix("torch."),
                    "num_splits": choose_num_splits(batch, num_kv_heads, context,
                                                    _num_sms(device), head_dim)}
                for key, call in (("latency_us_p50", variant()),
                                  ("every_tile_latency_us_p50", variant(every=True)),
                                  ("n64_latency_us_p50", variant(64)),
                                  ("n64_every_tile_latency_us_p50", variant(64, True))):
                    record[key] = round(timed(call), 2)
                latency = record["latency_us_p50"]
                record["copy_bw_ratio"] = float(f"{kv_bytes / latency / 1e3 / copy_gb_per_s:.4g}")
                src = torch.empty(kv_bytes, dtype=torch.uint8, device=device)
                dst = torch.empty_like(src)
                copy_us = timed(lambda src=src, dst=dst: dst.copy_(src))
                same = 2 * kv_bytes / copy_us / 1e3  # read + write, as the 1 GiB copy
                record["same_size_copy_gb_per_s"] = float(f"{same:.4g}")
                record["copy_bw_ratio_same_size"] = float(f"{kv_bytes / latency / 1e3 / same:.4g}")
                emit(record)
                del b, args, out, src, dst
                if device.type == "cuda":
                    torch.cuda.empty_cache()


# Table widths of the ``decode_wide`` cases: the context's own, and what a decode graph's
# static tables have (cuda_graphs.py: the model's longest context; 2,048 16-token blocks
# for Qwen2.5's 32,768 tokens), from which the split rule counts its splits.
WIDE_TABLE_BLOCKS = 2048


def bench_decode_wide(torch, device, dtype, timed, dry_run: bool) -> None:
    """kernels_bench.py's `--cases decode_wide`: the decode kernel at a short context through
    a table as wide as a decode graph's. In a graph the split count comes from the table
    width, so at small batches a 1k context gets the splits of a 32k one (batch 8: 33 splits
    for 9 tiles, with the reduction in a second launch); the empty splits write no partial
    output and the reductions read only the splits with a tile (fifteenth session). Per
    batch (1, 8, 32, 64) at context 1,061, the Qwen2.5-0.5B attention shape: the rule's
    splits and latency (graph-timed, us) with the context's own table and with a
    2,048-block one, and their ratio: what a graph step's attention costs over an eager
    one's at that size."""
    from pagedserve.kernels.decode_attention import _num_sms, choose_num_splits
    from pagedserve.kernels.decode_attention import paged_decode_attention_triton as attend
    from pagedserve.kernels.testing import make_paged_batch

    num_heads, num_kv_heads, head_dim, block = 14, 2, 64, 16
    batches, context, wide = ((2,), 40, 64) if dry_run else ((1, 8, 32, 64), 1061,
                                                               WIDE_TABLE_BLOCKS)
    for batch in batches:
        record = {"case": f"decode_wide/qwen2.5_0.5b/b{batch}/ctx{context}",
                  "dtype": str(dtype).removeprefix("torch."), "table_blocks_wide": wide}
        for name, blocks in (("exact", -(-context // block)), ("wide", wide)):
            b = make_paged_batch([(1, context)] * batch, num_kv_heads=num_kv_heads,
                                 group=num_heads // num_kv_heads, head_dim=head_dim,
                                 block_size=block, dtype=dtype, device=device, seed=1,
                                 extra_table_columns=blocks - -(-context // block))
            args = (b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.scale)
            out = torch.empty_like(b.query)
            record[f"{name}_num_splits"] = choose_num_splits(
                batch, num_kv_heads, b.block_tables.shape[1] * block, _num_sms(device),
                head_dim)
            record[f"{name}_latency_us_p50"] = round(
                timed(lambda args=args, out=out: attend(*args, out=out)), 2)
            del b, args, out
        record["wide_vs_exact_ratio"] = round(
            record["wide_latency_us_p50"] / record["exact_latency_us_p50"], 3)
        emit(record)
        if device.type == "cuda":
            torch.cuda.empty_cache()
