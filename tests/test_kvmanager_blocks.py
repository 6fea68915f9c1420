"""KV-cache blocks and their pool: the free queue's LRU order and O(1) removal, Blocks kept
out of the garbage collector, lazy creation (kvmanager/block_pool.py)."""

from __future__ import annotations

import gc
import tracemalloc

import pytest
from pagedserve.kvmanager import Block, BlockPool, KVCacheManager
from test_kvmanager import admit, make


def test_free_queue_lru_order_and_reverse_free():
    m = make(8, enable_prefix_caching=False)
    assert m.allocate("a", list(range(8)), 8) == [0, 1]
    assert m.allocate("b", list(range(12)), 12) == [2, 3, 4]
    m.free("a")
    assert m.gpu.free_block_ids() == [5, 6, 7, 1, 0]
    m.free("b")
    assert m.gpu.free_block_ids() == [5, 6, 7, 1, 0, 4, 3, 2]
    assert m.allocate("c", list(range(16)), 16) == [5, 6, 7, 1]
    assert m.gpu.free_block_ids() == [0, 4, 3, 2]


def test_free_queue_remove_any_block_in_o1():
    pool = BlockPool(6, "gpu")
    ids = pool.take(6)
    assert ids == [0, 1, 2, 3, 4, 5]
    pool.release([5, 4, 3, 2, 1, 0])
    assert pool.free_block_ids() == [5, 4, 3, 2, 1, 0]
    pool.touch([2])  # unlinks from the middle
    assert pool.free_block_ids() == [5, 4, 3, 1, 0]
    assert pool.num_free == 5
    pool.release([2])
    assert pool.free_block_ids() == [5, 4, 3, 1, 0, 2]
    with pytest.raises(AssertionError):
        pool.release([2])  # ref count would go below 0


def test_blocks_stay_out_of_the_garbage_collector():
    """A GPU's pool holds hundreds of thousands of Blocks for the router's life: none is
    tracked by the cyclic collector (a full collection would walk each), and none refers to
    another Block (the queue links are ids), so no cycle can hide behind an untracked one."""
    m = make(8, 8)
    admit(m, "a", list(range(10)))  # cached blocks
    m.fork("a", "b")
    m.allocate("b", list(range(10)) + [5], 1)  # copy-on-write
    admit(m, "c", list(range(8)) + [7])  # a prefix hit
    m.swap_out(["a", "b"])  # CPU blocks too
    m.free("c")
    m.allocate("d", [3] * 20, 20)  # evictions from the queue's head
    m.check_invariants()
    seen = 0
    for pool in (m.gpu, m.cpu):
        for b in pool.blocks:
            if b is None:
                continue
            seen += 1
            assert not gc.is_tracked(b)
            for name in Block.__struct_fields__:
                assert not isinstance(getattr(b, name), (Block, list, dict, set)), (b, name)
            assert type(b.prev_free) in (int, type(None))
            assert type(b.next_free) in (int, type(None))
    assert seen >= 2 * 2 + 8  # every device block was handed out; sentinels of both pools
    a, b = m.gpu.blocks[0], Block(0)
    assert a != b and len({a, b}) == 2  # identity, not field-wise equality


def test_pool_of_a_million_blocks_is_cheap():
    """O(1) Python objects at creation: a block gets its Block when first taken (a Block
    each would be ~100 MB here; the id lists are 8 bytes a block)."""
    tracemalloc.start()
    try:
        m = KVCacheManager(1_000_000, 1_000_000, 16)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 40 * 2**20, peak
    assert m.stats().gpu.num_free_blocks == 1_000_000
    assert sum(b is not None for b in m.gpu.blocks) == 2  # the queue's two sentinels
    assert m.gpu.take(3) == [0, 1, 2]
    assert sum(b is not None for b in m.gpu.blocks) == 2 + 3
