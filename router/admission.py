"""Admission: which swapped and waiting groups join the running ones in a step (the last
part of `Scheduler.schedule()`, after the running groups are served), with prefill dedup.
Functions of the Scheduler (bound there as `_admit` and `_admit_waiting`), on the same hot
path: per-group work only.
"""

from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING

from ..kvmanager import PrefixHit
from .sequence import GroupStatus, RequestGroup, Sequence

if TYPE_CHECKING:
    from .scheduler import Scheduler, SchedulerOutput


def admit(self: Scheduler, out: SchedulerOutput, budget: int, num_seqs: int) -> None:
    """Bring in swapped and waiting groups in order until one does not fit; a waiting
    group that waits for its prefix (`_admit_waiting`) is passed over, not a stop."""
    kv = self.kv
    cfg = self.config
    waiting = self.waiting if not self.hold else []  # held: only swapped ones come back
    w = 0  # index of the next waiting group (those before it wait for their prefix)
    sw = 0  # index of the next swapped group (those before it are finished)
    while (sw < len(self.swapped) or w < len(waiting)) and budget > 0:
        take_swapped = sw < len(self.swapped) and (
            w >= len(waiting) or self.swapped[sw].sort_key <= waiting[w].sort_key
        )
        group = self.swapped[sw] if take_swapped else waiting[w]
        if group.has_pending:  # preempted with a token in flight: wait for it, in order
            return
        if out.preempted and any(g is group for g, _ in out.preempted):
            return  # preempted in this step (for a seat): never back in the same plan
        seqs = group.active_seqs()
        if not seqs:
            # Preempted with its last token in flight, which has just arrived: every
            # sample is finished, and the text stage completes the group (removes it)
            # once this plan is sent. Passed over, never admitted.
            if take_swapped:
                sw += 1
            else:
                w += 1
            continue
        if num_seqs + len(seqs) > cfg.max_num_seqs:
            return
        if take_swapped:
            seq_ids = [s.seq_id for s in seqs if kv.has_request(s.seq_id)]
            if kv.swap_in(seq_ids) is None:
                return
            self.swapped.pop(sw)
            scheduled = []
            for seq in seqs:
                remaining = seq.num_uncomputed
                if not group.forked:  # sample 0 of n > 1 stops before the last token
                    remaining = seq.num_prompt_tokens - 1 - seq.num_computed_tokens
                num_new = min(remaining, budget)
                if num_new <= 0:
                    continue
                if kv.allocate(seq.seq_id, seq.token_ids, num_new) is None:
                    break
                scheduled.append((seq, num_new))
                budget -= num_new
            # Swap-out released the group's intent; one back in the middle of its prompt
            # intends the rest again, so routing and waiting requests see those blocks.
            if any(s.num_computed_tokens + n < s.num_prompt_tokens for s, n in scheduled):
                self._intend(group)
        else:
            scheduled = self._admit_waiting(group, budget)
            if scheduled is WAITS_FOR_PREFIX:
                w += 1
                continue
            if scheduled is None:
                return
            waiting.pop(w)
            budget -= sum(n for _, n in scheduled)
        group.status = GroupStatus.RUNNING
        if group.first_scheduled_time is None:
            group.first_scheduled_time = time.monotonic()
        bisect.insort(self.running, group, key=lambda g: g.sort_key)
        for seq, num_new in scheduled:
            if num_new > 0:
                out.rows.add(seq, num_new)
        num_seqs += len(seqs)
        if not group.forked and len(group.seqs) > 1 and not any(n for _, n in scheduled):
            budget = _fork_now(self, group, out, budget)
        self._num_running_seqs += len(group.active_seqs())


