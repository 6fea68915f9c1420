"""Offloading (kvmanager/offload.py): exact block ids, pairs and serials of the prefix
cache's host tier. The stateful machines in test_kvmanager_stateful.py check the same
against simulated block contents under random operations."""

from __future__ import annotations

import pytest
from pagedserve.kvmanager import InvariantError, KVCacheManager

BS = 4
A = list(range(13))  # three full blocks and one token
B = list(range(100, 113))


def manager(num_gpu: int = 4, num_cpu: int = 8, **kw) -> KVCacheManager:
    kw.setdefault("enable_offloading", True)
    return KVCacheManager(num_gpu, num_cpu, BS, watermark=0, hash_algo="builtin",
                          debug_checks=True, **kw)


def step(m: KVCacheManager, op, sent: int | None = None):
    """One plan: `op` between begin_step and end_step; returns (op's result, block ops)."""
    m.begin_step()
    result = op()
    ops = m.take_block_ops()
    m.end_step(sent)
    return result, ops


def admit(m: KVCacheManager, rid: str, toks: list[int]):
    hashes = m.hash_blocks(toks)
    hit = m.lookup(toks, hashes)
    new = m.allocate(rid, toks, len(toks) - hit.num_tokens, hit=hit, block_hashes=hashes)
    return hit, new


def pairs(arr) -> list[tuple[int, int]]:
    return [tuple(p) for p in arr.tolist()]


def host_serials(m: KVCacheManager) -> dict[int, int]:
    return {b.block_id: b.serial for b in m.cpu.cached.values()}


def test_freed_blocks_go_to_the_host_and_come_back_on_a_hit():
    m = manager()
    _, ops = step(m, lambda: admit(m, "a", A))
    assert m.block_table("a") == [0, 1, 2, 3] and not len(ops.swap_out)
    serials = [m.gpu.blocks[b].serial for b in (0, 1, 2)]
    # freed: its three full blocks are copied to the host in the plan built next (here the
    # same one), the last first (the host keeps a sequence's first blocks longest); the
    # partial last block is not cached and stays behind
    _, ops = step(m, lambda: m.free("a"))
    assert pairs(ops.swap_out) == [(2, 0), (1, 1), (0, 2)]
    assert host_serials(m) == dict(zip((2, 1, 0), serials, strict=True))
    # another prompt takes every device block: A's evicted there, kept on the host
    step(m, lambda: admit(m, "b", B))
    assert m.block_table("b") == [3, 2, 1, 0] and m.gpu.cached.keys().isdisjoint(
        m.hash_blocks(A))
    _, ops = step(m, lambda: m.free("b"))
    assert pairs(ops.swap_out) == [(1, 3), (2, 4), (3, 5)]  # B's full blocks 2, 1, 0
    # fresh CPU blocks first, then the host entries least recently used first
    assert m.cpu.free_block_ids() == [6, 7, 0, 1, 2, 3, 4, 5]
    (hit, new), ops = step(m, lambda: admit(m, "a2", A + [7]))
    assert hit.block_ids == () and hit.host_block_ids == (2, 1, 0)
    assert hit.num_tokens == 12 and len(hit) == 3 and hit.host_serials == tuple(serials)
    assert new == [0, 1, 2, 3] and m.block_table("a2") == [0, 1, 2, 3]
    assert pairs(ops.swap_in) == [(2, 0), (1, 1), (0, 2)] and not len(ops.swap_out)
    # the device blocks are the same cache entries again (the host entries' serials)
    assert [m.gpu.blocks[b].serial for b in (0, 1, 2)] == serials
    # the host blocks read were held for the plan, then went to the most recent end
    assert m.cpu.free_block_ids() == [6, 7, 3, 4, 5, 2, 1, 0]
    st = m.stats()
    assert (st.prefix_hit_tokens, st.host_hit_tokens) == (12, 12)
    assert (st.num_offloaded_blocks, st.num_offloads_dropped) == (6, 0)
    assert st.cpu.num_cached_blocks == 6 and st.cpu.num_free_blocks == 8


