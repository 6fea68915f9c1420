"""KV-cache manager: exact expectations (block ids, queue order, copy and swap pairs)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedserve.kvmanager import (
    InvariantError,
    KVCacheManager,
    builtin_block_hash,
    get_hash_fn,
)


def make(num_gpu=16, num_cpu=8, block_size=4, **kw):
    kw.setdefault("watermark", 0.0)
    kw.setdefault("debug_checks", True)
    return KVCacheManager(num_gpu, num_cpu, block_size, **kw)


def admit(m, rid, tokens, salt=None, pin=False):
    hashes = m.hash_blocks(tokens, cache_salt=salt)
    hit = m.lookup(tokens, hashes, cache_salt=salt)
    if pin:
        hit = m.pin(rid, hit)
    new = m.allocate(rid, tokens, len(tokens) - hit.num_tokens, hit=hit, block_hashes=hashes,
                     cache_salt=salt)
    return hit, new


# ------------------------------------------------------------------ prefix caching


def test_prefix_hit_across_requests_and_refcounts():
    m = make()
    hit, new = admit(m, "a", list(range(10)))
    assert (hit.num_tokens, new) == (0, [0, 1, 2])
    hit, new = admit(m, "b", list(range(8)) + [99, 98, 97])
    assert hit.block_ids == (0, 1) and hit.num_tokens == 8
    assert new == [3]
    assert m.block_table("b") == [0, 1, 3]
    assert [m.gpu.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    s = m.stats()
    assert (s.prefix_query_tokens, s.prefix_hit_tokens) == (21, 8)


def test_prompt_exactly_filling_blocks_and_full_hit_leaves_one_token():
    m = make()
    tokens = list(range(8))
    admit(m, "a", tokens)
    assert m.block_table("a") == [0, 1]
    # the whole prompt is cached: the last block is dropped, 4 tokens remain to compute
    hit, new = admit(m, "b", tokens)
    assert hit.block_ids == (0,) and hit.num_tokens == 4
    assert new == [2]
    assert m.block_table("b") == [0, 2]
    # one more token than the cached prefix: the whole cached prefix is used
    hit, _ = admit(m, "c", tokens + [1])
    assert hit.block_ids == (0, 1)


def test_cache_salt_isolates():
    m = make()
    tokens = list(range(9))
    admit(m, "a", tokens, salt="alice")
    assert admit(m, "b", tokens, salt="bob")[0].num_tokens == 0
    assert admit(m, "c", tokens)[0].num_tokens == 0
    assert admit(m, "d", tokens, salt="alice")[0].block_ids == (0, 1)


def test_cached_blocks_stay_reusable_until_evicted():
    m = make(6)
    tokens = list(range(9))
    admit(m, "a", tokens)  # blocks 0, 1, 2; 0 and 1 cached
    m.free("a")
    assert m.gpu.free_block_ids() == [3, 4, 5, 2, 1, 0]
    assert m.stats().gpu.num_free_blocks == 6
    assert m.stats().gpu.num_cached_blocks == 2
    hit, new = admit(m, "b", tokens)
    assert hit.block_ids == (0, 1) and new == [3]
    m.free("b")
    # fill the device: fresh blocks first, then LRU: 2 (uncached) then 3, then cached 1
    assert m.allocate("c", [7] * 20, 20) == [4, 5, 2, 3, 1]
    assert m.stats().gpu.num_evictions == 1
    assert m.lookup(tokens, m.hash_blocks(tokens)).block_ids == (0,)


def test_prefix_caching_off():
    m = make(enable_prefix_caching=False)
    tokens = list(range(9))
    assert m.hash_blocks(tokens) == []
    admit(m, "a", tokens)
    assert admit(m, "b", tokens)[0].num_tokens == 0
    assert m.stats().gpu.num_cached_blocks == 0


def test_forced_collision_never_serves_wrong_blocks():
    def collide(parent, token_ids, extra):
        return 0  # every block of every prompt has the same hash

    m = make(hash_fn=collide)
    admit(m, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # another prompt: same hash, other tokens
    assert admit(m, "b", [9, 9, 9, 9, 1, 1, 1, 1, 1])[0].num_tokens == 0
    # same tokens at another position: block 0's tokens match but its chain does not
    hit, _ = admit(m, "c", [1, 2, 3, 4, 1, 2, 3, 4, 1])
    assert hit.block_ids == (0,)
    # a weak hash colliding across salts: salt roots keep them apart
    m2 = make(hash_fn=lambda p, t, e: hash(tuple(t)))
    admit(m2, "a", list(range(9)), salt="x")
    assert admit(m2, "b", list(range(9)), salt="y")[0].num_tokens == 0


def test_hash_algos():
    toks = list(range(16))
    for algo in ("sha256", "builtin"):
        m = make(hash_algo=algo)
        hs = m.hash_blocks(toks)
        assert len(hs) == 4 and len(set(hs)) == 4
        # incremental extension hashes only the new blocks, with the same chain
        part = m.hash_blocks(toks[:9])
        assert m.hash_blocks(toks, block_hashes=part) is part and part == hs
        assert m.hash_blocks(toks, cache_salt="s")[0] != hs[0]
        assert m.hash_blocks(toks, cache_salt="s")[1] != hs[1]
    assert get_hash_fn("builtin") is builtin_block_hash
    with pytest.raises(ValueError):
        get_hash_fn("md5")


# ------------------------------------------------------------------ allocation


def test_none_when_short_leaves_no_trace():
    m = make(4)
    admit(m, "a", list(range(9)))
    before = (m.gpu.free_block_ids(), m.stats())
    assert m.allocate("b", list(range(100, 108)), 8) is None
    assert not m.has_request("b")
    assert m.allocate("a", list(range(9)) + [1] * 8, 8) is None
    assert m.num_tokens("a") == 9 and m.block_table("a") == [0, 1, 2]
    assert (m.gpu.free_block_ids(), m.stats()) == before


def test_watermark_for_admissions_only():
    m = make(100, watermark=0.1)
    assert m.watermark_blocks == 10
    assert m.allocate("big", [1] * 364, 364) is None  # 91 blocks
    assert len(m.allocate("big", [1] * 360, 360)) == 90
    assert m.allocate("small", [2], 1) is None  # admission would eat the watermark
    # a running request's appends may use the watermark blocks
    assert m.allocate("big", [1] * 400, 40) == list(range(90, 100))
    assert m.num_free_gpu_blocks == 0
    assert m.can_ever_fit(360) and not m.can_ever_fit(361)


def test_lookahead_and_table_changes():
    m = make()
    assert m.allocate("a", [1] * 5, 5, lookahead=3) == [0, 1]
    assert m.take_table_change("a") == (0, [0, 1])
    assert m.take_table_change("a") == (2, [])
    assert m.allocate("a", [1] * 8, 3) == []  # the lookahead slots are used
    assert m.allocate("a", [1] * 9, 1) == [2]
    assert m.take_table_change("a") == (2, [2])


def test_slot_mapping_vectorised():
    m = make()
    m.allocate("a", [1] * 3, 3)
    m.allocate("b", [1] * 10, 10)  # blocks 1, 2, 3
    sm = m.slot_mapping("b", 2, 8)
    assert sm.dtype == np.int64
    assert sm.tolist() == [6, 7, 8, 9, 10, 11, 12, 13]
    assert m.slot_mapping("b", 9, 1).tolist() == [13]
    assert m.slot_mapping("b", 0, 0).shape == (0,)
    with pytest.raises(InvariantError):
        m.slot_mapping("b", 10, 3)


def test_allocate_decode_gives_the_slot_and_table_change():
    m = make(4)
    m.allocate("a", [1] * 3, 3)  # block 0, 3 of 4 slots
    assert m.allocate_decode("a", [1] * 4) == (0, [0], 3)  # first entry: whole table
    assert m.allocate_decode("a", [1] * 5) == (1, [1], 4)  # a new block
    assert m.allocate_decode("a", [1] * 6) == (2, [], 5)  # no change
    m.fork("a", "b")
    assert m.allocate_decode("b", [1] * 7) == (0, [0, 2], 10)  # copy-on-write of block 1
    assert m.take_block_ops().copy.tolist() == [[1, 2]]
    m.allocate("c", [2] * 4, 4)  # the last free block
    assert m.allocate_decode("b", [1] * 8) == (2, [], 11)
    before = (m.gpu.free_block_ids(), m.stats(), m.block_table("b"))
    assert m.allocate_decode("b", [1] * 9) is None  # short of blocks: no trace
    assert (m.gpu.free_block_ids(), m.stats(), m.block_table("b")) == before
    with pytest.raises(InvariantError):
        m.allocate_decode("nobody", [1])


def test_steady_decode_state_names_the_slot_base_and_where_the_block_ends():
    """(state, num_tokens, slot_base, block_end, table_len, register_at), exactly; block
    end 0 where the next decode is not steady."""
    m = make(8, block_size=4)
    toks = [1, 2, 3, 4, 5, 6]
    m.allocate("a", toks, 6)  # blocks 0, 1; block 0 full (registered), 6 slots
    state = m._reqs["a"]
    assert m.steady_decode_state("a", toks) == (state, 6, 0, 0, 2, 0)  # a change to send
    m.take_table_change("a")
    # position 6 is in table block 1 (block id 1): slot base (1 - 1) * 4, block ends at 8;
    # the block registers once 8 tokens are known
    assert m.steady_decode_state("a", toks) == (state, 6, 0, 8, 2, 8)
    assert m.steady_decode_state("a", list(toks)) == (state, 6, 0, 0, 2, 0)  # another list
    m.advance_steady_decodes([state], [7])
    assert m.num_tokens("a") == 7 and m.slot("a", 6) == 6
    m.advance_steady_decodes([state], [8])
    assert m.steady_decode_state("a", toks)[3] == 0  # the next slot needs a block
    btoks = [9] * 3
    m.allocate("b", btoks, 3)  # block 2
    m.take_table_change("b")
    m.fork("b", "c")  # its last block shared: a write copies it
    assert m.steady_decode_state("b", btoks)[3] == 0
    m.free("c")
    assert m.steady_decode_state("b", btoks)[1:4] == (3, 8, 4)  # block id 2, table block 0
    assert m.steady_decode_state("nobody", toks) == (None, 0, 0, 0, 0, 0)
    off = make(8, block_size=4, enable_prefix_caching=False)
    off.allocate("a", toks, 6)
    off.take_table_change("a")
    assert off.steady_decode_state("a", toks)[5] > 10 ** 12  # never registers


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["decode", "fork", "free", "admit"]),
                          st.integers(0, 3)), max_size=60))
def test_allocate_decode_is_allocate_then_take_decode_entry(ops):
    """Two managers driven alike, one decoding with `allocate_decode`, the other with
    `allocate(..., 1)` and `take_decode_entry` at the slot allocated: the same answers and
    the same state after every operation (new blocks, copy-on-write, short of blocks)."""
    a, b = make(10, block_size=4), make(10, block_size=4)
    tokens: dict[str, list[int]] = {}
    for n, (op, k) in enumerate(ops):
        rid = f"r{k}"
        if op == "admit" and rid not in tokens:
            toks = [k + 1] * (k * 3 + 1)
            got = (a.allocate(rid, toks, len(toks)), b.allocate(rid, toks, len(toks)))
            if got[0] is not None:
                tokens[rid] = toks
        elif op == "decode" and rid in tokens:
            toks = tokens[rid] + [n]
            pos = b.num_tokens(rid)
            want = None if b.allocate(rid, toks, 1) is None \
                else b.take_decode_entry(rid, pos)
            assert a.allocate_decode(rid, toks) == want
            if want is not None:
                tokens[rid] = toks
        elif op == "fork" and rid in tokens:
            child = f"c{n}"
            a.fork(rid, child)
            b.fork(rid, child)
            tokens[child] = list(tokens[rid])
        elif op == "free" and tokens:
            victim = sorted(tokens)[k % len(tokens)]
            a.free(victim)
            b.free(victim)
            del tokens[victim]
        for rid in tokens:
            assert a.block_table(rid) == b.block_table(rid)
        assert a.stats() == b.stats() and a.gpu.free_block_ids() == b.gpu.free_block_ids()
        assert a.take_block_ops().copy.tolist() == b.take_block_ops().copy.tolist()


# ------------------------------------------------------------------ pins


def test_pins_cap_conversion_and_release():
    m = make(16, max_pinned_fraction=0.25)  # at most 4 pinned blocks
    tokens = list(range(21))  # 5 full blocks, all can be hit (1 token left)
    admit(m, "a", tokens)
    m.free("a")
    hashes = m.hash_blocks(tokens)
    hit = m.lookup(tokens, hashes)
    assert hit.block_ids == (0, 1, 2, 3, 4)
    p1 = m.pin("x", m.lookup(tokens[:13], hashes))  # 3 blocks
    assert p1.block_ids == (0, 1, 2)
    p2 = m.pin("y", hit)  # only 1 left under the cap
    assert p2.block_ids == (0,) and p2.num_tokens == 4
    assert m.pin("z", hit).block_ids == ()
    assert m.stats().num_pinned_blocks == 4
    assert m.gpu.blocks[0].ref_cnt == 2
    # pinned blocks are not evictable: filling the device leaves them alone
    free = m.num_free_gpu_blocks
    assert free == 16 - 3
    filler = m.allocate("f", [9] * 4 * free, 4 * free)
    assert not set(filler) & {0, 1, 2}
    m.free("f")
    # conversion: allocate("x") takes over the pin's references, no window
    new = m.allocate("x", tokens[:13], 1, hit=None, block_hashes=m.hash_blocks(tokens[:13]))
    assert m.block_table("x")[:3] == [0, 1, 2] and len(new) == 1
    assert m.pinned("x") is None and m.stats().num_pinned_blocks == 1
    assert m.gpu.blocks[0].ref_cnt == 2  # x and the pin of y
    assert m.release_pins() == 1
    assert m.gpu.blocks[0].ref_cnt == 1
    assert not m.unpin("y")


def test_free_of_pinned_only_request_unpins():
    m = make()
    tokens = list(range(9))
    admit(m, "a", tokens)
    m.pin("b", m.lookup(tokens, m.hash_blocks(tokens)))
    m.free("b")
    assert m.stats().num_pinned_blocks == 0
    with pytest.raises(InvariantError):
        m.free("b")


def test_stale_hit_raises():
    m = make(4)
    tokens = list(range(9))
    admit(m, "a", tokens)
    hit = m.lookup(tokens, m.hash_blocks(tokens))
    m.free("a")
    m.allocate("f", [5] * 16, 16)  # evicts everything
    m.free("f")
    with pytest.raises(InvariantError, match="stale"):
        m.allocate("b", tokens, 1, hit=hit)
    assert m.pin("b", hit).block_ids == ()


# ------------------------------------------------------------------ step boundary


def test_freed_blocks_are_deferred_until_end_step():
    m = make(4)
    m.allocate("a", [1] * 8, 8)  # 0, 1
    m.begin_step()
    m.free("a")
    assert m.num_free_gpu_blocks == 2
    assert m.stats().gpu.num_free_blocks == 4  # held by nobody
    assert m.allocate("b", [2] * 8, 8) == [2, 3]
    assert m.allocate("c", [3], 1) is None  # 0 and 1 are not handed out in this plan
    m.end_step()
    assert m.gpu.free_block_ids() == [1, 0]
    assert m.allocate("c", [3], 1) == [1]


def test_deferred_cached_block_can_be_hit_in_the_same_step():
    m = make(4)
    tokens = list(range(9))
    admit(m, "a", tokens)
    m.begin_step()
    m.free("a")
    hit, new = admit(m, "b", tokens)
    assert hit.block_ids == (0, 1) and new == [3]
    m.end_step()
    assert m.gpu.free_block_ids() == [2]


def test_blocks_enter_the_cache_when_the_plan_is_sent():
    m = make()
    tokens = list(range(9))
    m.begin_step()
    admit(m, "a", tokens)
    assert admit(m, "b", tokens)[0].num_tokens == 0  # not computed yet: no hit
    m.end_step()
    assert admit(m, "c", tokens)[0].block_ids == (0, 1)


def test_request_preempted_in_its_step_registers_nothing_new():
    m = make()
    toks = list(range(7))
    m.allocate("a", toks, 7)  # outside a step: block 0 cached at once
    m.begin_step()
    toks.append(7)
    assert m.allocate("a", toks, 1) == []  # fills block 1
    assert m.swap_out(["a"]) == [(0, 0), (1, 1)]  # preempted before the plan ran
    m.end_step()
    probe = toks + [0]
    assert m.lookup(probe, m.hash_blocks(probe)).block_ids == (0,)
    assert m.swap_in(["a"]) == [(0, 2), (1, 3)]
    # recompute position 7 (its slot exists but was never computed)
    assert m.allocate("a", toks, 1, num_computed_tokens=7) == []
    assert m.num_tokens("a") == 8
    assert m.slot_mapping("a", 7, 1).tolist() == [15]
    assert m.lookup(probe, m.hash_blocks(probe)).block_ids == (0, 3)
    with pytest.raises(InvariantError):
        m.allocate("a", toks, 1, num_computed_tokens=9)
    # the same with free (recompute preemption)
    m.begin_step()
    m.allocate("b", [5] * 8, 8)
    m.free("b")
    m.end_step()
    assert m.lookup([5] * 9, m.hash_blocks([5] * 9)).num_tokens == 0


# ------------------------------------------------------------------ accounting


def test_events_and_stats():
    m = make(8, enable_kv_events=True)
    admit(m, "a", list(range(9)))
    ev = m.take_events()
    assert [(e.kind, e.block_id) for e in ev] == [("stored", 0), ("stored", 1)]
    assert m.take_events() == []
    m.free("a")
    m.allocate("f", [0] * 32, 32)
    ev = m.take_events()
    assert [(e.kind, e.block_id) for e in ev if e.kind == "removed"] == [("removed", 1),
                                                                        ("removed", 0)]
    assert sum(e.kind == "stored" for e in ev) == 8
    s = m.stats()
    assert s.gpu.num_total_blocks == 8 and s.gpu.num_free_blocks == 0
    assert s.gpu.usage_ratio == 1.0 and s.gpu.num_evictions == 2
    assert s.cpu.num_free_blocks == 8


def test_broken_invariants_raise_with_request_ids():
    m = make(debug_checks=False)
    m.allocate("a", [1] * 5, 5)
    with pytest.raises(InvariantError, match="unknown"):
        m.free("nope")
    m.gpu.blocks[1].ref_cnt += 1  # corrupt
    with pytest.raises(InvariantError) as e:
        m.check_invariants()
    assert e.value.request_ids == ("a",)
    m.gpu.blocks[1].ref_cnt = 0
    with pytest.raises(InvariantError):
        m.free("a")  # ref count would go negative
    m2 = make()
    with pytest.raises(InvariantError):
        m2.fork("nope", "x")
