"""`pagedserve bench`: a load generator against a running router (like `vllm bench serve`).

    pagedserve bench --address HOST:PORT [--backend grpc|openai] [--metrics-address HOST:PORT]
                     [--dataset random|shared-prefix|file] [--num-prompts N]
                     [--request-rate R|inf] [--burstiness B] [--max-concurrency C] [--json]

Flow: build the request list (`sample_requests`, seeded) → send each over a gRPC `Stream`
(or, with `--backend openai`, a streamed POST /v1/completions: the same workload against
pagedserve's HTTP API or any OpenAI-compatible server such as vLLM, SGLang or TGI)
at its arrival time (Poisson with a gamma burstiness factor, vLLM's definition, or all at
once) under an optional concurrency cap → record per request the time of every
token-bearing chunk → summarise (`summarise`). Latencies are measured here, at the client:

- TTFT: request sent → first chunk that carries tokens;
- ITL: gaps between token-bearing chunks; a chunk with k tokens counts k gaps of gap / k
  (openai: an SSE chunk carries no token count, so each text chunk counts as one token, as
  vLLM's client counts; output tokens come from the final usage chunk);
- TPOT: (e2e - TTFT) / (output tokens - 1), per request with more than one token;
- e2e: request sent → stream ended.

Each latency is reported as its mean and percentiles (`--metric-percentiles`, default 50,
90, 99). Goodput (`--goodput ttft:MS tpot:MS e2el:MS`, vLLM's flag and names; DistServe's
measure): the completed requests that met every objective given, per second of the run --
a request's TPOT as above (one with a single token has no gap and meets any TPOT
objective); a failed request never counts.

The prefix-cache hit rate is the change of `pagedserve_prefix_cache_hits_total` over
`pagedserve_prefix_cache_queries_total` (summed over executors) between a /metrics read
before and after the run. `run_bench` is the library entry point (benchmarks/ use it).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import re
import sys
import time
import urllib.request
from dataclasses import dataclass

import numpy as np

from .bench_datasets import DATASETS, BenchRequest, parse_range, sample_requests
from .bench_report import (
    PERCENTILES,
    RequestOutcome,
    format_table,
    parse_percentiles,
    parse_slo,
    summarise,
)
from .router.edge_security import add_client_api_key, grpc_metadata

BACKENDS = ("grpc", "openai", "openai-chat", "openai-embeddings")


@dataclass
class BenchConfig:
    address: str
    metrics_address: str | None = None
    dataset: str = "random"
    num_prompts: int = 100
    seed: int = 0
    input_len_range: tuple[int, int] = (64, 256)
    output_len_range: tuple[int, int] = (16, 64)
    tenants: int = 4
    prefix_len: int = 256
    questions_per_tenant: int = 8
    question_len: int = 32
    file: str | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    temperature: float = 0.0
    ignore_eos: bool = True
    progress: bool = True
    timeout_s: float | None = None
    backend: str = "grpc"
    vocab_size: int | None = None  # openai: the token-id range of random prompts
    model: str | None = None  # openai: the model id (default: the server's first)
    connections: int = 1  # grpc: channels (TCP connections) the requests are spread over
    lora_modules: tuple[str, ...] = ()  # each request runs one of these adapters, at random
    api_key: str | None = None  # the server's --api-key (sent as a bearer token)
    tokenizer: str | None = None  # sharegpt: the model whose tokens count each reply
    metric_percentiles: tuple[float, ...] = PERCENTILES  # of each latency
    goodput_ms: dict[str, float] | None = None  # the objectives: ttft / tpot / e2el -> ms


# ---------------------------------------------------------------------------------------
# Arrivals and one request


def arrival_delays(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Inter-arrival gaps in seconds. vLLM: gamma(shape=burstiness, scale=1/(rate*burstiness))
    — mean 1/rate; burstiness 1 is Poisson, < 1 burstier, > 1 more regular."""
    if math.isinf(request_rate):
        return [0.0] * n
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    rng = np.random.default_rng(seed + 7919)
    theta = 1.0 / (request_rate * burstiness)
    return [float(x) for x in rng.gamma(shape=burstiness, scale=theta, size=n)]


def _grpc_request(req: BenchRequest, cfg: BenchConfig):
    from .protos.generated.pagedserve.v1 import generate_pb2 as pb
    params = pb.SamplingParams(max_tokens=req.max_tokens, temperature=cfg.temperature,
                               ignore_eos=cfg.ignore_eos, seed=cfg.seed)
    msg = pb.GenerateRequest(params=params, lora_adapter=req.lora)
    if req.prompt_token_ids is not None:
        msg.prompt_token_ids.ids.extend(req.prompt_token_ids)
    else:
        msg.prompt = req.prompt
    return msg


