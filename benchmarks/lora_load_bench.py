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
import asyncio
import contextlib
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

import numpy as np
import torch
from pagedserve.executor.lora_ops import apply_lora_ops
from pagedserve.executor.models.lora import read_adapter
from pagedserve.executor.runner_setup import build_runner
from pagedserve.protos.wire import LoraOp

from pagedserve.subprocs import stop_process
from pagedserve.tinymodels import build_lora_adapter

BENCH = "lora_load_bench"
RANK, SLOTS, STREAM_TOKENS = 16, 4, 600
LORA_RANK = ["--max-lora-rank", str(RANK)]
# on_demand: adapters in the folder, requests (Zipf-like over them), in flight, tokens each
ON_DEMAND_ADAPTERS, ON_DEMAND_REQUESTS, ON_DEMAND_CONCURRENCY, ON_DEMAND_TOKENS = 12, 48, 8, 16
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


def post_timed(http: str, path: str, body: dict) -> tuple[int, float]:
    """POST ``body`` as JSON: (status, seconds the call took)."""
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


@contextlib.contextmanager
def serve_process(model: str, work: Path, extra: list[str]):
    """`pagedserve serve` (one executor, float32, one thread) with ``extra`` flags: its HTTP
    address and its log's path, stopped on exit (weight_update_bench.py's too)."""
    log_path = work / f"serve-{time.monotonic_ns()}.log"
    argv = [sys.executable, "-m", "pagedserve.cli", "serve", "--model", model, "--port", "0",
            "--metrics-port", "0", "--http-port", "0", "--executors", "1", "--cpu-threads",
            "1", "--dtype", "float32", *extra]
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
        yield m.group(4), log_path
    finally:
        stop_process(proc)


def serve_load(model: str, adapters: list[Path], cycles: int, work: Path) -> None:
    with serve_process(model, work, ["--max-loras", str(SLOTS), *LORA_RANK]) as (http, _):
        stamps: list[float] = []
        streamer = threading.Thread(target=_stream, args=(http, stamps))
        streamer.start()
        while len(stamps) < STREAM_TOKENS // 4:
            time.sleep(0.01)
        loads, unloads, reloads = [], [], []
        window = [time.perf_counter()]
        for i in range(cycles):
            body = {"lora_name": f"a{i}", "lora_path": str(adapters[i % len(adapters)])}
            loads.append(post_timed(http, "/v1/load_lora_adapter", body)[1])
            unloads.append(post_timed(http, "/v1/unload_lora_adapter", {"lora_name": f"a{i}"})[1])
        body = {"lora_name": "r", "lora_path": str(adapters[0])}
        post_timed(http, "/v1/load_lora_adapter", body)
        for _ in range(cycles):
            post_timed(http, "/v1/unload_lora_adapter", {"lora_name": "r"})
            reloads.append(post_timed(http, "/v1/load_lora_adapter", body)[1])
        window.append(time.perf_counter())
        streamer.join()
    gaps = [(b - a, a) for a, b in zip(stamps, stamps[1:], strict=False)]
    before = [g for g, t in gaps[5:] if t < window[0]]  # (past the first tokens)
    during = [g for g, t in gaps if window[0] <= t <= window[1]]
    emit("serve_load", rank=RANK, slots=SLOTS, cycles=cycles, load=ms(loads),
         unload=ms(unloads), reload=ms(reloads), tokens_gap_before=ms(before),
         tokens_gap_during=ms(during), tokens_during=len(during), threads=1)


async def _requests(http: str, names: list[str]) -> tuple[float, list[float], int]:
    """ON_DEMAND_REQUESTS streamed completions, each running ``names[i]``, at most
    ON_DEMAND_CONCURRENCY at a time: (wall s, each one's time to first token, tokens)."""
    import aiohttp
    window = asyncio.Semaphore(ON_DEMAND_CONCURRENCY)
    ttfts: list[float] = []
    tokens = 0

    async def one(i: int, session) -> None:
        nonlocal tokens
        body = {"model": names[i], "prompt": f"Request {i}: tell me about rivers and stones",
                "max_tokens": ON_DEMAND_TOKENS, "temperature": 0, "ignore_eos": True,
                "stream": True}
        async with window:
            t0 = time.perf_counter()
            async with session.post("/v1/completions", json=body) as reply:
                assert reply.status == 200, await reply.text()
                async for line in reply.content:
                    if line.startswith(b"data: {"):
                        tokens += 1
                        if t0:
                            ttfts.append(time.perf_counter() - t0)
                            t0 = 0.0
    async with aiohttp.ClientSession(f"http://{http}",
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.perf_counter()
        await asyncio.gather(*(one(i, session) for i in range(len(names))))
        return time.perf_counter() - start, ttfts, tokens


def on_demand(model: str, folder: Path, work: Path) -> None:
    """ON_DEMAND_ADAPTERS adapters (a folder), requests naming them Zipf-like (seeded): with
    SLOTS slots loaded on demand (--lora-dir), and with every adapter loaded at start
    (--lora-modules, as many slots)."""
    rng = np.random.default_rng(0)
    weights = 1.0 / np.arange(1, ON_DEMAND_ADAPTERS + 1)
    picks = rng.choice(ON_DEMAND_ADAPTERS, size=ON_DEMAND_REQUESTS, p=weights / weights.sum())
    names = [f"a{k}" for k in picks]
    modules = ",".join(f"a{k}={folder / f'a{k}'}" for k in range(ON_DEMAND_ADAPTERS))
    for case, extra in (
            (f"on_demand_{SLOTS}_slots", ["--max-loras", str(SLOTS), "--lora-dir", str(folder)]),
            (f"preloaded_{ON_DEMAND_ADAPTERS}", ["--max-loras", str(ON_DEMAND_ADAPTERS),
                                                 "--lora-modules", modules])):
        with serve_process(model, work, [*extra, *LORA_RANK]) as (http, log_path):
            wall, ttfts, tokens = asyncio.run(_requests(http, names))
            loads = len(re.findall(r"LoRA adapter \S+ loaded from", log_path.read_text()))
        emit(case, adapters=ON_DEMAND_ADAPTERS, distinct_requested=len(set(names)),
             requests=ON_DEMAND_REQUESTS, concurrency=ON_DEMAND_CONCURRENCY,
             output_tokens=tokens, wall_s=round(wall, 2), output_tok_per_s=round(tokens / wall, 1),
             ttft_p50_ms=round(float(np.percentile(ttfts, 50)) * 1e3, 1),
             ttft_p90_ms=round(float(np.percentile(ttfts, 90)) * 1e3, 1),
             router_loads=loads, rank=RANK, threads=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--cycles", type=int, default=8)
    parser.add_argument("--cases", default="executor_ops,serve_load,on_demand")
    args = parser.parse_args(argv)
    cases = args.cases.split(",")
    from pagedserve.models import resolve_model

    model_dir = str(resolve_model(args.model))
    with tempfile.TemporaryDirectory() as tmp:
        count = ON_DEMAND_ADAPTERS if "on_demand" in cases else 4
        adapters = [build_lora_adapter(model_dir, Path(tmp) / f"a{i}", rank=RANK,
                                       alpha=2.0 * RANK, std=0.02, seed=i) for i in range(count)]
        if "executor_ops" in cases:
            executor_ops(model_dir, adapters[:4], args.cycles)
        if "serve_load" in cases:
            serve_load(args.model, adapters[:4], args.cycles, Path(tmp))
        if "on_demand" in cases:
            on_demand(args.model, Path(tmp), Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
