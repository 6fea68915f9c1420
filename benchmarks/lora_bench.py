"""What serving LoRA adapters costs an executor's step (``--lora-modules``), on the built-in
model on this CPU. Random adapters of rank 16 on all seven projections of every layer
(tinymodels.build_lora_adapter: PEFT's format), float32, one torch thread. One JSON line a
case and setting (DESIGN §8):

* ``decode_b{B}``: B requests decoding one token each at context ~256 (executor_steps.py's
  decode plans), the step's time with ``adapters`` loaded (0, 1 or 4) and ``with_adapter``
  of the B rows running one (the rows take the first ``distinct_in_step`` adapters in turn):
  0 loaded; 4 loaded and no row using one (such a step builds no mask: the base model's
  step); 1 loaded, every row; 4 loaded, every row, mixed; 16 loaded, every row the same
  one; 16 loaded, every row, as many distinct as the batch allows (up to 16);
* ``prefill_{N}``: one prompt of N tokens computed whole (the time to its first token),
  with no adapter and with one.

    .venv/bin/python benchmarks/lora_bench.py [--model default] [--rank 16] [--repeats 12]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np
import torch
from executor_steps import decode_plans
from pagedserve.executor.runner_setup import build_runner
from pagedserve.protos.wire import NewRequest, SamplingParams, StepPlan

from pagedserve.tinymodels import build_lora_adapter

BENCH = "lora_bench"


def emit(case: str, **figures) -> None:
    print(json.dumps({"bench": BENCH, "case": case, **figures}), flush=True)


def with_adapters(plan: StepPlan, names: list[str], using: int) -> StepPlan:
    """``plan`` with its first ``using`` new requests running ``names`` in turn."""
    if not names or not plan.new_requests:
        return plan
    new = [msgspec.structs.replace(r, lora=names[i % len(names)]) if i < using else r
           for i, r in enumerate(plan.new_requests)]
    return msgspec.structs.replace(plan, new_requests=new)


def prefill_plan(step: int, length: int, vocab: int, block_size: int, lora: str) -> StepPlan:
    """One new request of ``length`` random prompt tokens, computed whole and sampled."""
    rng = np.random.default_rng(step)
    ids = rng.integers(0, vocab, length).astype(np.int32)
    blocks = np.arange(-(-length // block_size), dtype=np.int32)
    pos = np.arange(length)
    i32 = np.int32
    return StepPlan(
        step_id=step, request_ids=[f"p{step}"],
        new_requests=[NewRequest(request_id=f"p{step}", prompt_token_ids=ids,
                                 output_token_ids=np.zeros(0, i32),
                                 sampling=SamplingParams(temperature=0.0), lora=lora)],
        num_computed_tokens=np.zeros(1, i32), num_new_tokens=np.array([length], i32),
        do_sample=np.ones(1, np.uint8), token_ids=ids, positions=pos.astype(i32),
        slot_mapping=(blocks[pos // block_size].astype(np.int64) * block_size
                      + pos % block_size),
        block_table_starts=np.zeros(1, i32), block_table_lens=np.array([blocks.shape[0]], i32),
        block_table_ids=blocks, finished_ids=[f"p{step - 1}"] if step else [])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=12, help="steps timed a setting")
    args = parser.parse_args(argv)
    from pagedserve.models import resolve_model

    model_dir = str(resolve_model(args.model))
    torch.set_num_threads(1)
    block_size, context = 16, 256
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [(f"a{i}", str(build_lora_adapter(
            model_dir, Path(tmp) / f"a{i}", rank=args.rank, alpha=2.0 * args.rank,
            std=0.02, seed=i))) for i in range(16)]
        # (adapters loaded, of them in use in a step)
        settings = [(0, 0), (4, 0), (1, 1), (4, 4), (16, 1), (16, 16)]
        for batch in (1, 8, 32):
            for loaded, in_use in settings:
                if in_use > batch:  # 16 distinct: as many as the batch has, from 8 rows
                    if (loaded, in_use) != (16, 16) or batch < 8:
                        continue
                    in_use = batch
                runner = build_runner(model_dir, dtype="float32",
                                      num_gpu_blocks=batch * 20 + 8, num_cpu_blocks=0,
                                      block_size=block_size, progress=False,
                                      lora_modules=tuple(adapters[:loaded]))
                names = [name for name, _ in adapters[:in_use]]
                times = []
                for plan in decode_plans(batch, context, block_size, args.repeats,
                                         runner.vocab_size):
                    plan = with_adapters(plan, names, batch if names else 0)
                    t0 = time.perf_counter()
                    runner.execute(plan)
                    times.append(time.perf_counter() - t0)
                p50 = statistics.median(times[2:])
                emit(f"decode_b{batch}", adapters=loaded, with_adapter=batch if in_use else 0,
                     distinct_in_step=in_use, rank=args.rank, context_tokens=context,
                     step_ms_p50=round(p50 * 1e3, 2), decode_tok_per_s=round(batch / p50, 1),
                     threads=1)
        for length in (128, 512):
            for loaded in (0, 1):
                runner = build_runner(model_dir, dtype="float32", num_gpu_blocks=64,
                                      num_cpu_blocks=0, block_size=block_size, progress=False,
                                      lora_modules=tuple(adapters[:loaded]))
                times = []
                for step in range(5):
                    plan = prefill_plan(step, length, runner.vocab_size, block_size,
                                        "a0" if loaded else "")
                    t0 = time.perf_counter()
                    runner.execute(plan)
                    times.append(time.perf_counter() - t0)
                emit(f"prefill_{length}", adapters=loaded, with_adapter=loaded, rank=args.rank,
                     ms_p50=round(statistics.median(times[1:]) * 1e3, 1), threads=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
