"""kernels_bench.py's `--cases sampling`: the sampler's kernels (kernels/sampling_ops.py) at the
Qwen2.5 vocabulary (151,936). ``argmax/...``: the greedy argmax of 16-bit logits (1 to 256
rows) against torch's. ``top_p/...``: the whole-row top-p threshold for a 256-row step, and
the sort it replaces. Rows are flat (every nucleus reaches past the sampler's first 256 tokens:
"unresolved"); `rows` of them are marked. The kernel is graph-timed (nothing read back);
the sort ("twin") needs a host read of which rows, so it is timed eagerly, read included:
what an overlapped step would wait. ``radixB_latency_us_p50``: the kernel with its search
cutting the key range into 2^B parts a pass (32 / B reads of each row), to choose
``sampling_ops.RADIX_BITS``; ``radixB_chunksC_latency_us_p50``: each row spread over C
programs, one launch a pass, to choose ``sampling_ops.TOP_P_CHUNKS`` (one unresolved row
costs one program's whole walk of its row otherwise: ~1 ms on an H200). ``draw/...``: the
keyed draw (softmax, min-p, inverse CDF: kernels/draw_ops.py, what every sampling row
ends with) on 1 to 256 rows at temperature 1, against the twin's passes it replaces
(``torch_latency_us_p50``: the twin over a fresh copy of the rows, less the copy's time),
both graph-timed; ``temperature_latency_us_p50``: the draw dividing the model's 16-bit
logits by the temperature itself (the sampler's rows without top-k or top-p), against
``divide_then_draw_latency_us_p50``, the division into a float32 buffer and the draw.
``top_p_parts/...``: what a top-p step spends before the draw, part by part."""

from __future__ import annotations

from kernels_tune import emit


def bench_sampling(torch, ops, device, dtype, timed, dry_run: bool) -> None:
    vocab = 600 if dry_run else 151_936
    for rows in (1, 4) if dry_run else (1, 8, 64, 256):
        logits = torch.randn(rows, vocab, device=device).to(dtype)
        kernel = timed(lambda logits=logits: ops.argmax_rows(logits, backend="triton"))
        twin = timed(lambda logits=logits: ops.argmax_rows(logits, backend="torch"))
        emit({"case": f"argmax/v{vocab}/r{rows}", "dtype": str(dtype).removeprefix("torch."),
              "latency_us_p50": round(kernel, 2), "torch_latency_us_p50": round(twin, 2),
              "gb_per_s": float(f"{logits.numel() * logits.element_size() / kernel / 1e3:.4g}"),
              "speedup_ratio": float(f"{twin / kernel:.3g}")})  # (tiny in the interpreter)
    bench_draw(torch, ops, device, dtype, timed, dry_run)  # before top-p's long sweep
    bench_top_p_parts(torch, device, timed, dry_run)
    bench_top_p(torch, ops, device, timed, dry_run)


def bench_top_p_parts(torch, device, timed, dry_run: bool) -> None:
    """What a top-p step spends before the draw (executor/sampler.py top_p_thresholds),
    part by part, at 256 rows: the rows' log-sum-exp, their best 256 tokens (torch's topk),
    the threshold from those (the whole-row kernel for rows past their best 256 is timed by
    bench_top_p), and the fill of what falls below it, which a GPU no longer writes (the
    draw applies the threshold as it reads: what that saves)."""
    from pagedserve.kernels import reference

    num_rows, vocab = (4, 600) if dry_run else (256, 151_936)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(num_rows, vocab, generator=gen, device=device) * 2.0
    scratch = torch.empty_like(x)
    lse = torch.logsumexp(x, -1, keepdim=True)
    desc = x.topk(256, dim=-1).values
    top_p = torch.full((num_rows,), 0.9, device=device)
    thresholds, _ = reference.top_p_threshold(desc, lse, top_p)
    copy = timed(lambda: scratch.copy_(x))
    emit({"case": f"top_p_parts/v{vocab}/r{num_rows}",
          "logsumexp_latency_us_p50": round(timed(
              lambda: torch.logsumexp(x, -1, keepdim=True)), 2),
          "topk256_latency_us_p50": round(timed(lambda: x.topk(256, dim=-1)), 2),
          "threshold_of_256_latency_us_p50": round(timed(
              lambda: reference.top_p_threshold(desc, lse, top_p)), 2),
          "masked_fill_latency_us_p50": round(timed(lambda: scratch.copy_(x).masked_fill_(
              scratch < thresholds, float("-inf"))) - copy, 2)})


