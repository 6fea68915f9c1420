"""What updating the weights while serving costs (``--enable-weight-updates``,
/update_weights_from_disk; router/weight_sync.py, executor/weight_ops.py): the built-in
model on this CPU, float32 executor, one torch thread, checkpoints that are copies of its
own safetensors (bfloat16, cast to float32 as they are copied). One JSON line a case
(DESIGN §8):

* ``executor_ops``: the executor's own work, what a plan carrying the op holds its step: a
  check (config.json and the safetensors headers) and a load (the check again, then every
  tensor read, cast and copied in place), p50 and max over ``--cycles`` loads of two
  checkpoints in turn.
* ``serve_idle``: `pagedserve serve --enable-weight-updates` (one executor): the update's
  latency as a client sees it with nothing running, and the executor's own load time in
  it (from its log).
* ``serve_<mode>``: the same while ``STREAMS`` streamed completions run (max_tokens 16,
  32, ... 128, started together; the update is called once each has its first token), by
  the three ways an RL trainer can do it: ``wait`` (the default: the update waits for the
  running requests), ``abort`` (``abort_all_requests``: they end at once) and ``retract``
  (/pause_generation retract, the update, /continue_generation: they stop, then go on
  computing their tokens again with the new weights); ``keep`` (added after the first
  three runs: /pause_generation keep, the streams frozen with their KV, then the update,
  which retracts them, and the continue). Figures: the calls' latency, the streams' wall
  time (from their start to the last one's end), the tokens they got.

    .venv/bin/python benchmarks/weight_update_bench.py [--model default] [--cycles 2]
        [--cases executor_ops,serve]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from lora_load_bench import post_timed, serve_process
from pagedserve.executor.runner_setup import build_runner
from pagedserve.executor.weight_ops import apply_weight_op
from pagedserve.protos.wire import WeightOp

BENCH = "weight_update_bench"
EXECUTOR_LOAD = re.compile(r"weights loaded from \S+ \((\d+) ms\)")
STREAMS, STEP_TOKENS = 8, 16  # stream i asks for (i + 1) * STEP_TOKENS tokens


def emit(case: str, **figures) -> None:
    print(json.dumps({"bench": BENCH, "case": case, **figures}), flush=True)


def ms(values: list[float]) -> dict:
    return {"p50_ms": round(statistics.median(values) * 1e3, 1),
            "max_ms": round(max(values) * 1e3, 1)}


def checkpoints(model_dir: str, work: Path) -> list[Path]:
    """Two copies of the model's weights and config (a trainer's checkpoints)."""
    out = []
    for name in ("ckpt-a", "ckpt-b"):
        dst = work / name
        dst.mkdir()
        for f in Path(model_dir).iterdir():
            if f.suffix in (".safetensors", ".json"):
                shutil.copy(f, dst / f.name)
        out.append(dst)
    return out


def executor_ops(model_dir: str, ckpts: list[Path], cycles: int) -> None:
    torch.set_num_threads(1)
    runner = build_runner(model_dir, dtype="float32", num_gpu_blocks=64, num_cpu_blocks=0,
                          progress=False)
    checks, loads = [], []
    for i in range(cycles):
        path = str(ckpts[i % len(ckpts)])
        for load, times in ((False, checks), (True, loads)):
            t0 = time.perf_counter()
            failed = apply_weight_op(runner, WeightOp(path=path, load=load))
            times.append(time.perf_counter() - t0)
            assert not failed, failed
    size = sum(f.stat().st_size for f in ckpts[0].glob("*.safetensors"))
    params = sum(p.numel() for p in runner.model.parameters())
    emit("executor_ops", checkpoint_mb=round(size / 2**20, 1), parameters=params,
         cycles=cycles, check=ms(checks), load=ms(loads),
         load_gb_per_s=round(size / 2**30 / statistics.median(loads), 2), threads=1)


def _stream(http: str, max_tokens: int, out: dict) -> None:
    """One streamed completion: its tokens (and first token time) into ``out``."""
    import urllib.request
    body = {"prompt": f"Story {max_tokens}: once upon a time", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(f"http://{http}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    out["tokens"] = 0
    with urllib.request.urlopen(req, timeout=600) as resp:
        for line in resp:
            if line.startswith(b"data: {") and b'"text"' in line:
                out["tokens"] += 1
    out["end"] = time.perf_counter()


def _update_under_load(http: str, mode: str, path: str) -> dict:
    outs = [{} for _ in range(STREAMS)]
    start = time.perf_counter()
    threads = [threading.Thread(target=_stream, args=(http, (i + 1) * STEP_TOKENS, outs[i]))
               for i in range(STREAMS)]
    for t in threads:
        t.start()
    while not all(o.get("tokens") for o in outs):
        time.sleep(0.005)
    calls = []
    if mode in ("retract", "keep"):
        calls.append(post_timed(http, "/pause_generation", {"mode": mode})[1])
    body = {"model_path": path, "abort_all_requests": mode == "abort"}
    calls.append(post_timed(http, "/update_weights_from_disk", body)[1])
    if mode in ("retract", "keep"):
        calls.append(post_timed(http, "/continue_generation", {})[1])
    for t in threads:
        t.join()
    return {"calls_s": sum(calls), "wall_s": max(o["end"] for o in outs) - start,
            "tokens": sum(o["tokens"] for o in outs)}


def serve(model: str, ckpts: list[Path], cycles: int, work: Path) -> None:
    with serve_process(model, work, ["--enable-weight-updates"]) as (http, log_path):
        idle = [post_timed(http, "/update_weights_from_disk",
                           {"model_path": str(ckpts[i % 2])})[1] for i in range(cycles)]
        # the executor's own time for each (its log line), the rest is the router's part
        own = [int(t) / 1e3 for t in EXECUTOR_LOAD.findall(log_path.read_text())]
        emit("serve_idle", cycles=cycles, update=ms(idle), executor_load=ms(own), threads=1)
        asked = sum((i + 1) * STEP_TOKENS for i in range(STREAMS))
        for mode in ("wait", "abort", "retract", "keep"):
            runs = [_update_under_load(http, mode, str(ckpts[i % 2])) for i in range(cycles)]
            emit(f"serve_{mode}", cycles=cycles, streams=STREAMS, tokens_asked=asked,
                 calls=ms([r["calls_s"] for r in runs]),
                 streams_wall_s=round(statistics.median(r["wall_s"] for r in runs), 2),
                 tokens_got=min(r["tokens"] for r in runs), threads=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--cases", default="executor_ops,serve")
    args = parser.parse_args(argv)
    cases = args.cases.split(",")
    from pagedserve.models import resolve_model

    model_dir = str(resolve_model(args.model))
    with tempfile.TemporaryDirectory() as tmp:
        ckpts = checkpoints(model_dir, Path(tmp))
        if "executor_ops" in cases:
            executor_ops(model_dir, ckpts, max(args.cycles, 4))
        if "serve" in cases:
            serve(args.model, ckpts, args.cycles, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
