"""Beam search in the router: n beams of one request, ranked by their logprob sums, kept
as the request's samples, their KV blocks shared by copy-on-write.

The executor does nothing special for a beam: each beam is a sample that decodes one
token a step and answers with the top-K logprobs of its next position (log-softmax of
the raw logits; K = max(2, 1 + number of stop ids) x n, transformers' count). When every
live beam of a request has answered, `advance` runs one step of transformers' beam search
(`GenerationMixin._beam_search`, whose results it reproduces token for token):

1. every beam's candidates score beam score + logprob (float32, as transformers adds);
   before min_tokens the stop ids are not candidates. The best K candidates over all
   beams are kept (ties: the better-ranked beam, then the lower token id);
2. a candidate that ends (a stop id, or max_tokens reached) among the best n of the K
   becomes a finished hypothesis, scored logprob sum / generated length ** length_penalty;
   the best n hypotheses are kept;
3. the best n candidates that do not end are the next beams. A beam with one child keeps
   its sample (the token appended); a beam with several forks: each further child takes
   the sample of a beam that had none (`KVCacheManager.fork`: every block shared; the
   child's first write into the shared last block copies it) under a new sample id, and
   the next plan forks it on the executor (a copy of the parent's state); a beam with no
   child is freed and the executor drops it;
4. the search ends when no candidate continues (max_tokens), when n hypotheses are in
   and (early_stopping True) or the best running beam cannot beat the worst of them
   (its score / current length ** length_penalty, or / max_tokens ** length_penalty with
   early_stopping "never" and a positive length_penalty): the n hypotheses, best first,
   are the request's completions.

A beam never decodes a token still in flight (the next step's inputs are known only from
this step's answers), so a beam search is one step behind the pipeline: it decodes every
other plan at depth 2 while other requests pipeline as usual. Preemption (swap or
recompute), migration and aborts treat the beams as any request's samples: an answer kept
for a beam stays valid until its step runs, since its tokens change only there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .sequence import RequestGroup, Sequence
from .types import SamplingSpec, TokenLogprob

if TYPE_CHECKING:
    from .engine import RouterEngine
    from .membership import ExecutorHandle
    from .scheduler import Scheduler

NEG = np.float32(-1e9)  # transformers' "never chosen" offset


@dataclass(slots=True)
class Hypothesis:
    """A finished beam: its output tokens (the stop id that ended it included) and
    their logprobs, and its length-penalized score."""

    score: float
    token_ids: list[int]
    logprobs: list[TokenLogprob]


@dataclass(slots=True)
class Candidate:
    """A next beam: the slot of its parent beam, its token and its logprob sum."""

    parent: int
    token_id: int
    logprob: TokenLogprob
    score: np.float32


class BeamSearch:
    """One request's beam search state (`RequestGroup.beam`)."""

    __slots__ = ("width", "length_penalty", "early_stopping", "max_tokens", "min_tokens",
                 "stop_ids", "_stop_arr", "k", "num_logprobs", "user_logprobs", "scores",
                 "order", "finished", "improvable", "answers", "serial")

    def __init__(self, sampling: SamplingSpec, stop_ids: frozenset[int],
                 vocab_size: int) -> None:
        assert sampling.beam is not None
        self.width = sampling.n
        self.length_penalty = sampling.beam.length_penalty
        self.early_stopping = sampling.beam.early_stopping
        self.max_tokens = sampling.max_tokens
        self.min_tokens = sampling.min_tokens
        self.stop_ids = stop_ids  # the ids that end a beam: EOS unless ignored + stop ids
        self._stop_arr = np.fromiter(sorted(stop_ids), np.int64, len(stop_ids))
        self.k = min(vocab_size, max(2, 1 + len(stop_ids)) * self.width)
        self.user_logprobs = sampling.logprobs  # the client's top-k (None: no logprobs)
        self.num_logprobs = max(self.k, sampling.logprobs or 0)  # what a beam's row returns
        self.scores = np.zeros(self.width, np.float32)  # running beams' scores, by slot
        self.order = [0]  # the running beams' slots, best first (one beam: the prompt)
        self.finished: list[Hypothesis] = []  # best first, at most `width`
        self.improvable = True
        self.answers: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # slot -> (ids, lps)
        self.serial = 0  # forks so far: the suffix of a forked beam's sample id

    @classmethod
    def start(cls, group: RequestGroup, vocab_size: int) -> BeamSearch:
        """The search of a new request (`RequestGroup.beam`). Slots 1.. hold no beam until
        the first step: their samples never run, and the one beam computes the whole
        prompt (no fork after it as for n samples)."""
        beam = cls(group.spec.sampling, group.seqs[0].assembler.stop_token_ids, vocab_size)
        for seq in group.seqs[1:]:
            seq.finished = True
        group.forked = True
        return beam

    # ------------------------------------------------------------------ answers

    def take(self, seq: Sequence, ids: np.ndarray, lps: np.ndarray) -> bool:
        """A beam's top-K answer for its next position; False if `seq` is no running
        beam of this search (a sample replaced since: dropped)."""
        slot = seq.index
        if slot not in self.order or seq.group.seqs[slot] is not seq:
            return False
        self.answers[slot] = (ids, lps)
        return True

    def ready(self, group: RequestGroup) -> bool:
        """Every running beam has answered and none has a row in flight."""
        return all(slot in self.answers and not group.seqs[slot].num_pending
                   for slot in self.order)

    # ------------------------------------------------------------------ one step

    def select(self, num_generated: int, history: Callable[[int], tuple[list, list]]
               ) -> tuple[list[Candidate], bool]:
        """Step `num_generated` -> `num_generated + 1` from the answers: the next beams,
        best first, and whether the search is done. Adds the hypotheses that end here,
        their outputs and logprobs so far from `history(slot)` (asked only for those)."""
        width = self.width
        answers = [self.answers[slot] for slot in self.order]
        if num_generated < self.min_tokens and len(self._stop_arr):  # no stop id yet
            kept = []
            for ids, vals in answers:
                keep = ~self._stops(ids)
                kept.append((ids[keep], vals[keep]))
            answers = kept
        sizes = [len(ids) for ids, _ in answers]
        lp = np.concatenate([vals for _, vals in answers]).astype(np.float32)
        token = np.concatenate([ids for ids, _ in answers]).astype(np.int64)
        rank_of = np.repeat(np.arange(len(answers)), sizes)
        score = self.scores[self.order][rank_of] + lp
        best = np.lexsort((token, rank_of, -score))[: self.k]  # best score, then beam rank
        score, rank_of, token, lp = score[best], rank_of[best], token[best], lp[best]
        at_length = num_generated + 1 >= self.max_tokens
        ends = np.ones(len(best), bool) if at_length else self._stops(token)
        self._add_finished(num_generated, score, rank_of, token, lp, ends, history)
        running_key = np.where(ends, score + NEG, score).astype(np.float32)
        nxt = np.argsort(-running_key, kind="stable")[:width]
        running = []
        for j in nxt.tolist():
            parent, tok = self.order[int(rank_of[j])], int(token[j])
            running.append(Candidate(parent, tok, self._logprob(parent, tok, float(lp[j])),
                                     running_key[j]))
        full = len(self.finished) == width
        if full:
            length = num_generated + 1
            if self.early_stopping == "never" and self.length_penalty > 0:
                length = self.max_tokens
            best_possible = running[0].score / np.float32(length ** self.length_penalty)
            self.improvable = self.improvable and bool(best_possible > self.finished[-1].score)
        done = bool(ends.all()) or not self.improvable or (full and self.early_stopping is True)
        return running, done

    def _stops(self, ids: np.ndarray) -> np.ndarray:
        """Which of `ids` are stop ids (a compare a stop id: np.isin costs ~10x on these
        few ids)."""
        stops = self._stop_arr
        if len(stops) == 1:
            return ids == stops[0]
        return (ids[:, None] == stops).any(axis=1)

    def _add_finished(self, num_generated: int, score, rank_of, token, lp, ends,
                      history) -> None:
        """Candidates among the best `width` that end become hypotheses (transformers'
        `_update_finished_beams`); the best `width` hypotheses are kept."""
        width = self.width  # (n in with early_stopping True: the search ended before)
        denom = np.float32((num_generated + 1) ** self.length_penalty)
        added = False
        for j in range(min(width, len(score))):
            if not ends[j]:
                continue
            slot = self.order[int(rank_of[j])]
            outputs, logprobs = history(slot)
            self.finished.append(Hypothesis(
                float(score[j] / denom), [*outputs, int(token[j])],
                [*logprobs, self._logprob(slot, int(token[j]), float(lp[j]))]))
            added = True
        if added:  # (stable: an earlier hypothesis wins a tie, as it does in transformers)
            self.finished.sort(key=lambda h: -h.score)
            del self.finished[width:]

    def _logprob(self, slot: int, token_id: int, logprob: float) -> TokenLogprob:
        """The token's logprob and, when the client asked for k, its beam's top k."""
        if self.user_logprobs is None:
            return _NO_LOGPROB
        ids, vals = self.answers[slot]
        k = self.user_logprobs
        return TokenLogprob(token_id, logprob, tuple(zip(ids[:k].tolist(), vals[:k].tolist(),
                                                         strict=True)))


