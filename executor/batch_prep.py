"""Preparing a step's batch from its plan: feeding the marked decodes, applying the block
table changes, building the tensors the forward reads (`Batch`).

Functions of the ModelRunner (bound as its methods in model_runner.py; `self` is the
runner). HOT PATH: `prepare` and `full_batch` run between two steps (the executor's gap):
a fixed number of numpy calls over the step's rows, no per-request Python loops.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING

import numpy as np
import torch
from pagedserve.executor.device_copy import to_device, to_device_many
from pagedserve.executor.draft_rows import DraftRows, per_position, sampling_positions
from pagedserve.executor.graph_feed import GraphFeed
from pagedserve.executor.models import AttentionMetadata
from pagedserve.executor.plan_inputs import PlanInputs, build_tensors
from pagedserve.kernels import ops
from pagedserve.protos.wire import RequestError, StepPlan

if TYPE_CHECKING:
    from pagedserve.executor.model_runner import ModelRunner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Batch:
    """The valid part of a plan, as device tensors; or, for a decode step that runs as a
    fed graph (``feed``), as host arrays, with only the input ids on the device when they
    are there (else None), no positions, attention metadata or sample rows (every row
    samples)."""

    input_ids: torch.Tensor | None
    positions: torch.Tensor | None
    attn: AttentionMetadata | None
    sample_rows: torch.Tensor | None  # index into the hidden states of the tokens that sample
    sample_ids: list[str]  # their requests, same order
    sample_state_rows: np.ndarray  # their rows in RequestRows, same order
    kept: np.ndarray | None = None  # the plan rows in the batch (None: every row)
    feed: GraphFeed | None = None
    # each token's LoRA adapter slot (None: no token has one): a graph holding the
    # adapters copies them in; an eager forward makes its LoraStep of them (model_runner)
    lora_slots: np.ndarray | None = None
    # speculative decoding: per sampling position (None: no row has drafts)
    drafts: DraftRows | None = None


def prepare(self: ModelRunner, plan: StepPlan, errors: list[RequestError],
            pre: PlanInputs) -> Batch | None:
    """Feed the marked decodes, apply the table changes of the valid requests and build
    the batch tensors (the plan-only part from `precompute`).

    The usual step (every request known, the marked rows rows that sampled in the
    previous step, every table change starting at the end of its table, nothing condemned
    by the plan) is a fixed handful of numpy calls, whatever the number of rows: one
    C-level pass maps the request ids to their rows of `self.rows`; the previous step's
    tokens (still pending, `PendingSamples`; on the device while that step is in flight)
    are scattered into the input ids, as they are when the marked rows are exactly the
    rows that sampled, in order, else picked by one sorted lookup (a request that ended
    or sits out this step); the table changes are one scatter (indices from
    `precompute`); the batch's tables are one gather. Array equality is tested on bytes
    (on the cold cache a long forward leaves, the cheapest test). Any other step takes
    `_prepare_checked`, which finds and reports the rows to leave out.
    """
    num_seqs = plan.num_seqs
    if num_seqs == 0:
        return None
    if pre.unfed or pre.bad:
        return self._prepare_checked(plan, errors, pre)
    try:
        rows = np.fromiter(map(self._row_of.__getitem__, plan.request_ids), np.int64,
                           num_seqs)
    except KeyError:  # an unknown request
        return self._prepare_checked(plan, errors, pre)
    table, pending, marked = self.rows, self._pending, pre.marked
    old_len = table.num_blocks[rows]
    pick = None  # positions of the marked rows among the pending ones (None: all, in order)
    if marked.shape[0]:
        if not (pending.states and pending.step_id == plan.step_id - 1) or pending.drafted:
            return self._prepare_checked(plan, errors, pre, rows, old_len)
        marked_rows = rows if pre.all_marked else rows[marked]
        if marked_rows.tobytes() != pending.rows.tobytes():
            pick = _positions(pending.rows, marked_rows)
            if pick is None:  # a marked row that did not sample
                return self._prepare_checked(plan, errors, pre, rows, old_len)
    if pre.starts.tobytes() != old_len.tobytes():  # a change before a table's end
        return self._prepare_checked(plan, errors, pre, rows, old_len)
    on_device = False
    if marked.shape[0]:
        if pending.token_ids is not None:
            pre.token_ids[pre.feed_at] = (pending.token_ids if pick is None
                                          else pending.token_ids[pick])
        else:  # the previous step is in flight: fed from its tokens on the device
            on_device = True
    table.ensure_width(pre.longest)
    table.set_tails(rows, pre.new_len, rows[pre.id_seq], pre.id_cols, pre.ids)
    if on_device and pick is None and pre.all_marked \
            and pending.device_tokens.shape[0] == pre.token_ids.shape[0] \
            and pending.device_tokens.dtype == torch.int64:
        # Every token of the step is a marked decode fed in the order the previous step
        # sampled them (a steady decode batch): its input ids ARE that step's tokens on
        # the device, with no index list to copy there and no scatter.
        return self._full_batch(pre, rows, input_ids=pending.device_tokens)
    batch = self._full_batch(pre, rows, ids_patched=on_device)
    if on_device:
        tokens = pending.device_tokens
        if pick is not None:
            tokens = tokens[to_device(pick, tokens.device)]
        batch.input_ids.index_copy_(0, to_device(pre.feed_at, tokens.device),
                                    tokens.to(batch.input_ids.dtype))
    return batch


def _positions(among: np.ndarray, wanted: np.ndarray) -> np.ndarray | None:
    """Index into ``among`` (distinct values) of each value of ``wanted``; None when one
    is missing."""
    order = np.argsort(among, kind="stable")
    ranked = among[order]
    at = np.minimum(np.searchsorted(ranked, wanted), ranked.shape[0] - 1)
    if not (ranked[at] == wanted).all():
        return None
    return order[at]


def full_batch(self: ModelRunner, pre: PlanInputs, rows: np.ndarray,
               input_ids: torch.Tensor | None = None, ids_patched: bool = False) -> Batch:
    """Every row kept: the tensors precompute built, the fed input ids (``input_ids``:
    already on the device; ``ids_patched``: the caller writes some into the batch's on the
    device), the tables. A decode step that fits the graphs runs fed: host arrays, and
    the ids on the device only when they are there."""
    self.rows.gather(rows, pre.longest, out=pre.tables)
    graphs = self.graphs
    lora_slots = lora_slots_of(self, rows, pre.num_new)
    if pre.feedable and graphs is not None and graphs.can_feed(rows.shape[0], pre.longest) \
            and (lora_slots is None or graphs.loras is not None):
        if ids_patched:
            input_ids = to_device(pre.token_ids, self.device, torch.int64)
        return Batch(
            input_ids=input_ids, positions=None, attn=None, sample_rows=None,
            sample_ids=pre.sample_ids, sample_state_rows=rows,
            feed=GraphFeed(pre.plan_positions, pre.slots, pre.seq_lens, pre.tables,
                           None if input_ids is not None else pre.token_ids),
            lora_slots=lora_slots)
    if pre.positions is None:  # precompute left them to a graph's stage
        build_tensors(pre, self.device)
    state_rows = rows if pre.do_sample_rows is None else rows[pre.do_sample_rows]
    if pre.drafts is not None:  # a row's own for each of its sampling positions
        drafts = pre.drafts if pre.do_sample_rows is None else pre.drafts[pre.do_sample_rows]
        state_rows = np.repeat(state_rows, drafts + 1)
    if input_ids is None:
        input_ids, block_tables = to_device_many(
            ((pre.token_ids, torch.int64), (pre.tables, torch.int32)), self.device)
    else:
        (block_tables,) = to_device_many(((pre.tables, torch.int32),), self.device)
    return Batch(
        input_ids=input_ids,
        positions=pre.positions,
        attn=AttentionMetadata(
            slot_mapping=pre.slot_mapping,
            block_tables=block_tables,
            query_start_loc=pre.query_start_loc, seq_lens=pre.seq_lens_t,
            max_query_len=pre.max_query_len,
            decode_split=ops.decode_split_of(pre.num_new, pre.query_start_loc)),
        sample_rows=pre.sample_rows, sample_ids=pre.sample_ids,
        sample_state_rows=state_rows, lora_slots=lora_slots, drafts=pre.draft_rows)


def lora_slots_of(self: ModelRunner, rows: np.ndarray,
                  num_new: np.ndarray) -> np.ndarray | None:
    """The LoRA adapter slot of each token of ``rows`` (models/lora.py; ``num_new`` tokens
    a row), or None when no row has an adapter."""
    if self.loras is None:
        return None
    slots = self.rows.lora[rows]
    return np.repeat(slots, num_new) if slots.any() else None


def prepare_checked(self: ModelRunner, plan: StepPlan, errors: list[RequestError],
                    pre: PlanInputs, rows: np.ndarray | None = None,
                    old_len: np.ndarray | None = None) -> Batch | None:
    """`_prepare` row by row where it matters: the rows that can be fed are fed; each
    row that cannot, is condemned by the plan, is unknown (row -1) or whose table change
    starts beyond its table gets an error and its state is dropped; the others' changes
    are applied (tables cut shorter zeroed past their end) and they form the batch.
    (`rows` and `old_len` as `_prepare` found them, when it did.)"""
    self._pending.apply()  # the records read below
    table, marked = self.rows, pre.marked
    if rows is None:
        rows = np.fromiter(map(self._row_of.get, plan.request_ids,
                               repeat(-1, plan.num_seqs)), np.int64, plan.num_seqs)
        old_len = table.num_blocks[rows]  # -1: the last row's, masked below
    known = rows >= 0
    fed = known[marked] & (table.sampled_step[rows[marked]] == plan.step_id - 1)
    pre.token_ids[pre.feed_at[fed]] = table.sampled_token[rows[marked[fed]]]
    late = ~known | (pre.starts > old_len)
    bad = self._condemned(plan, pre, rows, old_len, marked[~fed], late)
    keep = np.ones(plan.num_seqs, dtype=bool)
    keep[list(bad)] = False
    kept = np.flatnonzero(keep)
    kept_rows, new_len = rows[kept], pre.new_len[kept]
    table.cut(kept_rows, old_len[kept], new_len)
    table.ensure_width(pre.longest)
    by_id = keep[pre.id_seq]
    table.set_tails(kept_rows, new_len, rows[pre.id_seq[by_id]], pre.id_cols[by_id],
                    pre.ids[by_id])
    reported = {e.request_id for e in errors}  # one error a request (a failed fork's child)
    for i, message in sorted(bad.items()):
        rid = plan.request_ids[i]
        log.error("step %d: request %s: %s", plan.step_id, rid, message)
        if rid not in reported:
            errors.append(RequestError(rid, message))
        self._drop(rid)
    if not bad:
        return self._full_batch(pre, rows)
    if not kept.shape[0]:
        return None
    return self._batch_of(plan, pre, keep, kept_rows, table.gather(kept_rows))


def condemned(self: ModelRunner, plan: StepPlan, pre: PlanInputs, rows: np.ndarray,
              old_len: np.ndarray, unfed: np.ndarray, late: np.ndarray) -> dict[int, str]:
    """{row: error} of the rows left out, one message each (the first that applies:
    cannot be fed, condemned by the plan alone, unknown, table change too late)."""
    prev = plan.step_id - 1
    bad = dict(pre.unfed)
    for i in unfed.tolist():
        bad[i] = (f"marked to be fed its sample of step {prev}, but the request is "
                  "unknown here (never sent, or dropped after an error)"
                  if rows[i] < 0 else
                  f"marked to be fed its sample of step {prev}, but it sampled "
                  f"nothing in step {prev} (that step failed or did not sample it)")
    for i, message in pre.bad.items():
        bad.setdefault(i, message)
    for i in np.flatnonzero(late).tolist():
        bad.setdefault(i, "unknown request (never sent as a new request)" if rows[i] < 0
                       else f"block table change at {pre.starts[i]} beyond its {old_len[i]}")
    return bad


def batch_of(self: ModelRunner, plan: StepPlan, pre: PlanInputs, keep: np.ndarray,
             kept_rows: np.ndarray, block_tables: np.ndarray) -> Batch:
    """The batch of the rows in `keep` (when some rows are left out, or precompute built
    no tensors)."""
    keep_token = keep[pre.row_of_token]
    num_new, seq_lens = pre.num_new[keep], pre.seq_lens[keep]
    query_start_loc = np.concatenate([[0], np.cumsum(num_new)])
    do_sample = plan.do_sample[keep].astype(bool)
    lora_slots = lora_slots_of(self, kept_rows, num_new)
    kept_ids = [r for r, k in zip(plan.request_ids, keep.tolist(), strict=True) if k]
    device = self.device
    starts = to_device(query_start_loc, device, torch.int32)
    sample_ids = [r for r, s in zip(kept_ids, do_sample.tolist(), strict=True) if s]
    state_rows = kept_rows[do_sample]
    token_ids = pre.token_ids[keep_token]
    sample_index, drafted = query_start_loc[1:][do_sample] - 1, None
    if pre.drafts is not None:  # a row's own for each of its sampling positions
        counts = pre.drafts[keep][do_sample]
        sample_index, counts, drafted = sampling_positions(sample_index + 1, counts, token_ids)
        sample_ids = per_position(sample_ids, counts.tolist())
        state_rows = np.repeat(state_rows, counts)
    return Batch(
        input_ids=to_device(token_ids, device, torch.int64),
        positions=to_device(plan.positions[keep_token], device, torch.int64),
        attn=AttentionMetadata(
            slot_mapping=to_device(pre.slots[keep_token], device, torch.int64),
            block_tables=to_device(block_tables, device, torch.int32),
            query_start_loc=starts,
            seq_lens=to_device(seq_lens, device, torch.int32),
            max_query_len=int(num_new.max()),
            decode_split=ops.decode_split_of(num_new, starts),
        ),
        sample_rows=to_device(sample_index, device, torch.int64),
        sample_ids=sample_ids,
        sample_state_rows=state_rows,
        kept=np.flatnonzero(keep),
        lora_slots=lora_slots,
        drafts=drafted,
    )
