"""What a StepPlan alone determines (no request state), computed off the main thread.

`precompute` runs on the executor's I/O thread while the previous step's forward runs
(io_threads.py): the block-move checks, the new requests' sampling states, the rows' arrays
(the table changes as one scatter's indices, where the fed tokens go), every check that
needs no request state and, when no row fails those, the batch tensors but the input ids
and block tables. `ModelRunner` (model_runner.py) is then left with what needs the
requests' state: feeding the marked decodes and applying the table changes (the gap).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from pagedserve.executor.device_copy import to_device_many
from pagedserve.executor.draft_rows import DraftRows, per_position, sampling_positions
from pagedserve.executor.grammar import GrammarCompiler, GrammarError
from pagedserve.executor.sampling_state import SamplingState
from pagedserve.protos.wire import StepPlan


@dataclass(frozen=True)
class PlanLimits:
    """The fixed sizes a plan is checked against (one executor's)."""

    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    max_model_len: int
    vocab_size: int
    device: torch.device
    grammars: GrammarCompiler | None = None  # structured output (None: not available)
    # Decode steps of at most this many rows, tables at most this wide, run as fed graphs
    # (graph_feed.py): their batch tensors are not built (0: none are).
    graph_rows: int = 0
    graph_width: int = 0
    lora_names: frozenset[str] = frozenset()  # the LoRA adapters it serves
    kv_block_bytes: int = 0  # one block's bytes (blocks received from another executor)


@dataclass(slots=True)
class PlanInputs:
    """What `precompute` finds in a plan alone (no request state)."""

    move_error: str  # a block move out of range: the whole step fails ("" when none)
    moves: list[tuple[str, np.ndarray]]  # (swap_out | swap_in | copy, pairs), non-empty
    new_states: list[SamplingState]  # of plan.new_requests, same order
    # The rows (None when the plan schedules none):
    num_new: np.ndarray | None = None  # int64 [S]
    seq_lens: np.ndarray | None = None  # int64 [S]
    starts: np.ndarray | None = None  # int64 [S]: each table is replaced from there on ...
    new_len: np.ndarray | None = None  # int64 [S]: ... and has this length after
    longest: int = 0  # max(new_len)
    ids: np.ndarray | None = None  # int32: the new block ids, row after row
    id_seq: np.ndarray | None = None  # int64: the row of each id ...
    id_cols: np.ndarray | None = None  # int64: ... and its column in that row's table
    row_of_token: np.ndarray | None = None  # int64 [T]
    slots: np.ndarray | None = None  # int64 [T]
    token_ids: np.ndarray | None = None  # int64 [T], a copy: the fed tokens are written in
    marked: np.ndarray | None = None  # int64: the rows to feed (marked, one token each) ...
    feed_at: np.ndarray | None = None  # int64: ... and where their token goes in token_ids
    all_marked: bool = False  # marked is every row
    do_sample_rows: np.ndarray | None = None  # int64: the rows that sample (None: all)
    drafts: np.ndarray | None = None  # int64 [S]: drafts a row (None: no row has any)
    draft_rows: DraftRows | None = None  # per sampling position, when some row has drafts
    unfed: dict[int, str] | None = None  # marked rows that cannot be fed whatever the state
    bad: dict[int, str] | None = None  # rows the plan alone condemns
    # When no row is condemned by the plan: its tensors (one packed copy to the device);
    # the input ids and block tables are arrays the main thread fills in place (token_ids,
    # fed; tables, gathered) and moves in one more packed copy (batch_prep.full_batch).
    # A decode step every row of which samples (``feedable``) that fits the fed graphs gets
    # no tensors here: its arrays go to a graph's stage (batch_prep.full_batch builds the
    # tensors after all when it does not run as one).
    tables: np.ndarray | None = None  # int32 [S, longest], filled by RequestRows.gather
    plan_positions: np.ndarray | None = None  # [T], the plan's
    feedable: bool = False
    positions: torch.Tensor | None = None
    slot_mapping: torch.Tensor | None = None
    query_start_loc: torch.Tensor | None = None
    seq_lens_t: torch.Tensor | None = None
    max_query_len: int = 0
    sample_rows: torch.Tensor | None = None
    sample_ids: list[str] | None = None


def check_block_moves(plan: StepPlan, limits: PlanLimits) -> str:
    """"" (fine) or why the plan's block moves name a block out of range."""
    ranges = {
        "swap_out": (limits.num_gpu_blocks, limits.num_cpu_blocks),
        "swap_in": (limits.num_cpu_blocks, limits.num_gpu_blocks),
        "copy": (limits.num_gpu_blocks, limits.num_gpu_blocks),
    }
    for name, (src_limit, dst_limit) in ranges.items():
        pairs = getattr(plan, name)
        if pairs is None or pairs.shape[0] == 0:
            continue
        for col, limit in ((0, src_limit), (1, dst_limit)):
            if pairs[:, col].min() < 0 or pairs[:, col].max() >= limit:
                return f"{name} names a block out of range (have {limit})"
    for name, limit in (("kv_import", limits.num_cpu_blocks),
                        ("kv_export", limits.num_gpu_blocks)):
        ids = getattr(plan, name)
        if ids is not None and ids.shape[0] and (ids.min() < 0 or ids.max() >= limit):
            return f"{name} names a block out of range (have {limit})"
    imports = plan.kv_import
    if imports is not None and imports.shape[0]:
        if len(set(imports.tolist())) != imports.shape[0]:
            return "kv_import names a block twice"
        want = imports.shape[0] * limits.kv_block_bytes
        if plan.kv_import_data.shape[0] != want:
            return (f"kv_import_data has {plan.kv_import_data.shape[0]} bytes, "
                    f"{imports.shape[0]} blocks take {want}")
    return ""


_NONE = np.zeros(0, np.int64)  # no rows


def precompute(plan: StepPlan, limits: PlanLimits) -> PlanInputs:
    """The part of a step that depends on the plan alone: the block-move checks, the new
    requests' sampling states, the rows' arrays (the table changes as one scatter's
    indices, where the fed tokens go), every check that needs no request state, and
    (when no row fails those) the batch tensors but the input ids and block tables.
    Thread-safe (reads only the plan and `limits`): the executor's I/O thread calls
    it on plan N+1 while step N's forward runs, so the main thread is left with the fed
    tokens and the table changes (the executor's gap)."""
    new_states, state_errors = _new_states(plan, limits)
    inputs = PlanInputs(
        move_error=check_block_moves(plan, limits),
        moves=[(name, pairs) for name in ("swap_out", "swap_in", "copy")
               if (pairs := getattr(plan, name)) is not None and pairs.shape[0]],
        new_states=new_states)
    num_seqs = plan.num_seqs
    if num_seqs == 0:
        return inputs
    bs, num_blocks = limits.block_size, limits.num_gpu_blocks
    num_new = plan.num_new_tokens.astype(np.int64)
    seq_lens = plan.num_computed_tokens.astype(np.int64) + num_new
    starts = plan.block_table_starts.astype(np.int64)
    lens = plan.block_table_lens.astype(np.int64)
    ids = plan.block_table_ids if plan.block_table_ids is not None else np.zeros(0, np.int32)
    # A step of one token a row (every decode step) skips the per-token bookkeeping below
    # (the executor's I/O thread holds the GIL while it runs this, every step).
    max_query_len = int(num_new.max())
    one_each = max_query_len == 1 and plan.num_tokens == num_seqs
    if one_each:  # the row of token i is i, and so is its first token
        row_of_token = first_token = np.arange(num_seqs)
    else:
        row_of_token = np.repeat(np.arange(num_seqs), num_new)
        first_token = np.cumsum(num_new) - num_new
    slots = plan.slot_mapping.astype(np.int64)
    token_ids = plan.token_ids.astype(np.int64)  # a copy: fed tokens are written in
    marked_rows = np.zeros(num_seqs, dtype=bool)
    if plan.feed_sampled is not None:
        marked_rows = plan.feed_sampled.astype(bool)
    marked = np.flatnonzero(marked_rows)
    prev = plan.step_id - 1
    unfed: dict[int, str] = {}
    if not one_each:
        one = num_new[marked] == 1
        unfed = {i: (f"marked to be fed its sample of step {prev} but scheduled with "
                     f"{num_new[i]} tokens (a marked row is a decode of one token)")
                 for i in marked[~one].tolist()}
        if unfed:
            marked = marked[one]

    # Vectorised checks; a bad token, block id or length condemns its request. The
    # tokens of marked rows are checked when fed (a -1 left unfed is an error there).
    id_seq = np.repeat(np.arange(num_seqs), lens)  # the row each block id belongs to
    bad_token = (
        (slots < -1) | (slots >= num_blocks * bs)
        | (plan.positions < 0) | (plan.positions >= limits.max_model_len)
        | (((token_ids < 0) | (token_ids >= limits.vocab_size))
           & ~(marked_rows if one_each else marked_rows[row_of_token]))
    )
    new_len = starts + lens
    bad: dict[int, str] = {}
    for rows, message in (
        (row_of_token[bad_token], "a slot, position or token id out of range"),
        (id_seq[(ids < 0) | (ids >= num_blocks)], f"block id out of range (have {num_blocks})"),
        (np.flatnonzero(seq_lens > np.minimum(limits.max_model_len, new_len * bs)),
         "its tokens do not fit its blocks or max_model_len"),
        (_NONE if one_each else np.flatnonzero(num_new == 0), "scheduled with no new tokens"),
    ):
        if rows.shape[0]:
            for i in rows.tolist():
                bad.setdefault(i, message)
    if state_errors:  # a new request is scheduled in the plan that sends it
        row = {rid: i for i, rid in enumerate(plan.request_ids)}
        for rid, message in state_errors.items():
            if rid in row:
                bad.setdefault(row[rid], message)
    do_sample = plan.do_sample.astype(bool)
    drafts = plan.num_draft_tokens
    if drafts is not None and drafts.any():
        inputs.drafts = drafts.astype(np.int64)
    inputs.num_new, inputs.seq_lens, inputs.starts, inputs.new_len = (
        num_new, seq_lens, starts, new_len)
    inputs.longest = int(new_len.max())
    # Block id j of the changes goes to column starts[row] + (j - the row's first id).
    inputs.ids, inputs.id_seq = ids, id_seq
    inputs.id_cols = np.arange(ids.shape[0]) + np.repeat(starts - (np.cumsum(lens) - lens),
                                                         lens)
    inputs.row_of_token, inputs.slots, inputs.token_ids = row_of_token, slots, token_ids
    inputs.marked, inputs.feed_at = marked, first_token[marked]
    inputs.all_marked = marked.shape[0] == num_seqs
    every_row_samples = bool(do_sample.all())
    inputs.do_sample_rows = None if every_row_samples else np.flatnonzero(do_sample)
    inputs.unfed, inputs.bad = unfed, bad
    if not bad and not unfed:  # the usual case: the tensors of every row, built here
        inputs.max_query_len = max_query_len
        inputs.tables = np.empty((num_seqs, inputs.longest), dtype=np.int32)
        inputs.sample_ids = (list(plan.request_ids) if every_row_samples else
                             [r for r, d in zip(plan.request_ids, do_sample.tolist(),
                                                strict=True) if d])
        if inputs.drafts is not None:  # a row's id for each of its sampling positions
            inputs.sample_ids = per_position(inputs.sample_ids,
                                             (inputs.drafts[do_sample] + 1).tolist())
        inputs.plan_positions = plan.positions
        inputs.feedable = inputs.max_query_len == 1 and inputs.do_sample_rows is None
        if not (inputs.feedable and num_seqs <= limits.graph_rows
                and inputs.longest <= limits.graph_width):
            build_tensors(inputs, limits.device)
    return inputs


def build_tensors(inputs: PlanInputs, device: torch.device) -> None:
    """The batch tensors of a plan none of whose rows is condemned (but the input ids and
    block tables), in one packed copy to ``device``."""
    num_new = inputs.num_new
    query_start_loc = np.concatenate([[0], np.cumsum(num_new)])
    sample_ends = query_start_loc[1:]
    if inputs.do_sample_rows is not None:
        sample_ends = sample_ends[inputs.do_sample_rows]
    sample_index = sample_ends - 1
    if inputs.drafts is not None:
        drafts = inputs.drafts if inputs.do_sample_rows is None \
            else inputs.drafts[inputs.do_sample_rows]
        sample_index, _, inputs.draft_rows = sampling_positions(sample_ends, drafts,
                                                                inputs.token_ids)
    (inputs.positions, inputs.slot_mapping, inputs.query_start_loc, inputs.seq_lens_t,
     inputs.sample_rows) = to_device_many(
        ((inputs.plan_positions, torch.int64), (inputs.slots, torch.int64),
         (query_start_loc, torch.int32), (inputs.seq_lens, torch.int32),
         (sample_index, torch.int64)), device)


def _new_states(plan: StepPlan, limits: PlanLimits) -> tuple[list[SamplingState], dict[str, str]]:
    """The new requests' sampling states (grammar matchers built here, off the step) and the
    requests whose state could not be built (a grammar this executor cannot use): those get
    a plain state and are condemned in this plan."""
    states: list[SamplingState] = []
    errors: dict[str, str] = {}
    for req in plan.new_requests:
        if req.lora and req.lora not in limits.lora_names:
            errors[req.request_id] = f"unknown LoRA adapter {req.lora!r}"
        try:
            states.append(SamplingState.from_new_request(req, limits.grammars))
        except GrammarError as exc:
            errors[req.request_id] = str(exc)
            states.append(SamplingState(req.sampling, req.sample_index, req.output_token_ids,
                                        req.prompt_token_ids))
    return states, errors
