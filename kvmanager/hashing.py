"""Prefix-cache block hashes.

A full block's hash chains its parent's: hash(parent hash, the block's token ids, extra
keys). The only extra key today is the request's cache salt, mixed into the first block; the
chain carries it into every later block, so requests with different salts get different
hashes everywhere. Hashes are only an index: the manager confirms every hit by comparing the
block's tokens and its chain (see manager.lookup), so a collision costs a miss, never wrong
keys and values.

Hash functions take (parent hash or None, the block's token ids as a list, extra keys as a
tuple) and return any hashable value:
- "sha256" (default): 32-byte digest of parent + tokens as little-endian int64 + extra keys;
  the same on every machine and process.
- "builtin": Python's hash() of a tuple. Several times faster; stable within one process
  only (a str salt is randomised by PYTHONHASHSEED), which is all the router needs.
- "xxhash": xxh3-128 of the same bytes as sha256, when the xxhash package is importable.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Hashable, Sequence

HashFn = Callable[[Hashable | None, Sequence[int], tuple], Hashable]

_ROOT = b"pagedserve-kv-root"


_PACKERS: dict[int, Callable[..., bytes]] = {}  # block length -> its Struct's pack


def _block_bytes(parent, token_ids: Sequence[int], extra_keys: tuple) -> bytes:
    head = _ROOT if parent is None else parent
    n = len(token_ids)
    pack = _PACKERS.get(n)
    if pack is None:  # (one format a block size: no format string built each block)
        pack = _PACKERS[n] = struct.Struct(f"<{n}q").pack
    body = pack(*token_ids)
    if extra_keys:
        return head + body + repr(extra_keys).encode()
    return head + body


def sha256_block_hash(parent, token_ids: Sequence[int], extra_keys: tuple = ()) -> bytes:
    return hashlib.sha256(_block_bytes(parent, token_ids, extra_keys)).digest()


def builtin_block_hash(parent, token_ids: Sequence[int], extra_keys: tuple = ()) -> int:
    return hash((parent, tuple(token_ids), extra_keys))


def get_hash_fn(hash_algo: str) -> HashFn:
    """The block hash function named `hash_algo` ("sha256", "builtin" or "xxhash")."""
    if hash_algo == "sha256":
        return sha256_block_hash
    if hash_algo == "builtin":
        return builtin_block_hash
    if hash_algo == "xxhash":
        try:
            import xxhash
        except ImportError as e:
            raise ValueError("hash_algo='xxhash' needs the xxhash package") from e
        digest = xxhash.xxh3_128_digest

        def xxhash_block_hash(parent, token_ids, extra_keys=()):
            return digest(_block_bytes(parent, token_ids, extra_keys))

        return xxhash_block_hash
    raise ValueError(f"unknown hash_algo {hash_algo!r} (sha256, builtin, xxhash)")


def hash_blocks(
    hash_fn: HashFn,
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    block_hashes: list | None = None,
    num_tokens: int | None = None,
) -> list:
    """Extend `block_hashes` (in place; a new list when None) with the hashes of the full
    blocks of `token_ids` (of its first `num_tokens` when given: no slice of a long
    sequence is copied) it does not have yet, and return it. Hashing a growing sequence
    again only hashes its newly full blocks."""
    out = [] if block_hashes is None else block_hashes
    start = len(out)
    if num_tokens is None or num_tokens > len(token_ids):
        num_tokens = len(token_ids)
    num_full = num_tokens // block_size
    parent = out[-1] if out else None
    for i in range(start, num_full):
        extra = (cache_salt,) if (i == 0 and cache_salt) else ()
        parent = hash_fn(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        out.append(parent)
    return out
