"""What the OpenAI HTTP API costs next to gRPC: one `pagedserve serve`, the same workload sent
through `pagedserve bench` over each API in turn (alternating, `--rounds` times each).

    python benchmarks/api_overhead.py [--model tiny] [--num-prompts 64] [--rounds 2]

With PAGEDSERVE_API_KEY set, the server needs that key and the clients send it.

Prints one JSON line per run ({"bench": "api_overhead", "case": "grpc"|"http", ...} with
output tok/s, TTFT and ITL percentiles) and a last line comparing the medians. Both APIs run
in the router process on one event loop, so the difference is the edge's own work: JSON and
SSE framing versus protobuf and HTTP/2 frames. Output lengths are fixed (ignore_eos); prefix
caching is off (each round repeats its prompts on both APIs). ITL over HTTP counts one token
per text chunk (an SSE chunk has no token count): a token whose text is held back (an
incomplete UTF-8 sequence) merges into the next chunk and shows as one long gap, so HTTP's
ITL tail reads higher than gRPC's for the same stream.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagedserve.router.edge_security import (  # $PAGEDSERVE_API_KEY, as serve's
    client_api_key,
    grpc_metadata,
)

from pagedserve.bench import BenchConfig, run_bench
from pagedserve.subprocs import stop_process

READY = re.compile(r"pagedserve ready grpc=(\S+) metrics=(\S+) executors=(\d+) http=(\S+)")


def start_serve(model: str, log_path: Path, extra: list[str]) -> tuple[subprocess.Popen, dict]:
    argv = [sys.executable, "-m", "pagedserve.cli", "serve", "--model", model, "--port", "0",
            "--metrics-port", "0", "--http-port", "0", "--no-prefix-caching", "--executor-bind",
            f"tcp://127.0.0.1:{_free_port()}", *extra]
    log = open(log_path, "w")  # noqa: SIM115 - the child writes it while we read
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        m = READY.search(log_path.read_text())
        if m:
            return proc, {"grpc": m.group(1), "metrics": m.group(2), "http": m.group(4)}
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    stop_process(proc)
    raise RuntimeError("serve did not start:\n" + log_path.read_text()[-3000:])


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", default="64:128")
    p.add_argument("--output-len", default="32:64")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--serve-arg", action="append", default=[],
                   help="extra flag for serve (repeat), e.g. --serve-arg=--executors=2")
    args = p.parse_args()
    lo, hi = (int(x) for x in args.input_len.split(":"))
    olo, ohi = (int(x) for x in args.output_len.split(":"))
    with tempfile.TemporaryDirectory() as tmp:
        proc, addr = start_serve(args.model, Path(tmp) / "serve.log", args.serve_arg)
        try:
            vocab = asyncio.run(_vocab_size(addr["grpc"]))
            results: dict[str, list[dict]] = {"grpc": [], "http": []}
            warm = BenchConfig(address=addr["grpc"], num_prompts=8, input_len_range=(lo, hi),
                               output_len_range=(4, 4), progress=False, seed=99,
                               api_key=client_api_key())
            asyncio.run(run_bench(warm))
            for r in range(args.rounds):
                for case in ("grpc", "http") if r % 2 == 0 else ("http", "grpc"):
                    cfg = BenchConfig(
                        address=addr[case], backend="openai" if case == "http" else "grpc",
                        vocab_size=vocab, num_prompts=args.num_prompts, seed=r,
                        input_len_range=(lo, hi), output_len_range=(olo, ohi),
                        progress=False, api_key=client_api_key())
                    res = asyncio.run(run_bench(cfg))
                    results[case].append(res)
                    print(json.dumps({"bench": "api_overhead", "case": case, "round": r,
                                      "model": args.model, **{k: res[k] for k in KEYS}}),
                          flush=True)
        finally:
            stop_process(proc)
    med = {case: {k: statistics.median(x[k] for x in runs) for k in KEYS[1:]}
           for case, runs in results.items()}
    print(json.dumps({"bench": "api_overhead", "case": "http_vs_grpc_median",
                      "model": args.model, "num_prompts": args.num_prompts,
                      "tok_per_s_ratio_http_over_grpc": round(
                          med["http"]["output_throughput_tok_per_s"]
                          / med["grpc"]["output_throughput_tok_per_s"], 3),
                      "ttft_p50_ms": {c: med[c]["ttft_ms_p50"] for c in med},
                      "itl_p50_ms": {c: med[c]["itl_ms_p50"] for c in med}}), flush=True)
    return 0


KEYS = ("completed", "output_throughput_tok_per_s", "ttft_ms_p50", "ttft_ms_p99",
        "itl_ms_p50", "itl_ms_p99", "e2e_ms_p50")


async def _vocab_size(address: str) -> int:
    import grpc
    from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
    from pagedserve.protos.generated.pagedserve.v1 import generate_pb2_grpc as pb_grpc
    async with grpc.aio.insecure_channel(address) as channel:
        info = await pb_grpc.GeneratorStub(channel).GetModelInfo(
            pb.ModelInfoRequest(), timeout=30, metadata=grpc_metadata(client_api_key()))
    return info.vocab_size


if __name__ == "__main__":
    sys.exit(main())
