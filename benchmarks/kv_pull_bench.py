"""Prefix pulls (`--kv-pull auto`, router/prefix_pull.py) against computing the prefix again
(`--kv-pull off`), end to end: JSON lines on stdout, a table on stderr.

For each workload and configuration, starts `pagedserve serve` with two executors (the
built-in SmolLM2-135M-Instruct unless `--model DIR`; on the CPU with one thread each unless
`--device cuda`; `--swap-space` left at its default: the CPU blocks pulled blocks land in)
and plays the workload over gRPC, greedy, EOS ignored. Workloads (fixed; never change one
to meet a target):

* `second_request` (`--routing round-robin`, so placement alternates): 6 times, a new
  1,024-token prefix and three requests in turn, one at a time, each the prefix and its own
  32 tokens, 8 output tokens: A on one executor (cold), B on the other (with `auto` it pulls
  A's blocks, with `off` computes the prefix), C on A's again (a local cache hit). B's time
  to first token against A's and C's is what a pull costs and saves; `transfer_ns_per_byte`
  = (B's TTFT - C's TTFT) / the bytes B pulled, medians (the router path's price that
  prefix_pull.TRANSFER_S_PER_BYTE stands for);
* `hot_tenant` (`--routing prefix`): one tenant, a 1,024-token system prompt, 16 requests
  (its prompt and a 64-token question, 16 output tokens) from 4 clients: the prefix
  routing rule keeps the tenant on one executor until its queue pays for moving; a pull
  makes moving cheaper;
* `unique_prompts` (`--routing prefix`): 16 requests of 512 unrelated tokens, 16 output
  tokens, 4 clients: nothing to pull (the cost of pricing pulls, if any);
* `multi_turn_disaggregated` (`--prefill-executors 1`: prompts on one executor, decoding
  on the other; added 2026-11-29, thirty-third session): 4 conversations at once, 3 turns
  each, 128 output tokens a turn; turn 1 is 256 tokens, each later turn the conversation
  so far (the last answer included) and 32 new tokens. The prefill executor holds the
  conversation up to the last answer, which was decoded on the other executor: with
  `auto` it pulls the answer's blocks from there, with `off` computes them. TTFT of turns
  2 and 3 (`ttft_later_p50_ms`, p90) against turn 1's is the figure.

Per (workload, config): wall seconds, output tokens per second, TTFT p50/p90 (of B, A and C
separately for `second_request`), pulls and blocks received (metrics), and `same_outputs`
(every output equal to `off`'s token for token: expect it with `--dtype float32`; in
bfloat16 a prefix-cache hit's tail rounds differently from a prompt computed whole).

    .venv/bin/python benchmarks/kv_pull_bench.py [--model DIR] [--workloads a,b]
        [--configs off,auto] [--dtype auto] [--device cpu]
"""

from __future__ import annotations

import random
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb  # noqa: E402
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2_grpc as pb_grpc  # noqa: E402
from serve_bench import bench_parser, run_matrix  # noqa: E402
from serve_process import ServeProcess, metric_sum, serve_argv  # noqa: E402

BENCH = "kv_pull_bench"
ROUTING = {"second_request": "round-robin", "hot_tenant": "prefix", "unique_prompts": "prefix",
           "multi_turn_disaggregated": "prefix"}
WORKLOADS = tuple(ROUTING)
SERVE_ARGS = {"multi_turn_disaggregated": ["--prefill-executors", "1"]}
CONFIGS = ("off", "auto")


