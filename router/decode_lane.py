"""The decode lane: one scheduler's steady decodes planned as numpy columns.

Most rows of a serving step are steady decodes: a request with its prompt computed decodes
one token whose slot lies in a block it holds alone. Planned one by one (the scheduler's
loop: the sample's counters, `allocate_decode`, the plan row) each cost ~1.2 us of Python at
256 streams, most of the engine's CPU a step. The lane keeps what a member's next decode
needs in columns -- its computed count, its slot count in the KV manager, the slot base of
the block it writes into and where that block ends, its table's length, where its next block
registers in the prefix cache, where it ends -- so one step plans every steady member with a
few array operations and writes the counters back to the objects in tight loops. Two cases
that come every block's worth of tokens stay in the lane: a slot that opens a block past the
table's end (`commit`: a block from the free queue, sent as the row's table change) and
a decode that completes a block (`note_steady_fills`: it registers at end_step). The objects
stay authoritative: every step reads the members' pending and received counts from them and
leaves them as the ordinary loop would have.

A member whose next decode is anything else (a table change or intent waiting, a shared
block to copy, an end known ahead, a chunk) takes the ordinary loop for that step and is
read again from the objects at the start of the next one (after `end_step`): `mark_stale`.
A sample joins after the ordinary loop committed a decode for it (read in the next step); it
leaves when the scheduler removes, finishes or preempts it (`evict`). Rows are unordered (an
eviction moves the last row into the hole): the scheduler uses the lane only in steps where
the order rows are planned in cannot matter (`plan_with_lane`, below).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from ..kvmanager import KVCacheManager
from .sequence import RequestGroup, Sequence

if TYPE_CHECKING:
    from .scheduler import Scheduler, SchedulerOutput

# Steps the loop plans alone after a step the decode lane could not plan (`plan_with_lane`).
LANE_BACKOFF_STEPS = 4

# column indices of `_cols`
COMPUTED, POS, SLOT_BASE, BLOCK_END, TABLE_LEN, REGISTER_AT, END_AT = range(7)


class LaneStep(NamedTuple):
    """`DecodeLane.classify`'s answer for one step."""

    steady: np.ndarray  # bool, a member's row: planned in the lane
    pending: np.ndarray  # int64, each member's tokens in flight
    received: np.ndarray  # int64, each member's tokens received
    fills: np.ndarray | None  # lane rows whose decode lets a block register
    crossers: list[int]  # decodes that need a new block (`commit`), not yet steady
    others: list[int]  # rows the scheduler's loop plans this step


class LaneRows(NamedTuple):
    """A step's steady decodes from the lane, as plan columns (one token each, every row
    sampling; a table change of at most one new block, at the table's end)."""

    seqs: list[Sequence]
    ids: list[str]
    starts: np.ndarray  # int32: tokens computed before (the token's position)
    inputs: np.ndarray  # int32 token ids, -1 where the executor feeds its own sample
    slots: np.ndarray  # int64
    table_starts: np.ndarray  # int32: the table's length before this step's block
    table_changed: np.ndarray  # int32: 1 where the row's table gained a block
    table_ids: np.ndarray  # int32: the new blocks, in row order


