"""Allocation: admission, slots for new tokens (with copy-on-write), free, fork, and the
per-request plan data the plan builder reads (tables, slots, table changes).

Functions of the KVCacheManager (bound as its methods in manager.py; `self` is the manager).
HOT PATH: `allocate_decode` (a decode), `allocate` (a prompt chunk), `free`, `slot_mapping`
and `take_decode_entry` run for every request of every step: no logging, no per-block method
calls, no defensive copies.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .state import EMPTY_HIT, InvariantError, PrefixHit, RequestState, cdiv

if TYPE_CHECKING:
    from .manager import KVCacheManager


# ------------------------------------------------------------------ allocation


def can_ever_fit(self: KVCacheManager, num_tokens: int) -> bool:
    """Whether a request of `num_tokens` tokens could be admitted on an empty cache."""
    return cdiv(num_tokens, self.block_size) <= self.gpu.num_blocks - self.watermark_blocks


def allocate(
    self: KVCacheManager,
    request_id: str,
    token_ids: Sequence[int],
    num_new_tokens: int,
    *,
    hit: PrefixHit | None = None,
    block_hashes: list | None = None,
    cache_salt: str | None = None,
    lookahead: int = 0,
    num_computed_tokens: int | None = None,
) -> list[int] | None:
    """Give `request_id` slots for `num_new_tokens` more tokens (plus `lookahead` spare
    slots). Returns the ids of the blocks newly added to its table ([] when none were
    needed), or None when the device is short of blocks; None leaves no trace.

    `token_ids` is the request's whole token list so far (prompt + output; the manager
    keeps a reference and reads only its first num_tokens). Its newly full blocks are
    registered in the prefix cache when the plan computing them is sent (`end_step`),
    or at once when called outside a step; so a lookup never hits a block whose keys
    and values are not computed by an earlier plan, and a request preempted in the
    step it was scheduled (free or swap_out before end_step) registers nothing new.

    A request seen for the first time is admitted: its computed prefix is its pin
    (`pin(request_id, ...)`, which wins) or `hit` (from `lookup` just before, else the
    hit is stale and this raises), it must leave `watermark_blocks` free, and it counts
    in the prefix-cache query/hit stats. Its `block_hashes` list (from `hash_blocks`) is
    kept and extended in place as blocks fill; `cache_salt` is remembered.

    A running request's next tokens are written from position `num_computed_tokens`
    on (default: its num_tokens, i.e. right after the last slot given; pass it to
    recompute slots that were given but never computed, e.g. after a preemption in
    the step they were scheduled). Its slot count becomes max(num_tokens,
    num_computed_tokens + num_new_tokens). A block written into that is shared (ref
    count > 1, after `fork`) is replaced by a fresh block and a (src, dst) copy is
    queued for the plan (copy-on-write)."""
    req = self._reqs.get(request_id)
    if req is None:
        return self._admit(
            request_id, token_ids, num_new_tokens, hit, block_hashes, cache_salt, lookahead
        )
    if not req.on_gpu:
        raise InvariantError("allocate on a swapped-out request", (request_id,))
    bs = self.block_size
    gpu = self.gpu
    table = req.block_ids
    old_tokens = req.num_tokens
    start = old_tokens
    if num_computed_tokens is not None:
        if not 0 <= num_computed_tokens <= old_tokens:
            raise InvariantError(
                f"num_computed_tokens {num_computed_tokens} outside [0, {old_tokens}]",
                (request_id,),
            )
        start = num_computed_tokens
    end = start + num_new_tokens
    num_tokens = end if end > old_tokens else old_tokens
    num_old_blocks = len(table)
    need = -(-(end + lookahead) // bs) - num_old_blocks  # ceil division, inlined
    if need < 0:
        need = 0
    # Copy-on-write: existing blocks this call writes into that others share.
    cow: list[int] = []
    if num_new_tokens == 1:  # a decode writes into one block at most
        i = start // bs
        if i < num_old_blocks and gpu.blocks[table[i]].ref_cnt > 1:
            cow.append(i)
    elif num_new_tokens > 0:
        blocks = gpu.blocks
        last = -(-end // bs)
        if last > num_old_blocks:
            last = num_old_blocks
        for i in range(start // bs, last):
            if blocks[table[i]].ref_cnt > 1:
                cow.append(i)
    if need + len(cow) > gpu.num_free:
        return None
    new_ids: list[int] = []
    if cow:
        fresh = gpu.take(len(cow))
        old = []
        # A block swapped in by this plan is a destination of it: the copy is made from
        # its CPU source instead (a plan never names a block as source and destination).
        swapped_in = {g: c for c, g in self._swap_in} if self._swap_in else None
        for i, dst in zip(cow, fresh, strict=True):
            src = table[i]
            if i * bs < old_tokens:  # holds written tokens: copy them
                if swapped_in is not None and src in swapped_in:
                    self._swap_in.append((swapped_in[src], dst))
                else:
                    self._copies.append((src, dst))
            old.append(src)
            table[i] = dst
        gpu.release(old)  # ref counts were > 1: nothing is freed here
        new_ids.extend(fresh)
        req.change_start = cow[0] if req.change_start is None else min(req.change_start, cow[0])
    if need:
        fresh = gpu.take(need)
        table.extend(fresh)
        new_ids.extend(fresh)
        if req.change_start is None:
            req.change_start = num_old_blocks
    req.num_tokens = num_tokens
    if self.enable_prefix_caching or req.intent is not None:
        self._note_full_blocks(request_id, req, token_ids)
    self._debug_check()
    return new_ids


def allocate_decode(self: KVCacheManager, request_id: str,
                    token_ids: Sequence[int]) -> tuple[int, list[int], int] | None:
    """`allocate(request_id, token_ids, 1)` of a running request, then its
    `take_decode_entry` at the position allocated, in one call: (table change start, the
    changed ids, the slot), or None when the device is short of blocks (no trace). The
    scheduler's path for a sample computing one token (a decode)."""
    req = self._reqs.get(request_id)
    if req is not None and req.on_gpu:
        pos = req.num_tokens
        bs = self.block_size
        table = req.block_ids
        i = pos // bs
        if i < len(table) and self.gpu.blocks[table[i]].ref_cnt == 1:
            # The steady decode (most calls): its slot is in its last block, which it alone
            # holds -- no block to take, nothing to copy; `allocate` gives the same.
            req.num_tokens = pos + 1
            if self.enable_prefix_caching or req.intent is not None:
                self._note_full_blocks(request_id, req, token_ids)
            self._debug_check()
            slot = table[i] * bs + pos % bs
            start = req.change_start
            if start is None:
                return len(table), [], slot
            req.change_start = None
            return start, table[start:], slot
    elif req is None:
        raise InvariantError("allocate_decode of a request not admitted", (request_id,))
    else:
        pos = req.num_tokens  # (swapped out: allocate raises)
    if allocate(self, request_id, token_ids, 1) is None:
        return None
    return take_decode_entry(self, request_id, pos)


