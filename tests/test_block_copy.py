"""kernels/block_copy.py: host block copies by runs equal the twins' indexed copies."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedserve.kernels import block_copy, ops, reference


def test_block_runs_exact():
    assert block_copy.block_runs(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == []
    assert block_copy.block_runs(np.array([4]), np.array([9])) == [(4, 9, 1)]
    # runs break where either side's next id is not the previous one plus one
    src = np.array([3, 4, 5, 9, 10, 11, 2])
    dst = np.array([0, 1, 2, 3, 5, 6, 7])
    assert block_copy.block_runs(src, dst) == [(3, 0, 3), (9, 3, 1), (10, 5, 2), (2, 7, 1)]
    assert block_copy.block_runs(np.array([7, 6]), np.array([0, 1])) == [(7, 0, 1), (6, 1, 1)]


def _cache(num_blocks: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 2, num_blocks, 4, 2, 8, generator=g).to(dtype)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_swap_by_runs_equals_the_twin(data):
    n_src, n_dst = 12, 10
    k = data.draw(st.integers(0, n_dst))
    dst = data.draw(st.permutations(range(n_dst)))[:k]
    src = data.draw(st.lists(st.integers(0, n_src - 1), min_size=k, max_size=k))
    mapping = torch.tensor(list(zip(src, dst, strict=True)), dtype=torch.int64).view(-1, 2)
    src_cache = _cache(n_src)
    got, want = _cache(n_dst, seed=1), _cache(n_dst, seed=1)
    ops.swap_blocks(src_cache, got, mapping)
    reference.swap_blocks(src_cache, want, mapping)
    assert torch.equal(got, want)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_copy_on_write_by_runs_equals_the_twin(data):
    """Sources and destinations in one cache, overlapping or not (an overlap takes the
    twin's gather-then-scatter order)."""
    n = 10
    k = data.draw(st.integers(0, n))
    dst = data.draw(st.permutations(range(n)))[:k]
    src = data.draw(st.lists(st.integers(0, n - 1), min_size=k, max_size=k))
    mapping = torch.tensor(list(zip(src, dst, strict=True)), dtype=torch.int64).view(-1, 2)
    got, want = _cache(n), _cache(n)
    ops.copy_blocks(got, mapping)
    reference.copy_blocks(want, mapping)
    assert torch.equal(got, want)


def test_overlapping_copy_reads_before_it_writes():
    cache = _cache(4)
    before = cache.clone()
    ops.copy_blocks(cache, torch.tensor([[0, 1], [1, 2]]))  # block 1 read, then written
    assert torch.equal(cache[:, :, 1], before[:, :, 0])
    assert torch.equal(cache[:, :, 2], before[:, :, 1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.uint8])
def test_strided_views_and_dtypes(dtype):
    """Block-major bytes (the wire's order) viewed in the cache layout, both ways."""
    cache = _cache(6, torch.float32).to(dtype) if dtype != torch.uint8 \
        else torch.randint(0, 255, (3, 2, 6, 4, 2, 8), dtype=torch.uint8)
    out = torch.empty((3, *cache.shape[:2], *cache.shape[3:]), dtype=dtype)
    block_copy.copy_blocks_by_runs(cache, out.movedim(0, 2), np.array([5, 1, 2]),
                                   np.arange(3))
    for i, b in enumerate((5, 1, 2)):
        assert torch.equal(out[i].view(torch.uint8), cache[:, :, b].view(torch.uint8))
    back = torch.zeros_like(cache)
    block_copy.copy_blocks_by_runs(out.movedim(0, 2), back, np.arange(3), np.array([0, 3, 4]))
    assert torch.equal(back[:, :, 3].view(torch.uint8), cache[:, :, 1].view(torch.uint8))
    assert torch.equal(back[:, :, 4].view(torch.uint8), cache[:, :, 2].view(torch.uint8))
    assert not back[:, :, [1, 2, 5]].view(torch.uint8).any()
