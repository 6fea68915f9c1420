"""A decode graph's inputs unpacked from one staged buffer: Triton kernel and launcher.

Twin: ``reference.graph_inputs_``. Used by executor/cuda_graphs.py, where this launch is the
first node of every captured decode graph.

Why: a decode step replayed as a CUDA graph reads its inputs from static buffers (token ids,
positions, slots, context lengths [B], block tables [B, W]). Copying a step's rows into them
one tensor at a time, and writing the padding rows, took five to nine launches on the host
between two forwards (each ~20-30 us of host time on an H200's host, 2026-11-27), plus a
packed host-to-device copy of the tables. Instead the host writes the step's values into one
pinned buffer, one copy moves it to the device (``stage``), and the graph itself scatters it
into the static buffers before its forward: one launch on the host's path, not ten.

Stage layout, int32 words: a header ``[n, w, ids_from, 0]``, then four runs of ``n`` values
(token ids, positions, slots, context lengths) and the ``n`` rows' tables, ``w`` columns
each, row after row. Program ``r`` of the launch (one per graph row) writes row ``r``:

* ``r < n``: its position, slot and context length; its table's first ``w`` columns (the
  rest is left as it is: a table is read only up to its context length); its token id by
  ``ids_from``: 0 from the stage, 1 from ``last_tokens[r]`` (the previous replay's greedy
  tokens, row for row: a steady decode fed its own samples), 2 left as it is (the host
  copied the ids in before the replay);
* ``r >= n`` (padding): token 0, position 0, slot -1 (no cache write), context length 0
  (nothing read);
* ``ids_from`` 3: nothing at all (the host wrote every input, padding included).

Slots are int32 in the stage: the executor uses it only when its cache has fewer than 2^31
slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .host_math import next_power_of_2

HEADER_WORDS = 4  # n, w, ids_from, 0
IDS_FROM_STAGE, IDS_FROM_LAST_TOKENS, IDS_IN_PLACE, ALL_IN_PLACE = 0, 1, 2, 3


def stage_words(num_rows: int, width: int) -> int:
    """int32 words of a stage holding ``num_rows`` rows with tables ``width`` wide."""
    return HEADER_WORDS + num_rows * (4 + width)


@triton.jit
def _graph_inputs_kernel(
    stage_ptr, ids_ptr, pos_ptr, slot_ptr, lens_ptr, table_ptr, last_ptr,
    stride_table,
    HEADER: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    r = tl.program_id(0)
    n = tl.load(stage_ptr)
    w = tl.load(stage_ptr + 1)
    ids_from = tl.load(stage_ptr + 2)
    if ids_from != 3:
        if r < n:
            values = stage_ptr + HEADER + r
            if ids_from == 0:
                tl.store(ids_ptr + r, tl.load(values).to(tl.int64))
            if ids_from == 1:
                tl.store(ids_ptr + r, tl.load(last_ptr + r))
            tl.store(pos_ptr + r, tl.load(values + n).to(tl.int64))
            tl.store(slot_ptr + r, tl.load(values + 2 * n).to(tl.int64))
            tl.store(lens_ptr + r, tl.load(values + 3 * n))
            src = stage_ptr + HEADER + 4 * n + r * w
            dst = table_ptr + r * stride_table
            for col in range(0, w, BLOCK_W):
                offs = col + tl.arange(0, BLOCK_W)
                keep = offs < w
                tl.store(dst + offs, tl.load(src + offs, mask=keep), mask=keep)
        else:
            tl.store(ids_ptr + r, tl.zeros((), tl.int64))
            tl.store(pos_ptr + r, tl.zeros((), tl.int64))
            tl.store(slot_ptr + r, tl.full((), -1, tl.int64))
            tl.store(lens_ptr + r, tl.zeros((), tl.int32))


def graph_inputs_triton(stage: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                        slot_mapping: torch.Tensor, seq_lens: torch.Tensor,
                        block_tables: torch.Tensor, last_tokens: torch.Tensor) -> None:
    """Write the graph's ``input_ids``, ``positions``, ``slot_mapping`` (int64 [B]),
    ``seq_lens`` (int32 [B]) and ``block_tables`` (int32 [B, W], rows contiguous) from
    ``stage`` (int32; module docstring), reading ``last_tokens`` (int64 [>= B]) when the
    header says so. One launch of B programs; nothing read back."""
    rows = input_ids.shape[0]
    if rows == 0:
        return
    width = block_tables.shape[1]
    _graph_inputs_kernel[(rows,)](
        stage, input_ids, positions, slot_mapping, seq_lens, block_tables, last_tokens,
        block_tables.stride(0), HEADER=HEADER_WORDS,
        BLOCK_W=min(1024, max(16, next_power_of_2(width))), num_warps=1)
