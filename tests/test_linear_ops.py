"""The split-K Triton GEMM (kernels/linear_ops.py) against torch's linear, in the interpreter
on CPU (natively on a GPU): odd sizes (M, N, K not multiples of the tiles), with and without
bias, one part or several (more parts than K slices included), the tile counters left at
zero for the next launch, and the same result whatever the part count's rounding."""

from __future__ import annotations

import pytest
import torch
from pagedserve.kernels import linear_ops
from pagedserve.kernels.linear_ops import linear_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("m, n, k, bias, split_k", [
    (5, 40, 70, True, 1),
    (33, 17, 100, False, 3),
    (16, 64, 64, True, 4),
    (7, 24, 40, True, 8),  # 8 parts of 40 / 16-wide slices: some parts empty
])
def test_linear_matches_torch(m, n, k, bias, split_k):
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen).to(DEVICE)
    w = torch.randn(n, k, generator=gen).to(DEVICE)
    b = torch.randn(n, generator=gen).to(DEVICE) if bias else None
    got = linear_triton(x, w, b, block_m=16, block_n=16, block_k=16, split_k=split_k)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-4)
    if split_k > 1:
        assert int(linear_ops._counters[got.device].count_nonzero()) == 0
        again = linear_triton(x, w, b, block_m=16, block_n=16, block_k=16, split_k=split_k)
        assert torch.equal(got, again)  # the partials summed in part order: deterministic


def test_linear_bf16_and_bad_inputs():
    x = torch.randn(9, 48).to(DEVICE, torch.bfloat16)
    w = torch.randn(20, 48).to(DEVICE, torch.bfloat16)
    got = linear_triton(x, w, block_m=16, block_n=16, block_k=16, split_k=2)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), (x.float() @ w.float().T), atol=0.1, rtol=0.02)
    with pytest.raises(ValueError, match="weight"):
        linear_triton(x, w[:, :40])
    with pytest.raises(TypeError):
        linear_triton(x, w.float())
    with pytest.raises(ValueError, match="split_k"):
        linear_triton(x, w, split_k=0)
    assert linear_triton(x[:0], w).shape == (0, 20)


@pytest.mark.gpu
@pytest.mark.parametrize("n, k, bias", [(1152, 896, True), (896, 896, False), (9728, 896, False),
                                        (896, 4864, False)])
@pytest.mark.parametrize("split_k", [1, 4])
def test_linear_gpu_at_the_decode_shapes(n, k, bias, split_k):
    """Compiled natively, bf16, the Qwen2.5-0.5B layer's projections at 256 tokens, in a
    CUDA graph: within bf16 rounding of cuBLAS's."""
    x = torch.randn(256, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    want = torch.nn.functional.linear(x, w, b).float()
    graph = torch.cuda.CUDAGraph()
    linear_triton(x, w, b, split_k=split_k)  # compile outside the capture
    with torch.cuda.graph(graph):
        got = linear_triton(x, w, b, split_k=split_k)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.02)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64, 256])
def test_linear_tuned_gpu(m):
    """The autotuned launch (ops.linear with triton_gemm, as the model calls it) at every
    projection shape of the Qwen2.5-0.5B layer: tuned outside a capture, then replayed in
    a CUDA graph, within bf16 rounding of cuBLAS's; the counters end at zero."""
    from pagedserve.kernels import ops

    for n, k, bias in [(1152, 896, True), (896, 896, False), (9728, 896, False),
                       (896, 4864, False)]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
        want = torch.nn.functional.linear(x, w, b).float()
        ops.linear(x, w, b, triton_gemm=True)  # tunes this shape
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = ops.linear(x, w, b, triton_gemm=True)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.02)
        assert int(linear_ops._counters[got.device].count_nonzero()) == 0
    # The down projection with SiLU-and-multiply in its operand loads (the model's MLP).
    gate_up = torch.randn(m, 2 * 4864, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(896, 4864, device="cuda", dtype=torch.bfloat16) * 4864 ** -0.5
    want = torch.nn.functional.linear(ops.silu_and_mul(gate_up), w).float()
    got = ops.linear(gate_up, w, triton_gemm=True, silu_mul=True)
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("split_k", [1, 3])
def test_silu_mul_operand_is_the_silu_and_mul_kernels(split_k):
    """``silu_mul``: x is gate | up and the GEMM multiplies silu(gate) * up, rounded as the
    SiLU-and-multiply kernel rounds it: bit-equal to that kernel's output fed to the plain
    GEMM (the same launch configuration), and close to torch's form."""
    from pagedserve.kernels import ops

    gen = torch.Generator().manual_seed(split_k)
    gate_up = torch.randn(11, 2 * 40, generator=gen).to(DEVICE, torch.bfloat16)
    w = (torch.randn(24, 40, generator=gen) / 6).to(DEVICE, torch.bfloat16)
    launch = dict(block_m=16, block_n=16, block_k=16, split_k=split_k)
    fused = linear_triton(gate_up, w, silu_mul=True, **launch)
    two = linear_triton(ops.silu_and_mul(gate_up, backend="triton"), w, **launch)
    assert torch.equal(fused, two)
    want = torch.nn.functional.linear(ops.silu_and_mul(gate_up, backend="torch").float(),
                                      w.float())
    torch.testing.assert_close(fused.float(), want, atol=0.05, rtol=0.02)
    with pytest.raises(ValueError, match="2K"):
        linear_triton(gate_up[:, :40], w, silu_mul=True)


def test_a_grown_buffer_outlives_its_replacement(monkeypatch):
    """The split-K workspace and the arrival counters grow by replacement; the buffer a
    CUDA graph may have captured stays alive (counters.RETIRED), so its memory is never
    handed to another tensor under a graph that still writes it."""
    from pagedserve.kernels import counters

    store: dict = {}
    first = counters.arrival_counters(store, torch.device("cpu"), 4, 4)
    second = counters.arrival_counters(store, torch.device("cpu"), 9, 4)
    assert second.numel() == 9 and first is not second
    assert any(t is first for t in counters.RETIRED)
    monkeypatch.setattr(linear_ops, "_workspaces", {})
    small = linear_ops._workspace(torch.device("cpu"), 8)
    larger = linear_ops._workspace(torch.device("cpu"), 64)
    assert larger.numel() == 64 and any(t is small for t in counters.RETIRED)
    assert linear_ops._workspace(torch.device("cpu"), 16) is larger  # never shrunk
