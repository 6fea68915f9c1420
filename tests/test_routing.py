"""The routing cost rule (router/routing.py:choose) with real KV managers and schedulers:
exact decisions at the thresholds the rule names."""

from __future__ import annotations

import pytest
from pagedserve.kvmanager import KVCacheManager
from pagedserve.router import cost_model, routing
from pagedserve.router.cost_model import CostModel
from pagedserve.router.routing import RoutingPolicy, candidate, choose
from pagedserve.router.scheduler import Scheduler, SchedulerConfig
from pagedserve.router.sequence import RequestGroup
from pagedserve.router.types import RequestSpec, SamplingSpec

BS = 16
RATE = 10_000.0  # prefill tokens per second, every executor (measured)


class _Assembler:
    finished = False
    num_tokens = 0


class Executor:
    def __init__(self, name: str, num_blocks: int = 256, rate: float | None = RATE,
                 offload_blocks: int = 0) -> None:
        self.name = name
        self.kv = KVCacheManager(num_blocks, offload_blocks, BS, watermark=0.0,
                                 debug_checks=True, enable_offloading=offload_blocks > 0)
        self.sched = Scheduler(self.kv, SchedulerConfig(max_model_len=4096))
        if rate is not None:  # two prompt sizes: the step-time fit sees no fixed cost
            self.sched.cost.observe_prefill(1000, 1000 / rate)
            self.sched.cost.observe_prefill(500, 500 / rate)

    def cache(self, rid: str, tokens: list[int], num_hits: int = 0) -> None:
        """Compute `tokens` here and end the request: its blocks stay cached, evictable
        (`num_hits` later requests found them)."""
        hashes = self.kv.hash_blocks(tokens)
        self.kv.allocate(rid, tokens, len(tokens), block_hashes=hashes)
        self.kv.free(rid)
        for i in range(num_hits):
            hit = self.kv.lookup(tokens + [0], self.kv.hash_blocks(tokens + [0]))
            self.kv.allocate(f"{rid}.hit{i}", tokens + [0], 1, hit=hit,
                             block_hashes=self.kv.hash_blocks(tokens + [0]))
            self.kv.free(f"{rid}.hit{i}")
        self.kv.take_block_ops()  # the next plan: with offloading, copies them to the host


def route(executors: list[Executor], rid: str, tokens: list[int], arrival: int,
          turn: int = 0) -> int:
    """What RouterEngine.place does: choose, pin the cached prefix, queue the request."""
    spec = RequestSpec(rid, tuple(tokens), SamplingSpec(max_tokens=16))
    group = RequestGroup(spec, [_Assembler()], arrival)
    seq = group.seqs[0]
    executors[0].kv.hash_blocks(seq.token_ids, None, seq.block_hashes)
    cands = [candidate(e.name, e.kv, e.sched) for e in executors]
    d = choose(RoutingPolicy.PREFIX, cands, seq.token_ids, seq.block_hashes, None, turn)
    chosen = executors[d.index]
    if d.hit.block_ids:
        group.pinned_tokens = chosen.kv.pin(seq.seq_id, d.hit).num_tokens
    chosen.sched.add(group)
    return d.index


def prompt(tenant: int, question: int, prefix_len: int = 1024, question_len: int = 64):
    return [10_000 + tenant] * prefix_len + [question + 1] * question_len


def test_a_tenant_stays_until_its_queue_is_longer_by_the_named_threshold():
    """Tenant 1's prefix (1,024 tokens) is cached on e0; e1 is idle and empty. Requests of
    other tenants queue on e0: tenant 1 stays there until e0's queue is longer than e1's by
    more than TENANT_SPILL_FACTOR x 1,024 tokens of prefill time."""
    threshold = int(routing.TENANT_SPILL_FACTOR * 1024)
    for queued, want in ((threshold, 0), (threshold + 1, 1)):
        e0, e1 = Executor("e0"), Executor("e1")
        e0.cache("old", prompt(1, 0))
        filler = [20_000 + i for i in range(queued)]  # another tenant's prompt, queued on e0
        e0.kv.intend("filler", filler, e0.kv.hash_blocks(filler), order=(0, 0))
        assert e0.sched.num_queued_tokens() == queued
        assert route([e0, e1], "r", prompt(1, 1), 1) == want, queued


