"""The torch twins against dense causal attention on realistic sizes (CPU, fast).

8 sequences, up to ~500 tokens, head dim 128, GQA 4:1, block size 16: prefill with prefixes,
decode, sliding window. The twins are the oracle of the kernel tests, so they are checked here
against the plainest possible attention.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedserve.kernels import reference
from pagedserve.kernels.testing import make_paged_batch

SEQS = [(1, 1), (17, 17), (1, 511), (64, 300), (37, 97), (128, 128), (5, 480), (1, 33)]


def _dense(batch, window=None):
    outs = []
    starts = batch.query_start_loc.tolist()
    for i in range(len(batch.dense_keys)):
        q = batch.query[starts[i] : starts[i + 1]]
        if q.shape[0]:
            outs.append(reference.dense_causal_attention(
                q, batch.dense_keys[i], batch.dense_values[i], batch.scale, window))
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 64])
def test_prefill_twin_matches_dense(window):
    batch = make_paged_batch(SEQS, num_kv_heads=2, group=4, head_dim=128, block_size=16)
    got = reference.paged_prefill_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
        batch.query_start_loc, batch.seq_lens, batch.scale, sliding_window=window,
    )
    torch.testing.assert_close(got, _dense(batch, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 100])
def test_decode_twin_matches_dense(window):
    seqs = [(1, s) for _, s in SEQS]
    batch = make_paged_batch(seqs, num_kv_heads=2, group=4, head_dim=128, block_size=16, seed=1)
    out = torch.empty_like(batch.query)
    got = reference.paged_decode_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
        batch.scale, sliding_window=window, out=out,
    )
    assert got is out
    torch.testing.assert_close(got, _dense(batch, window), atol=1e-5, rtol=1e-5)


def test_twin_bf16_close_to_dense_fp32():
    batch = make_paged_batch(SEQS[:4], num_kv_heads=1, group=4, head_dim=128, block_size=16,
                             dtype=torch.bfloat16, seed=2)
    got = reference.paged_prefill_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
        batch.query_start_loc, batch.seq_lens, batch.scale,
    )
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), _dense(batch).float(), atol=2e-2, rtol=2e-2)


# A decode batch wide enough to be grouped by context length (_decode_groups), with lengths
# spread over several octaves, one row in a group of its own octave that is merged into the
# group before it, and a mixed step of the same decodes next to prefill chunks.
WIDE = [(1, n) for n in (700, 650, 640, 600, 580, 520, 500, 360, 351, 300, 290, 250, 200,
                         190, 181, 150, 120, 90, 64, 33, 17, 9, 3, 1)]


def test_decode_groups_split_by_octave_exactly():
    lens = torch.tensor([100] * 10 + [40] * 10)
    groups = reference._decode_groups(lens)
    assert [g.tolist() for g in groups] == [list(range(10)), list(range(10, 20))]
    # 8 rows below the longest octave plus 3 further down: the 3 join the last group
    lens = torch.tensor([100] * 9 + [40] * 8 + [5] * 3)
    assert [g.numel() for g in reference._decode_groups(lens)] == [9, 11]
    # too few rows for two groups: one group, in order
    assert [g.tolist() for g in reference._decode_groups(torch.arange(1, 13))] == [
        list(range(12))]


@given(st.lists(st.integers(0, 5000), min_size=1, max_size=300))
@settings(max_examples=200, deadline=None)
def test_decode_groups_partition_the_rows(lens):
    groups = reference._decode_groups(torch.tensor(lens))
    rows = sorted(r for g in groups for r in g.tolist())
    assert rows == list(range(len(lens)))
    assert len(groups) == 1 or all(g.numel() >= reference.DECODE_GROUP_MIN_SEQS for g in groups)


@pytest.mark.parametrize("window,dtype", [(None, torch.float32), (100, torch.float32),
                                          (None, torch.bfloat16)])
def test_grouped_decode_matches_dense(window, dtype):
    batch = make_paged_batch(WIDE, num_kv_heads=2, group=3, head_dim=64, block_size=16,
                             seed=3, dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert len(reference._decode_groups(batch.seq_lens.long())) > 1
    out = torch.empty_like(batch.query)
    got = reference.paged_decode_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
        batch.scale, sliding_window=window, out=out,
    )
    assert got is out and got.dtype == dtype
    torch.testing.assert_close(got.float(), _dense(batch, window).float(), atol=tol, rtol=tol)


def test_mixed_step_with_grouped_decodes_matches_dense():
    seqs = WIDE[:12] + [(64, 300), (128, 128)] + WIDE[12:] + [(5, 480)]
    batch = make_paged_batch(seqs, num_kv_heads=2, group=4, head_dim=32, block_size=16,
                             seed=4)
    got = reference.paged_prefill_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
        batch.query_start_loc, batch.seq_lens, batch.scale,
    )
    torch.testing.assert_close(got, _dense(batch), atol=1e-5, rtol=1e-5)


def test_decode_row_of_length_zero_reads_nothing():
    """A padding row (context 0, as CUDA-graph padding rows have) gets zeros; the rest are
    unaffected, in a grouped batch and in a small one."""
    for seqs in (WIDE, WIDE[:5]):
        batch = make_paged_batch(seqs, num_kv_heads=2, group=2, head_dim=32, block_size=16,
                                 seed=5)
        seq_lens = batch.seq_lens.clone()
        seq_lens[1] = 0
        got = reference.paged_decode_attention(
            batch.query, batch.key_cache, batch.value_cache, batch.block_tables, seq_lens,
            batch.scale)
        assert torch.count_nonzero(got[1]) == 0
        want = _dense(batch)
        keep = [i for i in range(len(seqs)) if i != 1]
        torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=1e-5)


def test_results_do_not_alias_the_scratch_buffers():
    """The gathers reuse per-thread buffers: a result stays as it was after later calls,
    larger and smaller, and threads computing at once get their own buffers."""
    small = make_paged_batch(WIDE[-6:], num_kv_heads=1, group=4, head_dim=32, block_size=8,
                             seed=6)
    large = make_paged_batch(WIDE, num_kv_heads=1, group=4, head_dim=32, block_size=8, seed=7)

    def decode(batch):
        return reference.paged_decode_attention(
            batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
            batch.seq_lens, batch.scale)

    first = decode(small)
    kept = first.clone()
    decode(large)
    decode(small)
    assert torch.equal(first, kept)

    want = {id(b): _dense(b) for b in (small, large)}
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda b: (b, decode(b)), [small, large] * 8))
    for batch, got in results:
        torch.testing.assert_close(got, want[id(batch)], atol=1e-5, rtol=1e-5)


def test_scratch_made_in_inference_mode_serves_calls_outside_it():
    """The executor runs in inference mode, tests and tools outside it, in one thread."""
    batch = make_paged_batch(WIDE, num_kv_heads=1, group=2, head_dim=16, block_size=8, seed=8)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
            batch.seq_lens, batch.scale)

    def fresh_thread(fn):
        with ThreadPoolExecutor(1) as pool:  # a thread of its own: its scratch starts empty
            return pool.submit(fn).result()

    def inside_then_outside():
        with torch.inference_mode():
            inside = reference.paged_decode_attention(*args)
        return inside.clone(), reference.paged_decode_attention(*args)

    inside, outside = fresh_thread(inside_then_outside)
    torch.testing.assert_close(outside, inside)
    torch.testing.assert_close(outside, _dense(batch), atol=1e-5, rtol=1e-5)


# Whole prompts of similar lengths (grouped into padded batches), a lone long one, a chunk
# after cached tokens and a decode, in one step.
FRESH_SEQS = [(8, 8), (1, 40), (9, 9), (8, 8), (12, 12), (40, 40), (5, 60), (37, 37),
              (33, 33), (2, 2), (3, 3), (100, 100)]


def _poison_unused_slots(batch, block_size: int) -> None:
    """NaN in every cache slot no sequence holds (what a padded batch reads and must mask)."""
    used = torch.zeros(batch.key_cache.shape[:2], dtype=torch.bool)
    for i, n in enumerate(batch.seq_lens.tolist()):
        for p in range(n):
            used[int(batch.block_tables[i, p // block_size]), p % block_size] = True
    batch.key_cache[~used] = float("nan")
    batch.value_cache[~used] = float("nan")


@pytest.mark.parametrize("dtype, block_size", [(torch.float32, 16), (torch.bfloat16, 8)])
def test_whole_prompts_batched_as_each_alone(dtype, block_size):
    """Whole prompts run in batches by padded length (prefill_twin._fresh_groups): every
    prompt's rows equal, to the bit, what it gets in a step of its own (batch invariance),
    with NaN in every slot a batch pads over; and dense attention's."""
    from pagedserve.kernels import prefill_twin

    batch = make_paged_batch(FRESH_SEQS, num_kv_heads=2, group=3, head_dim=64,
                             block_size=block_size, dtype=dtype, seed=7)
    _poison_unused_slots(batch, block_size)
    starts = batch.query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]
    whole = [i for i, (q, s) in enumerate(FRESH_SEQS) if q == s and q > 1]
    calls = [(g.tolist(), n) for g, n in prefill_twin._fresh_groups(torch.tensor(whole),
                                                                    q_lens)]
    assert calls == [([0, 2, 3, 4, 9, 10], 16), ([5, 7, 8], 48), ([11], 112)]
    args = (batch.key_cache, batch.value_cache)
    got = reference.paged_prefill_attention(
        batch.query, *args, batch.block_tables, batch.query_start_loc, batch.seq_lens,
        batch.scale)
    assert not got.isnan().any()
    for i in range(len(FRESH_SEQS)):
        a, b = int(starts[i]), int(starts[i + 1])
        alone = reference.paged_prefill_attention(
            batch.query[a:b], *args, batch.block_tables[i:i + 1],
            torch.tensor([0, b - a], dtype=torch.int32), batch.seq_lens[i:i + 1], batch.scale)
        assert torch.equal(got[a:b], alone), i
    if dtype == torch.float32:
        torch.testing.assert_close(got, _dense(batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("elements", [1, 64 * 2 * 64, 700 * 2 * 64 * 3])
def test_decode_parts_give_the_one_batch_values(monkeypatch, elements):
    """A decode batch attended in parts (a part as small as one row; three rows of the
    longest group; one part a group) equals it attended whole, bit for bit: each row is
    padded to its group's longest context whatever part it is in."""
    from pagedserve.kernels import decode_twin

    batch = make_paged_batch(WIDE, num_kv_heads=2, group=3, head_dim=64, block_size=16,
                             seed=5, dtype=torch.bfloat16)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
            batch.seq_lens, batch.scale)
    monkeypatch.setattr(decode_twin, "DECODE_PART_ELEMENTS", 1 << 40)
    whole = reference.paged_decode_attention(*args)
    groups = len(reference._decode_groups(batch.seq_lens.long()))
    assert len(decode_twin._decode_parts(batch.block_tables, batch.seq_lens,
                                         batch.key_cache, None)) == groups
    monkeypatch.setattr(decode_twin, "DECODE_PART_ELEMENTS", elements)
    parts = decode_twin._decode_parts(batch.block_tables, batch.seq_lens, batch.key_cache,
                                      None)
    assert len(parts) > groups
    assert sorted(r for p in parts for r in p.rows.tolist()) == list(range(len(WIDE)))
    if elements == 1:
        assert all(p.rows.numel() == 1 for p in parts)
    assert torch.equal(reference.paged_decode_attention(*args), whole)


@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn],
                         ids=str)
