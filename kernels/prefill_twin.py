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
tokens on the built-in model spent ~150 of 830 ms a step on them. Chunks of up to
SHORT_CHUNK_TOKENS after cached tokens (speculative decoding's drafted rows, a prefix hit's
last few tokens) are attended as decodes are, batched (decode_twin's ``_short_parts``);
longer chunks after cached tokens (chunked prefill, prefix-cache hits), and every chunk
under a sliding window that is not short, keep one fused call a sequence (``_attend_chunk``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .decode_twin import _attend_decode, _attend_short, _DecodePart, _short_parts
from .kv_gather import _gather_context, _in_float32
from .step_memo import memoized

# Whole prompts are padded to a multiple of this many tokens; one call holds at most
# FRESH_GROUP_TOKENS padded tokens (its gathered keys and values: scratch buffers).
FRESH_BUCKET_TOKENS = 16
FRESH_GROUP_TOKENS = 8192
# Chunks of at most this many tokens after cached ones (a drafted row's verification, a
# prefix hit's last few tokens) are attended as decodes are, batched (decode_twin's
# `_short_parts`); longer ones by torch's fused attention, one call a chunk.
SHORT_CHUNK_TOKENS = 16


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
    more). The split, and what each piece needs (rows, tables, masks), is derived once a
    forward (``_split_step``; step_memo.py): every layer has the same.
    """
    num_seqs = block_tables.shape[0]
    if query.shape[0] == 0 or num_seqs == 0:
        return query.new_empty(query.shape) if out is None else out
    split = memoized(f"prefill_split{sliding_window}", (block_tables, query_start_loc, seq_lens),
                     lambda: _split_step(block_tables, query_start_loc, seq_lens,
                                         query.shape[0], key_cache, sliding_window))
    if split.all_decodes:
        return _attend_decode(query, key_cache, value_cache, block_tables, seq_lens, scale,
                              sliding_window, out)
    result = out if out is not None else query.new_empty(query.shape)
    if split.decodes is not None:
        rows, tables, lens = split.decodes
        result[rows] = _attend_decode(query[rows], key_cache, value_cache, tables, lens, scale,
                                      sliding_window, None)
    for group in split.fresh:
        _attend_fresh(query, key_cache, value_cache, group, scale, result)
    _attend_short(query, key_cache, value_cache, split.short, scale, result)
    for chunk in split.chunks:
        result[chunk.start:chunk.end] = _attend_chunk(query[chunk.start:chunk.end], key_cache,
                                                      value_cache, chunk, scale)
    return result


@dataclass(frozen=True)
class _FreshGroup:
    """Whole prompts attended as one padded batch (``_attend_fresh``)."""

    count: int  # prompts
    longest: int  # their padded length
    packed: torch.Tensor  # int64 [count * longest]: each padded position's query row (pad: 0)
    tables: torch.Tensor  # int32 [count, blocks]: their block tables, padded to `longest`
    pad: torch.Tensor  # bool [count, longest, 1, 1]: padding positions
    keep: torch.Tensor  # int64: the positions of `packed` that are real tokens
    written: torch.Tensor  # int64: their query rows (`packed[keep]`)


@dataclass(frozen=True)
class _Chunk:
    """One sequence's chunk after cached tokens (or with a sliding window): ``_attend_chunk``."""

    start: int  # its query rows start:end
    end: int
    block_table: torch.Tensor  # int32 [1, max_blocks]
    seq_len: int
    # float32 [q_len, seq_len]: 0 where a query attends, -inf elsewhere (the same values as
    # the boolean mask, which torch converts again on every call: 3-21% of a call)
    bias: torch.Tensor


@dataclass(frozen=True)
class _StepSplit:
    all_decodes: bool  # one token a sequence: the decode twin alone
    decodes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (query rows, tables, lens)
    fresh: list[_FreshGroup]
    short: list[_DecodePart]  # chunks of a few tokens after cached ones (`_short_parts`)
    chunks: list[_Chunk]


def _split_step(block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                seq_lens: torch.Tensor, num_tokens: int, key_cache: torch.Tensor,
                sliding_window: int | None) -> _StepSplit:
    """The step's sequences by how they are attended (see paged_prefill_attention)."""
    num_seqs = block_tables.shape[0]
    starts = query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]
    if num_tokens == num_seqs and bool((q_lens == 1).all()):
        return _StepSplit(True, None, [], [], [])
    decodes = (q_lens == 1).nonzero().flatten()
    decode_rows = None
    if decodes.numel():
        decode_rows = (starts[decodes], block_tables[decodes], seq_lens[decodes])
    chunks = (q_lens > 1).nonzero().flatten()
    fresh = []
    if sliding_window is None or sliding_window <= 0:  # whole prompts apart
        is_whole = q_lens[chunks] == seq_lens.long()[chunks]
        fresh = [_fresh_group(block_tables, starts, q_lens, rows, padded, key_cache.shape[1])
                 for rows, padded in _fresh_groups(chunks[is_whole], q_lens)]
        chunks = chunks[~is_whole]
    is_short = q_lens[chunks] <= SHORT_CHUNK_TOKENS
    short = []
    if bool(is_short.any()):
        short = _short_parts(block_tables, starts, q_lens, seq_lens, chunks[is_short],
                             key_cache, sliding_window)
    return _StepSplit(False, decode_rows, fresh, short,
                      [_chunk(block_tables, starts, seq_lens, i, sliding_window)
                       for i in chunks[~is_short].tolist()])


