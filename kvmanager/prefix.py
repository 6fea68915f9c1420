"""Lookup and prefix registration: block hashes, the verified prefix lookup, pins, and the
registration of newly full blocks in the device prefix cache.

Functions of the KVCacheManager (bound as its methods in manager.py; `self` is the manager).
HOT PATH: `lookup` and `_note_full_blocks` run for every admission and allocation.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from typing import TYPE_CHECKING

from . import hashing
from .block_pool import KVEvent
from .state import EMPTY_HIT, PrefixHit, RequestState

if TYPE_CHECKING:
    from .manager import KVCacheManager


# ------------------------------------------------------------------ hashing and lookup


def hash_blocks(
    self: KVCacheManager,
    token_ids: Sequence[int],
    cache_salt: str | None = None,
    block_hashes: list | None = None,
) -> list:
    """Extend `block_hashes` (in place, or a new list) with the hashes of `token_ids`'s
    full blocks not hashed yet; returns the list. Keep it per request and pass it to
    `lookup`/`allocate`; it is extended as blocks fill. Empty when caching is off."""
    if block_hashes is None:
        block_hashes = []
    if not self.enable_prefix_caching:
        return block_hashes
    return hashing.hash_blocks(self.hash_fn, token_ids, self.block_size, cache_salt, block_hashes)


def _salt_root(self: KVCacheManager, cache_salt: str | None) -> int:
    if not cache_salt:
        return 0
    root = self._salt_roots.get(cache_salt)
    if root is None:
        self._serial += 1
        root = self._salt_roots[cache_salt] = self._serial
    return root


def lookup(
    self: KVCacheManager,
    token_ids: Sequence[int],
    block_hashes: Sequence[Hashable],
    cache_salt: str | None = None,
) -> PrefixHit:
    """The longest cached prefix of full blocks of `token_ids`, never the whole prompt.

    Walk the chain of block hashes in the device cache map and stop at the first miss
    (with offloading, go on in the host map from there: offload.py).
    Each hit is confirmed, not trusted: the block must hold exactly this block's tokens
    and must have been registered after the block just matched (its `parent_serial`
    equals that block's `serial`, or the salt's root for the first block), so a hash
    collision can only end the walk early. At most (len(token_ids) - 1) // block_size
    blocks match, so at least one token is always left to compute. Takes no references
    and records no stats (pin the hit, or allocate at once)."""
    if not self.enable_prefix_caching:
        return EMPTY_HIT
    bs = self.block_size
    max_blocks = min((len(token_ids) - 1) // bs, len(block_hashes))
    if max_blocks <= 0:
        return EMPTY_HIT
    expect = self._salt_root(cache_salt) if cache_salt else 0
    ids, serials, expect = _walk(self.gpu.cached, bs, token_ids, block_hashes, 0, max_blocks,
                                 expect)
    if self.host_tier and len(ids) < max_blocks:  # on in the host's map (offload.py)
        host_ids, host_serials, _ = _walk(self.cpu.cached, bs, token_ids, block_hashes,
                                          len(ids), max_blocks, expect)
        if host_ids:
            return PrefixHit(tuple(ids), (len(ids) + len(host_ids)) * bs, tuple(serials),
                             tuple(host_ids), tuple(host_serials))
    if not ids:
        return EMPTY_HIT
    return PrefixHit(tuple(ids), len(ids) * bs, tuple(serials))


def _walk(cached: dict, bs: int, token_ids: Sequence[int], block_hashes: Sequence[Hashable],
          start: int, max_blocks: int, expect: int) -> tuple[list[int], list[int], int]:
    """Blocks [start, max_blocks) of `token_ids` in one pool's cache map, chaining from the
    entry of serial `expect`, until the first miss: (ids, serials, the last serial)."""
    ids: list[int] = []
    serials: list[int] = []
    for i in range(start, max_blocks):
        b = cached.get(block_hashes[i])
        if (
            b is None
            or b.parent_serial != expect
            or b.token_ids != tuple(token_ids[i * bs : (i + 1) * bs])
        ):
            break
        ids.append(b.block_id)
        expect = b.serial
        serials.append(expect)
    return ids, serials, expect


def _is_valid(self: KVCacheManager, hit: PrefixHit) -> bool:
    blocks = self.gpu.blocks
    for bid, serial in zip(hit.block_ids, hit.serials, strict=True):
        b = blocks[bid]
        if b is None or b.serial != serial:
            return False
    return not hit.host_block_ids or self.host_hit_valid(hit.host_block_ids, hit.host_serials)


def num_shared_blocks_evicted(self: KVCacheManager, num_blocks: int,
                              keep: Collection[int] = ()) -> int:
    """How many blocks that other requests have hit (`Block.num_hits` > 0: a prefix live
    requests share, which they would miss) are among the cached blocks that taking
    `num_blocks` blocks now would evict: the never-used blocks go first, then the free
    queue from its head (least recently freed first). Blocks in `keep` (the asking request's
    own hit, which its admission takes out of the queue first) are passed over. With
    offloading, a block the host holds (the same entry) is not lost: not counted.
    O(num_blocks)."""
    gpu = self.gpu
    n = num_blocks - (gpu.num_blocks - gpu.fresh_next)
    count = 0
    blocks = gpu.blocks
    bid = gpu.head.next_free
    tail = gpu.tail_id
    host = self.cpu.cached if self.host_tier else None
    while n > 0 and bid != tail:
        b = blocks[bid]
        if bid not in keep:
            if b.num_hits and b.block_hash is not None:
                kept = host.get(b.block_hash) if host is not None else None
                if kept is None or kept.serial != b.serial:
                    count += 1
            n -= 1
        bid = b.next_free
    return count


# ------------------------------------------------------------------ pins


def pin(self: KVCacheManager, key: Hashable, hit: PrefixHit) -> PrefixHit:
    """Hold a reference on the blocks of `hit` under `key` (the request id) so they
    cannot be evicted before the request is allocated. Pins together hold at most
    `max_pinned_blocks` blocks: over the cap only the first blocks that fit are pinned.
    Returns the pinned hit (possibly shorter, possibly empty: len(result) == 0). A stale
    hit (a block evicted since the lookup) pins only its still-valid prefix. Pinning a
    key again replaces its pin. `allocate(key, ...)` converts the pin into the request's
    references; `unpin`, `release_pins` or `free(key)` drop it."""
    if key in self._pins:
        self.unpin(key)
    k = self._valid_until(hit, 0, min(len(hit.block_ids),
                                      self.max_pinned_blocks - self._num_pinned))
    if k == 0:
        return EMPTY_HIT
    pinned = PrefixHit(hit.block_ids[:k], k * self.block_size, hit.serials[:k])
    self.gpu.touch(pinned.block_ids)
    self._pins[key] = pinned
    self._num_pinned += k
    self._debug_check()
    return pinned


def _valid_until(self: KVCacheManager, hit: PrefixHit, start: int, stop: int) -> int:
    """The first of `hit`'s device blocks `start` ... `stop - 1` evicted and reused since
    the lookup (its serial changed), or `stop`: the hit is valid up to there."""
    blocks = self.gpu.blocks
    k = start
    while k < stop:
        b = blocks[hit.block_ids[k]]
        if b is None or b.serial != hit.serials[k]:
            break
        k += 1
    return k


def unpin(self: KVCacheManager, key: Hashable) -> bool:
    """Drop the pin held under `key`; False when there is none."""
    pinned = self._pins.pop(key, None)
    if pinned is None:
        return False
    self._num_pinned -= len(pinned.block_ids)
    self.gpu.release(reversed(pinned.block_ids))
    self._debug_check()
    return True


def release_pins(self: KVCacheManager) -> int:
    """Drop every pin (call before preempting a running request); returns the number of
    blocks unpinned."""
    n = self._num_pinned
    for key in list(self._pins):
        self.unpin(key)
    return n


def pinned(self: KVCacheManager, key: Hashable) -> PrefixHit | None:
    return self._pins.get(key)


# ------------------------------------------------------------------ registration


def _note_full_blocks(self: KVCacheManager, request_id: str, req: RequestState,
                      token_ids: Sequence[int]) -> None:
    """Register blocks the request just filled: at end_step() inside a step (so a plan
    never reads a block an earlier plan did not write), at once outside one. Only a block
    that filled up has anything to register (most decodes do not), and only an intent
    scheduled through its end has anything to release."""
    req.token_ids = token_ids
    intent = req.intent
    # A block registers once its tokens are both scheduled and known (a pipelined decode
    # schedules a slot for a token still being sampled: its block waits a step).
    known = req.num_tokens
    if len(token_ids) < known:
        known = len(token_ids)
    if (self.enable_prefix_caching and known // self.block_size > req.num_cached_blocks) \
            or (intent is not None and req.num_tokens >= intent.num_tokens):
        if self._in_step:
            self._dirty[request_id] = None
        else:
            self._register(request_id, req)


def _register(self: KVCacheManager, request_id: str, req: RequestState) -> None:
    """The plan computing the request's new slots is sent (or no step is being built): its
    full blocks enter the prefix cache, and its intent, once scheduled through its end, is
    released (intents.py)."""
    if self.enable_prefix_caching:
        self._cache_full_blocks(req, req.token_ids)
    intent = req.intent
    if intent is not None and req.num_tokens >= intent.num_tokens:
        self._release_intent(request_id)


def _cache_full_blocks(self: KVCacheManager, req: RequestState, token_ids: Sequence[int]) -> None:
    """Register the request's newly full blocks in the device prefix cache.

    Block i is registered under the request's i-th block hash with a new serial and its
    parent's serial (block i-1's, or the salt root). When the hash already maps to a
    block with the same tokens after the same parent (the same tokens computed twice),
    that entry stands in as the parent of block i+1; on a collision the rest of the
    request stays out of the cache."""
    bs = self.block_size
    num_tokens = req.num_tokens
    if len(token_ids) < num_tokens:
        num_tokens = len(token_ids)
    num_full = num_tokens // bs
    start = req.num_cached_blocks
    if num_full <= start:
        return
    hashes = req.block_hashes
    if len(hashes) < num_full:
        hashing.hash_blocks(self.hash_fn, token_ids, bs, req.cache_salt, hashes, num_full * bs)
    blocks = self.gpu.blocks
    cached = self.gpu.cached
    table = req.block_ids
    events = self._events
    intended = self._intended  # a registered hash is no longer intended (intents.py)
    parent = self._salt_root(req.cache_salt) if start == 0 else req.chain_serial
    serial = self._serial
    setdefault = cached.setdefault
    host_tier = self.host_tier
    lo = start * bs
    for i in range(start, num_full):
        hi = lo + bs
        b = blocks[table[i]]
        if b.serial >= 0:  # already registered (a prefix hit, or by a fork's parent)
            parent = b.serial
            lo = hi
            continue
        if parent < 0:
            break
        h = hashes[i]
        toks = tuple(token_ids[lo:hi])
        lo = hi
        other = setdefault(h, b)
        if other is not b:
            # Another block holds these tokens after the same chain (computed twice,
            # e.g. after a swap-in): chain on from it. A collision ends the walk.
            if other.parent_serial == parent and other.token_ids == toks:
                parent = other.serial
                if intended and h in intended:
                    self._park_registered(h)
                continue
            parent = -1
            break
        b.block_hash = h
        b.token_ids = toks
        b.parent_serial = parent
        same = self.host_serial(h, parent, toks) if host_tier else -1
        if same >= 0:  # the host holds this entry (offload.py): it is the same one
            b.serial = parent = same
        else:
            serial += 1
            b.serial = parent = serial
        if intended and h in intended:
            self._park_registered(h)
        if events is not None:
            events.append(KVEvent("stored", "gpu", h, b.block_id))
    self._serial = serial
    req.num_cached_blocks = num_full
    req.chain_serial = parent


# ------------------------------------------------------------------ reset


def reset_prefix_cache(self: KVCacheManager) -> int:
    """Forget every cached prefix that no request holds: the pins are released, then each
    device block at ref count 0 (queued, deferred or fenced) and each host block (offload.py)
    leaves its pool's prefix-cache map, and the candidates not yet offloaded are dropped. A
    block a request still holds stays cached (its request goes on reading it). Returns how
    many blocks stayed cached for that reason: 0 means a later lookup finds nothing that
    was cached before the call (after a weight update, no KV of the old weights).

    Not the hot path: O(cached blocks), for vLLM's /reset_prefix_cache, SGLang's
    /flush_cache and weight updates (router/weight_sync.py)."""
    self.release_pins()
    self._offload_candidates = []
    kept = 0
    for pool in (self.gpu, self.cpu):
        events = self._events if pool is self.gpu else None
        for h, b in list(pool.cached.items()):
            if b.ref_cnt > 0:
                kept += 1
                continue
            del pool.cached[h]
            if events is not None:
                events.append(KVEvent("removed", pool.device, h, b.block_id))
            b.block_hash = b.token_ids = None
            b.serial = b.parent_serial = -1
            b.num_hits = 0
            pool.num_evictions += 1
    self._debug_check()
    return kept
