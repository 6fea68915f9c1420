"""What a decode graph step's inputs cost the host: buffer by buffer (``PAGEDSERVE_GRAPH_FEED=0``)
against fed through one staged copy (executor/graph_feed.py), on a CPU with the graphs'
twin (executor/cuda_graphs.py). One JSON line per case (DESIGN §8).

The figure that carries over to a GPU is the count of device operations the host issues per
step around the replay (copies, fills, allocations: each a launch or a cudaMemcpyAsync,
~10-30 us of host time on an H200's host, 2026-11-27), in the main thread (`submit`: the
batch and the replay) and in the plan's precompute (the executor's I/O thread, which holds
the GIL while it works). They are counted as torch operators dispatched, the replay itself
left out (on a GPU it is one launch whatever its content). ``host_us_per_step``: the main
thread's time in the step's input handling on this CPU (the replay stubbed), a rough
guide only (a CPU copy is a memcpy; a GPU's is a driver call).

Steady overlapped decodes of the tiny random Llama at 32, 250 and 256 rows (250: in the
graph of 256, 6 padding rows; contexts ~70-120 tokens, tables 5-8 columns of 16-token
blocks, 1,024-token model length): the executor's usual step, its ids fed from the previous
step's tokens on the device. On a CPU the batch's host arrays are wrapped, not copied
(device_copy.py), so the buffer-by-buffer path's host-to-device copies (the tables' in
the main thread, the plan's in precompute: a pinned allocation and a copy each on a GPU)
show as ``lift_fresh`` (the wrap) here.

    python benchmarks/graph_feed_bench.py [--steps 40]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _counting_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            self.ops[name] = self.ops.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    return Count


def run_case(model_dir: str, batch: int, steps: int, fed: bool) -> dict:
    import torch
    from executor_steps import pipelined_decode_plans
    from pagedserve.executor.cuda_graphs import DecodeGraphs
    from pagedserve.executor.runner_setup import build_runner

    os.environ["PAGEDSERVE_GRAPH_FEED"] = "1" if fed else "0"
    prompt, block = 64, 16
    runner = build_runner(model_dir, num_gpu_blocks=batch * ((prompt + steps) // block + 3),
                          num_cpu_blocks=0, block_size=block, max_model_len=1024,
                          progress=False)
    size = -(-batch // 8) * 8  # the graph a step of ``batch`` rows runs in
    graphs = DecodeGraphs(runner.model, runner.cache.kv_cache, block, 1024, size)
    graphs.capture([size])
    runner.graphs = graphs
    runner.overlap_steps = True  # as on a GPU: each step fed from the one in flight
    replay = graphs._replays[size]
    real_replay = replay.replay
    Count = _counting_mode()
    main_ops: dict[str, int] = {}
    pre_ops: dict[str, int] = {}
    counted = [0, 0.0, 0]  # steps counted; seconds in submit outside the replay, steps timed

    def add(into: dict, ops: dict) -> None:
        for k, v in ops.items():
            into[k] = into.get(k, 0) + v

    replay_s = [0.0]

    def timed_replay():  # the replay runs outside the count and the clock
        t0 = time.perf_counter()
        with torch.utils._python_dispatch._disable_current_modes():
            real_replay()
        replay_s[0] += time.perf_counter() - t0

    replay.replay = timed_replay
    plans = list(pipelined_decode_plans(batch, prompt, block, steps, runner.vocab_size))
    warmup = 4
    with torch.inference_mode():
        for plan in plans:
            # Every other step counts operators; the others are timed (no dispatch mode).
            count = plan.step_id % 2 == 0
            mode = Count() if count else contextlib.nullcontext()
            with mode:
                pre = runner.precompute(plan)
            if plan.step_id >= warmup and count:
                add(pre_ops, mode.ops)
            mode = Count() if count else contextlib.nullcontext()
            replay_s[0] = 0.0
            t0 = time.perf_counter()
            with mode:
                runner.submit(plan, pre)
            spent = time.perf_counter() - t0 - replay_s[0]
            if plan.step_id >= warmup:
                if count:
                    add(main_ops, mode.ops)
                    counted[0] += 1
                else:
                    counted[1] += spent
                    counted[2] += 1
        runner.collect()
    n = counted[0]
    # The forward of an eager step (step 0's prompts) is not in the steady steps counted.
    return {
        "bench": "graph_feed", "case": f"{'fed' if fed else 'buffers'}_b{batch}",
        "batch": batch, "steps": n, "graph_steps": runner.graph_steps,
        "fed_steps": sum(graphs.fed),
        "main_ops_per_step": round(sum(main_ops.values()) / n, 2),
        "precompute_ops_per_step": round(sum(pre_ops.values()) / n, 2),
        "main_ops": {k: round(v / n, 2) for k, v in sorted(main_ops.items())},
        "precompute_ops": {k: round(v / n, 2) for k, v in sorted(pre_ops.items())},
        "host_us_per_step": round(counted[1] / counted[2] * 1e6, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args(argv)
    import torch

    from pagedserve.models import ensure_tiny_model

    torch.set_num_threads(1)
    model_dir = str(ensure_tiny_model())
    for batch in (32, 250, 256):  # 250: 6 padding rows in the graph of 256
        for fed in (False, True):
            print(json.dumps(run_case(model_dir, batch, args.steps, fed)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
