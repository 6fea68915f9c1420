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
    # Prefix pulls (router/prefix_pull.py): executors with equal keys (not None) can move
    # blocks to one another (the same cache format and weights); the most blocks it can
    # receive for one request now (0: none), what one takes to reach it; its plans in
    # flight and their prompt tokens (how long until a plan of it could export).
    pull_key: object = None
    max_pull_blocks: int = 0
    transfer_s_per_block: float = 0.0
    num_in_flight: int = 0
    in_flight_prefill_tokens: int = 0


def candidate(executor_id: str, kv: KVCacheManager, scheduler: Scheduler) -> Candidate:
    """The Candidate of an executor: everything `choose` needs comes from its KV manager
    and its scheduler (whose cost model holds the measured prefill rate). Prefix pulls'
    fields are set by the engine (`Pulls.describe`, router/prefix_pull.py)."""
    return Candidate(executor_id, kv, scheduler.num_queued_tokens(),
                     len(scheduler.running) + len(scheduler.waiting) + len(scheduler.swapped),
                     scheduler.prefill_tokens_per_s(), scheduler.num_running_seqs(),
                     scheduler.decode_s_per_seq(), scheduler.step_fixed_s(),
                     scheduler.cost.s_per_block)


@dataclass
class RouteDecision:
    index: int  # into the candidates
    hit: PrefixHit  # the cached prefix found there (exact: the router owns the tables)
    # A prefix pull (router/prefix_pull.py): the candidate whose device blocks
    # `pull_hit.block_ids[len(hit):]` the chosen one receives instead of computing them
    pull_source: int | None = None
    pull_hit: PrefixHit = EMPTY_HIT

    @property
    def pull_blocks(self) -> tuple[int, ...]:
        """The source's device blocks the pull moves (the ones after the chosen hit)."""
        return self.pull_hit.block_ids[len(self.hit):]


@dataclass
class _Priced:
    """One candidate as the cost rule prices it (see `choose`)."""

    hit: PrefixHit
    match: int  # tokens cached or intended there
    wait: float
    rate: float
    fixed: float
    cost: float
    pull_source: int | None = None
    pull_hit: PrefixHit = EMPTY_HIT
    pull_match: int = 0  # its match with the pull
    pull_extra_s: float = 0.0  # what the pull adds to its time to first token
    export_delay_s: float = 0.0  # until a plan of it sent now is answered


