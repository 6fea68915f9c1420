"""pagedserve.kvmanager: the router's paged KV-cache manager, one per executor.

Pure Python (+ numpy). The router owns every block table; this package decides which block
holds which token, shares prefix blocks between requests (prefix caching), shares a forked
request's blocks until one side writes (copy-on-write) and moves requests between the
device pool ("gpu") and the CPU swap pool. Modules: `block_pool` (Block, the intrusive free
queue, one pool per device), `hashing` (chained block hashes), `manager` (KVCacheManager: its
state and the step boundary; its other methods live along its seams in `prefix` (lookup,
pins, prefix registration), `intents` (intended prefixes: blocks live requests will
compute, visible before they are cached), `allocation`, `swap` and `accounting` (stats,
invariants), with the shared records in `state`).

Usage, per executor::

    mgr = KVCacheManager(num_gpu_blocks=4096, num_cpu_blocks=1024, block_size=16,
                         enable_prefix_caching=True, hash_algo="sha256", watermark=0.01,
                         max_pinned_fraction=0.25, debug_checks=False)
    # admission (routing may look up on every executor, then pin on the chosen one)
    hashes = mgr.hash_blocks(prompt_ids, cache_salt=salt)     # keep it with the request
    hit = mgr.lookup(prompt_ids, hashes, cache_salt=salt)     # .block_ids, .num_tokens
    hit = mgr.pin(req_id, hit)                                # may shorten it (pin cap)
    mgr.intend(req_id, prompt_ids, hashes, salt, order=key)   # its prefix, visible now
    more = mgr.intended_tokens(other_ids, other_hashes, salt, len(other_hit))  # past a hit
    # one step
    mgr.begin_step()                                          # before scheduling
    new = mgr.allocate(req_id, prompt_ids, len(prompt_ids) - hit.num_tokens,
                       hit=hit, block_hashes=hashes, cache_salt=salt)
    if new is None: ...                                       # short of blocks: preempt
    mgr.allocate(other_id, other_ids, 1)                      # a decode step (CoW inside)
    mgr.fork(req_id, child_id)                                # parallel sample
    slots = mgr.slot_mapping(req_id, start_pos, num_tokens)   # np.int64
    start, ids = mgr.take_table_change(req_id)                # table[start:] = ids
    ops = mgr.take_block_ops()                                # swap_out, swap_in, copy
    ...send the StepPlan...
    mgr.end_step()                                            # after the plan was sent
    mgr.free(req_id)                                          # finished / aborted

Rules the caller relies on:
- Out of blocks is a return value: `allocate`, `swap_out` and `swap_in` return None and
  change nothing. Caller bugs and broken invariants raise `InvariantError`.
- New admissions leave `watermark_blocks` device blocks free; running requests may use them.
- Step boundary: between `begin_step()` and `end_step()` a freed block is deferred, so one
  plan never hands a block out again after freeing it (no block is both a source and a
  destination in one plan). Outside a step, frees go straight to the free queue, unless
  plans are in flight (pipelined steps): `end_step(sent_step)` records each plan sent and
  `plan_answered(step)` each result; a block freed while plans are in flight is handed out
  again only once the newest of them has been answered (a plan in flight may name it).
  Blocks whose last filled slot holds a token the router has not received yet are not
  registered: registration reads only the tokens the caller's list holds.
- Prefix hits are verified by tokens and by chain, never trusted on the hash alone, and
  leave at least one token to compute. A block enters the prefix cache when the plan that
  computes it is sent (`end_step`; at once outside a step), so no plan reads a block that
  an earlier plan did not write, and a request preempted in the step it was scheduled
  registers nothing new (re-schedule its uncomputed slots with
  `allocate(..., num_computed_tokens=n)`). Swapped-out device blocks stay cached
  (evictable) with their contents intact; swapped-in blocks are fresh and re-register at
  the request's next allocate (chaining through the old entries when those still exist).
- Pins hold references (the blocks count as used); together at most
  `max_pinned_fraction` of the device blocks. Release them before preempting anything.
- Intents hold no block: they only make uncached blocks a live request will compute
  visible (`intended_tokens`). A block leaves the intended index when it registers; an
  intent is released when its request is scheduled through its end, freed, swapped out or
  `drop_intent` is called.
"""

from .block_pool import Block, BlockPool, KVEvent
from .hashing import builtin_block_hash, get_hash_fn, hash_blocks, sha256_block_hash
from .manager import (
    EMPTY_HIT,
    BlockOps,
    DeviceStats,
    InvariantError,
    KVCacheManager,
    KVCacheStats,
    PrefixHit,
)

__all__ = [
    "EMPTY_HIT",
    "Block",
    "BlockOps",
    "BlockPool",
    "DeviceStats",
    "InvariantError",
    "KVCacheManager",
    "KVCacheStats",
    "KVEvent",
    "PrefixHit",
    "builtin_block_hash",
    "get_hash_fn",
    "hash_blocks",
    "sha256_block_hash",
]
