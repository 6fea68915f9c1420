"""The executor benchmarks' plans and the loops that run them (benchmarks/executor_bench.py;
tests/test_executor_gap.py and benchmarks/dtype_bench.py use them too): plans built as the
router builds them, for decodes of take-over requests, decodes with a prompt joining every
step, and a prefill then fed decodes; steps timed one at a time, or run through the
executor process's own pipelined loop (submit / collect, an I/O thread decoding and
preparing the next plan) without its sockets."""

from __future__ import annotations

import queue
import threading
import time
import zlib

import numpy as np
import torch
from pagedserve.executor.model_runner import ModelRunner
from pagedserve.protos.codec import Codec
from pagedserve.protos.wire import NewRequest, SamplingParams, StepPlan, int32


def decode_plans(batch: int, context: int, block_size: int, steps: int, vocab: int,
                 feed: bool = False, sampling: SamplingParams | None = None,
                 tag: str = "", first_step: int = 0, finish: bool = False):
    """Plans: step 0 registers ``batch`` requests with ``context`` prompt tokens already
    computed and decodes one token each; the next steps decode one more token each (with
    ``feed``: marked ``feed_sampled``, each fed the token the executor sampled for it in the
    step before, as the pipelining router plans them; else a random token given). Greedy
    unless ``sampling`` is given. Request ids ``tag`` + s0, s1, ..., step ids from
    ``first_step``; with ``finish`` a last plan ends the requests (`finish_plan`), so that
    another run's take the same blocks over in the same runner."""
    rng = np.random.default_rng(0)
    blocks_per_seq = (context + steps + block_size) // block_size
    tables = np.arange(batch * blocks_per_seq, dtype=np.int32).reshape(batch, blocks_per_seq)
    sampling = sampling or SamplingParams(temperature=0.0)
    ids = [f"{tag}s{i}" for i in range(batch)]
    for step in range(steps):
        pos = context + step
        new = [] if step else [
            NewRequest(request_id=r, prompt_token_ids=int32(rng.integers(0, vocab, context)),
                       output_token_ids=int32([]), sampling=sampling) for r in ids]
        yield StepPlan(
            step_id=first_step + step, new_requests=new, request_ids=ids,
            num_computed_tokens=int32([pos] * batch), num_new_tokens=int32([1] * batch),
            do_sample=np.ones(batch, np.uint8),
            feed_sampled=np.ones(batch, np.uint8) if feed and step else None,
            token_ids=int32(np.full(batch, -1) if feed and step else rng.integers(0, vocab, batch)),
            positions=int32([pos] * batch),
            slot_mapping=(tables[:, pos // block_size].astype(np.int64) * block_size
                          + pos % block_size),
            block_table_starts=int32([0 if step == 0 else blocks_per_seq] * batch),
            block_table_lens=int32([blocks_per_seq if step == 0 else 0] * batch),
            block_table_ids=tables.reshape(-1) if step == 0 else int32([]),
        )
    if finish:
        yield finish_plan(first_step + steps, ids)


def finish_plan(step: int, request_ids: list[str]) -> StepPlan:
    """A plan that runs nothing and ends ``request_ids`` (their blocks free again)."""
    empty = int32([])
    return StepPlan(step_id=step, new_requests=[], request_ids=[], num_computed_tokens=empty,
                    num_new_tokens=empty, do_sample=np.zeros(0, np.uint8), token_ids=empty,
                    positions=empty, slot_mapping=np.zeros(0, np.int64),
                    block_table_starts=empty, block_table_lens=empty, block_table_ids=empty,
                    finished_ids=list(request_ids))


def mixed_plans(batch: int, context: int, chunk: int, block_size: int, steps: int,
                vocab: int):
    """``decode_plans`` with one more request in every step after the first: a prompt of
    ``chunk`` tokens computed whole in that step (sampling its first token) and dropped in
    the next plan — the mixed prefill-and-decode step of a server whose streams end and
    start all the time, which the executor runs eagerly (its CUDA graphs are decode-only)."""
    rng = np.random.default_rng(1)
    decode_blocks = batch * ((context + steps + block_size) // block_size)
    chunk_blocks = -(-chunk // block_size)
    sampling = SamplingParams(temperature=0.0)
    for step, plan in enumerate(decode_plans(batch, context, block_size, steps, vocab)):
        if step == 0:
            yield plan
            continue
        rid = f"p{step}"
        blocks = decode_blocks + (step % 2) * chunk_blocks + np.arange(chunk_blocks)
        pos = np.arange(chunk)
        yield StepPlan(
            step_id=plan.step_id,
            new_requests=[NewRequest(request_id=rid,
                                     prompt_token_ids=int32(rng.integers(0, vocab, chunk)),
                                     output_token_ids=int32([]), sampling=sampling)],
            request_ids=[*plan.request_ids, rid],
            num_computed_tokens=int32([*plan.num_computed_tokens, 0]),
            num_new_tokens=int32([*plan.num_new_tokens, chunk]),
            do_sample=np.ones(batch + 1, np.uint8),
            token_ids=int32([*plan.token_ids, *rng.integers(0, vocab, chunk)]),
            positions=int32([*plan.positions, *pos]),
            slot_mapping=np.concatenate([plan.slot_mapping,
                                         blocks[pos // block_size] * block_size
                                         + pos % block_size]).astype(np.int64),
            block_table_starts=int32([*plan.block_table_starts, 0]),
            block_table_lens=int32([*plan.block_table_lens, chunk_blocks]),
            block_table_ids=int32([*plan.block_table_ids, *blocks]),
            finished_ids=[f"p{step - 1}"] if step > 1 else [],
        )


def pipelined_decode_plans(batch: int, prompt_len: int, block_size: int, steps: int,
                           vocab: int):
    """Step 0 prefills ``batch`` prompts (each samples); every later step decodes one token
    per request, marked ``feed_sampled`` (placeholder -1: the executor feeds its own
    sample), with a block appended to a table whenever its tokens need one. Block ids
    interleave across requests, as a shared free list hands them out."""
    rng = np.random.default_rng(0)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    ids = [f"req-{i:06d}" for i in range(batch)]
    max_blocks = (prompt_len + steps) // block_size + 2
    tables = np.arange(batch * max_blocks, dtype=np.int32).reshape(max_blocks, batch).T
    synced = np.zeros(batch, np.int64)  # table entries the executor holds
    computed = np.zeros(batch, np.int64)
    for step in range(steps):
        new, feed = [], None
        if step == 0:
            num_new = np.full(batch, prompt_len)
            new = [NewRequest(request_id=r, prompt_token_ids=int32(rng.integers(0, vocab,
                                                                                prompt_len)),
                              output_token_ids=int32([]), sampling=greedy) for r in ids]
            tokens = np.concatenate([q.prompt_token_ids for q in new]).astype(np.int32)
        else:
            num_new = np.ones(batch, np.int64)
            tokens = np.full(batch, -1, np.int32)
            feed = np.ones(batch, np.uint8)
        end = computed + num_new
        need = -(-end // block_size)
        row = np.repeat(np.arange(batch), num_new)
        pos = computed[row] + np.arange(int(num_new.sum())) - (np.cumsum(num_new) - num_new)[row]
        yield StepPlan(
            step_id=step, new_requests=new, request_ids=list(ids),
            num_computed_tokens=int32(computed), num_new_tokens=int32(num_new),
            do_sample=np.ones(batch, np.uint8), feed_sampled=feed, token_ids=tokens,
            positions=int32(pos),
            slot_mapping=(tables[row, pos // block_size].astype(np.int64) * block_size
                          + pos % block_size),
            block_table_starts=int32(synced), block_table_lens=int32(need - synced),
            block_table_ids=np.concatenate([tables[i, synced[i]:need[i]]
                                            for i in range(batch)]).astype(np.int32))
        synced, computed = need, end


def time_steps(runner: ModelRunner, plans) -> list[float]:
    times = []
    for plan in plans:
        t0 = time.perf_counter()
        result = runner.execute(plan)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        assert not result.errors, result.errors
    return times[2:]  # warm-up: registration step and the first decode


class _LoopIO:
    """The executor's I/O thread without the socket, for the loops below: plan N is decoded
    from MessagePack and `precompute`d (into ``inbox``) each time something is put on
    ``wake`` (a result, encoded first, as the I/O thread encodes results; True: nothing to
    encode); None on ``wake`` stops it. Plan 0 is asked for at `start`."""

    def __init__(self, runner: ModelRunner, plans) -> None:
        encoder = Codec()
        self.frames = [[bytes(f) for f in encoder.encode(plan)] for plan in plans]
        self.runner = runner
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.wake: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        # Results computed whole in a step: out when the next forward starts (the first
        # forward asks for plan 1: at depth 2, plan N+1 comes in while step N runs).
        self.held: list = [True]

    def before_forward(self) -> None:  # ModelRunner.before_forward
        for item in self.held:
            self.wake.put(item)
        self.held.clear()

    def _run(self) -> None:
        decoder, result_encoder = Codec(), Codec()
        for frame in self.frames:
            item = self.wake.get()
            if item is None:
                return
            if item is not True:
                result_encoder.encode(item)
            plan = decoder.decode(frame)
            self.inbox.put((plan, self.runner.precompute(plan)))

    def start(self) -> None:
        self._thread.start()
        self.wake.put(True)  # plan 0

    def stop(self) -> None:
        self.wake.put(None)
        self._thread.join()


class _Figures:
    """The steps' figures as results come: gap_s, forward_s, sample_s and the interval to
    the previous result of the steps from ``warmup`` on, and every step's tokens."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.gaps: list[float] = []
        self.forwards: list[float] = []
        self.samples: list[float] = []
        self.periods: list[float] = []
        self.tokens: list[np.ndarray] = []
        self._last: float | None = None

    def record(self, result) -> None:
        assert not result.errors, result.errors
        now = time.perf_counter()
        self.tokens.append(result.token_ids)
        if result.step_id >= self.warmup:
            self.gaps.append(result.gap_s)
            self.forwards.append(result.forward_s)
            self.samples.append(result.sample_s)
            self.periods.append(now - self._last)
        self._last = now

    def as_dict(self) -> dict:
        return {"gaps": self.gaps, "forwards": self.forwards, "samples": self.samples,
                "periods": self.periods,
                "tokens_crc32": f"{zlib.crc32(np.concatenate(self.tokens).tobytes()):08x}"}


def pipelined_steps(runner: ModelRunner, plans, warmup: int) -> dict:
    """The executor process's loop without sockets, at pipeline depth 2: plan N+1 is
    decoded from MessagePack and `precompute`d on a second thread (the executor's I/O
    thread) while step N runs, where results are encoded too; steps go through
    `ModelRunner.submit` / `collect` as the process runs them (a sampling step stays in
    flight until the next is launched). Returns the steps after ``warmup``: their gap_s,
    forward_s, the intervals between consecutive results (the step period: what the
    executor's throughput is), sample_s, and the crc32 of every sampled token."""
    io, figures = _LoopIO(runner, plans), _Figures(warmup)
    runner.before_forward = io.before_forward
    io.start()
    with torch.inference_mode():  # as the executor process runs its loop
        for _ in range(len(io.frames)):
            try:
                plan, inputs = io.inbox.get_nowait()
            except queue.Empty:  # nothing to run next: the step in flight answers now
                result = runner.collect()
                if result is not None:
                    figures.record(result)
                    io.wake.put(result)
                plan, inputs = io.inbox.get()
            for result in runner.submit(plan, inputs):
                figures.record(result)
                if result.step_id == plan.step_id:
                    io.held.append(result)  # computed here: out with the next forward
                else:
                    io.wake.put(result)  # read back after this launch: out at once
        result = runner.collect()
        if result is not None:
            figures.record(result)
    io.stop()
    runner.before_forward = None
    return figures.as_dict()


def serve_loop_steps(runner: ModelRunner, plans, warmup: int) -> dict:
    """`pipelined_steps` with the executor process's own waiting rule (executor/process.py
    `serve`): with no plan in the inbox, a step in flight the device is done with is read
    back at once; else the main thread blocks on the inbox, where a watcher thread (the
    process's `FlightWatch`, `ask`) puts `StepDone` once that step is done, and whichever
    comes first wins: the next plan (launched behind the step in flight) or StepDone (that
    step read back and answered). `pipelined_steps` instead reads
    the step in flight back at once when the next plan is not decoded yet, which serialises
    every other step on a GPU (a trace on an H200, 2026-11-27: the device idle ~1.4 ms in
    every second step). Results read back after a launch go out at once
    (`ModelRunner.result_ready`, as the process sets it). Plans arrive as in
    `pipelined_steps`: plan N+2 is decoded and prepared once result N is out (depth 2 with
    an instant router). Same figures."""
    from pagedserve.executor.io_threads import FlightWatch, StepDone

    io, figures = _LoopIO(runner, plans), _Figures(warmup)

    def send_now(result) -> None:  # read back after the next launch: out at once
        figures.record(result)
        io.wake.put(result)

    watch = FlightWatch()
    runner.before_forward, runner.result_ready = io.before_forward, send_now
    io.start()
    try:
        with torch.inference_mode():  # as the executor process runs its loop
            launched = 0
            while launched < len(io.frames):
                try:
                    msg = io.inbox.get_nowait()
                except queue.Empty:  # about to wait (the process's rule)
                    done = watch.ask(runner, io.inbox)
                    msg = StepDone(runner.inflight_step[0]) if done else io.inbox.get()
                if isinstance(msg, StepDone):
                    inflight = runner.inflight_step
                    if inflight is not None and inflight[0] == msg.step_id:
                        result = runner.collect()
                        if result is not None:
                            send_now(result)
                    continue
                plan, inputs = msg
                launched += 1
                for result in runner.submit(plan, inputs):
                    if result.step_id == plan.step_id:
                        figures.record(result)
                        io.held.append(result)
                    else:
                        send_now(result)
            result = runner.collect()
            if result is not None:
                figures.record(result)
    finally:
        io.stop()
        if watch.is_alive():
            watch.stop()
            watch.join()
        runner.before_forward = runner.result_ready = None
    return figures.as_dict()


def randomise_cache(kv_cache) -> None:
    """Random keys and values in every slot (standard normal), an fp8 cache (kv_dtypes.py)
    filled layer by layer through bfloat16 (torch draws no fp8 numbers)."""
    import torch

    if kv_cache.element_size() != 1:
        kv_cache.normal_()
        return
    for layer in kv_cache:
        layer.copy_(torch.randn(layer.shape, dtype=torch.bfloat16, device=layer.device))
