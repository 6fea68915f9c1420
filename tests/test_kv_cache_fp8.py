"""An fp8 KV cache (``--kv-cache-dtype fp8|fp8_e4m3|fp8_e5m2``, kernels/kv_dtypes.py): the
kernels that write the cache store the same byte as the twins (rounded to nearest, ties to
even, saturated), the kernels that read it widen it and match the twins, and the twins on
an fp8 cache equal the twins on a 16/32-bit cache holding the same values widened. Under
TRITON_INTERPRET=1 on CPU; the `gpu` cases natively (GPU check, `kernels` stage)."""

from __future__ import annotations

import pytest
import torch
from pagedserve.kernels import ops, reference
from pagedserve.kernels.decode_attention import paged_decode_attention_triton
from pagedserve.kernels.kv_dtypes import (
    is_fp8,
    kv_dtype_name,
    resolve_kv_cache_dtype,
    same_bytes,
    to_cache_dtype,
)
from pagedserve.kernels.testing import (
    PREFILL_CASES,
    make_paged_batch,
    rope_decode_inputs,
    rope_fused_and_two_launches,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _edge_values(kv_dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    """Every finite value of the format, every midpoint between neighbours (ties), values
    past its range both ways, tiny ones and plain normals: ``n`` of them."""
    grid = torch.arange(256, dtype=torch.uint8).view(kv_dtype).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    gen = torch.Generator().manual_seed(seed)
    big = torch.finfo(kv_dtype).max
    x = torch.cat([grid, mids, torch.tensor([2 * big, -3 * big, 1e30, -1e30, 1e-30, -1e-30]),
                   torch.randn(n, generator=gen) * 3, torch.randn(n, generator=gen) * 1e-3])
    return x[:n]


def test_flag_values_resolve():
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.float16) == torch.float8_e5m2
    with pytest.raises(ValueError, match="--kv-cache-dtype 'int8'"):
        resolve_kv_cache_dtype("int8", torch.float16)
    assert [kv_dtype_name(d) for d in (*FP8, torch.bfloat16)] == [
        "fp8_e4m3", "fp8_e5m2", "bfloat16"]
    assert is_fp8(torch.float8_e5m2) and not is_fp8(torch.float16)


@pytest.mark.parametrize("kv_dtype", FP8, ids=kv_dtype_name)
def test_twin_rounds_to_nearest_even_and_saturates(kv_dtype):
    big = torch.finfo(kv_dtype).max
    x = torch.tensor([big * 4, -big * 4, big, 1.0, -0.0])
    assert to_cache_dtype(x, kv_dtype).float().tolist() == [big, -big, big, 1.0, -0.0]
    grid = torch.arange(256, dtype=torch.uint8).view(kv_dtype).float()
    grid = grid[torch.isfinite(grid) & (grid > 0)].unique()
    mids = (grid[1:] + grid[:-1]) / 2  # a tie goes to the neighbour with an even code
    codes = to_cache_dtype(mids, kv_dtype).view(torch.uint8)
    assert bool((codes % 2 == 0).all())


@pytest.mark.parametrize("src", [torch.float32, torch.float16, torch.bfloat16],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("kv_dtype", FP8, ids=kv_dtype_name)
def test_cache_write_stores_the_twins_byte(kv_dtype, src):
    """reshape_and_cache into an fp8 cache: the kernel's bytes are the twin's, for every
    value of the format, every tie between two, values past its range and tiny ones."""
    heads, dim = 2, 64
    values = _edge_values(kv_dtype, 40 * heads * dim).to(src).float()
    key = values.view(40, heads, dim).to(src).to(DEVICE)
    value = key.flip(0).contiguous()
    got = torch.zeros(2, 8, 8, heads, dim, dtype=kv_dtype, device=DEVICE)
    want = got.clone()
    slots = torch.randperm(64)[:40].to(DEVICE)
    slots[3] = -1
    ops.reshape_and_cache(key, value, got[0], got[1], slots, backend="triton")
    reference.reshape_and_cache(key, value, want[0], want[1], slots)
    assert same_bytes(got, want)


@pytest.mark.parametrize("kv_dtype", FP8, ids=kv_dtype_name)
def test_rotary_cache_write_into_fp8_matches_the_twin(kv_dtype):
    tokens, heads, kv_heads, dim = 9, 8, 2, 64
    gen = torch.Generator().manual_seed(5)
    # float32: the interpreter rounds bfloat16 arithmetic its own way (the rotation's
    # bf16 bit-equality is the GPU cases' and test_layer_ops')
    dt = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    q = (torch.randn(tokens, heads, dim, generator=gen) * 40).to(DEVICE, dt)
    k = (torch.randn(tokens, kv_heads, dim, generator=gen) * 300).to(DEVICE, dt)
    v = (torch.randn(tokens, kv_heads, dim, generator=gen) * 300).to(DEVICE, dt)
    angles = torch.rand(tokens, 1, dim // 2, generator=gen) * 10
    emb = torch.cat((angles, angles), -1)
    cos_sin = torch.cat((emb.cos(), emb.sin()), 1).to(DEVICE, dt)
    slots = torch.tensor([0, 5, -1, 17, 30, 31, 8, 9, 2], device=DEVICE)
    runs = []
    for backend in ("triton", "torch"):
        kc = torch.zeros(4, 8, kv_heads, dim, dtype=kv_dtype, device=DEVICE)
        vc = torch.zeros_like(kc)
        qq, kk = q.clone(), k.clone()
        qq, kk = ops.rotary_embedding_and_cache(qq, kk, v, cos_sin, kc, vc, slots,
                                                backend=backend)
        runs.append((qq, kc, vc))
    (q1, kc1, vc1), (q2, kc2, vc2) = runs
    assert torch.equal(q1, q2) and same_bytes(kc1, kc2) and same_bytes(vc1, vc2)
    assert bool((kc1.float().abs() == torch.finfo(kv_dtype).max).any()) or kv_dtype == FP8[1]


DECODE_LAUNCHES = [  # (seqs, group, head_dim, block_size, launch)
    ([(1, 97), (1, 1), (1, 37)], 4, 64, 16, {}),
    ([(1, 200), (1, 17)], 7, 80, 8, {"num_splits": 3, "fused_reduce": True}),
    ([(1, 130), (1, 64)], 1, 64, 64, {"num_splits": 4, "fused_reduce": False}),
    ([(1, 97), (1, 40)], 8, 64, 16, {"sliding_window": 33, "block_n": 16}),
]


@pytest.mark.parametrize("seqs, group, head_dim, block_size, launch", DECODE_LAUNCHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("kv_dtype", FP8, ids=kv_dtype_name)
def test_decode_on_an_fp8_cache(kv_dtype, dtype, seqs, group, head_dim, block_size, launch):
    """The kernel against the twin on the fp8 cache; the twin on it equal to the twin on a
    cache of the query's dtype holding the same values."""
    batch = make_paged_batch(seqs, num_kv_heads=2, group=group, head_dim=head_dim,
                             block_size=block_size, dtype=dtype, device=DEVICE, seed=len(seqs),
                             kv_dtype=kv_dtype)
    window = launch.get("sliding_window")
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
            batch.seq_lens, batch.scale)
    got = paged_decode_attention_triton(*args, **launch)
    want = reference.paged_decode_attention(*args, sliding_window=window)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    wide = (batch.key_cache.to(dtype), batch.value_cache.to(dtype))
    assert torch.equal(want, reference.paged_decode_attention(
        batch.query, *wide, batch.block_tables, batch.seq_lens, batch.scale,
        sliding_window=window))


@pytest.mark.parametrize("seqs, block_size, kv_heads, group, head_dim, dtype, window",
                         PREFILL_CASES[:4])
@pytest.mark.parametrize("kv_dtype", FP8, ids=kv_dtype_name)
def test_prefill_on_an_fp8_cache(kv_dtype, seqs, block_size, kv_heads, group, head_dim, dtype,
                                 window):
    batch = make_paged_batch(seqs, num_kv_heads=kv_heads, group=group, head_dim=head_dim,
                             block_size=block_size, dtype=dtype, device=DEVICE,
                             kv_dtype=kv_dtype)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
            batch.query_start_loc, batch.seq_lens, batch.scale)
    got = ops.paged_attention(*args, max_query_len=batch.max_query_len, sliding_window=window,
                              backend="triton")
    want = reference.paged_prefill_attention(*args, sliding_window=window)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    # against dense causal attention over what the cache holds
    starts = batch.query_start_loc.tolist()
    for i, (q_len, _) in enumerate(seqs):
        if q_len == 0:
            continue
        dense = reference.dense_causal_attention(
            batch.query[starts[i]:starts[i + 1]], batch.dense_keys[i], batch.dense_values[i],
            batch.scale, sliding_window=window)
        torch.testing.assert_close(want[starts[i]:starts[i + 1]].float(), dense.float(),
                                   atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("kv_dtype", FP8, ids=kv_dtype_name)
def test_decode_rope_in_the_launch_on_an_fp8_cache_is_bit_identical(kv_dtype, num_splits):
    """The rotary and cache write inside the decode launch round and saturate as the
    rotary kernel's write does: the same bytes and the same output as the two launches."""
    seqs = [(1, 97), (1, 1), (1, 37), (1, 200), (1, 64)]
    inputs = rope_decode_inputs(2, 7, 64, torch.bfloat16, seqs, DEVICE, kv_dtype=kv_dtype)
    (out, kc, vc), (want, kc2, vc2) = rope_fused_and_two_launches(
        *inputs, num_splits=num_splits, block_n=16)
    assert torch.equal(out, want)
    assert same_bytes(kc, kc2) and same_bytes(vc, vc2)
    assert not same_bytes(kc, inputs[0].key_cache)  # the new keys were written


def test_copy_and_swap_move_fp8_blocks_bit_for_bit():
    kv = to_cache_dtype(torch.randn(3, 2, 7, 16, 2, 64) * 50, torch.float8_e4m3fn).to(DEVICE)
    want = kv.clone()
    mapping = torch.tensor([[0, 5], [2, 6], [4, 1]], device=DEVICE)
    ops.copy_blocks(kv, mapping, backend="triton")
    reference.copy_blocks(want, mapping)
    assert same_bytes(kv, want) and same_bytes(kv[:, :, 5], kv[:, :, 0])
    cpu = torch.zeros(3, 2, 4, 16, 2, 64, dtype=torch.float8_e4m3fn)
    ops.swap_blocks(kv, cpu, torch.tensor([[5, 0], [1, 3]]))
    assert same_bytes(cpu[:, :, 0], kv[:, :, 5].cpu())
    assert same_bytes(cpu[:, :, 3], kv[:, :, 1].cpu())
    ops.swap_blocks(cpu, kv, torch.tensor([[3, 2]]))
    assert same_bytes(kv[:, :, 2], kv[:, :, 1])


def test_launchers_take_fp8_caches_under_any_query_and_refuse_mixed_ones():
    batch = make_paged_batch([(1, 20), (1, 5)], num_kv_heads=2, group=2, head_dim=16,
                             block_size=8, dtype=torch.float32, device=DEVICE,
                             kv_dtype=torch.float8_e5m2)
    q, k, v = batch.query, batch.key_cache, batch.value_cache
    for query in (q, q.half(), q.bfloat16()):
        paged_decode_attention_triton(query, k, v, batch.block_tables, batch.seq_lens, 1.0)
    with pytest.raises(TypeError, match="dtype mismatch"):
        paged_decode_attention_triton(q, k, v.float(), batch.block_tables, batch.seq_lens, 1.0)
    with pytest.raises(TypeError, match="dtype mismatch"):
        paged_decode_attention_triton(q, k.view(torch.float8_e4m3fn), v, batch.block_tables,
                                      batch.seq_lens, 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_dtype", FP8, ids=kv_dtype_name)
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_fp8_cache_natively_gpu(kv_dtype, num_splits):
    """Compiled: the writes' bytes equal the twin's (the hardware's conversion after our
    rounding), bf16 decode and prefill at long contexts near the twin, the fused rotary's
    write and output equal to the two launches', split-K included."""
    seqs = [(1, n) for n in [1024] * 60 + [1, 17, 2049, 8191]]
    batch = make_paged_batch(seqs, num_kv_heads=2, group=7, head_dim=64, block_size=16,
                             dtype=torch.bfloat16, device=DEVICE, kv_dtype=kv_dtype)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
            batch.seq_lens, batch.scale)
    got = paged_decode_attention_triton(*args, num_splits=num_splits)
    want = reference.paged_decode_attention(*args)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    inputs = rope_decode_inputs(2, 7, 64, torch.bfloat16, seqs, DEVICE, kv_dtype=kv_dtype)
    (out, kc, vc), (want, kc2, vc2) = rope_fused_and_two_launches(*inputs,
                                                                  num_splits=num_splits)
    assert torch.equal(out, want) and same_bytes(kc, kc2) and same_bytes(vc, vc2)
    values = _edge_values(kv_dtype, 4096 * 2 * 64).view(4096, 2, 64).to(DEVICE, torch.bfloat16)
    cache = torch.zeros(2, 512, 8, 2, 64, dtype=kv_dtype, device=DEVICE)
    twin = cache.clone()
    slots = torch.randperm(4096, device=DEVICE)
    ops.reshape_and_cache(values, values, cache[0], cache[1], slots, backend="triton")
    reference.reshape_and_cache(values, values, twin[0], twin[1], slots)
    assert same_bytes(cache, twin)


def test_e4m3_is_refused_on_a_gpu_older_than_ada(monkeypatch):
    """Triton converts e4m3 from compute capability 8.9 on: an executor on an older GPU
    refuses it at start (one line), and takes e5m2."""
    from pagedserve.executor import runner_setup

    cuda = torch.device("cuda", 0)
    for capability, kv_dtype, refused in (((8, 0), torch.float8_e4m3fn, True),
                                          ((8, 0), torch.float8_e5m2, False),
                                          ((8, 9), torch.float8_e4m3fn, False),
                                          ((9, 0), torch.float8_e4m3fn, False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, c=capability: c)
        if refused:
            with pytest.raises(ValueError, match="compute capability 8.9 or newer"):
                runner_setup._check_kv_dtype_on(cuda, kv_dtype)
        else:
            runner_setup._check_kv_dtype_on(cuda, kv_dtype)
    runner_setup._check_kv_dtype_on(torch.device("cpu"), torch.float8_e4m3fn)
