"""Beam search in the router against beam search driven from outside, on the same server:
JSON lines on stdout, a table on stderr.

Starts `pagedserve serve` (the built-in SmolLM2-135M-Instruct unless `--model DIR`; one
CPU executor) and runs the same searches two ways, over gRPC:

* `router`: one request with `SamplingParams.beam_search` and n = width (router/
  beam_search.py: the beams are the request's samples, forked and freed in the router's
  KV manager, one decode row each a step);
* `client`: the same algorithm (`BeamSearch.select`, the router's own code, so both give
  the same beams) run by this script, each step one request per beam (its prompt + the
  beam's tokens so far, max_tokens 1, the top-K logprobs), all beams of a step at once,
  every step's requests served from the prefix cache but their last tokens: how vLLM's
  OpenAI server runs `use_beam_search` (one engine request per beam per step).

Per (width, concurrency) and mode: wall seconds for all searches, returned tokens per
second, the peak of KV blocks in use (ClusterStatus polled every 20 ms) and, for the
client, requests sent. `speedup_ratio` = client seconds / router seconds; `same_outputs`:
the beams of the two ways are the same token for token (bfloat16 rounding can differ
between a decode step and a prefix-cached recompute of the last token: `--dtype float32`).

    .venv/bin/python benchmarks/beam_search_bench.py [--model DIR] [--widths 2,4,8]
        [--concurrency 1,4] [--max-tokens 48] [--dtype auto]
    .venv/bin/python benchmarks/beam_search_bench.py --router-cost [--widths 2,4,8]

`--router-cost`: no server; the router's CPU a search step (`router_cost`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb  # noqa: E402
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2_grpc as pb_grpc  # noqa: E402
from pagedserve.router.beam_search import BeamSearch  # noqa: E402
from pagedserve.router.types import BeamSpec, RequestSpec, SamplingSpec  # noqa: E402
from serve_process import ServeProcess, serve_argv  # noqa: E402

BENCH = "beam_search_bench"
PROMPTS = ["Translate to French: The weather is nice today and we are going to the beach.",
           "Summarize: The paged KV cache stores keys and values in fixed-size blocks, so "
           "memory grows with the sequence and requests sharing a prefix share its blocks.",
           "Write a title for an article about learning a new language as an adult.",
           "Complete the sentence: The best way to start the morning is"]


def emit(case: str, **figures) -> None:
    print(json.dumps({"bench": BENCH, "case": case, **figures}), flush=True)


class Server:
    """`pagedserve serve` (scripts/serve_process.py: its own ports, killed with this
    process, as a GPU check step needs) and a gRPC stub to it."""

    def __init__(self, model: str | None, dtype: str) -> None:
        self._logs = tempfile.TemporaryDirectory(prefix="beam-search-bench-")
        self.proc = ServeProcess(serve_argv(
            model or "default", "--http-port", "0", "--dtype", dtype,
            "--max-logprobs", "64"),  # (the client's K: up to (1 + EOS ids) x width)
            Path(self._logs.name) / "serve.log").start()
        self.http = self.proc.http_address
        self.channel = grpc.insecure_channel(self.proc.address)
        self.stub = pb_grpc.GeneratorStub(self.channel)
        info = self.stub.GetModelInfo(pb.ModelInfoRequest(), timeout=30)
        self.eos = frozenset(info.eos_token_ids)
        self.vocab = info.vocab_size

    def tokenize(self, text: str) -> list[int]:
        """The prompt's ids as the server tokenizes it (POST /tokenize)."""
        req = urllib.request.Request(f"http://{self.http}/tokenize",
                                     data=json.dumps({"prompt": text}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())["tokens"]

    def used_blocks(self) -> int:
        st = self.stub.GetClusterStatus(pb.ClusterStatusRequest(), timeout=10)
        return sum(e.num_gpu_blocks - e.num_free_gpu_blocks for e in st.executors)

    def stop(self) -> None:
        self.channel.close()
        self.proc.stop()
        self._logs.cleanup()


class PeakBlocks:
    """Polls the blocks in use every 20 ms while a run goes on, the first poll at once
    (a short run can end inside the first 20 ms); `peak` after `stop`."""

    def __init__(self, server: Server) -> None:
        self.server, self.peak, self._done = server, 0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while True:
            self.peak = max(self.peak, self.server.used_blocks())
            if self._done.wait(0.02):
                return

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return self.peak


def router_search(server: Server, prompt: str, width: int, max_tokens: int) -> list[list[int]]:
    req = pb.GenerateRequest(prompt=prompt, params=pb.SamplingParams(
        max_tokens=max_tokens, n=width, beam_search=pb.BeamSearch()))
    resp = server.stub.Generate(req, timeout=1200)
    return [list(c.token_ids) for c in resp.completions]


def client_search(server: Server, prompt_ids: list[int], width: int, max_tokens: int,
                  pool: ThreadPoolExecutor, sent: list[int]) -> list[list[int]]:
    """transformers' beam search (the router's `BeamSearch.select`) with one 1-token
    request per beam per step."""
    beam = BeamSearch(SamplingSpec(max_tokens=max_tokens, n=width, beam=BeamSpec()),
                      server.eos, server.vocab)
    outputs: dict[int, list[int]] = {0: []}

    def answer(tokens: list[int]):
        resp = server.stub.Generate(pb.GenerateRequest(
            prompt_token_ids=pb.TokenIds(ids=prompt_ids + tokens),
            params=pb.SamplingParams(max_tokens=1, temperature=0, logprobs=beam.k,
                                     ignore_eos=True)), timeout=600)
        top = resp.completions[0].logprobs[0].top
        return (np.array([t.token_id for t in top], np.int64),
                np.array([t.logprob for t in top], np.float32))

    for step in range(max_tokens):
        slots = list(beam.order)
        sent[0] += len(slots)
        for slot, ans in zip(slots, pool.map(answer, [outputs[s] for s in slots]),
                             strict=True):
            beam.answers[slot] = ans
        running, done = beam.select(step, lambda s, outputs=outputs: (outputs[s], []))
        beam.answers.clear()
        if done:
            break
        new = {i: outputs[c.parent] + [c.token_id] for i, c in enumerate(running)}
        beam.scores[: len(running)] = [c.score for c in running]
        beam.order, outputs = list(range(len(running))), new
    return [h.token_ids for h in beam.finished]


def run_mode(server: Server, mode: str, width: int, concurrency: int, max_tokens: int,
             prompt_ids: dict[str, list[int]]) -> tuple[dict, list]:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(max(len(PROMPTS), concurrency))]
    sent = [0]
    pool = ThreadPoolExecutor(concurrency * width * 2)
    peak = PeakBlocks(server)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as outer:
        if mode == "router":
            outs = list(outer.map(lambda p: router_search(server, p, width, max_tokens),
                                  prompts))
        else:
            outs = list(outer.map(lambda p: client_search(server, prompt_ids[p], width,
                                                          max_tokens, pool, sent), prompts))
    wall = time.perf_counter() - t0
    blocks = peak.stop()
    pool.shutdown()
    tokens = sum(len(b) for o in outs for b in o)
    return {"seconds": round(wall, 3), "tok_per_s": round(tokens / wall, 2),
            "peak_blocks": blocks, "requests_sent": sent[0] or len(prompts)}, outs


