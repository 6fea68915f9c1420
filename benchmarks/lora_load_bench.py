"""What loading and unloading a LoRA adapter while serving costs (``--max-loras``,
/v1/load_lora_adapter): on the built-in model on this CPU, random adapters of rank 16 on all
seven projections of its 30 layers (tinymodels.build_lora_adapter: PEFT's format), float32
executor, one torch thread. One JSON line a case (DESIGN §8):

* ``executor_ops``: the executor's own work, the time a plan carrying the op holds its step
  (executor/lora_ops.py): a load (reading the directory, checking it, copying it into a
  slot) and an unload (zeroing the slot), p50 and max over ``--cycles`` load/unload
  cycles of 4 adapters in turn; the read alone (``read_adapter``) beside it.
* ``serve_load``: `pagedserve serve --max-loras 4` (one executor) streaming one long
  completion of the base model while ``--cycles`` load/unload pairs go through the HTTP
  routes, each cycle a new name (``load``), then ``--cycles`` of one name unloaded and
  loaded again at once (``reload``: the load waits for the executor to apply the unload
  first): each call's latency as a client sees it (a load answers once the executor has
  applied it: it goes with the next plan, behind the ones in flight), and the stream's gaps
  between tokens while the calls run against before them (p50 and max).

    .venv/bin/python benchmarks/lora_load_bench.py [--model default] [--cycles 8]
        [--cases executor_ops,serve_load]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch
from pagedserve.executor.lora_ops import apply_lora_ops
from pagedserve.executor.models.lora import read_adapter
from pagedserve.executor.runner_setup import build_runner
from pagedserve.protos.wire import LoraOp

from pagedserve.subprocs import stop_process
from pagedserve.tinymodels import build_lora_adapter

BENCH = "lora_load_bench"
RANK, SLOTS, STREAM_TOKENS = 16, 4, 600
READY = re.compile(r"pagedserve ready grpc=(\S+) metrics=(\S+) executors=(\d+) http=(\S+)")


def emit(case: str, **figures) -> None:
    print(json.dumps({"bench": BENCH, "case": case, **figures}), flush=True)


def ms(values: list[float]) -> dict:
    return {"p50_ms": round(statistics.median(values) * 1e3, 2),
            "max_ms": round(max(values) * 1e3, 2)}


def executor_ops(model_dir: str, adapters: list[Path], cycles: int) -> None:
    torch.set_num_threads(1)
    runner = build_runner(model_dir, dtype="float32", num_gpu_blocks=64, num_cpu_blocks=0,
                          progress=False, max_loras=SLOTS, max_lora_rank=RANK)
    loads, unloads, reads = [], [], []
    for i in range(cycles):
        path = adapters[i % len(adapters)]
        t0 = time.perf_counter()
        read_adapter("r", path, runner.model.config)
        reads.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        failed = apply_lora_ops(runner, [LoraOp(name="a", load=True, path=str(path))])
        loads.append(time.perf_counter() - t0)
        assert not failed, failed
        t0 = time.perf_counter()
        apply_lora_ops(runner, [LoraOp(name="a", load=False)])
        unloads.append(time.perf_counter() - t0)
    size = sum(f.stat().st_size for f in adapters[0].iterdir())
    emit("executor_ops", rank=RANK, slots=SLOTS, adapter_mb=round(size / 2**20, 2),
         cycles=cycles, load=ms(loads), read_alone=ms(reads), unload=ms(unloads), threads=1)


def _post(http: str, path: str, body: dict) -> tuple[int, float]:
    req = urllib.request.Request(f"http://{http}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as resp:
        resp.read()
        return resp.status, time.perf_counter() - t0


def _stream(http: str, stamps: list[float]) -> None:
    """One streamed completion of the base model; the arrival time of each token."""
    body = {"prompt": "Once upon a time", "max_tokens": STREAM_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(f"http://{http}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        for line in resp:
            if line.startswith(b"data: {"):
                stamps.append(time.perf_counter())


def serve_load(model: str, adapters: list[Path], cycles: int, work: Path) -> None:
    log_path = work / "serve.log"
    argv = [sys.executable, "-m", "pagedserve.cli", "serve", "--model", model, "--port", "0",
            "--metrics-port", "0", "--http-port", "0", "--executors", "1", "--cpu-threads",
            "1", "--dtype", "float32", "--max-loras", str(SLOTS), "--max-lora-rank",
            str(RANK)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                env={**env, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 300
        while not (m := READY.search(log_path.read_text())):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("serve did not start:\n" + log_path.read_text()[-3000:])
            time.sleep(0.2)
        http = m.group(4)
        stamps: list[float] = []
        streamer = threading.Thread(target=_stream, args=(http, stamps))
        streamer.start()
        while len(stamps) < STREAM_TOKENS // 4:
            time.sleep(0.01)
        loads, unloads, reloads = [], [], []
        window = [time.perf_counter()]
        for i in range(cycles):
            body = {"lora_name": f"a{i}", "lora_path": str(adapters[i % len(adapters)])}
            loads.append(_post(http, "/v1/load_lora_adapter", body)[1])
            unloads.append(_post(http, "/v1/unload_lora_adapter", {"lora_name": f"a{i}"})[1])
        body = {"lora_name": "r", "lora_path": str(adapters[0])}
        _post(http, "/v1/load_lora_adapter", body)
        for _ in range(cycles):
            _post(http, "/v1/unload_lora_adapter", {"lora_name": "r"})
            reloads.append(_post(http, "/v1/load_lora_adapter", body)[1])
        window.append(time.perf_counter())
        streamer.join()
        gaps = [(b - a, a) for a, b in zip(stamps, stamps[1:], strict=False)]
        before = [g for g, t in gaps[5:] if t < window[0]]  # (past the first tokens)
        during = [g for g, t in gaps if window[0] <= t <= window[1]]
        emit("serve_load", rank=RANK, slots=SLOTS, cycles=cycles, load=ms(loads),
             unload=ms(unloads), reload=ms(reloads), tokens_gap_before=ms(before), tokens_gap_during=ms(during),
             tokens_during=len(during), threads=1)
    finally:
        stop_process(proc)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--cycles", type=int, default=8)
    parser.add_argument("--cases", default="executor_ops,serve_load")
    args = parser.parse_args(argv)
    cases = args.cases.split(",")
    from pagedserve.models import resolve_model

    model_dir = str(resolve_model(args.model))
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [build_lora_adapter(model_dir, Path(tmp) / f"a{i}", rank=RANK,
                                       alpha=2.0 * RANK, std=0.02, seed=i) for i in range(4)]
        if "executor_ops" in cases:
            executor_ops(model_dir, adapters, args.cycles)
        if "serve_load" in cases:
            serve_load(args.model, adapters, args.cycles, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
