"""Per-executor scheduler: decides what one executor computes in one step.

Hot path: `schedule()` runs once per step per executor. Keep per-token Python work out of it
(per-sequence work only) and never await inside it: a plan is built from one consistent view
of the KV manager, between `begin_step()` and `end_step()`.
"""

from __future__ import annotations

import bisect
import enum
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from ..kvmanager import InvariantError, KVCacheManager
from . import admission, decode_lane
from .cost_model import CostModel
from .grammar_drafts import FormatDrafts
from .plan_builder import PlanRows, ScheduledSeq, SchedulerOutput  # noqa: F401 (re-exported)
from .sequence import GroupStatus, RequestGroup, Sequence
from .speculative import Drafter, SpeculativeConfig

log = logging.getLogger("pagedserve.router.scheduler")


class PreemptionMode(enum.Enum):
    AUTO = "auto"
    RECOMPUTE = "recompute"
    SWAP = "swap"


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    preemption_mode: PreemptionMode = PreemptionMode.AUTO
    # A group preempted this many times is chosen as a victim only when every other
    # candidate was preempted as often (no request starves).
    preemption_cap: int = 3
    # Plan steady decodes as columns (router/decode_lane.py) once this many groups run:
    # the lane's fixed cost (~20 numpy calls a step) beats ~1 us a row saved from ~32-48
    # rows on (engine_bench). 0: never (every running sample through the scheduler's
    # loop: the same plans, rows in another order).
    decode_lane_min_running: int = 48
    # Plans in flight per executor (the router's --pipeline-depth). From 3 on, a sample
    # whose token in flight comes from a plan older than the last one sent waits for it.
    pipeline_depth: int = 2
    # Speculative decoding by n-gram lookup (router/speculative.py; None: off). The decode
    # lane is off with it (a lane step's blocks are counted before the loop's drafts).
    speculative: SpeculativeConfig | None = None
    # With it, the router's cursors over structured output's formats, for the tokens a
    # format forces (router/grammar_drafts.py; shared by the schedulers; None: constrained
    # samples draft nothing)
    formats: FormatDrafts | None = None


