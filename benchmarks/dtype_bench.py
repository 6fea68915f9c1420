"""float32 vs bfloat16 on this CPU for the built-in model (DESIGN §8): one JSON line each.

The built-in SmolLM2-135M-Instruct (converted from its Q4_1 GGUF) through the executor's
own ModelRunner.execute (plan handling + forward + sampling), one torch thread, as a CPU
executor runs it:

* ``prefill_{N}``: one request of N prompt tokens, the whole prompt in one step;
* ``decode_b{B}``: B requests decoding one token each at context ~256 (take-overs, as in
  executor_bench.py);
* ``greedy_agreement``: the first 32 greedy tokens of 8 chat prompts, bfloat16 vs float32
  compute (the share of tokens equal up to the first difference), both from the same stored
  weights (cast at load);
* ``storage_agreement``: the same, both computed in float32, from the weights as given and
  from a copy rounded to bfloat16 (what storing the conversion in bfloat16 would change);
* ``checkpoint_bytes``: the size of model.safetensors in each storage dtype.

The last two need a float32 checkpoint (the built-in model is stored in bfloat16 since its
conversion changed; ``storage_agreement`` then says it was skipped).

    .venv/bin/python benchmarks/dtype_bench.py [--model DIR] [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from executor_steps import decode_plans, finish_plan
from pagedserve.executor.runner_setup import build_runner
from pagedserve.protos.wire import NewRequest, SamplingParams, StepPlan, int32

from pagedserve.cpu_dtypes import checkpoint_dtype

BENCH = "dtype_bench"
CHATS = ["What is the capital of France?", "Write a haiku about the sea.",
         "Explain what a KV cache is in one sentence.", "List three prime numbers.",
         "用一句话介绍北京。", "Write a Python function that adds two numbers.",
         "What does 🚀 usually mean in a chat?", "Give me a synonym for happy."]


def emit(case: str, **figures) -> None:
    print(json.dumps({"bench": BENCH, "case": case, **figures}), flush=True)


def prefill_plan(step: int, rid: str, ids: list[int], block_size: int,
                 finished: tuple[str, ...] = (), room: int = 0) -> StepPlan:
    """`room`: output tokens the block table must also hold."""
    n = len(ids)
    blocks = (n + room + block_size) // block_size
    table = np.arange(blocks, dtype=np.int32)
    return StepPlan(
        step_id=step, new_requests=[NewRequest(
            request_id=rid, prompt_token_ids=int32(ids), output_token_ids=int32([]),
            sampling=SamplingParams(temperature=0.0))],
        request_ids=[rid], num_computed_tokens=int32([0]), num_new_tokens=int32([n]),
        do_sample=np.ones(1, np.uint8), token_ids=int32(ids), positions=int32(range(n)),
        slot_mapping=np.arange(n, dtype=np.int64), block_table_starts=int32([0]),
        block_table_lens=int32([blocks]), block_table_ids=table, finished_ids=list(finished))


def decode_plan(step: int, rid: str, token: int, pos: int, table_len: int) -> StepPlan:
    """One decode; the block table (`table_len` blocks, from the prefill) is unchanged."""
    return StepPlan(
        step_id=step, new_requests=[], request_ids=[rid], num_computed_tokens=int32([pos]),
        num_new_tokens=int32([1]), do_sample=np.ones(1, np.uint8), token_ids=int32([token]),
        positions=int32([pos]), slot_mapping=np.array([pos], dtype=np.int64),
        block_table_starts=int32([table_len]),
        block_table_lens=int32([0]), block_table_ids=int32([]), finished_ids=[])


def greedy(runner, ids: list[int], max_tokens: int, block_size: int, step0: int) -> list[int]:
    """One request, greedy, through execute(): prefill then single-token decodes."""
    rid = f"g{step0}"
    out = []
    result = runner.execute(prefill_plan(step0, rid, ids, block_size, room=max_tokens))
    token = int(result.token_ids[0])
    pos = len(ids)
    for k in range(max_tokens - 1):
        out.append(token)
        table_len = (len(ids) + max_tokens + block_size) // block_size
        result = runner.execute(decode_plan(step0 + 1 + k, rid, token, pos, table_len))
        token = int(result.token_ids[0])
        pos += 1
    out.append(token)
    runner.execute(finish_plan(step0 + max_tokens + 1, [rid]))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    from tokenizers import Tokenizer

    from pagedserve.models import resolve_model
    model_dir = str(resolve_model(args.model))
    torch.set_num_threads(1)
    block_size, context, steps = 16, 256, 12
    tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    chat_ids = [tok.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n").ids
                for q in CHATS]
    outputs: dict[str, list[list[int]]] = {}
    for dtype in ("float32", "bfloat16"):
        runner = build_runner(model_dir, dtype=dtype, num_gpu_blocks=2200, num_cpu_blocks=0,
                              block_size=block_size, progress=False)
        vocab = runner.vocab_size
        rng = np.random.default_rng(0)
        for n in (128, 512):
            times = []
            for r in range(args.repeats + 1):
                ids = rng.integers(0, vocab, n).tolist()
                t0 = time.perf_counter()
                done = (f"p{n}-{r - 1}",) if r else ()
                runner.execute(prefill_plan(10_000 + r, f"p{n}-{r}", ids, block_size, done))
                times.append(time.perf_counter() - t0)
            p50 = statistics.median(times[1:])
            emit(f"prefill_{n}", dtype=dtype, step_ms_p50=round(p50 * 1e3, 1),
                 prefill_tok_per_s=round(n / p50, 1), threads=1)
        for batch in (1, 8, 32):
            runner = build_runner(model_dir, dtype=dtype, num_gpu_blocks=batch * 20 + 8,
                                  num_cpu_blocks=0, block_size=block_size, progress=False)
            times = []
            for plan in decode_plans(batch, context, block_size, steps, vocab):
                t0 = time.perf_counter()
                runner.execute(plan)
                times.append(time.perf_counter() - t0)
            p50 = statistics.median(times[2:])
            emit(f"decode_b{batch}", dtype=dtype, context_tokens=context,
                 step_ms_p50=round(p50 * 1e3, 2), decode_tok_per_s=round(batch / p50, 1),
                 threads=1)
        runner = build_runner(model_dir, dtype=dtype, num_gpu_blocks=64, num_cpu_blocks=0,
                              block_size=block_size, progress=False)
        outputs[dtype] = [greedy(runner, ids, 32, block_size, 1000 * i)
                          for i, ids in enumerate(chat_ids)]
        del runner
    emit("greedy_agreement", prompts=len(CHATS), tokens_each=32,
         **agreement(outputs["float32"], outputs["bfloat16"]))
    with open(os.path.join(model_dir, "config.json")) as f:
        stored = checkpoint_dtype(json.load(f))
    if stored != "float32":  # rounding a bfloat16 checkpoint to bfloat16 would compare a copy
        emit("storage_agreement", skipped=f"the model is stored in {stored}; pass --model "
             "with a float32 checkpoint to measure what storing it in bfloat16 changes")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        rounded = bf16_copy(model_dir, tmp)
        runner = build_runner(rounded, dtype="float32", num_gpu_blocks=64, num_cpu_blocks=0,
                              block_size=block_size, progress=False)
        stored_bf16 = [greedy(runner, ids, 32, block_size, 1000 * i)
                       for i, ids in enumerate(chat_ids)]
        emit("storage_agreement", prompts=len(CHATS), tokens_each=32, compute="float32",
             **agreement(outputs["float32"], stored_bf16))
        sizes = {dtype: os.path.getsize(os.path.join(d, "model.safetensors"))
                 for dtype, d in (("float32", model_dir), ("bfloat16", rounded))}
        emit("checkpoint_bytes", **{f"{k}_bytes": v for k, v in sizes.items()})
    return 0


def agreement(a_outputs: list[list[int]], b_outputs: list[list[int]]) -> dict:
    same = total = identical = 0
    for a, b in zip(a_outputs, b_outputs, strict=True):
        k = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        same += k
        total += len(a)
        identical += k == len(a)
    return {"equal_prefix_ratio": round(same / total, 3), "identical_prompts": identical}


def bf16_copy(model_dir: str, out: str) -> str:
    """`model_dir` with its weights rounded to bfloat16 (and back: the stored values)."""
    from safetensors.torch import load_file, save_file
    for name in os.listdir(model_dir):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(model_dir, name), out)
    for name in os.listdir(model_dir):
        if name.endswith(".safetensors"):
            tensors = load_file(os.path.join(model_dir, name))
            save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()},
                      os.path.join(out, name), metadata={"format": "pt"})
    return out


if __name__ == "__main__":
    sys.exit(main())
