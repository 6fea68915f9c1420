"""KVCacheManager: the router's view of one executor's KV cache (block tables, prefix cache,
copy-on-write, swap, pins, step boundary). See the package docstring for the protocol.

One class, one API for callers, its code in modules along its seams. Each module holds plain
functions whose first argument is the manager; the class below binds them as its methods
(`allocate = allocation.allocate`), so a call costs what a method defined here would, there
is no class hierarchy (no mixins, no delegation layer) and every function reads the state
declared in `__init__` below:

    prefix.py      hashing, the verified prefix lookup, pins, prefix registration
    allocation.py  admission, allocate (copy-on-write), free, fork, per-request plan data
    swap.py        swap_out / swap_in of request groups
    offload.py     the prefix cache's host tier in the CPU pool (offloading)
    transfer.py    blocks received from another executor, into that host tier
    accounting.py  KV events, stats, held blocks, check_invariants
    state.py       the records they share (PrefixHit, BlockOps, stats, RequestState)
    manager.py     the state itself and the step boundary (begin_step, end_step,
                   plan_answered: deferred frees and the fences of plans in flight)

HOT PATH: `allocate`, `free` and `lookup` run for every request of every step. No logging,
no per-block method calls, no defensive copies in them; put checks in `check_invariants`.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from . import accounting, allocation, intents, offload, prefix, swap, transfer
from .block_pool import Block, BlockPool, KVEvent  # noqa: F401 (Block re-exported)
from .hashing import HashFn, get_hash_fn
from .state import (  # noqa: F401 (re-exported)
    EMPTY_HIT,
    BlockOps,
    DeviceStats,
    InvariantError,
    KVCacheStats,
    PrefixHit,
    RequestState,
)


class KVCacheManager:
    """Paged KV-cache bookkeeping for one executor: a device ("gpu") pool and a CPU swap pool.

    Arguments: `num_gpu_blocks`, `num_cpu_blocks` (swap space, 0 disables swap),
    `block_size` tokens per block, `enable_prefix_caching`, `hash_algo` ("sha256",
    "builtin", "xxhash") or `hash_fn` (a custom function, e.g. to force collisions in tests),
    `watermark` (fraction of device blocks that new admissions must leave free),
    `max_pinned_fraction` (cap on device blocks held by pins), `enable_kv_events` (record
    KVEvents for `take_events`), `enable_offloading` (evicted prefix-cache blocks live on
    in the CPU pool's free blocks: offload.py; needs prefix caching and CPU blocks),
    `debug_checks` (run `check_invariants` after every mutating call).
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
        enable_offloading: bool = False,
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
        self._reqs: dict[str, RequestState] = {}
        self._pins: dict[Hashable, PrefixHit] = {}
        self._num_pinned = 0
        self._holds: dict[Hashable, tuple[int, ...]] = {}  # device blocks held for an export
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
        # Intended prefixes (intents.py): request id -> Intent, and block hash -> ids of the
        # requests intending that (uncached) block.
        self._intents: dict[str, intents.Intent] = {}
        self._intended: dict[Hashable, list[str]] = {}
        self._num_intent_entries = 0  # sum of the index's list lengths
        # intended blocks that registered since: hash -> their intenders, indexed again if
        # the block is evicted before they compute it (intents.py, `_reindex_evicted`)
        self._parked: dict[Hashable, dict[str, None]] = {}  # ordered sets: O(1) release
        self._parked_evictions = 0  # gpu.num_evictions when the parked hashes were checked
        self._num_intent_tail_tokens = 0  # sum of the intents' tails
        # Offloading (offload.py): device blocks freed since the last plan was built, as
        # (id, hash, tokens, parent serial, serial); host blocks read by this plan's swap-ins
        self.enable_offloading = bool(enable_offloading and enable_prefix_caching
                                      and num_cpu_blocks > 0)
        # Lookups go on in the CPU pool's map: with offloading, and once blocks were
        # received from another executor (transfer.py)
        self.host_tier = self.enable_offloading
        self.num_imported_blocks = 0  # blocks received from other executors (transfer.py)
        self._offload_candidates: list[tuple] = []
        self._host_reads: list[int] = []
        self.host_hit_tokens = 0  # of prefix_hit_tokens, those swapped in from the host
        self.num_offloaded_blocks = 0  # device blocks copied to the host
        self.num_offloads_dropped = 0  # candidates lost: the host full, or reused at once

    # ------------------------------------------------------------------ prefix.py
    hash_blocks = prefix.hash_blocks
    lookup = prefix.lookup
    pin = prefix.pin
    unpin = prefix.unpin
    release_pins = prefix.release_pins
    pinned = prefix.pinned
    num_shared_blocks_evicted = prefix.num_shared_blocks_evicted
    reset_prefix_cache = prefix.reset_prefix_cache
    _salt_root = prefix._salt_root
    _is_valid = prefix._is_valid
    _valid_until = prefix._valid_until
    _note_full_blocks = prefix._note_full_blocks
    _cache_full_blocks = prefix._cache_full_blocks
    _register = prefix._register

    # ------------------------------------------------------------------ intents.py
    intend = intents.intend
    drop_intent = intents.drop_intent
    intended_tokens = intents.intended_tokens
    intent_ids = intents.intent_ids
    has_intent = intents.has_intent
    num_intended_tokens = intents.num_intended_tokens
    _add_intent = intents._add_intent
    _release_intent = intents._release_intent
    _park_registered = intents._park_registered
    _reindex_evicted = intents._reindex_evicted
    _check_intents = intents.check_intents

    # ------------------------------------------------------------------ allocation.py
    can_ever_fit = allocation.can_ever_fit
    allocate = allocation.allocate
    allocate_decode = allocation.allocate_decode
    steady_decode_state = allocation.steady_decode_state
    advance_steady_decodes = allocation.advance_steady_decodes
    note_steady_fills = allocation.note_steady_fills
    extend_steady_tables = allocation.extend_steady_tables
    free = allocation.free
    fork = allocation.fork
    _admit = allocation._admit
    block_table = allocation.block_table
    request_ids = allocation.request_ids
    slot = allocation.slot
    num_blocks_needed = allocation.num_blocks_needed
    num_tokens = allocation.num_tokens
    block_hashes = allocation.block_hashes
    is_swapped = allocation.is_swapped
    has_request = allocation.has_request
    slot_mapping = allocation.slot_mapping
    take_table_change = allocation.take_table_change
    take_decode_entry = allocation.take_decode_entry
    _req = allocation._req

    # ------------------------------------------------------------------ swap.py
    can_swap_out = swap.can_swap_out
    can_swap_in = swap.can_swap_in
    swap_out = swap.swap_out
    swap_in = swap.swap_in
    _group = swap._group
    _distinct_blocks = staticmethod(swap._distinct_blocks)
    _rehome = staticmethod(swap._rehome)

    # ------------------------------------------------------------------ offload.py
    note_freed = offload.note_freed
    drain_offloads = offload.drain_offloads
    host_hit_valid = offload.host_hit_valid
    admit_host_hit = offload.admit_host_hit
    host_serial = offload.host_serial

    # ------------------------------------------------------------------ transfer.py
    import_blocks = transfer.import_blocks
    hold_export = transfer.hold_export
    release_export = transfer.release_export

    # ------------------------------------------------------------------ accounting.py
    take_events = accounting.take_events
    stats = accounting.stats
    held_gpu_blocks = accounting.held_gpu_blocks
    check_invariants = accounting.check_invariants
    _device_stats = staticmethod(accounting._device_stats)
    _debug_check = accounting._debug_check

    # ------------------------------------------------------------------ step boundary

    @property
    def has_block_ops(self) -> bool:
        """Swap-outs, swap-ins or copies are queued for the next plan (`take_block_ops`)."""
        return bool(self._swap_out or self._swap_in or self._copies)

    def take_block_ops(self) -> BlockOps:
        """Drain the swap-out, swap-in and copy pairs queued since the last call (once per
        step, into the StepPlan); with offloading, the blocks freed since the last plan are
        copied to the host in this one (offload.py)."""
        if self._offload_candidates or self._host_reads:
            self.drain_offloads()
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
        blocks it fills enter the prefix cache (requests still on the device only; see
        `_register`: they leave the intended index, and an intent scheduled through its end
        is released; intended blocks evicted while building it are indexed again). Blocks
        freed while building it join the free queue now when no plan is in flight, else
        when the newest plan in flight has been answered (`plan_answered`)."""
        self._in_step = False
        dirty, self._dirty = self._dirty, {}
        # In request-id order: when two requests filled blocks of the same tokens, which of
        # the two the cache keeps does not depend on the order the plan was built in (the
        # scheduler's decode lane builds rows out of order).
        for rid in sorted(dirty) if len(dirty) > 1 else dirty:
            req = self._reqs.get(rid)
            if req is not None and req.on_gpu:
                self._register(rid, req)
        if sent_step is not None:
            if sent_step <= self._last_sent:
                raise InvariantError(f"plan {sent_step} sent after plan {self._last_sent}")
            self._last_sent = sent_step
        if self._parked and self.gpu.num_evictions != self._parked_evictions:
            self._reindex_evicted()  # only evictions take a hash out of the prefix cache
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

    # ------------------------------------------------------------------ free blocks

    @property
    def num_deferred_gpu_blocks(self) -> int:
        """Device blocks freed but not allocatable yet: during the plan being built (free
        once end_step() runs) or held for plans in flight (free once they are answered)."""
        return len(self.gpu.held_free_ids())

    @property
    def num_free_gpu_blocks(self) -> int:
        """Device blocks allocatable now (free queue length, deferred blocks excluded)."""
        return self.gpu.num_free

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu.num_free

    @property
    def num_cached_gpu_blocks(self) -> int:
        """Device blocks in the prefix cache (held or evictable)."""
        return len(self.gpu.cached)


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