def test_a_hit_runs_from_the_device_into_the_host():
    m = manager(num_gpu=6)
    step(m, lambda: admit(m, "a", A))
    step(m, lambda: m.free("a"))  # A's blocks 0-2 on the host too
    # a prompt sharing A's first block holds it on the device; B's evict A's blocks 1-2
    step(m, lambda: admit(m, "s", A[:4] + [50, 51, 52, 53, 0]))
    step(m, lambda: admit(m, "b", B[:9]))
    assert (m.block_table("s"), m.block_table("b")) == ([0, 4, 5], [3, 2, 1])
    step(m, lambda: m.free("b"))
    hit = m.lookup(A + [1], m.hash_blocks(A + [1]))
    assert (hit.block_ids, hit.host_block_ids, hit.num_tokens) == ((0,), (1, 0), 12)
    pinned = m.pin("p", hit)  # a pin holds the device part
    assert (pinned.block_ids, pinned.host_block_ids, pinned.num_tokens) == ((0,), (), 4)
    m.unpin("p")
    (_, new), ops = step(m, lambda: admit(m, "a2", A + [1]))
    assert new == [1, 2, 3] and m.block_table("a2") == [0, 1, 2, 3]
    assert pairs(ops.swap_in) == [(1, 1), (0, 2)] and not len(ops.swap_out)
    # registered under the host entries: the chain is whole on the device again
    assert m.lookup(A + [2], m.hash_blocks(A + [2])).serials == (1, 2, 3)


def test_the_same_tokens_computed_again_are_the_same_entry():
    """A block computed again on the device while the host holds it takes the host entry's
    serial, so the host's later blocks still chain from it."""
    m = manager(num_gpu=8, num_cpu=16)
    long = list(range(17))  # four full blocks
    step(m, lambda: admit(m, "a", long))
    serials = [m.gpu.blocks[b].serial for b in m.block_table("a")[:4]]
    step(m, lambda: m.free("a"))
    assert sorted(host_serials(m).values()) == serials
    step(m, lambda: admit(m, "b", list(range(200, 229))))  # evicts every device block
    step(m, lambda: m.free("b"))
    # the first two blocks computed again without a lookup (as a recomputed request whose
    # prefix was evicted from the device computes them)
    step(m, lambda: m.allocate("c", long[:9], 9, block_hashes=m.hash_blocks(long[:9])))
    assert [m.gpu.blocks[b].serial for b in m.block_table("c")[:2]] == serials[:2]
    hit = m.lookup(long + [0], m.hash_blocks(long + [0]))
    assert hit.block_ids == tuple(m.block_table("c")[:2]) and len(hit.host_block_ids) == 2


def test_a_candidate_reused_as_a_destination_in_the_same_plan_is_dropped():
    """A plan never names a block as both source and destination: a freed block that the
    same plan swaps into is not copied out first."""
    m = manager(num_gpu=3)
    step(m, lambda: admit(m, "x", B[:5]))
    _, ops = step(m, lambda: m.swap_out(["x"]))
    assert pairs(ops.swap_out) == [(0, 0), (1, 1)]
    step(m, lambda: admit(m, "a", A[:9]))
    assert m.block_table("a") == [2, 1, 0]
    # freed outside a step with no plan in flight: free at once, and the swap-in of x
    # takes a's block 1 (full, cached) as a destination before the plan copies it out
    m.free("a")
    _, ops = step(m, lambda: m.swap_in(["x"]))
    assert pairs(ops.swap_in) == [(0, 0), (1, 1)]
    assert pairs(ops.swap_out) == [(2, 2)]  # a's block 2 goes; block 1 is dropped
    assert m.stats().num_offloads_dropped == 1


def test_swap_space_comes_first():
    """Host entries are free CPU blocks: a preempted group's swap-out takes them (least
    recently used first)."""
    m = manager(num_gpu=8, num_cpu=3)
    step(m, lambda: admit(m, "a", A))
    step(m, lambda: m.free("a"))
    assert len(m.cpu.cached) == 3 and m.cpu.num_free == 3
    step(m, lambda: admit(m, "b", B[:9]))
    assert m.block_table("b") == [4, 5, 6] and m.can_swap_out(["b"])
    _, ops = step(m, lambda: m.swap_out(["b"]))
    assert pairs(ops.swap_out) == [(4, 0), (5, 1), (6, 2)]
    assert m.is_swapped("b") and not m.cpu.cached
    assert m.lookup(A, m.hash_blocks(A)).host_block_ids == ()


