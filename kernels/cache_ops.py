"""KV-cache writes and block moves: Triton kernels, launchers and the swap helper.

Twins: ``reference.reshape_and_cache``, ``reference.copy_blocks``, ``reference.swap_blocks``.
Hot path: no device-to-host reads may be added to ``reshape_and_cache_triton`` or
``copy_blocks_triton``.

Provenance: vLLM's ``reshape_and_cache`` and ``copy_blocks`` CUDA kernels (csrc/cache_kernels.cu):
one program per token scattering by ``slot_mapping`` with negative slots skipped, and one
launch copying every (src, dst) pair for every layer. Our cache is one tensor for all layers
(kernels/__init__.py), so the copy indexes layers by program id instead of a pointer array.
The code is our own.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from .block_copy import copy_blocks_by_runs
from .host_math import cdiv, next_power_of_2
from .kv_dtypes import to_cache

# --- reshape_and_cache -------------------------------------------------------------------------


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh,  # key [T, Hkv, D]
    stride_vt, stride_vh,
    stride_kcs, stride_kch,  # key cache viewed as [num_slots, Hkv, D]
    stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """Program t: copy token t's [Hkv, D] keys and values to slot slot_mapping[t] (skip if < 0)."""
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    t64 = t.to(tl.int64)
    k = tl.load(key_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(
        value_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask
    )
    tl.store(
        key_cache_ptr + slot * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :],
        to_cache(k, key_cache_ptr), mask=mask,
    )
    tl.store(
        value_cache_ptr + slot * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :],
        to_cache(v, value_cache_ptr), mask=mask,
    )


def check_cache_write(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """ValueError unless key and value [T, Hkv, D] can be written at ``slot_mapping`` [T]
    into caches [num_blocks, block_size, Hkv, D] on their device, the slots linear (every
    launcher that writes the cache: reshape_and_cache, the rotary's fused write)."""
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            f"key and value must both be [num_tokens, num_kv_heads, head_dim], got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError("key_cache and value_cache must both be [num_blocks, block_size, Hkv, D]")
    num_tokens, num_kv_heads, head_dim = key.shape
    if tuple(key_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"caches' heads/dim {tuple(key_cache.shape[2:])} != key's "
                         f"{(num_kv_heads, head_dim)}")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32/int64 [num_tokens={num_tokens}]")
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: head_dim axis must be contiguous (stride 1)")
    if key_cache.stride(0) != key_cache.shape[1] * key_cache.stride(1) or (
        value_cache.stride(0) != value_cache.shape[1] * value_cache.stride(1)
    ):
        raise ValueError("caches must have contiguous (block, offset) axes so slots are linear")
    for name, t in (("value", value), ("key_cache", key_cache), ("value_cache", value_cache),
                    ("slot_mapping", slot_mapping)):
        if t.device != key.device:
            raise ValueError(f"{name} is on {t.device}, key on {key.device}")


def reshape_and_cache_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens], -1 = padding
) -> None:
    check_cache_write(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(1), key_cache.stride(2), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        H_PAD=next_power_of_2(num_kv_heads), D_PAD=next_power_of_2(head_dim),
        num_warps=4,
    )


# --- copy_blocks ---------------------------------------------------------------------------------

_COPY_CHUNK = 1024  # elements per program: 2-4 KiB, 4 warps x 32 lanes x 8 elements


