"""Prefill/decode disaggregation (`--prefill-executors`) against executors that do both,
end to end: JSON lines on stdout, a table on stderr.

For each workload and configuration, starts `pagedserve serve` with two executors (the
built-in SmolLM2-135M-Instruct unless `--model DIR`; on the CPU with one thread each unless
`--device cuda`) and plays the workload over gRPC, greedy, EOS ignored:

* `mixed`: `--executors 2`, each computes prompts and decodes (routing spreads requests);
* `disaggregated`: `--executors 2 --prefill-executors 1`: prompts on one, decoding on the
  other, each request moved with its KV blocks after its first token.

Workloads (fixed; never change one to meet a target):

* `streams_with_long_prompts`: 8 streams (64-token prompts, 160 output tokens) decoding
  while 6 long prompts (1,024 tokens, 16 output tokens) arrive, one every 1.5 s: what
  disaggregation is for (a long prompt computed in a decoding executor's step stalls
  every stream there);
* `streams_only`: 16 streams (64-token prompts, 96 output tokens), no long prompt: the
  unfavourable case (one executor decodes everything, the other idles);
* `prompts_only`: 24 requests of 512-token prompts and 24 output tokens, 4 clients: the
  prompts are the work (one executor computes them all).

Per (workload, config): wall seconds, output tokens per second, the streams' time
between tokens (p50, p90, p99 of every gap between two chunks of a stream, divided by the
tokens in the later chunk) and time per output token (p50 of (last - first token) / (n - 1)
a request), time to first token of the long prompts (or of every request where none),
handoffs and blocks received (metrics), and `same_outputs`: every config's outputs equal
`mixed`'s token for token (expect it with `--dtype float32`; in bfloat16 the decode
executor's tail, computed over received blocks, rounds differently from the prompt
computed whole, as a prefix-cache hit does).

    .venv/bin/python benchmarks/disagg_bench.py [--model DIR] [--workloads a,b]
        [--configs mixed,disaggregated] [--dtype auto] [--device cpu]
"""

from __future__ import annotations

import random
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb  # noqa: E402
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2_grpc as pb_grpc  # noqa: E402
from serve_bench import bench_parser, run_matrix  # noqa: E402
from serve_process import ServeProcess, metric_sum, serve_argv  # noqa: E402

BENCH = "disagg_bench"


@dataclass(frozen=True)
class Workload:
    streams: int  # requests that start at once and decode
    stream_prompt: int
    stream_output: int
    long: int  # long prompts, one every `every_s`
    long_prompt: int
    long_output: int
    every_s: float
    clients: int = 0  # >0: `streams` requests played by this many clients in turn


WORKLOADS = {
    "streams_with_long_prompts": Workload(8, 64, 160, 6, 1024, 16, 1.5),
    "streams_only": Workload(16, 64, 96, 0, 0, 0, 0.0),
    "prompts_only": Workload(24, 512, 24, 0, 0, 0, 0.0, clients=4),
}
CONFIGS = {"mixed": [], "disaggregated": ["--prefill-executors", "1"]}


