"""An executor's start-up checks of its device kernels (CUDA), each run once at the model's
sizes and dtype before the decode graphs are captured: where a kernel fails to compile or
disagrees with what it stands for, the executor uses the slower form instead (logged) —
speed is lost, never service or a token.

* `check_fused_ops`: the fused layer kernels (RMSNorm, rotary, SiLU-and-multiply) against
  their torch twins;
* `check_fused_decode_rope`: the rotary embedding and cache write inside the decode
  attention's launch against the two launches it replaces, to the bit;
* `check_sampler_kernels`: the sampler's top-p threshold, greedy argmax and keyed draw
  against theirs;
* `check_graph_feed` (after the decode graphs are captured): a fed replay writes the static
  inputs the host packed (cuda_graphs.py `check_feed`), else the steps copy their inputs
  buffer by buffer.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
from pagedserve.executor.models import LlamaForCausalLM
from pagedserve.executor.models.llama import Attention

if TYPE_CHECKING:
    from pagedserve.executor.cuda_graphs import DecodeGraphs
    from pagedserve.executor.model_runner import ModelRunner

log = logging.getLogger(__name__)


def check_sampler_kernels(runner: ModelRunner, vocab: int, dtype: torch.dtype) -> None:
    """Run the sampler's device kernels (the whole-row top-p threshold, the greedy argmax,
    the keyed draw) once against their twins at the model's vocabulary and dtype (its
    logits'); if one
    fails to compile or disagrees (top-p: by more than a token at a rounding edge), the
    sampler uses the twins (logged): its top-p steps then wait for their forward to learn
    which rows need a full sort."""
    from pagedserve.kernels import ops

    device = runner.cache.device
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(4, vocab, generator=gen, device=device) * torch.tensor(
        [[0.1], [1.0], [3.0], [0.5]], device=device)
    lse = torch.logsumexp(logits, -1, keepdim=True)
    top_p = torch.tensor([0.3, 0.6, 0.9, 0.99], device=device)
    flags = torch.ones(4, dtype=torch.bool, device=device)
    kept = {}
    try:
        for backend in ("torch", "triton"):
            thresholds = torch.zeros(4, 1, device=device)
            ops.top_p_thresholds_(logits, lse, top_p, thresholds, flags, backend=backend)
            kept[backend] = (logits >= thresholds).sum(-1)
        worst = int((kept["triton"] - kept["torch"]).abs().max())
        if worst > 1:
            raise ValueError(f"top-p kept-token counts differ by {worst}")
        tied = logits.to(dtype)
        tied[:, vocab // 2] = tied[:, 7] = tied.max() + 1  # ties: the first index wins
        if not torch.equal(ops.argmax_rows(tied, backend="triton"),
                           ops.argmax_rows(tied, backend="torch")):
            raise ValueError("argmax_rows disagrees")
        u = torch.tensor([0.01, 0.37, 0.9, 1.0 - 2.0 ** -54], dtype=torch.float64,
                         device=device)
        min_p = torch.tensor([0.0, 0.1, 0.0, 0.02], device=device)
        for rows_min_p in (None, min_p):
            drawn = [ops.keyed_draw_(logits.clone(), rows_min_p, u, backend=backend)
                     for backend in ("triton", "torch")]
            if not torch.equal(*drawn):
                raise ValueError(f"keyed_draw_ disagrees: {drawn[0].tolist()} against "
                                 f"{drawn[1].tolist()}")
    except Exception as exc:
        log.warning("sampler kernels off, torch forms used: %s: %s", type(exc).__name__, exc)
        runner.sampler.kernel_backend = "torch"


def check_fused_ops(model: LlamaForCausalLM) -> None:
    """Run the fused layer kernels (kernels/layer_ops.py) once at this model's sizes against
    their torch twins; where one fails to compile or disagrees, every module uses the torch
    forms (logged): lose speed, not service."""
    from pagedserve.kernels import ops

    cfg, param = model.config, model.model.embed_tokens.weight
    dtype, device = param.dtype, param.device
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    tokens, hidden = 5, cfg.hidden_size
    x, residual, weight = rand(tokens, hidden), rand(tokens, hidden), rand(hidden)
    qkv = rand(tokens, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim)
    q = qkv[:, :cfg.num_heads * cfg.head_dim].view(tokens, cfg.num_heads, cfg.head_dim)
    k = qkv[:, cfg.num_heads * cfg.head_dim:].view(tokens, -1, cfg.head_dim)[:, :cfg.num_kv_heads]
    cos_sin = model.cos_sin_cache[torch.arange(tokens, device=device) * 7].to(dtype)
    gate_up = rand(tokens, 2 * cfg.intermediate_size)
    v = qkv[:, (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim:].view(
        tokens, cfg.num_kv_heads, cfg.head_dim)
    slots = torch.tensor([3, -1, 0, 9, 4], device=device)  # a padding row among them
    cache_shape = (2, 8, cfg.num_kv_heads, cfg.head_dim)

    def rotary_and_cache(backend):
        caches = torch.zeros(cache_shape, dtype=dtype, device=device), torch.zeros(
            cache_shape, dtype=dtype, device=device)
        q_rot, k_rot = ops.rotary_embedding_and_cache(q.clone(), k.clone(), v, cos_sin,
                                                      *caches, slots, backend=backend)
        return q_rot, k_rot, *caches

    checks = {
        "rms_norm": lambda backend: ops.rms_norm(x, weight, cfg.rms_norm_eps, backend=backend),
        "rms_norm_residual": lambda backend: ops.rms_norm(
            x, weight, cfg.rms_norm_eps, residual.clone(), backend=backend),
        "rms_norm_per_head": lambda backend: ops.rms_norm(
            q, weight[:cfg.head_dim], cfg.rms_norm_eps, backend=backend),
        "rotary_embedding": lambda backend: ops.rotary_embedding(
            q.clone(), k.clone(), cos_sin, backend=backend),
        "rotary_embedding_and_cache": rotary_and_cache,
        "silu_and_mul": lambda backend: ops.silu_and_mul(gate_up, backend=backend),
    }
    try:
        for name, run in checks.items():
            want, got = run("torch"), run("triton")
            for a, b in zip(*(t if isinstance(t, tuple) else (t,) for t in (got, want)),
                            strict=True):
                if not torch.allclose(a.float(), b.float(), atol=tol, rtol=tol):
                    raise ValueError(f"{name}: max difference "
                                     f"{(a.float() - b.float()).abs().max().item():.3g}")
    except Exception as exc:
        log.warning("fused layer kernels off, torch forms used: %s: %s",
                    type(exc).__name__, exc)
        for module in model.modules():
            if hasattr(module, "kernel_backend"):
                module.kernel_backend = "torch"


# Contexts of the decode-rope check: ending inside a 128-token tile (as a serving step's
# do), a padding row (no context, slot -1, as a CUDA graph's), short, one tile exactly, and
# split-K counts: the launcher's rule, none, four (the fused reduction).
DECODE_ROPE_CHECK_LENS = (1061, 0, 17, 300, 128)
DECODE_ROPE_CHECK_SPLITS = (None, 1, 4)


def check_fused_decode_rope(model: LlamaForCausalLM, lens=DECODE_ROPE_CHECK_LENS,
                            splits=DECODE_ROPE_CHECK_SPLITS,
                            kv_dtype: torch.dtype | None = None) -> None:
    """Where the model's decode steps would rotate and cache their new token inside the
    attention launch (llama.Attention.fuses_decode_rope), check once that the launch gives
    the output and both caches of the two launches (rotary-and-cache, then attention) to
    the bit, at this model's head shapes and dtype and the cache's (``kv_dtype``, default
    the model's); if not (or a kernel fails), every
    attention layer takes the two launches (logged). The two launches are what transformers
    matches (the HF-equivalence tests), so a model that passes serves the same tokens
    either way."""
    device = model.model.embed_tokens.weight.device
    probe = SimpleNamespace(max_query_len=1, slot_mapping=torch.empty(0, device=device))
    fusing = [m for m in model.modules() if isinstance(m, Attention) and m.fuses_decode_rope(probe)]
    if not fusing:
        return
    try:
        why = _decode_rope_mismatch(model, lens, splits, kv_dtype)
    except Exception as exc:  # noqa: BLE001 - a kernel that fails here runs as two launches
        why = f"{type(exc).__name__}: {exc}"
    if why:
        log.warning("the rotary in the decode attention launch off, two launches used: %s",
                    why)
        for attention in fusing:
            attention.fused_decode_rope = False


def _decode_rope_mismatch(model: LlamaForCausalLM, lens, splits,
                          kv_dtype: torch.dtype | None) -> str:
    """"" when the fused launch equals the two launches to the bit, else what differed."""
    from pagedserve.kernels import ops
    from pagedserve.kernels.kv_dtypes import same_bytes, to_cache_dtype

    cfg, param = model.config, model.model.embed_tokens.weight
    dtype, device = param.dtype, param.device
    heads, kv_heads, dim, block = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    num = len(lens)
    per_seq = [max(1, -(-n // block)) for n in lens]
    width = max(per_seq)
    tables = torch.zeros(num, width, dtype=torch.int32)
    first = 0
    for i, count in enumerate(per_seq):
        tables[i, :count] = torch.arange(first, first + count)
        first += count
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    pos = (seq_lens.long() - 1).clamp(min=0)
    slots = tables.long()[torch.arange(num), pos // block] * block + pos % block
    slots[seq_lens == 0] = -1  # a padding row writes nothing
    tables, seq_lens, slots = tables.to(device), seq_lens.to(device), slots.to(device)
    # (the angles of positions the model has: an index past its cache would be a device-side
    # assert on a GPU, which no exception handler survives)
    cos_sin = model.cos_sin_cache[pos.clamp(max=model.cos_sin_cache.shape[0] - 1)
                                  .to(device)].to(dtype)
    caches = [to_cache_dtype(rand(first, block, kv_heads, dim), kv_dtype or dtype)
              for _ in range(2)]
    q, k, v = rand(num, heads, dim), rand(num, kv_heads, dim), rand(num, kv_heads, dim)
    scale = dim ** -0.5
    for num_splits in splits:
        fused_caches = [c.clone() for c in caches]
        fused = ops.paged_decode_attention(q.clone(), *fused_caches, tables, seq_lens, scale,
                                           backend="triton", num_splits=num_splits,
                                           rope=(k.clone(), v, cos_sin, slots))
        two_caches = [c.clone() for c in caches]
        q2, _ = ops.rotary_embedding_and_cache(q.clone(), k.clone(), v, cos_sin, *two_caches,
                                               slots, backend="triton")
        two = ops.paged_decode_attention(q2, *two_caches, tables, seq_lens, scale,
                                         backend="triton", num_splits=num_splits)
        pairs = (("output", fused, two), ("key cache", fused_caches[0], two_caches[0]),
                 ("value cache", fused_caches[1], two_caches[1]))
        for name, a, b in pairs:
            if not same_bytes(a, b):
                return (f"{name} differs at num_splits={num_splits} (max "
                        f"{(a.float() - b.float()).abs().max().item():.3g})")
    return ""


def check_graph_feed(graphs: DecodeGraphs) -> None:
    """Where the captured decode graphs are fed (graph_feed.py), check once that a fed replay
    writes what the host packed; if not (or it fails), the steps copy their inputs buffer
    by buffer (logged)."""
    try:
        wrong = graphs.check_feed()
    except Exception as exc:  # noqa: BLE001 - a feed that fails costs speed, not service
        wrong = f"{type(exc).__name__}: {exc}"
    if wrong:
        log.warning("decode graph steps copy their inputs buffer by buffer: %s", wrong)
        graphs.feeds = False
