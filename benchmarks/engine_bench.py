"""The router engine's CPU per step, in one process: what limits a GPU executor's step rate
when the router cannot keep up (benchmarks/README.md, "engine_bench.py").

A RouterEngine with one registered executor whose link answers every plan on the next loop
turn (an executor with a zero-time forward: one token per sampled request), so the engine
runs flat out and wall time per step is its CPU per step: `schedule` + `build_plan` + the
plan's encoding + the result's decoding + `apply_result` + the text stage + the asyncio turns
between them. The executor's part (building and encoding the result) is timed and
subtracted; no socket is involved (hop_bench.py times those). Requests are admitted as
the API workers' requests are (`text=False`: tokens and token stops only; the text is the
workers'), into a sink that keeps nothing, so no edge work is counted; with `--sink hub`
into the API workers' forwarding channels of a real EdgeHub instead (each step's outputs
merged per worker and encoded as one Outputs message, sent to a worker id nobody holds, so
zeroMQ drops it): the core's whole per-token cost with API workers, as on a GPU host.

The collector runs as in the router process (`freeze_heap`: start-up objects frozen, young
threshold raised); at the default threshold the hub case's per-token structs cost a young
collection every step. Cases (`--streams`, default 32,256): that many requests decoding together (prompts of 64
tokens, `max_tokens` past the window so none ends), block size 16, depth 2 (the default),
prefix caching on. `--churn` (new cases `engine_s<N>_churn`, the default cases unchanged):
request i first ends after i + 1 tokens and every ending request is replaced by a new one
(a fresh random 64-token prompt, N tokens), so about one request ends and one prompt is
computed in each step, as in serving with streams that end and start (step_overhead,
steady_serving): most plans mix decodes with a prompt chunk. Prints one JSON line per case: `engine_us_per_step` (p50 over windows of
`--window` steps, and all windows), steps, and the cProfile top functions with `--profile`.

Usage: .venv/bin/python benchmarks/engine_bench.py [--streams 32,256] [--steps 2000]
       [--window 200] [--sink null|hub] [--churn] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import statistics
import sys
import time

import numpy as np
from pagedserve.protos import wire
from pagedserve.protos.codec import Codec
from pagedserve.router.edge_hub import EdgeHub, ForwardChannel
from pagedserve.router.edge_wire import Outputs
from pagedserve.router.engine import EngineConfig, RouterEngine
from pagedserve.router.types import ModelInfoData, RequestSpec, SamplingSpec

from pagedserve.gc_tuning import freeze_heap

BENCH = "engine_bench"
BLOCK_SIZE = 16
PROMPT_LEN = 64
VOCAB = 32000
TOKEN = 1234  # every sampled token (not an EOS)
MAX_MODEL_LEN = 8192
WARMUP_PLANS = 20  # plans before timing: the prefills, then steady decode


class _NullSink:
    """A request's output sink that keeps nothing (the API worker's side is not timed)."""

    closed = False
    on_finish = None  # --churn: called when the request ends

    def put(self, delta) -> None:
        pass

    def deliver(self, *args) -> None:
        pass

    def push_token(self, index, token_id) -> None:
        pass

    def finish(self, usage, prompt_logprobs=(), embedding=None) -> None:
        if self.on_finish is not None:
            self.on_finish()

    def fail(self, error) -> None:
        pass


class _Tokenizer:
    """Enough of router.tokenizer.Tokenizer for admission with text=False."""

    eos_token_ids = (2,)
    special_token_ids = frozenset({2})

    def decode(self, ids, skip_special_tokens=False) -> str:
        return ""

    def token_text(self, token_id: int) -> str:
        return ""

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_token_ids


class _AnsweringLink:
    """The executor link: each plan is answered on the next loop turn by a zero-time
    executor (one token per sampled request; marked decodes need no state here)."""

    def __init__(self, engine: RouterEngine, executor_id: str) -> None:
        self.engine = engine
        self.executor_id = executor_id
        self.codec = Codec()
        self.num_plans = 0
        self.executor_s = 0.0  # building and encoding results (subtracted)

    def send(self, routing_id, msg) -> None:
        if not isinstance(msg, wire.StepPlan):
            return
        self.codec.encode(msg)  # the router's link encodes every plan
        t0 = time.perf_counter()  # the executor's part from here: not the engine's
        ids = [rid for rid, s in zip(msg.request_ids, msg.do_sample.tolist(), strict=True)
               if s]
        frame = self.codec.encode(wire.StepResult(
            step_id=msg.step_id, executor_id=self.executor_id, request_ids=ids,
            token_ids=np.full(len(ids), TOKEN, dtype=np.int32), forward_s=1e-3))
        self.executor_s += time.perf_counter() - t0
        self.num_plans += 1
        asyncio.get_running_loop().call_soon(self._answer, frame)

    def _answer(self, frame: bytes) -> None:
        self.engine.steps.on_result(self.executor_id, self.codec.decode(frame))

    async def close(self) -> None:
        pass


async def run_case(streams: int, steps: int, window: int, profile: bool,
                   sink: str = "null", churn: bool = False) -> dict:
    config = EngineConfig(model_fingerprint="fp", block_size=BLOCK_SIZE,
                          max_model_len=MAX_MODEL_LEN,
                          max_num_seqs=max(256, streams), max_num_batched_tokens=8192,
                          pipeline_depth=2)
    info = ModelInfoData("m", "LlamaForCausalLM", MAX_MODEL_LEN, VOCAB, BLOCK_SIZE, "bfloat16",
                         (2,))
    engine = RouterEngine(config, _Tokenizer(), info)
    link = engine.link = _AnsweringLink(engine, "e0")
    # (at least what one request could ever need, so that 1-3 streams are admitted too)
    num_blocks = max(streams * ((PROMPT_LEN + steps + 64) // BLOCK_SIZE + 2),
                     (PROMPT_LEN + steps + 1000) // BLOCK_SIZE + 16)
    hello = wire.Hello(executor_id="e0", model_fingerprint="fp", device="cuda",
                       dtype="bfloat16", block_size=BLOCK_SIZE, num_gpu_blocks=num_blocks,
                       num_cpu_blocks=0, max_model_len=MAX_MODEL_LEN)
    assert engine.membership.on_hello(b"e0", hello).accepted
    hub = conn = None
    if sink == "hub":
        hub = EdgeHub(engine, engine.metrics)
        hub.start()
        conn = hub.worker(0)
        conn.routing_id = b"worker-nobody-holds"
        hub_sent = [0, 0]  # Outputs messages, the steady tokens in their columns
        send = hub._send

        def counting_send(conn, msg, **kwargs) -> None:
            if isinstance(msg, Outputs):
                hub_sent[0] += 1
                hub_sent[1] += len(msg.token_ids)
            send(conn, msg, **kwargs)
        hub._send = counting_send
    rng = np.random.default_rng(0)
    ended: list[int] = []  # --churn: requests that ended, replaced on the next loop turn
    admitted = [0]

    def admit(max_tokens: int) -> None:
        i = admitted[0]
        admitted[0] += 1
        prompt = tuple(rng.integers(3, VOCAB, PROMPT_LEN).tolist())
        spec = RequestSpec(f"r{i}", prompt, SamplingSpec(max_tokens=max_tokens,
                                                         temperature=0.0, ignore_eos=True))
        if hub is None:
            channel = _NullSink()
            if churn:
                channel.on_finish = lambda: ended.append(i)
        else:
            channel = ForwardChannel(hub, conn, spec.request_id)
        engine.admit(spec, channel=channel, text=False)

    for i in range(streams):
        admit(i + 1 if churn else steps + 1000)
    engine.executors["e0"].wakeup.set()

    def replace_ended() -> None:
        if ended:
            for _ in range(len(ended)):
                admit(streams)
            ended.clear()
            engine.executors["e0"].wakeup.set()

    while link.num_plans < WARMUP_PLANS:  # prefills done, steady decode from here
        await asyncio.sleep(0)
        replace_ended()
    prof = cProfile.Profile() if profile else None
    times: list[float] = []
    start_plans, t0, ex0 = link.num_plans, time.perf_counter(), link.executor_s
    if prof is not None:
        prof.enable()
    mark = start_plans
    while link.num_plans - start_plans < steps:
        await asyncio.sleep(0)
        replace_ended()
        if link.num_plans - mark >= window:
            t1, ex1 = time.perf_counter(), link.executor_s
            times.append((t1 - t0 - (ex1 - ex0)) / (link.num_plans - mark) * 1e6)
            t0, ex0, mark = t1, ex1, link.num_plans
    if prof is not None:
        prof.disable()
    handle = engine.executors["e0"]
    decoding = len(handle.scheduler.running)
    await engine.stop()
    if hub is not None:
        await hub.close()
    suffix = ("" if hub is None else "_hub") + ("_churn" if churn else "")
    res = {"bench": BENCH, "case": f"engine_s{streams}{suffix}", "streams": streams,
           "running": decoding, "steps": link.num_plans - start_plans,
           "engine_us_per_step_p50": round(statistics.median(times), 1),
           "engine_us_per_step_windows": [round(t, 1) for t in times]}
    if hub is not None:
        res["hub_messages"], res["hub_column_tokens"] = hub_sent
    if churn:
        res["requests_admitted"] = admitted[0]
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue(), file=sys.stderr)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="32,256")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--window", type=int, default=200)
    ap.add_argument("--sink", choices=("null", "hub"), default="null",
                    help="where outputs go: nowhere, or API workers' forwarding channels")
    ap.add_argument("--churn", action="store_true",
                    help="requests end and are replaced, ~1 a step (null sink only)")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    if args.churn and args.sink != "null":
        ap.error("--churn runs with the null sink")
    if PROMPT_LEN + WARMUP_PLANS + args.steps > MAX_MODEL_LEN:  # the streams would end
        ap.error(f"--steps at most {MAX_MODEL_LEN - PROMPT_LEN - WARMUP_PLANS} "
                 f"(max_model_len {MAX_MODEL_LEN})")
    freeze_heap()  # the router process's garbage-collector settings (pagedserve/gc_tuning.py)
    for n in (int(x) for x in args.streams.split(",") if x):
        r = asyncio.run(run_case(n, args.steps, args.window, args.profile, args.sink,
                                 args.churn))
        print(json.dumps(r), flush=True)
        print(f"{r['case']:<14} {r['engine_us_per_step_p50']} us a step p50 "
              f"({r['running']} running, {r['steps']} steps)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
