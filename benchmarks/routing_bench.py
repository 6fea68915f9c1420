"""Routing policies on a shared-prefix workload: `--routing prefix` vs `round-robin` vs
`least-loaded`, 2 CPU executors (one torch thread each), one fresh cluster per policy.

Workload (`pagedserve.bench`'s shared-prefix dataset, seeded, the same for every policy):
--tenants system prompts of --prefix-len tokens, --questions-per-tenant unique questions of
--question-len tokens each, tenants interleaved, Poisson arrivals at --request-rate, greedy,
EOS ignored. Each executor gets --num-gpu-blocks device blocks: chosen so that one executor
holds the prefixes of about two thirds of the tenants (with room for the running requests),
both together hold all of them. Prefix routing can keep each tenant on one executor; the other
policies spread every tenant over both, so each executor must cache every tenant.

Per policy one JSON line: TTFT p50/p90, e2e p50, output tok/s, prefix hit ratio (from the
router's /metrics), and per executor the prompt tokens looked up and hit (the load split).
A `summary` line: round-robin TTFT p50 / prefix TTFT p50 (target >= 2).

    .venv/bin/python benchmarks/routing_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pagedserve.bench import BenchConfig, run_bench, sample_requests  # noqa: E402
from pagedserve.subprocs import stop_process  # noqa: E402

BENCH = "routing_bench"
READY = re.compile(r"pagedserve ready grpc=(\S+) metrics=(\S+) executors=(\d+)")
POLICIES = ("prefix", "round-robin", "least-loaded")


def emit(case: str, **figures) -> None:
    print(json.dumps({"bench": BENCH, "case": case, **figures}), flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def per_executor_prefix(metrics_address: str) -> dict[str, list[int]]:
    """{executor: [queried tokens, hit tokens]} from /metrics."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, list[int]] = {}
    pat = re.compile(r'^pagedserve_prefix_cache_(queries|hits)_total\{executor="([^"]+)"\}'
                     r"\s+(\S+)")
    for line in text.splitlines():
        m = pat.match(line)
        if m:
            slot = out.setdefault(m.group(2), [0, 0])
            slot[0 if m.group(1) == "queries" else 1] += int(float(m.group(3)))
    return out


class ServeCluster:
    def __init__(self, model_dir: Path, policy: str, num_gpu_blocks: int) -> None:
        self.cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--model", str(model_dir),
                    "--executors", "2", "--routing", policy, "--port", "0",
                    "--metrics-port", "0", "--cpu-threads", "1",
                    "--executor-bind", f"tcp://127.0.0.1:{free_port()}",
                    "--num-gpu-blocks", str(num_gpu_blocks), "--swap-space", "0"]
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in __exit__
        self.proc: subprocess.Popen | None = None
        self.address = self.metrics_address = ""

    def __enter__(self) -> ServeCluster:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     text=True, env=env, cwd=ROOT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.proc.poll() is None:
            self.log.seek(0)
            m = READY.search(self.log.read())
            if m:
                self.address, self.metrics_address = m.group(1), m.group(2)
                return self
            time.sleep(0.2)
        self.log.seek(0)
        raise RuntimeError("pagedserve serve did not start:\n" + self.log.read()[-3000:])

    def __exit__(self, *exc) -> None:
        stop_process(self.proc)
        self.log.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 4 tenants x 3 questions")
    p.add_argument("--tenants", type=int, default=16)
    p.add_argument("--prefix-len", type=int, default=768)
    p.add_argument("--questions-per-tenant", type=int, default=6)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len-range", default="16:32")
    p.add_argument("--request-rate", type=float, default=4.0)
    p.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="per executor; default: prefixes of 2/3 of the tenants + 40 blocks")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.quick:
        args.tenants, args.questions_per_tenant, args.prefix_len = 4, 3, 128
        args.request_rate = 8.0
    lo, hi = (int(x) for x in args.output_len_range.split(":"))
    block_size = 16
    prefix_blocks = -(-args.prefix_len // block_size)
    num_gpu_blocks = args.num_gpu_blocks or (prefix_blocks * (2 * args.tenants) // 3 + 40)

    from pagedserve.models import resolve_model
    model_dir = resolve_model("tiny")  # the random-weight model: offline, fast, same figures
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    cfg = BenchConfig(address="", dataset="shared-prefix", seed=args.seed,
                      num_prompts=args.tenants * args.questions_per_tenant,
                      tenants=args.tenants, prefix_len=args.prefix_len,
                      questions_per_tenant=args.questions_per_tenant,
                      question_len=args.question_len, output_len_range=(lo, hi),
                      request_rate=args.request_rate, progress=False,
                      timeout_s=600.0)
    requests = sample_requests(cfg, vocab)
    print(f"--model tiny; {len(requests)} requests ({args.tenants} tenants x "
          f"{args.questions_per_tenant}), prefix {args.prefix_len} + question "
          f"{args.question_len} tokens, output {lo}-{hi}, {args.request_rate} req/s Poisson; "
          f"2 executors x {num_gpu_blocks} blocks (all prefixes: "
          f"{prefix_blocks * args.tenants} blocks)", file=sys.stderr)

    results = {}
    for policy in args.policies.split(","):
        with ServeCluster(model_dir, policy, num_gpu_blocks) as cluster:
            run_cfg = BenchConfig(**{**cfg.__dict__, "address": cluster.address,
                                     "metrics_address": cluster.metrics_address})
            res = asyncio.run(run_bench(run_cfg, requests))
            split = per_executor_prefix(cluster.metrics_address)
            cluster.log.seek(0)
            rejected = [x for x in cluster.log.read().splitlines() if "rejected" in x]
        if rejected:
            print("the server rejected messages (see its log):\n"
                  + "\n".join(rejected[:3]), file=sys.stderr)
        results[policy] = res
        fig = dict(policy=policy, completed=res["completed"], failed=res["failed"],
                   ttft_ms_p50=res["ttft_ms_p50"], ttft_ms_p90=res["ttft_ms_p90"],
                   ttft_ms_mean=res["ttft_ms_mean"], e2e_ms_p50=res["e2e_ms_p50"],
                   tpot_ms_p50=res["tpot_ms_p50"], duration_s=res["duration_s"],
                   output_tok_per_s=res["output_throughput_tok_per_s"],
                   total_tok_per_s=res["total_token_throughput_tok_per_s"],
                   prefix_hit_ratio=res["prefix_hit_ratio"],
                   per_executor_queried_hit_tokens=[v for _, v in sorted(split.items())],
                   num_gpu_blocks=num_gpu_blocks)
        emit(policy, **fig)
        print(f"{policy:>13}: TTFT p50 {res['ttft_ms_p50']:.0f} ms p90 "
              f"{res['ttft_ms_p90']:.0f} ms, {res['output_throughput_tok_per_s']:.0f} out "
              f"tok/s, hit {res['prefix_hit_ratio']:.3f}, per executor [queried, hit] "
              f"{fig['per_executor_queried_hit_tokens']}", file=sys.stderr)
    if "prefix" in results and "round-robin" in results:
        ratio = results["round-robin"]["ttft_ms_p50"] / results["prefix"]["ttft_ms_p50"]
        emit("summary", ttft_p50_rr_over_prefix_ratio=round(ratio, 2), target_ratio=2.0,
             met=ratio >= 2.0)
        print(f"round-robin / prefix TTFT p50: {ratio:.2f}x (target 2x)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
