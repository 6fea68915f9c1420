"""PAGEDSERVE_MIXED_DECODE_SPLIT (kernels/ops.py): in a step with prompt tokens, the leading
one-token sequences attended by the decode kernel and the rest by the prefill kernel, each
into its rows of the output: against the twins (Triton under TRITON_INTERPRET=1 on CPU), where
the split is taken (``decode_split_of``), and an executor's tokens unchanged by it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pagedserve.kernels import ops, reference
from pagedserve.kernels.testing import make_paged_batch
from test_executor_support import small_runner
from test_mixed_graphs import _drive

from pagedserve.tinymodels import build_model

# three decodes (one token each, contexts across tiles), then two prompt chunks
SEQS = [(1, 97), (1, 300), (1, 17), (40, 97), (23, 23)]


def _split(batch, d: int):
    return d, batch.query_start_loc[d:] - d


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("window", [None, 30])
@pytest.mark.parametrize("group, head_dim", [(7, 64), (4, 80)])
def test_split_attends_as_the_twin(backend, window, group, head_dim):
    batch = make_paged_batch(SEQS, num_kv_heads=2, group=group, head_dim=head_dim,
                             block_size=16, seed=3)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
            batch.query_start_loc, batch.seq_lens, batch.scale)
    want = reference.paged_prefill_attention(*args, sliding_window=window)
    out = torch.full_like(batch.query, float("nan"))
    got = ops.paged_attention(*args, max_query_len=batch.max_query_len, sliding_window=window,
                              out=out, backend=backend, decode_split=_split(batch, 3))
    assert got is out  # both launches wrote into the given rows
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    whole = ops.paged_attention(*args, max_query_len=batch.max_query_len,
                                sliding_window=window, backend=backend)
    torch.testing.assert_close(got, whole, atol=2e-4, rtol=2e-4)


def test_split_taken_only_for_leading_decodes_beside_a_prompt(monkeypatch):
    starts = torch.tensor([0, 1, 2, 42, 65], dtype=torch.int32)
    num_new = np.array([1, 1, 40, 23])
    monkeypatch.setattr(ops, "MIXED_DECODE_SPLIT", False)
    assert ops.decode_split_of(num_new, starts) is None  # off by default
    monkeypatch.setattr(ops, "MIXED_DECODE_SPLIT", True)
    d, rest = ops.decode_split_of(num_new, starts)
    assert d == 2 and rest.tolist() == [0, 40, 63]
    assert ops.decode_split_of(np.array([40, 1, 1]), starts[:4]) is None  # none leading
    assert ops.decode_split_of(np.array([1, 1, 1]), starts[:4]) is None  # decodes alone
    assert ops.decode_split_of(np.array([], dtype=np.int64), starts[:1]) is None


def test_switch_read_strictly_at_an_executor_start():
    from pagedserve.kernels.host_math import mixed_decode_split_from_env

    assert mixed_decode_split_from_env({}) is False
    assert mixed_decode_split_from_env({"PAGEDSERVE_MIXED_DECODE_SPLIT": "1"}) is True
    with pytest.raises(ValueError, match="PAGEDSERVE_MIXED_DECODE_SPLIT='yes'"):
        mixed_decode_split_from_env({"PAGEDSERVE_MIXED_DECODE_SPLIT": "yes"})
    assert mixed_decode_split_from_env({"PAGEDSERVE_MIXED_DECODE_SPLIT": "yes"},
                                       strict=False) is False


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("split") / "llama", "llama",
                       initializer_range=0.2)


def test_an_executor_gives_the_same_tokens_split(model_dir, monkeypatch):
    """The mixed steps of test_mixed_graphs' drive, eager: the split where decodes lead
    (the steps where a and b decode beside c's chunk, and a, b, c beside d's and e's
    prompts), the same greedy tokens as without it."""
    monkeypatch.setattr(ops, "MIXED_DECODE_SPLIT", False)
    plain = _drive(small_runner(model_dir))
    monkeypatch.setattr(ops, "MIXED_DECODE_SPLIT", True)
    seen: list[int | None] = []
    attend = ops.paged_attention

    def spy(*args, decode_split=None, **kw):
        seen.append(None if decode_split is None else decode_split[0])
        return attend(*args, decode_split=decode_split, **kw)

    monkeypatch.setattr(ops, "paged_attention", spy)
    split = _drive(small_runner(model_dir))
    for rid in plain.seqs:
        assert split.seqs[rid].outputs == plain.seqs[rid].outputs, rid
    layers = split.runner.model.config.num_layers
    assert seen.count(2) == layers and seen.count(3) == layers, seen  # two split steps


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_split_compiled_attends_as_the_twin_gpu(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    seqs = [(1, 1061)] * 40 + [(1, 17), (256, 256), (30, 1030)]
    batch = make_paged_batch(seqs, num_kv_heads=2, group=7, head_dim=64, block_size=16,
                             dtype=dtype, device="cuda", seed=5)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
            batch.query_start_loc, batch.seq_lens, batch.scale)
    got = ops.paged_attention(*args, max_query_len=batch.max_query_len,
                              decode_split=_split(batch, 41))
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-4
    torch.testing.assert_close(got.float(), reference.paged_prefill_attention(*args).float(),
                               atol=tol, rtol=tol)
