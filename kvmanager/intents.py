"""Intended prefixes: blocks that requests living on this executor will compute but that are
not in the prefix cache yet.

The prefix cache shows a block once the plan computing it is sent. Until then three kinds of
work are invisible to a lookup: a request routed here and still waiting (it holds only a pin
on what was cached), a request admitted in the plan being built (its blocks register at
`end_step`), and the later chunks of a prompt prefilled in chunks. An *intent* makes them
visible, exactly: `intend(request_id, token_ids, ...)` records the request's full blocks
that are not cached (by block hash, in an index shared by every intent), and
`intended_tokens(...)` extends a prefix hit through blocks that live requests intend.

An intended block leaves the index when its hash registers in the prefix cache (from then on
`lookup` finds it; a collision with other tokens does not count). Its intenders are parked
under the hash: if the block is evicted before they compute it, `end_step` indexes them
again (a request that waits while the block that another computed for it is evicted would
otherwise be invisible to routing until its admission). A whole intent is released
when its request has been scheduled through its last intended token (its blocks then
register as today, at `end_step`), and when the request is freed (finished, aborted,
preempted by recompute, migrated), swapped out, or `drop_intent` is called. An intent holds
no block: it changes what routing and the scheduler see, never what a plan reads (a request
that waited for intended blocks is admitted with an ordinary, verified `lookup`).

Order: each intent carries the caller's `order` key (the scheduler's (priority, arrival)).
`intended_tokens(..., before=key)` counts only intenders that will compute their blocks
before a request of that key could: admitted requests (running on the device: they are
scheduled before any admission), and waiting ones whose key is smaller.

Matches are verified by tokens, not trusted on the hash: an intender counts for block i only
when its first (i + 1) blocks hold this prompt's tokens under the same salt.

Functions of the KVCacheManager (bound as its methods in manager.py; `self` is the manager).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from .state import InvariantError

if TYPE_CHECKING:
    from .manager import KVCacheManager


class Intent:
    """One request's intended blocks: `hashes` were indexed at `intend` time (blocks
    [first_block, first_block + len(hashes)) of `token_ids`); `num_tokens` is where the
    intent ends (tokens the request will have computed when it is released) and
    `num_tail_tokens` the part of them no full uncached block covers (a last partial block,
    or everything when prefix caching is off): counted as queued work, never shared."""

    __slots__ = ("token_ids", "cache_salt", "order", "hashes", "first_block", "num_tokens",
                 "num_tail_tokens")

    def __init__(self, token_ids, cache_salt, order, hashes, first_block, num_tokens,
                 num_tail_tokens) -> None:
        self.token_ids: Sequence[int] = token_ids  # the caller's list (a reference)
        self.cache_salt: str | None = cache_salt
        self.order = order
        self.hashes: list[Hashable] = hashes
        self.first_block: int = first_block
        self.num_tokens: int = num_tokens
        self.num_tail_tokens: int = num_tail_tokens


def intend(
    self: KVCacheManager,
    request_id: str,
    token_ids: Sequence[int],
    block_hashes: list | None = None,
    cache_salt: str | None = None,
    order: tuple = (),
) -> int:
    """Record that `request_id` will compute `token_ids` here (replacing its previous
    intent). Its full blocks past the cached prefix (`lookup`) enter the intended index;
    `block_hashes` (the request's list) is extended in place first. Returns the tokens it
    intends (uncached: its intended blocks and its tail)."""
    if block_hashes is None:
        block_hashes = []
    self.hash_blocks(token_ids, cache_salt, block_hashes)
    first = len(self.lookup(token_ids, block_hashes, cache_salt))
    return self._add_intent(request_id, token_ids, block_hashes, cache_salt, order, first)


def _add_intent(self: KVCacheManager, request_id: str, token_ids: Sequence[int],
                block_hashes: list, cache_salt: str | None, order: tuple,
                first_block: int) -> int:
    self._release_intent(request_id)
    bs = self.block_size
    num_tokens = len(token_ids)
    num_full = min(num_tokens // bs, len(block_hashes)) if self.enable_prefix_caching else 0
    if first_block > num_full:
        first_block = num_full
    hashes = block_hashes[first_block:num_full]
    index = self._intended
    for h in hashes:
        rids = index.get(h)
        if rids is None:
            index[h] = [request_id]
        else:
            rids.append(request_id)
    self._num_intent_entries += len(hashes)
    tail = num_tokens - num_full * bs
    self._num_intent_tail_tokens += tail
    intent = Intent(token_ids, cache_salt or None, order, hashes, first_block, num_tokens, tail)
    self._intents[request_id] = intent
    req = self._reqs.get(request_id)
    if req is not None:
        req.intent = intent
    return len(hashes) * bs + tail


def drop_intent(self: KVCacheManager, request_id: str) -> bool:
    """Release the request's intent; False when it has none."""
    released = self._release_intent(request_id)
    if released:
        self._debug_check()
    return released


def _release_intent(self: KVCacheManager, request_id: str) -> bool:
    intent = self._intents.pop(request_id, None)
    if intent is None:
        return False
    index = self._intended
    parked = self._parked
    removed = 0
    for h in intent.hashes:
        rids = index.get(h)
        if rids is not None and request_id in rids:
            rids.remove(request_id)
            removed += 1
            if not rids:
                del index[h]
            continue
        parked_rids = parked.get(h)  # registered since (the hash left the index)
        if parked_rids is not None and request_id in parked_rids:
            del parked_rids[request_id]
            if not parked_rids:
                del parked[h]
    self._num_intent_entries -= removed
    self._num_intent_tail_tokens -= intent.num_tail_tokens
    req = self._reqs.get(request_id)
    if req is not None:
        req.intent = None
    return True


def _park_registered(self: KVCacheManager, block_hash: Hashable) -> None:
    """A block registered under `block_hash`: it is cached now, no longer intended; its
    intenders wait in `_parked` in case it is evicted before they compute it."""
    rids = self._intended.pop(block_hash)
    self._num_intent_entries -= len(rids)
    self._parked.setdefault(block_hash, {}).update(dict.fromkeys(rids))


def _reindex_evicted(self: KVCacheManager) -> None:
    """Parked hashes no longer in the prefix cache go back into the intended index."""
    cached = self.gpu.cached
    index = self._intended
    for h in [h for h in self._parked if h not in cached]:
        rids = self._parked.pop(h)
        index.setdefault(h, []).extend(rids)
        self._num_intent_entries += len(rids)
    self._parked_evictions = self.gpu.num_evictions


def intended_tokens(
    self: KVCacheManager,
    token_ids: Sequence[int],
    block_hashes: Sequence[Hashable],
    cache_salt: str | None = None,
    start_block: int = 0,
    *,
    before: tuple | None = None,
    exclude: str | None = None,
) -> int:
    """Tokens of `token_ids` past its first `start_block` blocks (pass the length of its
    `lookup` hit) that requests here intend to compute, block by block until the first
    block nobody intends. With `before`, only intenders that compute before a request of
    that order key count (admitted ones, and waiting ones of a smaller key); `exclude`
    skips the asking request's own intent. Like `lookup`, at most (len(token_ids) - 1) //
    block_size blocks count."""
    index = self._intended
    if not index:
        return 0
    bs = self.block_size
    max_blocks = min((len(token_ids) - 1) // bs, len(block_hashes))
    salt = cache_salt or None
    intents = self._intents
    reqs = self._reqs
    cur = None  # the intender verified through the previous block
    i = start_block
    while i < max_blocks:
        rids = index.get(block_hashes[i])
        if not rids:
            break
        lo, hi = i * bs, (i + 1) * bs
        found = None
        if cur is not None and cur in rids and \
                tuple(intents[cur].token_ids[lo:hi]) == tuple(token_ids[lo:hi]):
            found = cur
        else:
            want = tuple(token_ids[:hi])
            for rid in rids:
                if rid in (exclude, cur):
                    continue
                intent = intents[rid]
                if intent.cache_salt != salt:
                    continue
                if before is not None and not intent.order < before:
                    req = reqs.get(rid)
                    if req is None or not req.on_gpu:
                        continue
                if tuple(intent.token_ids[:hi]) == want:
                    found = rid
                    break
        if found is None:
            break
        cur = found
        i += 1
    return (i - start_block) * bs


def intent_ids(self: KVCacheManager) -> list[str]:
    """Ids of the requests holding an intent."""
    return list(self._intents)


def has_intent(self: KVCacheManager, request_id: str) -> bool:
    return request_id in self._intents


@property
def num_intended_tokens(self: KVCacheManager) -> int:
    """Tokens live requests here intend to compute that are not cached: each intended block
    counted once however many requests intend it, plus every intent's tail."""
    return len(self._intended) * self.block_size + self._num_intent_tail_tokens


def check_intents(self: KVCacheManager) -> None:
    """The intended index is exactly what the live intents left in it, counts agree, and an
    admitted request's record points at its intent."""
    entries = 0
    for h, rids in self._intended.items():
        if not rids:
            raise InvariantError("empty intended-index entry")
        for rid in rids:
            intent = self._intents.get(rid)
            if intent is None:
                raise InvariantError("intended block of a request without an intent", (rid,))
            if h not in intent.hashes:
                raise InvariantError("intended block not in its request's intent", (rid,))
        entries += len(rids)
    if entries != self._num_intent_entries:
        raise InvariantError(f"intent entries {self._num_intent_entries} != indexed {entries}")
    for h, rids in self._parked.items():
        if not rids:
            raise InvariantError("empty parked entry")
        for rid in rids:
            intent = self._intents.get(rid)
            if intent is None or h not in intent.hashes:
                raise InvariantError("parked block not in a live intent", (rid,))
            if rid in self._intended.get(h, ()):
                raise InvariantError("block both intended and parked", (rid,))
    tails = sum(i.num_tail_tokens for i in self._intents.values())
    if tails != self._num_intent_tail_tokens:
        raise InvariantError("intent tail tokens drifted")
    for rid, req in self._reqs.items():
        if req.intent is not self._intents.get(rid) and req.intent is not None:
            raise InvariantError("request points at a released intent", (rid,))
        if req.intent is None and rid in self._intents:
            raise InvariantError("admitted request lost track of its intent", (rid,))
