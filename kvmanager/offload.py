"""Offloading: a second tier of the prefix cache in the CPU pool (`--kv-offloading-size`).

A device holds the keys and values of few long conversations; the CPU memory beside it holds
many more. With offloading on, a prefix-cache block evicted from the device is not lost: its
copy in the CPU pool is swapped back in (a copy across the bus) when a later prompt
starts with it, instead of being computed again (a forward over its tokens).

Write-through on release. A full, registered device block whose last holder frees it (a
request finished, aborted, preempted by recompute or moved away) becomes evictable; it is
then a candidate (`note_freed`). When the next plan is built (`drain_offloads`, called by
`take_block_ops`), each candidate not on the host yet is copied into a CPU block: a
swap_out pair of that plan, which the executor runs before its forward, so a candidate
that this plan already hands out again (evicted to hold new tokens) is read before the
forward overwrites it. The copy is indexed in the CPU pool's prefix-cache map under the
same hash, tokens, parent and serial: one cache entry, in a second place. A candidate that
this plan names as a swap-in or copy destination is dropped (a plan never names a block as
both a source and a destination, DESIGN §2): that only happens when a freed block is
reused within one plan, i.e. when the device has almost nothing evictable left. A
candidate already on the host moves to the most recently used end of the host queue.

Host entries are ref-count-0 blocks in the CPU pool's free queue, evicted least recently
used first, by a new offload or by a swap-out of a preempted group: swap space comes
first, the host tier has what it leaves.

Host hits. `lookup` walks the device map, then continues in the host map from the first
block the device misses, verified by tokens and chain the same way (prefix._walk).
Admission (`admit_host_hit`) gives those blocks fresh device blocks, queues the swap-ins
(cpu -> device pairs of this plan) and registers the device blocks at once under the host
entries' serials (their contents are there before this plan's forward reads them), so the
chain stays one: a later host block still chains from them. The host blocks read are held
until the plan carrying the swap-ins is built, then freed like any block of a plan (not
handed out again until that plan is answered). A device block that registers with a hash
the host holds after the same parent, with the same tokens, takes the host entry's serial
(`host_serial`): the same tokens computed again are the same entry, so chains stay
continuous across the tiers.

Functions of the KVCacheManager (bound as its methods in manager.py; `self` is the manager).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from .block_pool import KVEvent
from .state import RequestState

if TYPE_CHECKING:
    from .manager import KVCacheManager


def note_freed(self: KVCacheManager, block_ids: Sequence[int]) -> None:
    """Device blocks just released (a request's table): the cached ones no request holds
    any more are candidates for the host (copied when the next plan is built), the last
    first, so a sequence's first blocks are the host's most recent and its least shareable
    ones go first (as the device's free queue orders them)."""
    blocks = self.gpu.blocks
    cands = self._offload_candidates
    for bid in reversed(block_ids):
        b = blocks[bid]
        if b.ref_cnt == 0 and b.serial >= 0:
            cands.append((bid, b.block_hash, b.token_ids, b.parent_serial, b.serial))


def drain_offloads(self: KVCacheManager) -> None:
    """Copy this plan's candidates to the host (swap_out pairs) and release the host blocks
    that this plan's swap-ins read (see the module docstring)."""
    cpu = self.cpu
    if self._host_reads:
        reads, self._host_reads = self._host_reads, []
        cpu.release(reads)
    cands = self._offload_candidates
    if not cands:
        return
    self._offload_candidates = []
    dsts = {g for _, g in self._swap_in}
    dsts.update(d for _, d in self._copies)
    cached = cpu.cached
    blocks = cpu.blocks
    seen: set[int] = set()
    for bid, h, toks, parent, serial in cands:
        if bid in seen:
            continue
        seen.add(bid)
        hb = cached.get(h)
        if hb is not None:
            if hb.serial == serial and hb.ref_cnt == 0 and hb.prev_free is not None:
                cpu.touch((hb.block_id,))  # on the host already: now the most recent
                cpu.release((hb.block_id,))
            continue  # (another entry under this hash: a collision keeps the older)
        if bid in dsts or cpu.num_free == 0:
            self.num_offloads_dropped += 1
            continue
        c = cpu.take(1)[0]
        b = blocks[c]
        b.block_hash = h
        b.token_ids = toks
        b.parent_serial = parent
        b.serial = serial
        cached[h] = b
        cpu.release((c,))
        self._swap_out.append((bid, c))
        self.num_offloaded_blocks += 1


def host_hit_valid(self: KVCacheManager, host_ids: Sequence[int],
                   serials: Sequence[int]) -> bool:
    blocks = self.cpu.blocks
    for bid, serial in zip(host_ids, serials, strict=True):
        b = blocks[bid]
        if b is None or b.serial != serial:
            return False
    return True


def admit_host_hit(self: KVCacheManager, req: RequestState, host_ids: Sequence[int],
                   device_ids: Sequence[int]) -> None:
    """Swap the host blocks of an admission's hit into `device_ids` (the request's table
    entries after its device hit) and register them under the host entries (see the module
    docstring). Sets the request's registration progress past them."""
    cpu_blocks = self.cpu.blocks
    gpu_blocks = self.gpu.blocks
    cached = self.gpu.cached
    events = self._events
    self.cpu.touch(host_ids)  # held until the plan carrying the swap-ins is built
    self._host_reads.extend(host_ids)
    chain = 0  # -1 once the chain breaks
    registered = 0
    for c, g in zip(host_ids, device_ids, strict=True):
        self._swap_in.append((c, g))
        if chain == -1:
            continue  # the chain broke on a collision: the rest stays out of the cache
        hb = cpu_blocks[c]
        h = hb.block_hash
        b = gpu_blocks[g]
        if cached.setdefault(h, b) is not b:  # the hash holds other tokens on the device
            chain = -1
            continue
        b.block_hash = h
        b.token_ids = hb.token_ids
        b.parent_serial = hb.parent_serial
        b.serial = chain = hb.serial
        b.num_hits = 1
        registered += 1
        if events is not None:
            events.append(KVEvent("stored", "gpu", h, g))
    req.num_cached_blocks += registered
    if registered or chain == -1:
        req.chain_serial = chain
    self.host_hit_tokens += len(host_ids) * self.block_size


def host_serial(self: KVCacheManager, block_hash: Hashable, parent: int,
                token_ids: tuple[int, ...]) -> int:
    """The serial of the host entry holding `token_ids` after `parent` under this hash;
    -1 when the host holds none."""
    hb = self.cpu.cached.get(block_hash)
    if hb is not None and hb.parent_serial == parent and hb.token_ids == token_ids:
        return hb.serial
    return -1
