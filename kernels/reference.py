"""Pure-torch twins of the paged-attention kernels.

Every Triton kernel in this package has a twin here with the same signature. The twins are
the CPU executor's implementation and the oracle of the kernel tests; they are themselves
checked against dense causal attention. They are vectorised: keys and values are gathered by
block table for many sequences at once (a group of decodes of similar length, or one
prefill chunk), with Python loops only over such groups and over KV heads, never over
tokens. On a CPU they are the attention, so they are written for its memory system: gathers
into reused buffers, matmuls on strided views instead of permuted copies, fused attention
for prefill chunks (figures: benchmarks/README.md, "e2e_vs_hf.py").

KV-cache layout (see kernels/__init__.py): one tensor per executor,
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``; a layer's key cache is
``kv_cache[layer, 0]`` and its value cache ``kv_cache[layer, 1]``, each
``[num_blocks, block_size, num_kv_heads, head_dim]``. A token at position ``p`` of a sequence
lives in block ``block_table[p // block_size]`` at offset ``p % block_size``; its slot is
``block_id * block_size + offset``.
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F

from .kv_dtypes import to_cache_dtype, widen_e4m3_
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


class _Scratch(threading.local):
    """Per-thread buffers the gathers below reuse across layers and steps.

    A decode step gathers every sequence's keys and values into a dense tensor, layer after
    layer: megabytes each time. Fresh tensors that size come from the C allocator's mmap and
    go back to the kernel when freed, so every gather paid page faults and the kernel's
    zeroing of fresh pages (a fresh 64 MB tensor filled at 1.2 GB/s on the 2-core VM, an
    existing one at 8 GB/s). A buffer per (slot, dtype, device) grows to the largest gather
    seen and is reused; what a gather returns is a view into it, valid until the same slot's
    next gather on this thread. The memory stays held: at most what the old code allocated
    afresh for its largest step (decode groups keep a gather within about twice the keys
    or values of the context it covers)."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, slot: int, numel: int, dtype: torch.dtype, device: torch.device):
        key = (slot, dtype, device)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:  # 25% headroom: contexts grow step by step
            # a normal tensor even in inference mode (the executor's), so that a later call
            # outside it may write into it too
            with torch.inference_mode(False):
                buf = torch.empty(numel + numel // 4, dtype=dtype, device=device)
            self.buffers[key] = buf
        return buf[:numel]


_scratch = _Scratch()


def _gather_context(
    cache: torch.Tensor, block_tables: torch.Tensor, max_len: int, slot: int,
    table: torch.Tensor | None = None,
) -> torch.Tensor:
    """[num_seqs, max_len, num_kv_heads, head_dim] gathered through the block tables, a view
    into this thread's scratch buffer ``slot``. One ``index_select`` of whole blocks (rows
    of ``block_size * num_kv_heads * head_dim`` contiguous elements); table entries past a
    sequence's end are clamped to block 0 and masked by the caller. ``table``: the block
    list `_gather_table` gives (when the caller has it)."""
    num_seqs = block_tables.shape[0]
    num_blocks, block_size = cache.shape[:2]
    if table is None:
        table = _gather_table(block_tables, max_len, block_size)
    flat = cache.view(num_blocks, -1)
    out = _scratch.get(slot, table.numel() * flat.shape[1], cache.dtype, cache.device)
    torch.index_select(flat, 0, table, out=out.view(table.numel(), flat.shape[1]))
    return out.view(num_seqs, table.numel() // max(num_seqs, 1) * block_size,
                    *cache.shape[2:])[:, :max_len]


def _gather_table(block_tables: torch.Tensor, max_len: int, block_size: int) -> torch.Tensor:
    """int64 [num_seqs * blocks]: the blocks holding each sequence's first ``max_len``
    positions, row after row (entries past a table's end, -1, as block 0)."""
    num_blocks_needed = (max_len + block_size - 1) // block_size
    return block_tables[:, :num_blocks_needed].reshape(-1).long().clamp_min(0)


def _in_float32(t: torch.Tensor, slot: int, copy: bool = False) -> torch.Tensor:
    """``t`` itself when float32 (unless ``copy``), else its float32 copy in scratch buffer
    ``slot``, contiguous in ``t``'s shape: the twins compute half-precision and fp8 caches
    in float32, as the kernels accumulate.

    e4m3 bytes on a CPU: kv_dtypes.widen_e4m3_ (a table of byte pairs)."""
    if t.dtype == torch.float32 and not copy:
        return t
    out = _scratch.get(slot, t.numel(), torch.float32, t.device).view(t.shape)
    if t.dtype != torch.float8_e4m3fn or t.device.type != "cpu" or t.shape[-1] % 2:
        return out.copy_(t)
    return widen_e4m3_(t, out, _scratch.get(slot, t.numel() // 2, torch.int32, t.device))


# Decode rows are grouped by context length (see _decode_groups); a group has at least this
# many rows, so a batch of few sequences is one group.
DECODE_GROUP_MIN_SEQS = 8


def _attend_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], one token per sequence
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, tokens in the cache incl. the new one
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """One query token per sequence: each group of similar context lengths is one padded
    batch (``_attend_decode_padded``). The grouping and each group's tables and lengths are
    the step's (memoized: every layer has the same)."""
    groups = memoized("decode_groups", (block_tables, seq_lens),
                      lambda: _grouped_rows(block_tables, seq_lens))
    if groups is None:
        result = _attend_decode_padded(query, key_cache, value_cache, block_tables, seq_lens,
                                       scale, sliding_window)
        return result if out is None else out.copy_(result)
    result = out if out is not None else query.new_empty(query.shape)
    for rows, tables, lens in groups:
        result.index_copy_(0, rows, _attend_decode_padded(
            query[rows], key_cache, value_cache, tables, lens, scale, sliding_window))
    return result


def _grouped_rows(block_tables: torch.Tensor, seq_lens: torch.Tensor
                  ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None:
    """`_decode_groups` as (row indices, their block tables, their lengths) each; None when
    the batch is one group."""
    groups = _decode_groups(seq_lens.long())
    if len(groups) == 1:
        return None
    return [(rows, block_tables[rows], seq_lens[rows]) for rows in groups]


def _decode_groups(seq_lens: torch.Tensor) -> list[torch.Tensor]:
    """Row indices of the decode batch in groups of similar context length.

    Padding every sequence to the batch's longest context reads (and gathers) keys and
    values that are masked away: with contexts spread evenly up to L, about half of what is
    read. Rows are put in octaves of length below the longest (``(L/2, L]``, ``(L/4, L/2]``,
    ...), so no row is padded to more than twice its length; walking from the longest
    octave, rows accumulate until a group holds ``DECODE_GROUP_MIN_SEQS`` (each group costs
    a dozen more small ops per layer), and a short remainder joins the last group."""
    num_seqs = seq_lens.shape[0]
    if num_seqs < 2 * DECODE_GROUP_MIN_SEQS:
        return [torch.arange(num_seqs, device=seq_lens.device)]
    longest = max(int(seq_lens.max()), 1)
    # clamp: log2 of exactly 1.0 came out a hair below 0 in an executor (vectorised log2)
    octave = torch.log2(longest / seq_lens.clamp_min(1).double()).floor_().clamp_min_(0).long()
    order = torch.argsort(octave, stable=True)
    groups: list[torch.Tensor] = []
    start = size = 0
    for count in torch.bincount(octave).tolist():
        size += count
        if size >= DECODE_GROUP_MIN_SEQS:
            groups.append(order[start:start + size])
            start, size = start + size, 0
    if size:
        if groups:
            groups[-1] = order[start - groups[-1].numel():]
        else:
            groups.append(order)
    return groups


def _decode_masks(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                  sliding_window: int | None) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(the longest context L, the gather's block list, the masked positions [S, 1, 1, L]:
    past a sequence's length or outside its sliding window) of a padded decode batch."""
    lens = seq_lens.long()
    max_len = max(int(lens.max()), 1)
    k_pos = torch.arange(max_len, device=seq_lens.device)
    masked = k_pos[None, :] >= lens[:, None]  # [S, L]
    if sliding_window is not None and sliding_window > 0:
        masked |= k_pos[None, :] <= (lens - 1 - sliding_window)[:, None]
    return (max_len, _gather_table(block_tables, max_len, block_size),
            masked[:, None, None, :])


def _attend_decode_padded(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], one token per sequence
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, tokens in the cache incl. the new one
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One query token per sequence, the batch padded to its longest context.

    Keys and values are gathered once per layer ([S, L, Hkv, D], scratch buffers) and
    widened to float32 as [S, Hkv, L, D] (the widening copy transposes them, at no extra
    pass), so that every (sequence, KV head) pair is one entry of two batched matmuls:
    ``[S*Hkv, G, D] x [S*Hkv, D, L]`` for the scores of its G query heads and
    ``[S*Hkv, G, L] x [S*Hkv, L, D]`` for the context, whose result is already [S, H, D].
    (A loop over KV heads on strided views did 6 operations a head and fed BLAS operands
    with a row stride of Hkv*D: 25-30% slower on the 2-core VM, the same values to the bit.)
    Positions past a sequence's length (and outside a sliding window) are masked; a sequence
    of length 0 (a padding row) gets zeros."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    max_len, table, masked = memoized(
        f"decode_masks{sliding_window}", (block_tables, seq_lens),
        lambda: _decode_masks(block_tables, seq_lens, key_cache.shape[1], sliding_window))
    k = _gather_context(key_cache, block_tables, max_len, slot=0, table=table)
    v = _gather_context(value_cache, block_tables, max_len, slot=1, table=table)
    k = _in_float32(k.transpose(1, 2), slot=2, copy=True).view(-1, max_len, head_dim)
    v = _in_float32(v.transpose(1, 2), slot=3, copy=True).view(-1, max_len, head_dim)
    q = query.float().reshape(num_seqs * num_kv_heads, group, head_dim)
    scores = torch.bmm(q, k.transpose(1, 2)).view(num_seqs, num_kv_heads, group, max_len)
    scores.mul_(scale).masked_fill_(masked, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # length-0 rows: all -inf
    ctx = torch.bmm(probs.view(-1, group, max_len), v)  # [S*Hkv, G, D]
    return ctx.view(num_seqs, num_heads, head_dim).to(query.dtype)


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], one new token per sequence
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, tokens in the cache incl. the new one
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence to its cached context (decode)."""
    if query.shape[0] == 0:
        return query.new_empty(query.shape) if out is None else out
    return _attend_decode(query, key_cache, value_cache, block_tables, seq_lens, scale,
                          sliding_window, out)


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
    cos_sin [T, 2, D]; returns new tensors (the Triton kernel rotates in place)."""
    cos, sin = cos_sin[:, 0:1], cos_sin[:, 1:2]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    return rotate(q), rotate(k)


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


# The prefill twin lives in prefill_twin.py (it uses the helpers above).
from .prefill_twin import paged_prefill_attention  # noqa: E402, F401
