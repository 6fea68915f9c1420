"""Pure-torch twins of the paged-attention kernels.

Every Triton kernel in this package has a twin here with the same signature. The twins are
the CPU executor's implementation and the oracle of the kernel tests; they are themselves
checked against dense causal attention. They are vectorised: keys and values are gathered by
block table for the whole batch at once, with no per-token Python loop.

KV-cache layout (see kernels/__init__.py): one tensor per executor,
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``; a layer's key cache is
``kv_cache[layer, 0]`` and its value cache ``kv_cache[layer, 1]``, each
``[num_blocks, block_size, num_kv_heads, head_dim]``. A token at position ``p`` of a sequence
lives in block ``block_table[p // block_size]`` at offset ``p % block_size``; its slot is
``block_id * block_size + offset``.
"""

from __future__ import annotations

import torch


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 = padding (skipped)
) -> None:
    """Scatter the step's new keys and values into the cache at their slots."""
    num_blocks, block_size = key_cache.shape[:2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    key_cache.view(num_blocks * block_size, *key_cache.shape[2:])[slots] = key[valid].to(
        key_cache.dtype
    )
    value_cache.view(num_blocks * block_size, *value_cache.shape[2:])[slots] = value[valid].to(
        value_cache.dtype
    )


def _gather_context(
    cache: torch.Tensor, block_tables: torch.Tensor, max_len: int
) -> torch.Tensor:
    """[num_seqs, max_len, num_kv_heads, head_dim] gathered through the block tables."""
    num_seqs = block_tables.shape[0]
    block_size = cache.shape[1]
    num_blocks_needed = (max_len + block_size - 1) // block_size
    table = block_tables[:, :num_blocks_needed].long().clamp_min(0)
    gathered = cache[table]  # [S, nb, B, H, D]
    return gathered.reshape(num_seqs, num_blocks_needed * block_size, *cache.shape[2:])[
        :, :max_len
    ]


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences packed back to back
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, prefix sums of query lengths
    seq_lens: torch.Tensor,  # [num_seqs] int32, tokens in the cache incl. this step's
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens to its whole cached context.

    The new tokens' keys and values must already be in the cache (reshape_and_cache first).
    Query ``i`` of a sequence with ``q_len`` new tokens and ``seq_len`` cached tokens sits at
    position ``seq_len - q_len + i`` and attends to positions ``<=`` its own (and, with a
    sliding window ``w``, to positions ``> pos - w``). Prefix-cache hits and chunked prefill
    are the case ``seq_len > q_len``; decode is ``q_len == 1``.

    A mixed step (decodes next to prefill chunks) is split: the decodes run as one padded
    batch and each prefill chunk on its own, so no sequence is padded to another's query
    length (one batch padded to a 512-token chunk made 78 decodes cost 39x more).
    """
    num_seqs = block_tables.shape[0]
    if num_seqs <= 1:
        return _attend_padded(query, key_cache, value_cache, block_tables, query_start_loc,
                              seq_lens, scale, sliding_window, out)
    starts = query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]
    if int(q_lens.max()) <= 1:
        return _attend_padded(query, key_cache, value_cache, block_tables, query_start_loc,
                              seq_lens, scale, sliding_window, out)
    result = out if out is not None else query.new_empty(query.shape)
    decodes = (q_lens == 1).nonzero().flatten()
    if decodes.numel():
        rows = starts[decodes]
        result[rows] = _attend_padded(
            query[rows], key_cache, value_cache, block_tables[decodes],
            torch.arange(decodes.numel() + 1, device=query.device, dtype=torch.int32),
            seq_lens[decodes], scale, sliding_window, None)
    for i in (q_lens > 1).nonzero().flatten().tolist():
        a, b = int(starts[i]), int(starts[i + 1])
        result[a:b] = _attend_padded(
            query[a:b], key_cache, value_cache, block_tables[i : i + 1],
            query_start_loc.new_tensor([0, b - a]), seq_lens[i : i + 1], scale,
            sliding_window, None)
    return result


def _attend_padded(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences packed back to back
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, prefix sums of query lengths
    seq_lens: torch.Tensor,  # [num_seqs] int32, tokens in the cache incl. this step's
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """All sequences in one batch, padded to the longest query and context."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    num_seqs = block_tables.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return query.new_empty(query.shape) if out is None else out
    device = query.device

    starts = query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]
    seq_lens_l = seq_lens.long()
    max_q = int(q_lens.max())
    max_len = int(seq_lens_l.max())

    # Pad queries to [S, max_q, H, D]: token t of sequence s goes to (s, t - start[s]).
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens)
    idx_in_seq = torch.arange(num_tokens, device=device) - starts[seq_of_token]
    q = query.new_zeros(num_seqs, max_q, num_heads, head_dim, dtype=torch.float32)
    q[seq_of_token, idx_in_seq] = query.float()

    k = _gather_context(key_cache, block_tables, max_len).float()  # [S, L, Hkv, D]
    v = _gather_context(value_cache, block_tables, max_len).float()

    # Grouped-query attention without copying K/V: [S, Hkv, G*max_q, D] x [S, Hkv, D, L].
    q = q.view(num_seqs, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(num_seqs, num_kv_heads, group * max_q, head_dim)
    scores = torch.matmul(q, k.permute(0, 2, 3, 1)) * scale  # [S, Hkv, G*max_q, L]
    scores = scores.view(num_seqs, num_kv_heads, group, max_q, max_len)

    q_pos = (seq_lens_l - q_lens)[:, None] + torch.arange(max_q, device=device)[None, :]
    k_pos = torch.arange(max_len, device=device)
    allowed = k_pos[None, None, :] <= q_pos[:, :, None]  # [S, max_q, L]
    allowed &= k_pos[None, None, :] < seq_lens_l[:, None, None]
    if sliding_window is not None and sliding_window > 0:
        allowed &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # padded query rows are all -inf
    probs = probs.view(num_seqs, num_kv_heads, group * max_q, max_len)
    ctx = torch.matmul(probs, v.permute(0, 2, 1, 3))  # [S, Hkv, G*max_q, D]
    ctx = ctx.view(num_seqs, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
    ctx = ctx.reshape(num_seqs, max_q, num_heads, head_dim)

    result = ctx[seq_of_token, idx_in_seq].to(query.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


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
    num_seqs = query.shape[0]
    query_start_loc = torch.arange(num_seqs + 1, device=query.device, dtype=torch.int32)
    return paged_prefill_attention(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
        sliding_window=sliding_window, out=out,
    )


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
