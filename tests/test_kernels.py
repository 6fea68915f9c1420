"""Triton kernels against their torch twins, under TRITON_INTERPRET=1 on CPU (natively on a GPU).

Shapes are small and odd on purpose: context lengths 1/17/37/97 (not multiples of the block
size), block sizes 8/16/64, GQA ratios 1/4/8, head dims 64/80 (80 exercises padding to 128),
fp32/fp16/bf16, covered pairwise rather than as a full cross product.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedserve.kernels import host_math, ops, reference
from pagedserve.kernels.cache_ops import swap_blocks_device
from pagedserve.kernels.decode_attention import (
    choose_block_n,
    choose_num_splits,
    paged_decode_attention_triton,
)
from pagedserve.kernels.prefill_attention import choose_prefill_config
from pagedserve.kernels.testing import (
    DECODE_CASES,
    DECODE_FACTORS,
    PREFILL_CASES,
    case_id,
    make_paged_batch,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_pairwise_cases_cover_every_pair():
    import itertools

    for a, b in itertools.combinations(DECODE_FACTORS, 2):
        seen = {(c[a], c[b]) for c in DECODE_CASES}
        assert seen == set(itertools.product(DECODE_FACTORS[a], DECODE_FACTORS[b])), (a, b)
    assert len(DECODE_CASES) <= 20


# --- decode ------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", DECODE_CASES, ids=case_id)
def test_decode_matches_twin(case):
    ctx = case["context_len"]
    # Two sequences: the case's context length and a different odd one.
    batch = make_paged_batch(
        [(1, ctx), (1, 37 if ctx != 37 else 17)],
        num_kv_heads=2 if case["group"] < 8 else 1, group=case["group"],
        head_dim=case["head_dim"], block_size=case["block_size"], dtype=case["dtype"],
        device=DEVICE,
    )
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
            batch.scale)
    got = ops.paged_decode_attention(*args, backend="triton")
    want = reference.paged_decode_attention(*args)
    _close(got, want, case["dtype"])


def test_choose_num_splits_rule():
    sms = 132
    assert choose_num_splits(256, 4, 16384, sms) == 1  # grid already fills the GPU
    assert choose_num_splits(64, 4, 4096, sms) == 1  # 256 programs, target 264: about there
    # Head dim 64 (Qwen2.5-0.5B: 2 KV heads): twice the programs per SM.
    assert choose_num_splits(64, 2, 1024, sms, head_dim=64) == 4  # 528 / 128 programs
    assert choose_num_splits(256, 2, 1024, sms, head_dim=64) == 1  # 528 / 512
    assert choose_num_splits(8, 2, 16384, sms, head_dim=64) == 33  # 528 / 16
    assert choose_num_splits(16, 4, 8192, sms) == 4  # 264 / 64 = 4.1, rounded
    assert choose_num_splits(1, 4, 16384, sms) == 64  # 66 wanted, 64 cap and 16k/256 = 64
    assert choose_num_splits(1, 2, 1024, sms) == 4  # capped by 256-token minimum pieces
    assert choose_num_splits(1, 4, 300, sms) == 1  # too short to split


def test_choose_block_n_rule():
    sms, bf16 = 132, torch.bfloat16
    # 128-token tiles up to 4 programs per SM (528 here) at head dim 64, 3 (396) when wider
    # (72 KiB of shared memory a program), 16-bit caches, head dim <= 128.
    assert choose_block_n(64 * 2 * 4, sms, 64, bf16) == 128  # Qwen shape, batch 64, 4 splits
    assert choose_block_n(256 * 2, sms, 64, bf16) == 128  # Qwen shape, batch 256
    assert choose_block_n(528, sms, 64, bf16) == 128 and choose_block_n(529, sms, 64, bf16) == 64
    assert choose_block_n(64 * 4, sms, 128, torch.float16) == 128  # 32 q / 4 kv, batch 64
    assert choose_block_n(396, sms, 80, bf16) == 128
    assert choose_block_n(397, sms, 80, bf16) == 64
    assert choose_block_n(64 * 8, sms, 128, bf16) == 64  # 512 programs: 3.9 a SM
    assert choose_block_n(256 * 8, sms, 128, bf16) == 64  # 2,048 programs
    assert choose_block_n(8, sms, 128, torch.float32) == 64  # float32: twice the bytes a tile
    # an fp8 cache: the 16-bit rule (128 tiles timed faster on an H200 though they spill a
    # few bytes on sm_90), 32 under a float32 model
    assert choose_block_n(8, sms, 64, bf16, kv_fp8=True) == 128
    assert choose_block_n(64 * 2 * 4, sms, 64, bf16, kv_fp8=True) == 128
    assert choose_block_n(64 * 4, sms, 128, bf16, kv_fp8=True) == 128
    assert choose_block_n(529, sms, 64, bf16, kv_fp8=True) == 64
    assert choose_block_n(8, sms, 128, torch.float32, kv_fp8=True) == 32
    assert choose_block_n(8, sms, 256, bf16) == 32  # wide heads


def test_choose_prefill_config_rule():
    assert choose_prefill_config(64, torch.bfloat16) == (128, 64, 8)
    assert choose_prefill_config(32, torch.float16) == (128, 64, 8)
    assert choose_prefill_config(128, torch.bfloat16) == (128, 32, 4)
    assert choose_prefill_config(80, torch.float16) == (128, 32, 4)  # pads to 128
    assert choose_prefill_config(128, torch.float32) == (64, 64, 4)
    assert choose_prefill_config(256, torch.bfloat16) == (32, 32, 4)


@pytest.mark.parametrize("head_dim, group", [(64, 7), (128, 8), (80, 4)])
def test_default_launch_configs_match_twin_bf16(head_dim, group):
    """The 16-bit defaults (128-token decode tiles on a small grid, 128-row prefill programs)
    against the twins, with chunks longer than one program's query tokens."""
    batch = make_paged_batch([(40, 97), (1, 300), (23, 23)], num_kv_heads=1, group=group,
                             head_dim=head_dim, block_size=16, dtype=torch.bfloat16,
                             device=DEVICE)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
            batch.query_start_loc, batch.seq_lens, batch.scale)
    _close(ops.paged_attention(*args, max_query_len=batch.max_query_len, backend="triton"),
           reference.paged_prefill_attention(*args), torch.bfloat16)
    decode = make_paged_batch([(1, 300), (1, 17), (1, 130)], num_kv_heads=2, group=group,
                              head_dim=head_dim, block_size=16, dtype=torch.bfloat16,
                              device=DEVICE)
    dargs = (decode.query, decode.key_cache, decode.value_cache, decode.block_tables,
             decode.seq_lens, decode.scale)
    _close(paged_decode_attention_triton(*dargs), reference.paged_decode_attention(*dargs),
           torch.bfloat16)


