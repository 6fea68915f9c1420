"""Blocks, the intrusive free queue and one pool of blocks per device.

HOT PATH: `BlockPool.take` and `BlockPool.release` run once per allocation and per free for
every block of every request. Keep them flat loops over local variables: no per-block method
calls, no logging, no new attribute lookups in the loops.

Free queue (after vLLM V1's FreeKVCacheBlockQueue): a doubly linked list threaded through the
blocks themselves (`prev_free` / `next_free`) between two sentinels, so any block is removed
in O(1) (a prefix-cache hit on a free but cached block) and the queue order is the eviction
order: blocks are taken from the head (least recently freed first) and appended at the tail
when their ref count drops to 0. A request frees its blocks tail first, so a sequence's last
blocks (the least shareable part of a prefix) are evicted before its first ones.

The queue's links are block ids, not references: `prev_free` / `next_free` hold the id of
the neighbour (the two sentinels have ids `num_blocks` and `num_blocks + 1`, at the end of
`blocks`), None when the block is not queued. So no Block refers to another, and Blocks are
kept out of the cyclic garbage collector (`gc=False`; msgspec Structs): a router serving a
GPU holds hundreds of thousands of them for its whole life, and a full collection walked
each one while every executor's step loop waited (600k blocks: 78 ms on the CPU machine,
10 ms untracked). Nothing a Block holds can lead back to it (ints, a hash, a tuple of
token ids), so no cycle can leak.

Creating a pool is O(1) in Python objects: a block that was never handed out has no Block
object yet. The queue is "ids [fresh_next, num_blocks) that were never used" followed by the
linked list; those fresh ids are older than anything in the list (free since creation), so
taking them first is exactly LRU. A Block object is created when its id is first taken.

Step boundary: while `deferring` is set (between the manager's begin_step and end_step, and
while plans are in flight), a block whose ref count drops to 0 goes to `deferred` instead of
the queue, so it cannot be handed out again in the plan being built; `flush_deferred` appends
them to the queue in the order they were freed.

Fences (pipelined steps): a block freed while plans are in flight may still be named by one
of them. `fence(step)` moves the deferred blocks into a batch held until the result of plan
`step` is back; `release_fenced(answered)` frees every batch whose plan has been answered
(results come back in plan order). A block freed again after a cache hit is held by its
latest fence only.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import msgspec


class KVEvent(NamedTuple):
    """A prefix-cache change: `kind` is "stored" (block registered under `block_hash`) or
    "removed" (evicted, the hash no longer maps to `block_id`)."""

    kind: str
    device: str
    block_hash: object
    block_id: int


class Block(msgspec.Struct, gc=False, eq=False):
    """One KV-cache block. `block_hash`/`token_ids` are set only while the block is in its
    pool's prefix-cache map (full blocks only); `serial` identifies that registration (-1
    when not cached) and `parent_serial` the registration of the block before it in the
    sequence (or the salt's root), so a lookup can verify the whole chain, not just one
    block's tokens. `num_hits` counts the admissions that found it in the prefix cache since
    it was registered (routing values a block shared by later requests). `prev_free` /
    `next_free`: the ids of its neighbours in the free queue, None when not queued. Never
    give a Block a field that can refer to another object holding it (see the module
    docstring: it is not tracked by the garbage collector). Blocks compare and hash by
    identity (`eq=False`), as plain objects do."""

    block_id: int
    ref_cnt: int = 0
    block_hash: object = None
    token_ids: tuple[int, ...] | None = None
    serial: int = -1
    parent_serial: int = -1
    num_hits: int = 0
    prev_free: int | None = None
    next_free: int | None = None

    def __repr__(self) -> str:
        return f"Block(id={self.block_id}, ref={self.ref_cnt}, cached={self.serial >= 0})"


class BlockPool:
    """All blocks of one device: the blocks, the free queue, the prefix-cache map
    (block hash -> Block, device pool only) and the deferred list of the step boundary."""

    def __init__(self, num_blocks: int, device: str, events: list | None = None) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.device = device
        # blocks[i] is None until id i is first handed out (lazy creation); the two
        # sentinels of the linked part of the free queue follow the real blocks.
        self.blocks: list[Block | None] = [None] * num_blocks
        self.fresh_next = 0  # ids >= fresh_next were never handed out (head of the queue)
        self.head_id, self.tail_id = num_blocks, num_blocks + 1
        self.head = Block(self.head_id, next_free=self.tail_id)
        self.tail = Block(self.tail_id, prev_free=self.head_id)
        self.blocks += [self.head, self.tail]
        self.num_free = num_blocks  # blocks in the queue (fresh + linked)
        self.cached: dict = {}  # block hash -> Block
        self.deferred: list[Block] = []
        self.deferring = False
        self.fenced: deque[tuple[int, list[Block]]] = deque()  # (plan step, blocks), in order
        self._fence_of: dict[int, int] = {}  # block id -> the latest fence holding it
        self.num_evictions = 0
        self.events = events  # list of KVEvent tuples to append to, or None

    # ------------------------------------------------------------------ queries

    def block(self, block_id: int) -> Block:
        b = self.blocks[block_id]
        if b is None:  # a fresh id: materialise it (still free, still in the queue)
            b = self.blocks[block_id] = Block(block_id)
        return b

    def free_block_ids(self) -> list[int]:
        """The free queue in eviction order (head first). O(num free): for tests and debug."""
        ids = list(range(self.fresh_next, self.num_blocks))
        blocks, tail = self.blocks, self.tail_id
        bid = self.head.next_free
        while bid != tail:
            ids.append(bid)
            bid = blocks[bid].next_free
        return ids

    # ------------------------------------------------------------------ hot path

    def take(self, n: int) -> list[int]:
        """Pop `n` blocks from the head of the free queue with ref count 1 each; a popped
        block that is still in the prefix cache is evicted from it. The caller has checked
        n <= num_free."""
        if n > self.num_free:
            raise AssertionError(f"{self.device}: take({n}) with {self.num_free} free")
        self.num_free -= n
        out: list[int] = []
        fresh = self.fresh_next
        if fresh < self.num_blocks:
            k = min(n, self.num_blocks - fresh)
            blocks = self.blocks
            for bid in range(fresh, fresh + k):
                b = Block(bid)
                b.ref_cnt = 1
                blocks[bid] = b
            out.extend(range(fresh, fresh + k))
            self.fresh_next = fresh + k
            n -= k
            if not n:
                return out
        blocks = self.blocks
        head = self.head
        bid = head.next_free
        append = out.append
        cached = self.cached
        events = self.events
        num_evicted = 0
        for _ in range(n):
            b = blocks[bid]
            h = b.block_hash
            if h is not None:  # evict (inlined _evict: this loop is the hot path)
                del cached[h]
                if events is not None:
                    events.append(KVEvent("removed", self.device, h, bid))
                b.block_hash = b.token_ids = None
                b.serial = -1
                b.num_hits = 0
                num_evicted += 1
            b.ref_cnt = 1
            append(bid)
            bid = b.next_free
            b.prev_free = b.next_free = None
        head.next_free = bid
        blocks[bid].prev_free = self.head_id
        self.num_evictions += num_evicted
        return out

    def release(self, block_ids) -> None:
        """Drop one reference per id, in the order given (pass a table reversed to free its
        tail first). Blocks reaching ref count 0 join the free queue tail, or the deferred
        list during a step. Raises AssertionError on a ref count going negative."""
        blocks = self.blocks
        if self.deferring:
            deferred = self.deferred
            for bid in block_ids:
                b = blocks[bid]
                r = b.ref_cnt - 1
                b.ref_cnt = r
                if r == 0:
                    deferred.append(b)
                elif r < 0:
                    b.ref_cnt = 0
                    raise AssertionError(f"{self.device} block {bid}: ref count below 0")
            return
        tail = self.tail
        last = blocks[tail.prev_free]
        n = 0
        try:
            for bid in block_ids:
                b = blocks[bid]
                r = b.ref_cnt - 1
                b.ref_cnt = r
                if r == 0:
                    last.next_free = bid
                    b.prev_free = last.block_id
                    last = b
                    n += 1
                elif r < 0:
                    b.ref_cnt = 0
                    raise AssertionError(f"{self.device} block {bid}: ref count below 0")
        finally:
            last.next_free = self.tail_id
            tail.prev_free = last.block_id
            self.num_free += n

    def touch(self, block_ids) -> None:
        """Add one reference to each block; a block at ref count 0 leaves the free queue
        (O(1) unlink) and stays in the prefix cache (a cache hit or a pin)."""
        blocks = self.blocks
        for bid in block_ids:
            b = blocks[bid]
            if b.ref_cnt == 0 and b.prev_free is not None:
                prv = b.prev_free
                nxt = b.next_free
                blocks[prv].next_free = nxt
                blocks[nxt].prev_free = prv
                b.prev_free = b.next_free = None
                self.num_free -= 1
            b.ref_cnt += 1

    def flush_deferred(self) -> None:
        """Move blocks deferred by the step boundary to the free queue tail (in free order);
        a deferred block touched since (a cache hit) and not freed again is skipped."""
        self.deferring = False
        deferred, self.deferred = self.deferred, []
        self._enqueue(deferred, None)

    def fence(self, step: int) -> None:
        """Hold the blocks deferred so far until the result of plan `step` is back."""
        if not self.deferred:
            return
        batch, self.deferred = self.deferred, []
        fence_of = self._fence_of
        for b in batch:
            fence_of[b.block_id] = step
        self.fenced.append((step, batch))

    def release_fenced(self, answered: int) -> None:
        """Free the blocks held for plans up to `answered` (in the order they were freed)."""
        fenced = self.fenced
        while fenced and fenced[0][0] <= answered:
            self._enqueue(fenced.popleft()[1], answered)

    def _enqueue(self, blocks: list[Block], answered: int | None) -> None:
        """Append the blocks still free (ref count 0, not queued) to the queue tail; with
        `answered`, only those whose latest fence is answered."""
        fence_of = self._fence_of
        tail = self.tail
        last = self.blocks[tail.prev_free]
        for b in blocks:
            if answered is not None:
                fence = fence_of.get(b.block_id)
                if fence is not None:
                    if fence > answered:
                        continue  # freed again later: a later fence holds it
                    del fence_of[b.block_id]
            if b.ref_cnt == 0 and b.prev_free is None:
                last.next_free = b.block_id
                b.prev_free = last.block_id
                last = b
                self.num_free += 1
        last.next_free = self.tail_id
        tail.prev_free = last.block_id

    def held_free_ids(self) -> set[int]:
        """Blocks at ref count 0 that are not in the queue yet: deferred or fenced."""
        held = {b.block_id for b in self.deferred if b.ref_cnt == 0 and b.prev_free is None}
        for _, batch in self.fenced:
            held.update(b.block_id for b in batch if b.ref_cnt == 0 and b.prev_free is None)
        return held
