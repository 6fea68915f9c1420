"""Pure-torch twins of the paged-attention kernels.

Every Triton kernel in this package has a twin here with the same signature (the attention
twins in decode_twin.py and prefill_twin.py, named here too). The twins are the CPU
executor's implementation and the oracle of the kernel tests; they are themselves checked
against dense causal attention. They are vectorised: keys and values are gathered by block
table for many sequences at once (a part of a decode batch, or whole prompts of one padded
length), with Python loops only over such parts, never over tokens. On a CPU they are the
attention, so they are written for its memory system: gathers into reused buffers
(kv_gather.py), batched matmuls over every (sequence, KV head) pair, decode batches in
parts that stay in the CPU's caches, fused attention for prefill chunks, a step's metadata
derived once a forward (step_memo.py). Figures: benchmarks/README.md, "e2e_vs_hf.py" and
"CPU decode attention".

KV-cache layout (see kernels/__init__.py): one tensor per executor,
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``; a layer's key cache is
``kv_cache[layer, 0]`` and its value cache ``kv_cache[layer, 1]``, each
``[num_blocks, block_size, num_kv_heads, head_dim]``. A token at position ``p`` of a sequence
lives in block ``block_table[p // block_size]`` at offset ``p % block_size``; its slot is
``block_id * block_size + offset``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# The attention twins live in decode_twin.py and prefill_twin.py (their gathers from the
# paged cache: kv_gather.py); named here with the others.
from .decode_twin import (  # noqa: F401
    DECODE_GROUP_MIN_SEQS,
    _decode_groups,
    paged_decode_attention,
)
from .kv_dtypes import to_cache_dtype
from .prefill_twin import paged_prefill_attention  # noqa: F401
from .step_memo import memoized


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 = padding (skipped)
) -> None:
    """Scatter the step's new keys and values into the cache at their slots."""
    num_blocks, block_size = key_cache.shape[:2]
    slots, valid = memoized("cache_slots", (slot_mapping,), lambda: _cache_slots(slot_mapping))
    if valid is not None:
        key, value = key[valid], value[valid]
    key_cache.view(num_blocks * block_size, *key_cache.shape[2:])[slots] = to_cache_dtype(
        key, key_cache.dtype)
    value_cache.view(num_blocks * block_size, *value_cache.shape[2:])[slots] = to_cache_dtype(
        value, value_cache.dtype)