# Far past any position: a request whose blocks are never registered (prefix caching off).
NEVER = 1 << 62


def steady_decode_state(self: KVCacheManager, request_id: str,
                        token_ids: Sequence[int]) -> tuple:
    """What the scheduler's decode lane (router/decode_lane.py) needs to give the request
    its next decodes without calling `allocate_decode` while they stay steady:
    (state, num_tokens, slot_base, block_end, table_len, register_at). Position p <
    block_end has slot `slot_base + p`: it lies in the table's block that holds
    num_tokens, which the request alone holds (a write needs no copy). `register_at`:
    once num_tokens + 1 or the known tokens (`token_ids`) reach it, a block fills and
    registers in the prefix cache (`_note_full_blocks`). A request whose next decode is
    not steady (its slot needs a new block, its last block is shared, a table change or
    an intent waits, it is swapped out, or `token_ids` is not the list it registers
    from) gets block_end 0: `allocate_decode` serves it."""
    req = self._reqs.get(request_id)
    if req is None or not req.on_gpu:
        return (req, 0, 0, 0, 0, 0)
    pos = req.num_tokens
    bs = self.block_size
    table = req.block_ids
    b = pos // bs
    if b >= len(table) or req.change_start is not None or req.intent is not None \
            or self.gpu.blocks[table[b]].ref_cnt != 1 \
            or (self.enable_prefix_caching and req.token_ids is not token_ids):
        return (req, pos, 0, 0, len(table), 0)
    register_at = (req.num_cached_blocks + 1) * bs if self.enable_prefix_caching else NEVER
    return (req, pos, (table[b] - b) * bs, (b + 1) * bs, len(table), register_at)


def advance_steady_decodes(self: KVCacheManager, states: Iterable[RequestState],
                           num_tokens: Iterable[int]) -> None:
    """The decode lane gave these requests (`steady_decode_state`'s states) one slot
    each: their slot counts become `num_tokens` (each one more than before; the slots
    lie in blocks they hold alone, and no block filled, so nothing else changes)."""
    for req, n in zip(states, num_tokens, strict=True):
        req.num_tokens = n
    self._debug_check()


