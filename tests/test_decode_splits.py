"""The decode kernel's split-K paths against their twin and against each other, under
TRITON_INTERPRET=1 on CPU (natively on a GPU): split counts past the tiles (empty splits: no
partials written, none read), the fused reduction's counters, the last partial tile masked
in its own loop or the whole tiles' (the same bits), and the rotary with the new token's
cache write inside the launch (the same bits as the two launches). Split from
test_kernels.py (its helpers)."""

from __future__ import annotations

import pytest
import torch
from pagedserve.kernels import decode_attention, reference
from pagedserve.kernels.decode_attention import paged_decode_attention_triton
from pagedserve.kernels.testing import (
    make_paged_batch,
    rope_decode_inputs,
    rope_fused_and_two_launches,
)
from test_kernels import DEVICE, _close


@pytest.mark.parametrize(
    "num_splits, window, dtype",
    [(2, None, torch.float32), (3, None, torch.float16), (7, None, torch.float32),
     (16, None, torch.float32),  # more splits than tiles: empty splits must not count
     (3, 20, torch.float32), (4, 50, torch.bfloat16)],
)
@pytest.mark.parametrize("fused", [False, True], ids=["reduce-launch", "fused"])
def test_split_k_decode_matches_twin(num_splits, window, dtype, fused):
    batch = make_paged_batch(
        [(1, 97), (1, 1), (1, 37), (1, 200)], num_kv_heads=2, group=4, head_dim=80,
        block_size=16, dtype=dtype, device=DEVICE, seed=num_splits,
    )
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
            batch.scale)
    got = paged_decode_attention_triton(
        *args, sliding_window=window, num_splits=num_splits, block_n=16, fused_reduce=fused
    )
    want = reference.paged_decode_attention(*args, sliding_window=window)
    _close(got, want, dtype)


@pytest.mark.parametrize("num_splits, fused", [(8, True), (16, False), (33, False)])
def test_empty_splits_leave_no_partials_and_none_is_read(monkeypatch, num_splits, fused):
    """A short context through many splits (a decode graph's, counted from its table width):
    the splits past the context's tiles write no partial output, and neither reduction
    reads one — with every partial buffer starting as NaN, the output is still the twin's
    (a reduction that read an unwritten partial would be NaN: NaN * 0)."""
    batch = make_paged_batch(
        [(1, 97), (1, 1), (1, 37), (1, 20)], num_kv_heads=2, group=4, head_dim=64,
        block_size=8, dtype=torch.float32, device=DEVICE, seed=num_splits,
        extra_table_columns=60,
    )
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
            batch.scale)
    want = reference.paged_decode_attention(*args)
    empty = torch.empty

    def nan_empty(*shape, **kw):
        t = empty(*shape, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    got = paged_decode_attention_triton(*args, out=want.new_zeros(want.shape),
                                        num_splits=num_splits, block_n=16, fused_reduce=fused)
    monkeypatch.undo()
    assert not got.isnan().any()
    _close(got, want, torch.float32)


def test_fused_split_k_leaves_its_counters_at_zero():
    """The fused reduction's arrival counters are shared by every launch on the device:
    each launch must leave them as it found them, or the next one combines too early.
    Group 7 pads to 16 rows (masked rows in the combine); 5 splits of 16-token tiles leave
    the 20-token sequence's last splits empty."""
    batch = make_paged_batch(
        [(1, 150), (1, 20), (1, 77)], num_kv_heads=2, group=7, head_dim=64, block_size=8,
        dtype=torch.float32, device=DEVICE, seed=11,
    )
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
            batch.scale)
    want = reference.paged_decode_attention(*args)
    first = paged_decode_attention_triton(*args, num_splits=5, block_n=16, fused_reduce=True)
    counters = decode_attention._split_counters[first.device]
    assert int(counters.count_nonzero()) == 0
    again = paged_decode_attention_triton(*args, num_splits=5, block_n=16, fused_reduce=True)
    assert int(counters.count_nonzero()) == 0
    _close(first, want, torch.float32)
    assert torch.equal(first, again)


@pytest.mark.parametrize("num_splits, window, fused, dtype", [
    (1, None, None, torch.float32),
    (1, 20, None, torch.bfloat16),  # the window's first tile masked too
    (3, None, True, torch.float16),
    (4, 50, False, torch.float32),
    (16, None, True, torch.float32),  # empty splits
])
def test_decode_masking_every_tile_is_bit_identical(num_splits, window, fused, dtype):
    """``mask_every_tile``: the last partial tile read in the loop of the whole ones (all
    masked) gives the same output to the bit as the tail's own loop, and the twin's values.
    Lengths end inside a tile (97, 37, 200), on a tile's last token (64: no tail) and at 1."""
    batch = make_paged_batch(
        [(1, 97), (1, 1), (1, 37), (1, 200), (1, 64)], num_kv_heads=2, group=4, head_dim=80,
        block_size=8, dtype=dtype, device=DEVICE, seed=num_splits + 20,
    )
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
            batch.scale)
    launch = dict(sliding_window=window, num_splits=num_splits, block_n=16, fused_reduce=fused)
    apart = paged_decode_attention_triton(*args, mask_every_tile=False, **launch)
    every = paged_decode_attention_triton(*args, mask_every_tile=True, **launch)
    assert torch.equal(every, apart)
    _close(every, reference.paged_decode_attention(*args, sliding_window=window), dtype)


def test_decode_with_rope_masking_every_tile_is_bit_identical():
    """The rotary and cache write in the launch with every tile masked: the same output and
    caches as the two launches (each with every tile masked)."""
    inputs = rope_decode_inputs(2, 7, 64, torch.bfloat16, ROPE_SEQS, DEVICE)
    (out, kc, vc), (want, kc2, vc2) = rope_fused_and_two_launches(
        *inputs, num_splits=3, block_n=16, mask_every_tile=True)
    assert torch.equal(out, want)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


# Lengths 97, 37 and 200 end inside a 16-token tile, 64 on a tile's last token (an unmasked
# tile); window 5 puts the new token in the window's first (masked) tile.
ROPE_SEQS = [(1, 97), (1, 1), (1, 37), (1, 200), (1, 64)]


@pytest.mark.parametrize("kv_heads, group, head_dim, num_splits, window, dtype", [
    (2, 7, 64, 1, None, torch.float32),
    (2, 7, 64, 3, None, torch.float32),
    (2, 4, 80, 4, 50, torch.bfloat16),  # head dim 80: padded columns
    (3, 3, 64, 2, 5, torch.bfloat16),
    (1, 4, 16, 5, None, torch.float16),
])
def test_decode_with_the_rotary_and_cache_write_in_the_launch_is_bit_identical(
        kv_heads, group, head_dim, num_splits, window, dtype):
    """``rope=``: the attention kernel rotates q and the new k and writes the new keys and
    values at their slots itself; its output and both caches equal the two launches'
    (rotary_embedding_and_cache, then decode) bit for bit, split-K included; a padding row
    (slot -1) writes nothing."""
    inputs = rope_decode_inputs(kv_heads, group, head_dim, dtype, ROPE_SEQS, DEVICE)
    (out, kc, vc), (want, kc2, vc2) = rope_fused_and_two_launches(
        *inputs, num_splits=num_splits, block_n=16, sliding_window=window)
    assert torch.equal(out, want)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    batch = inputs[0]
    assert not torch.equal(kc, batch.key_cache)  # the new keys were written
