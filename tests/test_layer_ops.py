"""The fused layer kernels (kernels/layer_ops.py) against their torch twins, under
TRITON_INTERPRET=1 on CPU (natively on a GPU, where the `gpu` cases also run at the Qwen2.5-0.5B
sizes); a whole model forward with the fused kernels equal to the torch forms; the start-up
check that falls back to the torch forms."""

from __future__ import annotations

import pytest
import torch
from pagedserve.kernels import ops, reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]


def _rand(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def _close(actual, expected, dtype):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOL[dtype],
                               rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,hidden", [(1, 8), (3, 160), (7, 96)])
def test_rms_norm(dtype, tokens, hidden):
    x, w = _rand(tokens, hidden, dtype=dtype), _rand(hidden, dtype=dtype, seed=1)
    _close(ops.rms_norm(x, w, 1e-6, backend="triton"), reference.rms_norm(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_with_residual_writes_the_sum(dtype):
    x, w = _rand(5, 160, dtype=dtype), _rand(160, dtype=dtype, seed=1)
    residual = _rand(5, 160, dtype=dtype, seed=2)
    want_out, want_sum = reference.rms_norm(x, w, 1e-5, residual.clone())
    buffer = residual.clone()
    out, total = ops.rms_norm(x, w, 1e-5, buffer, backend="triton")
    assert total.data_ptr() == buffer.data_ptr()  # in place
    if dtype == torch.float32 or DEVICE == "cuda":  # the interpreter rounds bf16 its own way
        assert torch.equal(total, want_sum)  # one rounding of x + residual, as torch's add
    _close(total, want_sum, dtype)
    _close(out, want_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_per_head_on_a_strided_view(dtype):
    """Qwen3's q_norm: a [T, H, D] view into a fused qkv projection."""
    qkv = _rand(4, (6 + 2 * 2) * 16, dtype=dtype)
    q = qkv[:, :96].view(4, 6, 16)
    w = _rand(16, dtype=dtype, seed=3)
    got = ops.rms_norm(q, w, 1e-6, backend="triton")
    assert got.is_contiguous()
    _close(got, reference.rms_norm(q, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (14, 2, 64), (3, 3, 8)])
def test_rotary_in_place_on_views(dtype, heads, kv_heads, dim):
    tokens = 5
    qkv = _rand(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    q = qkv[:, :heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v_before = qkv[:, (heads + kv_heads) * dim:].clone()
    angles = _rand(tokens, 1, dim // 2, seed=4).float()
    emb = torch.cat((angles, angles), dim=-1)
    cos_sin = torch.cat((emb.cos(), emb.sin()), dim=1).to(dtype)
    want_q, want_k = reference.rotary_embedding(q, k, cos_sin)
    got_q, got_k = ops.rotary_embedding(q, k, cos_sin, backend="triton")
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    _close(got_q, want_q, dtype)
    _close(got_k, want_k, dtype)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v_before)  # v untouched


def _rotate_half_form(x, cos_sin):
    """transformers' rotary, written out: x * cos + cat(-x2, x1) * sin."""
    cos, sin = cos_sin[:, 0:1], cos_sin[:, 1:2]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@pytest.mark.parametrize("tokens", [1, 6])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (9, 3, 64), (3, 3, 8)])
def test_twin_rotates_a_fused_projections_q_and_k_as_one(dtype, heads, kv_heads, dim, tokens):
    """The twin rotates q and k views of one q/k/v projection as one view of both (one
    token a step too, whose views' row strides differ): bit for bit transformers'
    rotate_half form on each apart, the projection untouched."""
    qkv = _rand(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    before = qkv.clone()
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(-1, heads, dim), k.view(-1, kv_heads, dim)
    assert reference._heads_together(q, k) is not None
    assert reference._heads_together(q.clone(), k) is None  # not neighbours: apart
    assert reference._heads_together(k, q) is None
    angles = _rand(tokens, 1, dim // 2, seed=4).float() * 3
    emb = torch.cat((angles, angles), dim=-1)
    cos_sin = torch.cat((emb.cos(), emb.sin()), dim=1).to(dtype)
    got_q, got_k = reference.rotary_embedding(q, k, cos_sin)
    apart_q, apart_k = reference.rotary_embedding(q.contiguous(), k.contiguous(), cos_sin)
    assert got_q.shape == q.shape and got_k.shape == k.shape
    for got in (got_q, apart_q):
        assert torch.equal(got, _rotate_half_form(q, cos_sin))
    for got in (got_k, apart_k):
        assert torch.equal(got, _rotate_half_form(k, cos_sin))
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (14, 2, 64), (3, 3, 8)])
def test_rotary_and_cache_write_in_one_launch(dtype, heads, kv_heads, dim):
    """The fused kernel against the twin path (rotary, then reshape_and_cache): q and k
    rotated in place as before, the rotated k and v at their slots, a padding row (slot -1)
    writing nothing, views of a fused projection as inputs."""
    tokens = 5
    qkv = _rand(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    q = qkv[:, :heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    angles = _rand(tokens, 1, dim // 2, seed=4).float()
    emb = torch.cat((angles, angles), dim=-1)
    cos_sin = torch.cat((emb.cos(), emb.sin()), dim=1).to(dtype)
    slots = torch.tensor([5, -1, 0, 13, 8], device=DEVICE)

    def caches():
        shape = (3, 8, kv_heads, dim)
        return (torch.full(shape, 7.0, dtype=dtype, device=DEVICE),
                torch.full(shape, 7.0, dtype=dtype, device=DEVICE))

    want_q, want_k = reference.rotary_embedding(q, k, cos_sin)
    want_caches = caches()
    reference.reshape_and_cache(want_k, v, *want_caches, slots)
    got_caches = caches()
    got_q, got_k = ops.rotary_embedding_and_cache(q, k, v, cos_sin, *got_caches, slots,
                                                  backend="triton")
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    _close(got_q, want_q, dtype)
    _close(got_k, want_k, dtype)
    for got, want in zip(got_caches, want_caches, strict=True):
        _close(got, want, dtype)
        flat = got.view(-1, kv_heads, dim)
        untouched = [i for i in range(24) if i not in (5, 0, 13, 8)]
        assert (flat[untouched] == 7.0).all()  # the padding row and other slots unwritten
    # The cache holds exactly the k the op returned (one rounding, as the twin's copy).
    assert torch.equal(got_caches[0].view(-1, kv_heads, dim)[[5, 0, 13, 8]], got_k[[0, 2, 3, 4]])


def test_rotary_and_cache_refuses_bad_caches():
    q, k = _rand(2, 2, 8), _rand(2, 1, 8)
    cos_sin = _rand(2, 2, 8)
    slots = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ValueError, match="caches"):
        ops.rotary_embedding_and_cache(q, k, k, cos_sin, _rand(2, 4, 2, 8), _rand(2, 4, 2, 8),
                                       slots, backend="triton")
    with pytest.raises(ValueError, match="slot_mapping"):
        ops.rotary_embedding_and_cache(q, k, k, cos_sin, _rand(2, 4, 1, 8), _rand(2, 4, 1, 8),
                                       slots[:1], backend="triton")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,n", [(1, 8), (3, 256), (2, 1100)])
def test_silu_and_mul(dtype, tokens, n):
    x = _rand(tokens, 2 * n, dtype=dtype)
    _close(ops.silu_and_mul(x, backend="triton"), reference.silu_and_mul(x), dtype)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="weight must be"):
        ops.rms_norm(_rand(2, 8), _rand(4), 1e-6, backend="triton")
    with pytest.raises(ValueError, match="residual"):
        ops.rms_norm(_rand(2, 8), _rand(8), 1e-6, _rand(3, 8), backend="triton")
    with pytest.raises(ValueError, match="cos_sin"):
        ops.rotary_embedding(_rand(2, 2, 8), _rand(2, 1, 8), _rand(2, 2, 4), backend="triton")
    with pytest.raises(ValueError, match="2n"):
        ops.silu_and_mul(_rand(2, 7), backend="triton")


def _tiny_model(tmp_path, arch: str):
    from pagedserve.executor.runner_setup import build_runner

    from pagedserve.tinymodels import build_model

    path = build_model(tmp_path / arch, arch=arch, num_layers=2, hidden_size=64, num_heads=4,
                       num_kv_heads=2, intermediate_size=96, vocab_size=128)
    return build_runner(str(path), device=DEVICE, dtype="float32", num_gpu_blocks=16,
                        num_cpu_blocks=0, enforce_eager=True)


def _forward(runner, ids):
    from pagedserve.executor.models import AttentionMetadata

    n = len(ids)
    attn = AttentionMetadata(
        slot_mapping=torch.arange(n, device=DEVICE),
        block_tables=torch.arange(4, dtype=torch.int32, device=DEVICE).view(1, 4),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=DEVICE), max_query_len=n)
    with torch.inference_mode():
        return runner.model(torch.tensor(ids, device=DEVICE), torch.arange(n, device=DEVICE),
                            runner.cache.kv_cache, attn)


def _set_backend(model, backend):
    for module in model.modules():
        if hasattr(module, "kernel_backend"):
            module.kernel_backend = backend


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_model_forward_fused_equals_torch_forms(tmp_path, arch):
    """Every layer op through the Triton kernels (Qwen3: per-head q/k norms too) gives the
    hidden states of the torch forms."""
    runner = _tiny_model(tmp_path, arch)
    ids = [5, 17, 99, 3, 42, 7, 64]
    _set_backend(runner.model, "torch")
    want = _forward(runner, ids)
    _set_backend(runner.model, "triton")
    got = _forward(runner, ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_startup_check_falls_back_to_torch_forms(tmp_path, monkeypatch):
    from pagedserve.executor import kernel_checks
    from pagedserve.kernels import layer_ops

    runner = _tiny_model(tmp_path, "qwen2")
    kernel_checks.check_fused_ops(runner.model)  # passes: nothing changes
    assert {m.kernel_backend for m in runner.model.modules()
            if hasattr(m, "kernel_backend")} == {"auto"}

    def broken(x):
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(layer_ops, "silu_and_mul_triton", broken)
    kernel_checks.check_fused_ops(runner.model)
    backends = [m.kernel_backend for m in runner.model.modules() if hasattr(m, "kernel_backend")]
    assert backends and set(backends) == {"torch"}


def _fusing(model, device=DEVICE) -> list[bool]:
    from types import SimpleNamespace

    from pagedserve.executor.models.llama import Attention

    probe = SimpleNamespace(max_query_len=1, slot_mapping=torch.empty(0, device=device))
    return [m.fuses_decode_rope(probe) for m in model.modules() if isinstance(m, Attention)]


def test_decode_rope_fuses_by_default_where_triton_runs(tmp_path, monkeypatch):
    """llama.Attention.fused_decode_rope: None (PAGEDSERVE_DECODE_FUSED_ROPE unset) fuses the
    decode steps' rotary into the attention launch wherever the Triton kernels run (a GPU,
    or PAGEDSERVE_KERNEL_BACKEND=triton), not on the torch twins; 0 never, 1 always; never
    for a step with prompt tokens or once the layer kernels fell back to the torch forms."""
    from types import SimpleNamespace

    from pagedserve.executor.models import llama

    runner = _tiny_model(tmp_path, "qwen2")
    monkeypatch.setattr(llama.Attention, "fused_decode_rope", None)
    monkeypatch.delenv("PAGEDSERVE_KERNEL_BACKEND", raising=False)
    assert _fusing(runner.model, "cpu") == [False, False]
    monkeypatch.setenv("PAGEDSERVE_KERNEL_BACKEND", "triton")
    assert _fusing(runner.model, "cpu") == [True, True]
    attention = runner.model.model.layers[0].self_attn
    assert not attention.fuses_decode_rope(
        SimpleNamespace(max_query_len=2, slot_mapping=torch.empty(0)))
    monkeypatch.setattr(llama.Attention, "fused_decode_rope", False)
    assert _fusing(runner.model, "cpu") == [False, False]
    monkeypatch.delenv("PAGEDSERVE_KERNEL_BACKEND")
    monkeypatch.setattr(llama.Attention, "fused_decode_rope", True)
    assert _fusing(runner.model, "cpu") == [True, True]
    _set_backend(runner.model, "torch")
    assert _fusing(runner.model, "cpu") == [False, False]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_startup_check_of_the_decode_rope_fusion(tmp_path, monkeypatch, dtype):
    """kernel_checks.check_fused_decode_rope: the fused launch equal to the two launches
    to the bit (the interpreter here) leaves the fusion on; a launch that differs by a
    little or fails turns it off on every layer (the two launches then serve)."""
    from pagedserve.executor import kernel_checks
    from pagedserve.executor.models import llama
    from pagedserve.executor.runner_setup import build_runner
    from pagedserve.kernels import ops

    from pagedserve.tinymodels import build_model

    monkeypatch.setattr(llama.Attention, "fused_decode_rope", True)
    path = build_model(tmp_path / "qwen2", arch="qwen2", num_layers=2, hidden_size=64,
                       num_heads=4, num_kv_heads=2, intermediate_size=96, vocab_size=128,
                       max_position_embeddings=64)
    runner = build_runner(str(path), device=DEVICE, dtype=dtype, num_gpu_blocks=16,
                          num_cpu_blocks=0, enforce_eager=True)
    small = dict(lens=(37, 0, 17, 32), splits=(None, 3))
    kernel_checks.check_fused_decode_rope(runner.model, **small)
    assert _fusing(runner.model) == [True, True]
    # contexts past the model's positions (a short-context model; the default check's
    # 1,061): the angles of positions it has, no index past its rotary cache
    kernel_checks.check_fused_decode_rope(runner.model, lens=(100, 0, 17), splits=(1,))
    assert _fusing(runner.model) == [True, True]
    # on an fp8 cache (--kv-cache-dtype fp8): both launches round and saturate alike
    kernel_checks.check_fused_decode_rope(runner.model, **small, kv_dtype=torch.float8_e4m3fn)
    assert _fusing(runner.model) == [True, True]

    decode = ops.paged_decode_attention

    def off_by_a_little(*args, rope=None, **kwargs):
        out = decode(*args, rope=rope, **kwargs)
        return out.add_(1e-3) if rope is not None else out

    monkeypatch.setattr(ops, "paged_decode_attention", off_by_a_little)
    kernel_checks.check_fused_decode_rope(runner.model, **small)
    assert _fusing(runner.model) == [False, False]

    for attention in runner.model.modules():
        if isinstance(attention, llama.Attention):
            del attention.fused_decode_rope  # back to the class's: fused

    def broken(*args, rope=None, **kwargs):
        if rope is not None:
            raise RuntimeError("PassManager::run failed")
        return decode(*args, **kwargs)

    monkeypatch.setattr(ops, "paged_decode_attention", broken)
    assert _fusing(runner.model) == [True, True]
    kernel_checks.check_fused_decode_rope(runner.model, **small)
    assert _fusing(runner.model) == [False, False]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_rope_fusion_passes_its_startup_check_gpu(tmp_path, dtype):
    """On a GPU the decode steps' rotary is fused into the attention launch by default, and
    build_runner's start-up check (the fused launch against the two launches, to the bit,
    at the Qwen2.5-0.5B attention shape: 14 q / 2 KV heads of 64) leaves it on."""
    from pagedserve.executor.runner_setup import build_runner

    from pagedserve.tinymodels import build_model

    path = build_model(tmp_path / "qwen2", arch="qwen2", num_layers=2, hidden_size=896,
                       num_heads=14, num_kv_heads=2, intermediate_size=96, vocab_size=128)
    runner = build_runner(str(path), device="cuda", dtype=dtype, num_gpu_blocks=16,
                          num_cpu_blocks=0, enforce_eager=True)
    assert _fusing(runner.model, "cuda") == [True, True]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_qwen_sizes_on_gpu(dtype):
    """Qwen2.5-0.5B sizes natively: hidden 896, 14/2 heads of 64, MLP 4864, 256 tokens."""
    tokens = 256
    x, w = _rand(tokens, 896, dtype=dtype), _rand(896, dtype=dtype, seed=1)
    residual = _rand(tokens, 896, dtype=dtype, seed=2)
    want = reference.rms_norm(x, w, 1e-6, residual.clone())
    got = ops.rms_norm(x, w, 1e-6, residual.clone())
    _close(got[0], want[0], dtype)
    assert torch.equal(got[1], want[1])
    qkv = _rand(tokens, (14 + 4) * 64, dtype=dtype)
    q, k = qkv[:, :896].view(tokens, 14, 64), qkv[:, 896:1024].view(tokens, 2, 64)
    angles = _rand(tokens, 1, 32, seed=4).float() * 100
    emb = torch.cat((angles, angles), dim=-1)
    cos_sin = torch.cat((emb.cos(), emb.sin()), dim=1).to(dtype)
    want_q, want_k = reference.rotary_embedding(q, k, cos_sin)
    v = qkv[:, 1024:].view(tokens, 2, 64)
    slots = torch.randperm(64 * 16, device=DEVICE)[:tokens]
    slots[::7] = -1  # padding rows, as a decode graph's
    want_caches = [torch.zeros(64, 16, 2, 64, dtype=dtype, device=DEVICE) for _ in range(2)]
    reference.reshape_and_cache(want_k, v, *want_caches, slots)
    got_caches = [torch.zeros(64, 16, 2, 64, dtype=dtype, device=DEVICE) for _ in range(2)]
    got_q, got_k = ops.rotary_embedding_and_cache(q, k, v, cos_sin, *got_caches, slots)
    _close(got_q, want_q, dtype)
    _close(got_k, want_k, dtype)
    for got, want in zip(got_caches, want_caches, strict=True):
        _close(got, want, dtype)
    gate_up = _rand(tokens, 2 * 4864, dtype=dtype)
    _close(ops.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_model_forward_fused_on_gpu(tmp_path, arch):
    test_model_forward_fused_equals_torch_forms(tmp_path, arch)
