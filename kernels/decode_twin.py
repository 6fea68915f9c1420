"""The decode attention twin (the CPU executor's decode attention; the oracle of
kernels/decode_attention.py's tests): one new token a sequence attends to its cached
context, gathered from the paged cache (reference.py's helpers and layout).

The batch is attended in parts: rows grouped by context length (so no row is padded to
more than twice its length), each group split so that a part's gathered keys and values
stay in the CPU's caches (``_decode_parts``); what every layer needs for a part (its rows,
tables, mask, gather list) is derived once a forward (step_memo.py). Each part's keys and
values are gathered, widened to float32 and attended by two batched matmuls over every
(sequence, KV head) pair (``_attend_padded``). Short chunks after cached tokens (a drafted
row's verification, a prefix hit's last few tokens) are attended the same way, each
sequence's few queries together (``_short_parts``; prefill_twin.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_gather import _gather_context, _gather_pair, _gather_table, _in_float32
from .step_memo import memoized

# Decode rows are grouped by context length (see _decode_groups); a group has at least this
# many rows, so a batch of few sequences is one group.
DECODE_GROUP_MIN_SEQS = 8
# A group's rows are attended in parts of at most this many gathered key elements (rows x
# padded length x KV heads x head dim; at least one row a part): see _decode_parts.
DECODE_PART_ELEMENTS = 1 << 19


@dataclass(frozen=True)
class _DecodePart:
    """Sequences attended together as one padded batch, and what every layer needs for them:
    a decode batch's rows (one query a sequence), or short chunks' (``queries`` a sequence,
    see `_short_parts`)."""

    rows: torch.Tensor | None  # int64 [R * Q]: the query rows, Q a sequence; None: all, Q = 1
    block_tables: torch.Tensor  # int32 [R, max_blocks]: the sequences' tables
    max_len: int  # the sequences' group's longest context: each one's padded length
    table: torch.Tensor  # int64 [R * blocks]: the gather's block list
    masked: torch.Tensor  # bool [R, 1, 1, Q, max_len]: past a query's position or window
    any_masked: bool  # does `masked` hold any True (else the fill is skipped)
    any_empty: bool  # has a row length 0 (its scores all -inf: softmax's NaN zeroed)
    queries: int = 1  # Q: query tokens a sequence (a shorter chunk's last one repeats)
    keep: torch.Tensor | None = None  # int64: the positions of `rows` that are real queries
    written: torch.Tensor | None = None  # int64: their query rows (`rows[keep]`)


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
    """One query token per sequence, in parts (``_decode_parts``: derived once a forward,
    every layer has the same), each one padded batch (``_attend_padded``)."""
    parts = memoized(f"decode_parts{sliding_window}", (block_tables, seq_lens),
                     lambda: _decode_parts(block_tables, seq_lens, key_cache, sliding_window))
    if parts[0].rows is None:
        result = _attend_padded(query, key_cache, value_cache, parts[0], scale)
        return result if out is None else out.copy_(result)
    result = out if out is not None else query.new_empty(query.shape)
    for part in parts:
        result.index_copy_(0, part.rows, _attend_padded(
            query[part.rows], key_cache, value_cache, part, scale))
    return result


def _decode_parts(block_tables: torch.Tensor, seq_lens: torch.Tensor, key_cache: torch.Tensor,
                  sliding_window: int | None) -> list[_DecodePart]:
    """The decode batch's parts (`_padded_parts`), one query a row: a part covering the
    whole batch in order attends it as it is (``rows`` None)."""
    lens = seq_lens.long()
    rows = torch.arange(lens.numel(), device=lens.device)
    return _padded_parts(block_tables, lens, rows, rows, torch.ones_like(lens), key_cache,
                         sliding_window, decode=True)


def _padded_parts(block_tables: torch.Tensor, lens: torch.Tensor, seqs: torch.Tensor,
                  first_rows: torch.Tensor, chunk_lens: torch.Tensor, key_cache: torch.Tensor,
                  sliding_window: int | None, decode: bool = False) -> list[_DecodePart]:
    """Sequences ``seqs`` (contexts ``lens``, this step's tokens included; ``chunk_lens``
    queries each, from query row ``first_rows``) in groups by context length
    (`_decode_groups`), each split into runs whose gathered keys hold at most
    DECODE_PART_ELEMENTS values. Q is the longest chunk (1 for a decode batch); a shorter
    one repeats its last query (dropped after: ``keep``). Query ``t`` of a chunk of ``q``
    tokens sits at position ``len - q + t`` and attends to positions up to it (and within
    the window).

    A part's keys and values pass through memory four times (gathered, widened, and read
    by each matmul); kept to a few megabytes they stay in the CPU's caches between the
    passes. One batch of 32 rows of 256 tokens on the built-in model (19 MB of gathered
    and widened keys and values a layer) took 3.3 ms, in parts of 8 rows 2.3; 32 rows of
    1,024 tokens 14.5 ms whole, 9.8 in parts of 4 (the 2-core VM, 32 MB of L3). A row's
    values do not depend on the parts: each is padded to its group's longest context."""
    queries = 1 if decode else int(chunk_lens.max())
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    t = torch.arange(queries, device=lens.device)
    groups = _decode_groups(lens)
    parts = []
    for group in groups:
        max_len = max(int(lens[group].max()), 1)
        per_part = max(1, DECODE_PART_ELEMENTS // (max_len * num_kv_heads * head_dim))
        k_pos = torch.arange(max_len, device=lens.device)
        for start in range(0, group.numel(), per_part):
            members = group[start:start + per_part]
            whole = decode and len(groups) == 1 and members.numel() == lens.numel()
            if whole:  # the batch as it is: its own order (the group's is by length)
                members = seqs
            n_q = chunk_lens[members][:, None]
            t_q = torch.minimum(t[None, :], n_q - 1)  # [R, Q]
            rows = (first_rows[members][:, None] + t_q).flatten()
            pos = lens[members][:, None] - n_q + t_q  # [R, Q]
            masked = k_pos[None, None, :] > pos[:, :, None]  # [R, Q, L]
            if sliding_window is not None and sliding_window > 0:
                masked |= k_pos[None, None, :] <= (pos - sliding_window)[:, :, None]
            real = (t[None, :] < n_q).flatten()
            keep = None if bool(real.all()) else real.nonzero().flatten()
            tables = block_tables if whole else block_tables[seqs[members]]
            parts.append(_DecodePart(
                None if whole else rows, tables, max_len,
                _gather_table(tables, max_len, block_size), masked[:, None, None],
                bool(masked.any()), bool((lens[members] == 0).any()), queries, keep,
                rows if keep is None else rows[keep]))
    return parts


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


def _attend_padded(
    query: torch.Tensor,  # [R * Q, num_heads, head_dim]: Q query tokens a sequence
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    part: _DecodePart,
    scale: float,
) -> torch.Tensor:
    """The Q query tokens of each sequence of ``part`` (a decode's one, a short chunk's few),
    each sequence padded to the part's length.

    Keys and values are gathered ([R, L, Hkv, D], scratch buffers) and widened to float32
    as [R, Hkv, L, D] (the widening copy transposes them, at no extra pass), so that every
    (sequence, KV head) pair is one entry of two batched matmuls: ``[R*Hkv, G*Q, D] x
    [R*Hkv, D, L]`` for the scores of its G query heads' Q tokens and ``[R*Hkv, G*Q, L] x
    [R*Hkv, L, D]`` for the context (at Q = 1 already [R, H, D]). (A loop over KV heads on
    strided views did 6 operations a head and fed BLAS operands with a row stride of
    Hkv*D: 25-30% slower on the 2-core VM, the same values to the bit.) A layer's key and
    value caches side by side in one tensor (the executor's) are gathered by one
    ``index_select`` and widened by one copy. Masked positions get no weight; a sequence
    of length 0 (a padding row) gets zeros. Where no position is masked (every row as long
    as the part's longest: one sequence, or a batch in step) the fill is skipped, and the
    softmax's NaN guard where no row is empty."""
    num_rows, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group, max_len, queries = num_heads // num_kv_heads, part.max_len, part.queries
    num_seqs = num_rows // queries
    pair = _gather_pair(key_cache, value_cache, part.table, num_seqs, max_len, slot=0)
    if pair is not None:  # [2, R, L, Hkv, D] -> float32 [2, R, Hkv, L, D]
        both = _in_float32(pair.transpose(2, 3), slot=2, copy=True)
        k, v = both[0].view(-1, max_len, head_dim), both[1].view(-1, max_len, head_dim)
    else:
        k = _gather_context(key_cache, part.block_tables, max_len, slot=0, table=part.table)
        v = _gather_context(value_cache, part.block_tables, max_len, slot=1, table=part.table)
        k = _in_float32(k.transpose(1, 2), slot=2, copy=True).view(-1, max_len, head_dim)
        v = _in_float32(v.transpose(1, 2), slot=3, copy=True).view(-1, max_len, head_dim)
    q = query.float()
    if queries > 1:  # [R, Q, Hkv, G, D] -> [R, Hkv, G, Q, D]
        q = q.view(num_seqs, queries, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(num_seqs * num_kv_heads, group * queries, head_dim)
    scores = torch.bmm(q, k.transpose(1, 2)).view(num_seqs, num_kv_heads, group, queries,
                                                   max_len)
    scores.mul_(scale)
    if part.any_masked:
        scores.masked_fill_(part.masked, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if part.any_empty:  # length-0 rows: all -inf, NaN after the softmax
        probs.nan_to_num_(0.0)
    ctx = torch.bmm(probs.view(-1, group * queries, max_len), v)  # [R*Hkv, G*Q, D]
    if queries > 1:  # [R, Hkv, G, Q, D] -> [R, Q, Hkv, G, D]
        ctx = ctx.view(num_seqs, num_kv_heads, group, queries, head_dim).permute(0, 3, 1, 2, 4)
    return ctx.reshape(num_rows, num_heads, head_dim).to(query.dtype)


def _short_parts(block_tables: torch.Tensor, starts: torch.Tensor, q_lens: torch.Tensor,
                 seq_lens: torch.Tensor, seqs: torch.Tensor, key_cache: torch.Tensor,
                 sliding_window: int | None) -> list[_DecodePart]:
    """Parts for chunks of a few query tokens after cached ones (sequences ``seqs``; query
    rows from ``starts``), attended as decodes are (`_attend_padded`, `_padded_parts`),
    each sequence's queries together: one gather of its context serves them all.

    A drafted row's verification was one fused attention call a sequence and a layer
    (``_attend_chunk``): 16 drafted rows of 5 tokens at a context of 300 spent 122 of 246 ms
    a step in attention on the built-in model."""
    return _padded_parts(block_tables, seq_lens.long()[seqs], seqs, starts[seqs],
                         q_lens[seqs], key_cache, sliding_window)


def _attend_short(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  parts: list[_DecodePart], scale: float, result: torch.Tensor) -> None:
    """Short chunks' queries (`_short_parts`) attended, written into their rows of
    ``result``."""
    for part in parts:
        out = _attend_padded(query[part.rows], key_cache, value_cache, part, scale)
        result.index_copy_(0, part.written, out if part.keep is None else out[part.keep])


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
