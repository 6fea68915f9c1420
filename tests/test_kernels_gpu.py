"""Triton kernels on a CUDA device against their twins: the interpreter cases at native speed,
bf16 computed natively (tensor cores), and large shapes. Skipped without CUDA (conftest).

The *_grid tests compile every kernel natively over pairwise combinations (kernels.testing
.pairwise) of block sizes 8-128, head dims 64/80/128, GQA 1/4/8, fp32/fp16/bf16, forced
split-K counts and context lengths that are not multiples of the block size (the GPU check,
scripts/gpu_check.py, runs them in its `kernels` stage).
"""

from __future__ import annotations

import pytest
import torch
from pagedserve.kernels import decode_attention, ops, reference
from pagedserve.kernels.decode_attention import paged_decode_attention_triton
from pagedserve.kernels.testing import (
    DECODE_CASES,
    PREFILL_CASES,
    case_id,
    make_paged_batch,
    pairwise,
    rope_decode_inputs,
    rope_fused_and_two_launches,
)

pytestmark = pytest.mark.gpu
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}  # tf32-free, bf16 dots
DEVICE = "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCK_SIZES = [8, 16, 32, 64, 128]
HEAD_DIMS = [64, 80, 128]
GROUPS = [1, 4, 8]

DECODE_GRID = pairwise({
    "context_len": [1, 17, 37, 97, 1000, 4097],
    "block_size": BLOCK_SIZES,
    "group": GROUPS,
    "head_dim": HEAD_DIMS,
    "dtype": DTYPES,
    "num_splits": [None, 1, 3, 8],
    "fused_reduce": [False, True],
})
# (q_len, seq_len) per sequence: what the prefill/extend kernel meets in a step.
PREFILL_SHAPES = {
    "prefill": [(17, 17), (37, 37), (97, 97)],
    "prefix_hit": [(17, 97), (5, 37), (64, 1000)],
    "mixed": [(1, 37), (13, 13), (37, 97), (1, 4097)],
    "empty_chunk": [(3, 3), (0, 5), (2, 64), (200, 200)],
}
PREFILL_GRID = pairwise({
    "shape": list(PREFILL_SHAPES),
    "block_size": BLOCK_SIZES,
    "group": GROUPS,
    "head_dim": HEAD_DIMS,
    "dtype": DTYPES,
    "window": [None, 33],
})
CACHE_GRID = pairwise({
    "num_tokens": [1, 17, 97, 1000],
    "block_size": BLOCK_SIZES,
    "head_dim": HEAD_DIMS,
    "dtype": DTYPES,
})


def grid_id(case: dict) -> str:
    return "-".join(f"{k}{str(v).removeprefix('torch.')}" for k, v in case.items())


def _close(actual, expected, dtype):
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("case", DECODE_CASES, ids=case_id)
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_decode_gpu(case, num_splits):
    batch = make_paged_batch(
        [(1, case["context_len"]), (1, 300), (1, 1000)], num_kv_heads=2, group=case["group"],
        head_dim=case["head_dim"], block_size=case["block_size"], dtype=case["dtype"],
        device=DEVICE,
    )
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
            batch.scale)
    _close(paged_decode_attention_triton(*args, num_splits=num_splits),
           reference.paged_decode_attention(*args), case["dtype"])


@pytest.mark.parametrize("seqs, block_size, kv_heads, group, head_dim, dtype, window",
                         PREFILL_CASES)
def test_prefill_gpu(seqs, block_size, kv_heads, group, head_dim, dtype, window):
    batch = make_paged_batch(seqs, num_kv_heads=kv_heads, group=group, head_dim=head_dim,
                             block_size=block_size, dtype=dtype, device=DEVICE)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
            batch.query_start_loc, batch.seq_lens, batch.scale)
    _close(ops.paged_attention(*args, max_query_len=batch.max_query_len, sliding_window=window),
           reference.paged_prefill_attention(*args, sliding_window=window), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 128])
