"""The torch twins against dense causal attention on realistic sizes (CPU, fast).

8 sequences, up to ~500 tokens, head dim 128, GQA 4:1, block size 16: prefill with prefixes,
decode, sliding window. The twins are the oracle of the kernel tests, so they are checked here
against the plainest possible attention.
"""

from __future__ import annotations

import pytest
import torch
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
