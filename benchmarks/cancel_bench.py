"""Mass cancellation: how long after every client of a busy router hangs up at once are all of
its KV blocks free again (a load balancer dropping its connections, a benchmark client
stopping). JSON lines on stdout (DESIGN §8).

A router (`--pipeline-depth 2`, no `--debug-checks`) and one wire fake executor
(tests/wire_fake_executor.py: no model work, `--step-delay-ms` per step) with room for every
stream; `--streams` greedy, ignore_eos gRPC streams of 4-token prompts; once the median stream
has `--tokens` tokens, every call is cancelled at once and the router's status is polled
until the executor's free blocks equal its total. Per case: `all_free_after_s` (cancel to
all free), the tokens each stream had (median) and the blocks they held.

    .venv/bin/python benchmarks/cancel_bench.py [--streams 256] [--tokens 1000,1900]
        [--step-delay-ms 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

BENCH = "cancel_bench"
BLOCK_SIZE = 16


def emit(case: str, **figures) -> None:
    print(json.dumps({"bench": BENCH, "case": case, **figures}), flush=True)


def run_case(model_dir: Path, work: Path, streams: int, tokens: int, delay_s: float,
             max_tokens: int) -> dict:
    import cluster_harness
    import grpc
    from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
    from pagedserve.protos.generated.pagedserve.v1 import generate_pb2_grpc as pb_grpc
    from wire_fake_executor import fake_cluster

    blocks = streams * (-(-(max_tokens + 4) // BLOCK_SIZE) + 2) + 64
    cluster, _ = fake_cluster(
        model_dir, work, 1, router_args=["--max-queue-len", str(max(1024, streams)),
                                         "--max-num-seqs", str(streams),
                                         "--pipeline-depth", "2"],
        num_gpu_blocks=blocks, step_delay_s=delay_s,
        extra=["--max-model-len", str(max_tokens + 64)])
    # The harness starts routers with --debug-checks (every step verifies the whole KV
    # state): a serving router does not.
    spawn = cluster._spawn

    def without_debug_checks(args, name, env=None):
        return spawn([a for a in args if a != "--debug-checks"], name, env)

    cluster._spawn = without_debug_checks
    assert isinstance(cluster, cluster_harness.Cluster)

    async def main() -> dict:
        channel = grpc.aio.insecure_channel(cluster.address)
        stub = pb_grpc.GeneratorStub(channel)
        counts = [0] * streams
        calls = []
        for _ in range(streams):
            req = pb.GenerateRequest(params=pb.SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            req.prompt_token_ids.ids.extend([5, 6, 7, 8])
            calls.append(stub.Stream(req))

        async def read(i: int) -> None:
            try:
                async for chunk in calls[i]:
                    counts[i] += len(chunk.token_ids)
            except (grpc.aio.AioRpcError, asyncio.CancelledError):
                pass

        tasks = [asyncio.create_task(read(i)) for i in range(streams)]
        deadline = time.monotonic() + 600
        while sorted(counts)[streams // 2] < tokens and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        status = (await stub.GetClusterStatus(pb.ClusterStatusRequest(), timeout=30)).executors[0]
        held = status.num_gpu_blocks - status.num_free_gpu_blocks
        median = sorted(counts)[streams // 2]
        started = time.perf_counter()
        for call in calls:
            call.cancel()
        await asyncio.gather(*tasks)
        polls = 0
        while True:
            polls += 1
            e = (await stub.GetClusterStatus(pb.ClusterStatusRequest(), timeout=30)).executors[0]
            if e.num_free_gpu_blocks == e.num_gpu_blocks:
                break
            await asyncio.sleep(0.005)
        elapsed = time.perf_counter() - started
        await channel.close()
        return {"streams": streams, "tokens_median": median, "blocks_held": held,
                "all_free_after_s": round(elapsed, 4), "status_polls": polls}

    with cluster.running():
        return asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", default="1000,1900", help="median tokens a stream has when "
                    "every call is cancelled (comma-separated: one case each)")
    ap.add_argument("--step-delay-ms", type=float, default=2.0)
    args = ap.parse_args(argv)
    from pagedserve.tinymodels import build_model

    targets = [int(t) for t in args.tokens.split(",")]
    max_tokens = max(targets) + 100
    with tempfile.TemporaryDirectory(prefix="cancel-bench-") as tmp:
        model_dir = build_model(Path(tmp) / "model", "llama",
                                max_position_embeddings=max_tokens + 64)
        for tokens in targets:
            work = Path(tmp) / f"t{tokens}"
            work.mkdir()
            emit(f"s{args.streams}_t{tokens}", **run_case(
                model_dir, work, args.streams, tokens, args.step_delay_ms / 1e3, max_tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