def test_large_decode_gpu(dtype, block_size):
    seqs = [(1, n) for n in (4096, 1, 2049, 16000, 777, 3333, 128, 8191)]
    batch = make_paged_batch(seqs, num_kv_heads=4, group=8, head_dim=128, block_size=block_size,
                             dtype=dtype, device=DEVICE)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
            batch.scale)
    want = reference.paged_decode_attention(*args)
    _close(ops.paged_decode_attention(*args), want, dtype)  # auto split rule
    _close(ops.paged_decode_attention(*args, sliding_window=1024),
           reference.paged_decode_attention(*args, sliding_window=1024), dtype)


@pytest.mark.parametrize("head_dim, group", [(128, 4), (64, 7), (96, 1), (256, 2)])
def test_large_prefill_gpu(head_dim, group):
    seqs = [(1024, 1024), (500, 3000), (1, 2000), (77, 77)]
    batch = make_paged_batch(seqs, num_kv_heads=2, group=group, head_dim=head_dim,
                             block_size=16, dtype=torch.bfloat16, device=DEVICE)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
            batch.query_start_loc, batch.seq_lens, batch.scale)
    _close(ops.paged_attention(*args, max_query_len=batch.max_query_len),
           reference.paged_prefill_attention(*args), torch.bfloat16)


def test_cache_ops_gpu():
    kv_cache = torch.randn(4, 2, 64, 16, 4, 128, device=DEVICE, dtype=torch.bfloat16)
    expected = kv_cache.clone()
    key = torch.randn(100, 4, 128, device=DEVICE, dtype=torch.bfloat16)
    slots = torch.randperm(64 * 16, device=DEVICE)[:100]
    slots[::7] = -1
    ops.reshape_and_cache(key, key, kv_cache[2, 0], kv_cache[2, 1], slots)
    reference.reshape_and_cache(key, key, expected[2, 0], expected[2, 1], slots)
    assert torch.equal(kv_cache, expected)
    mapping = torch.tensor([[0, 10], [3, 11], [5, 63]], device=DEVICE)
    ops.copy_blocks(kv_cache, mapping)
    reference.copy_blocks(expected, mapping)
    assert torch.equal(kv_cache, expected)

    cpu_cache = torch.zeros(4, 2, 8, 16, 4, 128, dtype=torch.bfloat16).pin_memory()
    ops.swap_blocks(kv_cache, cpu_cache, torch.tensor([[10, 2], [63, 7]]))
    assert torch.equal(cpu_cache[:, :, 2], kv_cache[:, :, 10].cpu())
    assert torch.equal(cpu_cache[:, :, 7], kv_cache[:, :, 63].cpu())
    ops.swap_blocks(cpu_cache, kv_cache, torch.tensor([[2, 40], [7, 41]]))
    torch.cuda.synchronize()
    assert torch.equal(kv_cache[:, :, 40], kv_cache[:, :, 10])
    assert torch.equal(kv_cache[:, :, 41], kv_cache[:, :, 63])


@pytest.mark.parametrize("case", DECODE_GRID, ids=grid_id)
def test_decode_grid_gpu(case):
    seqs = [(1, case["context_len"]), (1, 1), (1, 300), (1, case["context_len"] + 5)]
    batch = make_paged_batch(seqs, num_kv_heads=2, group=case["group"],
                             head_dim=case["head_dim"], block_size=case["block_size"],
                             dtype=case["dtype"], device=DEVICE, seed=3)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
            batch.scale)
    _close(paged_decode_attention_triton(*args, num_splits=case["num_splits"],
                                         fused_reduce=case["fused_reduce"]),
           reference.paged_decode_attention(*args), case["dtype"])