class DecodeLane:
    """Members' columns (`_cols[c, :n]`) beside their samples, ids and KV states."""

    def __init__(self, kv: KVCacheManager, max_model_len: int, capacity: int = 64) -> None:
        self.kv = kv
        self.max_model_len = max_model_len
        self.n = 0
        self.seqs: list[Sequence] = []
        self.ids: list[str] = []
        self.states: list = []  # the KV manager's RequestState of each member
        self.rows: dict[Sequence, int] = {}
        self.stale: list[Sequence] = []  # to read again at the next step
        self._cols = np.zeros((7, capacity), dtype=np.int64)

    def __len__(self) -> int:
        return self.n

    def __contains__(self, seq: Sequence) -> bool:
        return seq in self.rows

    # ------------------------------------------------------------------ membership

    def join(self, seq: Sequence) -> None:
        """Take in a sample (its columns read at the next step); a member is marked stale."""
        if seq in self.rows:
            self.stale.append(seq)
            return
        n = self.n
        if n == self._cols.shape[1]:
            self._cols = np.concatenate([self._cols, np.zeros_like(self._cols)], axis=1)
        self.rows[seq] = n
        self.seqs.append(seq)
        self.ids.append(seq.seq_id)
        self.states.append(None)
        self.n = n + 1
        self.stale.append(seq)

    def mark_stale(self, seq: Sequence) -> None:
        if seq in self.rows:
            self.stale.append(seq)

    def evict(self, seq: Sequence) -> None:
        """The sample leaves (removed, finished, preempted): the last row takes its place."""
        i = self.rows.pop(seq, None)
        if i is None:
            return
        last = self.n - 1
        if i != last:
            moved = self.seqs[last]
            self.seqs[i] = moved
            self.ids[i] = self.ids[last]
            self.states[i] = self.states[last]
            self._cols[:, i] = self._cols[:, last]
            self.rows[moved] = i
        self.seqs.pop()
        self.ids.pop()
        self.states.pop()
        self.n = last

    def clear(self) -> None:
        self.n = 0
        self.seqs.clear()
        self.ids.clear()
        self.states.clear()
        self.rows.clear()
        self.stale.clear()

    def _refresh(self) -> None:
        """Read the stale members' columns from their samples and the KV manager."""
        state_of = self.kv.steady_decode_state
        max_len = self.max_model_len
        rows = self.rows
        states = self.states
        idx: list[int] = []
        values: list[tuple] = []
        for seq in self.stale:
            i = rows.get(seq)
            if i is None:  # evicted since
                continue
            state = state_of(seq.seq_id, seq.token_ids)
            states[i] = state[0]
            end_at = seq.num_prompt_tokens + seq.group.spec.sampling.max_tokens
            idx.append(i)
            values.append((seq.num_computed_tokens, state[1], state[2],
                           state[3] if seq.on_executor else 0, state[4], state[5],
                           end_at if end_at < max_len else max_len))
        self.stale.clear()
        if idx:
            self._cols[:, idx] = np.array(values, dtype=np.int64).T

    # ------------------------------------------------------------------ one step

    def classify(self, last_plan: int | None = None) -> LaneStep:
        """This step's members: which are steady, which go to the ordinary loop. A member
        in neither has nothing to compute this step (an end known ahead, nothing
        uncomputed, or, with `last_plan` (pipeline depth 3 on: the number of the last plan
        sent), a token in flight from an older plan), as the ordinary loop would find."""
        if self.stale:
            self._refresh()
        n = self.n
        seqs = self.seqs
        cols = self._cols[:, :n]
        pending = np.fromiter([s.num_pending for s in seqs], np.int64, n)
        received = np.fromiter([len(s.token_ids) for s in seqs], np.int64, n)
        computed, pos = cols[COMPUTED], cols[POS]
        num_tokens = received + pending
        remaining = num_tokens - computed
        # (the ordinary loop's skips: nothing to compute, the tokens in flight already end
        # it; a finished sample is never a member: `finish_seq` evicts it)
        active = (remaining > 0) & ((pending == 0) | (num_tokens < cols[END_AT]))
        if last_plan is not None:
            sampled_in = np.fromiter([s.sampled_plan for s in seqs], np.int64, n)
            active &= (pending == 0) | (sampled_in == last_plan)
        decode = active & (remaining == 1) & (pos == computed)
        steady = decode & (pos < cols[BLOCK_END])
        # Its slot opens a block past the end of its table: one block from the free queue
        # (`commit`, in the loop's order), or the loop's if the scheduler says so.
        cross = decode & (pos == cols[BLOCK_END]) & (pos == cols[TABLE_LEN] * self.kv.block_size)
        # A block whose tokens are now all scheduled and known registers once this plan is
        # sent, as `allocate_decode` would arrange.
        fills = (steady | cross) & (np.minimum(pos + 1, received) >= cols[REGISTER_AT])
        others = np.flatnonzero(active & ~steady & ~cross).tolist()
        return LaneStep(steady, pending, received,
                        np.flatnonzero(fills) if fills.any() else None,
                        np.flatnonzero(cross).tolist() if cross.any() else [], others)

    def commit(self, step: LaneStep, crossers: list[int]) -> LaneRows:
        """Give each steady member its next decode, every row sampling: their computed,
        pending and KV slot counts go up by one. `crossers` (rows of `step.crossers`, in
        the order the loop would have served them) first get a new last block each, from
        the free queue in that order, sent as their row's table change."""
        steady, pending = step.steady, step.pending
        if crossers:
            new_blocks = self.kv.extend_steady_tables([self.states[i] for i in crossers])
            bs = self.kv.block_size
            cols = self._cols
            b = cols[TABLE_LEN, crossers]  # the new block's index in each table
            cols[SLOT_BASE, crossers] = (np.array(new_blocks, dtype=np.int64) - b) * bs
            cols[BLOCK_END, crossers] = (b + 1) * bs
            cols[TABLE_LEN, crossers] = b + 1
            steady[crossers] = True
        num_steady = int(np.count_nonzero(steady))
        n = self.n
        cols = self._cols[:, :n]
        if num_steady == n:
            rows = None
            seqs, ids, states = self.seqs, list(self.ids), self.states
            starts = cols[COMPUTED].copy()
            slots = cols[SLOT_BASE] + starts
            table_lens = cols[TABLE_LEN].astype(np.int32)
            pend = pending
            cols[COMPUTED] += 1
            cols[POS] += 1
        else:
            idx = np.flatnonzero(steady)
            rows = idx.tolist()
            seqs = [self.seqs[i] for i in rows]
            ids = [self.ids[i] for i in rows]
            states = [self.states[i] for i in rows]
            starts = cols[COMPUTED, idx]
            slots = cols[SLOT_BASE, idx] + starts
            table_lens = cols[TABLE_LEN, idx].astype(np.int32)
            pend = pending[idx]
            cols[COMPUTED, idx] = starts + 1
            cols[POS, idx] = starts + 1
        inputs = np.full(num_steady, -1, dtype=np.int32)
        known = np.flatnonzero(pend == 0)
        if known.size:  # nothing in flight: its input is its last token, known here
            for j in known.tolist():
                seq = seqs[j]
                inputs[j] = seq.token_ids[-1]
        counts = (starts + 1).tolist()
        for seq, c in zip(seqs, counts, strict=True):
            seq.num_computed_tokens = c
            seq.num_pending += 1
        self.kv.advance_steady_decodes(states, counts)
        if step.fills is not None:
            fills = step.fills
            self.kv.note_steady_fills([self.ids[i] for i in fills],
                                      [self.states[i] for i in fills])
            # Registration (at end_step) goes through every full block known then, so the
            # next registers once the block after the last known token is full.
            bs = self.kv.block_size
            known = np.minimum(self._cols[POS, fills], step.received[fills])
            self._cols[REGISTER_AT, fills] = (known // bs + 1) * bs
        changed = np.zeros(num_steady, dtype=np.int32)
        new_ids = np.zeros(0, dtype=np.int32)
        if crossers:  # their tables change by their new block
            at = np.array(crossers) if rows is None else np.searchsorted(idx, crossers)
            changed[at] = 1
            new_ids = np.array(new_blocks, dtype=np.int32)[np.argsort(at)]  # in row order
            table_lens -= changed
        return LaneRows(list(seqs), ids, starts.astype(np.int32), inputs, slots, table_lens,
                        changed, new_ids)

    def verify(self) -> None:
        """Every fresh member's columns agree with its sample and the KV manager (tests,
        `debug_checks`); raises AssertionError naming the sample."""
        stale = set(self.stale)
        for seq, i in self.rows.items():
            assert self.seqs[i] is seq and self.ids[i] == seq.seq_id, seq
            assert not seq.finished, seq
            if seq in stale:
                continue
            col = self._cols[:, i]
            assert col[COMPUTED] == seq.num_computed_tokens, (seq, col[COMPUTED])
            state = self.kv.steady_decode_state(seq.seq_id, seq.token_ids)
            assert self.states[i] is state[0], seq
            if col[POS] < col[BLOCK_END]:  # steady when read: still the KV manager's view
                assert (col[POS], col[SLOT_BASE], col[BLOCK_END], col[TABLE_LEN],
                        col[REGISTER_AT]) == state[1:], (seq, col, state)
        assert self.n == len(self.seqs) == len(self.rows) == len(self.ids) == len(self.states)


# ------------------------------------------------------------------ the scheduler's side
# Functions of the Scheduler (bound there as `_plan_with_lane` and `_lane_fallback`).


def _sort_key(group: RequestGroup) -> tuple:
    return group.sort_key


def plan_with_lane(self: Scheduler, out: SchedulerOutput,
                   budget: int) -> tuple[int, int, int] | None:
    """Plan the lane's steady decodes as columns and serve the other running samples
    (lane members that are not steady this step, groups off the lane) with the loop,
    in (priority, arrival) order; None when this step must run the loop over every
    running group instead (nothing planned then).

    The lane plans its rows out of order, so it is used only when order cannot change
    a decision: the token budget covers every running sample's demand (nobody is cut
    short) and the free blocks cover the most the loop's samples could take (each
    sample's tokens in blocks, plus one for a copy-on-write), so no allocation can
    fail and nothing is preempted. Then each sample gets exactly what the loop would
    have given it, and the blocks are taken in the loop's order. Otherwise (a long
    prompt's chunks take the budget, blocks run short) the loop runs alone for this
    step and `LANE_BACKOFF_STEPS` more, and the members are read again afterwards."""
    lane = self.lane
    if self._lane_backoff:
        self._lane_backoff -= 1
        return None
    kv = self.kv
    running = self.running
    step = lane.classify(self._plans_sent if self._hold_older_pending else None)
    if kv.debug_checks:
        lane.verify()
    seqs = lane.seqs
    others = [seqs[i] for i in step.others]
    crossers = step.crossers
    num_members = len(lane)  # (the loop below may add members)
    serve = [seq.group for seq in others]
    if len(running) != len(lane):  # groups off the lane (new, chunked prefills, n > 1)
        rows = lane.rows
        off = [g for g in running if len(g.seqs) != 1 or g.seqs[0] not in rows]
        serve = sorted(serve + off, key=_sort_key) if serve else off
    elif len(serve) > 1:  # (lane rows are unordered)
        serve.sort(key=_sort_key)
    # What the loop's groups would compute; those with nothing (a finished sample whose
    # group the text stage has not removed yet, an end known ahead) are only counted.
    demand = blocks = num_idle = 0
    bs = kv.block_size
    serving = []
    for group in serve:
        if not group.forked:  # a fork in the loop: keep the loop's exact order
            return self._lane_fallback()
        active = group.active_seqs()
        group_demand = 0
        for seq in active:
            d = self._demand(group, seq)
            if d:
                group_demand += d
                blocks += -(-d // bs) + 1
        if group_demand:
            serving.append(group)
            demand += group_demand
        else:
            num_idle += len(active)
    serve = serving
    if crossers:
        # Members whose slot opens a new block take it from the lane, in the loop's
        # order, before the loop serves anyone: only if they all come before the
        # loop's groups (the usual case: the loop's are new requests' prompts).
        crossers.sort(key=lambda i: seqs[i].group.sort_key)
        if serve and seqs[crossers[-1]].group.sort_key > serve[0].sort_key:
            others += [seqs[i] for i in crossers]
            serve = sorted(serve + [seqs[i].group for i in crossers], key=_sort_key)
            demand += len(crossers)
            blocks += 2 * len(crossers)
            crossers = []
    num_steady = int(np.count_nonzero(step.steady)) + len(crossers)
    if num_steady + demand > budget or \
            blocks + len(crossers) > kv.num_free_gpu_blocks:
        return self._lane_fallback()
    if num_steady:
        out.rows.add_lane(lane.commit(step, crossers))
    budget, num_seqs, num_serve_running = self._serve_running(
        out, serve, budget - num_steady, num_steady, lane)
    for seq in others:  # (the loop changed them: read again at the next step)
        lane.mark_stale(seq)
    return budget, num_seqs, num_members - len(others) + num_serve_running + num_idle


def lane_fallback(self: Scheduler) -> None:
    """This step goes to the loop alone, and `LANE_BACKOFF_STEPS` more."""
    self._lane_backoff = LANE_BACKOFF_STEPS
    lane = self.lane
    lane.stale = list(lane.seqs)  # the loop plans them now: read them again after
