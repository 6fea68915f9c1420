"""The in-process rig of the router's pipelined step loop: a RouterEngine whose executor is
`SimExecutor`, which answers plans exactly when a test says so.

`SimExecutor` plays the executor's side of the protocol: it keeps each request's output
tokens, feeds every marked decode the token it sampled itself in the previous step (and
checks that it did sample one there), and samples a deterministic token per (request,
output position), so any lost, duplicated or reordered token shows in the outputs. KV
invariants are checked after every plan (`debug_checks`). Used by test_router_pipeline,
test_prefill_dedup and test_cpu_dtypes.
"""

from __future__ import annotations

import asyncio

import numpy as np
from pagedserve.protos import wire
from pagedserve.router.engine import EngineConfig, RouterEngine
from pagedserve.router.scheduler import PreemptionMode
from pagedserve.router.types import ModelInfoData, RequestSpec, SamplingSpec

VOCAB = 64
EOS = 63
BS = 4


class CharTokenizer:
    """Token i is the character chr(65 + i) (EOS is special)."""

    special_token_ids = frozenset({EOS})
    eos_token_ids = (EOS,)

    def is_special(self, t):
        return t in self.special_token_ids

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(65 + i) for i in ids
                       if not (skip_special_tokens and i in self.special_token_ids))

    def token_text(self, t):
        return self.decode([t])


def sim_token(seq_id: str, out_pos: int) -> int:
    """The token the simulated executor samples at output position `out_pos` (never EOS)."""
    return (sum(map(ord, seq_id)) * 7 + out_pos * 13) % (VOCAB - 2)


class FakeLink:
    def __init__(self) -> None:
        self.sent: list = []  # every message sent, in order
        self.to: list[bytes] = []  # the routing id each went to

    def send(self, routing_id, msg) -> None:
        self.sent.append(msg)
        self.to.append(routing_id)

    async def close(self) -> None:
        pass


