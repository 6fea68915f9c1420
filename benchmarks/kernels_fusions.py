"""kernels_bench.py's `--cases decode_rope`: a decode step's rotary embedding and new-token
cache write inside the attention launch (decode_attention's ``rope``, the model's
PAGEDSERVE_DECODE_FUSED_ROPE) against the two launches it replaces (rotary_and_cache, then
the attention), at the Qwen2.5-0.5B shape (14 q / 2 KV heads of 64) for batch 64 and 256 at
context 1k. On the H200 (2026-11-27 trace) the rotary-and-cache launch took 2.1 us a layer, 51 us a
step: ``saved_us`` is what fusing saves a layer, ``x24`` a step."""

from __future__ import annotations

from kernels_tune import emit


def _launches(inputs):
    """(fused, two launches) over ``inputs`` (kernels.testing.rope_decode_inputs)."""
    import torch
    from pagedserve.kernels import ops
    from pagedserve.kernels.decode_attention import paged_decode_attention_triton

    batch, q, k, v, cos_sin, slots = inputs
    kc, vc = batch.key_cache, batch.value_cache
    attend = (batch.block_tables, batch.seq_lens, batch.scale)
    out = torch.empty_like(q)

    def fused():
        paged_decode_attention_triton(q, kc, vc, *attend, out=out,
                                      rope=(k, v, cos_sin, slots))

    def two_launches():
        # (rotates q and k in place each call: the timing, not the values, matters)
        ops.rotary_embedding_and_cache(q, k, v, cos_sin, kc, vc, slots, backend="triton")
        paged_decode_attention_triton(q, kc, vc, *attend, out=out)

    return fused, two_launches


def bench_decode_rope(torch, device, dtype, timed, dry_run: bool) -> None:
    from pagedserve.kernels.testing import rope_decode_inputs

    context = 40 if dry_run else 1024
    for batch in (2,) if dry_run else (64, 256):
        inputs = rope_decode_inputs(2, 7, 64, dtype, [(1, context)] * batch, device)
        fused, two_launches = _launches(inputs)
        one, two = timed(fused), timed(two_launches)
        emit({"case": f"decode_rope/qwen2.5_0.5b/b{batch}/ctx{context}",
              "dtype": str(dtype).removeprefix("torch."), "latency_us_p50": round(one, 2),
              "two_launches_latency_us_p50": round(two, 2),
              "saved_us": round(two - one, 2), "saved_us_x24": round(24 * (two - one), 1)})
