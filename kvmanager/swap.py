"""Swap: moving a group of requests (a request and its forks) between the device pool and
the CPU swap pool, keeping blocks shared within the group shared.

Functions of the KVCacheManager (bound as its methods in manager.py; `self` is the manager).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .block_pool import BlockPool
from .state import InvariantError, RequestState

if TYPE_CHECKING:
    from .manager import KVCacheManager


def _group(self: KVCacheManager, request_ids: Sequence[str], on_gpu: bool) -> list[RequestState]:
    reqs = []
    for rid in request_ids:
        req = self._reqs.get(rid)
        if req is None:
            raise InvariantError("swap of an unknown request", (rid,))
        if req.on_gpu != on_gpu:
            where = "device" if on_gpu else "cpu"
            raise InvariantError(f"swap of a request not on the {where}", (rid,))
        reqs.append(req)
    if len(set(request_ids)) != len(request_ids):
        raise InvariantError("duplicate request in a swap group", request_ids)
    return reqs


def _distinct_blocks(reqs: list[RequestState]) -> dict[int, int]:
    refs: dict[int, int] = {}
    for req in reqs:
        for bid in req.block_ids:
            refs[bid] = refs.get(bid, 0) + 1
    return refs


def can_swap_out(self: KVCacheManager, request_ids: Sequence[str]) -> bool:
    """Whether the CPU pool has a block for every distinct device block of the group."""
    reqs = self._group(request_ids, True)
    return len(self._distinct_blocks(reqs)) <= self.cpu.num_free


def can_swap_in(self: KVCacheManager, request_ids: Sequence[str]) -> bool:
    """Whether the device can take the group back and still keep the watermark free."""
    reqs = self._group(request_ids, False)
    need = len(self._distinct_blocks(reqs))
    return need <= self.gpu.num_free - self.watermark_blocks


def swap_out(self: KVCacheManager, request_ids: Sequence[str]) -> list[tuple[int, int]] | None:
    """Move a group (a request and its forks) to the CPU pool; None when the CPU pool is
    short (nothing changes). Returns the (device, cpu) pairs, also queued for
    `take_block_ops`.

    Every distinct device block of the group gets one CPU block, so blocks shared
    within the group stay shared. A device block whose references all come from the
    group is released (it stays in the prefix cache as an evictable block: its contents
    are intact until it is reused); one also held by a request that stays, or by a pin,
    is only copied. A block that is the destination of a copy queued this step is read
    from the copy's source instead (the executor swaps out before it copies)."""
    reqs = self._group(request_ids, True)
    refs = self._distinct_blocks(reqs)
    if len(refs) > self.cpu.num_free:
        return None
    cpu_ids = self.cpu.take(len(refs))
    mapping = dict(zip(refs, cpu_ids, strict=True))
    cpu_blocks = self.cpu.blocks
    for bid, cnt in refs.items():
        cpu_blocks[mapping[bid]].ref_cnt = cnt
    copy_src = {dst: src for src, dst in self._copies} if self._copies else {}
    pairs = [(copy_src.get(g, g), c) for g, c in mapping.items()]
    for rid in request_ids:  # its blocks of this step are not computed: never cache
        self._dirty.pop(rid, None)
        self._release_intent(rid)  # preempted: it computes nothing until swapped in
    self._rehome(reqs, mapping, self.gpu, on_gpu=False)
    self._swap_out.extend(pairs)
    self._debug_check()
    return pairs


def swap_in(self: KVCacheManager, request_ids: Sequence[str]) -> list[tuple[int, int]] | None:
    """Bring a swapped-out group back into fresh device blocks; None when the device is
    short (it must keep the watermark free; nothing changes). Returns the (cpu, device)
    pairs, also queued for `take_block_ops`. Sharing is kept the same way as in
    swap_out. The blocks re-enter the prefix cache at the request's next allocate
    (where their hash is not taken by another block). Table changes start at 0."""
    reqs = self._group(request_ids, False)
    refs = self._distinct_blocks(reqs)
    if len(refs) > self.gpu.num_free - self.watermark_blocks:
        return None
    gpu_ids = self.gpu.take(len(refs))
    mapping = dict(zip(refs, gpu_ids, strict=True))
    gpu_blocks = self.gpu.blocks
    for bid, cnt in refs.items():
        gpu_blocks[mapping[bid]].ref_cnt = cnt
    pairs = list(mapping.items())
    self._rehome(reqs, mapping, self.cpu, on_gpu=True)
    self._swap_in.extend(pairs)
    self._debug_check()
    return pairs


def _rehome(reqs: list[RequestState], mapping: dict[int, int], src_pool: BlockPool,
            on_gpu: bool) -> None:
    for req in reqs:
        old = req.block_ids
        req.block_ids = [mapping[b] for b in old]
        req.on_gpu = on_gpu
        req.change_start = 0
        req.num_cached_blocks = 0
        src_pool.release(reversed(old))
