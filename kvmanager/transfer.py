"""KV blocks received from another executor (prefill/decode disaggregation,
router/handoff.py): they enter this cache's host tier, so the request that brings them
finds them as a prefix-cache hit when it is admitted here.

A prefill executor computes a prompt's blocks; its plan exports their bytes, the router
takes them from its result and gives them to the decode executor's next plan. Here
(`import_blocks`) each received block takes a CPU block and becomes an entry of the CPU
pool's prefix-cache map, the host tier that offloading also fills (offload.py): the same
hash, tokens and chain as a block this cache computed itself, chained on after the blocks
it already holds of that prompt (device or host). Admission then swaps them in like any
host hit (`admit_host_hit`): one mechanism for both, and a received prefix that is never
used is evicted like any other host entry (least recently used first).

Blocks the cache already holds are not taken again; a received block whose chain does not
reach what the cache holds (it evicted the blocks before it meanwhile) is not taken at
all: the request computes what it misses. Every shortfall costs recomputation only.

The plan carrying the bytes must go out before any plan that could swap them in: the
router attaches every block imported since its last plan to the next one, and the
executor writes them before that plan's swaps (DESIGN §2's order, imports first).

Export holds (`hold_export`, `release_export`): the device blocks a plan of this executor
exports for another executor's request (a prefix pull, router/prefix_pull.py) hold a
reference until that plan is answered, so nothing evicts and overwrites them before the
executor reads them. Unlike pins, holds are not given up under memory pressure: a pull's
blocks are read by the next plan, and the hold ends with its result.

Functions of the KVCacheManager (bound as its methods in manager.py; `self` is the manager).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from .prefix import _walk
from .state import PrefixHit

if TYPE_CHECKING:
    from .manager import KVCacheManager


def import_blocks(self: KVCacheManager, token_ids: Sequence[int], block_hashes: list,
                  cache_salt: str | None, first: int, count: int) -> tuple[int, list[int]]:
    """Blocks `first` ... `first + count - 1` of `token_ids` (full blocks, computed by
    another executor) enter the host tier. Returns (skip, cpu_ids): received block
    `first + skip + k` goes into CPU block `cpu_ids[k]` (the executor writes it there in
    the next plan); blocks this cache holds already and blocks it has no room or no chain
    for are left out (an empty list: none taken)."""
    if count <= 0 or not self.enable_prefix_caching or self.cpu.num_blocks == 0:
        return 0, []
    self.host_tier = True  # lookups continue in the CPU pool's map from now on
    bs = self.block_size
    end = first + count
    if len(token_ids) < end * bs:
        raise ValueError(f"blocks up to {end} of {len(token_ids)} tokens")
    if len(block_hashes) < end:
        self.hash_blocks(token_ids, cache_salt, block_hashes)
    expect = self._salt_root(cache_salt) if cache_salt else 0
    ids, _, expect = _walk(self.gpu.cached, bs, token_ids, block_hashes, 0, end, expect)
    host_ids, _, expect = _walk(self.cpu.cached, bs, token_ids, block_hashes, len(ids), end,
                                expect)
    held = len(ids) + len(host_ids)
    if held < first:
        return 0, []  # the chain breaks before the received blocks: they cannot join it
    cpu = self.cpu
    cpu.touch(host_ids)  # the chain it extends is not evicted for room
    try:
        n = min(end - held, cpu.num_free)
        taken = cpu.take(n) if n > 0 else []
    finally:
        cpu.release(host_ids)
    cached = cpu.cached
    blocks = cpu.blocks
    kept: list[int] = []
    serial = self._serial
    for k, c in enumerate(taken):
        i = held + k
        h: Hashable = block_hashes[i]
        if h in cached:  # the hash holds other tokens or another chain here: stop
            break
        b = blocks[c]
        b.block_hash = h
        b.token_ids = tuple(token_ids[i * bs:(i + 1) * bs])
        b.parent_serial = expect
        serial += 1
        b.serial = expect = serial
        cached[h] = b
        kept.append(c)
    self._serial = serial
    # Last first, as a freed sequence: a received prefix's head is its most recent entry
    cpu.release(reversed(kept))
    cpu.release(reversed(taken[len(kept):]))
    self.num_imported_blocks += len(kept)
    return held - first, kept


def hold_export(self: KVCacheManager, key: Hashable, hit: PrefixHit, first: int) -> tuple[int, ...]:
    """Hold a reference on the device blocks of `hit` from block `first` on, for a plan
    that exports them (see the module docstring), under `key`. Only the blocks still
    valid are held (a stale hit: those before the first block evicted since the lookup).
    Returns the ids held (empty: none). Holding a key again replaces its hold."""
    if key in self._holds:
        self.release_export(key)
    ids = hit.block_ids[first:self._valid_until(hit, first, len(hit.block_ids))]
    if ids:
        self.gpu.touch(ids)
        self._holds[key] = ids
    self._debug_check()
    return ids


def release_export(self: KVCacheManager, key: Hashable) -> bool:
    """End the hold under `key` (its plan was answered, or the pull was given up); False
    when there is none. The blocks stay cached."""
    ids = self._holds.pop(key, None)
    if ids is None:
        return False
    self.gpu.release(reversed(ids))
    self._debug_check()
    return True
