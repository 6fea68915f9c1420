"""A CPU executor's packed projections with their rows padded (executor/packed_weights.py).

The built-in SmolLM2-135M-Instruct in bfloat16, one torch thread, packed as a CPU executor
packs it, then:

* ``pass_rows_{R}``: one pass over the packed projections and the vocabulary head at R
  rows, unpadded (what the start-up calibration times, packed_weights.time_passes; ms p50
  of ``--repeats`` interleaved rounds after one to warm up);
* ``decode_b{B}``: decode steps of B sequences at context 256 through the executor's own
  ``ModelRunner.execute`` (executor_steps.decode_plans), with the start-up's padding table
  and without it, alternating every round in one process (the same weights, the same
  cache), step ms p50 of each; ``table`` names what the start chose on this machine.

    .venv/bin/python benchmarks/row_padding_bench.py [--batches 1,2,3,4,6,8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from executor_steps import decode_plans
from pagedserve.executor.packed_weights import is_packed, time_passes, timed_matrices
from pagedserve.executor.runner_setup import build_runner
from pagedserve.kernels import ops

BENCH = "row_padding_bench"


def emit(case: str, **figures) -> None:
    print(json.dumps({"bench": BENCH, "case": case, **figures}), flush=True)


def decode_times(runner, batch: int, repeats: int, table: dict[int, int],
                 step0: int) -> dict[str, float]:
    """Step ms p50, padded and not, over ``repeats`` runs of 13 decode steps each way
    (alternating which goes first; each run's first two steps not counted)."""
    steps: dict[str, list[float]] = {"padded": [], "unpadded": []}
    for r in range(repeats):
        for how in ("padded", "unpadded") if r % 2 == 0 else ("unpadded", "padded"):
            ops.PACKED_ROW_PADDING.clear()
            if how == "padded":
                ops.PACKED_ROW_PADDING.update(table)
            for i, plan in enumerate(decode_plans(batch, 256, 16, 13, runner.vocab_size,
                                                  tag=f"{how}{r}-", first_step=step0,
                                                  finish=True)):
                start = time.perf_counter()
                result = runner.execute(plan)
                if 2 <= i < 13:
                    steps[how].append(time.perf_counter() - start)
                assert not result.errors, result.errors
            step0 += 14
    ops.PACKED_ROW_PADDING.clear()
    ops.PACKED_ROW_PADDING.update(table)
    return {how: statistics.median(t) * 1e3 for how, t in steps.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--batches", default="1,2,3,4,6,8")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    from pagedserve.models import resolve_model

    torch.set_num_threads(1)
    batches = [int(b) for b in args.batches.split(",")]
    runner = build_runner(str(resolve_model(args.model)), dtype="bfloat16",
                          num_gpu_blocks=max(batches) * 18 + 8, num_cpu_blocks=0,
                          block_size=16, progress=False)
    if not is_packed(runner.model):
        emit("skipped", reason="this CPU runs the model's projections unpacked (see the log)")
        return 0
    table = dict(ops.PACKED_ROW_PADDING)
    named = {str(rows): to for rows, to in table.items()}
    times = time_passes(timed_matrices(runner.model), args.repeats + 1)
    for rows, t in times.items():  # (the first round warms up)
        emit(f"pass_rows_{rows}", pass_ms_p50=round(statistics.median(t[1:]) * 1e3, 2))
    for n, batch in enumerate(batches):
        ms = decode_times(runner, batch, args.repeats, table, step0=100_000 * (n + 1))
        emit(f"decode_b{batch}", table=named, padded_step_ms_p50=round(ms["padded"], 2),
             unpadded_step_ms_p50=round(ms["unpadded"], 2),
             padded_ratio=round(ms["padded"] / ms["unpadded"], 3))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
