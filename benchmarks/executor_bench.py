"""Executor step benchmark (DESIGN §8): one JSON object per line on stdout.

Cases:
* ``cpu_tiny_decode_b{1,32,128}``: decode step time of the tiny random Llama (tinymodels
  defaults, fp32, --cpu-threads 1) at context ~128, through ModelRunner.execute (plan
  handling + forward + sampling, the executor's whole step minus the socket);
* ``gpu_qwen2.5-0.5b_decode_b{64,256}`` (CUDA only, else one ``skipped`` line): decode
  tokens/s of a random-weight Qwen2.5-0.5B-shaped model (bf16) at context 1k, next to the
  bandwidth bound ``batch / ((weight bytes + KV bytes read) / measured copy bandwidth)``.
  With ``--model-dir`` the model is that directory loaded as the executor loads it (the GPU
  check builds a random-weight Qwen2.5-0.5B-shape one: scripts/gpu_steps.py build-model);
  without, the same shape is initialised in place on the device.
* ``gpu_qwen2.5-0.5b_decode_b{1,8}`` and ``..._b{1,8,64,256}_graphs``: the same at batch
  1 and 8, and each batch with the decode step replayed as a CUDA graph
  (executor/cuda_graphs.py; only that batch size captured) instead of launched eagerly.

Sequences enter as take-overs: a NewRequest with a full prompt whose keys/values are
already "in the cache" (random), so no prefill is timed or needed.

    .venv/bin/python benchmarks/executor_bench.py [--steps N] [--cpu-only] [--gpu-only]
        [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from pagedserve.executor.cache_engine import CacheEngine
from pagedserve.executor.cuda_graphs import DecodeGraphs
from pagedserve.executor.model_runner import ModelRunner, build_runner
from pagedserve.executor.models import LlamaForCausalLM, ModelConfig
from pagedserve.protos.wire import NewRequest, SamplingParams, StepPlan, int32

BENCH = "executor_bench"


def emit(case: str, **figures) -> None:
    print(json.dumps({"bench": BENCH, "case": case, **figures}), flush=True)


def decode_plans(batch: int, context: int, block_size: int, steps: int, vocab: int):
    """Plans: step 0 registers ``batch`` requests with ``context`` prompt tokens already
    computed and decodes one token each; the next steps decode one more token each."""
    rng = np.random.default_rng(0)
    blocks_per_seq = (context + steps + block_size) // block_size
    tables = np.arange(batch * blocks_per_seq, dtype=np.int32).reshape(batch, blocks_per_seq)
    greedy = SamplingParams(temperature=0.0)
    ids = [f"s{i}" for i in range(batch)]
    for step in range(steps):
        pos = context + step
        new = [] if step else [
            NewRequest(request_id=r, prompt_token_ids=int32(rng.integers(0, vocab, context)),
                       output_token_ids=int32([]), sampling=greedy) for r in ids]
        yield StepPlan(
            step_id=step, new_requests=new, request_ids=ids,
            num_computed_tokens=int32([pos] * batch), num_new_tokens=int32([1] * batch),
            do_sample=np.ones(batch, np.uint8),
            token_ids=int32(rng.integers(0, vocab, batch)), positions=int32([pos] * batch),
            slot_mapping=(tables[:, pos // block_size].astype(np.int64) * block_size
                          + pos % block_size),
            block_table_starts=int32([0 if step == 0 else blocks_per_seq] * batch),
            block_table_lens=int32([blocks_per_seq if step == 0 else 0] * batch),
            block_table_ids=tables.reshape(-1) if step == 0 else int32([]),
        )


def time_steps(runner: ModelRunner, plans) -> list[float]:
    times = []
    for plan in plans:
        t0 = time.perf_counter()
        result = runner.execute(plan)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        assert not result.errors, result.errors
    return times[2:]  # warm-up: registration step and the first decode


def bench_cpu(steps: int) -> None:
    from pagedserve.tinymodels import build_model

    torch.set_num_threads(1)
    context, block_size = 128, 16
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(tmp + "/tiny", "llama")
        for batch in (1, 32, 128):
            num_blocks = batch * ((context + steps + block_size) // block_size)
            runner = build_runner(str(model_dir), num_gpu_blocks=num_blocks, num_cpu_blocks=0,
                                  block_size=block_size, progress=False)
            times = time_steps(runner, decode_plans(batch, context, block_size, steps,
                                                    runner.vocab_size))
            p50 = statistics.median(times)
            emit(f"cpu_tiny_decode_b{batch}", batch=batch, context_tokens=context,
                 step_us_p50=round(p50 * 1e6, 1), decode_tok_per_s=round(batch / p50, 1),
                 threads=1, device="cpu")


def qwen25_05b_config() -> ModelConfig:
    return ModelConfig(
        architecture="Qwen2ForCausalLM", vocab_size=151936, hidden_size=896,
        intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
        rms_norm_eps=1e-6, max_model_len=32768, tie_word_embeddings=True, qkv_bias=True,
        o_bias=False, mlp_bias=False, qk_norm=False, rope_theta=1e6, torch_dtype="bfloat16",
    )


def copy_bandwidth_bytes_per_s(device, num_bytes: int = 1 << 30) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * num_bytes * 10 / (time.perf_counter() - t0)  # read + write


def bench_gpu(steps: int, model_dir: str | None = None) -> None:
    if not torch.cuda.is_available():
        emit("gpu_qwen2.5-0.5b_decode", skipped="no CUDA device")
        return
    device, dtype = torch.device("cuda", 0), torch.bfloat16
    if model_dir:
        from pagedserve.executor.models import load_config, load_model

        cfg = load_config(model_dir)
        model = load_model(model_dir, dtype, device, cfg, progress=False)
    else:
        cfg = qwen25_05b_config()
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        model = model.to_empty(device=device).to(dtype)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)
        model.cos_sin_cache = LlamaForCausalLM.rope_cache(cfg).to(device)
        model.eval().requires_grad_(False)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = copy_bandwidth_bytes_per_s(device)
    context, block_size = 1024, 16
    kv_bytes_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    blocks_per_seq = (context + steps + block_size) // block_size
    cases = [(64, False), (256, False), (1, False), (8, False),
             (1, True), (8, True), (64, True), (256, True)]
    for batch, graphed in cases:
        num_blocks = batch * blocks_per_seq
        cache = CacheEngine(cfg, block_size, num_blocks, 0, dtype, device)
        cache.kv_cache.normal_()
        graphs = None
        if graphed:
            graphs = DecodeGraphs(model, cache.kv_cache, block_size,
                                  blocks_per_seq * block_size, batch)
            graphs.capture([batch])
        runner = ModelRunner(model, cache, graphs=graphs)
        times = time_steps(runner, decode_plans(batch, context, block_size, steps,
                                                cfg.vocab_size))
        assert runner.graph_steps == (steps if graphed else 0), runner.graph_steps
        p50 = statistics.median(times)
        bytes_read = weight_bytes + batch * (context + steps // 2) * kv_bytes_per_token
        bound_s = bytes_read / bandwidth
        suffix = "_graphs" if graphed else ""
        emit(f"gpu_qwen2.5-0.5b_decode_b{batch}{suffix}", batch=batch, context_tokens=context,
             step_us_p50=round(p50 * 1e6, 1), decode_tok_per_s=round(batch / p50, 1),
             bound_tok_per_s=round(batch / bound_s, 1), of_bound_ratio=round(bound_s / p50, 3),
             weight_bytes=weight_bytes, kv_read_bytes=bytes_read - weight_bytes,
             copy_bandwidth_gb_per_s=round(bandwidth / 1e9, 1),
             device=torch.cuda.get_device_name(device),
             model="loaded" if model_dir else "initialised in place",
             cuda_graphs=graphed)
        del cache, runner, graphs
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--cpu-only", action="store_true")
    parser.add_argument("--gpu-only", action="store_true")
    parser.add_argument("--model-dir", default=None,
                        help="GPU cases: load this model directory (bf16) instead")
    args = parser.parse_args(argv)
    if not args.gpu_only:
        bench_cpu(args.steps)
    if not args.cpu_only:
        bench_gpu(args.steps, args.model_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
