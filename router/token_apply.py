"""Applying a StepResult's tokens, prompt scores and embeddings to the router's requests (the step
loop's result path, router/step_loop.py; functions bound as `StepLoop` methods, `self`
is the loop).

HOT PATH: `apply_tokens` runs once per step per executor: no logging per request, no
per-token Python beyond appending the sampled token.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from ..protos import wire
from . import beam_search, predicted_outputs
from . import result_checks as checks
from .errors import Unavailable
from .predicted_outputs import PredictedDrafts
from .sequence import RequestGroup, Sequence
from .types import TokenLogprob

if TYPE_CHECKING:
    from .membership import ExecutorHandle
    from .step_loop import InFlightPlan, StepLoop

log = logging.getLogger("pagedserve.router")


def apply_prompt_scores(self: StepLoop, handle: ExecutorHandle, plan: InFlightPlan,
                        result: wire.StepResult) -> None:
    """Prompt logprobs: each request keeps the scores of prompt tokens 1, 2, ... in
    order, each position once (a recompute or a migration scores again what it has)."""
    ofs = top_ofs = 0
    for q, seq_id in enumerate(result.prompt_ids):
        first = int(result.prompt_starts[q])
        count, k = int(result.prompt_counts[q]), int(result.prompt_ks[q])
        group = self._plan_group(plan, seq_id)
        have = len(group.prompt_logprobs) if group is not None else -1
        if group is not None and group.executor_id == handle.id and first <= have + 1:
            lps = result.prompt_logprobs[ofs:ofs + count].tolist()
            rank_arr = (result.prompt_ranks[ofs:ofs + count]
                        if result.prompt_ranks is not None else None)
            ranks = rank_arr.tolist() if rank_arr is not None else [None] * count
            top_ids = result.prompt_top_token_ids[top_ofs:top_ofs + count * k]
            ids = top_ids.tolist()
            vals = result.prompt_top_logprobs[top_ofs:top_ofs + count * k].tolist()
            tokens = group.spec.prompt_token_ids
            wrong = checks.prompt_scores_wrong(first, count, len(tokens), top_ids,
                                               self.vocab_size, rank_arr)
            if wrong:  # an executor's bug (result_checks.py): that request fails
                log.error("executor %s: prompt scores of %s: %s", handle.id, seq_id, wrong)
                self.engine.delivery.fail(group, Unavailable(
                    f"the executor's prompt scores for {seq_id}: {wrong}"))
            else:
                for j in range(have + 1 - first, count):  # new positions only
                    top = tuple(zip(ids[j * k:(j + 1) * k], vals[j * k:(j + 1) * k],
                                    strict=True))
                    group.prompt_logprobs.append(
                        TokenLogprob(tokens[first + j], lps[j], top, ranks[j]))
        ofs += count
        top_ofs += count * k

def apply_embeddings(self: StepLoop, handle: ExecutorHandle, plan: InFlightPlan,
                     result: wire.StepResult) -> None:
    """Embedding requests whose prompt's last token the step computed keep its final
    hidden state (the last one received: a recompute sends the same vector again). One
    that is not finite fails its request (an executor's bug)."""
    for e, seq_id in enumerate(result.embed_ids):
        group = self._plan_group(plan, seq_id)
        if group is None or group.executor_id != handle.id or not group.spec.sampling.embed:
            continue
        vector = result.embeddings[e]
        if not np.isfinite(vector).all():
            log.error("executor %s: the embedding of %s is not finite", handle.id, seq_id)
            self.engine.delivery.fail(group, Unavailable(
                f"the executor's embedding for {seq_id} is not finite"))
            continue
        group.embedding = vector.copy()


def apply_tokens(self: StepLoop, handle: ExecutorHandle, result: wire.StepResult,
                 sampled: list[Sequence],
                 drafts: dict[Sequence, list[int]] | None = None) -> list[Sequence]:
    """Append sampled tokens and apply the cheap stops; returns the sequences that got a
    token for the text stage (an API worker's sample whose token ends nothing is
    delivered here instead). A sequence that stopped is freed at once; a token for a
    sequence that had already ended (a late stop), whose request is no longer live (an
    abort, even if a new request took its id since), that moved to another executor, or
    that the plan did not sample for, is dropped.

    `sampled`: the plan's samples in plan order. The executor answers them in that
    order (one token each, minus any it failed), so result row i is normally
    `sampled[i]`; otherwise it is found among those not answered yet by id (a second
    row for one is dropped). A sample still live that got neither a token nor an error
    (an executor's bug) fails its request: nothing would plan it again.

    `drafts`: the plan's rows with drafts, and their drafts (router/speculative.py). Such
    a row is answered by up to 1 + d consecutive rows; each after the first means the
    draft before it was confirmed (the token before it equals that draft: else an
    executor's bug, and the request fails), so its position is computed: the sample's
    computed tokens and slots advance by one (its blocks were allocated with the
    drafts).

    A beam search's row (`group.beam`) is its search's answer, the top-K of the beam's
    next position: taken by router/beam_search.py (no token is appended here); a search
    whose running beams have all answered takes its step after the last row."""
    sched = handle.scheduler
    touched: list[Sequence] = []
    ids = result.request_ids
    if not ids:
        if sampled:  # none answered with a token
            checks.fail_unanswered(self.engine, handle.id, result, sampled)
        return touched
    live = self.engine.live
    tokens = result.token_ids.tolist()
    lps = result.logprobs
    top_counts = result.top_counts.tolist() if result.top_counts is not None else None
    top_ofs = 0
    max_len = self.config.max_model_len
    handle_id = handle.id
    push_token = self.engine.delivery.push_token
    num_delivered = 0
    aligned = len(sampled) == len(ids)
    by_id: dict[str, Sequence] | None = None
    burst, burst_left = None, 0  # a drafted row's sample, and rows it may still have
    confirmed = dict.fromkeys(drafts, 0) if drafts else None  # a drafted sample's count
    beams: dict[RequestGroup, None] = {}  # beam searches answered in this result
    for i, seq_id in enumerate(ids):
        k = top_counts[i] if top_counts is not None else 0
        more = burst_left > 0 and burst.seq_id == seq_id
        if more:  # the next token of a drafted row
            seq = burst
            burst_left -= 1
        else:
            seq = sampled[i] if aligned else None
            if seq is None or seq.seq_id != seq_id:
                if by_id is None:  # those before row i are answered: by id from here on
                    by_id = {s.seq_id: s for s in sampled[i:]}
                    aligned = False
                seq = by_id.pop(seq_id, None)
            burst_left = 0
            if drafts and seq is not None and seq in drafts:
                burst, burst_left = seq, len(drafts[seq])
        group = seq.group if seq is not None else None
        if seq is None or seq.finished or live.get(group.request_id) is not group \
                or group.executor_id != handle_id:
            top_ofs += k
            continue
        if group.beam is not None:  # a beam's answer: the top-K of its next position
            if not k:  # an executor's bug: nothing to choose the next beams from
                self.engine.delivery.fail(group, Unavailable(
                    f"the executor answered beam {seq_id} without its logprobs"))
            elif group.beam.take(seq, result.top_token_ids[top_ofs:top_ofs + k],
                                 result.top_logprobs[top_ofs:top_ofs + k]):
                beams[group] = None
            top_ofs += k
            continue
        tok = tokens[i]
        token_ids = seq.token_ids
        if more:  # its input (the draft the last token confirmed) is computed
            if token_ids[-1] != drafts[seq][confirmed[seq]]:  # an executor's bug
                log.error("executor %s: %s: a token after an unconfirmed draft", handle_id,
                          seq_id)
                self.engine.delivery.fail(group, Unavailable(
                    f"the executor answered {seq_id}'s drafts wrongly"))
                top_ofs += k
                continue
            seq.num_computed_tokens += 1
            if handle.kv.allocate(seq_id, token_ids, 1) is None:
                raise RuntimeError(f"{seq_id}: a confirmed draft's slot was not held")
            confirmed[seq] += 1
        token_ids.append(tok)
        rules = group.token_rules
        if rules is None:  # (once a request: its sampling spec's rules as one tuple)
            sp = group.spec.sampling
            rules = group.token_rules = (seq.assembler.stop_token_ids, sp.min_tokens,
                                         sp.max_tokens, sp.logprobs is not None)
        stop_ids, min_tokens, max_tokens, wants_logprobs = rules
        if wants_logprobs and lps is not None:
            top = ()
            if k:
                ids_k = result.top_token_ids[top_ofs:top_ofs + k].tolist()
                vals = result.top_logprobs[top_ofs:top_ofs + k].tolist()
                top = tuple(zip(ids_k, vals, strict=False))
            seq.logprobs.append(TokenLogprob(tok, float(lps[i]), top))
        top_ofs += k
        n_out = len(token_ids) - seq.num_prompt_tokens
        # a stop id (or EOS unless ignored) ends it from min_tokens on
        if (tok in stop_ids and n_out >= min_tokens) or n_out >= max_tokens \
                or len(token_ids) >= max_len:
            sched.finish_seq(seq)
        elif seq.assembler.tokens_only and seq.num_delivered == n_out - 1 \
                and not wants_logprobs and not group.aborted:
            # An API worker's steady decode: no text to make and nothing ends (the
            # rules above are the tokens-only assembler's, so its append() would only
            # count the token: counted here), and the text stage's cheap form runs
            # here rather than in a second pass over the samples.
            seq.assembler.num_tokens = n_out
            seq.num_delivered = n_out
            push_token(seq, tok)
            num_delivered += 1
            continue
        if not touched or touched[-1] is not seq:
            touched.append(seq)
    if num_delivered:  # one counter update a step (as the text stage's)
        self.metrics.add_generation_tokens(num_delivered)
    if drafts:
        drafter = handle.scheduler.drafter
        for seq, n in confirmed.items():
            drafted = drafts[seq]
            drafter.confirmed(seq, len(drafted), n)
            if type(drafted) is PredictedDrafts:  # (the sample may have ended)
                predicted_outputs.count(seq.group, len(drafted), n)
        self.metrics.add_spec_decode(handle_id, len(drafts), sum(map(len, drafts.values())),
                                     sum(confirmed.values()))
    for group in beams:  # (after every row: a step needs all of a search's beams)
        if live.get(group.request_id) is group and group.beam.ready(group):
            beam_search.advance(self.engine, handle, group)
    if by_id:  # samples no row answered (left out, or others' rows in their places)
        checks.fail_unanswered(self.engine, handle.id, result, list(by_id.values()))
    return touched
