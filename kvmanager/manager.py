"""KVCacheManager: the router's view of one executor's KV cache (block tables, prefix cache,
copy-on-write, swap, pins, step boundary). See the package docstring for the protocol.

HOT PATH: `allocate`, `free` and `lookup` run for every request of every step. No logging,
no per-block method calls, no defensive copies in them; put checks in `check_invariants`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .block_pool import Block, BlockPool, KVEvent  # noqa: F401 (Block re-exported)
from .hashing import HashFn, get_hash_fn, hash_blocks


class InvariantError(AssertionError):
    """A broken invariant or a caller bug (double free, unknown request, negative ref
    count). `request_ids` names the requests involved."""

    def __init__(self, message: str, request_ids: Iterable[str] = ()) -> None:
        self.request_ids = tuple(request_ids)
        if self.request_ids:
            message = f"{message} (requests: {', '.join(self.request_ids)})"
        super().__init__(message)


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The cached prefix of a prompt: `block_ids` (device blocks, in order) hold its first
    `num_tokens` tokens (= len(block_ids) * block_size). `serials` identify the cache
    entries, so a stale hit (a block evicted and reused since the lookup) is detected."""

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    serials: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.block_ids)


EMPTY_HIT = PrefixHit()


class BlockOps(NamedTuple):
    """The block transfers a step plan carries, each an int64 array of shape [P, 2]:
    swap_out (device, cpu), swap_in (cpu, device), copy (src device, dst device)."""

    swap_out: np.ndarray
    swap_in: np.ndarray
    copy: np.ndarray


@dataclass(frozen=True, slots=True)
class DeviceStats:
    num_total_blocks: int
    num_free_blocks: int  # held by no request or pin: free, cached-evictable, deferred or
    # held for a plan in flight (allocatable once that plan is answered)
    num_cached_blocks: int  # blocks in the prefix cache (held or evictable)
    usage_ratio: float  # 1 - free / total
    num_evictions: int  # cached blocks reused for other content


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    gpu: DeviceStats
    cpu: DeviceStats
    prefix_query_tokens: int  # prompt tokens looked up at admissions
    prefix_hit_tokens: int  # of which served from the prefix cache
    num_pinned_blocks: int
    num_requests: int