def test_a_cold_prefix_goes_where_the_least_valuable_blocks_would_be_evicted():
    """Both caches are full of blocks that ended requests left; on e0 the least recently
    used ones are a prefix other requests have hit, on e1 blocks nobody shared. A new
    tenant's prompt (66 blocks) would evict them: it goes to e1, and with the roles swapped
    to e0. Queues are equal (empty)."""
    for shared_on, want in ((0, 1), (1, 0)):
        e0, e1 = Executor("e0", num_blocks=80), Executor("e1", num_blocks=80)
        for i, e in enumerate((e0, e1)):
            e.cache(f"lru{i}", prompt(50 + i, 0, prefix_len=960, question_len=0),
                    num_hits=2 if i == shared_on else 0)
            e.cache(f"mru{i}", prompt(60 + i, 0, prefix_len=320, question_len=0))
        assert [e.kv.num_free_gpu_blocks for e in (e0, e1)] == [80, 80]
        assert route([e0, e1], "r", prompt(1, 1), 1) == want


def test_a_prefix_offloaded_to_the_host_still_counts_as_matched():
    """Tenant 1's prefix (64 blocks) was computed on e0, then evicted from its device by
    another tenant's prompt (80 blocks, the whole device): with offloading e0's CPU blocks
    hold most of it and the request goes there (its hit swaps it back in); without, neither
    executor holds any of it and the cold-prefix rule sends it to the emptier e1."""
    for offload, want in ((128, 0), (0, 1)):
        e0 = Executor("e0", num_blocks=80, offload_blocks=offload)
        e1 = Executor("e1", num_blocks=80)
        e0.cache("old", prompt(1, 0))
        e0.cache("other", prompt(2, 0, prefix_len=1216))
        hit = e0.kv.lookup(prompt(1, 1), e0.kv.hash_blocks(prompt(1, 1)))
        # the host (128 blocks) took old's 68 then other's 80, evicting old's last 20
        assert (len(hit.block_ids), len(hit.host_block_ids)) == (0, 48 if offload else 0)
        assert route([e0, e1], "r", prompt(1, 1), 1) == want


def test_blocks_the_host_keeps_are_not_counted_as_evicted():
    """Both caches are full of blocks that ended requests left, the least recently used
    ones a prefix other requests have hit; a new tenant's prompt would evict them. On e0
    (offloading) the host holds them, so evicting them there loses nothing: e0, whichever
    the turn."""
    for turn in (0, 1):
        e0 = Executor("e0", num_blocks=80, offload_blocks=128)
        e1 = Executor("e1", num_blocks=80)
        for i, e in enumerate((e0, e1)):
            e.cache(f"lru{i}", prompt(50 + i, 0, prefix_len=960, question_len=0), num_hits=2)
            e.cache(f"mru{i}", prompt(60 + i, 0, prefix_len=320, question_len=0))
        assert e0.kv.num_shared_blocks_evicted(66) == 0
        assert e1.kv.num_shared_blocks_evicted(66) == 60
        assert route([e0, e1], "r", prompt(1, 1), 1, turn=turn) == 0