def extend_steady_tables(self: KVCacheManager, states: list[RequestState]) -> list[int]:
    """The decode lane's requests whose next slot opens a block past their table's end:
    one block each from the free queue, in the order given (as `allocate` of one token
    each in that order would take them; the caller checked they fit). Appended to their
    tables; the lane sends each as its row's table change (no `change_start`)."""
    new_ids = self.gpu.take(len(states))
    for req, bid in zip(states, new_ids, strict=True):
        req.block_ids.append(bid)
    return new_ids


def note_steady_fills(self: KVCacheManager, request_ids: list[str],
                      states: list[RequestState]) -> None:
    """Requests the decode lane just advanced whose newest slot or token completed a
    block (`register_at` reached): the block registers as after `allocate_decode`
    (at end_step inside a step)."""
    for rid, req in zip(request_ids, states, strict=True):
        self._note_full_blocks(rid, req, req.token_ids)
    self._debug_check()


def _admit(self: KVCacheManager, request_id, token_ids, num_new_tokens, hit, block_hashes,
           cache_salt, lookahead):
    bs = self.block_size
    gpu = self.gpu
    pinned = self._pins.get(request_id)
    if pinned is not None:
        hit = pinned
    elif hit is None or not len(hit):
        hit = EMPTY_HIT
    elif not self._is_valid(hit):
        raise InvariantError("stale prefix hit: lookup and allocate in one go, or pin",
                             (request_id,))
    hit_ids = hit.block_ids
    num_tokens = hit.num_tokens + num_new_tokens
    need = cdiv(num_tokens + lookahead, bs) - len(hit_ids)
    if need < 0:
        need = 0
    from_queue = 0
    if pinned is None:
        blocks = gpu.blocks
        for bid in hit_ids:
            b = blocks[bid]
            if b.ref_cnt == 0 and b.prev_free is not None:
                from_queue += 1
    if need + from_queue > gpu.num_free - self.watermark_blocks:
        return None
    if pinned is None:
        gpu.touch(hit_ids)  # first, so that take() cannot evict them
    else:  # the pin's references become the request's: no window for eviction
        del self._pins[request_id]
        self._num_pinned -= len(hit_ids)
    blocks = gpu.blocks
    for bid in hit_ids:  # shared now: what evicting it would cost (routing's memory term)
        blocks[bid].num_hits += 1
    new_ids = gpu.take(need) if need else []
    table = list(hit_ids)
    table.extend(new_ids)
    if block_hashes is None:
        block_hashes = []
    req = RequestState(table, num_tokens, block_hashes, cache_salt)
    req.num_cached_blocks = len(hit_ids)
    if hit_ids:
        req.chain_serial = hit.serials[-1]
    if hit.host_block_ids:  # the rest of the hit comes back from the host (offload.py)
        self.admit_host_hit(req, hit.host_block_ids, new_ids[:len(hit.host_block_ids)])
    self._reqs[request_id] = req
    self.prefix_query_tokens += len(token_ids)
    self.prefix_hit_tokens += hit.num_tokens
    # Intended prefixes (intents.py): from now on the request intends exactly the blocks it
    # computes, those past its hit (some may have been evicted since it intended them); a
    # chunked prefill without an intent intends its later chunks.
    intent = self._intents.get(request_id)
    if intent is not None:
        self._add_intent(request_id, intent.token_ids, block_hashes, cache_salt, intent.order,
                         len(hit_ids))
    elif num_tokens < len(token_ids) and self.enable_prefix_caching:
        self._add_intent(request_id, token_ids, block_hashes, cache_salt, (), len(hit_ids))
    if self.enable_prefix_caching or req.intent is not None:
        self._note_full_blocks(request_id, req, token_ids)
    self._debug_check()
    return new_ids


def free(self: KVCacheManager, request_id: str) -> None:
    """Drop the request's blocks (tail first, so its last blocks are evicted first), any
    pin held under its id and its intent. Raises InvariantError for an id with none of
    them."""
    released = self._release_intent(request_id) if self._intents else False
    req = self._reqs.pop(request_id, None)
    self._dirty.pop(request_id, None)
    if req is None:
        if self.unpin(request_id) or released:
            self._debug_check()
            return
        raise InvariantError("free of an unknown request", (request_id,))
    if request_id in self._pins:
        self.unpin(request_id)
    pool = self.gpu if req.on_gpu else self.cpu
    try:
        pool.release(reversed(req.block_ids))
    except AssertionError as e:
        raise InvariantError(str(e), (request_id,)) from None
    if self.enable_offloading and req.on_gpu:
        self.note_freed(req.block_ids)
    self._debug_check()


