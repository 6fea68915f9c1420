"""Routing policies on a real cluster: `--routing prefix` vs `round-robin` vs `least-loaded`,
2 CPU executors (one torch thread each) of the random-weight `tiny` model, one fresh
`pagedserve serve` cluster per (case, policy), the same seeded requests for every policy.

Cases (`--cases`, default all; every one is reported):

* `exceeds-one` (issue 14's target case): 12 tenants with 1,024-token system prompts and
  10 questions each (32 tokens, output 16-32), tenants interleaved, 12 requests in flight at
  all times (as many as tenants); each executor gets the prefixes of 2/3 of the tenants + 40
  blocks (552), so the tenants' prefixes (768 blocks) exceed one executor's cache and fit in
  both. Target: prefix hit ratio >= 0.8 and TTFT p50 >= 2x better than round-robin.
* `zipf`: 16 tenants with 768-token prefixes, tenant of each request Zipf-popular (s 1.1),
  128 requests, Poisson 6 req/s; 2/3-of-the-prefixes + 40 blocks per executor (552).
* `multi-turn`: 24 chats (Poisson 1.5 chats/s), 4 turns each; a chat starts from one of 4
  system prompts (512 tokens) and each turn's prompt is the previous prompt + the answer
  (32-64 tokens, as generated) + a new user message (32-96 tokens); 0.5 s (exponential mean)
  between an answer and the next turn; 320 blocks per executor (the live chats' contexts
  exceed one executor's cache).
* `legacy-16x768`: the previous default workload, unchanged: `pagedserve.bench`'s
  shared-prefix dataset, 16 tenants x 6 questions, prefix 768 + question 32, output 16-32,
  Poisson 4 req/s, 552 blocks per executor.
* `legacy-12x384`: the default before that (issue 14: "the old one gave 1.23x"), unchanged:
  12 tenants x 8, prefix 384, 232 blocks per executor, otherwise as legacy-16x768.

Policies: `prefix`, `round-robin`, `least-loaded` (`--swap-space 0`, as every run before
prefix pulls), and any of them with `+pull` (`--kv-pull auto`: router/prefix_pull.py) or
`+swap` (its control), both with PULL_SWAP_SPACE_GIB of CPU blocks per executor.

Per (case, policy) one JSON line: TTFT p50/p90/p99, e2e p50, output tok/s, the router's
prefix hit ratio (/metrics: prompt tokens looked up at each admission, hits among them),
the usage hit ratio (Usage.cached_prompt_tokens / prompt tokens), the infinite-cache bound
(each distinct prompt block misses once in the cluster; `routing_sim.infinite_bound`), and
per executor the prompt tokens looked up and hit (the load split), prefix pulls and the blocks
they brought (a pulled block counts as a hit where it lands). Per case a `summary` line:
round-robin TTFT p50 / prefix TTFT p50 (and the target flags for `exceeds-one`).

    .venv/bin/python benchmarks/routing_bench.py [--cases a,b] [--policies ...] [--quick]
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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from routing_sim import Record, infinite_bound  # noqa: E402

from pagedserve.bench import (  # noqa: E402
    BenchConfig,
    BenchRequest,
    RequestOutcome,
    read_prefix_counters,
    run_bench,
    sample_requests,
    summarise,
)
from pagedserve.subprocs import stop_process  # noqa: E402

BENCH = "routing_bench"
READY = re.compile(r"pagedserve ready grpc=(\S+) metrics=(\S+) executors=(\d+)")
POLICIES = ("prefix", "round-robin", "least-loaded")
# `--policies` also takes POLICY+pull (`--kv-pull auto`, router/prefix_pull.py) and
# POLICY+swap (its control: the same CPU blocks, no pulls), each with this much swap space
# per executor (the pulled blocks land in CPU blocks; it also lets preemption swap)
PULL_SWAP_SPACE_GIB = 0.25
BLOCK_SIZE = 16
TARGET_CASE = "exceeds-one"
TARGET_HIT_RATIO = 0.8
TARGET_TTFT_RATIO = 2.0


@dataclass(frozen=True)
class Case:
    """One workload. `kind`: `shared-prefix` (pagedserve.bench's dataset), `zipf` or `chat`."""

    name: str
    kind: str
    tenants: int
    prefix_len: int
    num_gpu_blocks: int
    questions_per_tenant: int = 0  # shared-prefix
    num_requests: int = 0  # zipf: requests; chat: chats
    question_len: tuple[int, int] = (32, 32)
    output_len: tuple[int, int] = (16, 32)
    request_rate: float = float("inf")  # requests/s (chat: chats/s), Poisson
    max_concurrency: int | None = None
    zipf_s: float = 0.0
    turns: int = 0
    think_s: float = 0.0


def _two_thirds_plus_40(tenants: int, prefix_len: int) -> int:
    """Device blocks per executor: the prefixes of 2/3 of the tenants + 40 blocks (room for the
    running requests): one executor cannot hold every prefix, two can."""
    return -(-prefix_len // BLOCK_SIZE) * (2 * tenants) // 3 + 40


CASES: dict[str, Case] = {c.name: c for c in (
    Case("exceeds-one", "shared-prefix", tenants=12, prefix_len=1024,
         num_gpu_blocks=_two_thirds_plus_40(12, 1024), questions_per_tenant=10,
         max_concurrency=12),
    Case("zipf", "zipf", tenants=16, prefix_len=768,
         num_gpu_blocks=_two_thirds_plus_40(16, 768), num_requests=128, request_rate=6.0,
         zipf_s=1.1),
    Case("multi-turn", "chat", tenants=4, prefix_len=512, num_gpu_blocks=320,
         num_requests=24, question_len=(32, 96), output_len=(32, 64), request_rate=1.5,
         turns=4, think_s=0.5),
    Case("legacy-16x768", "shared-prefix", tenants=16, prefix_len=768,
         num_gpu_blocks=_two_thirds_plus_40(16, 768), questions_per_tenant=6,
         request_rate=4.0),
    Case("legacy-12x384", "shared-prefix", tenants=12, prefix_len=384,
         num_gpu_blocks=_two_thirds_plus_40(12, 384), questions_per_tenant=8,
         request_rate=4.0),
)}
QUICK = Case("quick", "shared-prefix", tenants=4, prefix_len=128,
             num_gpu_blocks=_two_thirds_plus_40(4, 128), questions_per_tenant=3,
             request_rate=8.0)


def emit(case: str, **figures) -> None:
    print(json.dumps({"bench": BENCH, "case": case, **figures}), flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics(metrics_address: str) -> str:
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as r:
        return r.read().decode()


def pull_counts(metrics_address: str) -> tuple[int, int]:
    """(prefix pulls, KV blocks received) over the executors, from /metrics."""
    text = _metrics(metrics_address)
    total = []
    for name in ("pagedserve_kv_pulls_total", "pagedserve_kv_blocks_received_total"):
        total.append(int(sum(float(v) for v in re.findall(
            rf'^{name}\{{[^}}]*\}}\s+(\S+)', text, re.M))))
    return total[0], total[1]


def per_executor_prefix(metrics_address: str) -> dict[str, list[int]]:
    """{executor: [queried tokens, hit tokens]} from /metrics."""
    text = _metrics(metrics_address)
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
        routing, _, variant = policy.partition("+")
        extra = ["--swap-space", "0"]  # (the policies' runs before prefix pulls: no CPU blocks)
        if variant:  # CPU blocks to receive pulled blocks into; "+swap": the same, no pulls
            extra = ["--swap-space", str(PULL_SWAP_SPACE_GIB)]
            if variant == "pull":
                extra += ["--kv-pull", "auto"]
        self.cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--model", str(model_dir),
                    "--executors", "2", "--routing", routing, "--port", "0",
                    "--metrics-port", "0", "--http-port", "-1", "--cpu-threads", "1",
                    "--executor-bind", f"tcp://127.0.0.1:{free_port()}",
                    "--num-gpu-blocks", str(num_gpu_blocks), *extra]
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


# ====================================================================== workloads


def base_config(case: Case, seed: int) -> BenchConfig:
    return BenchConfig(address="", dataset="shared-prefix", seed=seed,
                       num_prompts=case.tenants * case.questions_per_tenant,
                       tenants=case.tenants, prefix_len=case.prefix_len,
                       questions_per_tenant=case.questions_per_tenant,
                       question_len=case.question_len[0], output_len_range=case.output_len,
                       request_rate=case.request_rate, max_concurrency=case.max_concurrency,
                       progress=False, timeout_s=600.0)


def zipf_requests(case: Case, vocab: int, seed: int) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(3, vocab, case.prefix_len).tolist() for _ in range(case.tenants)]
    weights = 1.0 / np.arange(1, case.tenants + 1) ** case.zipf_s
    tenants = rng.choice(case.tenants, size=case.num_requests, p=weights / weights.sum())
    reqs = []
    for t in tenants.tolist():
        ids = tuple(prefixes[t] + rng.integers(3, vocab, case.question_len[0]).tolist())
        out = int(rng.integers(case.output_len[0], case.output_len[1] + 1))
        reqs.append(BenchRequest(None, ids, out, len(ids)))
    return reqs


@dataclass
class ChatPlan:
    start_s: float
    system: list[int]
    messages: list[list[int]]
    outputs: list[int]
    think_s: list[float]


def chat_plans(case: Case, vocab: int, seed: int) -> list[ChatPlan]:
    rng = np.random.default_rng(seed)
    systems = [rng.integers(3, vocab, case.prefix_len).tolist() for _ in range(case.tenants)]
    plans, t = [], 0.0
    for _ in range(case.num_requests):
        t += float(rng.exponential(1.0 / case.request_rate))
        lo, hi = case.question_len
        plans.append(ChatPlan(
            start_s=t, system=systems[int(rng.integers(case.tenants))],
            messages=[rng.integers(3, vocab, int(rng.integers(lo, hi + 1))).tolist()
                      for _ in range(case.turns)],
            outputs=[int(rng.integers(case.output_len[0], case.output_len[1] + 1))
                     for _ in range(case.turns)],
            think_s=[float(rng.exponential(case.think_s)) for _ in range(case.turns)]))
    return plans


async def stream_ids(stub, pb, ids: list[int], max_tokens: int, seed: int,
                     outcome: RequestOutcome) -> list[int]:
    """One greedy streamed request; fills `outcome` as pagedserve.bench does and returns the
    generated token ids."""
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                               seed=seed)
    msg = pb.GenerateRequest(params=params)
    msg.prompt_token_ids.ids.extend(ids)
    tokens: list[int] = []
    start = time.perf_counter()
    async for chunk in stub.Stream(msg, timeout=600.0):
        if chunk.token_ids:
            outcome.record_tokens(len(chunk.token_ids), start)
            tokens.extend(chunk.token_ids)
        if chunk.HasField("usage"):
            outcome.prompt_tokens = chunk.usage.prompt_tokens
            outcome.cached_prompt_tokens = chunk.usage.cached_prompt_tokens
    outcome.e2e_s = time.perf_counter() - start
    outcome.ok = outcome.last_token_at is not None
    return tokens


