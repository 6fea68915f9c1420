"""POST /v1/embeddings end to end against transformers on the same machine: JSON lines on
stdout, a table on stderr.

Starts `pagedserve serve` (the built-in SmolLM2-135M-Instruct unless `--model DIR`; one
executor, on the CPU with one thread unless `--device cuda`) and sends each workload's
inputs as token ids, `--batch` inputs a request, `--concurrency` requests in flight. The
reference is transformers' forward of the same inputs in batches of `--hf-batch` (right
padded, the attention mask given, the last real token's final hidden state, normalized) in
the same dtype on the same device (one torch thread on a CPU): what a script embedding with
transformers does. Both sides' vectors are compared (`min_cosine`: the least cosine
similarity over the inputs; in bfloat16 a prompt computed over cached blocks, or padded,
rounds differently).

Workloads (fixed; never change one to meet a target):

* `documents`: 64 distinct inputs of 256 tokens: no reuse, the prefill rate;
* `instructed_queries`: 256 queries of 16 tokens after one 64-token instruction (as
  Qwen3-Embedding and E5-Mistral prompt a query: "Instruct: ...\\nQuery: ..."): the prefix
  cache computes the instruction once;
* `short`: 512 inputs of 8 tokens: the per-input overhead.

Per workload and side: wall seconds, inputs per second, prompt tokens per second (the
inputs' tokens over the wall time), tokens computed (pagedserve: prompt - cached).

    .venv/bin/python benchmarks/embed_bench.py [--model DIR] [--workloads a,b]
        [--batch 16] [--concurrency 4] [--hf-batch 16] [--dtype auto] [--device cpu]
        [--scale 1]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from serve_process import ServeProcess, metric_sum, serve_argv  # noqa: E402

BENCH = "embed_bench"


@dataclass(frozen=True)
class Workload:
    inputs: int
    prefix_tokens: int  # shared by every input (0: none)
    own_tokens: int  # each input's own


WORKLOADS = {
    "documents": Workload(64, 0, 256),
    "instructed_queries": Workload(256, 64, 16),
    "short": Workload(512, 0, 8),
}


def emit(case: str, **figures) -> None:
    print(json.dumps({"bench": BENCH, "case": case, **figures}), flush=True)


def make_inputs(work: Workload, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(work.prefix_tokens)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(work.own_tokens)]
            for _ in range(work.inputs)]


def post(http: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://{http}/v1/embeddings", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=1800) as r:
        return json.loads(r.read())


def run_server(http: str, inputs: list[list[int]], batch: int,
               concurrency: int) -> tuple[np.ndarray, float]:
    """Every input's vector (in input order) and the wall seconds."""
    batches = [list(range(i, min(i + batch, len(inputs)))
                    ) for i in range(0, len(inputs), batch)]
    vectors: list[np.ndarray | None] = [None] * len(inputs)
    lock = threading.Lock()
    cursor = iter(batches)

    def client() -> None:
        while True:
            with lock:
                chunk = next(cursor, None)
            if chunk is None:
                return
            reply = post(http, {"input": [inputs[i] for i in chunk]})
            for d in reply["data"]:
                vectors[chunk[d["index"]]] = np.asarray(d["embedding"], dtype=np.float32)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return np.stack(vectors), time.perf_counter() - t0


