"""Request lifecycle at the router's output end: text, stop strings, streams, endings.

    sampled tokens (step_loop) -> text_stage: detokenize, stop strings -> deliver -> stream
    every sample finished -> complete (usage, final item) | an error -> fail

Nothing here decides what an executor computes; it only turns tokens the router has
received into what the client sees, and ends requests.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from .errors import Unavailable
from .sequence import GroupStatus, RequestGroup, Sequence

if TYPE_CHECKING:
    from .engine import RouterEngine
    from .membership import ExecutorHandle
    from .scheduler import Scheduler

log = logging.getLogger("pagedserve.router")


class Delivery:
    """Turns received tokens into stream items and ends requests (one per engine)."""

    def __init__(self, engine: RouterEngine) -> None:
        self.engine = engine
        self.metrics = engine.metrics
        self.live = engine.live

    def text_stage(self, scheduler: Scheduler, touched: list[Sequence]) -> None:
        """Detokenize, match stop strings, push deltas; finish groups that are done."""
        done_groups: list[RequestGroup] = []
        num_tokens = 0
        for seq in touched:
            group = seq.group
            if group.aborted or seq.assembler.finished:
                continue
            start = seq.num_prompt_tokens + seq.num_delivered
            token_ids = seq.token_ids
            if len(token_ids) == start + 1 and not seq.logprobs:
                # The steady decode: one new token, no logprobs (no lists to build).
                tok = token_ids[start]
                update = seq.assembler.append(tok)
                seq.num_delivered += 1
                num_tokens += 1
                if update.finish_reason is None:
                    if update.text:
                        self.deliver(seq, update.text, (tok,), (), None)
                    else:  # no text to hand out (text=False, or held back)
                        self.push_token(seq, tok)
                    continue
                text, delivered, lps = update.text, (tok,), ()
            else:
                text, delivered, lps, update = self._take_new(seq, token_ids[start:])
                num_tokens += len(delivered)
            if update is not None and update.finished:
                if group.spec.sampling.embed:  # its one token is a means, not an output
                    num_tokens -= len(delivered)
                if not seq.finished:
                    scheduler.finish_seq(seq)  # a stop string: at most one token wasted
                self.deliver(seq, text, delivered, lps, update.finish_reason,
                             update.stop_string, update.stop_token_id)
                if group.all_finished:
                    done_groups.append(group)
            else:
                self.deliver(seq, text, delivered, lps, None)
        if num_tokens:  # one counter update a step, not one a sequence
            self.metrics.add_generation_tokens(num_tokens)
        for group in done_groups:
            if group.request_id in self.live:
                scheduler.remove(group)
                self.complete(group)

    @staticmethod
    def _assemble(seq: Sequence, new_ids) -> tuple:
        """(text, token ids, last update) of `new_ids` through the sample's assembler, up
        to the one that ends it."""
        text_parts: list[str] = []
        delivered: list[int] = []
        update = None
        for tok in new_ids:
            update = seq.assembler.append(tok)
            delivered.append(tok)
            text_parts.append(update.text)
            if update.finished:
                break
        return "".join(text_parts), tuple(delivered), update

    @classmethod
    def _take_new(cls, seq: Sequence, new_ids) -> tuple:
        """(text, token ids, logprobs, last update) of the sample's undelivered tokens, up
        to the one that ends it."""
        text, delivered, update = cls._assemble(seq, new_ids)
        seq.num_delivered += len(delivered)
        lps = tuple(seq.logprobs[: len(delivered)])
        del seq.logprobs[: len(delivered)]
        return text, delivered, lps, update

    def deliver_whole(self, seq: Sequence, token_ids: list[int], logprobs) -> int:
        """Hand a sample's whole output to its stream in one delta (a beam search's
        completion: router/beam_search.py), its text made by the sample's assembler, which
        ends it at its stop id or max_tokens; returns the tokens delivered."""
        text, delivered, update = self._assemble(seq, token_ids)
        if update is None or not update.finished:  # (a beam always ends where the rules do)
            text += seq.assembler.finish("length")
            reason, stop_string, stop_id = "length", None, None
        else:
            reason, stop_string, stop_id = (update.finish_reason, update.stop_string,
                                            update.stop_token_id)
        self.deliver(seq, text, delivered, tuple(logprobs), reason, stop_string, stop_id)
        return len(delivered)

    def finish_by_edge(self, handle: ExecutorHandle | None, seq: Sequence) -> bool:
        """A sample the API worker ended (a stop string in the text it assembles): as the
        text stage ends one, without a delta (the worker has handed out its ending)."""
        if seq.assembler.finished:
            return False
        seq.assembler.finish("stop")
        group = seq.group
        if handle is not None and not seq.finished:
            handle.scheduler.finish_seq(seq)
        seq.finished = True
        if group.all_finished and group.request_id in self.live:
            if handle is not None:
                handle.scheduler.remove(group)
            self.complete(group)
        if handle is not None:
            handle.wakeup.set()  # the step loop refreshes the gauges (engine.abort)
        return True

    def deliver(self, seq: Sequence, text: str, token_ids: tuple, logprobs: tuple,
                finish_reason, stop_string=None, stop_token_id=None) -> None:
        """Hand one sample's new text/tokens to its request's stream (the text stage counts
        them in pagedserve_generation_tokens_total). (TTFT, inter-token
        latency and the other client-facing latencies are measured by the gRPC edge when
        the stream hands them to the client.)"""
        group = seq.group
        if token_ids and group.first_token_time is None:
            group.first_token_time = time.monotonic()
        group.channel.deliver(seq.index, text, token_ids, logprobs, finish_reason,
                              stop_string, stop_token_id)

    def push_token(self, seq: Sequence, token_id: int) -> None:
        """`deliver` of one token with no text, no logprobs and no finish: the steady
        decode's form (an API worker's token column row)."""
        group = seq.group
        if group.first_token_time is None:
            group.first_token_time = time.monotonic()
        group.channel.push_token(seq.index, token_id)

    def complete(self, group: RequestGroup) -> None:
        """Every sample finished: the final item with usage; forget the request."""
        if group.spec.sampling.embed and group.embedding is None and not group.aborted:
            # its token came without its embedding: an executor's bug
            self.fail(group, Unavailable(f"the executor sent no embedding for "
                                         f"{group.request_id}"))
            return
        if self.live.pop(group.request_id, None) is None:
            return
        if group.spec.lora_adapter:  # an unload may wait for its last request
            self.engine.loras.request_ended(group.spec.lora_adapter)
        group.channel.finish(group.usage(), tuple(group.prompt_logprobs), group.embedding)
        if group.first_scheduled_time is not None:
            self.metrics.observe_queue_time(group.first_scheduled_time - group.arrival_time)

    def fail(self, group: RequestGroup, error: Exception) -> None:
        handle = self.engine.executors.get(group.executor_id or "")
        if handle is not None and group.status is not GroupStatus.FINISHED:
            handle.scheduler.remove(group)
        for seq in group.seqs:
            seq.finished = True
        if self.live.pop(group.request_id, None) is not None:
            if group.spec.lora_adapter:
                self.engine.loras.request_ended(group.spec.lora_adapter)
            group.channel.fail(error)  # the edge maps it to a status and counts the failure
