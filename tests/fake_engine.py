"""A fake Engine for the API edges' tests (gRPC and HTTP): a fixed script of tokens through
real TextAssemblers, as the real engine uses them — one per sample, `append(token)` after every
step, `finish("abort")` on abort."""

from __future__ import annotations

import asyncio
import time

from pagedserve.router.detokenizer import TextAssembler
from pagedserve.router.errors import AlreadyExists, QueueFull, Unavailable
from pagedserve.router.tokenizer import Tokenizer
from pagedserve.router.types import (
    ClusterStatusData,
    CompletionDelta,
    ExecutorStatusData,
    ModelInfoData,
    RequestOutput,
    RequestSpec,
    TokenLogprob,
    Usage,
)


def make_tokenizer(tmp_path_factory) -> Tokenizer:
    """The test tokenizer (pagedserve.tinymodels, ChatML template) in a fresh folder."""
    from pagedserve.tinymodels import build_tokenizer

    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d)
    return Tokenizer.from_dir(d)


SCRIPT = "Hello there, 日本語のテキスト 🙂🚀 and more words. " * 4


async def eventually(condition, timeout_s: float = 10.0) -> None:
    """Poll `condition()` every 10 ms until it holds or `timeout_s` has passed; the caller
    then asserts it. What a test checks is that it happens, not how fast: a bound of a few
    dozen polls failed on a loaded machine."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)



class FakeEngine:
    """Emits a fixed script of tokens (shifted by sample index) at `step_s` per step."""

    def __init__(self, tokenizer: Tokenizer, step_s: float = 0.002):
        self.tok = tokenizer
        self.step_s = step_s
        self.script = tokenizer.encode(SCRIPT)[1:]
        self.live: dict[str, asyncio.Event] = {}
        self.aborted: list[str] = []
        self.submitted: list[RequestSpec] = []
        self.serving = True
        self.queue_full = False
        self.tasks: list[asyncio.Future] = []

    async def submit(self, spec: RequestSpec):
        if spec.request_id in self.live:
            raise AlreadyExists(f"request {spec.request_id!r} is live")
        if self.queue_full:
            raise QueueFull("the waiting queue is full")
        if not self.serving:
            raise Unavailable("no executor is up")
        self.submitted.append(spec)
        abort = self.live[spec.request_id] = asyncio.Event()
        queue: asyncio.Queue = asyncio.Queue()
        self.tasks.append(asyncio.ensure_future(self._produce(spec, abort, queue)))
        return self._consume(queue)

    @staticmethod
    async def _consume(queue: asyncio.Queue):
        # Like the real engine: the consumer only reads what the step loop produced.
        while True:
            out = await queue.get()
            yield out
            if out.finished:
                return

    async def _produce(self, spec: RequestSpec, abort: asyncio.Event, queue: asyncio.Queue):
        sp = spec.sampling
        samples = {
            i: TextAssembler(self.tok, sp, spec.prompt_token_ids, eos_token_ids=self.tok.eos_token_ids)
            for i in range(sp.n)
        }
        pos = 0
        total = 0
        try:
            while samples:
                await asyncio.sleep(self.step_s)
                deltas = []
                if abort.is_set():
                    for i, a in samples.items():
                        deltas.append(CompletionDelta(index=i, text=a.finish("abort"), finish_reason="abort"))
                    samples.clear()
                else:
                    for i, a in list(samples.items()):
                        t = self.script[(pos + i) % len(self.script)]
                        u = a.append(t)
                        total += 1
                        lp = ()
                        if sp.logprobs is not None:
                            lp = (TokenLogprob(t, -0.5, tuple((t + k, -1.0 - k) for k in range(sp.logprobs))),)
                        deltas.append(CompletionDelta(
                            index=i, text=u.text, token_ids=(t,), logprobs=lp,
                            finish_reason=u.finish_reason, stop_string=u.stop_string,
                            stop_token_id=u.stop_token_id))
                        if u.finished:
                            del samples[i]
                    pos += 1
                usage = Usage(len(spec.prompt_token_ids), total, 3) if not samples else None
                queue.put_nowait(RequestOutput(spec.request_id, tuple(deltas), usage))
        finally:
            self.live.pop(spec.request_id, None)

    def abort(self, request_id: str) -> bool:
        ev = self.live.get(request_id)
        if ev is None:
            return False
        self.aborted.append(request_id)
        ev.set()
        return True

    def model_info(self) -> ModelInfoData:
        return ModelInfoData("tiny", "LlamaForCausalLM", 256, self.tok.vocab_size, 16, "float32", (1,))

    def cluster_status(self) -> ClusterStatusData:
        ex = ExecutorStatusData("e0", "cpu", True, 100, 90, 10, 10, 1, 2, 0)
        return ClusterStatusData((ex,), prefix_cache_queries=10, prefix_cache_hits=4)

    def is_serving(self) -> bool:
        return self.serving


