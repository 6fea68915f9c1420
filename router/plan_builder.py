"""SchedulerOutput -> StepPlan: the arrays an executor needs for one step.

Hot path: runs once per step per executor. Per scheduled sequence a handful of list
operations; token ids, positions and slots go into flat Python lists turned into numpy arrays
once at the end. Decodes (one new token) compute their slot inline instead of calling into
the KV manager.
"""

from __future__ import annotations

import numpy as np

from ..kvmanager import KVCacheManager
from ..protos import wire
from .scheduler import SchedulerOutput
from .sequence import RequestGroup, Sequence


def wire_sampling(group: RequestGroup, eos_token_ids: tuple[int, ...]) -> wire.SamplingParams:
    sp = group.spec.sampling
    return wire.SamplingParams(
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k if sp.top_k > 0 else 0,
        min_p=sp.min_p,
        seed=sp.seed,
        repetition_penalty=sp.repetition_penalty,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        min_tokens=sp.min_tokens,
        logprobs=sp.logprobs,
        stop_token_ids=tuple(sp.stop_token_ids),
        eos_token_ids=tuple(eos_token_ids),
        ignore_eos=sp.ignore_eos,
    )


def _new_request(seq: Sequence, eos_token_ids: tuple[int, ...]) -> wire.NewRequest:
    return wire.NewRequest(
        request_id=seq.seq_id,
        prompt_token_ids=np.asarray(seq.token_ids[: seq.num_prompt_tokens], dtype=np.int32),
        output_token_ids=np.asarray(seq.token_ids[seq.num_prompt_tokens:], dtype=np.int32),
        sampling=wire_sampling(seq.group, eos_token_ids),
        sample_index=seq.index,
    )


def build_plan(step_id: int, out: SchedulerOutput, kv: KVCacheManager,
               eos_token_ids: tuple[int, ...]) -> wire.StepPlan:
    """Turn one step's decisions into the StepPlan (and mark what the executor now knows)."""
    forks: list[wire.Fork] = []
    new_requests: list[wire.NewRequest] = []
    for parent, child in out.forks:
        if parent.on_executor:  # the executor copies the parent's sampling state
            forks.append(wire.Fork(parent.seq_id, child.seq_id, child.index))
            child.on_executor = True

    n = len(out.scheduled)
    request_ids: list[str] = []
    num_computed = np.empty(n, dtype=np.int32)
    num_new = np.empty(n, dtype=np.int32)
    do_sample = np.empty(n, dtype=np.uint8)
    table_starts = np.empty(n, dtype=np.int32)
    table_lens = np.empty(n, dtype=np.int32)
    table_ids: list[int] = []
    token_ids: list[int] = []
    slot_chunks: list = []  # ints (decodes) and arrays (prefill chunks), in token order
    positions = np.empty(out.num_tokens, dtype=np.int32)
    t = 0
    for i, item in enumerate(out.scheduled):
        seq = item.seq
        k = item.num_new_tokens
        end = seq.num_computed_tokens  # already advanced by the scheduler
        start = end - k
        if not seq.on_executor:
            new_requests.append(_new_request(seq, eos_token_ids))
            seq.on_executor = True
        request_ids.append(seq.seq_id)
        num_computed[i] = start
        num_new[i] = k
        do_sample[i] = end == len(seq.token_ids)
        change_start, change_ids = kv.take_table_change(seq.seq_id)
        table_starts[i] = change_start
        table_lens[i] = len(change_ids)
        table_ids.extend(change_ids)
        if k == 1:
            token_ids.append(seq.token_ids[start])
            slot_chunks.append(kv.slot(seq.seq_id, start))
            positions[t] = start
        else:
            token_ids.extend(seq.token_ids[start:end])
            slot_chunks.append(kv.slot_mapping(seq.seq_id, start, k))
            positions[t : t + k] = np.arange(start, end, dtype=np.int32)
        t += k

    slot_mapping = _concat_slots(slot_chunks, out.num_tokens)
    ops = kv.take_block_ops()
    return wire.StepPlan(
        step_id=step_id,
        new_requests=new_requests,
        forks=forks,
        request_ids=request_ids,
        num_computed_tokens=num_computed,
        num_new_tokens=num_new,
        do_sample=do_sample,
        token_ids=np.asarray(token_ids, dtype=np.int32),
        positions=positions,
        slot_mapping=slot_mapping,
        block_table_starts=table_starts,
        block_table_lens=table_lens,
        block_table_ids=np.asarray(table_ids, dtype=np.int32),
        swap_out=ops.swap_out,
        swap_in=ops.swap_in,
        copy=ops.copy,
        finished_ids=list(out.dropped_seq_ids),
    )


def _concat_slots(chunks: list, num_tokens: int) -> np.ndarray:
    if all(type(c) is int for c in chunks):
        return np.asarray(chunks, dtype=np.int64)
    result = np.empty(num_tokens, dtype=np.int64)
    t = 0
    for c in chunks:
        if type(c) is int:
            result[t] = c
            t += 1
        else:
            result[t : t + len(c)] = c
            t += len(c)
    return result
