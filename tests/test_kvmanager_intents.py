"""Intended prefixes (kvmanager/intents.py): exact expectations on what routing and the
scheduler see of blocks that live requests will compute but that are not cached yet."""

from __future__ import annotations

import pytest
from pagedserve.kvmanager import InvariantError, KVCacheManager

BS = 4
P = list(range(100, 112))  # a 3-block prefix


def make(num_gpu=32, num_cpu=8, **kw):
    kw.setdefault("watermark", 0.0)
    kw.setdefault("debug_checks", True)
    return KVCacheManager(num_gpu, num_cpu, BS, **kw)


def seen(m, tokens, salt=None, **kw):
    """(cached tokens, intended tokens past them) of a prompt, as routing sees it."""
    hashes = m.hash_blocks(tokens, cache_salt=salt)
    hit = m.lookup(tokens, hashes, salt)
    return hit.num_tokens, m.intended_tokens(tokens, hashes, salt, len(hit), **kw)


def test_a_waiting_request_makes_its_prefix_visible_and_counted_once():
    m = make()
    a = P + [1, 2, 3, 4, 5]  # 4 full blocks and a tail of 1
    assert m.intend("a", a, m.hash_blocks(a), order=(0, 1)) == 17
    assert m.num_intended_tokens == 17
    assert seen(m, P + [9, 9]) == (0, 12)  # follows a through the prefix, not past it
    assert seen(m, a + [7]) == (0, 16)  # every full block of a
    assert seen(m, a) == (0, 16)  # at most (len - 1) // block_size blocks, like lookup
    assert seen(m, [100, 101, 102, 7] + P[4:]) == (0, 0)  # diverges in block 0
    assert seen(m, P + [9], salt="s") == (0, 0)  # another salt shares nothing
    b = P + [6, 6, 6, 6]
    assert m.intend("b", b, m.hash_blocks(b), order=(0, 2)) == 16
    assert m.num_intended_tokens == 17 + 4  # the shared prefix counted once
    assert m.drop_intent("a") and not m.drop_intent("a")
    assert m.num_intended_tokens == 16 and seen(m, a + [7]) == (0, 12)  # b still holds P
    m.free("b")  # a waiting request's free drops its intent (no blocks, no pin)
    assert m.num_intended_tokens == 0 and m.intent_ids() == []
    with pytest.raises(InvariantError):
        m.free("b")


def test_intent_skips_the_cached_prefix_and_registered_blocks_leave_the_index():
    m = make()
    cached = P + [1]
    m.allocate("c", cached, len(cached), block_hashes=m.hash_blocks(cached))  # P registered
    a = P + [1, 2, 3, 4, 5, 6, 7]
    assert m.intend("a", a, m.hash_blocks(a)) == 4 + 3  # block 3 and a tail of 3
    assert seen(m, a + [0]) == (12, 4)
    # Chunked prefill of a: the chunk's blocks register when its plan is sent.
    m.begin_step()
    hashes = m.hash_blocks(a)
    hit = m.lookup(a, hashes)
    assert m.allocate("a", a, 4, hit=hit, block_hashes=hashes) == [4]  # c holds 0-3
    assert seen(m, a + [0]) == (12, 4)  # dirty, not registered: still intended
    m.end_step(1)
    assert seen(m, a + [0]) == (16, 0)
    assert m.num_intended_tokens == 3 and m.has_intent("a")  # the tail is still to come
    m.begin_step()
    m.allocate("a", a, 3)
    m.end_step(2)
    assert not m.has_intent("a") and m.num_intended_tokens == 0  # scheduled through its end


def test_a_chunked_admission_intends_its_later_chunks():
    m = make()
    a = list(range(40, 60))  # 5 blocks
    hashes = m.hash_blocks(a)
    m.begin_step()
    assert m.allocate("a", a, 8, block_hashes=hashes) == [0, 1]
    m.end_step(1)
    assert seen(m, a + [1]) == (8, 12)  # two chunks cached, three intended
    m.plan_answered(1)
    m.begin_step()
    m.allocate("a", a, 12)
    m.end_step(2)
    assert seen(m, a + [1]) == (20, 0) and m.intent_ids() == []


def test_same_plan_build_admissions_see_each_other():
    """Routing never runs inside a plan build, but the scheduler does: a request admitted
    earlier in the build is intended until end_step registers its blocks."""
    m = make()
    a = P + [1]
    m.intend("a", a, m.hash_blocks(a), order=(0, 1))
    m.begin_step()
    hashes = m.hash_blocks(a)
    m.allocate("a", a, len(a), block_hashes=hashes)
    assert seen(m, P + [2, 2]) == (0, 12)
    m.end_step(1)
    assert seen(m, P + [2, 2]) == (12, 0) and m.intent_ids() == []


