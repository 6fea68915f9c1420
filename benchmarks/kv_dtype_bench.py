"""An fp8 KV cache against the model's own dtype (``--kv-cache-dtype``), on the built-in
model on this CPU: what it gives (blocks), what it costs (step time), what it changes
(tokens, log-probabilities). One JSON line each (DESIGN §8):

* ``blocks``: device blocks in ``--kv-cache-space 1`` GiB and bytes a block, per cache dtype;
* ``decode_b{B}``: B requests decoding one token each at context ~256 (take-overs, as in
  executor_bench.py), the step's time per cache dtype (a CPU executor widens the gathered
  fp8 keys and values to float32 before its matmuls);
* ``greedy_agreement``: the first 32 greedy tokens of 8 chat prompts with the fp8 cache
  against the model's dtype (the share of tokens equal up to the first difference, and the
  prompts wholly equal): dtype_bench.py's measure;
* ``logprob_drift``: teacher-forced, each chat prompt followed by the model-dtype run's 32
  tokens, scored in one prefill (prompt logprobs: the cache's rounded keys and values are
  what the prompt's attention reads): the mean and largest |log p_fp8 - log p| of those
  tokens, and the share whose rank-1 status differs.

The model computes in ``--dtype`` (default float32, the CPU default of the built-in
bfloat16 checkpoint on a machine without native bfloat16; dtype_bench.py).

    .venv/bin/python benchmarks/kv_dtype_bench.py [--model default] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import msgspec
import numpy as np
import torch
from dtype_bench import CHATS, agreement, greedy, prefill_plan
from executor_steps import decode_plans
from pagedserve.executor.cache_engine import block_bytes
from pagedserve.executor.runner_setup import build_runner
from pagedserve.protos.wire import SamplingParams

BENCH = "kv_dtype_bench"
KV_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")


def emit(case: str, **figures) -> None:
    print(json.dumps({"bench": BENCH, "case": case, **figures}), flush=True)


def scored(runner, ids: list[int], block_size: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """(logprob, rank) of each of ``ids[1:]`` given the tokens before it, one prefill."""
    plan = prefill_plan(step, f"s{step}", ids, block_size, room=1)
    request = msgspec.structs.replace(
        plan.new_requests[0], sampling=SamplingParams(temperature=0.0, prompt_logprobs=0))
    plan = msgspec.structs.replace(plan, new_requests=[request])
    result = runner.execute(plan)
    return np.asarray(result.prompt_logprobs), np.asarray(result.prompt_ranks)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=12, help="decode steps timed")
    args = parser.parse_args(argv)
    from tokenizers import Tokenizer

    from pagedserve.models import resolve_model
    model_dir = str(resolve_model(args.model))
    torch.set_num_threads(1)
    block_size, context = 16, 256
    tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    chat_ids = [tok.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n").ids
                for q in CHATS]
    outputs: dict[str, list[list[int]]] = {}
    scores: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for kv in KV_DTYPES:
        runner = build_runner(model_dir, dtype=args.dtype, kv_cache_space=1.0,
                              num_cpu_blocks=0, block_size=block_size, progress=False,
                              kv_cache_dtype=kv)
        cache_dtype = runner.cache.kv_cache.dtype
        emit("blocks", kv_cache_dtype=kv, dtype=str(cache_dtype).removeprefix("torch."),
             kv_cache_space_gib=1.0, num_blocks=runner.cache.num_gpu_blocks,
             block_bytes=block_bytes(runner.model.config, block_size, cache_dtype))
        del runner
        vocab = None
        for batch in (1, 8, 32):
            runner = build_runner(model_dir, dtype=args.dtype, num_gpu_blocks=batch * 20 + 8,
                                  num_cpu_blocks=0, block_size=block_size, progress=False,
                                  kv_cache_dtype=kv)
            vocab = runner.vocab_size
            times = []
            for plan in decode_plans(batch, context, block_size, args.repeats, vocab):
                t0 = time.perf_counter()
                runner.execute(plan)
                times.append(time.perf_counter() - t0)
            p50 = statistics.median(times[2:])
            emit(f"decode_b{batch}", kv_cache_dtype=kv, dtype=args.dtype,
                 context_tokens=context, step_ms_p50=round(p50 * 1e3, 2),
                 decode_tok_per_s=round(batch / p50, 1), threads=1)
        runner = build_runner(model_dir, dtype=args.dtype, num_gpu_blocks=64, num_cpu_blocks=0,
                              block_size=block_size, progress=False, kv_cache_dtype=kv)
        outputs[kv] = [greedy(runner, ids, 32, block_size, 1000 * i)
                       for i, ids in enumerate(chat_ids)]
        scores[kv] = [scored(runner, ids + outputs["auto"][i], block_size, 50_000 + i)
                      for i, ids in enumerate(chat_ids)]
        del runner
    for kv in KV_DTYPES[1:]:
        emit("greedy_agreement", kv_cache_dtype=kv, against="auto", dtype=args.dtype,
             prompts=len(CHATS), tokens_each=32, **agreement(outputs["auto"], outputs[kv]))
        drift, top_changed, count = [], 0, 0
        for i, ids in enumerate(chat_ids):
            tail = slice(len(ids) - 1, None)  # the 32 continuation tokens' scores
            (lp, rank), (lp8, rank8) = scores["auto"][i], scores[kv][i]
            drift.extend(np.abs(lp8[tail] - lp[tail]).tolist())
            top_changed += int(((rank[tail] == 1) != (rank8[tail] == 1)).sum())
            count += lp[tail].shape[0]
        emit("logprob_drift", kv_cache_dtype=kv, against="auto", dtype=args.dtype,
             tokens=count, mean_abs_logprob_diff=round(statistics.fmean(drift), 5),
             max_abs_logprob_diff=round(max(drift), 4),
             top1_changed_ratio=round(top_changed / count, 4))
    return 0


if __name__ == "__main__":
    sys.exit(main())
