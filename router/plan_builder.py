"""Scheduler decisions -> StepPlan: the arrays an executor needs for one step. The
decisions themselves (`SchedulerOutput`: the rows, forks, drops, preemptions) are defined
here, at the end, and re-exported by scheduler.py.

Hot path: runs once per step per executor. The scheduler adds each sample's row as it
commits the sample's tokens (`PlanRows.add`, one pass over the running samples makes the
decision and the row), so building the plan is a transpose of the rows and one numpy array
per column. A decode (one new token) takes its slot and table change in one call into the
KV manager.

A row's block table change is taken from the KV manager when the row is added: nothing
later in the step changes a committed sample's table (a sample is committed once a step;
a fork copies the parent's table without changing it). A row undone because its group
was preempted in the same step loses its change, and needs none: swap-in resends the whole
table, recompute starts over as a new request.

Pipelined steps: a decode whose input token is still being sampled by the previous plan (the
sequence has it pending, so its position is past the tokens received) goes out marked in
`feed_sampled` with -1 in `token_ids`; the executor feeds it its own sample. A sequence that
samples in this plan gets one more pending token when its row is added, taken back when the
plan's result is in (or when the row is undone).

Speculative decoding (router/speculative.py): a decode with drafts is a row of 1 + d tokens
(its input, then the drafts, which are in no token list) with slots for all of them; the
plan's `num_draft_tokens` says which rows those are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

from ..kvmanager import KVCacheManager
from ..protos import wire
from .decode_lane import LaneRows
from .sequence import RequestGroup, Sequence

if TYPE_CHECKING:
    from .scheduler import PreemptionMode


def wire_sampling(group: RequestGroup, eos_token_ids: tuple[int, ...]) -> wire.SamplingParams:
    sp = group.spec.sampling
    if group.beam is not None:  # a beam's row answers the top-K logprobs; its sample is unused
        return wire.SamplingParams(temperature=0.0, seed=sp.seed,
                                   logprobs=group.beam.num_logprobs,
                                   stop_token_ids=tuple(sp.stop_token_ids),
                                   eos_token_ids=tuple(eos_token_ids), ignore_eos=sp.ignore_eos,
                                   prompt_logprobs=sp.prompt_logprobs)
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
        allowed_token_ids=sp.allowed_token_ids,
        bad_words_token_ids=sp.bad_words_token_ids,
        embed=sp.embed,
    )


def _new_request(seq: Sequence, eos_token_ids: tuple[int, ...]) -> wire.NewRequest:
    return wire.NewRequest(
        request_id=seq.seq_id,
        prompt_token_ids=np.asarray(seq.token_ids[: seq.num_prompt_tokens], dtype=np.int32),
        output_token_ids=np.asarray(seq.token_ids[seq.num_prompt_tokens:], dtype=np.int32),
        sampling=wire_sampling(seq.group, eos_token_ids),
        sample_index=seq.index,
        lora=seq.group.spec.lora_adapter,
    )


class PlanRows:
    """One step's per-sample rows, in the order the scheduler commits them.

    A row is a tuple (seq, seq_id, start, num_new, samples, input, slot, table_start,
    table_ids): `start` is the tokens already computed; a decode's `input` is its token id
    (-1: fed the executor's own previous sample) and `slot` an int; a chunk's are a list of
    ids and an int64 array."""

    __slots__ = ("kv", "rows", "lane", "sampled", "fresh", "num_tokens", "num_prefill_tokens",
                 "num_decode_seqs", "drafts", "speculating")

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.rows: list[tuple] = []
        self.lane: LaneRows | None = None  # the steady decodes planned as columns, first
        self.sampled: list[Sequence] = []  # rows that sample, in row order
        self.fresh: list[Sequence] = []  # rows' samples the executor did not hold when added
        self.num_tokens = 0
        self.num_prefill_tokens = 0  # of num_tokens, in chunks of more than one token
        self.num_decode_seqs = 0  # rows computing one token (or one and its drafts)
        self.drafts: dict[Sequence, list[int]] = {}  # rows with drafts: the drafts
        # a sample of this plan may speculate: no plan may follow it before its result
        self.speculating = False

    def add_lane(self, lane: LaneRows) -> None:
        """The decode lane's rows (router/decode_lane.py): they go first in the plan, so
        their samples come first in `sampled` (added before any other row)."""
        assert self.lane is None and not self.rows
        self.lane = lane
        self.sampled.extend(lane.seqs)
        n = len(lane.ids)
        self.num_tokens += n
        self.num_decode_seqs += n

    def row_samples(self) -> list[tuple[Sequence, int]]:
        """Every row's (sample, tokens computed), in plan order."""
        lane = [(seq, 1) for seq in self.lane.seqs] if self.lane is not None else []
        return lane + [(r[0], r[3]) for r in self.rows]

    def add(self, seq: Sequence, num_new: int) -> None:
        """Commit `num_new` tokens of `seq` (its slots already allocated) into a row."""
        if num_new == 1:
            self.add_decode(seq, self.kv.take_decode_entry(seq.seq_id, seq.num_computed_tokens))
            return
        # (`add_decode` repeats this bookkeeping inline: a shared helper, one call more a
        # sample, measured 3-4% of an engine step at 256 streams)
        start = seq.num_computed_tokens
        end = start + num_new
        seq.num_computed_tokens = end
        seq_id = seq.seq_id
        tokens = seq.token_ids
        samples = end == len(tokens) + seq.num_pending
        if samples:
            seq.num_pending += 1
            self.sampled.append(seq)
        if not seq.on_executor:
            self.fresh.append(seq)
        self.num_tokens += num_new
        self.num_prefill_tokens += num_new
        kv = self.kv
        table_start, table_ids = kv.take_table_change(seq_id)
        self.rows.append((seq, seq_id, start, num_new, samples, tokens[start:end],
                          kv.slot_mapping(seq_id, start, num_new), table_start, table_ids))

    def add_decode(self, seq: Sequence, entry: tuple[int, list[int], int]) -> None:
        """Commit one token of `seq`: `entry` is its (table change start, changed ids,
        slot) from `KVCacheManager.allocate_decode` or `take_decode_entry`."""
        start = seq.num_computed_tokens
        seq.num_computed_tokens = start + 1
        tokens = seq.token_ids
        num_received = len(tokens)
        samples = start + 1 == num_received + seq.num_pending
        if samples:
            seq.num_pending += 1
            self.sampled.append(seq)
        if not seq.on_executor:
            self.fresh.append(seq)
        self.num_tokens += 1
        self.num_decode_seqs += 1
        self.rows.append((seq, seq.seq_id, start, 1, samples,
                          tokens[start] if start < num_received else -1, entry[2],
                          entry[0], entry[1]))

    def add_drafted(self, seq: Sequence, drafts: list[int]) -> None:
        """Commit a decode of `seq` with `drafts` after its input (slots allocated for
        all of them: `KVCacheManager.allocate` with the drafts as lookahead). The drafts
        count as prefill tokens (a chunk's work), the row as a decode."""
        start = seq.num_computed_tokens
        seq.num_computed_tokens = start + 1
        num_drafts = len(drafts)
        seq.num_pending += 1
        self.sampled.append(seq)
        if not seq.on_executor:
            self.fresh.append(seq)
        self.num_tokens += 1 + num_drafts
        self.num_prefill_tokens += num_drafts
        self.num_decode_seqs += 1
        self.drafts[seq] = drafts
        seq_id = seq.seq_id
        kv = self.kv
        table_start, table_ids = kv.take_table_change(seq_id)
        self.rows.append((seq, seq_id, start, 1 + num_drafts, True,
                          [seq.token_ids[start], *drafts],
                          kv.slot_mapping(seq_id, start, 1 + num_drafts), table_start,
                          table_ids))

    def undo_group(self, group: RequestGroup) -> None:
        """Take back the rows of `group` (preempted in the step that committed them; never
        in a step that planned lane rows: see Scheduler._plan_with_lane)."""
        assert self.lane is None, "a preemption in a step with lane rows"
        mine = [r for r in self.rows if r[0].group is group]
        if not mine:
            return
        self.rows = [r for r in self.rows if r[0].group is not group]
        for r in mine:
            r[0].num_computed_tokens = r[2]
            self.num_tokens -= r[3]
            drafted = self.drafts.pop(r[0], None)
            if drafted is not None:
                self.num_decode_seqs -= 1
                self.num_prefill_tokens -= len(drafted)
            elif r[3] == 1:
                self.num_decode_seqs -= 1
            else:
                self.num_prefill_tokens -= r[3]
        for seq in self.sampled:
            if seq.group is group:
                seq.num_pending -= 1
        self.sampled = [s for s in self.sampled if s.group is not group]
        self.fresh = [s for s in self.fresh if s.group is not group]

    def has(self, seq: Sequence) -> bool:
        """Whether `seq` has a row in this step (O(rows): off the per-sample path)."""
        return any(r[0] is seq for r in self.rows) or (
            self.lane is not None and any(s is seq for s in self.lane.seqs))


def build_plan(step_id: int, out: SchedulerOutput, kv: KVCacheManager,
               eos_token_ids: tuple[int, ...], deadline_s: float = 0.0) -> wire.StepPlan:
    """Turn one step's decisions (`SchedulerOutput`: its rows, forks, drops) into the
    StepPlan, and mark the samples the executor now holds (forked children, new
    requests)."""
    forks: list[wire.Fork] = []
    for parent, child in out.forks:
        if parent.on_executor:  # the executor copies the parent's sampling state
            forks.append(wire.Fork(parent.seq_id, child.seq_id, child.index))
            child.on_executor = True
    new_requests: list[wire.NewRequest] = []
    for seq in out.rows.fresh:
        if not seq.on_executor:  # (a child the fork above gave the executor is not new)
            new_requests.append(_new_request(seq, eos_token_ids))
            seq.on_executor = True

    rows = out.rows.rows
    num_rows = len(rows)
    if num_rows:
        (_, request_ids, starts, num_new, samples, inputs, slots, table_starts,
         table_ids) = zip(*rows, strict=True)
        request_ids = list(request_ids)
    else:
        request_ids, starts, num_new, samples, inputs, slots, table_starts, table_ids = \
            [], (), (), (), (), (), (), ()
    num_computed = np.array(starts, dtype=np.int32)
    if out.rows.num_prefill_tokens == 0:  # decodes only: one value a row everywhere
        token_ids = np.array(inputs, dtype=np.int32)
        positions = num_computed.copy()
        slot_mapping = np.array(slots, dtype=np.int64)
    else:
        num_lane = len(out.rows.lane.ids) if out.rows.lane is not None else 0
        token_ids, positions, slot_mapping = _concat_chunks(rows, out.rows.num_tokens - num_lane)
    feed = token_ids[: num_rows] < 0 if out.rows.num_prefill_tokens == 0 else \
        np.array([type(x) is int and x < 0 for x in inputs], dtype=bool)
    num_new = np.array(num_new, dtype=np.int32)
    samples = np.array(samples, dtype=np.uint8)
    table_starts = np.array(table_starts, dtype=np.int32)
    table_lens = np.fromiter(map(len, table_ids), dtype=np.int32, count=num_rows)
    lane = out.rows.lane
    if lane is not None:  # the steady decodes first: one token each, sampling, no change
        n = len(lane.ids)
        request_ids = lane.ids + request_ids if num_rows else lane.ids
        if num_rows:
            num_computed = np.concatenate([lane.starts, num_computed])
            num_new = np.concatenate([np.ones(n, np.int32), num_new])
            samples = np.concatenate([np.ones(n, np.uint8), samples])
            token_ids = np.concatenate([lane.inputs, token_ids])
            positions = np.concatenate([lane.starts, positions])
            slot_mapping = np.concatenate([lane.slots, slot_mapping])
            feed = np.concatenate([lane.inputs < 0, feed])
            table_starts = np.concatenate([lane.table_starts, table_starts])
            table_lens = np.concatenate([lane.table_changed, table_lens])
        else:
            num_computed, token_ids, slot_mapping = lane.starts, lane.inputs, lane.slots
            positions = lane.starts.copy()
            num_new, samples = np.ones(n, np.int32), np.ones(n, np.uint8)
            feed = lane.inputs < 0
            table_starts, table_lens = lane.table_starts, lane.table_changed
    feed_sampled = feed.astype(np.uint8) if feed.any() else None
    num_drafts = None
    if out.rows.drafts:
        drafted = out.rows.drafts
        num_drafts = np.fromiter((len(drafted.get(r[0], ())) for r in rows), np.uint8,
                                 num_rows)
        if lane is not None:
            num_drafts = np.concatenate([np.zeros(len(lane.ids), np.uint8), num_drafts])
    ops = kv.take_block_ops()
    return wire.StepPlan(
        step_id=step_id,
        new_requests=new_requests,
        forks=forks,
        request_ids=request_ids,
        num_computed_tokens=num_computed,
        num_new_tokens=num_new,
        do_sample=samples,
        feed_sampled=feed_sampled,
        token_ids=token_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        block_table_starts=table_starts,
        block_table_lens=table_lens,
        block_table_ids=np.fromiter(chain.from_iterable(table_ids), dtype=np.int32)
        if lane is None else np.concatenate([
            lane.table_ids, np.fromiter(chain.from_iterable(table_ids), dtype=np.int32)]),
        swap_out=ops.swap_out,
        swap_in=ops.swap_in,
        copy=ops.copy,
        finished_ids=list(out.dropped_seq_ids),
        deadline_s=deadline_s,
        num_draft_tokens=num_drafts,
    )


def _concat_chunks(rows: list[tuple], num_tokens: int) -> tuple[np.ndarray, ...]:
    """Token ids, positions and slots of rows mixing decodes and chunks, in token order."""
    token_ids = np.empty(num_tokens, dtype=np.int32)
    positions = np.empty(num_tokens, dtype=np.int32)
    slots = np.empty(num_tokens, dtype=np.int64)
    t = 0
    for row in rows:
        start, k = row[2], row[3]
        if k == 1:
            token_ids[t] = row[5]
            positions[t] = start
            slots[t] = row[6]
        else:
            token_ids[t : t + k] = row[5]
            positions[t : t + k] = np.arange(start, start + k, dtype=np.int32)
            slots[t : t + k] = row[6]
        t += k
    return token_ids, positions, slots


# ------------------------------------------------------------------ a step's decisions


@dataclass
class ScheduledSeq:
    """A row as tests and logs read it (`SchedulerOutput.scheduled`)."""

    seq: Sequence
    num_new_tokens: int  # tokens computed this step, from seq.num_computed_tokens before


@dataclass
class SchedulerOutput:
    """One step's decisions for one executor: the plan's rows as they are committed
    (`PlanRows`), forks, drops and preemptions (turned into a StepPlan by plan_builder)."""

    rows: PlanRows
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)  # (parent, child)
    dropped_seq_ids: list[str] = field(default_factory=list)  # executor forgets them
    preempted: list[tuple[RequestGroup, PreemptionMode]] = field(default_factory=list)

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        """The committed samples and their token counts, in row order."""
        return [ScheduledSeq(seq, n) for seq, n in self.rows.row_samples()]

    @property
    def sampled(self) -> list[Sequence]:
        """The samples that sample in this step, in row order (each has it pending)."""
        return self.rows.sampled

    @property
    def num_tokens(self) -> int:
        return self.rows.num_tokens

    @property
    def num_prefill_tokens(self) -> int:
        """Of num_tokens, those in chunks of more than one token (the cost model's split)."""
        return self.rows.num_prefill_tokens

    @property
    def num_decode_seqs(self) -> int:
        """Sequences computing one token this step."""
        return self.rows.num_decode_seqs

    @property
    def empty(self) -> bool:
        """Nothing for the executor: no tokens, no drops, no preemptions, no block moves
        (a group swapped in whose samples got no tokens this step still needs its swap-in
        sent now: a later plan could swap those blocks out again before it)."""
        return not self.rows.rows and self.rows.lane is None and not self.dropped_seq_ids \
            and not self.preempted and not self.rows.kv.has_block_ops and not self.forks
