"""The split-K decode's reduction (decode_attention.py): the splits of a (sequence, KV
head) each leave their normalised partial output and its log-sum-exp (base 2); they are
combined either by the split that finishes last, in the attention launch
(``_combine_if_last``), or by a second launch (``_reduce_kernel``)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _combine_if_last(
    out_ptr, part_out_ptr, part_lse_ptr, counter_ptr,
    seq, heads, mask_g, offs_d, mask_d, active,
    stride_os, stride_oh, stride_ps, stride_ph, stride_pk,
    BLOCK_G: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """Called by every split of (seq, kv_head) after writing its partials; the last to
    arrive combines the first ``active`` (the splits with a tile; the others' weight is 0)
    (out = sum_k 2^(lse_k - lse) out_k) and resets the counter.
    Ordering: the barrier puts every thread's partial stores before the counter's
    acq_rel increment (a release at GPU scope, cumulative over the CTA); the last
    arrival's acquire makes the other splits' stores visible to its loads, which go to L2
    (``.cg``), never to a possibly stale L1 line."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == NUM_SPLITS - 1:
        tl.store(counter_ptr, 0)  # every split has counted: nobody reads it in this launch
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D_PAD], tl.float32)
        for k in range(active):  # online: one split's partials in registers at a time
            base = seq * stride_ps + heads * stride_ph + k * stride_pk
            lse_k = tl.load(part_lse_ptr + base // D_PAD, mask=mask_g, other=float("-inf"),
                            cache_modifier=".cg")
            out_k = tl.load(part_out_ptr + base[:, None] + offs_d[None, :],
                            mask=mask_g[:, None] & mask_d[None, :], other=0.0,
                            cache_modifier=".cg")
            m_new = tl.maximum(m, lse_k)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # empty so far
            alpha = tl.exp2(m - m_safe)
            w = tl.exp2(lse_k - m_safe)  # 0 for an empty split
            l_sum = l_sum * alpha + w
            acc = acc * alpha[:, None] + out_k * w[:, None]
            m = m_new
        out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
        tl.store(
            out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mask_g[:, None] & mask_d[None, :],
        )


@triton.jit
def _reduce_kernel(
    out_ptr, part_out_ptr, part_lse_ptr,
    stride_os, stride_oh,
    stride_ps, stride_ph, stride_pk,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """Program (seq, head): out = sum_k 2^(lse_k - lse) * out_k with lse = log2 sum 2^lse_k;
    an empty split (lse_k = -inf) wrote no partial output, and none is read."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_k = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask_k = offs_k < NUM_SPLITS
    base = seq * stride_ps + head * stride_ph + offs_k * stride_pk
    lse = tl.load(part_lse_ptr + base // D_PAD, mask=mask_k, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)  # 0 for empty splits
    total = tl.sum(w, 0)
    w = w / tl.where(total > 0, total, 1.0)
    filled = mask_k & (lse > float("-inf"))
    parts = tl.load(part_out_ptr + base[:, None] + offs_d[None, :], mask=filled[:, None],
                    other=0.0)
    out = tl.sum(parts * w[:, None], 0)
    tl.store(
        out_ptr + seq * stride_os + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )
