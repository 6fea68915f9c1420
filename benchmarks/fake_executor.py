"""Helpers shared by the router benchmarks: synthetic requests and a fake executor.

The fake executor does no model work: for every request a plan samples (`do_sample`), it
returns one token. Results are applied the way `StepLoop.apply_tokens` does (append the
token, cheap stops by `max_tokens` / `max_model_len`, `finish_seq`, then `remove` once every
sample is done); text detokenization is skipped (the vLLM reference excludes it too), so each
sample carries a do-nothing assembler.
"""

from __future__ import annotations

import numpy as np
from pagedserve.protos import wire
from pagedserve.router.scheduler import Scheduler
from pagedserve.router.sequence import RequestGroup, Sequence
from pagedserve.router.types import RequestSpec, SamplingSpec

VOCAB = 32000


class NoTextAssembler:
    """Stands in for the detokenizer's TextAssembler: the benchmark skips the text stage."""

    finished = False
    num_tokens = 0


def make_groups(prompts: list[list[int]], max_tokens: int, prefix: str = "r",
                start: int = 0) -> list[RequestGroup]:
    """One n=1 greedy request per prompt, EOS ignored (only max_tokens stops it)."""
    sampling = SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    groups = []
    for i, ids in enumerate(prompts):
        spec = RequestSpec(request_id=f"{prefix}{start + i}", prompt_token_ids=tuple(ids),
                           sampling=sampling, arrival_time=1.0)
        groups.append(RequestGroup(spec, [NoTextAssembler()], arrival_seq=start + i))
    return groups


def fake_execute(plan: wire.StepPlan, step: int) -> wire.StepResult:
    """One token for every request the plan samples from (the executor's side)."""
    if not plan.request_ids:
        return wire.StepResult(step_id=plan.step_id)
    sampled = np.flatnonzero(plan.do_sample)
    ids = [plan.request_ids[i] for i in sampled.tolist()]
    tokens = ((sampled * 7919 + step * 104729) % VOCAB).astype(np.int32)
    return wire.StepResult(step_id=plan.step_id, request_ids=ids, token_ids=tokens)


class PipelinedFake:
    """The executor's side with state, for plans sent ahead (pipelined steps): `receive`
    plans as the router sends them, `answer` the oldest. It feeds every marked decode the
    token it sampled for that request in the previous step and checks it did sample one
    there (a -1 in an unmarked row, or a mark without that sample, is a violation); samples
    `fake_token(request, output position)`, the model's EOS at output position `eos_at`
    when given; `unanswered` lists the plans not answered yet."""

    def __init__(self, eos_token_id: int | None = None, eos_at: int | None = None) -> None:
        self.eos_token_id, self.eos_at = eos_token_id, eos_at
        self.unanswered: list[wire.StepPlan] = []
        self.outputs: dict[str, list[int]] = {}  # request id -> output tokens sampled here
        self.last: dict[str, tuple[int, int]] = {}  # request id -> (step, token) sampled
        self.violations: list[str] = []

    def receive(self, plan: wire.StepPlan) -> None:
        self.unanswered.append(plan)

    def token(self, request_id: str, position: int) -> int:
        if position == self.eos_at and self.eos_token_id is not None:
            return self.eos_token_id
        tok = (sum(map(ord, request_id)) * 31 + position * 7919) % VOCAB
        return tok if tok != self.eos_token_id else (tok + 1) % VOCAB

    def answer(self) -> wire.StepResult:
        plan = self.unanswered.pop(0)
        for rid in plan.finished_ids:
            self.outputs.pop(rid, None)
            self.last.pop(rid, None)
        for req in plan.new_requests:
            self.outputs[req.request_id] = req.output_token_ids.tolist()
        for fork in plan.forks:
            self.outputs[fork.child_id] = list(self.outputs.get(fork.parent_id, []))
        feed = plan.feed_sampled
        first = np.cumsum(plan.num_new_tokens) - plan.num_new_tokens if plan.request_ids \
            else np.zeros(0, np.int64)
        ids, tokens, errors = [], [], []
        for i, rid in enumerate(plan.request_ids):
            marked = feed is not None and bool(feed[i])
            placeholder = int(plan.token_ids[first[i]]) == -1
            if marked != placeholder:
                self.violations.append(f"step {plan.step_id}: {rid} marked={marked} "
                                       f"placeholder={placeholder}")
            if marked and self.last.get(rid, (-1, -1))[0] != plan.step_id - 1:
                errors.append(wire.RequestError(rid, "no sample of the previous step"))
                continue
            if plan.do_sample[i]:
                out = self.outputs.setdefault(rid, [])
                tok = self.token(rid, len(out))
                out.append(tok)
                self.last[rid] = (plan.step_id, tok)
                ids.append(rid)
                tokens.append(tok)
        return wire.StepResult(step_id=plan.step_id, request_ids=ids,
                               token_ids=np.array(tokens, dtype=np.int32), errors=errors)


class ResultApplier:
    """The router's result path without the text stage (mirrors StepLoop.apply_result /
    apply_tokens and the group-completion part of Delivery.text_stage)."""

    def __init__(self, scheduler: Scheduler, max_model_len: int,
                 eos_token_ids: tuple[int, ...] = ()) -> None:
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids  # ends a sample (the groups here ignore_eos
        # unless made otherwise)
        self.live: dict[str, RequestGroup] = {}
        self.num_finished = 0
        self.num_tokens = 0

    def add(self, group: RequestGroup) -> None:
        self.live[group.request_id] = group
        self.scheduler.add(group)

    def apply(self, result: wire.StepResult, sampled: list[Sequence] = ()) -> None:
        """`sampled`: the samples the answered plan sampled for (`SchedulerOutput.sampled`),
        pending until now."""
        for seq in sampled:
            seq.num_pending -= 1
        if not result.request_ids:
            return
        sched = self.scheduler
        tokens = result.token_ids.tolist()
        max_len = self.max_model_len
        for i, seq_id in enumerate(result.request_ids):
            rid, idx = seq_id.rsplit("#", 1)
            group = self.live.get(rid)
            if group is None:
                continue
            seq: Sequence = group.seqs[int(idx)]
            if seq.finished:
                continue
            seq.token_ids.append(tokens[i])
            self.num_tokens += 1
            sp = group.spec.sampling
            if seq.num_output_tokens >= sp.max_tokens or len(seq.token_ids) >= max_len or (
                    not sp.ignore_eos and tokens[i] in self.eos_token_ids):
                sched.finish_seq(seq)
                if all(s.finished for s in group.seqs):
                    sched.remove(group)
                    del self.live[rid]
                    self.num_finished += 1