def test_decode_auto_split_with_wide_block_table():
    # A wide block table (long max context) makes the rule split even for short sequences.
    batch = make_paged_batch(
        [(1, 17), (1, 97)], num_kv_heads=1, group=4, head_dim=64, block_size=8,
        device=DEVICE, extra_table_columns=200,
    )
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
            batch.scale)
    assert choose_num_splits(2, 1, batch.block_tables.shape[1] * 8, 108) > 1
    _close(ops.paged_decode_attention(*args, backend="triton"),
           reference.paged_decode_attention(*args), torch.float32)


@pytest.mark.parametrize("window", [1, 8, 30, 500])
def test_decode_sliding_window(window):
    batch = make_paged_batch(
        [(1, 97), (1, 17), (1, 1)], num_kv_heads=1, group=8, head_dim=64, block_size=8,
        device=DEVICE,
    )
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
            batch.scale)
    _close(ops.paged_decode_attention(*args, sliding_window=window, backend="triton"),
           reference.paged_decode_attention(*args, sliding_window=window), torch.float32)


# --- prefill / extend --------------------------------------------------------------------------

@pytest.mark.parametrize("seqs, block_size, kv_heads, group, head_dim, dtype, window",
                         PREFILL_CASES)
def test_prefill_matches_twin(seqs, block_size, kv_heads, group, head_dim, dtype, window):
    batch = make_paged_batch(seqs, num_kv_heads=kv_heads, group=group, head_dim=head_dim,
                             block_size=block_size, dtype=dtype, device=DEVICE)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
            batch.query_start_loc, batch.seq_lens, batch.scale)
    got = ops.paged_attention(*args, max_query_len=batch.max_query_len, sliding_window=window,
                              backend="triton")
    want = reference.paged_prefill_attention(*args, sliding_window=window)
    _close(got, want, dtype)