def test_host_blocks_read_by_a_plan_in_flight_are_not_reused():
    m = manager()
    for n, op in enumerate((lambda: admit(m, "a", A), lambda: m.free("a"),
                            lambda: admit(m, "b", B), lambda: m.free("b")), start=1):
        step(m, op, sent=n)
        m.plan_answered(n)
    assert m.cpu.free_block_ids() == [6, 7, 0, 1, 2, 3, 4, 5]
    (hit, _), ops = step(m, lambda: admit(m, "a2", A + [7]), sent=5)
    assert pairs(ops.swap_in) == [(2, 0), (1, 1), (0, 2)]
    # plan 5 is in flight: the CPU blocks it reads are not free to take
    assert m.cpu.free_block_ids() == [6, 7, 3, 4, 5]
    m.plan_answered(5)
    assert m.cpu.free_block_ids() == [6, 7, 3, 4, 5, 2, 1, 0]


def test_a_stale_host_hit_raises():
    m = manager(num_gpu=4, num_cpu=3)
    C = list(range(300, 313))
    step(m, lambda: admit(m, "b", B))
    step(m, lambda: m.free("b"))  # B's three full blocks: the whole host
    step(m, lambda: admit(m, "c", C))  # evicts B from the device
    stale = m.lookup(B, m.hash_blocks(B))
    assert stale.block_ids == () and stale.host_block_ids == (2, 1, 0)
    step(m, lambda: m.free("c"))  # C's blocks replace B's on the host
    assert m.lookup(B, m.hash_blocks(B)).host_block_ids == ()
    with pytest.raises(InvariantError, match="stale prefix hit"):
        m.allocate("b2", B, len(B) - stale.num_tokens, hit=stale,
                   block_hashes=m.hash_blocks(B))


@pytest.mark.parametrize("kw", [dict(enable_offloading=False),
                                dict(enable_prefix_caching=False), dict(num_cpu=0)])
def test_off(kw):
    m = manager(**kw)
    step(m, lambda: admit(m, "a", A))
    _, ops = step(m, lambda: m.free("a"))
    assert not len(ops.swap_out) and not m.cpu.cached and not m.enable_offloading


def test_reset_forgets_what_no_request_holds_on_both_tiers():
    m = manager(num_gpu=8, enable_kv_events=True)
    step(m, lambda: admit(m, "a", A))
    step(m, lambda: m.free("a"))  # A's 3 full blocks: free on the device, copied to the host
    step(m, lambda: admit(m, "b", B))  # B runs: its 3 full blocks are held
    assert m.block_table("b") == [4, 5, 6, 7] and len(m.cpu.cached) == 3
    hashes_a = m.hash_blocks(A)
    hit = m.lookup(A, hashes_a)
    assert hit.block_ids == (0, 1, 2)
    assert m.pin("w", hit).block_ids == (0, 1)  # a waiting request's pin (the cap: 2 blocks)
    m.take_events()
    assert m.reset_prefix_cache() == 3  # B's blocks stay: B goes on reading them
    assert m.pinned("w") is None and m.stats().num_pinned_blocks == 0
    assert sorted(b.block_id for b in m.gpu.cached.values()) == m.block_table("b")[:3]
    assert not m.cpu.cached and len(m.lookup(A, hashes_a)) == 0
    assert [(e.kind, e.device, e.block_hash, e.block_id) for e in m.take_events()] == [
        ("removed", "gpu", h, i) for i, h in enumerate(hashes_a)]  # the host has no events
    assert len(m.lookup(B + [9], m.hash_blocks(B + [9]))) == 3
    m.check_invariants()
    step(m, lambda: m.free("b"))
    assert m.reset_prefix_cache() == 0 and not m.gpu.cached and not m.cpu.cached
    st = m.stats()
    assert st.gpu.num_free_blocks == 8 and st.cpu.num_free_blocks == 8
