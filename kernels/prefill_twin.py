"""The prefill/extend attention twin (the CPU executor's prefill attention; the oracle of
kernels/prefill_attention.py's tests): each sequence's new tokens attend causally to its
whole context, gathered from the paged cache (reference.py's helpers and layout).

Whole prompts (no cached context: the chunk is the sequence so far) run in batches by
length: each padded at the end to the next multiple of FRESH_BUCKET_TOKENS, the prompts of
one padded length in one fused attention call (torch's scaled-dot-product, causal), the
padding's keys and values zeroed and its query rows dropped. A real query row attends only
to positions up to its own, so the padding behind it takes no part; and since a prompt's
padded length is its own (never a neighbour's), its result does not depend on what else
the step holds: the rows of one call are computed apart, and the kernel sums a row's terms
in an order set by the padded length alone (padding a prompt to another's length moved
results by an ulp of float32). A step of many short prompts (embeddings, a burst of chat
turns) otherwise paid ~30 small tensor operations a sequence and a layer: 64 prompts of 8
tokens on the built-in model spent ~150 of 830 ms a step on them. Chunks after cached
tokens (chunked prefill, prefix-cache hits) and sliding windows keep one call a sequence
(``_attend_chunk``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .decode_twin import _attend_decode
from .kv_gather import _gather_context, _in_float32

# Whole prompts are padded to a multiple of this many tokens; one call holds at most
# FRESH_GROUP_TOKENS padded tokens (its gathered keys and values: scratch buffers).
FRESH_BUCKET_TOKENS = 16
FRESH_GROUP_TOKENS = 8192


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

    A mixed step (decodes next to prefill chunks) is split: the decodes run as one batch
    (``_attend_decode``), whole prompts in batches by padded length (``_attend_fresh``)
    and every other chunk on its own, so no decode is padded to a
    chunk's query length (one batch padded to a 512-token chunk made 78 decodes cost 39x
    more).
    """
    num_seqs = block_tables.shape[0]
    if query.shape[0] == 0 or num_seqs == 0:
        return query.new_empty(query.shape) if out is None else out
    starts = query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]
    if query.shape[0] == num_seqs and bool((q_lens == 1).all()):
        return _attend_decode(query, key_cache, value_cache, block_tables, seq_lens, scale,
                              sliding_window, out)
    result = out if out is not None else query.new_empty(query.shape)
    decodes = (q_lens == 1).nonzero().flatten()
    if decodes.numel():
        result[starts[decodes]] = _attend_decode(
            query[starts[decodes]], key_cache, value_cache, block_tables[decodes],
            seq_lens[decodes], scale, sliding_window, None)
    chunks = (q_lens > 1).nonzero().flatten()
    if sliding_window is None or sliding_window <= 0:  # whole prompts apart
        is_whole = q_lens[chunks] == seq_lens.long()[chunks]
        for rows, padded in _fresh_groups(chunks[is_whole], q_lens):
            _attend_fresh(query, key_cache, value_cache, block_tables, starts, q_lens, rows,
                          padded, scale, result)
        chunks = chunks[~is_whole]
    for i in chunks.tolist():
        a, b = int(starts[i]), int(starts[i + 1])
        result[a:b] = _attend_chunk(query[a:b], key_cache, value_cache, block_tables[i],
                                    int(seq_lens[i]), scale, sliding_window)
    return result


def _attend_chunk(
    query: torch.Tensor,  # [q_len, num_heads, head_dim], one sequence's new tokens
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks_per_seq] int32
    seq_len: int,  # tokens in the cache incl. these
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One sequence's chunk of new tokens (prefill, chunked prefill, a prefix-cache hit's
    rest): causal attention to its context, queries at the last ``q_len`` positions.

    torch's fused scaled-dot-product attention on the gathered context: it never writes the
    ``[heads, q_len, seq_len]`` scores to memory (a 512-token chunk's masked fill and softmax
    cost as much as the attention's matmuls), with the chunk's mask (its positions after
    the cached ones, and the sliding window). Whole prompts without a window go to
    ``_attend_fresh``."""
    q_len, num_heads, head_dim = query.shape
    k = _gather_context(key_cache, block_table[None], seq_len, slot=0)[0]  # [L, Hkv, D]
    v = _gather_context(value_cache, block_table[None], seq_len, slot=1)[0]
    q = query.float().permute(1, 0, 2)[None]  # [1, H, q_len, D]
    k = _in_float32(k, slot=2).permute(1, 0, 2)[None]  # [1, Hkv, L, D]
    v = _in_float32(v, slot=3).permute(1, 0, 2)[None]
    q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
    k_pos = torch.arange(seq_len, device=query.device)[None, :]
    allowed = k_pos <= q_pos
    if sliding_window is not None and sliding_window > 0:
        allowed &= k_pos > q_pos - sliding_window
    ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale,
                                         enable_gqa=True)
    return ctx[0].permute(1, 0, 2).to(query.dtype)


def _fresh_groups(rows: torch.Tensor,
                  q_lens: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """Whole prompts ``rows`` as (rows, padded length) calls: by their length rounded up to
    a multiple of FRESH_BUCKET_TOKENS, at most FRESH_GROUP_TOKENS padded tokens a call."""
    if rows.numel() == 0:
        return []
    bucket = FRESH_BUCKET_TOKENS
    padded = (q_lens[rows] + bucket - 1) // bucket * bucket
    groups = []
    for length in torch.unique(padded).tolist():
        members = rows[padded == length]
        per_call = max(1, FRESH_GROUP_TOKENS // length)
        groups.extend((members[i:i + per_call], length)
                      for i in range(0, members.numel(), per_call))
    return groups


def _attend_fresh(query, key_cache, value_cache, block_tables, starts, q_lens,
                  rows: torch.Tensor, longest: int, scale: float, result: torch.Tensor) -> None:
    """Whole prompts ``rows`` padded to ``longest`` tokens as one batch (see the
    module's docstring), written into their rows of ``result``."""
    num_heads, head_dim = query.shape[1:]
    lens = q_lens[rows]
    count = rows.shape[0]
    pos = torch.arange(longest, device=query.device)
    valid = pos[None, :] < lens[:, None]  # [g, L]
    packed = (starts[rows][:, None] + pos[None, :]).masked_fill_(~valid, 0).flatten()
    q = torch.index_select(query, 0, packed).float().view(count, longest, num_heads, head_dim)
    tables = block_tables[rows]
    short = -(-longest // key_cache.shape[1]) - tables.shape[1]
    if short > 0:  # padded past the table (blocks smaller than the padding): block 0, masked
        tables = F.pad(tables, (0, short))
    k = _in_float32(_gather_context(key_cache, tables, longest, slot=0), slot=2)
    v = _in_float32(_gather_context(value_cache, tables, longest, slot=1), slot=3)
    pad = ~valid[:, :, None, None]
    # the padding's keys and values are whatever the cache held there: zeroed (in the
    # scratch buffers they were gathered into), so that a weight of exactly 0 meets no inf
    # or NaN
    k.masked_fill_(pad, 0.0)
    v.masked_fill_(pad, 0.0)
    ctx = F.scaled_dot_product_attention(
        q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3), is_causal=True,
        scale=scale, enable_gqa=True)  # [g, H, L, D]
    out = ctx.permute(0, 2, 1, 3).reshape(count * longest, num_heads, head_dim)
    keep = valid.flatten().nonzero().flatten()
    result.index_copy_(0, packed[keep], out[keep].to(result.dtype))