def router_cost(widths: list[int], rounds: int = 2000) -> None:
    """The router's CPU a search step, in process (no server): `BeamSearch.select` on
    synthetic answers (K = 2 x width, one stop id, a 49k vocabulary), and the whole
    `advance` (select, forks, frees) of 8 searches x 30 steps through the router's engine
    with tests/beam_rig.py's executor (one CPU thread; the rig's own work not counted)."""
    import asyncio
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from beam_rig import ContextExecutor
    from pagedserve.router import beam_search, token_apply
    from pipeline_rig import Collector, make_engine
    rng = np.random.default_rng(0)
    for width in widths:
        beam = BeamSearch(SamplingSpec(max_tokens=1000, n=width, beam=BeamSpec()),
                          frozenset({2}), 49152)
        order = list(range(width))
        answers = {s: (rng.integers(3, 49152, beam.k).astype(np.int32),
                       np.sort(rng.standard_normal(beam.k).astype(np.float32))[::-1] - 5)
                   for s in order}
        outputs = list(range(100))
        t0 = time.perf_counter()
        for _ in range(rounds):
            beam.order, beam.answers, beam.finished, beam.improvable = order, dict(answers), [], True
            beam.select(50, lambda s, outputs=outputs: (outputs, []))
        select_us = (time.perf_counter() - t0) / rounds * 1e6
        spent = [0.0, 0]
        advance = beam_search.advance

        def timed(*args, spent=spent, advance=advance):
            t = time.perf_counter()
            advance(*args)
            spent[0] += time.perf_counter() - t
            spent[1] += 1

        async def searches(width=width):
            engine, _ = make_engine(num_gpu_blocks=512)
            engine.executors["e0"].kv.debug_checks = False  # (the rig's are on: a server's are off)
            ex = ContextExecutor(engine, eos_boost=0.0)
            streams = [Collector(await engine.submit(RequestSpec(
                f"b{i}", (1 + i, 2, 3), SamplingSpec(max_tokens=30, temperature=0.0, n=width,
                                                     beam=BeamSpec())))) for i in range(8)]
            await ex.run_until_done(streams)
        token_apply.beam_search.advance = timed
        try:
            asyncio.run(searches())
        finally:
            token_apply.beam_search.advance = advance
        emit(f"router_cost_w{width}", width=width, select_us=round(select_us, 1),
             advance_us=round(spent[0] / spent[1] * 1e6, 1), advances=spent[1])
        print(f"router cost w{width}: select {select_us:.1f} us, advance "
              f"{spent[0] / spent[1] * 1e6:.1f} us a search a step", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--widths", default="2,4,8")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--router-cost", action="store_true",
                    help="only the router's CPU a search step, in process (router_cost)")
    args = ap.parse_args()
    if args.router_cost:
        router_cost([int(w) for w in args.widths.split(",")])
        return
    server = Server(args.model, args.dtype)
    try:
        prompt_ids = {p: server.tokenize(p) for p in PROMPTS}
        router_search(server, PROMPTS[0], 2, 4)  # warm-up
        for width in map(int, args.widths.split(",")):
            for conc in map(int, args.concurrency.split(",")):
                r, r_out = run_mode(server, "router", width, conc, args.max_tokens, prompt_ids)
                c, c_out = run_mode(server, "client", width, conc, args.max_tokens, prompt_ids)
                case = f"w{width}_c{conc}"
                emit(case, width=width, concurrency=conc, max_tokens=args.max_tokens,
                     router=r, client=c, speedup_ratio=round(c["seconds"] / r["seconds"], 2),
                     same_outputs=r_out == c_out)
                print(f"{case:8} router {r['seconds']:7.2f} s {r['peak_blocks']:5} blocks | "
                      f"client {c['seconds']:7.2f} s {c['peak_blocks']:5} blocks "
                      f"{c['requests_sent']:5} requests | x{c['seconds'] / r['seconds']:.2f} "
                      f"same={r_out == c_out}", file=sys.stderr)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
