"""Accounting and invariants: KV events, stats, the blocks the owner can account for, and
`check_invariants` (the whole state verified; O(blocks), never on the hot path).

Functions of the KVCacheManager (bound as its methods in manager.py; `self` is the manager).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .block_pool import BlockPool, KVEvent
from .state import DeviceStats, InvariantError, KVCacheStats

if TYPE_CHECKING:
    from .manager import KVCacheManager


def take_events(self: KVCacheManager) -> list[KVEvent]:
    """Drain the KV events ("stored"/"removed") recorded since the last call; [] unless
    the manager was created with enable_kv_events=True."""
    if self._events is None:
        return []
    out = list(self._events)
    self._events.clear()
    return out


def _device_stats(pool: BlockPool) -> DeviceStats:
    free = pool.num_free + len(pool.held_free_ids())
    total = pool.num_blocks
    return DeviceStats(
        num_total_blocks=total,
        num_free_blocks=free,
        num_cached_blocks=len(pool.cached),
        usage_ratio=(1.0 - free / total) if total else 0.0,
        num_evictions=pool.num_evictions,
    )


def stats(self: KVCacheManager) -> KVCacheStats:
    return KVCacheStats(
        gpu=self._device_stats(self.gpu),
        cpu=self._device_stats(self.cpu),
        prefix_query_tokens=self.prefix_query_tokens,
        prefix_hit_tokens=self.prefix_hit_tokens,
        num_pinned_blocks=self._num_pinned,
        num_requests=len(self._reqs),
        host_hit_tokens=self.host_hit_tokens,
        num_offloaded_blocks=self.num_offloaded_blocks,
        num_offloads_dropped=self.num_offloads_dropped,
    )


def held_gpu_blocks(self: KVCacheManager, request_ids) -> int:
    """Distinct device blocks held by these requests' tables, by all pins and by export
    holds (transfer.py): what the owner can account for. Device blocks in use beyond it
    are leaked."""
    held: set[int] = set()
    for rid in request_ids:
        req = self._reqs.get(rid)
        if req is not None and req.on_gpu:
            held.update(req.block_ids)
    for hit in self._pins.values():
        held.update(hit.block_ids)
    for ids in self._holds.values():
        held.update(ids)
    return len(held)


def _debug_check(self: KVCacheManager) -> None:
    if self.debug_checks:
        self.check_invariants()


def check_invariants(self: KVCacheManager) -> None:
    """Verify the whole state; raise InvariantError naming the requests involved.

    - every block's ref count equals its references from live block tables, pins and
      export holds (transfer.py);
    - the free queue holds exactly the ref-count-0 blocks not deferred (and its links
      and count agree), deferred blocks have ref count 0 or were touched since;
    - the prefix-cache map points only at blocks registered under that hash, holding a
      full block of tokens, and a request's registered block has the request's hash;
    - free + used = total on each device; a table lives on one device only;
    - a host prefix-cache block (offload.py) is held by no request, at most by a swap-in
      of the plan being built; without offloading or received blocks (transfer.py)
      the CPU pool caches nothing.
    """
    if not self.host_tier and (self.cpu.cached or self._host_reads):
        raise InvariantError("cpu blocks cached without offloading or received blocks")
    for pool, on_gpu in ((self.gpu, True), (self.cpu, False)):
        expected: dict[int, int] = {}
        holders: dict[int, list[str]] = {}
        for rid, req in self._reqs.items():
            if req.on_gpu != on_gpu:
                continue
            for i, bid in enumerate(req.block_ids):
                if not 0 <= bid < pool.num_blocks or pool.blocks[bid] is None:
                    raise InvariantError(f"{pool.device} block {bid} not a live block", (rid,))
                expected[bid] = expected.get(bid, 0) + 1
                holders.setdefault(bid, []).append(rid)
                b = pool.blocks[bid]
                if (on_gpu and b.block_hash is not None and i < len(req.block_hashes)
                        and req.block_hashes[i] != b.block_hash):
                    raise InvariantError(f"gpu block {bid} cached under another hash", (rid,))
            if req.num_tokens > len(req.block_ids) * self.block_size:
                raise InvariantError("num_tokens beyond the table", (rid,))
        if on_gpu:
            for key, hit in self._pins.items():
                for bid in hit.block_ids:
                    expected[bid] = expected.get(bid, 0) + 1
                    holders.setdefault(bid, []).append(f"pin:{key}")
            for key, ids in self._holds.items():
                for bid in ids:
                    expected[bid] = expected.get(bid, 0) + 1
                    holders.setdefault(bid, []).append(f"export:{key}")
        else:  # host blocks that this plan's swap-ins read (offload.py)
            for bid in self._host_reads:
                expected[bid] = expected.get(bid, 0) + 1
                holders.setdefault(bid, []).append("host read")
        in_queue: set[int] = set()
        prev = pool.head_id
        bid = pool.head.next_free
        while bid != pool.tail_id:
            if not 0 <= bid < pool.num_blocks:
                raise InvariantError(f"{pool.device} free queue links to {bid}")
            b = pool.blocks[bid]
            if b is None or b.prev_free != prev:
                raise InvariantError(f"{pool.device} free queue link broken at {bid}")
            if bid in in_queue:
                raise InvariantError(f"{pool.device} block {bid} twice in queue")
            in_queue.add(bid)
            prev, bid = bid, b.next_free
        if pool.tail.prev_free != prev:
            raise InvariantError(f"{pool.device} free queue tail link broken")
        num_fresh = pool.num_blocks - pool.fresh_next
        if len(in_queue) + num_fresh != pool.num_free:
            raise InvariantError(
                f"{pool.device} num_free {pool.num_free} != queue {len(in_queue) + num_fresh}"
            )
        deferred = {d.block_id for d in pool.deferred if d.ref_cnt == 0}
        for _, batch in pool.fenced:
            deferred.update(d.block_id for d in batch if d.ref_cnt == 0)
        used = 0
        for bid in range(pool.fresh_next):
            blk = pool.blocks[bid]
            if blk is None:
                raise InvariantError(f"{pool.device} block {bid} handed out but missing")
            want = expected.get(bid, 0)
            if blk.ref_cnt != want:
                raise InvariantError(
                    f"{pool.device} block {bid}: ref count {blk.ref_cnt}, referenced {want}",
                    holders.get(bid, ()),
                )
            if want:
                used += 1
                if bid in in_queue:
                    raise InvariantError(f"{pool.device} used block {bid} in free queue",
                                         holders.get(bid, ()))
            elif bid not in in_queue and bid not in deferred:
                raise InvariantError(f"{pool.device} block {bid} free but lost (leaked)")
            if blk.block_hash is not None and pool.cached.get(blk.block_hash) is not blk:
                raise InvariantError(f"{pool.device} block {bid} hash not in map")
            if not on_gpu and blk.block_hash is not None and any(
                    who != "host read" for who in holders.get(bid, ())):
                raise InvariantError(f"cpu block {bid} cached and held by a request",
                                     holders.get(bid, ()))
        for bid in range(pool.fresh_next, pool.num_blocks):
            if expected.get(bid):
                raise InvariantError(f"{pool.device} fresh block {bid} referenced",
                                     holders.get(bid, ()))
        for h, blk in pool.cached.items():
            if blk.block_hash != h or blk.serial < 0:
                raise InvariantError(f"{pool.device} map entry for block {blk.block_id} stale")
            if blk.token_ids is None or len(blk.token_ids) != self.block_size:
                raise InvariantError(f"{pool.device} cached block {blk.block_id} not full")
        free = pool.num_free + len(deferred - in_queue)
        if free + used != pool.num_blocks:
            raise InvariantError(
                f"{pool.device}: free {free} + used {used} != total {pool.num_blocks}"
            )
    self._check_intents()
    if self._num_pinned != sum(len(h.block_ids) for h in self._pins.values()):
        raise InvariantError("pinned block count drifted")
    if self._num_pinned > self.max_pinned_blocks:
        raise InvariantError("pins over the cap", [str(k) for k in self._pins])