# A tenant's requests leave the executor that holds their prefix (cached or intended) only
# when its queue is longer than another's by more than TENANT_SPILL_FACTOR x the time to
# recompute that prefix there. 1x is break-even for this request's own time to first token;
# the second 1x prices the copy the move makes: the prefix then takes as much cache on the
# other executor, where it evicts about as much of some other tenant's blocks, who will
# recompute them. Below the threshold the queue drains faster than splitting would pay back.
# With prefix pulls (router/prefix_pull.py) "recompute" reads "get": a pull when quicker.
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
    sources: Sequence[Candidate] = (),
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

      Prefix pulls (candidates with `max_pull_blocks`, router/prefix_pull.py): an
      executor lacking blocks of the prompt that another of its `pull_key` holds on its
      device may receive them instead of computing them, when that is quicker
      (`_offer_pull`); its cost is then lower by what the pull saves, and in the spill
      rule the pull (and what is left to compute) takes the place of recomputing what
      it lacks, for this request and for the copy (`_spill_threshold`: the copy's price
      is what getting it back would cost, and a pulled copy comes back as cheaply).
    least-loaded: fewest queued tokens, then fewest live requests, then in turn.
    round-robin: in turn.
    With either, the chosen executor pulls what it lacks when that pays, as above.

    `sources`: executors that take no request now but may be a pull's source (decode
    executors under disaggregation: router/handoff.py; a conversation's last answer was
    decoded there). A decision's `pull_source` indexes `candidates` then `sources`.
    """
    n = len(candidates)
    pulls = any(c.max_pull_blocks for c in candidates)
    if n == 1 and not (pulls and sources):  # nothing to weigh: the cached prefix there
        hit = candidates[0].kv.lookup(token_ids, block_hashes, cache_salt) \
            if policy is RoutingPolicy.PREFIX else EMPTY_HIT
        return RouteDecision(0, hit)  # (for the caller to pin)
    order = [(turn + k) % n for k in range(n)]  # rotation for tie-breaking
    everyone = [*candidates, *sources] if pulls else candidates
    extra = list(range(n, len(everyone)))  # the sources' indices
    if policy is not RoutingPolicy.PREFIX:
        if policy is RoutingPolicy.ROUND_ROBIN:
            index = order[0]
        else:
            index = min(order, key=lambda i: (candidates[i].queued_tokens,
                                              candidates[i].num_groups))
        if not pulls:
            return RouteDecision(index, EMPTY_HIT)
        p = _price(everyone, token_ids, block_hashes, cache_salt, order, extra)[index]
        if p.pull_source is None:
            return RouteDecision(index, EMPTY_HIT)
        return RouteDecision(index, p.hit, p.pull_source, p.pull_hit)

    priced = _price(everyone, token_ids, block_hashes, cache_salt, order, extra)

    def key(i: int) -> tuple:
        return priced[i].cost, candidates[i].num_groups

    home = min(order, key=lambda i: (-priced[i].match,) + key(i))
    h = priced[home]
    if h.match == 0:  # a cold prefix: where it displaces least, among the near-cheapest
        best = min(priced[i].cost for i in order)
        near = [i for i in order if priced[i].cost <= best * (1 + COLD_PREFIX_TIE)]
        chosen = min(near, key=lambda i: (candidates[i].kv.num_cached_gpu_blocks,) + key(i))
    else:
        spill = [i for i in order if priced[i].cost < h.cost
                 and h.wait - priced[i].wait > _spill_threshold(h, priced[i])]
        chosen = min(spill, key=key) if spill else home
    p = priced[chosen]
    return RouteDecision(chosen, p.hit, p.pull_source, p.pull_hit)


def _spill_threshold(home: _Priced, p: _Priced) -> float:
    """How much longer home's queue must be than p's for a request to leave it:
    TENANT_SPILL_FACTOR x the time to get there what p lacks of home's match, computed or
    (when p's pull is quicker) pulled with the rest computed: once for this request, once
    for the copy (see TENANT_SPILL_FACTOR)."""
    acquire = max(home.match - p.match, 0) / p.rate
    if p.pull_source is not None:
        acquire = min(acquire, p.pull_extra_s + max(home.match - p.pull_match, 0) / p.rate)
    return TENANT_SPILL_FACTOR * acquire


def _price(candidates: Sequence[Candidate], token_ids: Sequence[int], block_hashes: list,
           cache_salt: str | None, order: list[int],
           sources: list[int] = ()) -> dict[int, _Priced]:
    """Every candidate of `order` priced by the cost rule (`choose`), with its best pull
    if any, from the others or from `sources` (indices of candidates that are only pull
    sources: priced too, for their hits and export delays)."""
    measured = [c.prefill_tokens_per_s for c in candidates if c.prefill_tokens_per_s]
    assumed_rate = sum(measured) / len(measured) if measured else DEFAULT_PREFILL_TOKENS_PER_S
    measured = [c.decode_s_per_seq for c in candidates if c.decode_s_per_seq]
    assumed_decode_s = sum(measured) / len(measured) if measured else DEFAULT_DECODE_S_PER_SEQ
    measured = [c.step_fixed_s for c in candidates if c.step_fixed_s is not None]
    assumed_fixed_s = sum(measured) / len(measured) if measured else 0.0
    num_tokens = len(token_ids)
    priced: dict[int, _Priced] = {}
    for i in (*order, *sources):
        c = candidates[i]
        kv = c.kv
        rate = c.prefill_tokens_per_s or assumed_rate
        hit = kv.lookup(token_ids, block_hashes, cache_salt)
        matched = hit.num_tokens + kv.intended_tokens(token_ids, block_hashes, cache_salt,
                                                      len(hit))
        uncached = num_tokens - matched
        host_blocks = len(hit.host_block_ids)  # cached, but each takes a device block
        need_blocks = -(-uncached // kv.block_size) + host_blocks
        decode_s = c.decode_s_per_seq or assumed_decode_s
        wait = c.num_running_seqs * decode_s + c.queued_tokens / rate
        if need_blocks > kv.num_free_gpu_blocks - kv.watermark_blocks:
            wait += MEMORY_SHORT_WAIT_TOKENS / rate
        evicted = kv.num_shared_blocks_evicted(need_blocks, hit.block_ids)
        fixed = c.step_fixed_s if c.step_fixed_s is not None else assumed_fixed_s
        cost = wait + fixed + uncached / rate + host_blocks * c.swap_s_per_block \
            + evicted * kv.block_size / rate
        priced[i] = _Priced(hit, matched, wait, rate, fixed, cost,
                            export_delay_s=_export_delay(c, rate, decode_s, fixed))
    if any(c.max_pull_blocks for c in candidates):
        offers_from = [*order, *sources]
        for i in order:
            _offer_pull(candidates, priced, i, offers_from)
    return priced


def _export_delay(c: Candidate, rate: float, decode_s: float, fixed: float) -> float:
    """Seconds until a plan of `c` sent now is answered: its plans in flight (their
    prompt tokens and decodes). The plan exporting a pull's blocks computes nothing
    (prefix_pull.py)."""
    return c.num_in_flight * (fixed + c.num_running_seqs * decode_s) \
        + c.in_flight_prefill_tokens / rate


def _offer_pull(candidates: Sequence[Candidate], priced: dict[int, _Priced], i: int,
                order: list[int]) -> None:
    """Candidate i's best prefix pull, if one pays: from the candidate of the same
    pull_key whose device blocks reach furthest past what i holds, the blocks after i's
    hit (at most i's max_pull_blocks). It pays when what it adds to the time to first
    token, max(0, export delay + blocks x transfer - i's wait) + blocks x i's swap-in, is
    less than computing the tokens it brings past i's match; then i's cost is lower by
    the difference."""
    c = candidates[i]
    p = priced[i]
    if not c.max_pull_blocks or c.pull_key is None:
        return
    bs = c.kv.block_size
    held = len(p.hit)
    best = None
    for j in order:
        if j == i or candidates[j].pull_key != c.pull_key:
            continue
        q = priced[j]
        if len(q.hit.block_ids) > held and (best is None or (
                len(q.hit.block_ids), -q.export_delay_s)
                > (len(priced[best].hit.block_ids), -priced[best].export_delay_s)):
            best = j
    if best is None:
        return
    q = priced[best]
    end = min(len(q.hit.block_ids), held + c.max_pull_blocks)
    gain = end - held
    brought = end * bs - p.match  # tokens it need not compute
    if gain <= 0 or brought <= 0:
        return
    arrive = q.export_delay_s + gain * c.transfer_s_per_block
    extra = max(0.0, arrive - p.wait) + gain * c.swap_s_per_block
    saved = brought / p.rate
    if extra >= saved:
        return
    p.pull_source = best
    p.pull_hit = q.hit.clip(end, bs)
    p.pull_match = end * bs
    p.pull_extra_s = extra
    p.cost -= saved - extra