def fork(self: KVCacheManager, parent_id: str, child_id: str) -> None:
    """The child shares every block of the parent (ref counts go up); the first write
    into a shared partial block copies it (see allocate). The child's table change
    starts at 0."""
    parent = self._reqs.get(parent_id)
    if parent is None:
        raise InvariantError("fork of an unknown request", (parent_id,))
    if child_id in self._reqs:
        raise InvariantError("fork into an existing request", (child_id,))
    pool = self.gpu if parent.on_gpu else self.cpu
    pool.touch(parent.block_ids)
    child = RequestState(
        list(parent.block_ids), parent.num_tokens, list(parent.block_hashes),
        parent.cache_salt,
    )
    child.num_cached_blocks = parent.num_cached_blocks
    child.chain_serial = parent.chain_serial
    child.on_gpu = parent.on_gpu
    self._reqs[child_id] = child
    self._debug_check()


# ------------------------------------------------------------------ plan data


def block_table(self: KVCacheManager, request_id: str) -> list[int]:
    """The request's block ids (a copy), on the device it is on."""
    return list(self._req(request_id).block_ids)


def request_ids(self: KVCacheManager) -> list[str]:
    return list(self._reqs)


def slot(self: KVCacheManager, request_id: str, pos: int) -> int:
    """The slot of one token position (no table copy: the plan builder's decode path)."""
    return self._req(request_id).block_ids[pos // self.block_size] * self.block_size \
        + pos % self.block_size


def num_blocks_needed(self: KVCacheManager, request_id: str, num_new_tokens: int) -> int:
    """Device blocks `allocate(request_id, ..., num_new_tokens)` would add (a running
    request's table growth, not counting copy-on-write replacements)."""
    req = self._req(request_id)
    bs = self.block_size
    return max(0, -(-(req.num_tokens + num_new_tokens) // bs) - len(req.block_ids))


def num_tokens(self: KVCacheManager, request_id: str) -> int:
    """Token positions of the request that have a slot (computed or scheduled)."""
    return self._req(request_id).num_tokens


def block_hashes(self: KVCacheManager, request_id: str) -> list:
    """The request's block-hash list (the manager's own, extended in place)."""
    return self._req(request_id).block_hashes


def is_swapped(self: KVCacheManager, request_id: str) -> bool:
    return not self._req(request_id).on_gpu


def has_request(self: KVCacheManager, request_id: str) -> bool:
    return request_id in self._reqs


def _req(self: KVCacheManager, request_id: str) -> RequestState:
    req = self._reqs.get(request_id)
    if req is None:
        raise InvariantError("unknown request", (request_id,))
    return req


def slot_mapping(self: KVCacheManager, request_id: str, start_pos: int,
                 num_tokens: int) -> np.ndarray:
    """Cache slots (block id * block_size + offset) of positions [start_pos,
    start_pos + num_tokens) of the request, as an int64 array."""
    req = self._req(request_id)
    bs = self.block_size
    if num_tokens <= 0:
        return np.empty(0, dtype=np.int64)
    end = start_pos + num_tokens
    if start_pos < 0 or end > len(req.block_ids) * bs:
        raise InvariantError(
            f"slot_mapping [{start_pos}, {end}) outside {len(req.block_ids)} blocks",
            (request_id,),
        )
    first = start_pos // bs
    ids = np.asarray(req.block_ids[first : cdiv(end, bs)], dtype=np.int64)
    pos = np.arange(start_pos, end, dtype=np.int64)
    return ids[pos // bs - first] * bs + pos % bs


def take_table_change(self: KVCacheManager, request_id: str) -> tuple[int, list[int]]:
    """(start, ids): table[start:] was replaced by `ids` since the last call (append:
    start == previous length; copy-on-write of the last block: start == len - 1; first
    allocation, fork child or swap-in: start 0). No change: (len(table), [])."""
    req = self._req(request_id)
    start = req.change_start
    if start is None:
        return len(req.block_ids), []
    req.change_start = None
    return start, req.block_ids[start:]


def take_decode_entry(self: KVCacheManager, request_id: str,
                      pos: int) -> tuple[int, list[int], int]:
    """`take_table_change(request_id)` plus `slot(request_id, pos)` in one call: the plan
    builder's path for a request computing one token (a decode)."""
    req = self._reqs.get(request_id)
    if req is None:
        raise InvariantError("unknown request", (request_id,))
    table = req.block_ids
    bs = self.block_size
    slot = table[pos // bs] * bs + pos % bs
    start = req.change_start
    if start is None:
        return len(table), [], slot
    req.change_start = None
    return start, table[start:], slot