def test_a_request_follows_an_intended_prefix_on_a_waiting_request():
    """Two requests of a new prefix arrive before either has run: the second goes where the
    first waits (its prefix is intended there), not to the idle executor."""
    e0, e1 = Executor("e0"), Executor("e1")
    assert route([e0, e1], "a", prompt(1, 1), 1) == 0
    assert e0.kv.num_intended_tokens == 1088
    assert route([e0, e1], "b", prompt(1, 2), 2, turn=1) == 0  # turn alone would say e1
    assert e0.kv.num_intended_tokens == 1088 + 64  # the shared prefix counted once
    # The scheduler runs a alone; b waits for a's prefix, then computes its question only.
    out = e0.sched.schedule()
    e0.kv.end_step()
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [("a#0", 1088)]
    assert e0.sched.waiting[0].prefix_wait_tokens == 1024


def test_a_hot_prefix_spreads_to_a_second_executor_by_the_same_rule():
    """Tenant 1 sends request after request; its prefix is cached on e0. Each one queues
    its question (64 tokens) on e0 until e0's queue passes the threshold
    (TENANT_SPILL_FACTOR x 1,024 tokens: after 32 of them); the next goes to e1, which
    then intends the prefix too, and from then on the two share the tenant by cost."""
    e0, e1 = Executor("e0"), Executor("e1")
    e0.cache("old", prompt(1, 0))
    where = [route([e0, e1], f"r{i}", prompt(1, i + 1), i + 1, turn=i) for i in range(40)]
    first_move = where.index(1)
    assert first_move == 33 and where[:33] == [0] * 33
    assert e0.sched.num_queued_tokens() == 33 * 64  # above 2 x 1,024: the 34th moved
    # e1 computes the prefix for the 34th; after it the requests alternate by queue length.
    assert where[33:] == [1, 1, 1, 1, 1, 1, 1]
    assert e1.sched.num_queued_tokens() == 1024 + 7 * 64


def test_prefill_rate_scales_the_rule_and_an_unmeasured_executor_takes_the_mean():
    e0, e1, e2 = Executor("e0", rate=20_000.0), Executor("e1", rate=5_000.0), \
        Executor("e2", rate=None)
    cands = [candidate(e.name, e.kv, e.sched) for e in (e0, e1, e2)]
    assert [c.prefill_tokens_per_s for c in cands] == \
        [pytest.approx(20_000.0, rel=1e-3), pytest.approx(5_000.0, rel=1e-3), None]
    tokens = prompt(1, 1)
    hashes = e0.kv.hash_blocks(tokens)
    assert choose(RoutingPolicy.PREFIX, cands, tokens, hashes, None, 1).index == 0  # fastest
    # e2 counts as the measured mean, 12,500 tokens/s: 1,088 tokens take it 87 ms; behind
    # 1,000 queued tokens e0 takes 104 ms, e1 218 ms.
    filler = [20_000 + i for i in range(1000)]
    e0.kv.intend("filler", filler, e0.kv.hash_blocks(filler), order=(0, 0))
    cands = [candidate(e.name, e.kv, e.sched) for e in (e0, e1, e2)]
    assert choose(RoutingPolicy.PREFIX, cands, tokens, hashes, None, 0).index == 2


def test_cost_model_fits_a_fixed_cost_and_per_token_and_per_sequence_costs():
    """forward_s = fixed + tokens x s_per_token + sequences x s_per_seq, fitted from steps
    of different shapes (here exact: 10 ms + 50 us per prefill token + 1 ms per sequence);
    the ridge towards the priors costs a few percent."""
    cost = CostModel()
    assert (cost.prefill_measured, cost.decode_measured) == (False, False)
    assert cost.s_per_token == cost_model.DEFAULT_PREFILL_S_PER_TOKEN and cost.fixed_s == 0
    for _ in range(3):
        for seqs in (4, 8, 16):
            cost.observe_step(0, seqs, 0.010 + 1e-3 * seqs)
    assert cost.decode_measured and not cost.prefill_measured
    assert cost.fixed_s == pytest.approx(0.010, rel=0.03)
    assert cost.s_per_seq == pytest.approx(1e-3, rel=0.03)
    cost.observe_step(8, 0, 0.010 + 8 * 5e-5)  # enters the fit, too short to be "measured"
    assert not cost.prefill_measured
    cost.observe_step(1000, 10, 0.010 + 1000 * 5e-5 + 10e-3)
    cost.observe_step(200, 10, 0.010 + 200 * 5e-5 + 10e-3)
    assert cost.prefill_measured
    assert cost.s_per_token == pytest.approx(5e-5, rel=0.01)
    assert cost.fixed_s == pytest.approx(0.010, rel=0.03)