def _cache_slots(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the written tokens' slots as int64, the mask of those tokens or None for all)."""
    valid = slot_mapping >= 0
    if bool(valid.all()):
        return slot_mapping.long(), None
    return slot_mapping[valid].long(), valid


def copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy-on-write: for every (src, dst) row of ``block_mapping`` copy the block in every
    layer, keys and values. ``kv_cache`` is ``[num_layers, 2, num_blocks, ...]``."""
    if block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0].long().to(kv_cache.device)
    dst = block_mapping[:, 1].long().to(kv_cache.device)
    kv_cache[:, :, dst] = kv_cache[:, :, src]


def swap_blocks(
    src_cache: torch.Tensor, dst_cache: torch.Tensor, block_mapping: torch.Tensor
) -> None:
    """Move blocks between two caches of the same layout (device <-> CPU swap space):
    ``dst_cache[:, :, dst] = src_cache[:, :, src]`` for every (src, dst) row."""
    if block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0].long().to(src_cache.device)
    dst = block_mapping[:, 1].long().to(dst_cache.device)
    dst_cache[:, :, dst] = src_cache[:, :, src].to(dst_cache.device)


def dense_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Plain causal attention of one sequence, [T, H, D] x [L, Hkv, D], queries at the last T
    positions: the oracle the twins are checked against."""
    num_q, num_heads, _ = query.shape
    num_k, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    k = key.float().repeat_interleave(group, dim=1)
    v = value.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,lhd->htl", query.float(), k) * scale
    q_pos = torch.arange(num_k - num_q, num_k)[:, None]
    k_pos = torch.arange(num_k)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None and sliding_window > 0:
        mask &= k_pos > q_pos - sliding_window
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("htl,lhd->thd", torch.softmax(scores, -1), v).to(query.dtype)


# --- per-layer elementwise ops (twins of layer_ops.py; the CPU executor's own forms) ---------

def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """transformers' RMSNorm over the last axis (statistics in float32, the normalised value
    rounded to x's dtype, then times the weight). With ``residual``: (norm(x + residual),
    x + residual); the Triton kernel writes the sum into ``residual``, this form does not."""
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(dtype)
    return (out, residual) if residual is not None else out


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE (transformers' rotate_half) of q [T, H, D] and k [T, Hkv, D] by
    cos_sin [T, 2, D]; returns new tensors (the Triton kernel rotates in place).

    transformers' ``x * cos + cat(-x2, x1) * sin`` computed as ``x * cos + roll(x) * sin'``,
    sin' being sin with its first half negated (derived once a forward): ``(-a) * b`` and
    ``a * (-b)`` round alike, so the values are the same to the bit in two operations
    fewer. When k's heads follow q's in memory (the fused q/k/v projection's views), both
    are rotated as one [T, H + Hkv, D] view: the same values, half the operations."""
    cos, signed_sin = memoized("rope_signed_sin", (cos_sin,), lambda: _signed_sin(cos_sin))
    half = q.shape[-1] // 2

    def rotate(x: torch.Tensor) -> torch.Tensor:
        return x * cos + x.roll(half, dims=-1) * signed_sin

    both = _heads_together(q, k)
    if both is not None:
        rotated = rotate(both)
        return rotated[:, :q.shape[1]], rotated[:, q.shape[1]:]
    return rotate(q), rotate(k)


def _signed_sin(cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos [T, 1, D], sin with its first half negated [T, 1, D]) of cos_sin [T, 2, D]."""
    cos, sin = cos_sin[:, 0:1], cos_sin[:, 1:2]
    half = sin.shape[-1] // 2
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _heads_together(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """[T, H + Hkv, D]: one view of q's and k's heads when k's follow q's in every row
    (same storage and dtype, unit-stride heads of D elements, the same row stride; a single
    row's stride is whatever its view says and does not count); else None."""
    if q.dim() != 3 or k.dim() != 3 or q.dtype != k.dtype or q.shape[0] != k.shape[0] \
            or q.shape[2] != k.shape[2]:
        return None
    tokens, heads, dim = q.shape
    if q.stride(2) != 1 or k.stride(2) != 1 or q.stride(1) != dim or k.stride(1) != dim \
            or (tokens > 1 and q.stride(0) != k.stride(0)) \
            or q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr() \
            or k.storage_offset() != q.storage_offset() + heads * dim:
        return None
    return q.as_strided((tokens, heads + k.shape[1], dim), (q.stride(0), dim, 1))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2n] (gate then up) -> silu(gate) * up (the product into silu's output: one
    [T, n] tensor fewer a layer, ~10% of this op on a CPU at 512 x 1536 bf16)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


# --- sampling (twin of sampling_ops.py) ------------------------------------------------------

EXP_FLOOR = -87.0  # exp(-87) = 1.6e-38, just above fp32's smallest normal number


def top_p_threshold(desc: torch.Tensor, lse: torch.Tensor,
                    top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of logits in descending order (desc [R, K]: whole rows, or their K best) with
    their log-sum-exp [R, 1]: the nucleus threshold [R, 1], the value of the last token
    whose mass before it is < top_p [R] (each token weighs exp(max(x - lse, EXP_FLOOR))),
    and how many of the K tokens that keeps [R]."""
    cum = (desc - lse).clamp_(min=EXP_FLOOR).exp_().cumsum_(-1)
    mass_before = torch.zeros_like(cum)
    mass_before[:, 1:] = cum[:, :-1]
    n_keep = (mass_before < top_p.unsqueeze(1)).sum(-1)
    return desc.gather(1, (n_keep - 1).unsqueeze(1)), n_keep


def top_p_thresholds_(logits: torch.Tensor, lse: torch.Tensor, top_p: torch.Tensor,
                      thresholds: torch.Tensor, unresolved: torch.Tensor) -> None:
    """In place: ``thresholds[r]`` = the nucleus threshold of the whole row ``logits[r]``
    for every row with ``unresolved[r]``, by sorting those rows (which ones: a host read,
    free on a CPU; the Triton kernel needs none)."""
    if bool(unresolved.any()):
        rows = unresolved.nonzero().squeeze(1)
        full = logits[rows].sort(dim=-1, descending=True).values
        thresholds[rows] = top_p_threshold(full, lse[rows], top_p[rows])[0]


def argmax_rows(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [R]: the first index of each row's largest logit (into ``out`` when given)."""
    if out is None:
        return logits.argmax(-1)
    return torch.argmax(logits, -1, out=out)


def graph_inputs_(stage: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                  slot_mapping: torch.Tensor, seq_lens: torch.Tensor,
                  block_tables: torch.Tensor, last_tokens: torch.Tensor) -> None:
    """A decode graph's static inputs from its staged buffer (graph_input_ops.py has the
    layout and the rules); reads the header on the host."""
    n, w, ids_from = (int(v) for v in stage[:3].tolist())
    if ids_from == 3:
        return
    values = stage[4:4 + 4 * n].view(4, n).long()
    if ids_from == 0:
        input_ids[:n] = values[0]
    elif ids_from == 1:
        input_ids[:n] = last_tokens[:n]
    positions[:n], slot_mapping[:n], seq_lens[:n] = values[1], values[2], values[3]
    block_tables[:n, :w] = stage[4 + 4 * n:4 + 4 * n + n * w].view(n, w)
    input_ids[n:], positions[n:], seq_lens[n:] = 0, 0, 0
    slot_mapping[n:] = -1


# --- the keyed draw (twin of draw_ops.py) --------------------------------------------------


def exp_relative_to_max_(x: torch.Tensor) -> torch.Tensor:
    """In place: unnormalised softmax exp(x - max), max 1. Relative probabilities below
    exp(-86.5) (near fp32's smallest normal number; -inf included) become exactly 0:
    an exp that underflows is ~20x slower on CPU, and a cdf cannot resolve such mass."""
    x.sub_(x.amax(-1, keepdim=True)).clamp_(min=EXP_FLOOR).exp_()
    return torch.nn.functional.threshold_(x, math.exp(EXP_FLOOR + 0.5), 0.0)


def sample_from_probs_(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw per row: probs [N, V] >= 0, unnormalised, is overwritten by its
    cumsum; u float64 [N] in (0, 1). Returns int64 [N]: the first i with cdf[i] > u * total,
    which always has probability > 0 (token 0 for a row with no mass at all)."""
    cdf = probs.cumsum_(-1)
    total = cdf[:, -1:]
    target = (u.unsqueeze(1).to(torch.float64) * total.to(torch.float64)).to(cdf.dtype)
    idx = torch.searchsorted(cdf, target, right=True)
    # u * total rounded up to total: take the last token with mass. Computed for every row
    # and selected (no device-to-host read of "any row over?": sampling never syncs).
    over = idx >= cdf.shape[1]
    idx = torch.where(over, torch.searchsorted(cdf, total.contiguous(), right=False), idx)
    # A row with no mass at all (every logit -inf: nothing allowed) would search past its
    # end: token 0 instead, in range (draw_ops.py does the same).
    idx = torch.where(total > 0, idx, torch.zeros_like(idx))
    return idx.squeeze(1)


def tempered(x: torch.Tensor, temperature: torch.Tensor, rows: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [R, V]: x[rows] (None: x) divided by temperature [R], written into ``out``
    (or a new tensor); 16-bit x is widened (exactly) first."""
    shape = (x.shape[0] if rows is None else rows.shape[0], x.shape[1])
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=x.device)
    if rows is None:
        return torch.div(x, temperature.unsqueeze(1), out=out)
    if x.dtype == torch.float32:
        return torch.index_select(x, 0, rows, out=out).div_(temperature.unsqueeze(1))
    return out.copy_(torch.index_select(x, 0, rows)).div_(temperature.unsqueeze(1))


def keyed_draw_(x: torch.Tensor, min_p: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    """int64 [R]: one token a row of x [R, V] (fp32 logits, temperature and filters applied,
    -inf where excluded; overwritten): probabilities exp(x - max) (below exp(-86.5) of the
    best: 0), those below ``min_p`` [R] of the best zeroed (None: no row has min_p), then
    the first token whose cumulative probability exceeds u [R] (float64) of the total."""
    probs = exp_relative_to_max_(x)
    if min_p is not None:
        probs.masked_fill_(probs < min_p.unsqueeze(1) * probs.amax(-1, keepdim=True), 0.0)
    return sample_from_probs_(probs, u)