class Scheduler:
    """Continuous batching with chunked prefill for one executor.

    Queues: `running`, `swapped` and `waiting` groups, each kept sorted by
    (priority, arrival): lower priority values first, then earlier arrivals.
    """

    def __init__(self, kv: KVCacheManager, config: SchedulerConfig) -> None:
        self.kv = kv
        self.config = config
        self.cost = CostModel()
        self.running: list[RequestGroup] = []
        self.swapped: list[RequestGroup] = []
        self.waiting: list[RequestGroup] = []
        self.num_preemptions = {PreemptionMode.RECOMPUTE: 0, PreemptionMode.SWAP: 0}
        self._pending_drops: list[str] = []
        # Admission held (router/weight_sync.py): "" no, "hold" waiting groups stay waiting,
        # "retract" the next step first preempts every group by recompute, then holds,
        # "freeze" no group is scheduled (running ones keep their blocks).
        self.hold = ""
        self.pending_forks: list[tuple[Sequence, Sequence]] = []  # beams forked between steps
        self._num_running_seqs = 0  # (num_running_seqs: counted as schedule() walks them)
        # Without --speculative-config the drafter serves predictions only (Predicted
        # Outputs, router/predicted_outputs.py), in steps while a group with one is here
        self.drafter = Drafter(config.speculative, config.formats)
        self._predicted: set[str] = set()  # ids of the groups here with a prediction
        self._drafting: Drafter | None = None  # the drafter, in a step where it drafts
        self.lane = decode_lane.DecodeLane(kv, config.max_model_len) \
            if config.decode_lane_min_running > 0 and config.speculative is None else None
        self._lane_backoff = 0  # steps left without the lane (`_plan_with_lane`)
        # Depth 3 and more: plans sent so far (the last one's number)
        self._hold_older_pending = config.pipeline_depth >= 3
        self._plans_sent = 0

    # ------------------------------------------------------------------ queues

    def add(self, group: RequestGroup) -> None:
        """Queue a group (new, migrated here, or preempted by recompute). Its prompt (its
        tokens so far) is intended here from now on (`KVCacheManager.intend`), so routing
        and later admissions see the prefix it will compute before it runs."""
        group.status = GroupStatus.WAITING
        bisect.insort(self.waiting, group, key=lambda g: g.sort_key)
        self._intend(group)
        if group.spec.sampling.prediction:
            self._predicted.add(group.request_id)

    def _intend(self, group: RequestGroup) -> None:
        seqs = group.active_seqs()
        if seqs:
            seq = seqs[0]
            self.kv.intend(seq.seq_id, seq.token_ids, seq.block_hashes,
                           group.spec.cache_salt or None, group.sort_key)

    def groups(self) -> Iterable[RequestGroup]:
        yield from self.running
        yield from self.swapped
        yield from self.waiting

    def num_queued_tokens(self) -> int:
        """Prefill tokens queued here: what the prompts (and recomputes) of the waiting and
        running groups still have to compute, with a block several of them share counted
        once and cached blocks not at all (`KVCacheManager.num_intended_tokens`: every
        group intends its prompt from `add` until it is scheduled through it). Routing
        divides it by the prefill rate. Decodes are left out: their cost is part of the
        measured rate (steps mix them with prefill)."""
        return self.kv.num_intended_tokens

    def prefill_tokens_per_s(self) -> float | None:
        """This executor's measured prefill rate (`CostModel`), None before any
        measurement (routing then assumes what the other executors measured)."""
        return 1.0 / self.cost.s_per_token if self.cost.prefill_measured else None

    def decode_s_per_seq(self) -> float | None:
        """Measured seconds a decoding sequence adds to a step here, None before any."""
        return self.cost.s_per_seq if self.cost.decode_measured else None

    def step_fixed_s(self) -> float | None:
        """Measured seconds of any step here whatever it computes, None before any step."""
        return self.cost.fixed_s if self.cost.decode_measured or self.cost.prefill_measured \
            else None

    def num_running_seqs(self) -> int:
        """Samples running here (each decodes every step), as the last `schedule()` walked
        and admitted them: routing asks once per request it places, and walking every
        running group each time cost an admission ~40 us at 256 streams. Between steps the
        count can only be a few high (samples that ended since), never low."""
        return self._num_running_seqs

    def num_leaked_blocks(self) -> tuple[int, list[str]]:
        """Device blocks in use that no live sample here holds (nor a pin), and the KV
        manager's request ids and intents ("intent:<id>") that belong to no live sample
        (the likely owners; an orphan intent holds no block but would misinform routing)."""
        live = {s.seq_id for g in self.groups() for s in g.seqs}
        stats = self.kv.stats().gpu
        used = stats.num_total_blocks - stats.num_free_blocks
        leaked = max(0, used - self.kv.held_gpu_blocks(live))
        orphans = [rid for rid in self.kv.request_ids() if rid not in live]
        orphans += [f"intent:{rid}" for rid in self.kv.intent_ids() if rid not in live]
        return leaked, orphans

    def remove(self, group: RequestGroup) -> None:
        """Take a group off this executor for good (finished, aborted, failed): its blocks
        are freed now and the executor is told to drop its samples in the next plan."""
        for queue in (self.running, self.swapped, self.waiting):
            if group in queue:
                queue.remove(group)
                break
        self.kv.unpin(group.seqs[0].seq_id)
        for seq in group.seqs:
            self._release_seq(seq)
        group.status = GroupStatus.FINISHED
        self._predicted.discard(group.request_id)

    def finish_seq(self, seq: Sequence) -> None:
        """One sample is done (its group may go on): free its blocks at once."""
        seq.finished = True
        self._release_seq(seq)

    def _release_seq(self, seq: Sequence) -> None:
        if self.lane is not None:
            self.lane.evict(seq)
        self.drafter.forget(seq.seq_id)
        if self.kv.has_request(seq.seq_id):
            self.kv.free(seq.seq_id)  # its intent too
        else:
            self.kv.drop_intent(seq.seq_id)
        if seq.on_executor:
            self._pending_drops.append(seq.seq_id)
            seq.on_executor = False

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        """Decide one step.

        1. Running groups, best (priority, arrival) first: each active sample gets its next
           tokens (one for a decode, a chunk of the prompt for a prefill) within the token
           budget. When blocks run out, pins are released first, then the worst running
           group (the victim: lowest priority, latest arrival, not over the preemption cap)
           is preempted by swap or recompute (`auto` asks the cost model), until the sample
           fits or the group being scheduled is itself the victim.
        2. Only if nothing was preempted for blocks (a group preempted for a seat by a
           better priority, `_yield_seats`, leaves its seat to that one in this step):
           swapped and waiting groups in (priority, arrival) order, swapped first among
           equals, are brought in while blocks (above the watermark for new admissions),
           `max_num_seqs` and the token budget allow; the first one that does not fit (or
           that still has a token in flight from before its preemption, or was preempted
           in this step) stops admission, so order is kept. A new group's prompt starts after its cached
           prefix. A waiting group whose next prompt blocks a request ahead of it is
           computing waits for them instead (prefill dedup, `_admit_waiting`): it is
           passed over, not a stop. n > 1 groups compute the prompt once in
           sample 0 (all but the last token), then fork the other samples from it in a later
           step (copy-on-write shares every block) and every sample computes the last prompt
           token itself and samples from it.

        Pipelined steps: a sample whose last token is still being sampled by a plan in
        flight (`num_pending`) is decoded with that token as its input (the plan marks it;
        the executor feeds its own sample), unless the tokens in flight already reach
        max_tokens or max_model_len. Its slot is allocated like any other. The executor
        feeds a marked decode from the step just before (DESIGN §2), so from depth 3 on a
        sample whose token in flight comes from an older plan (it sat out the last one:
        budget, a swap) waits until that token is back; at depth 1-2 every token in flight
        comes from the last plan sent.

        Steady decodes are planned in the decode lane (router/decode_lane.py) as columns,
        and only the other running samples go through the loop below, when the order rows
        are planned in cannot matter (`_plan_with_lane`); otherwise every running sample
        goes through the loop, in order.
        """
        kv = self.kv
        drafter = self.drafter  # drafts this step unless as many groups run as disable it
        self._drafting = drafter if (drafter.config is not None or self._predicted) \
            and drafter.drafts_at(len(self.running)) else None
        kv.begin_step()
        out = SchedulerOutput(PlanRows(kv))
        out.dropped_seq_ids.extend(self._pending_drops)
        self._pending_drops.clear()
        out.forks.extend(f for f in self.pending_forks if not f[1].finished)
        self.pending_forks.clear()
        if self.hold == "freeze":  # paused in place (router/weight_sync.py): nothing runs
            self._num_running_seqs = sum(len(g.active_seqs()) for g in self.running)
        else:
            self._serve_and_admit(out)
        if self._drafting is not None:  # this plan must be answered before the next is built
            wants, may = self._drafting.wants_drafts, self._drafting.may_draft
            out.rows.speculating = bool(out.rows.drafts) or any(
                may(s.group) and wants(s) for s in out.rows.sampled)
        if self._hold_older_pending and not out.empty:  # (sent)
            self._plans_sent += 1
            for seq in out.rows.sampled:
                seq.sampled_plan = self._plans_sent
        return out

    def rowless_step(self) -> SchedulerOutput:
        """A step that computes nothing (a plan of block exports: router/prefix_pull.py):
        its plan counts as the last one sent, so from depth 3 on no later plan feeds a
        sample a token sampled before it (the executor feeds from the step just before)."""
        self.kv.begin_step()
        self._plans_sent += 1
        return SchedulerOutput(PlanRows(self.kv))

    def _serve_and_admit(self, out: SchedulerOutput) -> None:
        """`schedule()`'s steps 1 and 2: seats for better priorities, the running groups,
        then admission unless a group was preempted for blocks."""
        budget = self.config.max_num_batched_tokens
        self._yield_seats(out)  # admission held, or a better priority for a seat (admission.py)
        num_seat_preemptions = len(out.preempted)
        served = None
        lane = self.lane
        if lane is not None:
            if self._predicted:  # drafted rows take blocks the lane's step did not count
                lane.clear()
            elif len(self.running) >= self.config.decode_lane_min_running:
                served = self._plan_with_lane(out, budget)
            elif len(lane):  # too few to pay: the loop plans them from now on
                lane.clear()
        if served is None:
            served = self._serve_running(out, self.running, budget, 0, None)
        budget, num_seqs, self._num_running_seqs = served
        if len(out.preempted) == num_seat_preemptions:  # none for blocks
            self._admit(out, budget, num_seqs)  # (sets a group's first_scheduled_time)

    def _demand(self, group: RequestGroup, seq: Sequence) -> int:
        """Tokens of `seq` the loop would compute this step with budget to spare (0:
        none). A sample whose last token is in flight decodes it (the plan marks the
        row), unless the tokens in flight already reach max_tokens or max_model_len."""
        if group.handoff is not None:
            return 0  # its prompt is done: it decodes on a decode executor (handoff.py)
        pending = seq.num_pending
        num_tokens = len(seq.token_ids) + pending
        remaining = num_tokens - seq.num_computed_tokens
        if not group.forked:  # sample 0 of n > 1 stops before the last prompt token
            remaining = seq.num_prompt_tokens - 1 - seq.num_computed_tokens
        if pending:
            if group.beam is not None:
                return 0  # a beam's next input is chosen from this token's answer
            if num_tokens - seq.num_prompt_tokens >= group.spec.sampling.max_tokens \
                    or num_tokens >= self.config.max_model_len:
                return 0  # the tokens in flight already end it: known ahead
            if self._hold_older_pending and seq.sampled_plan != self._plans_sent:
                return 0  # its token in flight is not the last plan's: wait for it
            if self._drafting is not None and self._drafting.may_draft(group) \
                    and self._drafting.wants_drafts(seq):
                return 0  # a sample about to draft decodes from tokens received only
            if remaining > 1:  # a chunk never reaches past the tokens received
                remaining = len(seq.token_ids) - seq.num_computed_tokens
        return remaining if remaining > 0 else 0

    def _serve_running(self, out: SchedulerOutput, groups: list[RequestGroup], budget: int,
                       num_seqs: int, lane: decode_lane.DecodeLane | None
                       ) -> tuple[int, int, int]:
        """The loop: each active sample of `groups` (in order) gets its next tokens within
        the budget; returns (budget left, samples with rows, samples walked). `groups` is
        the running list itself (`lane` None: a sample short of blocks preempts, see
        `schedule`), or the samples the lane leaves to it (`lane` given: a committed
        decode of a one-sample group joins the lane; `_plan_with_lane` made sure no
        allocation fails)."""
        kv = self.kv
        num_running_seqs = 0
        pins_released = False
        # (bound once: this loop runs for every sample)
        commit, commit_decode = out.rows.add, out.rows.add_decode
        demand = self._demand
        drafter = self._drafting
        i = 0
        while i < len(groups):
            group = groups[i]
            if not group.forked:
                self._fork_if_ready(group, out)
            preempted_self = False
            active = group.active_seqs()
            num_running_seqs += len(active)
            for seq in active:
                if budget <= 0:
                    break
                remaining = demand(group, seq)
                if remaining <= 0:
                    continue
                num_new = remaining if remaining < budget else budget
                drafts = drafter.for_decode(group, seq, budget, self.config.max_model_len) \
                    if drafter is not None and num_new == 1 else None
                waits = False
                while True:
                    if drafts:  # slots for the drafts too, or none drafted
                        entry = kv.allocate(seq.seq_id, seq.token_ids, 1,
                                            lookahead=len(drafts))
                        if entry is None:
                            drafts = None
                            continue
                        break
                    entry = kv.allocate_decode(seq.seq_id, seq.token_ids) if num_new == 1 \
                        else kv.allocate(seq.seq_id, seq.token_ids, num_new)
                    if entry is not None:
                        break
                    if lane is not None:
                        raise InvariantError("a lane step ran out of blocks", (seq.seq_id,))
                    if not pins_released:
                        kv.release_pins()
                        pins_released = True
                        continue
                    # Blocks freed by this step's preemptions are handed out only from the
                    # next plan on (step boundary), blocks freed while plans are in flight
                    # once those are answered. When they already cover this sample's need,
                    # it waits a step instead of preempting yet another group.
                    if (out.preempted or kv.num_plans_in_flight) and \
                            kv.num_deferred_gpu_blocks >= \
                            kv.num_blocks_needed(seq.seq_id, num_new) + 1:
                        waits = True
                        break
                    victim = self._pick_victim(i)
                    partial = victim is group and any(r[0].group is group
                                                      for r in out.rows.rows)
                    self._preempt(victim, out, force_recompute=partial)
                    if victim is group:
                        preempted_self = True
                        break
                if preempted_self:
                    break
                if waits:
                    continue
                if drafts:
                    out.rows.add_drafted(seq, drafts)
                    budget -= 1 + len(drafts)
                    num_seqs += 1
                    continue
                if num_new == 1:
                    commit_decode(seq, entry)
                    if lane is not None and len(group.seqs) == 1 and group.beam is None:
                        lane.join(seq)
                else:
                    commit(seq, num_new)
                budget -= num_new
                num_seqs += 1
            if not preempted_self:
                i += 1
            else:  # (it left the running groups)
                num_running_seqs -= len(active)
        return budget, num_seqs, num_running_seqs

    def _fork_if_ready(self, group: RequestGroup, out: SchedulerOutput) -> None:
        """n > 1: once sample 0 has all but the last prompt token computed (in an earlier
        step: a copy-on-write copy made before this step's forward must see those keys and
        values), fork the other samples from it."""
        if group.forked:
            return
        parent = group.seqs[0]
        if parent.num_computed_tokens < parent.num_prompt_tokens - 1:
            return
        if out.rows.has(parent):
            return
        for child in group.seqs[1:]:
            if child.finished:  # forked again after a recompute: done already
                continue
            if self.kv.has_request(parent.seq_id):
                self.kv.fork(parent.seq_id, child.seq_id)
            child.num_computed_tokens = parent.num_computed_tokens
            child.block_hashes = list(parent.block_hashes)
            if parent.num_output_tokens == 0 and child.num_output_tokens == 0:
                out.forks.append((parent, child))  # the executor copies the parent's state
            # else (forked again after a recompute) the samples have outputs of their own:
            # the plan sends the child as a new request carrying its own, as any
            # recomputed sample
        group.forked = True

    def _pick_victim(self, current: int) -> RequestGroup:
        """The running group to preempt: the last in (priority, arrival) order from the one
        being scheduled on, skipping groups preempted `preemption_cap` times when another
        candidate remains."""
        candidates = self.running[current:]
        for group in reversed(candidates):
            if group.num_preemptions < self.config.preemption_cap:
                return group
        return candidates[-1]

    def _preempt(self, group: RequestGroup, out: SchedulerOutput,
                 force_recompute: bool = False) -> None:
        kv = self.kv
        self.running.remove(group)
        out.rows.undo_group(group)  # preempted itself while scheduled: undo its part
        if self.lane is not None:
            for seq in group.seqs:
                self.lane.evict(seq)
        seq_ids = [s.seq_id for s in group.active_seqs() if kv.has_request(s.seq_id)]
        mode = self.config.preemption_mode
        if mode is PreemptionMode.AUTO:
            blocks = {b for sid in seq_ids for b in kv.block_table(sid)}
            tokens = sum(s.num_computed_tokens for s in group.active_seqs())
            mode = (PreemptionMode.SWAP if self.cost.prefer_swap(len(blocks), tokens)
                    else PreemptionMode.RECOMPUTE)
        if force_recompute or not seq_ids or (
            mode is PreemptionMode.SWAP and kv.swap_out(seq_ids) is None
        ):
            mode = PreemptionMode.RECOMPUTE
        group.num_preemptions += 1
        self.num_preemptions[mode] += 1
        out.preempted.append((group, mode))
        if mode is PreemptionMode.SWAP:
            group.status = GroupStatus.SWAPPED
            bisect.insort(self.swapped, group, key=lambda g: g.sort_key)
            return
        self._requeue(group, out)

    # ------------------------------------------------------------------ admission.py
    _admit, _admit_waiting, _yield_seats, _requeue = (
        admission.admit, admission.admit_waiting, admission.yield_seats, admission.requeue)

    # ------------------------------------------------------------------ decode_lane.py
    _plan_with_lane = decode_lane.plan_with_lane
    _lane_fallback = decode_lane.lane_fallback