def bench_draw(torch, ops, device, dtype, timed, dry_run: bool) -> None:
    vocab = 600 if dry_run else 151_936
    for rows in (1, 4) if dry_run else (1, 8, 64, 256):
        gen = torch.Generator(device=device).manual_seed(rows)
        x = torch.randn(rows, vocab, generator=gen, device=device) * 2.0
        scratch = torch.empty_like(x)
        u = torch.rand(rows, generator=gen, device=device, dtype=torch.float64)
        kernel = timed(lambda x=x, u=u: ops.keyed_draw_(x, None, u, backend="triton"))
        copy = timed(lambda x=x, s=scratch: s.copy_(x))
        twin = timed(lambda x=x, u=u, s=scratch: ops.keyed_draw_(s.copy_(x), None, u,
                                                                 backend="torch"))
        # The sampler's temperature-only rows: the model's 16-bit logits divided inside
        # the draw, against the division into a float32 buffer and the draw over it.
        logits = (x * 3.0).to(dtype)
        temps = torch.full((rows,), 0.8, device=device)
        folded = timed(lambda lg=logits, u=u, t=temps: ops.keyed_draw_(
            lg, None, u, temperature=t, backend="triton"))
        divided = timed(lambda lg=logits, u=u, t=temps, s=scratch: ops.keyed_draw_(
            torch.div(lg, t.unsqueeze(1), out=s), None, u, backend="triton"))
        emit({"case": f"draw/v{vocab}/r{rows}", "latency_us_p50": round(kernel, 2),
              "torch_latency_us_p50": round(twin - copy, 2),
              "gb_per_s": float(f"{2 * x.numel() * x.element_size() / kernel / 1e3:.4g}"),
              "speedup_ratio": float(f"{(twin - copy) / kernel:.3g}"),
              "logits_dtype": str(dtype).removeprefix("torch."),
              "temperature_latency_us_p50": round(folded, 2),
              "divide_then_draw_latency_us_p50": round(divided, 2)})


def bench_top_p(torch, ops, device, timed, dry_run: bool) -> None:
    from pagedserve.kernels.reference import EXP_FLOOR
    from pagedserve.kernels.sampling_ops import RADIX_BITS, top_p_thresholds_triton

    num_rows, vocab = (4, 600) if dry_run else (256, 151_936)
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(num_rows, vocab, generator=gen, device=device) * 0.5
    lse = torch.logsumexp(logits, -1, keepdim=True)
    top_p = torch.full((num_rows,), 0.9, device=device)
    thresholds = torch.zeros(num_rows, 1, device=device)
    for marked in sorted({0, 1, min(8, num_rows), num_rows}):
        unresolved = torch.zeros(num_rows, dtype=torch.bool, device=device)
        unresolved[:marked] = True
        record = {"case": f"top_p/v{vocab}/r{num_rows}/unresolved{marked}", "rows": num_rows,
                  "vocab": vocab, "unresolved": marked, "default_radix_bits": RADIX_BITS}
        record["kernel_latency_us_p50"] = round(timed(
            lambda u=unresolved: ops.top_p_thresholds_(logits, lse, top_p, thresholds, u,
                                                       backend="triton")), 2)
        for bits in (1, 2, 4) if marked else ():  # the search's radix (default RADIX_BITS)
            record[f"radix{bits}_latency_us_p50"] = round(timed(
                lambda u=unresolved, bits=bits: top_p_thresholds_triton(
                    logits, lse, top_p, thresholds, u, EXP_FLOOR, radix_bits=bits,
                    chunks=1)), 2)
        # Each row over `chunks` programs, one launch a pass (TOP_P_CHUNKS, default 1):
        # radix 2 and 4, timed in a graph (the launches' host time not counted; it is
        # 32 / bits + 2 launches eagerly).
        for bits, chunks in (((2, 2),) if dry_run else ((2, 16), (2, 64), (4, 16), (4, 64),
                                                        (4, 256))) if marked else ():
            record[f"radix{bits}_chunks{chunks}_latency_us_p50"] = round(timed(
                lambda u=unresolved, bits=bits, chunks=chunks: top_p_thresholds_triton(
                    logits, lse, top_p, thresholds, u, EXP_FLOOR, radix_bits=bits,
                    chunks=chunks)), 2)
        if marked:
            record["sort_latency_us_p50"] = round(timed(
                lambda u=unresolved: ops.top_p_thresholds_(logits, lse, top_p, thresholds, u,
                                                           backend="torch"), graph=False), 2)
        emit(record)