def yield_seats(self: Scheduler, out: SchedulerOutput) -> None:
    """Priority preemption for seats (`max_num_seqs`), before the running groups are
    served: while the first swapped or waiting group has a better (lower) priority than
    the worst running group and the seats are all taken, that running group (worst
    priority, latest arrival, preempted fewer than `preemption_cap` times) is preempted, so
    the better one is admitted in this same step (blocks allowing: the victim's are free
    only from the next plan on) instead of waiting for the worse ones to finish: an online
    request beside a batch (router/batch_api.py) takes the seat at once, not after a batch
    request's whole generation. Equal priorities (the default) never preempt: the two
    comparisons are all this costs a step then.

    Admission held (`Scheduler.hold`, router/weight_sync.py) gives no seat; "retract"
    first preempts every running and swapped group by recompute (`retract`)."""
    if self.hold:
        if self.hold == "retract":
            retract(self, out)
        return
    running, waiting, swapped = self.running, self.waiting, self.swapped
    if not running or not (waiting or swapped):
        return
    head = (swapped[0] if not waiting else waiting[0] if not swapped
            else min(swapped[0], waiting[0], key=lambda g: g.sort_key))
    if head.spec.priority >= running[-1].spec.priority or head.has_pending:
        return
    cfg = self.config
    need = len(head.active_seqs())
    seats = cfg.max_num_seqs - sum(len(g.active_seqs()) for g in running)
    while seats < need <= cfg.max_num_seqs:
        victim = next((g for g in reversed(running)
                       if g.spec.priority > head.spec.priority
                       and g.num_preemptions < cfg.preemption_cap), None)
        if victim is None:
            return
        seats += len(victim.active_seqs())
        self._preempt(victim, out)


def retract(self: Scheduler, out: SchedulerOutput) -> None:
    """Every running and swapped group back to waiting with no KV (SGLang's "retract"
    pause, before a weight update): the running ones preempted by recompute, the swapped
    ones' CPU blocks freed; each keeps its tokens so far and computes them again once
    admitted. Then admission is held."""
    from .scheduler import PreemptionMode  # (scheduler.py imports this module)

    for group in reversed(list(self.running)):
        self._preempt(group, out, force_recompute=True)
    for group in list(self.swapped):
        self.swapped.remove(group)
        self.num_preemptions[PreemptionMode.RECOMPUTE] += 1
        out.preempted.append((group, PreemptionMode.RECOMPUTE))
        requeue(self, group, out)
    self.hold = "hold"


def requeue(self: Scheduler, group: RequestGroup, out: SchedulerOutput) -> None:
    """A group preempted by recompute: every block goes back; the executor forgets the
    samples and gets them again as new requests carrying their output so far."""
    kv = self.kv
    for seq in group.seqs:
        if kv.has_request(seq.seq_id):
            kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        if seq.on_executor:
            out.dropped_seq_ids.append(seq.seq_id)
            seq.on_executor = False
    if group.forked and len(group.seqs) > 1 and group.num_prompt_tokens > 1:
        # The samples must hold one copy of their prompt again: each admitted with its
        # own (no prefix caching, or the cached prompt evicted meanwhile), a request
        # admitted as fitting may never fit, swapping itself in and out for ever at the
        # head of the queue. So sample 0 recomputes the prompt (mostly cache hits with
        # prefix caching) and the others fork from it, as at the start (`_fork_if_ready`).
        group.forked = False
    self.add(group)


def _fork_now(self: Scheduler, group: RequestGroup, out: SchedulerOutput, budget: int) -> int:
    """An n > 1 group admitted with all of its prompt but the last token cached has nothing
    of sample 0 to compute: fork it now (the cached blocks were computed by earlier plans,
    which the executor runs first) and give every sample its last prompt token in this
    step, as far as the budget and free blocks go (the rest in the next steps). Otherwise
    it would sit out a step with nothing scheduled (and, nothing else running, its step
    loop would look again only after RETRY_S). Returns the budget left."""
    self._fork_if_ready(group, out)
    if not group.forked:
        return budget
    for seq in group.active_seqs():
        num_new = min(seq.num_uncomputed, budget)
        if num_new <= 0:
            continue
        if self.kv.allocate(seq.seq_id, seq.token_ids, num_new) is None:
            break
        out.rows.add(seq, num_new)
        budget -= num_new
    return budget


