"""Builders of paged-attention inputs for the kernel tests and the benchmark (not hot path).

``make_paged_batch`` draws per-sequence dense keys/values, writes them into a cache through a
shuffled block table with ``reference.reshape_and_cache`` and returns everything an attention
call needs plus the dense tensors for the oracle. Unused cache slots hold large garbage so a
kernel that reads outside a sequence's context produces a visibly wrong answer.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from . import reference
from .kv_dtypes import to_cache_dtype


@dataclass(frozen=True)
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, unused entries -1
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    max_query_len: int
    dense_keys: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim]
    dense_values: list[torch.Tensor]
    scale: float


def make_paged_batch(
    seqs: list[tuple[int, int]],  # (q_len, seq_len) per sequence
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
    extra_table_columns: int = 1,
    kv_dtype: torch.dtype | None = None,
) -> PagedBatch:
    """``kv_dtype``: the caches' (default ``dtype``; an fp8 one holds the keys and values
    rounded, and ``dense_keys`` / ``dense_values`` are then what it holds, widened)."""
    kv_dtype = kv_dtype or dtype
    gen = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    blocks_per_seq = [(seq_len + block_size - 1) // block_size for _, seq_len in seqs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = to_cache_dtype(100 * torch.randn(shape, generator=gen), kv_dtype)
    value_cache = to_cache_dtype(100 * torch.randn(shape, generator=gen), kv_dtype)
    order = torch.randperm(num_blocks, generator=gen)
    width = max(blocks_per_seq, default=0) + extra_table_columns
    block_tables = torch.full((len(seqs), width), -1, dtype=torch.int32)
    dense_keys, dense_values, queries = [], [], []
    used = 0
    for i, ((q_len, seq_len), nb) in enumerate(zip(seqs, blocks_per_seq, strict=True)):
        if not 0 <= q_len <= seq_len:
            raise ValueError(f"need 0 <= q_len <= seq_len, got {(q_len, seq_len)}")
        ids = order[used : used + nb]
        used += nb
        block_tables[i, :nb] = ids.int()
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        pos = torch.arange(seq_len)
        slots = (ids[pos // block_size] * block_size + pos % block_size) if seq_len else pos
        reference.reshape_and_cache(k, v, key_cache, value_cache, slots)
        if kv_dtype != dtype:  # what the cache holds
            k, v = to_cache_dtype(k, kv_dtype).to(dtype), to_cache_dtype(v, kv_dtype).to(dtype)
        dense_keys.append(k.to(device))
        dense_values.append(v.to(device))
        queries.append(torch.randn(q_len, num_heads, head_dim, generator=gen).to(dtype))
    q_lens = torch.tensor([q for q, _ in seqs], dtype=torch.int32)
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(q_lens, 0)
    return PagedBatch(
        query=torch.cat(queries).to(device) if queries else torch.empty(0, num_heads, head_dim),
        key_cache=key_cache.to(device),
        value_cache=value_cache.to(device),
        block_tables=block_tables.to(device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor([s for _, s in seqs], dtype=torch.int32, device=device),
        max_query_len=int(q_lens.max()) if len(seqs) else 0,
        dense_keys=dense_keys,
        dense_values=dense_values,
        scale=head_dim**-0.5,
    )


def pairwise(factors: dict[str, list]) -> list[dict]:
    """A small deterministic set of combinations covering every pair of factor values
    (greedy all-pairs: repeatedly take the combination covering the most uncovered pairs)."""
    names = list(factors)
    uncovered = {
        ((a, va), (b, vb))
        for a, b in itertools.combinations(names, 2)
        for va in factors[a]
        for vb in factors[b]
    }
    candidates = [dict(zip(names, c, strict=True)) for c in itertools.product(*factors.values())]
    def pairs_of(c: dict) -> set:
        return {((a, c[a]), (b, c[b])) for a, b in itertools.combinations(names, 2)}

    chosen = []
    while uncovered:
        best = max(candidates, key=lambda c, todo=uncovered: len(pairs_of(c) & todo))
        chosen.append(best)
        uncovered -= pairs_of(best)
    return chosen


# --- shared test cases (tests/test_kernels*.py) ------------------------------------------

DECODE_FACTORS = {
    "context_len": [1, 17, 37, 97],
    "block_size": [8, 16, 64],
    "group": [1, 4, 8],
    "head_dim": [64, 80],
    "dtype": [torch.float32, torch.float16, torch.bfloat16],
}
DECODE_CASES = pairwise(DECODE_FACTORS)


def case_id(c: dict) -> str:
    return "ctx{context_len}-bs{block_size}-g{group}-d{head_dim}-{dt}".format(
        dt=str(c["dtype"]).removeprefix("torch."), **c
    )


PREFILL_CASES = [
    # (seqs [(q_len, seq_len)], block_size, num_kv_heads, group, head_dim, dtype, window)
    ([(17, 17), (37, 37)], 16, 2, 1, 64, torch.float32, None),  # plain prefill
    ([(17, 97), (5, 37)], 8, 1, 4, 80, torch.float16, None),  # prefix-cache hits
    ([(1, 37), (13, 13), (37, 97)], 64, 1, 8, 64, torch.bfloat16, None),  # mixed decode+prefill
    ([(37, 97), (17, 17)], 16, 1, 4, 64, torch.float32, 9),  # sliding window
    ([(97, 97)], 8, 2, 1, 80, torch.float32, 40),
    ([(3, 3), (0, 5), (2, 64)], 64, 1, 8, 80, torch.float16, None),  # empty chunk in the batch
]


def rope_decode_inputs(kv_heads, group, head_dim, dtype, seqs, device, seed=3, kv_dtype=None):
    """A decode batch whose new tokens (one a sequence, at position seq_len - 1) arrive
    unrotated: (batch, q, k, v, cos_sin, slots), the second sequence a padding row (slot
    -1: nothing written): for the decode kernel's ``rope`` path."""
    batch = make_paged_batch(seqs, num_kv_heads=kv_heads, group=group, head_dim=head_dim,
                             block_size=16, dtype=dtype, device=device, seed=seed,
                             kv_dtype=kv_dtype)
    num = len(seqs)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    pos = batch.seq_lens.long() - 1
    slots = batch.block_tables.long()[torch.arange(num, device=device), pos // 16] * 16 + pos % 16
    slots[1] = -1
    q, k, v = (torch.randn(num, h, head_dim, generator=gen).to(device, dtype)
               for h in (kv_heads * group, kv_heads, kv_heads))
    angles = torch.rand(num, 1, head_dim // 2, generator=gen) * 10
    emb = torch.cat((angles, angles), -1)
    cos_sin = torch.cat((emb.cos(), emb.sin()), 1).to(device, dtype)
    return batch, q, k, v, cos_sin, slots


def rope_fused_and_two_launches(batch, q, k, v, cos_sin, slots, **launch):
    """(out, key cache, value cache) of the fused launch and of rotary-and-cache then
    decode, each on its own copy of the caches."""
    from . import ops
    from .decode_attention import paged_decode_attention_triton

    runs = []
    for fused in (True, False):
        kc, vc = batch.key_cache.clone(), batch.value_cache.clone()
        qq, kk = q.clone(), k.clone()
        if fused:
            out = paged_decode_attention_triton(qq, kc, vc, batch.block_tables, batch.seq_lens,
                                                batch.scale, rope=(kk, v, cos_sin, slots),
                                                **launch)
        else:
            ops.rotary_embedding_and_cache(qq, kk, v, cos_sin, kc, vc, slots, backend="triton")
            out = paged_decode_attention_triton(qq, kc, vc, batch.block_tables, batch.seq_lens,
                                                batch.scale, **launch)
        runs.append((out, kc, vc))
    return runs