def _chunk(block_tables, starts, seq_lens, i: int, sliding_window: int | None) -> _Chunk:
    a, b, seq_len = int(starts[i]), int(starts[i + 1]), int(seq_lens[i])
    q_pos = torch.arange(seq_len - (b - a), seq_len, device=starts.device)[:, None]
    k_pos = torch.arange(seq_len, device=starts.device)[None, :]
    allowed = k_pos <= q_pos
    if sliding_window is not None and sliding_window > 0:
        allowed &= k_pos > q_pos - sliding_window
    bias = torch.zeros(allowed.shape, device=starts.device).masked_fill_(~allowed, float("-inf"))
    return _Chunk(a, b, block_tables[i][None], seq_len, bias)


def _attend_chunk(
    query: torch.Tensor,  # [q_len, num_heads, head_dim], one sequence's new tokens
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    chunk: _Chunk,
    scale: float,
) -> torch.Tensor:
    """One sequence's chunk of new tokens (prefill, chunked prefill, a prefix-cache hit's
    rest): causal attention to its context, queries at the last ``q_len`` positions.

    torch's fused scaled-dot-product attention on the gathered context: it never writes the
    ``[heads, q_len, seq_len]`` scores to memory (a 512-token chunk's masked fill and softmax
    cost as much as the attention's matmuls), with the chunk's mask (its positions after
    the cached ones, and the sliding window). Whole prompts without a window go to
    ``_attend_fresh``."""
    seq_len = chunk.seq_len
    k = _gather_context(key_cache, chunk.block_table, seq_len, slot=0)[0]  # [L, Hkv, D]
    v = _gather_context(value_cache, chunk.block_table, seq_len, slot=1)[0]
    q = query.float().permute(1, 0, 2)[None]  # [1, H, q_len, D]
    k = _in_float32(k, slot=2).permute(1, 0, 2)[None]  # [1, Hkv, L, D]
    v = _in_float32(v, slot=3).permute(1, 0, 2)[None]
    ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.bias, scale=scale,
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


def _fresh_group(block_tables, starts, q_lens, rows: torch.Tensor, longest: int,
                 block_size: int) -> _FreshGroup:
    """What `_attend_fresh` needs for whole prompts ``rows`` padded to ``longest``."""
    pos = torch.arange(longest, device=starts.device)
    valid = pos[None, :] < q_lens[rows][:, None]  # [g, L]
    packed = (starts[rows][:, None] + pos[None, :]).masked_fill_(~valid, 0).flatten()
    tables = block_tables[rows]
    short = -(-longest // block_size) - tables.shape[1]
    if short > 0:  # padded past the table (blocks smaller than the padding): block 0, masked
        tables = F.pad(tables, (0, short))
    keep = valid.flatten().nonzero().flatten()
    return _FreshGroup(rows.shape[0], longest, packed, tables, ~valid[:, :, None, None], keep,
                       packed[keep])


def _attend_fresh(query, key_cache, value_cache, group: _FreshGroup, scale: float,
                  result: torch.Tensor) -> None:
    """Whole prompts ``group`` padded to its longest as one batch (see the module's
    docstring), written into their rows of ``result``."""
    num_heads, head_dim = query.shape[1:]
    count, longest = group.count, group.longest
    q = torch.index_select(query, 0, group.packed).float().view(count, longest, num_heads,
                                                                head_dim)
    k = _in_float32(_gather_context(key_cache, group.tables, longest, slot=0), slot=2)
    v = _in_float32(_gather_context(value_cache, group.tables, longest, slot=1), slot=3)
    # the padding's keys and values are whatever the cache held there: zeroed (in the
    # scratch buffers they were gathered into), so that a weight of exactly 0 meets no inf
    # or NaN
    k.masked_fill_(group.pad, 0.0)
    v.masked_fill_(group.pad, 0.0)
    ctx = F.scaled_dot_product_attention(
        q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3), is_causal=True,
        scale=scale, enable_gqa=True)  # [g, H, L, D]
    out = ctx.permute(0, 2, 1, 3).reshape(count * longest, num_heads, head_dim)
    result.index_copy_(0, group.written, out[group.keep].to(result.dtype))