def test_decode_gathers_a_layers_keys_and_values_as_one(kv_dtype, window):
    """Key and value caches side by side in one tensor (a layer's ``kv_cache[layer]``, as
    the executor passes them) are gathered by one index_select: bit for bit the values of
    gathering them apart, with padding rows, grouped rows, and a batch in step (nothing
    masked: the fill skipped); the latter against dense attention too."""
    from pagedserve.kernels import decode_twin, kv_gather

    for seqs in (WIDE, [(1, 200)] * 3, [(1, 37)]):
        batch = make_paged_batch(seqs, num_kv_heads=2, group=3, head_dim=64, block_size=16,
                                 seed=7, kv_dtype=kv_dtype)
        slab = torch.stack((batch.key_cache, batch.value_cache))
        assert kv_gather._gather_pair(slab[0], slab[1], torch.zeros(1, dtype=torch.long),
                                      1, 1, slot=0) is not None
        assert kv_gather._gather_pair(batch.key_cache, batch.value_cache,
                                      torch.zeros(1, dtype=torch.long), 1, 1, slot=0) is None
        seq_lens = batch.seq_lens.clone()
        if len(seqs) > 3:
            seq_lens[2] = 0  # a padding row
        parts = decode_twin._decode_parts(batch.block_tables, seq_lens, slab[0], window)
        lens = seq_lens.tolist()
        in_step = len(set(lens)) == 1 and (window is None or lens[0] <= window)
        assert any(p.any_masked for p in parts) != in_step
        apart = reference.paged_decode_attention(
            batch.query, batch.key_cache, batch.value_cache, batch.block_tables, seq_lens,
            batch.scale, sliding_window=window)
        together = reference.paged_decode_attention(
            batch.query, slab[0], slab[1], batch.block_tables, seq_lens, batch.scale,
            sliding_window=window)
        assert torch.equal(together, apart)
        if in_step:
            torch.testing.assert_close(together, _dense(batch), atol=1e-5, rtol=1e-5)


