"""Which executor takes a new request (`--routing prefix|round-robin|least-loaded`)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from ..kvmanager import EMPTY_HIT, KVCacheManager, PrefixHit
from .cost_model import (
    DEFAULT_DECODE_S_PER_SEQ,
    DEFAULT_PREFILL_S_PER_TOKEN,
    DEFAULT_SWAP_S_PER_BLOCK,
)
from .scheduler import Scheduler


class RoutingPolicy(enum.Enum):
    PREFIX = "prefix"
    ROUND_ROBIN = "round-robin"
    LEAST_LOADED = "least-loaded"


# An executor's prefill rate before anything was measured anywhere: the scheduler cost
# model's prior. An executor not measured yet while others are is assumed as fast as their
# mean (a new executor is most likely the same hardware; a prior far from the truth would
# make it look idle or swamped next to measured ones).
DEFAULT_PREFILL_TOKENS_PER_S = 1.0 / DEFAULT_PREFILL_S_PER_TOKEN


@dataclass
class Candidate:
    """One healthy executor that could ever fit the request, as `choose` sees it (build it
    with `candidate` from the executor's KV manager and scheduler)."""

    executor_id: str
    kv: KVCacheManager
    queued_tokens: int  # prefill tokens queued there (Scheduler.num_queued_tokens)
    num_groups: int  # requests living there (running, waiting, swapped)
    prefill_tokens_per_s: float | None = None  # its measured prefill rate (None: not yet)
    num_running_seqs: int = 0  # samples decoding there (Scheduler.num_running_seqs)
    decode_s_per_seq: float | None = None  # measured step time per decoding sample
    step_fixed_s: float | None = None  # measured time of a step whatever it computes
    swap_s_per_block: float = DEFAULT_SWAP_S_PER_BLOCK  # a block moved to or from the CPU


def candidate(executor_id: str, kv: KVCacheManager, scheduler: Scheduler) -> Candidate:
    """The Candidate of an executor: everything `choose` needs comes from its KV manager
    and its scheduler (whose cost model holds the measured prefill rate)."""
    return Candidate(executor_id, kv, scheduler.num_queued_tokens(),
                     len(scheduler.running) + len(scheduler.waiting) + len(scheduler.swapped),
                     scheduler.prefill_tokens_per_s(), scheduler.num_running_seqs(),
                     scheduler.decode_s_per_seq(), scheduler.step_fixed_s(),
                     scheduler.cost.s_per_block)


@dataclass
class RouteDecision:
    index: int  # into the candidates
    hit: PrefixHit  # the cached prefix found there (exact: the router owns the tables)


# A tenant's requests leave the executor that holds their prefix (cached or intended) only
# when its queue is longer than another's by more than TENANT_SPILL_FACTOR x the time to
# recompute that prefix there. 1x is break-even for this request's own time to first token;
# the second 1x prices the copy the move makes: the prefix then takes as much cache on the
# other executor, where it evicts about as much of some other tenant's blocks, who will
# recompute them. Below the threshold the queue drains faster than splitting would pay back.
# (benchmarks/routing_sim.py, two seeds: 1 lost 5 points of hit rate on bursty tenants and
# raised the p99 by a third where prefixes exceed the cache 4x; 1.5 still lost 1.5 points
# on bursty tenants; 2 and 3 gave the same figures.)
TENANT_SPILL_FACTOR = 2.0
# Queue time charged, in prefill tokens at the executor's rate, where the free blocks cannot
# hold the request's uncached part now: it would wait for running requests to free memory
# or force a preemption (a long prompt's worth of work, either way).
MEMORY_SHORT_WAIT_TOKENS = 4096
# A cold prefix goes to the executor with the fewest cached blocks among those whose cost is
# within this fraction of the cheapest: measured rates of the same hardware differ by a few
# percent, and that noise would otherwise send every new prefix to the same idle executor.
COLD_PREFIX_TIE = 0.1


def choose(
    policy: RoutingPolicy,
    candidates: Sequence[Candidate],
    token_ids: Sequence[int],
    block_hashes: list,
    cache_salt: str | None,
    turn: int,
) -> RouteDecision:
    """Pick an executor for a request of `token_ids` (its prompt, or tokens so far when it
    migrates), `block_hashes` from `KVCacheManager.hash_blocks(token_ids, cache_salt)`, and
    `turn`, a counter the caller advances per request (the last tie-break). A caller
    supplies one Candidate per healthy executor that could ever fit the request:
    `candidate(executor_id, kv, scheduler)`, i.e. the executor's KVCacheManager, its
    Scheduler's `num_queued_tokens()`, number of groups and `num_running_seqs()`, its
    prefill rate in tokens per second (`Scheduler.prefill_tokens_per_s()`), its seconds
    per decoding sample (`Scheduler.decode_s_per_seq()`) and its steps' fixed seconds
    (`Scheduler.step_fixed_s()`), all fitted to StepResults' forward_s (cost_model.py:
    what one more token or sample adds to a step, and what a step costs anyway); a value
    not measured yet is None, and the measured candidates' mean is assumed for it
    (DEFAULT_PREFILL_TOKENS_PER_S / DEFAULT_DECODE_S_PER_SEQ / no fixed cost when none is
    measured). The decision's `hit` is the cached prefix there, for the caller to
    pin.

    prefix: one cost rule, in seconds. For each executor e, with r_e its prefill rate:

        match_e  = prompt tokens cached on e (lookup: on the device, then offloaded to its
                   CPU blocks) + those past them that requests on e already intend to
                   compute (waiting, admitted this step, later chunks)
        wait_e   = running samples on e x d_e (the step that runs the prefill runs every
                   decode there too; d_e its measured step seconds per decoding sample)
                   + (queued prefill tokens on e, an intended block counted once) / r_e
                   + MEMORY_SHORT_WAIT_TOKENS / r_e if e's free blocks cannot hold the
                   uncached part now
        ttft_e   = wait_e + f_e + (len(prompt) - match_e) / r_e + host_e x s_e
                   (time to first token; f_e the fixed time of e's steps, r_e and d_e its
                   marginal rates: CostModel; host_e the matched blocks that come back
                   from e's CPU blocks, s_e its measured seconds per block moved)
        evict_e  = (cached blocks the uncached part would evict on e that other requests
                   have hit: prefixes live tenants share; with offloading, not those e's
                   CPU blocks hold too) x block_size / r_e
        cost_e   = ttft_e + evict_e

      The request goes to its home h, the executor with the longest match (ties: lowest
      cost), unless another executor e has a lower cost and h's queue is longer than e's
      by more than TENANT_SPILL_FACTOR x the time to recompute there what e lacks:
      wait_h - wait_e > TENANT_SPILL_FACTOR x (match_h - match_e) / r_e. Then the lowest
      cost wins. When no executor holds any of the prompt (a cold prefix), of the executors
      within COLD_PREFIX_TIE of the lowest cost the one with the fewest cached blocks wins
      (then the lowest cost). So a cold prefix goes where it displaces least (evict_e now,
      the emptier cache later: rate noise between idle twins does not send every new
      prefix to the same one), a tenant's requests stay together, a second request of
      a new prefix follows the first before either has run (the first's intent is its
      match), and a prefix hot enough to overload one executor spreads to a second once the
      queue there passes the threshold, after which both hold it and the cost balances them.
      Ties (equal costs) go to fewer live requests, then in turn.
    least-loaded: fewest queued tokens, then fewest live requests, then in turn.
    round-robin: in turn.
    """
    n = len(candidates)
    if n == 1:  # nothing to weigh: the cached prefix there (for the caller to pin)
        hit = candidates[0].kv.lookup(token_ids, block_hashes, cache_salt) \
            if policy is RoutingPolicy.PREFIX else EMPTY_HIT
        return RouteDecision(0, hit)
    order = [(turn + k) % n for k in range(n)]  # rotation for tie-breaking
    if policy is RoutingPolicy.ROUND_ROBIN:
        return RouteDecision(order[0], EMPTY_HIT)
    if policy is RoutingPolicy.LEAST_LOADED:
        best = min(order, key=lambda i: (candidates[i].queued_tokens, candidates[i].num_groups))
        return RouteDecision(best, EMPTY_HIT)

    measured = [c.prefill_tokens_per_s for c in candidates if c.prefill_tokens_per_s]
    assumed_rate = sum(measured) / len(measured) if measured else DEFAULT_PREFILL_TOKENS_PER_S
    measured = [c.decode_s_per_seq for c in candidates if c.decode_s_per_seq]
    assumed_decode_s = sum(measured) / len(measured) if measured else DEFAULT_DECODE_S_PER_SEQ
    measured = [c.step_fixed_s for c in candidates if c.step_fixed_s is not None]
    assumed_fixed_s = sum(measured) / len(measured) if measured else 0.0
    num_tokens = len(token_ids)
    hits: dict[int, PrefixHit] = {}
    match: dict[int, int] = {}
    wait_s: dict[int, float] = {}
    cost: dict[int, float] = {}
    rates: dict[int, float] = {}
    for i in order:
        c = candidates[i]
        kv = c.kv
        rate = c.prefill_tokens_per_s or assumed_rate
        rates[i] = rate
        hit = kv.lookup(token_ids, block_hashes, cache_salt)
        matched = hit.num_tokens + kv.intended_tokens(token_ids, block_hashes, cache_salt,
                                                      len(hit))
        uncached = num_tokens - matched
        host_blocks = len(hit.host_block_ids)  # cached, but each takes a device block
        need_blocks = -(-uncached // kv.block_size) + host_blocks
        wait = c.num_running_seqs * (c.decode_s_per_seq or assumed_decode_s) \
            + c.queued_tokens / rate
        if need_blocks > kv.num_free_gpu_blocks - kv.watermark_blocks:
            wait += MEMORY_SHORT_WAIT_TOKENS / rate
        evicted = kv.num_shared_blocks_evicted(need_blocks, hit.block_ids)
        hits[i], match[i], wait_s[i] = hit, matched, wait
        fixed = c.step_fixed_s if c.step_fixed_s is not None else assumed_fixed_s
        cost[i] = wait + fixed + uncached / rate + host_blocks * c.swap_s_per_block \
            + evicted * kv.block_size / rate

    def key(i: int) -> tuple:
        return cost[i], candidates[i].num_groups

    home = min(order, key=lambda i: (-match[i],) + key(i))
    if match[home] == 0:  # a cold prefix: where it displaces least, among the near-cheapest
        best = min(cost.values())
        near = [i for i in order if cost[i] <= best * (1 + COLD_PREFIX_TIE)]
        chosen = min(near, key=lambda i: (candidates[i].kv.num_cached_gpu_blocks,) + key(i))
    else:
        spill = [i for i in order if cost[i] < cost[home] and wait_s[home] - wait_s[i]
                 > TENANT_SPILL_FACTOR * (match[home] - match[i]) / rates[i]]
        chosen = min(spill, key=key) if spill else home
    return RouteDecision(chosen, hits[chosen])
