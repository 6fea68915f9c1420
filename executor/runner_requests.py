"""The model runner's requests: the states a plan adds (new requests, forks) and drops
(finished ids), each with its row of the runner's `RequestRows`, and the count of those
whose sampling is not plain greedy (`SamplingState.plain`, fixed for a state's life).

Functions of the ModelRunner (bound as its methods in model_runner.py; `self` is the
runner). The count lets a step whose every request is plain greedy (the usual decode
workload) skip walking its rows to find that out: at 256 rows the walk was ~35 us of the
main thread's time a step on the CPU machine, twice, between two forwards (the sample-first
verdict and the sampler's own).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.executor.sampling_state import SamplingState
from pagedserve.executor.step_records import RequestState
from pagedserve.protos.wire import RequestError, StepPlan

if TYPE_CHECKING:
    from pagedserve.executor.model_runner import ModelRunner


def put(self: ModelRunner, request_id: str, state: RequestState) -> None:
    old = self.requests.get(request_id)
    if old is not None:
        self._pending.apply()  # before its row can change hands
        self.rows.release(old.row)
        self._not_plain -= not old._sampling.plain
    self.requests[request_id] = state
    self._not_plain += not state._sampling.plain
    self._row_of[request_id] = state.row
    params = state._sampling.params
    if params.prompt_logprobs is not None or params.embed:
        self._scoring[request_id] = state._sampling
    else:
        self._scoring.pop(request_id, None)


def drop(self: ModelRunner, request_id: str) -> None:
    old = self.requests.pop(request_id, None)
    if old is not None:
        self._not_plain -= not old._sampling.plain
        pending = self._pending
        if pending.states and pending.token_ids is None:
            pending.released.append(old.row)  # released once the step's tokens are in
        else:
            pending.apply()  # before its row can change hands
            self.rows.release(old.row)
        del self._row_of[request_id]
        self._scoring.pop(request_id, None)


def update_requests(self: ModelRunner, plan: StepPlan,
                    new_states: list[SamplingState]) -> list[RequestError]:
    """The plan's finished ids dropped, its new requests and forks added (an error for a
    fork of an unknown parent)."""
    errors: list[RequestError] = []
    if not (plan.finished_ids or plan.new_requests or plan.forks):
        return errors
    for rid in plan.finished_ids:
        drop(self, rid)
    for req, sampling in zip(plan.new_requests, new_states, strict=True):
        row = self.rows.add()
        if req.lora and self.loras is not None:  # an unknown one is condemned (plan_inputs)
            self.rows.lora[row] = self.loras.slots.get(req.lora, 0)
        put(self, req.request_id, RequestState(row, sampling, self._pending))
    if plan.forks:
        self._pending.apply()  # a child copies its parent's records
    for fork in plan.forks:
        parent = self.requests.get(fork.parent_id)
        if parent is None:
            errors.append(RequestError(fork.child_id, f"fork of unknown {fork.parent_id!r}"))
            drop(self, fork.child_id)  # a state under that id is not the router's child
            continue
        # The child inherits the parent's table and last sample too (its row is a copy):
        # a fork planned while that token was in flight feeds it to both (their common
        # input).
        put(self, fork.child_id, RequestState(
            self.rows.fork(parent.row), parent.sampling.fork(fork.sample_index),
            self._pending))
    return errors