async def _one(stub, req: BenchRequest, cfg: BenchConfig) -> RequestOutcome:
    import grpc
    out = RequestOutcome(prompt_tokens=req.prompt_len)
    start = time.perf_counter()
    try:
        call = stub.Stream(_grpc_request(req, cfg), timeout=cfg.timeout_s,
                           metadata=grpc_metadata(cfg.api_key))
        async for chunk in call:
            if chunk.token_ids:
                out.record_tokens(len(chunk.token_ids), start)
            if chunk.finish_reason:
                out.finish_reason = chunk.finish_reason
            if chunk.HasField("usage"):
                out.prompt_tokens = chunk.usage.prompt_tokens
                out.cached_prompt_tokens = chunk.usage.cached_prompt_tokens
        out.e2e_s = time.perf_counter() - start
        out.ok = out.last_token_at is not None
        if not out.ok:
            out.error = f"no tokens (finish_reason {out.finish_reason})"
    except grpc.aio.AioRpcError as exc:
        out.error = f"{exc.code().name}: {exc.details()}"
    return out


# ---------------------------------------------------------------------------------------
# Metrics and summary


_SAMPLE = re.compile(r"^(pagedserve_prefix_cache_(?:queries|hits)_total)(\{[^}]*\})?\s+(\S+)")