@pytest.mark.parametrize("num_splits", [2, 4, 16])
def test_fused_split_k_races_gpu(num_splits):
    """The fused split-K reduction at the Qwen2.5-0.5B shape (14 q / 2 kv heads of 64) on
    a full grid, where splits of one (seq, kv_head) finish at nearly the same time: 30
    launches all equal the two-launch result within rounding, the counters end at zero, and
    a CUDA graph of it replays correctly on new inputs."""
    seqs = [(1, n) for n in [1024] * 60 + [1, 17, 255, 3000]]
    batch = make_paged_batch(seqs, num_kv_heads=2, group=7, head_dim=64, block_size=16,
                             dtype=torch.bfloat16, device=DEVICE, seed=num_splits)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
            batch.scale)
    want = paged_decode_attention_triton(*args, num_splits=num_splits, fused_reduce=False)
    _close(want, reference.paged_decode_attention(*args), torch.bfloat16)
    out = torch.empty_like(want)
    for _ in range(30):
        paged_decode_attention_triton(*args, out=out, num_splits=num_splits, fused_reduce=True)
        torch.testing.assert_close(out.float(), want.float(), atol=1e-2, rtol=1e-2)
    counters = decode_attention._split_counters[out.device]
    assert int(counters.count_nonzero()) == 0

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention_triton(*args, out=out, num_splits=num_splits, fused_reduce=True)
    batch.query.copy_(torch.randn_like(batch.query))
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    _close(out, reference.paged_decode_attention(*args), torch.bfloat16)
    assert int(counters.count_nonzero()) == 0


@pytest.mark.parametrize("case", PREFILL_GRID, ids=grid_id)
def test_prefill_grid_gpu(case):
    batch = make_paged_batch(PREFILL_SHAPES[case["shape"]], num_kv_heads=2, group=case["group"],
                             head_dim=case["head_dim"], block_size=case["block_size"],
                             dtype=case["dtype"], device=DEVICE, seed=4)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
            batch.query_start_loc, batch.seq_lens, batch.scale)
    window = case["window"]
    _close(ops.paged_prefill_attention(*args, sliding_window=window, backend="triton",
                                       max_query_len=batch.max_query_len),
           reference.paged_prefill_attention(*args, sliding_window=window), case["dtype"])


@pytest.mark.parametrize("case", CACHE_GRID, ids=grid_id)
def test_reshape_and_cache_grid_gpu(case):
    gen = torch.Generator().manual_seed(5)
    num_blocks, num_kv_heads = 64 + case["num_tokens"] // case["block_size"], 2
    shape = (num_blocks, case["block_size"], num_kv_heads, case["head_dim"])
    key_cache = torch.randn(shape, generator=gen).to(case["dtype"]).to(DEVICE)
    value_cache = torch.randn(shape, generator=gen).to(case["dtype"]).to(DEVICE)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    tokens = (case["num_tokens"], num_kv_heads, case["head_dim"])
    key = torch.randn(tokens, generator=gen).to(case["dtype"]).to(DEVICE)
    value = torch.randn(tokens, generator=gen).to(case["dtype"]).to(DEVICE)
    slots = torch.randperm(num_blocks * case["block_size"], generator=gen)[:case["num_tokens"]]
    slots[::5] = -1  # padding tokens are skipped
    slots = slots.to(DEVICE)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots, backend="triton")
    reference.reshape_and_cache(key, value, want_k, want_v, slots)
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size, head_dim", [(8, 80), (16, 128), (128, 64)])
def test_copy_blocks_grid_gpu(dtype, block_size, head_dim):
    gen = torch.Generator().manual_seed(6)
    kv_cache = torch.randn(3, 2, 40, block_size, 2, head_dim, generator=gen).to(dtype).to(DEVICE)
    expected = kv_cache.clone()
    mapping = torch.tensor([[0, 39], [7, 9], [8, 20], [33, 1]], device=DEVICE)  # no block both
    ops.copy_blocks(kv_cache, mapping, backend="triton")
    reference.copy_blocks(expected, mapping)
    assert torch.equal(kv_cache, expected)


