"""KV-cache manager: copy-on-write and swap, with exact expectations (block ids, copy and
swap pairs). Split from test_kvmanager.py, whose helpers it uses."""

from __future__ import annotations

import pytest
from pagedserve.kvmanager import InvariantError
from test_kvmanager import admit, make

# ------------------------------------------------------------------ copy-on-write


def test_fork_and_copy_on_write():
    m = make()
    m.allocate("a", [1] * 6, 6)  # blocks 0, 1 (block 1 half full)
    m.take_table_change("a")
    m.fork("a", "b")
    assert [m.gpu.blocks[i].ref_cnt for i in (0, 1)] == [2, 2]
    assert m.take_table_change("b") == (0, [0, 1])
    assert m.allocate("b", [1] * 6 + [2], 1) == [2]
    assert m.block_table("b") == [0, 2]
    assert m.take_table_change("b") == (1, [2])
    assert m.take_block_ops().copy.tolist() == [[1, 2]]
    # the parent's write into block 1 needs no copy any more
    assert m.allocate("a", [1] * 6 + [3], 1) == []
    assert m.block_table("a") == [0, 1]
    assert m.take_table_change("a") == (2, [])
    assert m.take_block_ops().copy.shape == (0, 2)
    assert [m.gpu.blocks[i].ref_cnt for i in (0, 1, 2)] == [2, 1, 1]


def test_fork_at_block_boundary_needs_no_copy():
    m = make()
    m.allocate("a", [1] * 8, 8)
    m.fork("a", "b")
    assert m.allocate("b", [1] * 9, 1) == [2]
    assert m.allocate("a", [1] * 9, 1) == [3]
    assert m.take_block_ops().copy.shape == (0, 2)


# ------------------------------------------------------------------ swap


def test_swap_group_keeps_sharing_and_copies_blocks_held_by_others():
    m = make()
    admit(m, "a", list(range(10)))  # 0, 1, 2 (0 and 1 cached)
    m.fork("a", "b")
    m.allocate("b", list(range(10)) + [5], 1)  # CoW of block 2 -> 3
    m.take_block_ops()
    admit(m, "c", list(range(8)) + [7])  # hits 0, 1; new block 4
    assert m.can_swap_out(["a", "b"])
    pairs = m.swap_out(["a", "b"])
    assert pairs == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert m.block_table("a") == [0, 1, 2] and m.block_table("b") == [0, 1, 3]
    assert [m.cpu.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    # 0 and 1 stay with c (copied); 2 and 3 were moved (freed: a, then b); 4 is c's
    assert [m.gpu.blocks[i].ref_cnt for i in range(5)] == [1, 1, 0, 0, 1]
    assert m.gpu.free_block_ids()[-2:] == [2, 3]
    assert m.is_swapped("a")
    ops = m.take_block_ops()
    assert ops.swap_out.tolist() == [[0, 0], [1, 1], [2, 2], [3, 3]]
    with pytest.raises(InvariantError):
        m.allocate("a", list(range(11)), 1)
    assert m.can_swap_in(["a", "b"])
    pairs = m.swap_in(["a", "b"])
    assert pairs == [(0, 5), (1, 6), (2, 7), (3, 8)]
    assert m.block_table("a") == [5, 6, 7] and m.block_table("b") == [5, 6, 8]
    assert m.take_table_change("a") == (0, [5, 6, 7])
    assert m.take_block_ops().swap_in.tolist() == [[0, 5], [1, 6], [2, 7], [3, 8]]
    assert m.num_free_cpu_blocks == 8


def test_swap_out_none_when_cpu_short():
    m = make(16, 2)
    m.allocate("a", [1] * 12, 12)
    assert not m.can_swap_out(["a"])
    assert m.swap_out(["a"]) is None
    assert not m.is_swapped("a") and m.num_free_cpu_blocks == 2


def test_swap_out_reads_a_pending_copy_source():
    m = make()
    m.allocate("a", [1] * 6, 6)
    m.fork("a", "b")
    m.allocate("b", [1] * 7, 1)  # copy (1, 2) queued
    pairs = m.swap_out(["b"])
    assert pairs == [(0, 0), (1, 1)]  # block 2 is written by the copy only after swap-out
    ops = m.take_block_ops()
    assert ops.copy.tolist() == [[1, 2]]


def test_a_copy_of_a_block_swapped_in_by_the_same_plan_reads_its_cpu_source():
    """Two samples share a partial block; swapped out, then back in, and the first one
    writes into the shared block in the same plan: its copy comes from the CPU block the
    plan swaps in, not from the device block the plan swaps into (DESIGN: a plan never
    names a block as both a source and a destination)."""
    m = make()
    m.allocate("a", [1] * 6, 6)  # blocks 0, 1 (1 partial)
    m.fork("a", "b")
    assert m.swap_out(["a", "b"]) == [(0, 0), (1, 1)]
    m.take_block_ops()
    m.begin_step()
    assert m.swap_in(["a", "b"]) == [(0, 2), (1, 3)]
    assert m.allocate("a", [1] * 7, 1) == [4]  # block 3 is shared: copy-on-write
    ops = m.take_block_ops()
    assert ops.swap_in.tolist() == [[0, 2], [1, 3], [1, 4]] and ops.copy.tolist() == []
    m.end_step()
    assert m.block_table("a") == [2, 4] and m.block_table("b") == [2, 3]