SHORT = [(1, 300), (5, 480), (2, 2), (16, 97), (3, 40), (1, 1), (9, 700), (4, 17),
         (17, 120), (7, 7), (2, 600)]


@pytest.mark.parametrize("window,kv_dtype", [(None, torch.float32), (100, torch.float32),
                                             (None, torch.bfloat16),
                                             (None, torch.float8_e4m3fn)])
def test_short_chunks_batched_match_dense_and_the_fused_path(monkeypatch, window, kv_dtype):
    """Chunks of a few tokens after cached ones (drafted rows; 2-16 tokens, several lengths
    in one part so the shorter ones repeat their last query) beside decodes, whole prompts
    and a longer chunk: against dense attention, and close to the fused one-call-a-chunk
    path they replaced; parts as small as one sequence give the one-part values."""
    from pagedserve.kernels import decode_twin, prefill_twin

    dtype = torch.float32 if kv_dtype == torch.float32 else torch.bfloat16
    batch = make_paged_batch(SHORT, num_kv_heads=2, group=3, head_dim=64, block_size=16,
                             seed=11, dtype=dtype, kv_dtype=kv_dtype)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
            batch.query_start_loc, batch.seq_lens, batch.scale)
    split = prefill_twin._split_step(batch.block_tables, batch.query_start_loc,
                                     batch.seq_lens, batch.query.shape[0], batch.key_cache,
                                     window)
    short_rows = sum(p.written.numel() for p in split.short)
    assert short_rows == 5 + 16 + 3 + 9 + 4 + (2 if window is None else 2 + 2 + 7)
    assert any(p.keep is not None for p in split.short)  # lengths differ within a part
    got = reference.paged_prefill_attention(*args, sliding_window=window)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got, _dense(batch, window), atol=tol, rtol=tol)
    monkeypatch.setattr(prefill_twin, "SHORT_CHUNK_TOKENS", 0)
    fused = reference.paged_prefill_attention(*args, sliding_window=window)
    torch.testing.assert_close(got, fused, atol=tol, rtol=tol)
    monkeypatch.setattr(prefill_twin, "SHORT_CHUNK_TOKENS", 16)
    monkeypatch.setattr(decode_twin, "DECODE_PART_ELEMENTS", 1)
    assert torch.equal(reference.paged_prefill_attention(*args, sliding_window=window), got)


@pytest.mark.parametrize("window", [None, 100])
def test_decode_batch_of_one_group_out_of_length_order(window):
    """A batch that is one group by length, its rows not in length order (the group lists
    them sorted; the batch is attended whole, in its own order): against dense attention,
    and its parts' rows, tables and masks line up with the batch's rows."""
    from pagedserve.kernels import decode_twin

    lens = [85, 215, 20, 287, 83, 145, 194, 88, 51, 249, 3, 7, 100, 5, 290, 1]
    batch = make_paged_batch([(1, n) for n in lens], num_kv_heads=1, group=3, head_dim=16,
                             block_size=16, seed=9)  # small: one part
    groups = reference._decode_groups(batch.seq_lens.long())
    assert len(groups) == 1 and groups[0].tolist() != list(range(len(lens)))
    (part,) = decode_twin._decode_parts(batch.block_tables, batch.seq_lens, batch.key_cache,
                                        window)
    assert part.rows is None
    assert part.masked.flatten(1).logical_not().sum(1).tolist() == [
        min(n, window or n) for n in lens]
    got = reference.paged_decode_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
        batch.scale, sliding_window=window)
    torch.testing.assert_close(got, _dense(batch, window), atol=1e-5, rtol=1e-5)
