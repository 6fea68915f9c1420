"""SchedulerOutput -> StepPlan: the arrays an executor needs for one step.

Hot path: runs once per step per executor. Per scheduled sequence a handful of list
operations; token ids, positions and slots go into flat Python lists turned into numpy arrays
once at the end. Decodes (one new token) compute their slot inline instead of calling into
the KV manager.

Pipelined steps: a decode whose input token is still being sampled by the previous plan (the
sequence has it pending, so its position is past the tokens received) goes out marked in
`feed_sampled` with -1 in `token_ids`; the executor feeds it its own sample. A sequence that
samples in this plan gets one more pending token, taken back when the plan's result is in.
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
        logit_bias_ids=tuple(t for t, _ in sp.logit_bias),
        logit_bias_values=tuple(v for _, v in sp.logit_bias),
        grammar=sp.grammar,
        prompt_logprobs=sp.prompt_logprobs,
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
               eos_token_ids: tuple[int, ...], deadline_s: float = 0.0) -> wire.StepPlan:
    """Turn one step's decisions into the StepPlan (and mark what the executor now knows:
    requests sent, samples pending in `out.sampled`)."""
    forks: list[wire.Fork] = []
    new_requests: list[wire.NewRequest] = []
    for parent, child in out.forks:
        if parent.on_executor:  # the executor copies the parent's sampling state
            forks.append(wire.Fork(parent.seq_id, child.seq_id, child.index))
            child.on_executor = True

    request_ids: list[str] = []
    num_computed: list[int] = []
    num_new: list[int] = []
    do_sample: list[bool] = []
    table_starts: list[int] = []
    table_lens: list[int] = []
    table_ids: list[int] = []
    token_ids: list[int] = []
    slot_chunks: list = []  # ints (decodes) and arrays (prefill chunks), in token order
    positions: list = []  # likewise: ints and ranges
    feed: list[int] = []  # indices of decodes fed the executor's own previous sample
    sampled = out.sampled
    all_decodes = True
    for item in out.scheduled:
        seq = item.seq
        k = item.num_new_tokens
        end = seq.num_computed_tokens  # already advanced by the scheduler
        start = end - k
        seq_id = seq.seq_id
        if not seq.on_executor:
            new_requests.append(_new_request(seq, eos_token_ids))
            seq.on_executor = True
        tokens = seq.token_ids
        if end == len(tokens) + seq.num_pending:  # (seq.num_tokens) samples
            do_sample.append(True)
            sampled.append(seq)
        else:
            do_sample.append(False)
        request_ids.append(seq_id)
        num_computed.append(start)
        num_new.append(k)
        if k == 1:
            change_start, change_ids, slot = kv.take_decode_entry(seq_id, start)
            if start < len(tokens):
                token_ids.append(tokens[start])
            else:  # its input is being sampled by the plan before this one
                feed.append(len(request_ids) - 1)
                token_ids.append(-1)
            slot_chunks.append(slot)
            positions.append(start)
        else:
            change_start, change_ids = kv.take_table_change(seq_id)
            token_ids.extend(tokens[start:end])
            slot_chunks.append(kv.slot_mapping(seq_id, start, k))
            positions.append(range(start, end))
            all_decodes = False
        table_starts.append(change_start)
        table_lens.append(len(change_ids))
        if change_ids:
            table_ids.extend(change_ids)

    for seq in sampled:
        seq.num_pending += 1
    slot_mapping = np.array(slot_chunks, dtype=np.int64) if all_decodes \
        else _concat_slots(slot_chunks, out.num_tokens)
    feed_sampled = None
    if feed:
        feed_sampled = np.zeros(len(request_ids), dtype=np.uint8)
        feed_sampled[feed] = 1
    ops = kv.take_block_ops()
    return wire.StepPlan(
        step_id=step_id,
        new_requests=new_requests,
        forks=forks,
        request_ids=request_ids,
        num_computed_tokens=np.array(num_computed, dtype=np.int32),
        num_new_tokens=np.array(num_new, dtype=np.int32),
        do_sample=np.array(do_sample, dtype=np.uint8),
        feed_sampled=feed_sampled,
        token_ids=np.array(token_ids, dtype=np.int32),
        positions=np.array(positions, dtype=np.int32) if all_decodes
        else _concat_positions(positions, out.num_tokens),
        slot_mapping=slot_mapping,
        block_table_starts=np.array(table_starts, dtype=np.int32),
        block_table_lens=np.array(table_lens, dtype=np.int32),
        block_table_ids=np.array(table_ids, dtype=np.int32),
        swap_out=ops.swap_out,
        swap_in=ops.swap_in,
        copy=ops.copy,
        finished_ids=list(out.dropped_seq_ids),
        deadline_s=deadline_s,
    )


def _concat_positions(chunks: list, num_tokens: int) -> np.ndarray:
    result = np.empty(num_tokens, dtype=np.int32)
    t = 0
    for c in chunks:
        if type(c) is int:
            result[t] = c
            t += 1
        else:
            result[t : t + len(c)] = np.arange(c.start, c.stop, dtype=np.int32)
            t += len(c)
    return result


def _concat_slots(chunks: list, num_tokens: int) -> np.ndarray:
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