def first_token(stub, ids: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """(seconds to the first token, output ids) of one greedy streamed request."""
    req = pb.GenerateRequest(params=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    req.prompt_token_ids.ids.extend(ids)
    t0 = time.perf_counter()
    ttft, out = None, []
    for msg in stub.Stream(req, timeout=1800):
        if msg.token_ids and ttft is None:
            ttft = time.perf_counter() - t0
        out.extend(msg.token_ids)
    return ttft or 0.0, out


def received(server) -> float:
    return metric_sum(server.metrics(), "pagedserve_kv_blocks_received_total")


def second_request(stub, server, vocab: int, rng: random.Random, block_bytes: int) -> dict:
    ttft: dict[str, list[float]] = {"a": [], "b": [], "c": []}
    outputs, per_byte = [], []
    for _ in range(6):
        prefix = [rng.randrange(3, vocab) for _ in range(1024)]
        for kind in "abc":
            before = received(server)
            seconds, out = first_token(stub, prefix + [rng.randrange(3, vocab)
                                                       for _ in range(32)], 8)
            ttft[kind].append(seconds)
            outputs.append(tuple(out))
            if kind == "b":
                pulled_bytes = (received(server) - before) * block_bytes
        if pulled_bytes:
            per_byte.append((ttft["b"][-1] - ttft["c"][-1]) / pulled_bytes)
    figures = {}
    for kind, xs in ttft.items():
        figures[f"ttft_{kind}_p50_ms"] = round(float(np.median(xs)) * 1e3, 1)
    figures["transfer_ns_per_byte"] = round(float(np.median(per_byte)) * 1e9, 2) \
        if per_byte else None
    return figures | {"_outputs": outputs}


def clients(stub, prompts: list[list[int]], max_tokens: int, num_clients: int) -> dict:
    results: dict[int, tuple[float, list[int]]] = {}
    lock = threading.Lock()

    def client(k: int) -> None:
        for i in range(k, len(prompts), num_clients):
            got = first_token(stub, prompts[i], max_tokens)
            with lock:
                results[i] = got

    threads = [threading.Thread(target=client, args=(k,)) for k in range(num_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ttfts = [results[i][0] for i in sorted(results)]
    return {"ttft_p50_ms": round(float(np.percentile(ttfts, 50)) * 1e3, 1),
            "ttft_p90_ms": round(float(np.percentile(ttfts, 90)) * 1e3, 1),
            "_outputs": [tuple(results[i][1]) for i in sorted(results)]}


def conversations(stub, vocab: int, rng: random.Random) -> dict:
    """`multi_turn_disaggregated`: 4 conversations, each in its own thread, 3 turns."""
    starts = [[rng.randrange(3, vocab) for _ in range(256)] for _ in range(4)]
    news = [[[rng.randrange(3, vocab) for _ in range(32)] for _ in range(2)]
            for _ in range(4)]
    results: dict[tuple[int, int], tuple[float, list[int]]] = {}
    lock = threading.Lock()

    def talk(k: int) -> None:
        prompt = starts[k]
        for turn in range(3):
            got = first_token(stub, prompt, 128)
            with lock:
                results[k, turn] = got
            if turn < 2:
                prompt = prompt + got[1] + news[k][turn]

    threads = [threading.Thread(target=talk, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = [results[k, 0][0] for k in range(4)]
    later = [results[k, t][0] for k in range(4) for t in (1, 2)]
    return {"ttft_first_p50_ms": round(float(np.median(first)) * 1e3, 1),
            "ttft_later_p50_ms": round(float(np.percentile(later, 50)) * 1e3, 1),
            "ttft_later_p90_ms": round(float(np.percentile(later, 90)) * 1e3, 1),
            "_outputs": [tuple(results[key][1]) for key in sorted(results)]}


def run_case(args, workload: str, config: str, logs: Path) -> dict:
    threads = ["--cpu-threads", "1"] if args.device == "cpu" else []
    argv = serve_argv(args.model, "--executors", "2", *SERVE_ARGS.get(workload, []),
                      "--routing", ROUTING[workload], "--kv-pull", config, "--device",
                      args.device, *threads, "--dtype", args.dtype)
    rng = random.Random(args.seed)
    with ServeProcess(argv, logs / f"{workload}-{config}.log") as server:
        channel = grpc.insecure_channel(server.address)
        stub = pb_grpc.GeneratorStub(channel)
        vocab = stub.GetModelInfo(pb.ModelInfoRequest(), timeout=30).vocab_size
        for k in range(4):  # warm both executors (first steps compile and allocate)
            first_token(stub, [rng.randrange(3, vocab) for _ in range(60 + k)], 4)
        block_bytes = _block_bytes(server)
        t0 = time.perf_counter()
        if workload == "second_request":
            figures = second_request(stub, server, vocab, rng, block_bytes)
        elif workload == "hot_tenant":
            system = [rng.randrange(3, vocab) for _ in range(1024)]
            prompts = [system + [rng.randrange(3, vocab) for _ in range(64)]
                       for _ in range(16)]
            figures = clients(stub, prompts, 16, 4)
        elif workload == "multi_turn_disaggregated":
            figures = conversations(stub, vocab, rng)
        else:
            prompts = [[rng.randrange(3, vocab) for _ in range(512)] for _ in range(16)]
            figures = clients(stub, prompts, 16, 4)
        wall = time.perf_counter() - t0
        text = server.metrics()
        channel.close()
    num_out = sum(len(o) for o in figures["_outputs"])
    return {"wall_s": round(wall, 2), "output_tokens_per_s": round(num_out / wall, 1),
            **figures, "pulls": int(metric_sum(text, "pagedserve_kv_pulls_total")),
            "blocks_received": int(metric_sum(text, "pagedserve_kv_blocks_received_total"))}


def _block_bytes(server) -> int:
    """One KV block's bytes, from the executors' log line at start (kv_block_bytes)."""
    import re
    m = re.search(r"kv_block_bytes=(\d+)", server.log())
    return int(m.group(1)) if m else 0


def main() -> None:
    args = bench_parser(__doc__, WORKLOADS, CONFIGS).parse_args()
    rows = run_matrix(args, BENCH, lambda w, c, logs: run_case(args, w, c, logs), "off")
    for workload, config, fig in rows:
        shown = {k: v for k, v in fig.items() if k != "wall_s"}
        print(f"{workload:24} {config:5} wall {fig['wall_s']:6.1f} s  {shown}",
              file=sys.stderr)


if __name__ == "__main__":
    main()