@pytest.mark.parametrize("kv_heads, group, head_dim", [(2, 7, 64), (4, 8, 128)])
@pytest.mark.parametrize("num_splits", [None, 4])
def test_decode_masking_every_tile_gpu(kv_heads, group, head_dim, num_splits):
    """``mask_every_tile`` compiled natively (bf16, the launcher's tiles): the tail read in
    the loop of the whole tiles gives the tail's own loop's output within one bf16 ulp, at
    contexts ending inside a tile (1,061 as the executor benchmark's steps, 4,133) and on
    one, both as close to the twin. (Equal to the bit under the interpreter; compiled, the
    two loops' code differs and 16-23 of the outputs differed by one ulp on an H100.)

    The ulp is taken at the larger of the output's magnitude and its row's RMS (one query
    head's output): a compiled loop may round a score differently in fp32, which moves its
    probability's bf16 rounding, an error of the size of the values summed (the row's
    scale), not of an output that their cancellation left near zero (the eighth run, an
    H200: every case failed at an output-relative ulp). A masking error (a token read or
    dropped wrongly) moves a row by ~|v| / context, ten times that floor, and the twin's
    check catches larger ones."""
    seqs = [(1, n) for n in [1061] * 60 + [1024, 1, 4133, 17]]
    batch = make_paged_batch(seqs, num_kv_heads=kv_heads, group=group, head_dim=head_dim,
                             block_size=16, dtype=torch.bfloat16, device=DEVICE, seed=5)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
            batch.scale)
    apart = paged_decode_attention_triton(*args, num_splits=num_splits, mask_every_tile=False)
    every = paged_decode_attention_triton(*args, num_splits=num_splits, mask_every_tile=True)
    want = reference.paged_decode_attention(*args)
    _close(every, want, torch.bfloat16)
    _close(apart, want, torch.bfloat16)
    # one ulp of bf16 (8 bits of mantissa) at the larger magnitude of the two, or the row's
    every, apart = every.float(), apart.float()
    row_rms = every.square().mean(dim=-1, keepdim=True).sqrt()
    scale = torch.maximum(torch.maximum(every.abs(), apart.abs()), row_rms)
    ulp = torch.exp2(torch.floor(torch.log2(scale.clamp_min(2.0 ** -126))) - 7)
    excess = (every - apart).abs() / ulp
    worst = excess.flatten().argmax()
    assert (excess <= 1).all(), (
        f"{int((excess > 1).sum())} of {excess.numel()} outputs over one ulp; worst "
        f"{excess.flatten()[worst]:.2f} ulp at {every.flatten()[worst]:.6g} vs "
        f"{apart.flatten()[worst]:.6g} (row rms {row_rms.expand_as(every).flatten()[worst]:.4g})")


@pytest.mark.parametrize("kv_heads, group, head_dim", [(2, 7, 64), (4, 8, 128), (2, 6, 80)])
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_decode_rope_in_the_launch_gpu(kv_heads, group, head_dim, num_splits):
    """The rotary and the cache write inside the decode launch, compiled natively, bf16:
    the output and both caches equal the two launches' bit for bit at long contexts (the
    barrier orders each program's writes before its reads of the last tile; the rotation's
    roundings kept from contracting into fma.rn.bf16: layer_ops.rotated), split-K included;
    in a CUDA graph too."""
    seqs = [(1, n) for n in [1024] * 60 + [1, 17, 2049, 8191]]
    inputs = rope_decode_inputs(kv_heads, group, head_dim, torch.bfloat16, seqs, DEVICE)
    (out, kc, vc), (want, kc2, vc2) = rope_fused_and_two_launches(
        *inputs, num_splits=num_splits)
    assert torch.equal(out, want)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    batch, q, k, v, cos_sin, slots = inputs
    graph_out = torch.empty_like(out)
    kc3, vc3 = batch.key_cache.clone(), batch.value_cache.clone()
    qq, kk = q.clone(), k.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention_triton(qq, kc3, vc3, batch.block_tables, batch.seq_lens,
                                      batch.scale, out=graph_out, num_splits=num_splits,
                                      rope=(kk, v, cos_sin, slots))
    kc3.copy_(batch.key_cache)
    vc3.copy_(batch.value_cache)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out, want) and torch.equal(kc3, kc2)