def test_order_filter_and_exclude():
    m = make()
    a, b = P + [1], P + [2]
    m.intend("a", a, m.hash_blocks(a), order=(0, 5))
    m.intend("b", b, m.hash_blocks(b), order=(0, 7))
    assert seen(m, P + [3], before=(0, 6)) == (0, 12)  # a is ahead
    assert seen(m, P + [3], before=(0, 4)) == (0, 0)  # both behind it
    assert seen(m, b, before=(0, 7), exclude="b") == (0, 12)  # b behind a
    assert seen(m, a, before=(0, 5), exclude="a") == (0, 0)  # a first: computes it
    # An admitted intender is ahead of any waiting request, whatever its key.
    m.begin_step()
    m.allocate("b", b, 8, block_hashes=m.hash_blocks(b))  # chunk 1 of b
    m.end_step(1)
    assert seen(m, a, before=(0, 5), exclude="a") == (8, 4)


def test_release_on_swap_out_and_on_recompute_free():
    m = make()
    a = list(range(40, 60))
    m.intend("a", a, m.hash_blocks(a), order=(0, 1))
    m.begin_step()
    m.allocate("a", a, 8, block_hashes=m.hash_blocks(a))
    m.end_step(1)
    assert seen(m, a + [1]) == (8, 12)
    m.plan_answered(1)
    m.begin_step()
    assert m.swap_out(["a"]) is not None
    m.end_step(2)
    assert seen(m, a + [1]) == (8, 0) and m.intent_ids() == []
    m.plan_answered(2)
    m.free("a")
    m.check_invariants()


def test_a_colliding_hash_never_counts_as_intended():
    def weak(parent, token_ids, extra):
        return 7  # every block collides

    m = make(hash_fn=weak)
    a = P + [1]
    m.intend("a", a, m.hash_blocks(a))
    other = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert seen(m, other) == (0, 0)  # same hash, other tokens
    assert seen(m, P + [2]) == (0, 12)
    m.free("a")
    m.check_invariants()


def test_an_intended_block_computed_by_another_then_evicted_is_intended_again():
    """w waits for P + X; c computes P (its blocks register: P leaves the intended index,
    w is parked under it); c finishes, and a later allocation evicts P before w runs. From
    that step's end routing sees w's P as intended again, as it was before c."""
    m = make(num_gpu=6, num_cpu=0)
    w = P + [1, 2, 3, 4, 5]  # P (3 blocks) + 1 more full block + a tail of 1
    m.intend("w", w, m.hash_blocks(w), order=(0, 1))
    assert seen(m, w + [0]) == (0, 16) and m.num_intended_tokens == 17
    m.begin_step()
    c = P + [9]
    m.allocate("c", c, len(c), block_hashes=m.hash_blocks(c))
    m.end_step(1)
    assert seen(m, w + [0]) == (12, 4)  # P cached, the 4th block still intended
    assert m.num_intended_tokens == 4 + 1
    m.plan_answered(1)
    m.free("c")  # P stays cached (free, evictable)
    m.begin_step()
    big = list(range(200, 224))  # 6 blocks: evicts every cached block
    m.allocate("d", big, len(big))
    assert seen(m, w + [0]) == (0, 0)  # mid-step: P gone, not yet indexed again
    m.end_step(2)
    assert seen(m, w + [0]) == (0, 16) and m.num_intended_tokens == 17
    m.plan_answered(2)
    m.free("d")
    m.free("w")
    assert m.num_intended_tokens == 0
    m.check_invariants()


def test_a_parked_intender_released_leaves_nothing_behind():
    m = make(num_gpu=6, num_cpu=0)
    w = P + [1]
    m.intend("w", w, m.hash_blocks(w), order=(0, 1))
    m.begin_step()
    m.allocate("c", P + [9], 13, block_hashes=m.hash_blocks(P + [9]))
    m.end_step(1)
    assert m.drop_intent("w")  # parked under P's hashes: released from there too
    m.plan_answered(1)
    m.free("c")
    m.begin_step()
    m.allocate("d", list(range(200, 224)), 24)
    m.end_step(2)
    assert seen(m, P + [1, 0]) == (0, 0) and m.num_intended_tokens == 0
    m.check_invariants()
