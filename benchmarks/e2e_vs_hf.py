"""End to end: pagedserve (router + 1 CPU executor) against transformers `generate`.

The same tiny random-weight Llama, the same prompts (random token ids; input lengths uniform
in [16, 512], output lengths uniform in [16, 256], seeded), greedy, EOS ignored, fp32,
one torch thread on both sides (the executor runs with --cpu-threads 1; HF with
torch.set_num_threads(1)), so neither side gets more cores than the other.

- pagedserve: `pagedserve serve --executors 1 --num-gpu-blocks N` started by this script;
  all requests sent at once over gRPC streams (`pagedserve.bench.run_bench`).
- HF: `model.generate` over padded batches in the prompts' order (left padding, attention
  mask, max_new_tokens = the batch's longest output, min_new_tokens the same). A padded batch
  runs every row to the batch's longest output; only each request's own output length is
  counted, so both sides are credited with the same tokens.

Cases (one JSON line each, DESIGN §8):
  pagedserve           output tok/s of the server run;
  hf_equal_kv          HF at the batch that fits pagedserve's KV token budget at the longest
                       prompt + output: num_gpu_blocks * block_size // (max_in + max_out);
  hf_batch_B           HF at batch B in --hf-batches (8, 32, 128, 256); a size whose first
                       batch shows it would run past --hf-budget-s is measured on the batches
                       that fit the budget (at least one) and says so (`batches_run`);
  summary              ratios: pagedserve / hf_equal_kv (target >= 3), pagedserve / best HF
                       (target >= 1).

    .venv/bin/python benchmarks/e2e_vs_hf.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pagedserve.bench import BenchConfig, BenchRequest, run_bench  # noqa: E402

BENCH = "e2e_vs_hf"
READY = re.compile(r"pagedserve ready grpc=(\S+) metrics=(\S+) executors=(\d+)")
BLOCK_SIZE = 16
# The router's default step budget (DESIGN §4). (An earlier run needed 2048 to dodge the
# wire's old 64-frame cap on plans admitting many requests; the cap was fixed in 3572485.)
MAX_NUM_BATCHED_TOKENS = 8192
REQUEST_TIMEOUT_S = 900.0
# The tiny model (chosen so the full run takes a few minutes on a 2-core VM): Llama, hidden
# 256, 4 layers, 8 query heads / 2 KV heads (head dim 32), MLP 512, vocab 512.
MODEL = dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
             intermediate_size=512, max_position_embeddings=1024, seed=7)


def emit(case: str, **figures) -> None:
    print(json.dumps({"bench": BENCH, "case": case, **figures}), flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_prompts(n: int, in_range, out_range, vocab: int, seed: int) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(in_range[0], in_range[1] + 1, size=n)
    out_lens = rng.integers(out_range[0], out_range[1] + 1, size=n)
    return [BenchRequest(None, tuple(int(x) for x in rng.integers(3, vocab, size=int(a))),
                         int(b), int(a)) for a, b in zip(in_lens, out_lens, strict=True)]


def run_pagedserve(model_dir: Path, prompts: list[BenchRequest], num_gpu_blocks: int,
                   max_num_seqs: int, server_log: str | None = None) -> dict:
    cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--model", str(model_dir),
           "--executors", "1", "--port", "0", "--metrics-port", "0", "--http-port", "-1",
           "--executor-bind", f"tcp://127.0.0.1:{free_port()}", "--cpu-threads", "1",
           "--num-gpu-blocks", str(num_gpu_blocks), "--block-size", str(BLOCK_SIZE),
           "--max-num-seqs", str(max_num_seqs), "--swap-space", "0",
           "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # Closed in the finally below.
    log = open(server_log, "w+") if server_log else tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        grpc_addr = metrics_addr = None
        while time.monotonic() < deadline and grpc_addr is None:
            if proc.poll() is not None:
                break
            log.seek(0)
            m = READY.search(log.read())
            if m:
                grpc_addr, metrics_addr = m.group(1), m.group(2)
            else:
                time.sleep(0.2)
        if grpc_addr is None:
            log.seek(0)
            raise RuntimeError("pagedserve serve did not start:\n" + log.read()[-3000:])
        cfg = BenchConfig(address=grpc_addr, metrics_address=metrics_addr,
                          temperature=0.0, ignore_eos=True, progress=False,
                          timeout_s=REQUEST_TIMEOUT_S)
        res = asyncio.run(run_bench(cfg, prompts))
        res.update(forward_breakdown(metrics_addr))
        log.seek(0)
        rejected = [x for x in log.read().splitlines() if "rejected" in x]
        if rejected:
            res["server_rejections"] = rejected[:3]
        return res
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def forward_breakdown(metrics_address: str) -> dict:
    """Executor forward time (the model alone) and step count from the router's /metrics."""
    import urllib.request
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as r:
        text = r.read().decode()
    sums = {}
    for line in text.splitlines():
        m = re.match(r"^(pagedserve_step_forward_seconds_(?:sum|count))\{[^}]*\}\s+(\S+)", line)
        if m:
            sums[m.group(1)] = sums.get(m.group(1), 0.0) + float(m.group(2))
    return {"forward_s": round(sums.get("pagedserve_step_forward_seconds_sum", 0.0), 2),
            "num_steps": int(sums.get("pagedserve_step_forward_seconds_count", 0))}