def test_prefill_small_tiles_and_unknown_max_query_len():
    from pagedserve.kernels.prefill_attention import paged_prefill_attention_triton

    batch = make_paged_batch([(37, 97), (17, 40)], num_kv_heads=1, group=4, head_dim=64,
                             block_size=16, device=DEVICE)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
            batch.query_start_loc, batch.seq_lens, batch.scale)
    want = reference.paged_prefill_attention(*args)
    _close(paged_prefill_attention_triton(*args, block_q=4, block_n=16), want, torch.float32)


@settings(max_examples=25, deadline=None)
@given(
    chunks=st.lists(st.tuples(st.integers(1, 48), st.integers(0, 70)), min_size=1, max_size=3),
    window=st.sampled_from([None, 1, 2, 5, 16, 17, 33, 200]),
    group=st.sampled_from([1, 3, 4]),
    block_size=st.sampled_from([4, 8, 16]),
    block_q=st.sampled_from([None, 2, 4, 16]),
    block_n=st.sampled_from([None, 16, 32]),
)
def test_prefill_mask_phases_match_twin(chunks, window, group, block_size, block_q, block_n):
    """The kernel skips the mask on key tiles every row of its query tile admits whole and
    masks the tiles at the window's lower edge and at the diagonal: any chunk length after
    any cached prefix, any window, any tile sizes give the twin's outputs."""
    from pagedserve.kernels.prefill_attention import paged_prefill_attention_triton

    batch = make_paged_batch([(q, q + ctx) for q, ctx in chunks], num_kv_heads=1, group=group,
                             head_dim=16, block_size=block_size, device=DEVICE)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
            batch.query_start_loc, batch.seq_lens, batch.scale)
    got = paged_prefill_attention_triton(*args, sliding_window=window,
                                         max_query_len=batch.max_query_len, block_q=block_q,
                                         block_n=block_n)
    _close(got, reference.paged_prefill_attention(*args, sliding_window=window), torch.float32)


def test_chunked_prefill_pipeline_equals_dense():
    """reshape_and_cache + prefill kernel, one sequence in three chunks, against dense."""
    torch.manual_seed(0)
    kv_heads, group, head_dim, block_size, total = 1, 4, 64, 8, 45
    num_heads = kv_heads * group
    key_cache = torch.zeros(8, block_size, kv_heads, head_dim, device=DEVICE)
    value_cache = torch.zeros_like(key_cache)
    block_table = torch.tensor([[5, 2, 7, 0, 3, 6]], dtype=torch.int32, device=DEVICE)
    q = torch.randn(total, num_heads, head_dim, device=DEVICE)
    k = torch.randn(total, kv_heads, head_dim, device=DEVICE)
    v = torch.randn(total, kv_heads, head_dim, device=DEVICE)
    outs, done = [], 0
    for chunk in (16, 20, 9):
        pos = torch.arange(done, done + chunk, device=DEVICE)
        slots = block_table[0, pos // block_size].long() * block_size + pos % block_size
        ops.reshape_and_cache(k[pos], v[pos], key_cache, value_cache, slots, backend="triton")
        done += chunk
        outs.append(ops.paged_attention(
            q[pos], key_cache, value_cache, block_table,
            torch.tensor([0, chunk], dtype=torch.int32, device=DEVICE),
            torch.tensor([done], dtype=torch.int32, device=DEVICE), head_dim**-0.5,
            max_query_len=chunk, backend="triton",
        ))
    want = reference.dense_causal_attention(q, k, v, head_dim**-0.5)
    torch.testing.assert_close(torch.cat(outs), want, atol=2e-5, rtol=2e-5)


def test_paged_attention_dispatches_decode_when_max_query_len_is_1():
    batch = make_paged_batch([(1, 17), (1, 37)], num_kv_heads=1, group=4, head_dim=64,
                             block_size=16, device=DEVICE)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
            batch.query_start_loc, batch.seq_lens, batch.scale)
    out = torch.empty_like(batch.query)
    got = ops.paged_attention(*args, max_query_len=1, out=out, backend="triton")
    assert got is out
    _close(got, ops.paged_attention(*args, max_query_len=1, backend="torch"), torch.float32)


