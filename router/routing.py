"""Which executor takes a new request (`--routing prefix|round-robin|least-loaded`)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from ..kvmanager import EMPTY_HIT, KVCacheManager, PrefixHit


class RoutingPolicy(enum.Enum):
    PREFIX = "prefix"
    ROUND_ROBIN = "round-robin"
    LEAST_LOADED = "least-loaded"


@dataclass
class Candidate:
    """One healthy executor that could ever fit the request."""

    executor_id: str
    kv: KVCacheManager
    queued_tokens: int  # tokens waiting to be computed there (scheduler.num_queued_tokens)
    num_groups: int  # requests living there


@dataclass
class RouteDecision:
    index: int  # into the candidates
    hit: PrefixHit  # the cached prefix found there (exact: the router owns the tables)


# Weight of an already queued token against a token this request must compute itself:
# queued work delays this request's prefill about as much as its own uncached tokens.
QUEUED_TOKEN_WEIGHT = 1.0
# Cost, in tokens, of an executor whose free blocks cannot hold the uncached part now:
# the request would wait there for memory or force a preemption.
MEMORY_SHORT_PENALTY_TOKENS = 4096


def choose(
    policy: RoutingPolicy,
    candidates: Sequence[Candidate],
    token_ids: Sequence[int],
    block_hashes: list,
    cache_salt: str | None,
    turn: int,
) -> RouteDecision:
    """Pick an executor.

    prefix: cost(e) = uncached prompt tokens on e (neither cached nor intended there)
                      + QUEUED_TOKEN_WEIGHT x tokens already queued on e
                      + MEMORY_SHORT_PENALTY_TOKENS if e's free blocks can't hold the
                        uncached part now.
      The uncached part is exact: each executor's KV manager answers the lookup, and its
      intended prefixes (`KVCacheManager.intended_tokens`: blocks that requests routed
      there will compute, waiting or mid-prefill) count as cached. The
      lowest cost wins: a long cached prefix attracts a request until the queue it would
      join costs more than recomputing the prefix elsewhere. Ties (e.g. no executor holds
      any of the prompt and all are idle) go to the least loaded (fewest live requests),
      then in turn (`turn`, a counter the caller advances per request).
    least-loaded: fewest queued tokens, then fewest live requests, then in turn.
    round-robin: in turn.
    """
    n = len(candidates)
    order = [(turn + k) % n for k in range(n)]  # rotation for tie-breaking
    if policy is RoutingPolicy.ROUND_ROBIN:
        return RouteDecision(order[0], EMPTY_HIT)
    if policy is RoutingPolicy.LEAST_LOADED:
        best = min(order, key=lambda i: (candidates[i].queued_tokens, candidates[i].num_groups))
        return RouteDecision(best, EMPTY_HIT)

    best_i, best_key, best_hit = order[0], None, EMPTY_HIT
    for i in order:
        c = candidates[i]
        hit = c.kv.lookup(token_ids, block_hashes, cache_salt)
        intended = c.kv.intended_tokens(token_ids, block_hashes, cache_salt, len(hit))
        uncached = len(token_ids) - hit.num_tokens - intended
        cost = uncached + QUEUED_TOKEN_WEIGHT * c.queued_tokens
        need_blocks = -(-uncached // c.kv.block_size)
        if need_blocks > c.kv.num_free_gpu_blocks:
            cost += MEMORY_SHORT_PENALTY_TOKENS
        key = (cost, c.num_groups)
        if best_key is None or key < best_key:
            best_i, best_key, best_hit = i, key, hit
    return RouteDecision(best_i, best_hit)