_NO_LOGPROB = TokenLogprob(-1, 0.0)


def advance(engine: RouterEngine, handle: ExecutorHandle, group: RequestGroup) -> None:
    """One beam search step for a request whose beams have all answered: the next beams
    take their samples (kept, forked or freed) or the search ends and the request
    completes."""
    beam = group.beam
    sched = handle.scheduler
    seqs = group.seqs
    head = seqs[beam.order[0]]
    num_generated = head.num_output_tokens
    wants = beam.user_logprobs is not None
    running, done = beam.select(num_generated, lambda s: (
        seqs[s].token_ids[seqs[s].num_prompt_tokens:], seqs[s].logprobs))
    beam.answers.clear()
    if done:
        _complete(engine, handle, group)
        return
    children: dict[int, list[Candidate]] = {}
    for cand in running:
        children.setdefault(cand.parent, []).append(cand)
    free_slots = [s for s in range(beam.width) if s not in children]
    placed: list[tuple[int, Candidate]] = []
    new_seqs: dict[int, Sequence] = {}
    for parent_slot, cands in children.items():  # forks first: parents are all alive
        parent = seqs[parent_slot]
        placed.append((parent_slot, cands[0]))
        for cand in cands[1:]:
            slot = free_slots.pop(0)
            beam.serial += 1
            new_seqs[slot] = _branch(sched, parent, seqs[slot], beam.serial)
            placed.append((slot, cand))
    for slot, child in new_seqs.items():  # then the beams without a child go
        old = seqs[slot]
        if not old.finished:
            sched.finish_seq(old)
        seqs[slot] = child
    for slot, cand in placed:
        seq = seqs[slot]
        seq.token_ids.append(cand.token_id)
        if wants:
            seq.logprobs.append(cand.logprob)
        beam.scores[slot] = cand.score
    slot_of = {id(cand): slot for slot, cand in placed}
    beam.order = [slot_of[id(cand)] for cand in running]


