"""The router's view of a request while it runs: one `RequestGroup` per request, one
`Sequence` per sample, and the `OutputChannel` the gRPC edge reads from.

A sequence's `token_ids` is prompt + output so far, tokens the router has received only;
`num_computed_tokens` counts the tokens whose keys/values are in the executor's cache or
scheduled in a plan in flight (the scheduler advances it when it schedules, as vLLM V1 does).
Every token the sequence ever had is here, so preemption by recompute or a move to another
executor loses nothing.

Pipelined steps: `num_pending` counts tokens being sampled for the sequence by plans in
flight, not received yet. They are a count, never a placeholder id: the sequence's length as
the scheduler sees it is `len(token_ids) + num_pending` (`num_tokens`), and a decode of a
pending token is sent marked, for the executor to feed its own sample.
"""

from __future__ import annotations

import asyncio
import enum
import time
from typing import TYPE_CHECKING, Protocol

from .detokenizer import TextAssembler
from .types import CompletionDelta, RequestOutput, RequestSpec, TokenLogprob, Usage

if TYPE_CHECKING:
    from .beam_search import BeamSearch
    from .prefix_pull import Pull


class GroupStatus(enum.Enum):
    WAITING = "waiting"  # queued on an executor, no blocks (new, or preempted by recompute)
    RUNNING = "running"
    SWAPPED = "swapped"  # blocks in the executor's CPU swap space
    FINISHED = "finished"


