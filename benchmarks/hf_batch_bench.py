"""pagedserve against transformers' continuous batching (`generate_batch`) on the same GPU,
model and requests (issue 15; the GPU check's `throughput` stage runs it).

Requests: `--num-prompts` random token-id prompts (lengths uniform in `--input-range`,
seeded), each generating exactly `--output-len` tokens (greedy, EOS ignored on both sides:
`ignore_eos` for pagedserve; `eos_token_id` unset, which transformers turns into -1, for HF).

- pagedserve: `pagedserve serve --executors 1` on the device, bf16, `--max-num-seqs`
  the number of prompts; 8 warm-up requests (Triton compiles) first, then every request at
  once over gRPC streams (`pagedserve.bench.run_bench`). The server is stopped before HF runs.
- HF: the model loaded with transformers in this process (bf16, same device);
  `model.generate_batch(inputs, generation_config)` once on 8 prompts (warm-up), then on all.
  `wall` counts the whole call (the manager's own warm-up, e.g. CUDA graph capture,
  included); `active` counts from the first request's creation to the last one's end
  (GenerationOutput.created_time / lifespan), the figure the ratio uses.

Cases (JSON lines, DESIGN §8): `pagedserve`, `hf_generate_batch`, `summary`
(`pagedserve_vs_hf_ratio` = pagedserve output tok/s / HF active output tok/s).

    python benchmarks/hf_batch_bench.py --model-dir DIR [--num-prompts 256] [--small]
        [--api-workers N]

`--small`: CPU, float32, 8 short requests, no HF warm-up (checks the script, not a GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from serve_process import bench_on_server  # noqa: E402

BENCH = "hf_batch_bench"
WARMUP_PROMPTS = 8


def emit(case: str, **figures) -> None:
    print(json.dumps({"bench": BENCH, "case": case, **figures}), flush=True)


def make_prompts(n: int, input_range: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(input_range[0], input_range[1] + 1, size=n)
    return [rng.integers(3, vocab, size=int(k)).tolist() for k in lens]


def run_pagedserve(args, prompts: list[list[int]], warmup: list[list[int]]) -> dict:
    from pagedserve.bench import BenchRequest

    def reqs(ps):
        return [BenchRequest(None, tuple(p), args.output_len, len(p)) for p in ps]

    log = Path(args.log_dir or tempfile.mkdtemp()) / "hf_batch_bench_serve.log"
    return bench_on_server(args.model_dir, log, reqs(prompts), reqs(warmup), dtype=args.dtype,
                           max_num_seqs=max(len(prompts), WARMUP_PROMPTS), small=args.small,
                           extra=("--api-workers", str(args.api_workers)))


def run_hf(args, prompts: list[list[int]], warmup: list[list[int]]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    device = "cpu" if args.small else "cuda"
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype))
    model.to(device).eval()
    gen_cfg = GenerationConfig(max_new_tokens=args.output_len, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
    if not args.small:
        model.generate_batch(inputs=warmup, generation_config=gen_cfg, progress_bar=False)
    start = time.perf_counter()
    outputs = model.generate_batch(inputs=prompts, generation_config=gen_cfg,
                                   progress_bar=False, warmup=not args.small)
    wall = time.perf_counter() - start
    results = list(outputs.values())
    tokens = sum(len(r.generated_tokens) for r in results)
    errors = [r.error for r in results if r.error]
    first = min(r.created_time for r in results)
    last = max(r.lifespan[1] for r in results)
    active = last - first if last > first else wall
    return {"requests": len(results), "output_tokens": tokens, "wall_s": round(wall, 3),
            "output_tok_per_s": round(tokens / wall, 1), "active_s": round(active, 3),
            "active_tok_per_s": round(tokens / active, 1), "errors": len(errors),
            "first_error": errors[0][:200] if errors else None,
            "transformers": __import__("transformers").__version__}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-range", default="16,512", help="min,max prompt tokens")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default=None, help="default bfloat16 (float32 with --small)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", default=None, help="the server's log goes here")
    ap.add_argument("--api-workers", type=int, default=0,
                    help="the server's --api-workers (0: gRPC served by the router process)")
    ap.add_argument("--small", action="store_true", help="CPU, few short requests")
    args = ap.parse_args(argv)
    if args.small:
        args.num_prompts, args.input_range, args.output_len = 8, "8,40", 8
    args.dtype = args.dtype or ("float32" if args.small else "bfloat16")
    lo, hi = (int(x) for x in args.input_range.split(","))
    prompts = make_prompts(args.num_prompts, (lo, hi), 500, args.seed)
    warmup = make_prompts(WARMUP_PROMPTS, (lo, hi), 500, args.seed + 1)
    expected = len(prompts) * args.output_len

    ps = run_pagedserve(args, prompts, warmup)
    ps_ok = ps["failed"] == 0 and ps["total_output_tokens"] == expected
    ps_tok_s = ps["total_output_tokens"] / ps["duration_s"]
    emit("pagedserve", ok=ps_ok, requests=len(prompts), output_len=args.output_len,
         dtype=args.dtype, output_tokens=ps["total_output_tokens"], wall_s=ps["duration_s"],
         output_tok_per_s=round(ps_tok_s, 1), ttft_ms_p50=ps["ttft_ms_p50"],
         tpot_ms_p50=ps["tpot_ms_p50"], failed=ps["failed"], api_workers=args.api_workers)

    hf = run_hf(args, prompts, warmup)
    hf_ok = hf["errors"] == 0 and hf["output_tokens"] == expected
    emit("hf_generate_batch", ok=hf_ok, dtype=args.dtype, **hf)
    emit("summary", ok=ps_ok and hf_ok, pagedserve_tok_per_s=round(ps_tok_s, 1),
         hf_active_tok_per_s=hf["active_tok_per_s"], hf_wall_tok_per_s=hf["output_tok_per_s"],
         pagedserve_vs_hf_ratio=round(ps_tok_s / hf["active_tok_per_s"], 3),
         pagedserve_vs_hf_wall_ratio=round(ps_tok_s / hf["output_tok_per_s"], 3))
    print(f"pagedserve {ps_tok_s:.0f} tok/s; HF generate_batch {hf['active_tok_per_s']:.0f} "
          f"tok/s active ({hf['output_tok_per_s']:.0f} over the whole call)", file=sys.stderr)
    return 0 if ps_ok and hf_ok else 1


if __name__ == "__main__":
    sys.exit(main())