def run_hf(model_dir: str, dtype: str, device: str, inputs: list[list[int]],
           batch: int) -> tuple[np.ndarray, float]:
    import torch
    from transformers import AutoModelForCausalLM

    if device == "cpu":
        torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    out = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(inputs), batch):
            chunk = inputs[i:i + batch]
            width = max(map(len, chunk))
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for j, x in enumerate(chunk):
                ids[j, :len(x)] = torch.tensor(x)
                mask[j, :len(x)] = 1
            hidden = model.model(input_ids=ids.to(device),
                                 attention_mask=mask.to(device)).last_hidden_state
            last = hidden[torch.arange(len(chunk)), mask.sum(1).to(device) - 1].float()
            out.append(torch.nn.functional.normalize(last, dim=-1).cpu().numpy())
        if device != "cpu":
            torch.cuda.synchronize()
    return np.concatenate(out), time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--batch", type=int, default=16, help="inputs a request")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--hf-batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply every workload's counts (smoke runs: 0.1)")
    args = p.parse_args()
    from pagedserve.models import resolve_model

    model_dir = str(resolve_model(None if args.model == "default" else args.model))
    threads = ["--cpu-threads", "1"] if args.device == "cpu" else []
    rows = []
    with tempfile.TemporaryDirectory(prefix="embed-bench-") as tmp:
        argv = serve_argv(model_dir, "--executors", "1", "--device", args.device, *threads,
                          "--dtype", args.dtype, "--http-port", "0")
        with ServeProcess(argv, Path(tmp) / "serve.log") as server:
            info = json.loads(urllib.request.urlopen(
                f"http://{server.http_address}/v1/models", timeout=30).read())
            dtype = _served_dtype(server)
            post(server.http_address, {"input": [list(range(3, 40))]})  # warm up
            results = {}
            for name in args.workloads.split(","):
                w = WORKLOADS[name]
                work = Workload(max(1, int(w.inputs * args.scale)), w.prefix_tokens,
                                w.own_tokens)
                inputs = make_inputs(work, _vocab(model_dir), args.seed)
                before = metric_sum(server.metrics(), "pagedserve_prefix_cache_hits_total")
                vectors, wall = run_server(server.http_address, inputs, args.batch,
                                           args.concurrency)
                cached = metric_sum(server.metrics(), "pagedserve_prefix_cache_hits_total") \
                    - before
                results[name] = (inputs, vectors, wall, int(cached))
        assert info["data"], info
    for name, (inputs, vectors, wall, cached) in results.items():
        tokens = sum(map(len, inputs))
        ref, hf_wall = run_hf(model_dir, dtype, args.device, inputs, args.hf_batch)
        cosine = float(np.min(np.sum(vectors * ref, axis=1)))
        for side, seconds, computed in (("pagedserve", wall, tokens - cached),
                                        ("transformers", hf_wall, tokens)):
            fig = dict(workload=name, side=side, inputs=len(inputs), wall_s=round(seconds, 2),
                       inputs_per_s=round(len(inputs) / seconds, 1),
                       prompt_tokens_per_s=round(tokens / seconds, 1),
                       tokens_computed=computed, dtype=dtype, device=args.device,
                       batch=args.batch if side == "pagedserve" else args.hf_batch,
                       concurrency=args.concurrency if side == "pagedserve" else 1)
            if side == "pagedserve":
                fig |= dict(speedup_vs_hf=round(hf_wall / seconds, 2), min_cosine=round(cosine, 5))
            emit(f"{name}/{side}", **fig)
            rows.append(fig)
    print(f"{'workload':20} {'side':13} {'wall s':>7} {'inputs/s':>9} {'tok/s':>8} "
          f"{'computed':>9} {'x HF':>6}", file=sys.stderr)
    for f in rows:
        print(f"{f['workload']:20} {f['side']:13} {f['wall_s']:7.2f} {f['inputs_per_s']:9.1f} "
              f"{f['prompt_tokens_per_s']:8.1f} {f['tokens_computed']:9d} "
              f"{f.get('speedup_vs_hf', ''):>6}", file=sys.stderr)


def _vocab(model_dir: str) -> int:
    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


def _served_dtype(server: ServeProcess) -> str:
    """The dtype the executors run (GetModelInfo's), for transformers to run the same."""
    import grpc
    from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
    from pagedserve.protos.generated.pagedserve.v1 import generate_pb2_grpc as pb_grpc

    with grpc.insecure_channel(server.address) as channel:
        info = pb_grpc.GeneratorStub(channel).GetModelInfo(pb.ModelInfoRequest(), timeout=30)
    return info.dtype


if __name__ == "__main__":
    main()
