"""What a batch running beside online traffic does to it: the OpenAI Batch API
(`--batch-dir`, its lines sent behind online requests) against the same requests sent as
plain online requests, on one `pagedserve serve`.

Workload (fixed before the first run): the built-in model, one executor, one torch thread,
`--max-num-seqs 16` (a server whose batch is full: what a batch does to the others shows
when it takes the seats), prefix caching off (no run served another's blocks). The batch:
48 completions of a ~64-token prompt each (seeded words), 48 tokens each (EOS ignored). The
online probe: 6 streamed completions of a ~32-token prompt, 16 tokens each, one every
2 s, starting 2 s after the batch. Three settings, each on a fresh server:

- ``alone``: the probe with no batch;
- ``batch_api``: the batch through /v1/files + /v1/batches (its window: 32 lines in flight,
  half of --max-queue-len and 2 x --max-num-seqs), the probe beside it;
- ``online_batch``: the same 48 requests POSTed to /v1/completions, 32 at a time, at the
  default priority (what sending a batch as online traffic does), the probe beside it.

Figures: the probe's time to first token and end to end (p50 and max, ms), and the batch's
wall time (its last answer after its first line went out).

    .venv/bin/python benchmarks/batch_api_bench.py [--model default]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from pagedserve.subprocs import stop_process

BENCH = "batch_api_bench"
BATCH, BATCH_TOKENS, PROBES, PROBE_TOKENS, PROBE_EVERY_S = 48, 48, 6, 16, 2.0
WINDOW = 32
READY = re.compile(r"pagedserve ready grpc=(\S+) metrics=(\S+) executors=(\d+) http=(\S+)")
WORDS = ["river", "stone", "market", "bread", "window", "garden", "letter", "morning",
         "silver", "engine", "ticket", "harbor", "candle", "forest", "music", "paper",
         "winter", "doctor", "summer", "bridge"]


def emit(case: str, **figures) -> None:
    print(json.dumps({"bench": BENCH, "case": case, **figures}), flush=True)


def _prompt(rng, words: int) -> str:
    return " ".join(rng.choice(WORDS, size=words))


def _ms(values: list[float]) -> dict:
    return {"p50_ms": round(statistics.median(values) * 1e3, 1),
            "max_ms": round(max(values) * 1e3, 1)}


def start_serve(model: str, work: Path) -> tuple[subprocess.Popen, str]:
    log_path = work / "serve.log"
    argv = [sys.executable, "-m", "pagedserve.cli", "serve", "--model", model, "--port", "0",
            "--metrics-port", "0", "--http-port", "0", "--executors", "1", "--cpu-threads",
            "1", "--max-num-seqs", "16", "--no-prefix-caching", "--batch-dir",
            str(work / "batches")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                env={**env, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 300
    while not (m := READY.search(log_path.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc)
            raise RuntimeError("serve did not start:\n" + log_path.read_text()[-3000:])
        time.sleep(0.2)
    return proc, f"http://{m.group(4)}"


async def probe(http: aiohttp.ClientSession, prompt: str) -> tuple[float, float]:
    body = {"prompt": prompt, "max_tokens": PROBE_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    first = None
    async with http.post("/v1/completions", json=body) as reply:
        assert reply.status == 200, await reply.text()
        async for line in reply.content:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter()
    return first - t0, time.perf_counter() - t0


async def run_batch_api(http, bodies: list[dict]) -> float:
    lines = "\n".join(json.dumps({"custom_id": f"b{i}", "method": "POST",
                                  "url": "/v1/completions", "body": b})
                      for i, b in enumerate(bodies))
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", lines.encode(), filename="in.jsonl")
    async with http.post("/v1/files", data=form) as reply:
        file_id = (await reply.json())["id"]
    t0 = time.perf_counter()
    async with http.post("/v1/batches", json={"input_file_id": file_id,
                                              "endpoint": "/v1/completions",
                                              "completion_window": "24h"}) as reply:
        batch_id = (await reply.json())["id"]
    while True:
        async with http.get(f"/v1/batches/{batch_id}") as reply:
            batch = await reply.json()
        if batch["status"] not in ("validating", "in_progress", "finalizing"):
            break
        await asyncio.sleep(0.1)
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == BATCH, \
        batch
    return time.perf_counter() - t0


async def run_online_batch(http, bodies: list[dict]) -> float:
    window = asyncio.Semaphore(WINDOW)

    async def one(body):
        async with window, http.post("/v1/completions", json=body) as reply:
            assert reply.status == 200, await reply.text()
            await reply.read()

    t0 = time.perf_counter()
    await asyncio.gather(*(one(b) for b in bodies))
    return time.perf_counter() - t0


async def setting(base: str, case: str) -> None:
    rng = np.random.default_rng(0)
    bodies = [{"prompt": _prompt(rng, 56), "max_tokens": BATCH_TOKENS, "temperature": 0,
               "ignore_eos": True} for _ in range(BATCH)]
    probes = [_prompt(rng, 28) for _ in range(PROBES)]
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(base, timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as http:
        await probe(http, "warm up")  # (compilation, caches: outside every figure)
        batch = None
        if case == "batch_api":
            batch = asyncio.ensure_future(run_batch_api(http, bodies))
        elif case == "online_batch":
            batch = asyncio.ensure_future(run_online_batch(http, bodies))
        await asyncio.sleep(PROBE_EVERY_S)
        results = []
        for prompt in probes:
            results.append(asyncio.ensure_future(probe(http, prompt)))
            await asyncio.sleep(PROBE_EVERY_S)
        done = await asyncio.gather(*results)
        batch_s = await batch if batch is not None else None
    emit(case, ttft=_ms([t for t, _ in done]), e2e=_ms([e for _, e in done]),
         batch_s=round(batch_s, 1) if batch_s is not None else None, probes=PROBES,
         batch_requests=BATCH if batch is not None else 0, max_num_seqs=16, threads=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--cases", default="alone,batch_api,online_batch")
    args = parser.parse_args(argv)
    for case in args.cases.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            proc, base = start_serve(args.model, Path(tmp))
            try:
                asyncio.run(setting(base, case))
            finally:
                stop_process(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