def stream_one(stub, ids: list[int], max_tokens: int) -> tuple[float, list[float], list[int]]:
    """(time to first token, arrival times of each later token, output ids)."""
    req = pb.GenerateRequest(params=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    req.prompt_token_ids.ids.extend(ids)
    t0 = time.perf_counter()
    ttft, times, out, last = None, [], [], None
    for msg in stub.Stream(req, timeout=1800):
        if not msg.token_ids:
            continue
        now = time.perf_counter()
        if ttft is None:
            ttft = now - t0
        elif last is not None:
            n = len(msg.token_ids)
            times.extend([(now - last) / n] * n)
        last = now
        out.extend(msg.token_ids)
    return ttft or 0.0, times, out


def play(stub, work: Workload, vocab: int, seed: int) -> tuple[dict, float]:
    rng = random.Random(seed)
    streams = [[rng.randrange(3, vocab) for _ in range(work.stream_prompt)]
               for _ in range(work.streams)]
    longs = [[rng.randrange(3, vocab) for _ in range(work.long_prompt)]
             for _ in range(work.long)]
    rec: dict = {"stream": {}, "long": {}}
    lock = threading.Lock()

    def run(kind: str, i: int, ids: list[int], max_tokens: int, delay: float) -> None:
        time.sleep(delay)
        got = stream_one(stub, ids, max_tokens)
        with lock:
            rec[kind][i] = got

    def client(k: int) -> None:
        for i in range(k, work.streams, work.clients):
            run("stream", i, streams[i], work.stream_output, 0.0)

    if work.clients:
        threads = [threading.Thread(target=client, args=(k,)) for k in range(work.clients)]
    else:
        threads = [threading.Thread(target=run, args=("stream", i, ids, work.stream_output,
                                                      0.0)) for i, ids in enumerate(streams)]
    threads += [threading.Thread(target=run, args=("long", i, ids, work.long_output,
                                                   0.5 + i * work.every_s))
                for i, ids in enumerate(longs)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rec, time.perf_counter() - t0


def run_case(args, name: str, work: Workload, config: str, logs: Path) -> dict:
    threads = ["--cpu-threads", "1"] if args.device == "cpu" else []
    argv = serve_argv(args.model, "--executors", "2", *CONFIGS[config], "--device",
                      args.device, *threads, "--dtype", args.dtype)
    with ServeProcess(argv, logs / f"{name}-{config}.log") as server:
        channel = grpc.insecure_channel(server.address)
        stub = pb_grpc.GeneratorStub(channel)
        vocab = stub.GetModelInfo(pb.ModelInfoRequest(), timeout=30).vocab_size
        for k in range(4):  # warm both executors (first steps compile and allocate)
            stream_one(stub, list(range(3 + k, 60 + k)), 4)
        rec, wall = play(stub, work, vocab, args.seed)
        text = server.metrics()
        channel.close()
    streams = list(rec["stream"].values())
    gaps = [g for _, times, _ in streams for g in times]
    tpot = [(sum(times) / len(times)) for _, times, _ in streams if times]
    ttfts = [r[0] for r in rec["long"].values()] or [r[0] for r in streams]
    outputs = {(kind, i): tuple(r[2]) for kind in rec for i, r in rec[kind].items()}

    def pct(xs, q):
        return round(float(np.percentile(xs, q)) * 1e3, 1) if xs else None

    figures = dict(
        wall_s=round(wall, 2),
        output_tokens_per_s=round(sum(len(o) for o in outputs.values()) / wall, 1),
        token_gap_p50_ms=pct(gaps, 50), token_gap_p90_ms=pct(gaps, 90),
        token_gap_p99_ms=pct(gaps, 99), tpot_p50_ms=pct(tpot, 50),
        ttft_p50_ms=pct(ttfts, 50), ttft_p90_ms=pct(ttfts, 90),
        handoffs=int(metric_sum(text, "pagedserve_handoffs_total")),
        blocks_received=int(metric_sum(text, "pagedserve_kv_blocks_received_total")),
    )
    return figures | {"_outputs": outputs}


def main() -> None:
    args = bench_parser(__doc__, WORKLOADS, CONFIGS).parse_args()
    rows = run_matrix(args, BENCH,
                      lambda w, c, logs: run_case(args, w, WORKLOADS[w], c, logs), "mixed")
    for name, config, f in rows:
        print(f"{name:26} {config:14} {f['wall_s']:7.1f} {f['output_tokens_per_s']:6.1f} "
              f"{f['token_gap_p50_ms']:8.1f} {f['token_gap_p90_ms']:7.1f} "
              f"{f['token_gap_p99_ms']:7.1f} {f['tpot_p50_ms']:6.1f} {f['ttft_p50_ms']:9.1f} "
              f"{f['ttft_p90_ms']:7.1f}", file=sys.stderr)


if __name__ == "__main__":
    main()