def read_prefix_counters(metrics_address: str) -> tuple[float, float]:
    """(queries, hits) summed over executors from the router's /metrics."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    queries = hits = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            if m.group(1).endswith("queries_total"):
                queries += float(m.group(3))
            else:
                hits += float(m.group(3))
    return queries, hits


# ---------------------------------------------------------------------------------------
# Driver


async def run_bench(cfg: BenchConfig, requests: list[BenchRequest] | None = None) -> dict:
    """Run the workload against cfg.address; returns the summary dict (no bench/case keys)."""
    if cfg.backend.startswith("openai"):
        from .bench_openai import run_openai
        return await run_openai(cfg, requests)
    import grpc

    from .protos.generated.pagedserve.v1 import generate_pb2 as pb
    from .protos.generated.pagedserve.v1 import generate_pb2_grpc as pb_grpc

    # One gRPC channel multiplexes every stream on one connection; a server whose API is
    # served by several processes (--api-workers) gets connections, not streams, spread.
    options = [("grpc.use_local_subchannel_pool", 1)] if cfg.connections > 1 else []
    channels = [grpc.aio.insecure_channel(cfg.address, options=options)
                for _ in range(max(1, cfg.connections))]
    try:
        stubs = [pb_grpc.GeneratorStub(ch) for ch in channels]
        info = await stubs[0].GetModelInfo(pb.ModelInfoRequest(), timeout=15,
                                           wait_for_ready=True,
                                           metadata=grpc_metadata(cfg.api_key))
        if requests is None:
            requests = sample_requests(cfg, info.vocab_size)
        turn = itertools.count()  # round robin over the connections
        return await drive(cfg, requests,
                           lambda req: _one(stubs[next(turn) % len(stubs)], req, cfg))
    finally:
        for ch in channels:
            await ch.close()


async def drive(cfg: BenchConfig, requests: list[BenchRequest], send) -> dict:
    """Send each request at its arrival time under the concurrency cap; summarise."""
    delays = arrival_delays(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed)
    before = read_prefix_counters(cfg.metrics_address) if cfg.metrics_address else None
    limit = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    bar = None
    if cfg.progress:
        from tqdm import tqdm
        bar = tqdm(total=len(requests), desc="requests", file=sys.stderr, dynamic_ncols=True)

    async def guarded(req: BenchRequest) -> RequestOutcome:
        if limit is None:
            out = await send(req)
        else:
            async with limit:
                out = await send(req)
        if bar is not None:
            bar.update(1)
        return out

    start = time.perf_counter()
    tasks = []
    for req, delay in zip(requests, delays, strict=True):
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(guarded(req)))
    outcomes = await asyncio.gather(*tasks)
    duration_s = time.perf_counter() - start
    if bar is not None:
        bar.close()
    prefix = None
    if before is not None:
        after = read_prefix_counters(cfg.metrics_address)
        prefix = (after[0] - before[0], after[1] - before[1])
    return summarise(list(outcomes), duration_s, prefix, cfg.metric_percentiles,
                     cfg.goodput_ms)


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} must be 1 or more")
    return n


def _rate(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be > 0 (or inf)")
    return value


def build_parser() -> argparse.ArgumentParser:
    class P(argparse.ArgumentParser):
        def error(self, message):
            self.exit(2, f"{self.prog}: {message}\n")

    p = P(prog="pagedserve bench", description="Load generator: streams requests to a "
          "router and reports throughput, TTFT, TPOT, ITL, e2e latency and prefix hits.")
    p.add_argument("--address", default=None,
                   help="router gRPC HOST:PORT (default 127.0.0.1:50051); with --backend "
                        "openai the HTTP server's HOST:PORT or URL (default 127.0.0.1:8000)")
    p.add_argument("--backend", choices=BACKENDS, default="grpc",
                   help="grpc: pagedserve's Stream; openai: streamed POST /v1/completions "
                        "(pagedserve's HTTP API or another OpenAI-compatible server); "
                        "openai-chat: streamed POST /v1/chat/completions, each prompt one "
                        "user message (text prompts: --dataset file); "
                        "openai-embeddings: POST /v1/embeddings of each prompt (latency: "
                        "the whole reply; no output tokens)")
    p.add_argument("--model", default=None,
                   help="openai: the model id (default: the first of GET /v1/models)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="openai: random token-id prompts are drawn below this id")
    p.add_argument("--metrics-address", default=None,
                   help="router metrics HOST:PORT (prefix-cache hit rate before/after)")
    p.add_argument("--dataset", choices=DATASETS, default="random")
    p.add_argument("--num-prompts", type=int, default=100,
                   help="requests (random, file); shared-prefix sends "
                        "tenants x questions-per-tenant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-len-range", type=parse_range, default=(64, 256), metavar="A:B",
                   help="random: prompt tokens, uniform in [A, B]")
    p.add_argument("--output-len-range", type=parse_range, default=(16, 64), metavar="A:B",
                   help="max_tokens, uniform in [A, B] (file: unless the line says)")
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=256, help="tokens of each system prompt")
    p.add_argument("--questions-per-tenant", type=int, default=8)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--tokenizer", default=None,
                   help="sharegpt: the served model's directory or hub id (its tokenizer "
                   "counts each reply's tokens: the request's output length)")
    p.add_argument("--file", default=None,
                   help='prompts: one per line, or JSONL {"prompt": ..., "max_tokens": ...}')
    p.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="requests/s (Poisson; inf = all at once)")
    p.add_argument("--burstiness", type=_rate, default=1.0,
                   help="gamma shape of inter-arrival times (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="let EOS end a request (default: ignore_eos, fixed output lengths)")
    p.add_argument("--timeout", type=float, default=None, help="per-request deadline (s)")
    p.add_argument("--connections", type=_positive_int, default=1,
                   help="grpc: connections to spread the requests over (a server with "
                        "--api-workers serves each connection from one worker)")
    p.add_argument("--lora-modules", type=lambda v: tuple(n for n in v.split(",") if n),
                   default=(), metavar="NAME[,NAME...]",
                   help="each request runs one of these LoRA adapters, drawn at random")
    p.add_argument("--metric-percentiles", type=parse_percentiles, default=PERCENTILES,
                   metavar="P[,P...]",
                   help="percentiles of each latency to report (default 50,90,99)")
    p.add_argument("--goodput", type=parse_slo, nargs="+", default=None,
                   metavar="METRIC:MS",
                   help="service-level objectives in milliseconds (ttft, tpot, e2el), e.g. "
                        "--goodput ttft:500 tpot:50: also report the completed requests "
                        "that met all of them, per second")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-progress", action="store_true")
    add_client_api_key(p)
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    num_prompts = args.num_prompts
    if args.dataset == "shared-prefix":
        num_prompts = args.tenants * args.questions_per_tenant
    address = args.address or ("127.0.0.1:8000" if args.backend.startswith("openai")
                               else "127.0.0.1:50051")
    return BenchConfig(
        address=address, backend=args.backend, model=args.model, vocab_size=args.vocab_size,
        metrics_address=args.metrics_address, dataset=args.dataset,
        num_prompts=num_prompts, seed=args.seed, input_len_range=args.input_len_range,
        output_len_range=args.output_len_range, tenants=args.tenants,
        prefix_len=args.prefix_len, questions_per_tenant=args.questions_per_tenant,
        question_len=args.question_len, file=args.file, request_rate=args.request_rate,
        burstiness=args.burstiness, max_concurrency=args.max_concurrency,
        temperature=args.temperature, ignore_eos=not args.no_ignore_eos,
        progress=not args.no_progress and not args.json, timeout_s=args.timeout,
        connections=args.connections, lora_modules=args.lora_modules, api_key=args.api_key,
        tokenizer=args.tokenizer, metric_percentiles=args.metric_percentiles,
        goodput_ms=dict(args.goodput) if args.goodput else None)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.dataset in ("file", "sharegpt") and not args.file:
        print(f"pagedserve bench: --dataset {args.dataset} needs --file PATH", file=sys.stderr)
        return 2
    if args.goodput and len(dict(args.goodput)) != len(args.goodput):
        print("pagedserve bench: --goodput names a metric twice", file=sys.stderr)
        return 2
    if args.num_prompts < 1 or (args.max_concurrency is not None and args.max_concurrency < 1):
        print("pagedserve bench: --num-prompts and --max-concurrency must be >= 1",
              file=sys.stderr)
        return 2
    import grpc
    cfg = config_from_args(args)
    try:
        res = asyncio.run(run_bench(cfg))
    except (OSError, ValueError) as exc:
        print(f"pagedserve bench: {exc}", file=sys.stderr)
        return 1
    except grpc.aio.AioRpcError as exc:  # the model-info call: no router there
        print(f"pagedserve bench: cannot reach {cfg.address}: {exc.code().name}",
              file=sys.stderr)
        return 1
    res = {"bench": "pagedserve_bench", "case": cfg.dataset, "backend": cfg.backend,
           "request_rate_req_per_s": None if math.isinf(cfg.request_rate) else cfg.request_rate,
           "burstiness": cfg.burstiness, "max_concurrency": cfg.max_concurrency,
           "num_prompts": cfg.num_prompts, **res}
    if args.json:
        print(json.dumps(res))
    else:
        print(format_table(res))
    return 0 if res["completed"] else 1
