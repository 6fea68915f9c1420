"""The twins' per-forward memo (kernels/step_memo.py): inside one scope a step's metadata is
derived once and every layer gets the values a fresh derivation gives; outside a scope (and
in the next one) nothing is reused."""

from __future__ import annotations

import pytest
import torch
from pagedserve.kernels import decode_twin, reference, step_memo
from pagedserve.kernels.testing import make_paged_batch

from tests.test_kernels_reference import WIDE


def test_memo_computes_once_per_scope_and_tensor():
    calls = []
    a, b = torch.zeros(3), torch.zeros(3)

    def compute(tag):
        calls.append(tag)
        return len(calls)

    assert step_memo.memoized("x", (a,), lambda: compute("out")) == 1
    assert step_memo.memoized("x", (a,), lambda: compute("out")) == 2  # no scope: afresh
    with step_memo.forward_scope():
        first = step_memo.memoized("x", (a,), lambda: compute("a"))
        assert step_memo.memoized("x", (a,), lambda: compute("a")) == first == 3
        assert step_memo.memoized("x", (b,), lambda: compute("b")) == 4  # another tensor
        assert step_memo.memoized("y", (a,), lambda: compute("ya")) == 5  # another name
        with step_memo.forward_scope():  # nested: the outer memo
            assert step_memo.memoized("x", (a,), lambda: compute("a")) == 3
        assert step_memo.memoized("x", (a,), lambda: compute("a")) == 3
    with step_memo.forward_scope():  # the next forward derives again
        assert step_memo.memoized("x", (a,), lambda: compute("a2")) == 6
    assert calls == ["out", "out", "a", "b", "ya", "a2"]


def test_memo_scope_closes_on_an_exception():
    with pytest.raises(RuntimeError), step_memo.forward_scope():
        raise RuntimeError("a layer failed")
    assert step_memo._memo.values is None


@pytest.mark.parametrize("window,kv_dtype", [(None, None), (100, None),
                                             (None, torch.float8_e4m3fn)])
def test_layers_in_one_scope_equal_fresh_calls(window, kv_dtype):
    """Two 'layers' (two caches) of a grouped decode step and a cache write, in one scope,
    equal the same calls made apart, bit for bit; and the scope derives the grouping once."""
    batch = make_paged_batch(WIDE, num_kv_heads=2, group=3, head_dim=64, block_size=16,
                             seed=3, dtype=torch.bfloat16, kv_dtype=kv_dtype)
    tables, lens = batch.block_tables, batch.seq_lens
    # a second layer: the same step's metadata, its own query and cache contents
    layers = [(batch.query, batch.key_cache, batch.value_cache),
              (batch.query.flip(1).contiguous(), batch.value_cache.flip(0).contiguous(),
               batch.key_cache.flip(0).contiguous())]

    def layer(query, key_cache, value_cache):
        return reference.paged_decode_attention(query, key_cache, value_cache, tables, lens,
                                                batch.scale, sliding_window=window)

    apart = [layer(*args) for args in layers]
    derived = []
    real = decode_twin._decode_parts

    def counted(*args):
        derived.append(1)
        return real(*args)

    decode_twin._decode_parts = counted
    try:
        with step_memo.forward_scope():
            together = [layer(*args) for args in layers]
    finally:
        decode_twin._decode_parts = real
    assert len(derived) == 1
    for got, want in zip(together, apart, strict=True):
        assert torch.equal(got, want)


def test_cache_write_in_a_scope_skips_padding_slots():
    """The memoized slots of a step with padding (-1) write only the real tokens, into every
    layer's cache, as the unscoped write does."""
    torch.manual_seed(0)
    caches = [torch.zeros(4, 2, 1, 8) for _ in range(4)]  # two layers' keys and values
    key, value = torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    slots = torch.tensor([5, -1, 2])
    with step_memo.forward_scope():
        reference.reshape_and_cache(key, value, caches[0], caches[1], slots)
        reference.reshape_and_cache(key * 2, value * 2, caches[2], caches[3], slots)
    for i, scale in ((0, 1), (2, 2)):
        flat_k, flat_v = caches[i].view(8, 1, 8), caches[i + 1].view(8, 1, 8)
        assert torch.equal(flat_k[5], key[0] * scale) and torch.equal(flat_k[2], key[2] * scale)
        assert torch.equal(flat_v[5], value[0] * scale)
        assert flat_k.abs().sum((1, 2)).nonzero().flatten().tolist() == [2, 5]


@pytest.mark.parametrize("window", [None, 64])
def test_mixed_step_layers_in_one_scope_equal_fresh_calls(window):
    """Two 'layers' of a mixed step (decodes, whole prompts, chunks after cached tokens) in
    one scope equal the same calls made apart, bit for bit; the scope splits the step once
    and derives its decodes' parts once (they are a selection of the step's tables)."""
    from pagedserve.kernels import prefill_twin

    seqs = [(1, 300), (40, 40), (1, 90), (17, 60), (33, 33), (1, 700), (1, 12), (5, 5)]
    batch = make_paged_batch(seqs, num_kv_heads=2, group=3, head_dim=64, block_size=16,
                             seed=4, dtype=torch.bfloat16)
    layers = [(batch.query, batch.key_cache, batch.value_cache),
              (batch.query.flip(1).contiguous(), batch.value_cache.flip(0).contiguous(),
               batch.key_cache.flip(0).contiguous())]

    def layer(query, key_cache, value_cache):
        return reference.paged_prefill_attention(
            query, key_cache, value_cache, batch.block_tables, batch.query_start_loc,
            batch.seq_lens, batch.scale, sliding_window=window)

    apart = [layer(*args) for args in layers]
    counts = {"split": 0, "parts": 0}
    real_split, real_parts = prefill_twin._split_step, decode_twin._decode_parts

    def split(*args):
        counts["split"] += 1
        return real_split(*args)

    def parts(*args):
        counts["parts"] += 1
        return real_parts(*args)

    prefill_twin._split_step, decode_twin._decode_parts = split, parts
    try:
        with step_memo.forward_scope():
            together = [layer(*args) for args in layers]
    finally:
        prefill_twin._split_step, decode_twin._decode_parts = real_split, real_parts
    assert counts == {"split": 1, "parts": 1}
    for got, want in zip(together, apart, strict=True):
        assert torch.equal(got, want)