class SimExecutor:
    """The executor's side: request state, fed-back tokens, deterministic samples."""

    def __init__(self, engine: RouterEngine, executor_id: str = "e0") -> None:
        self.engine = engine
        self.id = executor_id
        self.routing_id = executor_id.encode()  # as the tests register it (on_hello)
        self.out: dict[str, list[int]] = {}  # seq id -> output tokens on this executor
        self.last: dict[str, tuple[int, int]] = {}  # seq id -> (step, token sampled)
        self.answered = 0
        self.overrides: dict[tuple[str, int], int] = {}  # (seq id, out pos) -> token
        self.num_drafted = 0  # rows answered that had drafts

    @property
    def plans(self) -> list[wire.StepPlan]:
        link = self.engine.link
        return [m for to, m in zip(link.to, link.sent, strict=True)
                if to == self.routing_id and isinstance(m, wire.StepPlan)]

    def unanswered(self) -> list[wire.StepPlan]:
        return self.plans[self.answered:]

    def result_for(self, plan: wire.StepPlan) -> wire.StepResult:
        for rid in plan.finished_ids:
            self.out.pop(rid, None)
        for req in plan.new_requests:
            self.out[req.request_id] = req.output_token_ids.tolist()
        for fork in plan.forks:
            self.out[fork.child_id] = list(self.out[fork.parent_id])
        ids, tokens, errors = [], [], []
        feed = plan.feed_sampled if plan.feed_sampled is not None \
            else np.zeros(plan.num_seqs, np.uint8)
        for i, rid in enumerate(plan.request_ids):
            if feed[i]:
                step, token = self.last.get(rid, (-1, -1))
                assert plan.token_ids[int(plan.num_new_tokens[:i].sum())] == -1
                if step != plan.step_id - 1:
                    errors.append(wire.RequestError(rid, "no sample of the previous step"))
                    continue
            if plan.do_sample[i]:
                # A row with d drafts (speculative decoding) emits its samples up to and
                # including the first that differs from the draft after it.
                d = int(plan.num_draft_tokens[i]) if plan.num_draft_tokens is not None else 0
                first = int(plan.num_new_tokens[:i].sum())
                row = plan.token_ids[first:first + 1 + d].tolist()
                if d:
                    self.num_drafted += 1
                    assert not feed[i] and plan.num_new_tokens[i] == 1 + d
                    at = plan.positions[first:first + 1 + d].tolist()
                    assert at == list(range(at[0], at[0] + 1 + d)), at
                    if self.out[rid]:
                        assert row[0] == self.out[rid][-1], (rid, row)
                for j in range(d + 1):
                    pos = len(self.out[rid])
                    tok = self.overrides.get((rid, pos), sim_token(rid, pos))
                    self.out[rid].append(tok)
                    self.last[rid] = (plan.step_id, tok)
                    ids.append(rid)
                    tokens.append(tok)
                    if j == d or tok != row[j + 1]:
                        break
        return wire.StepResult(step_id=plan.step_id, executor_id=self.id, request_ids=ids,
                               token_ids=np.array(tokens, dtype=np.int32), errors=errors,
                               forward_s=1e-3)

    async def answer(self, count: int = 1) -> None:
        for _ in range(count):
            await self.wait_plans(1)
            plan = self.unanswered()[0]
            self.answered += 1
            self.engine.steps.on_result(self.id, self.result_for(plan))
            await settle()

    async def wait_plans(self, n: int, timeout_s: float = 5.0) -> None:
        """Until at least `n` plans are unanswered."""
        end = asyncio.get_running_loop().time() + timeout_s
        while len(self.unanswered()) < n:
            assert asyncio.get_running_loop().time() < end, \
                f"{len(self.unanswered())} plans unanswered, waited for {n}"
            await asyncio.sleep(0.001)

    async def run_one_in_flight(self, streams: list[Collector], max_steps: int = 500) -> None:
        """`run_until_done` for speculative decoding: checks that no plan follows one
        with drafts before its result."""
        for _ in range(max_steps):
            if all(s.done for s in streams):
                return
            if self.unanswered():
                await settle()
                for plan in self.unanswered()[:-1]:  # a plan with drafts is followed by none
                    assert plan.num_draft_tokens is None, \
                        [p.step_id for p in self.unanswered()]
                await self.answer()
            else:
                await asyncio.sleep(0.002)
        raise AssertionError("requests did not finish")

    async def run_until_done(self, streams: list[Collector], max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if all(s.done for s in streams):
                return
            if self.unanswered():
                await self.answer()
            else:
                await asyncio.sleep(0.002)
        raise AssertionError("requests did not finish")


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


class Collector:
    """Drains one request's stream in the background."""

    def __init__(self, stream) -> None:
        self.outputs = []
        self.done = False
        self.error: BaseException | None = None
        self.task = asyncio.ensure_future(self._run(stream))

    async def _run(self, stream) -> None:
        try:
            async for out in stream:
                self.outputs.append(out)
        except BaseException as exc:  # noqa: BLE001 (recorded for the test)
            self.error = exc
        self.done = True

    def tokens(self, index: int = 0) -> list[int]:
        return [t for o in self.outputs for d in o.deltas if d.index == index
                for t in d.token_ids]

    def text(self, index: int = 0) -> str:
        return "".join(d.text for o in self.outputs for d in o.deltas if d.index == index)

    def finish(self, index: int = 0):
        reasons = [d for o in self.outputs for d in o.deltas
                   if d.index == index and d.finish_reason]
        return reasons[-1] if reasons else None

    @property
    def usage(self):
        return self.outputs[-1].usage if self.outputs else None


def make_engine(depth: int = 2, num_gpu_blocks: int = 64, num_cpu_blocks: int = 16,
                mode: PreemptionMode = PreemptionMode.AUTO, **cfg) -> tuple[RouterEngine,
                                                                             SimExecutor]:
    config = EngineConfig(model_fingerprint="fp", block_size=BS, max_model_len=128,
                          pipeline_depth=depth, preemption_mode=mode, debug_checks=True,
                          watermark=0.0, **cfg)
    info = ModelInfoData("m", "LlamaForCausalLM", 128, VOCAB, BS, "float32", (EOS,))
    engine = RouterEngine(config, CharTokenizer(), info)
    engine.link = FakeLink()
    hello = wire.Hello(executor_id="e0", model_fingerprint="fp", device="cpu", dtype="float32",
                       block_size=BS, num_gpu_blocks=num_gpu_blocks,
                       num_cpu_blocks=num_cpu_blocks, max_model_len=128)
    assert engine.membership.on_hello(b"e0", hello).accepted
    return engine, SimExecutor(engine)


async def submit(engine, rid, prompt, **sampling) -> Collector:
    sampling.setdefault("max_tokens", 8)
    sampling.setdefault("temperature", 0.0)
    spec = RequestSpec(rid, tuple(prompt), SamplingSpec(**sampling))
    return Collector(await engine.submit(spec))


def expected(seq_id: str, n: int) -> list[int]:
    return [sim_token(seq_id, p) for p in range(n)]


def free_blocks(engine) -> tuple[int, int]:
    """(allocatable now, held by no request) device blocks."""
    kv = engine.executors["e0"].kv
    return kv.num_free_gpu_blocks, kv.stats().gpu.num_free_blocks


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))