async def run_chats(address: str, metrics_address: str, plans: list[ChatPlan],
                    seed: int) -> tuple[dict, list[Record]]:
    import grpc
    from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
    from pagedserve.protos.generated.pagedserve.v1 import generate_pb2_grpc as pb_grpc

    outcomes: list[RequestOutcome] = []
    records: list[Record] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        await stub.GetModelInfo(pb.ModelInfoRequest(), timeout=15, wait_for_ready=True)
        before = read_prefix_counters(metrics_address)
        t0 = time.perf_counter()

        async def chat(plan: ChatPlan) -> None:
            await asyncio.sleep(plan.start_s)
            history = list(plan.system)
            for k, message in enumerate(plan.messages):
                ids = history + message
                out = RequestOutcome(prompt_tokens=len(ids))
                outcomes.append(out)
                try:
                    answer = await stream_ids(stub, pb, ids, plan.outputs[k], seed, out)
                except grpc.aio.AioRpcError as exc:
                    out.error = f"{exc.code().name}: {exc.details()}"
                    return
                records.append(Record(f"{id(plan)}.{k}", time.perf_counter() - t0, ids,
                                      output=answer))
                history = ids + answer
                await asyncio.sleep(plan.think_s[k])

        await asyncio.gather(*(chat(p) for p in plans))
        duration = time.perf_counter() - t0
        after = read_prefix_counters(metrics_address)
    res = summarise(outcomes, duration, (after[0] - before[0], after[1] - before[1]))
    return res, records


