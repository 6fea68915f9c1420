"""Offloading (`--kv-offloading-size`) on multi-turn conversations, end to end: JSON lines on
stdout, a table on stderr.

For each workload and configuration, starts `pagedserve serve` (the built-in
SmolLM2-135M-Instruct unless `--model DIR`; one executor, on the CPU with one thread unless
`--device cuda`, exact block counts) and plays the workload over gRPC with `--clients` clients. A conversation's turn is
its context so far plus a new user message (random token ids), greedy, EOS ignored,
`--output-tokens` tokens; its next turn appends that output and a new message. Client k plays
conversations k, k + C, ... in turn, so between two turns of a conversation every other
conversation runs once: every context is in the working set.

Configurations (blocks of 16 tokens; D = `--device-blocks`, H = the host tier's blocks):

* `off`: D device blocks, no offloading (what a served model has without it);
* `offload`: D device blocks and H CPU blocks, `--kv-offloading-size` on;
* `device_plus_host`: D + H device blocks, no offloading. The same memory in all; on a CPU
  executor the "device" is the same RAM as the host, so this is the fair comparison there
  (on a GPU, device memory cannot be traded for host memory: `off` is the alternative).

Workloads (fixed; never change one to meet a target):

* `multi_turn_3x`: 16 conversations, a 512-token first message, 3 turns of 48-token
  messages: the contexts (~45 blocks each) are ~3x the device's D = 240 blocks, and fit in
  H = 720;
* `multi_turn_fits`: 4 of them (~180 blocks): everything fits the device, nothing to gain;
* `no_reuse`: 48 single-turn requests of 512 new tokens: never a hit, every freed block
  copied to the host for nothing;
* `multi_turn_beyond`: 40 conversations (~1,800 blocks): beyond D + H, the host churns.

Per (workload, config): wall seconds, output tokens per second, time to first token
(p50, p90) of the turns after each conversation's first (the ones a cache can serve),
prompt tokens computed (prompt - cached), cached tokens, of which from the host, and
blocks offloaded. `same_outputs`: each config's outputs equal `off`'s token for token.
Expect it in float32 (`--dtype float32`) only: in bfloat16 a prompt computed over cached
blocks rounds differently from the same prompt computed whole, whichever tier the blocks
came from (`device_plus_host` differs from `off` as much as `offload` does).

    .venv/bin/python benchmarks/kv_offload_bench.py [--model DIR] [--workloads a,b]
        [--configs off,offload,device_plus_host] [--clients 4] [--dtype auto]
        [--device cpu] [--device-blocks 240] [--host-blocks 720] [--scale 1]
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
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
from serve_bench import bench_parser  # noqa: E402
from serve_process import ServeProcess, metric_sum, serve_argv  # noqa: E402

BENCH = "kv_offload_bench"


@dataclass(frozen=True)
class Workload:
    conversations: int
    first_tokens: int
    turns: int
    message_tokens: int


WORKLOADS = {
    "multi_turn_3x": Workload(16, 512, 3, 48),
    "multi_turn_fits": Workload(4, 512, 3, 48),
    "no_reuse": Workload(48, 512, 1, 0),
    "multi_turn_beyond": Workload(40, 512, 3, 48),
}
CONFIGS = ("off", "offload", "device_plus_host")


def emit(case: str, **figures) -> None:
    print(json.dumps({"bench": BENCH, "case": case, **figures}), flush=True)


def server_argv(model: str, dtype: str, config: str, device_blocks: int,
                host_blocks: int, device: str = "cpu") -> list[str]:
    gpu = device_blocks + (host_blocks if config == "device_plus_host" else 0)
    cpu = host_blocks if config == "offload" else 0
    extra = ["--kv-offloading-size", "1"] if config == "offload" else []
    threads = ["--cpu-threads", "1"] if device == "cpu" else []
    return serve_argv(model, "--executors", "1", "--device", device, *threads,
                      "--dtype", dtype, "--num-gpu-blocks", str(gpu), "--num-cpu-blocks",
                      str(cpu), *extra)


def play(stub, work: Workload, clients: int, vocab: int, seed: int, output_tokens: int):
    """Run the workload; returns (per turn records, wall seconds). A record: (conversation,
    turn, ttft_s, prompt tokens, cached tokens, output ids)."""
    rng = random.Random(seed)
    contexts = [[rng.randrange(3, vocab) for _ in range(work.first_tokens)]
                for _ in range(work.conversations)]
    messages = [[[rng.randrange(3, vocab) for _ in range(work.message_tokens)]
                 for _ in range(work.turns)] for _ in range(work.conversations)]
    records: list[tuple] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        for turn in range(work.turns):
            for conv in range(k, work.conversations, clients):
                ctx = contexts[conv]
                if turn:
                    ctx.extend(messages[conv][turn])
                req = pb.GenerateRequest(params=pb.SamplingParams(
                    max_tokens=output_tokens, temperature=0.0, ignore_eos=True))
                req.prompt_token_ids.ids.extend(ctx)
                t0 = time.perf_counter()
                ttft, out, usage = None, [], None
                for msg in stub.Stream(req, timeout=1800):
                    if ttft is None and msg.token_ids:
                        ttft = time.perf_counter() - t0
                    out.extend(msg.token_ids)
                    if msg.HasField("usage"):
                        usage = msg.usage
                with lock:
                    records.append((conv, turn, ttft, len(ctx), usage.cached_prompt_tokens,
                                    tuple(out)))
                ctx.extend(out)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, time.perf_counter() - t0


def run_case(args, name: str, work: Workload, config: str, logs: Path) -> dict:
    argv = server_argv(args.model, args.dtype, config, args.device_blocks, args.host_blocks,
                       args.device)
    with ServeProcess(argv, logs / f"{name}-{config}.log") as server:
        channel = grpc.insecure_channel(server.address)
        stub = pb_grpc.GeneratorStub(channel)
        vocab = stub.GetModelInfo(pb.ModelInfoRequest(), timeout=30).vocab_size
        # warm up the executor (first steps compile and allocate)
        warm = pb.GenerateRequest(params=pb.SamplingParams(max_tokens=4, temperature=0.0))
        warm.prompt_token_ids.ids.extend(range(3, 40))
        stub.Generate(warm, timeout=600)
        records, wall = play(stub, work, args.clients, vocab, args.seed, args.output_tokens)
        text = server.metrics()
        channel.close()
    later = [r[2] for r in records if r[1] > 0] or [r[2] for r in records]
    prompt = sum(r[3] for r in records)
    cached = sum(r[4] for r in records)
    outputs = {(r[0], r[1]): r[5] for r in records}
    figures = dict(
        wall_s=round(wall, 2),
        output_tokens_per_s=round(sum(len(r[5]) for r in records) / wall, 1),
        ttft_p50_ms=round(float(np.percentile(later, 50)) * 1e3, 1),
        ttft_p90_ms=round(float(np.percentile(later, 90)) * 1e3, 1),
        prompt_tokens=prompt, prompt_tokens_computed=prompt - cached, cached_tokens=cached,
        cpu_hit_tokens=int(metric_sum(text, "pagedserve_prefix_cache_cpu_hits_total")),
        offloaded_blocks=int(metric_sum(text, "pagedserve_kv_offloaded_blocks_total")),
        preemptions=int(metric_sum(text, "pagedserve_preemptions_total")),
    )
    return figures | {"_outputs": outputs}


def main() -> None:
    p = bench_parser(__doc__, WORKLOADS, CONFIGS)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--device-blocks", type=int, default=240)
    p.add_argument("--host-blocks", type=int, default=720)
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply every workload's token counts (smoke runs: 0.1)")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kv-offload-bench-") as tmp:
        for name in args.workloads.split(","):
            w = WORKLOADS[name]
            work = Workload(w.conversations, max(1, int(w.first_tokens * args.scale)),
                            w.turns, int(w.message_tokens * args.scale))
            results = {}
            for config in args.configs.split(","):
                results[config] = run_case(args, name, work, config, Path(tmp))
            outputs = {config: fig.pop("_outputs") for config, fig in results.items()}
            base = results.get("off")
            for config, fig in results.items():
                same = None if base is None else outputs[config] == outputs["off"]
                speed = None if base is None else round(base["wall_s"] / fig["wall_s"], 2)
                emit(f"{name}/{config}", workload=name, config=config, **fig,
                     same_outputs=same, speedup_vs_off=speed,
                     device_blocks=args.device_blocks, host_blocks=args.host_blocks,
                     clients=args.clients)
                rows.append((name, config, fig, speed))
    print(f"{'workload':18} {'config':17} {'wall s':>7} {'tok/s':>7} {'ttft p50':>9} "
          f"{'p90 ms':>7} {'computed':>9} {'cpu hits':>9} {'x off':>6}", file=sys.stderr)
    for name, config, f, speed in rows:
        print(f"{name:18} {config:17} {f['wall_s']:7.1f} {f['output_tokens_per_s']:7.1f} "
              f"{f['ttft_p50_ms']:9.1f} {f['ttft_p90_ms']:7.1f} "
              f"{f['prompt_tokens_computed']:9d} {f['cpu_hit_tokens']:9d} "
              f"{speed if speed is not None else '':>6}", file=sys.stderr)


if __name__ == "__main__":
    main()