class _Request:
    __slots__ = (
        "block_ids",
        "num_tokens",
        "block_hashes",
        "cache_salt",
        "num_cached_blocks",
        "on_gpu",
        "change_start",
        "token_ids",
        "chain_serial",
    )

    def __init__(self, block_ids, num_tokens, block_hashes, cache_salt) -> None:
        self.block_ids: list[int] = block_ids
        self.num_tokens: int = num_tokens  # positions with a slot (computed or scheduled)
        self.block_hashes: list = block_hashes
        self.cache_salt = cache_salt
        self.num_cached_blocks = 0  # blocks [0, n) went through prefix-cache registration
        self.on_gpu = True
        self.change_start: int | None = 0  # table[change_start:] changed since last taken
        self.token_ids: Sequence[int] = ()  # the caller's token list (a reference)
        # serial of the cache entry standing for block num_cached_blocks - 1 (-1: the
        # chain is broken, nothing later can be registered)
        self.chain_serial = -1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Paged KV-cache bookkeeping for one executor: a device ("gpu") pool and a CPU swap pool.

    Arguments: `num_gpu_blocks`, `num_cpu_blocks` (swap space, 0 disables swap),
    `block_size` tokens per block, `enable_prefix_caching`, `hash_algo` ("sha256",
    "builtin", "xxhash") or `hash_fn` (a custom function, e.g. to force collisions in tests),
    `watermark` (fraction of device blocks that new admissions must leave free),
    `max_pinned_fraction` (cap on device blocks held by pins), `enable_kv_events` (record
    KVEvents for `take_events`), `debug_checks` (run `check_invariants` after every
    mutating call).
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        num_cpu_blocks: int = 0,
        block_size: int = 16,
        *,
        enable_prefix_caching: bool = True,
        hash_algo: str = "sha256",
        hash_fn: HashFn | None = None,
        watermark: float = 0.01,
        max_pinned_fraction: float = 0.25,
        enable_kv_events: bool = False,
        debug_checks: bool = False,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        if not 0.0 <= max_pinned_fraction <= 1.0:
            raise ValueError(f"max_pinned_fraction must be in [0, 1], got {max_pinned_fraction}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn: HashFn = hash_fn if hash_fn is not None else get_hash_fn(hash_algo)
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.max_pinned_blocks = int(max_pinned_fraction * num_gpu_blocks)
        self.debug_checks = debug_checks
        self._events: list[KVEvent] | None = [] if enable_kv_events else None
        self.gpu = BlockPool(num_gpu_blocks, "gpu", self._events)
        self.cpu = BlockPool(num_cpu_blocks, "cpu", None)
        self._reqs: dict[str, _Request] = {}
        self._pins: dict[Hashable, PrefixHit] = {}
        self._num_pinned = 0
        self._serial = 0  # last registration serial handed out (cache entries and salt roots)
        self._salt_roots: dict[str, int] = {}
        self._copies: list[tuple[int, int]] = []
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        self._in_step = False
        self._dirty: dict[str, None] = {}  # allocated this step: register them at end_step
        self._last_sent = 0  # step id of the newest plan sent (pipelined steps)
        self._last_answered = 0  # step id of the newest plan whose result is back
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    # ================================================================== hashing / lookup

    def hash_blocks(
        self,
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
        return hash_blocks(self.hash_fn, token_ids, self.block_size, cache_salt, block_hashes)

    def _salt_root(self, cache_salt: str | None) -> int:
        if not cache_salt:
            return 0
        root = self._salt_roots.get(cache_salt)
        if root is None:
            self._serial += 1
            root = self._salt_roots[cache_salt] = self._serial
        return root

    def lookup(
        self,
        token_ids: Sequence[int],
        block_hashes: Sequence[Hashable],
        cache_salt: str | None = None,
    ) -> PrefixHit:
        """The longest cached prefix of full blocks of `token_ids`, never the whole prompt.

        Walk the chain of block hashes in the device cache map and stop at the first miss.
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
        cached = self.gpu.cached
        expect = self._salt_root(cache_salt) if cache_salt else 0
        ids: list[int] = []
        serials: list[int] = []
        for i in range(max_blocks):
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
        if not ids:
            return EMPTY_HIT
        return PrefixHit(tuple(ids), len(ids) * bs, tuple(serials))

    def _is_valid(self, hit: PrefixHit) -> bool:
        blocks = self.gpu.blocks
        for bid, serial in zip(hit.block_ids, hit.serials, strict=True):
            b = blocks[bid]
            if b is None or b.serial != serial:
                return False
        return True

    # ================================================================== pins

    def pin(self, key: Hashable, hit: PrefixHit) -> PrefixHit:
        """Hold a reference on the blocks of `hit` under `key` (the request id) so they
        cannot be evicted before the request is allocated. Pins together hold at most
        `max_pinned_blocks` blocks: over the cap only the first blocks that fit are pinned.
        Returns the pinned hit (possibly shorter, possibly empty: len(result) == 0). A stale
        hit (a block evicted since the lookup) pins only its still-valid prefix. Pinning a
        key again replaces its pin. `allocate(key, ...)` converts the pin into the request's
        references; `unpin`, `release_pins` or `free(key)` drop it."""
        if key in self._pins:
            self.unpin(key)
        n = min(len(hit.block_ids), self.max_pinned_blocks - self._num_pinned)
        blocks = self.gpu.blocks
        k = 0
        while k < n:
            b = blocks[hit.block_ids[k]]
            if b is None or b.serial != hit.serials[k]:
                break
            k += 1
        if k == 0:
            return EMPTY_HIT
        pinned = PrefixHit(hit.block_ids[:k], k * self.block_size, hit.serials[:k])
        self.gpu.touch(pinned.block_ids)
        self._pins[key] = pinned
        self._num_pinned += k
        self._debug_check()
        return pinned

    def unpin(self, key: Hashable) -> bool:
        """Drop the pin held under `key`; False when there is none."""
        pinned = self._pins.pop(key, None)
        if pinned is None:
            return False
        self._num_pinned -= len(pinned.block_ids)
        self.gpu.release(reversed(pinned.block_ids))
        self._debug_check()
        return True

    def release_pins(self) -> int:
        """Drop every pin (call before preempting a running request); returns the number of
        blocks unpinned."""
        n = self._num_pinned
        for key in list(self._pins):
            self.unpin(key)
        return n

    def pinned(self, key: Hashable) -> PrefixHit | None:
        return self._pins.get(key)

    # ================================================================== allocation

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a request of `num_tokens` tokens could be admitted on an empty cache."""
        return _cdiv(num_tokens, self.block_size) <= self.gpu.num_blocks - self.watermark_blocks

    def allocate(
        self,
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
            for i, dst in zip(cow, fresh, strict=True):
                src = table[i]
                if i * bs < old_tokens:  # holds written tokens: copy them
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
        if self.enable_prefix_caching:
            self._note_full_blocks(request_id, req, token_ids)
        self._debug_check()
        return new_ids

    def _note_full_blocks(self, request_id: str, req: _Request,
                          token_ids: Sequence[int]) -> None:
        """Register blocks the request just filled: at end_step() inside a step (so a plan
        never reads a block an earlier plan did not write), at once outside one. Only a block
        that filled up has anything to register (most decodes do not)."""
        req.token_ids = token_ids
        if req.num_tokens // self.block_size > req.num_cached_blocks:
            if self._in_step:
                self._dirty[request_id] = None
            else:
                self._cache_full_blocks(req, token_ids)

    def _admit(self, request_id, token_ids, num_new_tokens, hit, block_hashes, cache_salt,
               lookahead):
        bs = self.block_size
        gpu = self.gpu
        pinned = self._pins.get(request_id)
        if pinned is not None:
            hit = pinned
        elif hit is None or not hit.block_ids:
            hit = EMPTY_HIT
        elif not self._is_valid(hit):
            raise InvariantError("stale prefix hit: lookup and allocate in one go, or pin",
                                 (request_id,))
        hit_ids = hit.block_ids
        num_tokens = hit.num_tokens + num_new_tokens
        need = _cdiv(num_tokens + lookahead, bs) - len(hit_ids)
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
        new_ids = gpu.take(need) if need else []
        table = list(hit_ids)
        table.extend(new_ids)
        if block_hashes is None:
            block_hashes = []
        req = _Request(table, num_tokens, block_hashes, cache_salt)
        req.num_cached_blocks = len(hit_ids)
        if hit_ids:
            req.chain_serial = hit.serials[-1]
        self._reqs[request_id] = req
        self.prefix_query_tokens += len(token_ids)
        self.prefix_hit_tokens += hit.num_tokens
        if self.enable_prefix_caching:
            self._note_full_blocks(request_id, req, token_ids)
        self._debug_check()
        return new_ids

    def _cache_full_blocks(self, req: _Request, token_ids: Sequence[int]) -> None:
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
            hash_blocks(self.hash_fn, token_ids[: num_full * bs], bs, req.cache_salt, hashes)
        blocks = self.gpu.blocks
        cached = self.gpu.cached
        table = req.block_ids
        events = self._events
        parent = self._salt_root(req.cache_salt) if start == 0 else req.chain_serial
        serial = self._serial
        setdefault = cached.setdefault
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
                    continue
                parent = -1
                break
            b.block_hash = h
            b.token_ids = toks
            b.parent_serial = parent
            serial += 1
            b.serial = parent = serial
            if events is not None:
                events.append(KVEvent("stored", "gpu", h, b.block_id))
        self._serial = serial
        req.num_cached_blocks = num_full
        req.chain_serial = parent

    def free(self, request_id: str) -> None:
        """Drop the request's blocks (tail first, so its last blocks are evicted first) and
        any pin held under its id. Raises InvariantError for an unknown id."""
        req = self._reqs.pop(request_id, None)
        self._dirty.pop(request_id, None)
        if req is None:
            if self.unpin(request_id):
                return
            raise InvariantError("free of an unknown request", (request_id,))
        if request_id in self._pins:
            self.unpin(request_id)
        pool = self.gpu if req.on_gpu else self.cpu
        try:
            pool.release(reversed(req.block_ids))
        except AssertionError as e:
            raise InvariantError(str(e), (request_id,)) from None
        self._debug_check()

    def fork(self, parent_id: str, child_id: str) -> None:
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
        child = _Request(
            list(parent.block_ids), parent.num_tokens, list(parent.block_hashes),
            parent.cache_salt,
        )
        child.num_cached_blocks = parent.num_cached_blocks
        child.chain_serial = parent.chain_serial
        child.on_gpu = parent.on_gpu
        self._reqs[child_id] = child
        self._debug_check()

    # ================================================================== swap

    def _group(self, request_ids: Sequence[str], on_gpu: bool) -> list[_Request]:
        reqs = []
        for rid in request_ids:
            req = self._reqs.get(rid)
            if req is None:
                raise InvariantError("swap of an unknown request", (rid,))
            if req.on_gpu != on_gpu:
                where = "device" if on_gpu else "cpu"
                raise InvariantError(f"swap of a request not on the {where}", (rid,))
            reqs.append(req)
        if len(set(request_ids)) != len(request_ids):
            raise InvariantError("duplicate request in a swap group", request_ids)
        return reqs

    @staticmethod
    def _distinct_blocks(reqs: list[_Request]) -> dict[int, int]:
        refs: dict[int, int] = {}
        for req in reqs:
            for bid in req.block_ids:
                refs[bid] = refs.get(bid, 0) + 1
        return refs

    def can_swap_out(self, request_ids: Sequence[str]) -> bool:
        """Whether the CPU pool has a block for every distinct device block of the group."""
        reqs = self._group(request_ids, True)
        return len(self._distinct_blocks(reqs)) <= self.cpu.num_free

    def can_swap_in(self, request_ids: Sequence[str]) -> bool:
        """Whether the device can take the group back and still keep the watermark free."""
        reqs = self._group(request_ids, False)
        need = len(self._distinct_blocks(reqs))
        return need <= self.gpu.num_free - self.watermark_blocks

    def swap_out(self, request_ids: Sequence[str]) -> list[tuple[int, int]] | None:
        """Move a group (a request and its forks) to the CPU pool; None when the CPU pool is
        short (nothing changes). Returns the (device, cpu) pairs, also queued for
        `take_block_ops`.

        Every distinct device block of the group gets one CPU block, so blocks shared
        within the group stay shared. A device block whose references all come from the
        group is released (it stays in the prefix cache as an evictable block: its contents
        are intact until it is reused); one also held by a request that stays, or by a pin,
        is only copied. A block that is the destination of a copy queued this step is read
        from the copy's source instead (the executor swaps out before it copies)."""
        reqs = self._group(request_ids, True)
        refs = self._distinct_blocks(reqs)
        if len(refs) > self.cpu.num_free:
            return None
        cpu_ids = self.cpu.take(len(refs))
        mapping = dict(zip(refs, cpu_ids, strict=True))
        cpu_blocks = self.cpu.blocks
        for bid, cnt in refs.items():
            cpu_blocks[mapping[bid]].ref_cnt = cnt
        copy_src = {dst: src for src, dst in self._copies} if self._copies else {}
        pairs = [(copy_src.get(g, g), c) for g, c in mapping.items()]
        for rid in request_ids:  # its blocks of this step are not computed: never cache
            self._dirty.pop(rid, None)
        self._rehome(reqs, mapping, self.gpu, on_gpu=False)
        self._swap_out.extend(pairs)
        self._debug_check()
        return pairs

    def swap_in(self, request_ids: Sequence[str]) -> list[tuple[int, int]] | None:
        """Bring a swapped-out group back into fresh device blocks; None when the device is
        short (it must keep the watermark free; nothing changes). Returns the (cpu, device)
        pairs, also queued for `take_block_ops`. Sharing is kept the same way as in
        swap_out. The blocks re-enter the prefix cache at the request's next allocate
        (where their hash is not taken by another block). Table changes start at 0."""
        reqs = self._group(request_ids, False)
        refs = self._distinct_blocks(reqs)
        if len(refs) > self.gpu.num_free - self.watermark_blocks:
            return None
        gpu_ids = self.gpu.take(len(refs))
        mapping = dict(zip(refs, gpu_ids, strict=True))
        gpu_blocks = self.gpu.blocks
        for bid, cnt in refs.items():
            gpu_blocks[mapping[bid]].ref_cnt = cnt
        pairs = list(mapping.items())
        self._rehome(reqs, mapping, self.cpu, on_gpu=True)
        self._swap_in.extend(pairs)
        self._debug_check()
        return pairs

    @staticmethod
    def _rehome(reqs: list[_Request], mapping: dict[int, int], src_pool: BlockPool,
                on_gpu: bool) -> None:
        for req in reqs:
            old = req.block_ids
            req.block_ids = [mapping[b] for b in old]
            req.on_gpu = on_gpu
            req.change_start = 0
            req.num_cached_blocks = 0
            src_pool.release(reversed(old))

    # ================================================================== plan data

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids (a copy), on the device it is on."""
        return list(self._req(request_id).block_ids)

    def held_gpu_blocks(self, request_ids) -> int:
        """Distinct device blocks held by these requests' tables and by all pins: what the
        owner can account for. Device blocks in use beyond it are leaked."""
        held: set[int] = set()
        for rid in request_ids:
            req = self._reqs.get(rid)
            if req is not None and req.on_gpu:
                held.update(req.block_ids)
        for hit in self._pins.values():
            held.update(hit.block_ids)
        return len(held)

    def request_ids(self) -> list[str]:
        return list(self._reqs)

    def slot(self, request_id: str, pos: int) -> int:
        """The slot of one token position (no table copy: the plan builder's decode path)."""
        return self._req(request_id).block_ids[pos // self.block_size] * self.block_size \
            + pos % self.block_size

    def num_blocks_needed(self, request_id: str, num_new_tokens: int) -> int:
        """Device blocks `allocate(request_id, ..., num_new_tokens)` would add (a running
        request's table growth, not counting copy-on-write replacements)."""
        req = self._req(request_id)
        bs = self.block_size
        return max(0, -(-(req.num_tokens + num_new_tokens) // bs) - len(req.block_ids))

    @property
    def num_deferred_gpu_blocks(self) -> int:
        """Device blocks freed but not allocatable yet: during the plan being built (free
        once end_step() runs) or held for plans in flight (free once they are answered)."""
        return len(self.gpu.held_free_ids())

    def num_tokens(self, request_id: str) -> int:
        """Token positions of the request that have a slot (computed or scheduled)."""
        return self._req(request_id).num_tokens

    def block_hashes(self, request_id: str) -> list:
        """The request's block-hash list (the manager's own, extended in place)."""
        return self._req(request_id).block_hashes

    def is_swapped(self, request_id: str) -> bool:
        return not self._req(request_id).on_gpu

    def has_request(self, request_id: str) -> bool:
        return request_id in self._reqs

    def _req(self, request_id: str) -> _Request:
        req = self._reqs.get(request_id)
        if req is None:
            raise InvariantError("unknown request", (request_id,))
        return req

    def slot_mapping(self, request_id: str, start_pos: int, num_tokens: int) -> np.ndarray:
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
        ids = np.asarray(req.block_ids[first : _cdiv(end, bs)], dtype=np.int64)
        pos = np.arange(start_pos, end, dtype=np.int64)
        return ids[pos // bs - first] * bs + pos % bs

    def take_table_change(self, request_id: str) -> tuple[int, list[int]]:
        """(start, ids): table[start:] was replaced by `ids` since the last call (append:
        start == previous length; copy-on-write of the last block: start == len - 1; first
        allocation, fork child or swap-in: start 0). No change: (len(table), [])."""
        req = self._req(request_id)
        start = req.change_start
        if start is None:
            return len(req.block_ids), []
        req.change_start = None
        return start, req.block_ids[start:]

    def take_decode_entry(self, request_id: str, pos: int) -> tuple[int, list[int], int]:
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

    def take_block_ops(self) -> BlockOps:
        """Drain the swap-out, swap-in and copy pairs queued since the last call (once per
        step, into the StepPlan)."""
        ops = BlockOps(
            np.asarray(self._swap_out, dtype=np.int64).reshape(-1, 2),
            np.asarray(self._swap_in, dtype=np.int64).reshape(-1, 2),
            np.asarray(self._copies, dtype=np.int64).reshape(-1, 2),
        )
        self._swap_out, self._swap_in, self._copies = [], [], []
        return ops

    def begin_step(self) -> None:
        """Start building a plan: from now on a freed block is deferred, not handed out
        again, and newly full blocks wait to enter the prefix cache, until end_step().
        Blocks freed since the last plan was sent stay held for the plans in flight."""
        self._fence_frees()
        self._in_step = True
        self.gpu.deferring = True
        self.cpu.deferring = True

    def end_step(self, sent_step: int | None = None) -> None:
        """The plan was built (and sent as plan `sent_step`; None: no plan was sent): the
        blocks it fills enter the prefix cache (requests still on the device only). Blocks
        freed while building it join the free queue now when no plan is in flight, else
        when the newest plan in flight has been answered (`plan_answered`)."""
        self._in_step = False
        dirty, self._dirty = self._dirty, {}
        for rid in dirty:
            req = self._reqs.get(rid)
            if req is not None and req.on_gpu:
                self._cache_full_blocks(req, req.token_ids)
        if sent_step is not None:
            if sent_step <= self._last_sent:
                raise InvariantError(f"plan {sent_step} sent after plan {self._last_sent}")
            self._last_sent = sent_step
        self._settle_frees()
        self._debug_check()

    def plan_answered(self, step: int) -> None:
        """The result of plan `step` is back (results come in plan order): the blocks held
        for it and for earlier plans join the free queue."""
        self._fence_frees()
        if step > self._last_answered:
            self._last_answered = step
        self.gpu.release_fenced(step)
        self.cpu.release_fenced(step)
        if not self._in_step:
            self._settle_frees()
        self._debug_check()

    @property
    def num_plans_in_flight(self) -> int:
        return self._last_sent - self._last_answered

    def _fence_frees(self) -> bool:
        """With plans in flight, hold the blocks freed so far for the newest of them;
        returns whether plans are in flight."""
        if self._last_sent <= self._last_answered:
            return False
        self.gpu.fence(self._last_sent)
        self.cpu.fence(self._last_sent)
        return True

    def _settle_frees(self) -> None:
        """Outside a plan build: with plans in flight, frees are held for the newest one
        (and keep being deferred); without, they are free at once."""
        in_flight = self._fence_frees()
        for pool in (self.gpu, self.cpu):
            if in_flight:
                pool.deferring = True
            else:
                pool.flush_deferred()

    # ================================================================== accounting

    def take_events(self) -> list[KVEvent]:
        """Drain the KV events ("stored"/"removed") recorded since the last call; [] unless
        the manager was created with enable_kv_events=True."""
        if self._events is None:
            return []
        out = list(self._events)
        self._events.clear()
        return out

    @staticmethod
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

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            gpu=self._device_stats(self.gpu),
            cpu=self._device_stats(self.cpu),
            prefix_query_tokens=self.prefix_query_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
            num_pinned_blocks=self._num_pinned,
            num_requests=len(self._reqs),
        )

    @property
    def num_free_gpu_blocks(self) -> int:
        """Device blocks allocatable now (free queue length, deferred blocks excluded)."""
        return self.gpu.num_free

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu.num_free

    def _debug_check(self) -> None:
        if self.debug_checks:
            self.check_invariants()

    def check_invariants(self) -> None:
        """Verify the whole state; raise InvariantError naming the requests involved.

        - every block's ref count equals its references from live block tables and pins;
        - the free queue holds exactly the ref-count-0 blocks not deferred (and its links
          and count agree), deferred blocks have ref count 0 or were touched since;
        - the prefix-cache map points only at blocks registered under that hash, holding a
          full block of tokens, and a request's registered block has the request's hash;
        - free + used = total on each device; a table lives on one device only.
        """
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
            in_queue: set[int] = set()
            prev = pool.head
            b = pool.head.next_free
            while b is not pool.tail:
                if b.prev_free is not prev:
                    raise InvariantError(f"{pool.device} free queue link broken at {b.block_id}")
                if b.block_id in in_queue:
                    raise InvariantError(f"{pool.device} block {b.block_id} twice in queue")
                in_queue.add(b.block_id)
                prev, b = b, b.next_free
            if pool.tail.prev_free is not prev:
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
                if blk.block_hash is not None and (
                    not on_gpu or pool.cached.get(blk.block_hash) is not blk
                ):
                    raise InvariantError(f"{pool.device} block {bid} hash not in map")
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
        if self._num_pinned != sum(len(h.block_ids) for h in self._pins.values()):
            raise InvariantError("pinned block count drifted")
        if self._num_pinned > self.max_pinned_blocks:
            raise InvariantError("pins over the cap", [str(k) for k in self._pins])


__all__ = [
    "Block",
    "BlockOps",
    "DeviceStats",
    "InvariantError",
    "KVCacheManager",
    "KVCacheStats",
    "KVEvent",
    "PrefixHit",
    "EMPTY_HIT",
]
