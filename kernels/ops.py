"""Public kernel entry points: the executor imports only from here.

Each function has the signature of its torch twin in ``reference`` plus a keyword-only
``backend``:

* ``"auto"`` (default): the Triton kernel when the tensors are on CUDA, the twin otherwise;
* ``"triton"``: always the Triton kernel (on CPU only under ``TRITON_INTERPRET=1``: tests);
* ``"torch"``: always the twin.

The environment variable ``PAGEDSERVE_KERNEL_BACKEND`` (``auto``/``triton``/``torch``) changes
what ``"auto"`` means, e.g. to run an executor on the twins on a GPU while debugging. It is read
at each call; nothing else is global.

Hot path: no host synchronisation, no tensor allocation beyond the output, no logging here.
"""

from __future__ import annotations

import os
import threading

import torch

from . import block_copy, reference
from .host_math import TRITON_GEMM_MAX_TOKENS, mixed_decode_split_from_env

# Read at import, leniently (an executor checks the value at its start); tests set it.
MIXED_DECODE_SPLIT = mixed_decode_split_from_env(strict=False)
# A CPU executor's packed projections (executor/packed_weights.py): row counts that oneDNN
# multiplies faster padded with rows to a few more (rows -> padded rows), as timed at
# the executor's start on its own weights; only where every row's values are the same at
# both counts (checked then). Empty: no padding (a GPU, a float32 model, a test).
PACKED_ROW_PADDING: dict[int, int] = {}

__all__ = [
    "reshape_and_cache",
    "paged_attention",
    "paged_decode_attention",
    "paged_prefill_attention",
    "copy_blocks",
    "swap_blocks",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "top_p_thresholds_",
    "argmax_rows",
    "graph_inputs_",
]

_BACKENDS = ("auto", "triton", "torch")


def runs_triton(tensor: torch.Tensor, backend: str = "auto") -> bool:
    """Does an op on ``tensor`` with ``backend`` take the Triton kernel (natively on CUDA,
    or forced by PAGEDSERVE_KERNEL_BACKEND=triton), not the torch twin?"""
    return _use_triton(backend, tensor)


