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


class ResultApplier:
    """The router's result path without the text stage (mirrors StepLoop.apply_result /
    apply_tokens and the group-completion part of Delivery.text_stage)."""

    def __init__(self, scheduler: Scheduler, max_model_len: int) -> None:
        self.scheduler = scheduler
        self.max_model_len = max_model_len
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
            if seq.num_output_tokens >= group.spec.sampling.max_tokens or \
                    len(seq.token_ids) >= max_len:
                sched.finish_seq(seq)
                if all(s.finished for s in group.seqs):
                    sched.remove(group)
                    del self.live[rid]
                    self.num_finished += 1