def _branch(sched: Scheduler, parent: Sequence, slot: Sequence, serial: int) -> Sequence:
    """A new beam forked from `parent` in `slot`'s place (its index and assembler), with
    the parent's tokens and logprobs so far; it shares the parent's blocks, and the next
    plan's forks tell the executor to copy the parent's state (DESIGN §2's forks). A
    parent with no blocks or not on the executor (preempted by recompute, migrated, while
    the step's rows were out): the child has none either and goes to the executor as a new
    request carrying its outputs when it is computed again (the group forks again)."""
    group = parent.group
    child = Sequence(group, slot.index, slot.assembler,
                     f"{group.request_id}#{slot.index}.{serial}", list(parent.token_ids))
    child.logprobs = list(parent.logprobs)
    child.block_hashes = list(parent.block_hashes)
    if sched.kv.has_request(parent.seq_id):
        sched.kv.fork(parent.seq_id, child.seq_id)
        child.num_computed_tokens = parent.num_computed_tokens
        if parent.on_executor:
            sched.pending_forks.append((parent, child))
    return child


def _complete(engine: RouterEngine, handle: ExecutorHandle, group: RequestGroup) -> None:
    """The search is done: every beam's blocks are freed and the best hypotheses are the
    request's completions, best first."""
    beam = group.beam
    sched = handle.scheduler
    for seq in group.seqs:
        if not seq.finished:
            sched.finish_seq(seq)
    delivery = engine.delivery
    total = 0
    for i, hyp in enumerate(beam.finished[: beam.width]):
        total += delivery.deliver_whole(group.seqs[i], hyp.token_ids,
                                        hyp.logprobs if beam.user_logprobs is not None else ())
    engine.metrics.add_generation_tokens(total)
    if group.request_id in engine.live:
        sched.remove(group)
        delivery.complete(group)