# --- cache ops -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reshape_and_cache_skips_padding_slots(dtype):
    layers, num_blocks, block_size, kv_heads, head_dim = 2, 6, 8, 3, 80
    kv_cache = torch.randn(layers, 2, num_blocks, block_size, kv_heads, head_dim).to(dtype)
    kv_cache = kv_cache.to(DEVICE)
    expected = kv_cache.clone()
    qkv = torch.randn(5, 3 * kv_heads, head_dim, device=DEVICE).to(dtype)  # non-contiguous K/V
    key, value = qkv[:, kv_heads : 2 * kv_heads], qkv[:, 2 * kv_heads :]
    slots = torch.tensor([3, -1, 17, 47, -1], dtype=torch.int64, device=DEVICE)
    ops.reshape_and_cache(key, value, kv_cache[1, 0], kv_cache[1, 1], slots, backend="triton")
    reference.reshape_and_cache(key, value, expected[1, 0], expected[1, 1], slots)
    assert torch.equal(kv_cache, expected)
    flat_k = kv_cache[1, 0].view(-1, kv_heads, head_dim)
    assert torch.equal(flat_k[47], key[3])


def test_reshape_and_cache_casts_to_cache_dtype():
    key_cache = torch.zeros(2, 8, 1, 64, dtype=torch.float16, device=DEVICE)
    value_cache = torch.zeros_like(key_cache)
    key = torch.randn(3, 1, 64, device=DEVICE)
    slots = torch.tensor([0, 9, -1], dtype=torch.int32, device=DEVICE)
    ops.reshape_and_cache(key, key, key_cache, value_cache, slots, backend="triton")
    assert torch.equal(key_cache.view(-1, 1, 64)[9], key[1].half())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_all_layers_one_launch(dtype):
    kv_cache = torch.randn(3, 2, 7, 16, 2, 80).to(dtype).to(DEVICE)
    expected = kv_cache.clone()
    mapping = torch.tensor([[0, 5], [2, 6], [4, 1]], dtype=torch.int64, device=DEVICE)
    ops.copy_blocks(kv_cache, mapping, backend="triton")
    reference.copy_blocks(expected, mapping)
    assert torch.equal(kv_cache, expected)
    assert torch.equal(kv_cache[:, :, 5], kv_cache[:, :, 0])
    ops.copy_blocks(kv_cache, mapping[:0], backend="triton")  # empty mapping: no-op


def test_swap_blocks_round_trip():
    device_cache = torch.randn(2, 2, 6, 8, 1, 64, device=DEVICE)
    cpu_cache = torch.zeros(2, 2, 4, 8, 1, 64)
    out_mapping = torch.tensor([[5, 0], [1, 3]])
    ops.swap_blocks(device_cache, cpu_cache, out_mapping)
    assert torch.equal(cpu_cache[:, :, 0], device_cache[:, :, 5].cpu())
    assert torch.equal(cpu_cache[:, :, 3], device_cache[:, :, 1].cpu())
    in_mapping = torch.tensor([[0, 2], [3, 4]])
    ops.swap_blocks(cpu_cache, device_cache, in_mapping, backend="triton")
    assert torch.equal(device_cache[:, :, 2], device_cache[:, :, 5])
    assert torch.equal(device_cache[:, :, 4], device_cache[:, :, 1])
    # The device helper falls back to the twin when neither side is on CUDA.
    other = torch.zeros_like(cpu_cache)
    swap_blocks_device(cpu_cache, other, torch.tensor([[3, 1]]))
    assert torch.equal(other[:, :, 1], cpu_cache[:, :, 3])


# --- launcher checks and dispatch --------------------------------------------------------------


def test_launchers_reject_bad_inputs():
    batch = make_paged_batch([(1, 17)], num_kv_heads=2, group=2, head_dim=64, block_size=8)
    args = [batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
            batch.scale]
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode_attention_triton(batch.query[:, :3], *args[1:])
    with pytest.raises(TypeError, match="dtype mismatch"):
        paged_decode_attention_triton(batch.query.half(), *args[1:])
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention_triton(*args[:3], batch.block_tables[:, None], *args[4:])
    with pytest.raises(ValueError, match="kv_cache must be"):
        ops.copy_blocks(batch.key_cache, torch.tensor([[0, 1]]), backend="triton")
    with pytest.raises(ValueError, match="slot_mapping"):
        ops.reshape_and_cache(batch.key_cache[0], batch.key_cache[0], batch.key_cache,
                              batch.value_cache, torch.zeros(3, dtype=torch.int32),
                              backend="triton")


