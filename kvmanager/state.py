"""The manager's records: its errors, the results it returns (PrefixHit, BlockOps, stats) and
the per-request state (`RequestState`) that the other modules of the package share.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


class InvariantError(AssertionError):
    """A broken invariant or a caller bug (double free, unknown request, negative ref
    count). `request_ids` names the requests involved."""

    def __init__(self, message: str, request_ids: Iterable[str] = ()) -> None:
        self.request_ids = tuple(request_ids)
        if self.request_ids:
            message = f"{message} (requests: {', '.join(self.request_ids)})"
        super().__init__(message)


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The cached prefix of a prompt: `block_ids` (device blocks, in order) hold its first
    blocks, then `host_block_ids` (CPU blocks of the offloaded prefix cache, offload.py)
    the blocks after them; together its first `num_tokens` tokens (= len(hit) *
    block_size). `serials` / `host_serials` identify the cache entries, so a stale hit (a
    block evicted and reused since the lookup) is detected. Admission swaps the host
    blocks into fresh device blocks; a pin holds the device blocks only."""

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    serials: tuple[int, ...] = ()
    host_block_ids: tuple[int, ...] = ()
    host_serials: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.block_ids) + len(self.host_block_ids)

    def clip(self, num_blocks: int, block_size: int) -> PrefixHit:
        """Its first `num_blocks` blocks (device ones first)."""
        if num_blocks >= len(self):
            return self
        d = min(num_blocks, len(self.block_ids))
        h = num_blocks - d
        return PrefixHit(self.block_ids[:d], num_blocks * block_size, self.serials[:d],
                         self.host_block_ids[:h], self.host_serials[:h])


EMPTY_HIT = PrefixHit()


class BlockOps(NamedTuple):
    """The block transfers a step plan carries, each an int64 array of shape [P, 2]:
    swap_out (device, cpu), swap_in (cpu, device), copy (src device, dst device)."""

    swap_out: np.ndarray
    swap_in: np.ndarray
    copy: np.ndarray


@dataclass(frozen=True, slots=True)
class DeviceStats:
    num_total_blocks: int
    num_free_blocks: int  # held by no request or pin: free, cached-evictable, deferred or
    # held for a plan in flight (allocatable once that plan is answered)
    num_cached_blocks: int  # blocks in the prefix cache (held or evictable)
    usage_ratio: float  # 1 - free / total
    num_evictions: int  # cached blocks reused for other content


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    gpu: DeviceStats
    cpu: DeviceStats
    prefix_query_tokens: int  # prompt tokens looked up at admissions
    prefix_hit_tokens: int  # of which served from the prefix cache
    num_pinned_blocks: int
    num_requests: int
    host_hit_tokens: int = 0  # of prefix_hit_tokens, swapped in from the host (offload.py)
    num_offloaded_blocks: int = 0  # device blocks copied to the host
    num_offloads_dropped: int = 0  # freed blocks not copied (host full, or reused at once)


class RequestState:
    """The manager's record of one admitted request (its block table and registration
    progress)."""

    __slots__ = (
        "block_ids",
        "num_tokens",
        "block_hashes",
        "cache_salt",
        "num_cached_blocks",
        "on_gpu",
        "change_start",
        "token_ids",
        "chain_serial",
        "intent",
    )

    def __init__(self, block_ids, num_tokens, block_hashes, cache_salt) -> None:
        self.block_ids: list[int] = block_ids
        self.num_tokens: int = num_tokens  # positions with a slot (computed or scheduled)
        self.block_hashes: list = block_hashes
        self.cache_salt = cache_salt
        self.num_cached_blocks = 0  # blocks [0, n) went through prefix-cache registration
        self.on_gpu = True
        self.change_start: int | None = 0  # table[change_start:] changed since last taken
        self.token_ids: Sequence[int] = ()  # the caller's token list (a reference)
        # serial of the cache entry standing for block num_cached_blocks - 1 (-1: the
        # chain is broken, nothing later can be registered)
        self.chain_serial = -1
        self.intent = None  # its Intent (intents.py) while it has one


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