@triton.jit
def _copy_blocks_kernel(
    cache_ptr, mapping_ptr,
    stride_plane,  # elements between (layer, kind) planes
    block_numel,
    CHUNK: tl.constexpr,
):
    """Program (pair, plane, chunk): copy one CHUNK of block src -> dst in one (layer, K/V)."""
    pair = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    src = tl.load(mapping_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(mapping_ptr + 2 * pair + 1).to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    base = cache_ptr + plane * stride_plane
    x = tl.load(base + src * block_numel + offs, mask=mask)
    tl.store(base + dst * block_numel + offs, x, mask=mask)


_SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_blocks_triton(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy-on-write for every (src, dst) row of ``block_mapping`` [num_pairs, 2], all layers,
    keys and values, in one launch. Bit-exact: the cache is copied as same-width integers."""
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
        raise ValueError(
            "kv_cache must be [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(kv_cache.shape)}"
        )
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [num_pairs, 2], got {tuple(block_mapping.shape)}")
    if block_mapping.numel() == 0:
        return
    mapping = block_mapping.to(device=kv_cache.device, dtype=torch.int64).contiguous()
    num_layers, _, num_blocks = kv_cache.shape[:3]
    block_numel = kv_cache[0, 0, 0].numel()
    raw = kv_cache.view(_SAME_WIDTH_INT[kv_cache.element_size()])
    grid = (mapping.shape[0], num_layers * 2, cdiv(block_numel, _COPY_CHUNK))
    _copy_blocks_kernel[grid](
        raw, mapping, num_blocks * block_numel, block_numel, CHUNK=_COPY_CHUNK, num_warps=4
    )


# --- swap_blocks -------------------------------------------------------------------------------


def swap_blocks_device(
    src_cache: torch.Tensor, dst_cache: torch.Tensor, block_mapping: torch.Tensor
) -> None:
    """Move blocks between the device cache and the pinned CPU swap space (same layout).

    Batched: one gather of every listed block over all layers, one bus transfer, one scatter.
    The host side gathers and scatters by runs of consecutive block ids (``block_copy``: the
    host's advanced indexing is several times slower).
    * swap-in (CPU -> CUDA): gather on the host into a pinned staging buffer, copy it to the
      device with ``non_blocking=True`` (stream-ordered; torch's caching host allocator keeps
      the staging buffer alive until the copy ends), scatter on the device. The host never
      waits for the device.
    * swap-out (CUDA -> CPU): gather on the device (stream-ordered, so the freed device blocks
      may be reused by later kernels at once), copy to a pinned staging buffer with
      ``non_blocking=True``, then wait for that copy and scatter on the host. The wait is the
      price of a scatter into a non-contiguous CPU destination; swap-out is rare (preemption).
    * device -> device: the twin (an indexed copy on the device).
    """
    if src_cache.dim() != 6 or src_cache.shape[:2] != dst_cache.shape[:2] or (
        src_cache.shape[3:] != dst_cache.shape[3:]
    ):
        raise ValueError(
            f"caches must share the layout [L, 2, *, block_size, Hkv, D]: "
            f"{tuple(src_cache.shape)} vs {tuple(dst_cache.shape)}"
        )
    if src_cache.dtype != dst_cache.dtype:
        raise TypeError(f"dtype mismatch {src_cache.dtype} vs {dst_cache.dtype}")
    if block_mapping.numel() == 0:
        return
    mapping = block_mapping.to("cpu", torch.int64)
    src_ids, dst_ids = mapping[:, 0], mapping[:, 1]
    if src_cache.is_cuda and dst_cache.is_cuda or not (src_cache.is_cuda or dst_cache.is_cuda):
        from .reference import swap_blocks

        swap_blocks(src_cache, dst_cache, block_mapping)
        return
    gathered_shape = (*src_cache.shape[:2], len(src_ids), *src_cache.shape[3:])
    staged = np.arange(len(src_ids))  # the blocks' places in the staging buffer
    if dst_cache.is_cuda:  # swap-in
        staging = torch.empty(gathered_shape, dtype=src_cache.dtype, pin_memory=True)
        copy_blocks_by_runs(src_cache, staging, src_ids.numpy(), staged)
        on_device = staging.to(dst_cache.device, non_blocking=True)
        dst_cache.index_copy_(2, dst_ids.to(dst_cache.device, non_blocking=True), on_device)
    else:  # swap-out
        gathered = src_cache.index_select(2, src_ids.to(src_cache.device, non_blocking=True))
        staging = torch.empty(gathered_shape, dtype=src_cache.dtype, pin_memory=True)
        staging.copy_(gathered, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        copy_blocks_by_runs(staging, dst_cache, staged, dst_ids.numpy())