def admit_waiting(self: Scheduler, group: RequestGroup, budget: int) -> list | object | None:
    """Allocate a waiting group's samples (all or nothing); None when they don't fit,
    `WAITS_FOR_PREFIX` when it waits for blocks of its prefix being computed here.

    Prefill dedup. Past its cached prefix, the blocks of the prompt that another request
    here intends to compute (`KVCacheManager.intended_tokens`) are not computed twice
    when that request computes them first: it is admitted (running: scheduled before
    any admission, every step) or waiting ahead of this group in (priority, arrival)
    order (admitted before it). Either way those blocks are ready no later than this
    group could compute them itself, so it waits: it is passed over (the groups behind
    it are still admitted), keeps its place, and pins what is cached of its prompt so
    far (pins stay under `max_pinned_fraction`). Each step it looks again; once nothing
    past its cached prefix is intended ahead of it (the blocks registered when their
    plan was sent; or the request computing them ended, was preempted or moved away,
    which releases its intent), it is admitted with an ordinary lookup: the waited-for
    tokens are cache hits (`cached_prompt_tokens`, the prefix hit counters), and what is
    still missing it computes itself. A group whose prefix is being pulled from another
    executor (router/prefix_pull.py) waits the same way until the pull ends."""
    if group.pull is not None:  # blocks of its prefix are on their way (prefix_pull.py)
        return WAITS_FOR_PREFIX
    kv = self.kv
    salt = group.spec.cache_salt or None
    seqs = group.active_seqs()
    first = seqs[0]
    kv.hash_blocks(first.token_ids, salt, first.block_hashes)
    hit = kv.lookup(first.token_ids, first.block_hashes, salt)
    waits_for = kv.intended_tokens(first.token_ids, first.block_hashes, salt, len(hit),
                                   before=group.sort_key, exclude=first.seq_id)
    group.prefix_wait_tokens = waits_for
    if waits_for:
        pinned = kv.pinned(first.seq_id)
        if len(hit.block_ids) > (len(pinned) if pinned is not None else 0):
            group.pinned_tokens = kv.pin(first.seq_id, hit).num_tokens
        return WAITS_FOR_PREFIX
    done: list[tuple[Sequence, int]] = []
    for seq in seqs:
        target = len(seq.token_ids)
        if not group.forked:  # sample 0 of an n > 1 group stops before the last token
            target = seq.num_prompt_tokens - 1
        if seq is not first:
            kv.hash_blocks(seq.token_ids, salt, seq.block_hashes)
            hit = kv.lookup(seq.token_ids, seq.block_hashes, salt)
        pinned = kv.pinned(seq.seq_id)
        if pinned is not None and len(pinned) < len(hit):
            kv.unpin(seq.seq_id)  # more of it is cached now than was pinned
        hit = _clip_hit(hit, target, kv.block_size)
        num_new = max(0, min(target - hit.num_tokens, budget))
        # No budget left: the group waits, unless the first sample got its tokens (the
        # others, e.g. of a group recomputed after its fork, go on in later steps: one
        # step may never have room for every sample's whole prompt).
        if (num_new == 0 and target > hit.num_tokens and seq is first) or kv.allocate(
            seq.seq_id, seq.token_ids, num_new, hit=hit,
            block_hashes=seq.block_hashes, cache_salt=salt,
        ) is None:  # no budget or no blocks left: the whole group waits
            for s, _ in done:
                kv.free(s.seq_id)
                s.num_computed_tokens = 0
            if done:
                self._intend(group)  # free released it: it still waits here
            return None
        seq.num_computed_tokens = hit.num_tokens
        group.pinned_tokens = 0
        if seq.index == 0 and group.cached_prompt_tokens is None:
            group.cached_prompt_tokens = min(hit.num_tokens, seq.num_prompt_tokens)
        done.append((seq, num_new))
        budget -= num_new
    return done


WAITS_FOR_PREFIX = object()  # _admit_waiting: the group waits for its prefix (dedup)


def _clip_hit(hit: PrefixHit, max_tokens: int, block_size: int) -> PrefixHit:
    """Shorten a prefix hit to at most `max_tokens` tokens (whole blocks)."""
    if hit.num_tokens <= max_tokens:
        return hit
    return hit.clip(max_tokens // block_size, block_size)