def _use_triton(backend: str, tensor: torch.Tensor) -> bool:
    if backend == "auto":
        backend = os.environ.get("PAGEDSERVE_KERNEL_BACKEND", "auto")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return tensor.is_cuda
    return backend == "triton"


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: str = "auto",
) -> None:
    """Scatter new keys/values into the cache by slot; slot -1 (padding) is skipped."""
    if _use_triton(backend, key_cache):
        from .cache_ops import reshape_and_cache_triton

        reshape_and_cache_triton(key, value, key_cache, value_cache, slot_mapping)
    else:
        reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    num_splits: int | None = None,
    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One query token per sequence attending to its cached context.

    ``num_splits`` (Triton only) forces the split-K partition count; ``None`` lets the
    launcher's rule decide (see ``decode_attention.choose_num_splits``). ``rope`` = (key,
    value, cos_sin, slot_mapping) of the step's new tokens, one a sequence, with ``query``
    and ``key`` not yet rotated: `rotary_embedding_and_cache` first. The Triton path does it
    in the attention's launch (the same values to the bit); the twin path runs the two ops.
    """
    if _use_triton(backend, query):
        from .decode_attention import paged_decode_attention_triton

        return paged_decode_attention_triton(
            query, key_cache, value_cache, block_tables, seq_lens, scale,
            sliding_window=sliding_window, out=out, num_splits=num_splits, rope=rope,
        )
    if rope is not None:
        key, value, cos_sin, slot_mapping = rope
        query, _ = rotary_embedding_and_cache(query, key, value, cos_sin, key_cache,
                                              value_cache, slot_mapping, backend=backend)
    return reference.paged_decode_attention(
        query, key_cache, value_cache, block_tables, seq_lens, scale,
        sliding_window=sliding_window, out=out,
    )


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens (packed, varlen) to its whole context.

    ``max_query_len`` (the longest query chunk) sizes the Triton grid; pass it when known to
    avoid a device-to-host read of ``query_start_loc``.
    """
    if _use_triton(backend, query):
        from .prefill_attention import paged_prefill_attention_triton

        return paged_prefill_attention_triton(
            query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
            sliding_window=sliding_window, out=out, max_query_len=max_query_len,
        )
    return reference.paged_prefill_attention(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
        sliding_window=sliding_window, out=out,
    )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    decode_split: tuple[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Unified entry: the decode kernel when ``max_query_len == 1`` (then ``query`` holds one
    token per sequence and ``query_start_loc`` is ``arange(num_seqs + 1)``), else the
    prefill/extend kernel (chunked prefill, prefix-cache hits, mixed batches).

    ``decode_split`` = (d, the rest's query_start_loc rebased to 0) for a mixed batch whose
    first d sequences have one query token each (``decode_split_of``; the switch
    PAGEDSERVE_MIXED_DECODE_SPLIT): those go to the decode kernel and the rest to the
    prefill kernel, each writing its rows of ``out``."""
    if max_query_len == 1:
        return paged_decode_attention(
            query, key_cache, value_cache, block_tables, seq_lens, scale,
            sliding_window=sliding_window, out=out, backend=backend,
        )
    if decode_split is not None:
        d, rest_start_loc = decode_split
        if out is None:
            out = torch.empty_like(query)
        paged_decode_attention(query[:d], key_cache, value_cache, block_tables[:d],
                               seq_lens[:d], scale, sliding_window=sliding_window,
                               out=out[:d], backend=backend)
        paged_prefill_attention(query[d:], key_cache, value_cache, block_tables[d:],
                                rest_start_loc, seq_lens[d:], scale,
                                sliding_window=sliding_window, out=out[d:], backend=backend,
                                max_query_len=max_query_len)
        return out
    return paged_prefill_attention(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
        sliding_window=sliding_window, out=out, backend=backend, max_query_len=max_query_len,
    )


def decode_split_of(num_new, query_start_loc: torch.Tensor) -> tuple | None:
    """``paged_attention``'s ``decode_split`` for a step whose sequences take ``num_new``
    (numpy, host) query tokens each: (d, the rest's query_start_loc from 0, on the device),
    d the leading one-token sequences; None unless the switch is on and the step has both
    (a decode step has no other: None) — one device subtraction a step, not a layer."""
    if not MIXED_DECODE_SPLIT or num_new.shape[0] == 0:
        return None
    not_one = num_new != 1
    d = int(not_one.argmax()) if not_one.any() else num_new.shape[0]
    if d == 0 or d == num_new.shape[0]:
        return None
    return d, query_start_loc[d:] - d


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           triton_gemm: bool = False, silu_mul: bool = False,
           backend: str = "auto", packed: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T (+ bias): torch's linear (cuBLAS on a GPU), or with
    ``triton_gemm`` the autotuned split-K Triton GEMM (linear_ops.py) for up to
    TRITON_GEMM_MAX_TOKENS rows on the Triton backend, or on a CPU with ``packed`` (the
    weight in oneDNN's blocked layout, executor/packed_weights.py; ``weight`` then holds
    only its shape) oneDNN's linear on it, bit for bit torch's. ``silu_mul``: x is [T, 2K],
    gate then up, multiplied as `silu_and_mul(x)` (``backend``'s), inside the Triton GEMM's
    operand loads when it runs."""
    if triton_gemm and packed is None and x.dim() == 2 \
            and x.shape[0] <= TRITON_GEMM_MAX_TOKENS and _use_triton(backend, x):
        from .linear_ops import linear_tuned

        return linear_tuned(x, weight, bias, silu_mul=silu_mul)
    if silu_mul:
        x = silu_and_mul(x, backend=backend)
    if packed is not None:  # (never with the Triton GEMM: ``weight`` has no values then)
        return packed_linear(x, packed, bias)
    return torch.nn.functional.linear(x, weight, bias)


def packed_linear(x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """oneDNN's linear on a packed weight; x [T, K], padded with rows where
    PACKED_ROW_PADDING says T rows run faster so (the result: a view of its first T rows).
    The padded input is a scratch buffer of this thread's, x copied into its first rows
    (one copy; a padding row holds zeros or an earlier call's row: each output row is its
    own input row's dot products, so no padding row reaches a kept one)."""
    rows = x.shape[0]
    padded = PACKED_ROW_PADDING.get(rows)
    if padded is None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    whole = _pad_scratch.get(padded, x)
    whole[:rows].copy_(x)
    return torch.ops.mkldnn._linear_pointwise(whole, packed, bias, "none", [], "")[:rows]


class _PadScratch(threading.local):
    """`packed_linear`'s padded inputs, per thread: one [padded, K] buffer a (padded, K,
    dtype, device), shared by every row count padded to it."""

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}

    def get(self, padded: int, x: torch.Tensor) -> torch.Tensor:
        key = (padded, x.shape[1], x.dtype, x.device)
        whole = self.buffers.get(key)
        if whole is None:
            # a normal tensor even in inference mode (the executor's), so that a later call
            # outside it may write into it too
            with torch.inference_mode(False):
                whole = self.buffers[key] = x.new_zeros(padded, x.shape[1])
        return whole


_pad_scratch = _PadScratch()


def copy_blocks(
    kv_cache: torch.Tensor, block_mapping: torch.Tensor, *, backend: str = "auto"
) -> None:
    """Copy-on-write: copy block src -> dst for every (src, dst) row, all layers, K and V."""
    if _use_triton(backend, kv_cache):
        from .cache_ops import copy_blocks_triton

        copy_blocks_triton(kv_cache, block_mapping)
    elif kv_cache.device.type == "cpu":
        block_copy.copy_blocks_host(kv_cache, block_mapping)
    else:
        reference.copy_blocks(kv_cache, block_mapping)


def swap_blocks(
    src_cache: torch.Tensor,
    dst_cache: torch.Tensor,
    block_mapping: torch.Tensor,
    *,
    backend: str = "auto",
) -> None:
    """Move blocks between the device cache and the (pinned) CPU swap space, same layout.

    Not a Triton kernel: on CUDA it is a batched gather + one non-blocking copy across the
    bus (see ``cache_ops.swap_blocks_device``); on CPU, copies by runs of consecutive ids
    (``block_copy``: the twin's result, several times faster). ``backend`` is accepted for
    symmetry; ``"triton"`` also selects the device path.
    """
    on_device = src_cache.is_cuda or dst_cache.is_cuda
    if _use_triton(backend, src_cache if src_cache.is_cuda else dst_cache) and on_device:
        from .cache_ops import swap_blocks_device

        swap_blocks_device(src_cache, dst_cache, block_mapping)
    elif src_cache.device.type == dst_cache.device.type == "cpu":
        block_copy.swap_blocks_host(src_cache, dst_cache, block_mapping)
    else:
        reference.swap_blocks(src_cache, dst_cache, block_mapping)


# --- per-layer elementwise ops (layer_ops.py) -------------------------------------------------

def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    *, backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last axis; with ``residual``, of x + residual, returned as the second
    value (the Triton kernel writes it into ``residual``: callers must not reuse it)."""
    if _use_triton(backend, x):
        from .layer_ops import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual)
    return reference.rms_norm(x, weight, eps, residual)


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, *, backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE of q and k by cos_sin [T, 2, D]; the Triton kernel rotates in place
    and returns q and k themselves, the twin returns new tensors."""
    if _use_triton(backend, q):
        from .layer_ops import rotary_embedding_triton

        return rotary_embedding_triton(q, k, cos_sin)
    return reference.rotary_embedding(q, k, cos_sin)


def rotary_embedding_and_cache(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor,
    key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
    *, backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_embedding` of q and k, then `reshape_and_cache` of the rotated k and v (slot
    -1: not written). The Triton kernel does both in one launch, rotating in place; the
    twin path is the two ops (the cache write with its own ``auto`` backend)."""
    if _use_triton(backend, q):
        from .layer_ops import rotary_embedding_and_cache_triton

        return rotary_embedding_and_cache_triton(q, k, v, cos_sin, key_cache, value_cache,
                                                 slot_mapping)
    q, k = reference.rotary_embedding(q, k, cos_sin)
    reshape_and_cache(k, v, key_cache, value_cache, slot_mapping)
    return q, k


def silu_and_mul(x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """x [T, 2n] (gate then up) -> silu(gate) * up, [T, n]."""
    if _use_triton(backend, x):
        from .layer_ops import silu_and_mul_triton

        return silu_and_mul_triton(x)
    return reference.silu_and_mul(x)


# --- sampling (sampling_ops.py) -----------------------------------------------------------------

def top_p_thresholds_(
    logits: torch.Tensor, lse: torch.Tensor, top_p: torch.Tensor, thresholds: torch.Tensor,
    unresolved: torch.Tensor, *, backend: str = "auto",
) -> None:
    """The nucleus threshold of each whole row the caller marks ``unresolved``, written into
    ``thresholds`` [R, 1]; the Triton kernel reads nothing back to the host."""
    if _use_triton(backend, logits):
        from .sampling_ops import top_p_thresholds_triton

        top_p_thresholds_triton(logits, lse, top_p, thresholds, unresolved,
                                reference.EXP_FLOOR)
    else:
        reference.top_p_thresholds_(logits, lse, top_p, thresholds, unresolved)


def keyed_draw_(x: torch.Tensor, min_p: torch.Tensor | None, u: torch.Tensor, *,
                temperature: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                floor: torch.Tensor | None = None, out: torch.Tensor | None = None,
                backend: str = "auto") -> torch.Tensor:
    """int64 [R]: each row's token by the keyed inverse-CDF draw (reference.keyed_draw_;
    ``min_p`` [R] or None; u float64 [R]). x [R, V]: float32 logits with temperature and
    filters applied, -inf where excluded (the twin overwrites them); or, with
    ``temperature`` [R], the logits as the model left them, row r being x[rows[r]]
    (``rows`` int64 [R]; None: x[r]) divided by temperature[r] (the twin divides into
    ``out``, a float32 [R, V] buffer, or a new one). ``floor`` [R] (float32, -inf: none):
    the values below it excluded, as a top-p threshold's fill (the twin fills them with
    -inf). The Triton path reads the rows twice and
    one chunk of each a third time, writes nothing but the tokens and reads nothing back
    (draw_ops.py): the twin's tokens but where a cumulative sum's rounding lands on a
    token's edge."""
    if _use_triton(backend, x):
        from .draw_ops import keyed_draw_triton

        return keyed_draw_triton(x, min_p, u, temperature=temperature, rows=rows,
                                 floor=floor)
    if temperature is not None:
        x = reference.tempered(x, temperature, rows, out=out)
    if floor is not None:
        x.masked_fill_(x < floor.unsqueeze(1), float("-inf"))
    return reference.keyed_draw_(x, min_p, u)


def argmax_rows(logits: torch.Tensor, *, out: torch.Tensor | None = None,
                backend: str = "auto") -> torch.Tensor:
    """int64 [R]: the first index of each row's largest logit (greedy tokens; into ``out``,
    int64 [R], when given); the Triton form splits each row over many programs (torch's
    walks a row with one)."""
    if _use_triton(backend, logits):
        from .sampling_ops import argmax_rows_triton

        return argmax_rows_triton(logits, out=out)
    return reference.argmax_rows(logits, out=out)


def graph_inputs_(stage: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                  slot_mapping: torch.Tensor, seq_lens: torch.Tensor,
                  block_tables: torch.Tensor, last_tokens: torch.Tensor, *,
                  backend: str = "auto") -> None:
    """A decode graph's static inputs (token ids, positions, slots, context lengths, block
    tables) written from the one staged int32 buffer the host copied in, padding rows
    included (graph_input_ops.py: the layout; ``last_tokens``: the previous replay's
    greedy tokens, read when the header says the ids are those)."""
    if _use_triton(backend, stage):
        from .graph_input_ops import graph_inputs_triton

        graph_inputs_triton(stage, input_ids, positions, slot_mapping, seq_lens,
                            block_tables, last_tokens)
    else:
        reference.graph_inputs_(stage, input_ids, positions, slot_mapping, seq_lens,
                                block_tables, last_tokens)
