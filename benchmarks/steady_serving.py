"""A server whose streams end and start all the time (issue 15): `pagedserve serve` with
`--concurrency` clients, each starting its next request as soon as one ends, so most steps
compute a new prompt's chunk beside the running decodes — the steps an executor replays as
graph pieces cut at the attention calls (executor/mixed_graphs.py). The same workload twice:
with the pieces (the default) and with `PAGEDSERVE_MIXED_GRAPHS=0` in the executors'
environment (those steps eager, as before the pieces).

Requests: `--num-prompts` random token-id prompts (lengths uniform in `--input-range`),
outputs uniform in `--output-range` (greedy, EOS ignored), seeded; 8 warm-up requests first.

Cases (JSON lines, DESIGN §8): `steady_pieces`, `steady_eager` (output tok/s, TTFT, TPOT and
ITL percentiles, failures), `summary` (`pieces_vs_eager_ratio` of output tok/s).

    python benchmarks/steady_serving.py --model-dir DIR [--concurrency 128]
        [--num-prompts 768] [--small]

`--small`: CPU, float32, 16 short requests (the script, not a GPU: on a CPU there are no
graphs, so both runs are eager).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from serve_process import bench_on_server  # noqa: E402

BENCH = "steady_serving"
WARMUP = 8
FIGURES = ("output_throughput_tok_per_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50",
           "tpot_ms_p99", "itl_ms_p50", "itl_ms_p99", "duration_s", "completed", "failed")


def emit(case: str, **figures) -> None:
    print(json.dumps({"bench": BENCH, "case": case, **figures}), flush=True)


def make_requests(n: int, input_range: tuple[int, int], output_range: tuple[int, int],
                  vocab: int, seed: int):
    from pagedserve.bench import BenchRequest

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = rng.integers(3, vocab, size=int(rng.integers(*input_range, endpoint=True)))
        out.append(BenchRequest(None, tuple(prompt.tolist()),
                                int(rng.integers(*output_range, endpoint=True)), len(prompt)))
    return out


def run(args, requests, warmup, env: dict, log_name: str) -> dict:
    log = Path(args.log_dir or tempfile.mkdtemp()) / log_name
    return bench_on_server(args.model_dir, log, requests, warmup, dtype=args.dtype,
                           max_num_seqs=args.concurrency, small=args.small, env=env,
                           max_concurrency=args.concurrency)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--num-prompts", type=int, default=768)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--input-range", default="64,512", help="min,max prompt tokens")
    ap.add_argument("--output-range", default="32,256", help="min,max output tokens")
    ap.add_argument("--dtype", default=None, help="default bfloat16 (float32 with --small)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", default=None, help="the servers' logs go here")
    ap.add_argument("--small", action="store_true", help="CPU, few short requests")
    args = ap.parse_args(argv)
    if args.small:
        args.num_prompts, args.concurrency = 16, 4
        args.input_range, args.output_range = "8,40", "2,8"
    args.dtype = args.dtype or ("float32" if args.small else "bfloat16")
    input_range = tuple(int(x) for x in args.input_range.split(","))
    output_range = tuple(int(x) for x in args.output_range.split(","))
    requests = make_requests(args.num_prompts, input_range, output_range, 500, args.seed)
    warmup = make_requests(WARMUP, input_range, output_range, 500, args.seed + 1)
    expected = sum(r.max_tokens for r in requests)

    rates, ok = {}, True
    for case, env in (("steady_pieces", {}), ("steady_eager", {"PAGEDSERVE_MIXED_GRAPHS": "0"})):
        res = run(args, requests, warmup, env, f"{case}.log")
        case_ok = res["failed"] == 0 and res["total_output_tokens"] == expected
        ok &= case_ok
        rates[case] = res["output_throughput_tok_per_s"]
        emit(case, ok=case_ok, requests=len(requests), concurrency=args.concurrency,
             dtype=args.dtype, output_tokens=res["total_output_tokens"],
             **{k: res[k] for k in FIGURES if k in res})
    emit("summary", ok=ok, pieces_tok_per_s=rates["steady_pieces"],
         eager_tok_per_s=rates["steady_eager"],
         pieces_vs_eager_ratio=round(rates["steady_pieces"] / rates["steady_eager"], 3))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