def test_a_short_first_prompt_teaches_the_same_prefill_rate_as_long_ones():
    """The demo's case on a 2-core CPU: steps take 95 ms + 3.5 ms per prompt token + 0.5 ms
    per decoding sequence on both executors. e1's only prompt had 37 tokens, e0's 100; then
    each decoded one sequence 8 times. As ratios of seconds to tokens they read 164 against
    226 tokens/s, and routing sent e1 nothing; fitted with a fixed cost, the same."""
    def run(cost: CostModel, prompt: int, prompts: int) -> None:
        for shape in [(prompt, 0)] * prompts + [(0, 1)] * 8:
            cost.observe_step(*shape, 0.095 + 3.5e-3 * shape[0] + 0.5e-3 * shape[1])
    e0, e1 = Executor("e0", rate=None), Executor("e1", rate=None)
    run(e0.sched.cost, 100, 3)
    run(e1.sched.cost, 37, 1)
    r0, r1 = e0.sched.prefill_tokens_per_s(), e1.sched.prefill_tokens_per_s()
    assert r0 == pytest.approx(1 / 3.5e-3, rel=0.05) and r1 == pytest.approx(r0, rel=0.02)
    assert e1.sched.step_fixed_s() == pytest.approx(0.095, rel=0.02)


def test_decoding_samples_count_in_the_wait():
    """Equal caches and queues: a cold prompt goes where fewer samples decode (the step
    that runs its prefill runs them too)."""
    e0, e1 = Executor("e0"), Executor("e1")
    for e in (e0, e1):
        e.sched.cost.observe_step(0, 10, 0.01)
    c0, c1 = (candidate(e.name, e.kv, e.sched) for e in (e0, e1))
    c0.num_running_seqs = 3
    tokens = prompt(1, 1)
    hashes = e0.kv.hash_blocks(tokens)
    assert choose(RoutingPolicy.PREFIX, [c0, c1], tokens, hashes, None, 0).index == 1
    c0.num_running_seqs, c1.num_running_seqs = 0, 1
    assert choose(RoutingPolicy.PREFIX, [c0, c1], tokens, hashes, None, 1).index == 0


def test_a_cold_prefix_goes_to_the_emptier_cache_among_the_near_cheapest():
    """Both idle; e0 measured 5% faster and holds tenant 1's prefix (cached, evictable). A
    new tenant's prefix goes to the emptier e1 whatever the turn: within COLD_PREFIX_TIE,
    rate noise does not decide. 1.5x apart, the faster one takes it."""
    e0, e1 = Executor("e0", rate=10_500.0), Executor("e1", rate=10_000.0)
    e0.cache("t1", prompt(1, 0))
    tokens = prompt(2, 0)
    hashes = e0.kv.hash_blocks(tokens)
    for turn in (0, 1):
        cands = [candidate(e.name, e.kv, e.sched) for e in (e0, e1)]
        assert choose(RoutingPolicy.PREFIX, cands, tokens, hashes, None, turn).index == 1
    e0, e1 = Executor("e0", rate=15_000.0), Executor("e1", rate=10_000.0)
    e0.cache("t1", prompt(1, 0))
    cands = [candidate(e.name, e.kv, e.sched) for e in (e0, e1)]
    assert choose(RoutingPolicy.PREFIX, cands, tokens, hashes, None, 1).index == 0
    assert e0.kv.num_cached_gpu_blocks == (1024 + 64) // BS and e1.kv.num_cached_gpu_blocks == 0