class HFRunner:
    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM
        torch.set_num_threads(1)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model.eval()
        self.pad_id = self.model.config.pad_token_id or 0

    def batch(self, reqs: list[BenchRequest]) -> tuple[float, int]:
        """Generate one padded batch; returns (seconds, counted output tokens)."""
        torch = self.torch
        width = max(r.prompt_len for r in reqs)
        ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, r in enumerate(reqs):  # left padding
            ids[i, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
            mask[i, width - r.prompt_len:] = 1
        max_new = max(r.max_tokens for r in reqs)
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, max_new_tokens=max_new,
                                      min_new_tokens=max_new, do_sample=False,
                                      eos_token_id=None, pad_token_id=self.pad_id)
        elapsed = time.perf_counter() - start
        assert out.shape[1] == width + max_new
        return elapsed, sum(r.max_tokens for r in reqs)

    def run(self, prompts: list[BenchRequest], batch_size: int, budget_s: float) -> dict:
        batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
        total_s, tokens, run = 0.0, 0, 0
        for b in batches:
            s, t = self.batch(b)
            total_s, tokens, run = total_s + s, tokens + t, run + 1
            # Bounded time: stop once the next batch would likely pass the budget.
            if total_s + total_s / run > budget_s:
                break
        return {"batch_size": batch_size, "batches_run": run, "batches_total": len(batches),
                "wall_s": round(total_s, 2), "output_tokens": tokens,
                "output_tok_per_s": round(tokens / total_s, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 24 prompts, shorter lengths, HF batches 8 and 24")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--num-gpu-blocks", type=int, default=1536,
                   help="pagedserve's KV cache (blocks of 16 tokens); sets the equal-KV batch")
    p.add_argument("--hf-batches", default="8,32,128,256")
    p.add_argument("--hf-budget-s", type=float, default=60.0,
                   help="time for one HF batch size (stops after the batch that passes it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-log", default=None, help="keep pagedserve's output in this file")
    p.add_argument("--model-dir", default=None, help="reuse/build the tiny model here")
    args = p.parse_args()

    in_range, out_range = (16, 512), (16, 256)
    hf_batches = [int(x) for x in args.hf_batches.split(",")]
    num_prompts = args.num_prompts
    if args.quick:
        in_range, out_range, num_prompts = (16, 128), (8, 32), 24
        hf_batches = [8, 24]

    from pagedserve.tinymodels import build_model
    model_dir = Path(args.model_dir or Path(tempfile.gettempdir()) / "pagedserve_e2e_model")
    if not (model_dir / "model.safetensors").is_file():
        build_model(model_dir, "llama", **MODEL)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(num_prompts, in_range, out_range, vocab, args.seed)
    counted = sum(r.max_tokens for r in prompts)
    longest = in_range[1] + out_range[1]
    kv_tokens = args.num_gpu_blocks * BLOCK_SIZE
    equal_kv_batch = max(1, kv_tokens // longest)
    print(f"model {MODEL}; {num_prompts} prompts, input {in_range}, output {out_range}, "
          f"{counted} output tokens; KV {args.num_gpu_blocks} blocks x {BLOCK_SIZE} = "
          f"{kv_tokens} tokens -> equal-KV HF batch {equal_kv_batch}", file=sys.stderr)

    ps = run_pagedserve(model_dir, prompts, args.num_gpu_blocks, max_num_seqs=256,
                        server_log=args.server_log)
    assert ps["failed"] == 0, (ps.get("errors"), ps.get("server_rejections"))
    assert ps["total_output_tokens"] == counted, (ps["total_output_tokens"], counted)
    ps_tok_s = ps["total_output_tokens"] / ps["duration_s"]
    emit("pagedserve", num_prompts=num_prompts, num_gpu_blocks=args.num_gpu_blocks,
         kv_tokens=kv_tokens, wall_s=ps["duration_s"], output_tokens=ps["total_output_tokens"],
         output_tok_per_s=round(ps_tok_s, 1), ttft_ms_p50=ps["ttft_ms_p50"],
         tpot_ms_p50=ps["tpot_ms_p50"], prefix_hit_ratio=ps.get("prefix_hit_ratio"),
         executor_forward_s=ps["forward_s"], num_steps=ps["num_steps"],
         forward_share_ratio=round(ps["forward_s"] / ps["duration_s"], 3))
    print(f"pagedserve: {ps_tok_s:.0f} output tok/s in {ps['duration_s']:.1f} s",
          file=sys.stderr)

    hf = HFRunner(model_dir)
    hf.batch(prompts[:2])  # warm-up (first-call allocations), not timed
    results = {}
    for b in sorted({equal_kv_batch, *hf_batches}):
        r = hf.run(prompts, b, args.hf_budget_s)
        results[b] = r
        case = f"hf_batch_{b}"
        emit(case, **r, equal_kv=b == equal_kv_batch)
        if b == equal_kv_batch:
            emit("hf_equal_kv", **r)
        note = "" if r["batches_run"] == r["batches_total"] else (
            f" (time-bounded: {r['batches_run']} of {r['batches_total']} batches)")
        print(f"HF batch {b}: {r['output_tok_per_s']:.0f} output tok/s{note}",
              file=sys.stderr)
    best_b = max((b for b in results if b in hf_batches),
                 key=lambda b: results[b]["output_tok_per_s"])
    eq = results[equal_kv_batch]["output_tok_per_s"]
    best = results[best_b]["output_tok_per_s"]
    summary = dict(pagedserve_tok_per_s=round(ps_tok_s, 1), equal_kv_batch=equal_kv_batch,
                   hf_equal_kv_tok_per_s=eq, equal_kv_ratio=round(ps_tok_s / eq, 2),
                   equal_kv_target_ratio=3.0, hf_best_batch=best_b, hf_best_tok_per_s=best,
                   best_hf_ratio=round(ps_tok_s / best, 2), best_hf_target_ratio=1.0)
    emit("summary", **summary)
    print(f"pagedserve / HF equal-KV (batch {equal_kv_batch}): {ps_tok_s / eq:.2f}x "
          f"(target 3x); pagedserve / HF best (batch {best_b}): {ps_tok_s / best:.2f}x "
          f"(target 1x)", file=sys.stderr)
    return 0 if not math.isnan(ps_tok_s) else 1


if __name__ == "__main__":
    sys.exit(main())