class Sequence:
    """One sample of a request."""

    __slots__ = (
        "seq_id", "group", "index", "token_ids", "num_prompt_tokens", "num_computed_tokens",
        "block_hashes", "on_executor", "assembler", "finished", "num_delivered",
        "last_token_time", "logprobs", "num_pending", "sampled_plan",
    )

    def __init__(self, group: RequestGroup, index: int, assembler: TextAssembler,
                 seq_id: str = "", token_ids: list[int] | None = None) -> None:
        """`seq_id` (default: `request_id#index`) and `token_ids` (default: a copy of the
        prompt) are given for a beam forked mid-search (router/beam_search.py)."""
        self.group = group
        self.index = index
        self.seq_id = seq_id or f"{group.request_id}#{index}"
        self.token_ids: list[int] = token_ids if token_ids is not None else \
            list(group.spec.prompt_token_ids)
        self.num_prompt_tokens = len(group.spec.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_pending = 0  # tokens sampled by plans in flight, not received yet
        # Which of its scheduler's plans sampled it last (their count then; kept from
        # pipeline depth 3 on: Scheduler.schedule)
        self.sampled_plan = -1
        self.block_hashes: list = []  # prefix-cache hashes of full blocks, extended in place
        self.on_executor = False  # the executor holds its state (NewRequest sent, not dropped)
        self.assembler = assembler
        self.finished = False  # no more tokens are scheduled for it (cheap stop or text stop)
        self.num_delivered = 0  # output tokens handed to the text stage
        self.last_token_time = 0.0
        self.logprobs: list[TokenLogprob] = []

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        """Tokens received plus tokens being sampled in plans in flight."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def __repr__(self) -> str:
        return f"Sequence({self.seq_id}, tokens={len(self.token_ids)}, " \
               f"pending={self.num_pending}, computed={self.num_computed_tokens})"


class OutputSink(Protocol):
    """Where a request's outputs go: `OutputChannel` (an edge in this process reads it) or an
    API worker's forwarding channel (edge_hub.py). Never blocks the producer."""

    closed: bool

    def put(self, delta: CompletionDelta) -> None: ...

    def deliver(self, index: int, text: str, token_ids: tuple, logprobs: tuple,
                finish_reason, stop_string, stop_token_id) -> None:
        """`put` of a delta with these fields (a sink may skip making the object)."""

    def push_token(self, index: int, token_id: int) -> None:
        """`deliver(index, "", (token_id,), (), None, None, None)`: the steady decode's
        form, the one most tokens take."""

    def finish(self, usage: Usage, prompt_logprobs: tuple = (), embedding=None) -> None: ...

    def fail(self, error: BaseException) -> None: ...


class OutputChannel:
    """Deltas waiting for the consumer, coalesced per sample: when the consumer falls behind,
    the next item simply carries several tokens. Never blocks the producer."""

    def __init__(self) -> None:
        self._pending: dict[int, list[CompletionDelta]] = {}
        self._usage: Usage | None = None
        self._prompt_logprobs: tuple = ()
        self._embedding = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self.closed = False
        self.reader = None  # the stream `open_stream` handed out: whose request this is

    def open_stream(self, request_id: str):
        """The request's output stream (`stream`), remembered: an edge that leaves it
        early aborts the request only if the request under that id is still this one."""
        self.reader = self.stream(request_id)
        return self.reader

    def put(self, delta: CompletionDelta) -> None:
        if self.closed:
            return
        self._pending.setdefault(delta.index, []).append(delta)
        self._event.set()

    def deliver(self, index: int, text: str, token_ids: tuple, logprobs: tuple,
                finish_reason, stop_string, stop_token_id) -> None:
        self.put(CompletionDelta(index, text, token_ids, logprobs, finish_reason, stop_string,
                                 stop_token_id))

    def push_token(self, index: int, token_id: int) -> None:
        self.put(CompletionDelta(index, "", (token_id,)))

    def finish(self, usage: Usage, prompt_logprobs: tuple = (), embedding=None) -> None:
        if self.closed:
            return
        self._usage = usage
        self._prompt_logprobs = prompt_logprobs
        self._embedding = embedding
        self.closed = True
        self._event.set()

    def fail(self, error: BaseException) -> None:
        if self.closed:
            return
        self._error = error
        self.closed = True
        self._event.set()

    @staticmethod
    def _merge(deltas: list[CompletionDelta]) -> CompletionDelta:
        if len(deltas) == 1:
            return deltas[0]
        last = deltas[-1]
        return CompletionDelta(
            index=last.index,
            text="".join(d.text for d in deltas),
            token_ids=tuple(t for d in deltas for t in d.token_ids),
            logprobs=tuple(lp for d in deltas for lp in d.logprobs),
            finish_reason=last.finish_reason,
            stop_string=last.stop_string,
            stop_token_id=last.stop_token_id,
        )

    async def stream(self, request_id: str):
        while True:
            await self._event.wait()
            self._event.clear()
            pending = self._pending
            if len(pending) == 1:  # one sample (n = 1, or one sample's turn): no sort
                (waiting,) = pending.values()
                deltas = (self._merge(waiting),)
            else:
                deltas = tuple(self._merge(pending[i]) for i in sorted(pending))
            pending.clear()
            if self._error is not None and not deltas:
                raise self._error
            if self._usage is not None:
                yield RequestOutput(request_id, deltas, self._usage, self._prompt_logprobs,
                                    self._embedding)
                return
            if self._error is not None:
                yield RequestOutput(request_id, deltas)
                raise self._error
            if deltas:
                yield RequestOutput(request_id, deltas)


class RequestGroup:
    """A request and its samples: the unit of routing, priority and preemption."""

    def __init__(self, spec: RequestSpec, assemblers: list[TextAssembler], arrival_seq: int):
        self.spec = spec
        self.request_id = spec.request_id
        self.arrival_seq = arrival_seq  # the engine's admission count: newer is larger
        self.sort_key = (spec.priority, arrival_seq)
        self.seqs = [Sequence(self, i, a) for i, a in enumerate(assemblers)]
        self.status = GroupStatus.WAITING
        self.executor_id: str | None = None
        # n > 1: sample 0 computes the prompt but its last token, then the others fork from it.
        self.forked = spec.sampling.n == 1 or len(spec.prompt_token_ids) == 1
        self.num_preemptions = 0
        self.aborted = False
        # prompt_logprobs: the scores of prompt tokens 1, 2, ... received so far, in order
        self.prompt_logprobs: list[TokenLogprob] = []
        self.embedding = None  # an embedding request's vector (float32), once computed
        self.cached_prompt_tokens: int | None = None
        self.pinned_tokens = 0  # prompt tokens pinned in the prefix cache (routing, waits)
        # Prompt tokens it waited for at its last admission attempt (prefill dedup: blocks
        # another request here is computing first); 0 when not waiting for any.
        self.prefix_wait_tokens = 0
        self.arrival_time = spec.arrival_time or time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.channel: OutputSink = OutputChannel()
        # (stop ids with EOS unless ignored, as its samples' assemblers hold them,
        # min_tokens, max_tokens, asks logprobs): the token rules the router applies to
        # every sampled token, gathered once (StepLoop.apply_tokens)
        self.token_rules: tuple | None = None
        self.beam: BeamSearch | None = None  # beam search's state (router/beam_search.py)
        # the decode executor it moves to once the plan ending its prompt is answered
        # (router/handoff.py); None: it stays
        self.handoff: str | None = None
        # the prefix pull bringing blocks of its prompt from another executor
        # (router/prefix_pull.py): admission waits for it; None: none
        self.pull: Pull | None = None
        # Predicted Outputs: the prediction's tokens its samples drafted and the model
        # confirmed, and rejected (router/speculative.py counts them)
        self.accepted_prediction_tokens = 0
        self.rejected_prediction_tokens = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.spec.prompt_token_ids)

    def active_seqs(self) -> list[Sequence]:
        """Samples that take part in scheduling now (before the fork: sample 0 only).
        Read-only: for n = 1 (nearly every request) it is `seqs` itself, no list a step."""
        seqs = self.seqs
        if len(seqs) == 1:
            return seqs if not seqs[0].finished else []
        if not self.forked:
            return [seqs[0]]
        return [s for s in seqs if not s.finished]

    def leave_executor(self) -> None:
        """Forget what its executor computed, before it is queued on another (a migration,
        a handoff to a decode executor: router/handoff.py): its samples recompute their
        tokens so far there (from what that executor's prefix cache holds), no token is in
        flight for it any more, nothing is pinned or marked to move, no pull is awaited
        (one in flight still ends: router/prefix_pull.py)."""
        for seq in self.seqs:
            seq.num_computed_tokens = 0
            seq.num_pending = 0
            seq.on_executor = False
        self.pinned_tokens = 0
        self.handoff = None
        self.pull = None

    @property
    def has_pending(self) -> bool:
        """A plan in flight samples for one of its samples (not re-admittable until back)."""
        return any(s.num_pending for s in self.seqs)

    @property
    def all_finished(self) -> bool:
        return all(s.assembler.finished for s in self.seqs)

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=sum(s.assembler.num_tokens for s in self.seqs),
            cached_prompt_tokens=self.cached_prompt_tokens or 0,
            accepted_prediction_tokens=self.accepted_prediction_tokens,
            rejected_prediction_tokens=self.rejected_prediction_tokens,
        )

    def __repr__(self) -> str:
        return f"RequestGroup({self.request_id}, {self.status.value}, n={len(self.seqs)})"