def test_the_per_token_cost_never_drops_near_zero():
    """A small model's short prompts: a 4 ms step, 30 us per prompt token, timing noise of
    0.5 ms. The fitted marginal cost is a small difference of noisy times; were it to come
    out near zero, routing would think moving a tenant's prefix free (a cluster test's wave
    once left its prefix's executor so). It never drops below half of what a
    PREFILL_SCALE-token prefill costs a token, its fixed cost included."""
    import random
    rng = random.Random(3)
    cost = CostModel()
    for i in range(60):
        shape = (rng.randint(35, 45), rng.randint(0, 2)) if i % 6 == 0 else \
            (0, rng.randint(1, 3))
        cost.observe_step(*shape, 0.004 + 30e-6 * shape[0] + 0.2e-3 * shape[1]
                          + rng.gauss(0, 0.0005))
    floor = 0.5 * cost.fixed_s / cost_model.FLOOR_PROMPT_TOKENS
    assert cost.fixed_s == pytest.approx(0.004, rel=0.25)
    assert floor > 5e-6 and cost.s_per_token >= floor
    assert 15e-6 <= cost.s_per_token <= 60e-6  # the true 30 us, within 2x
    cost = CostModel()  # a fit that gives everything to the fixed cost
    for _ in range(20):
        cost.observe_step(40, 0, 0.004)
        cost.observe_step(0, 1, 0.004)
    assert cost.s_per_token >= 0.5 * 0.004 / cost_model.FLOOR_PROMPT_TOKENS


def test_the_per_token_cost_does_not_depend_on_the_prompts_an_executor_happened_to_see():
    """Two executors with the same step law (68 ms whatever it computes, 0.7 ms a prompt
    token: the built-in model in bfloat16 on a 2-core VM), one having prefilled a 37- and a
    26-token prompt, the other a 403-token one, each then decoding. Their per-token costs
    agree within COLD_PREFIX_TIE, so a cold prefix goes by load and cache, not by history.
    (Half the plain seconds-per-token ratio of the prompts seen, the earlier floor, read
    1.28 ms against 0.43: every new tenant of the demo went to the second executor.)"""
    def law(tokens, seqs):
        return 0.068 + 0.0007 * tokens

    short, long = CostModel(), CostModel()
    for cost, prompts in ((short, (37, 26)), (long, (403,))):
        for tokens in prompts:
            cost.observe_step(tokens, 0, law(tokens, 0))
            for _ in range(8):
                cost.observe_step(0, 1, law(0, 1))
    ratios = [c._prefill_ratio.s_per_unit for c in (short, long)]
    assert ratios[0] > 2.5 * ratios[1]  # the plain ratios: 2.9 against 0.87 ms a token
    a, b = short.s_per_token, long.s_per_token
    assert abs(a - b) <= routing.COLD_PREFIX_TIE * min(a, b), (a, b)
    assert a == pytest.approx(0.0007, rel=0.25) and b == pytest.approx(0.0007, rel=0.25)


def test_one_executor_takes_every_request_with_its_cached_prefix():
    """One candidate: nothing to weigh, but the decision still carries the prefix cached
    there (the caller pins it), for the prefix policy only."""
    e0 = Executor("e0")
    e0.cache("t1", prompt(1, 0))
    tokens = prompt(1, 1)
    hashes = e0.kv.hash_blocks(tokens)
    cands = [candidate("e0", e0.kv, e0.sched)]
    d = choose(RoutingPolicy.PREFIX, cands, tokens, hashes, None, 5)
    assert d.index == 0 and d.hit.num_tokens == 1024
    assert d.hit.block_ids == e0.kv.lookup(tokens, hashes).block_ids
    for policy in (RoutingPolicy.ROUND_ROBIN, RoutingPolicy.LEAST_LOADED):
        d = choose(policy, cands, tokens, hashes, None, 5)
        assert d.index == 0 and not d.hit.block_ids