def test_backend_selection(monkeypatch):
    batch = make_paged_batch([(1, 17)], num_kv_heads=1, group=1, head_dim=64, block_size=8)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
            batch.scale)
    with pytest.raises(ValueError, match="backend"):
        ops.paged_decode_attention(*args, backend="cuda")
    calls = []
    monkeypatch.setattr(
        "pagedserve.kernels.decode_attention.paged_decode_attention_triton",
        lambda *a, **k: calls.append(1) or reference.paged_decode_attention(*a[:6]),
    )
    monkeypatch.setenv("PAGEDSERVE_KERNEL_BACKEND", "triton")
    ops.paged_decode_attention(*args)
    assert calls == [1]
    monkeypatch.setenv("PAGEDSERVE_KERNEL_BACKEND", "torch")
    ops.paged_decode_attention(*args)
    assert calls == [1]


def test_both_launchers_reject_a_bad_query_or_cache_alike():
    """The decode and prefill launchers share their query/cache checks (kv_tiles): each
    bad input is a clear error before anything launches."""
    from pagedserve.kernels.prefill_attention import paged_prefill_attention_triton

    batch = make_paged_batch([(1, 20), (1, 5)], num_kv_heads=2, group=2, head_dim=16,
                             block_size=8, dtype=torch.float32, device=DEVICE)
    q, k, v = batch.query, batch.key_cache, batch.value_cache
    tables, lens = batch.block_tables, batch.seq_lens
    starts = torch.arange(3, dtype=torch.int32)
    launchers = [
        ("num_seqs", lambda q, k, v: paged_decode_attention_triton(q, k, v, tables, lens, 1.0)),
        ("num_tokens", lambda q, k, v: paged_prefill_attention_triton(
            q, k, v, tables, starts, lens, 1.0, max_query_len=1)),
    ]
    for rows, launch in launchers:
        with pytest.raises(ValueError, match=rf"query must be \[{rows}, num_heads"):
            launch(q[0], k, v)
        with pytest.raises(ValueError, match="must both be"):
            launch(q, k, v[:, :4])
        with pytest.raises(ValueError, match="head_dim mismatch"):
            launch(q[..., :8], k, v)
        with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
            launch(q[:, :3], k, v)
        with pytest.raises(TypeError, match="dtype mismatch"):
            launch(q.half(), k, v)
        with pytest.raises(ValueError, match="contiguous"):
            launch(q, k.transpose(2, 3).contiguous().transpose(2, 3), v)


def test_triton_gemm_switch_names_projections():
    """PAGEDSERVE_DECODE_TRITON_GEMM: 0/unset none, 1 all four, or a comma list of them;
    anything else a one-line error naming the choices."""
    env, read = host_math.TRITON_GEMM_ENV, host_math.triton_gemm_from_env
    assert read({}) == frozenset() and read({env: "0"}) == frozenset()
    assert read({env: "1"}) == {"qkv", "o", "gate_up", "down"}
    assert read({env: "qkv, o"}) == {"qkv", "o"}
    for bad in ("2", "qkv,lm_head", "yes", "qkv,"):
        with pytest.raises(ValueError, match="comma list of qkv, o, gate_up, down"):
            read({env: bad})
        assert read({env: bad}, strict=False) == frozenset()  # at import: none


def test_fused_rope_switch():
    """PAGEDSERVE_DECODE_FUSED_ROPE: unset None (the default: where Triton runs), 0 False,
    1 True; anything else a one-line error, or unset when read leniently (at import)."""
    env, read = host_math.FUSED_ROPE_ENV, host_math.fused_rope_from_env
    assert read({}) is None and read({env: ""}) is None
    assert read({env: "0"}) is False and read({env: "1"}) is True
    with pytest.raises(ValueError, match="expected 0 or 1"):
        read({env: "on"})
    assert read({env: "on"}, strict=False) is None