# ====================================================================== driver


def run_case(case: Case, policy: str, model_dir: Path, vocab: int, seed: int) -> dict:
    with ServeCluster(model_dir, policy, case.num_gpu_blocks) as cluster:
        if case.kind == "chat":
            res, records = asyncio.run(run_chats(cluster.address, cluster.metrics_address,
                                                 chat_plans(case, vocab, seed), seed))
            records.sort(key=lambda r: r.arrival)
        else:
            cfg = base_config(case, seed)
            if case.kind == "zipf":
                requests = zipf_requests(case, vocab, seed)
                cfg.num_prompts = len(requests)
            else:
                requests = sample_requests(cfg, vocab)
            run_cfg = BenchConfig(**{**cfg.__dict__, "address": cluster.address,
                                     "metrics_address": cluster.metrics_address})
            res = asyncio.run(run_bench(run_cfg, requests))
            records = [Record(str(i), float(i), list(r.prompt_token_ids))
                       for i, r in enumerate(requests)]
        split = per_executor_prefix(cluster.metrics_address)
        pulls, blocks_received = pull_counts(cluster.metrics_address)
        cluster.log.seek(0)
        rejected = [x for x in cluster.log.read().splitlines() if "rejected" in x]
    if rejected:
        print("the server rejected messages (see its log):\n" + "\n".join(rejected[:3]),
              file=sys.stderr)
    prompt_tokens = sum(len(r.prompt) for r in records)
    bound = infinite_bound(records)
    return dict(
        policy=policy, completed=res["completed"], failed=res["failed"],
        ttft_ms_p50=res["ttft_ms_p50"], ttft_ms_p90=res["ttft_ms_p90"],
        ttft_ms_p99=res["ttft_ms_p99"], ttft_ms_mean=res["ttft_ms_mean"],
        e2e_ms_p50=res["e2e_ms_p50"], tpot_ms_p50=res["tpot_ms_p50"],
        duration_s=res["duration_s"], output_tok_per_s=res["output_throughput_tok_per_s"],
        total_tok_per_s=res["total_token_throughput_tok_per_s"],
        prefix_hit_ratio=res["prefix_hit_ratio"],
        usage_hit_ratio=round(res["cached_prompt_tokens"] / max(res["total_input_tokens"], 1),
                              4),
        bound_hit_ratio=round(bound / max(prompt_tokens, 1), 4),
        per_executor_queried_hit_tokens=[v for _, v in sorted(split.items())],
        num_gpu_blocks=case.num_gpu_blocks, pulls=pulls, blocks_received=blocks_received,
        errors=res.get("errors", []),
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--quick", action="store_true", help="smoke run: 4 tenants x 3, prefix 128")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    cases = [QUICK] if args.quick else [CASES[n] for n in args.cases.split(",") if n]
    policies = [x for x in args.policies.split(",") if x]

    from pagedserve.models import resolve_model
    model_dir = resolve_model("tiny")  # the random-weight model: offline, fast, same figures
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    print(f"--model tiny, 2 executors, cases {', '.join(c.name for c in cases)}; "
          f"policies {', '.join(policies)}", file=sys.stderr)
    for case in cases:
        results = {}
        for policy in policies:
            fig = run_case(case, policy, model_dir, vocab, args.seed)
            results[policy] = fig
            emit(f"{case.name}/{policy}", workload=case.name, **fig)
            print(f"{case.name:>14} {policy:>13}: TTFT p50 {fig['ttft_ms_p50']:.0f} ms p90 "
                  f"{fig['ttft_ms_p90']:.0f} p99 {fig['ttft_ms_p99']:.0f}, "
                  f"{fig['output_tok_per_s']:.0f} out tok/s, hit {fig['prefix_hit_ratio']:.3f}"
                  f" (usage {fig['usage_hit_ratio']:.3f}, bound {fig['bound_hit_ratio']:.3f}),"
                  f" per executor [queried, hit] {fig['per_executor_queried_hit_tokens']},"
                  f" pulls {fig['pulls']} ({fig['blocks_received']} blocks)",
                  file=sys.stderr)
        if "prefix" in results and "round-robin" in results:
            ratio = results["round-robin"]["ttft_ms_p50"] / results["prefix"]["ttft_ms_p50"]
            summary = dict(workload=case.name,
                           ttft_p50_rr_over_prefix_ratio=round(ratio, 2),
                           prefix_hit_ratio=results["prefix"]["prefix_hit_ratio"])
            if case.name == TARGET_CASE:
                summary.update(target_ttft_ratio=TARGET_TTFT_RATIO,
                               target_hit_ratio=TARGET_HIT_RATIO,
                               met=ratio >= TARGET_TTFT_RATIO
                               and results["prefix"]["prefix_hit_ratio"] >= TARGET_HIT_RATIO)
            emit(f"{case.name}/summary", **summary)
            print(f"{case.name}: round-robin / prefix TTFT p50 {ratio:.2f}x", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
