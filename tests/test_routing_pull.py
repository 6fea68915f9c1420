"""The routing cost rule with prefix pulls (router/routing.py `_offer_pull`,
`_spill_threshold`): exact decisions at the thresholds the rule names, with real KV
managers and schedulers (test_routing.py's)."""

from __future__ import annotations

from pagedserve.router import cost_model, routing
from pagedserve.router.routing import RoutingPolicy, candidate, choose
from test_routing import RATE, Executor, prompt

SWAP_S = cost_model.DEFAULT_SWAP_S_PER_BLOCK


def cands(executors, max_pull_blocks: int = 200, keys=("k", "k"), transfer_s: float = 0.0,
          in_flight_prefill=(0, 0)):
    out = []
    for e, key, inflight in zip(executors, keys, in_flight_prefill, strict=True):
        c = candidate(e.name, e.kv, e.sched)
        c.pull_key = key
        c.max_pull_blocks = max_pull_blocks
        c.transfer_s_per_block = transfer_s
        c.num_in_flight = 1 if inflight else 0
        c.in_flight_prefill_tokens = inflight
        out.append(c)
    return out


def decide(executors, tokens, policy=RoutingPolicy.PREFIX, turn=0, **kw):
    hashes = executors[0].kv.hash_blocks(tokens)
    return choose(policy, cands(executors, **kw), tokens, hashes, None, turn)


def tenant_on_e0(queued: int):
    """Tenant 1's 1,024-token prefix cached on e0, `queued` tokens of another tenant's
    prompt queued there; e1 idle and empty."""
    e0, e1 = Executor("e0"), Executor("e1")
    e0.cache("old", prompt(1, 0))
    filler = [20_000 + i for i in range(queued)]
    e0.kv.intend("filler", filler, e0.kv.hash_blocks(filler), order=(0, 0))
    return e0, e1


def test_a_pull_lowers_the_spill_threshold_to_twice_its_cost():
    """Without pulls a tenant leaves e0 once its queue is longer by more than
    TENANT_SPILL_FACTOR x the prefix's compute time (2 x 1,024 tokens); with them, by
    TENANT_SPILL_FACTOR x the pull's cost (64 swap-ins: 12.8 tokens' time here; nothing in
    flight, free transfer), and the request takes e0's 64 blocks."""
    assert routing.TENANT_SPILL_FACTOR == 2.0
    threshold = 2 * 64 * SWAP_S * RATE  # 25.6 tokens
    e0, e1 = tenant_on_e0(int(threshold))
    d = decide([e0, e1], prompt(1, 1))
    assert d.index == 0 and d.pull_source is None
    e0, e1 = tenant_on_e0(int(threshold) + 1)
    cached = e0.kv.lookup(prompt(1, 1), e0.kv.hash_blocks(prompt(1, 1))).block_ids
    d = decide([e0, e1], prompt(1, 1))
    assert d.index == 1 and d.pull_source == 0 and d.hit.block_ids == ()
    assert d.pull_blocks == cached and len(cached) == 64
    # without pulls it stays until 2 x 1,024
    d = decide([e0, e1], prompt(1, 1), max_pull_blocks=0)
    assert d.index == 0 and d.pull_source is None
    e0, e1 = tenant_on_e0(2048)
    assert decide([e0, e1], prompt(1, 1), max_pull_blocks=0).index == 0
    e0, e1 = tenant_on_e0(2049)
    assert decide([e0, e1], prompt(1, 1), max_pull_blocks=0).index == 1


def test_a_pull_is_taken_only_when_it_arrives_before_computing_would_end():
    """Round-robin sends the request to e1; the pull pays while e0's prompt tokens in flight
    (the export waits for them) plus 64 swap-ins take less than computing 1,024 tokens:
    1,011 tokens in flight pull, 1,012 compute."""
    for inflight, pulls in ((1011, True), (1012, False)):
        e0, e1 = tenant_on_e0(0)
        d = decide([e0, e1], prompt(1, 1), RoutingPolicy.ROUND_ROBIN, turn=1,
                   in_flight_prefill=(inflight, 0))
        assert d.index == 1 and (d.pull_source == 0) == pulls, inflight
    # the bytes count too: 64 blocks of 2 ms each (0.128 s) are slower than computing
    # 1,024 tokens (0.1024 s), of 1 ms each (0.064 s, +1.3 ms of swap-ins) quicker
    e0, e1 = tenant_on_e0(0)
    d = decide([e0, e1], prompt(1, 1), RoutingPolicy.ROUND_ROBIN, turn=1, transfer_s=2e-3)
    assert d.pull_source is None
    d = decide([e0, e1], prompt(1, 1), RoutingPolicy.ROUND_ROBIN, turn=1, transfer_s=1e-3)
    assert d.pull_source == 0


def test_pulls_only_between_equal_keys_and_at_most_max_pull_blocks():
    e0, e1 = tenant_on_e0(0)
    d = decide([e0, e1], prompt(1, 1), RoutingPolicy.ROUND_ROBIN, turn=1, keys=("a", "b"))
    assert d.index == 1 and d.pull_source is None
    d = decide([e0, e1], prompt(1, 1), RoutingPolicy.ROUND_ROBIN, turn=1, keys=(None, None))
    assert d.pull_source is None
    cached = e0.kv.lookup(prompt(1, 1), e0.kv.hash_blocks(prompt(1, 1))).block_ids
    d = decide([e0, e1], prompt(1, 1), RoutingPolicy.ROUND_ROBIN, turn=1, max_pull_blocks=10)
    assert d.pull_source == 0 and d.pull_blocks == cached[:10]
    d = decide([e0, e1], prompt(1, 1), RoutingPolicy.LEAST_LOADED, turn=1)
    assert d.index == 1 and d.pull_source == 0  # (both idle: the turn decides)


def test_a_pull_brings_only_the_blocks_past_what_the_target_holds():
    """e1 holds the prefix's first 256 tokens (16 blocks): its hit is those, and the pull
    brings e0's blocks 16-63."""
    e0, e1 = tenant_on_e0(0)
    e1.cache("part", prompt(1, 0, prefix_len=256, question_len=0))
    tokens = prompt(1, 1)
    cached = e0.kv.lookup(tokens, e0.kv.hash_blocks(tokens)).block_ids
    d = decide([e0, e1], tokens, RoutingPolicy.ROUND_ROBIN, turn=1)
    assert d.index == 1 and len(d.hit) == 16 and d.pull_source == 0
    assert d.pull_blocks == cached[16:]


def test_a_cold_prompt_pulls_nothing():
    e0, e1 = tenant_on_e0(0)
    d = decide([e0, e1], prompt(2, 1))
    assert d.pull_source is None and d.hit.block_ids == ()


def test_a_source_only_executor_gives_its_blocks_and_is_never_chosen():
    """`sources` (decode executors under disaggregation): e1 takes no request but holds the
    prefix; e0, the only executor that may take it, pulls from there (the decision's
    pull_source indexes candidates then sources). A source cheaper than every candidate
    (a cold prompt: nothing cached anywhere, e1 idle and e0 loaded) is still not chosen."""
    e0, e1 = Executor("e0"), Executor("e1")
    e1.cache("old", prompt(1, 0))
    tokens = prompt(1, 1)
    hashes = e0.kv.hash_blocks(tokens)
    on_e1 = e1.kv.lookup(tokens, hashes).block_ids
    c0, c1 = cands([e0, e1])
    for policy in RoutingPolicy:
        d = choose(policy, [c0], tokens, hashes, None, 0, sources=[c1])
        assert (d.index, d.pull_source, d.pull_blocks) == (0, 1, on_e1), policy
        assert d.hit.block_ids == ()
    d = choose(RoutingPolicy.PREFIX, [c0], tokens, hashes, None, 0)  # no sources: no pull
    assert (d.index, d.pull_source) == (0, None)
    filler = [20_000 + i for i in range(5000)]
    e0.kv.intend("filler", filler, e0.kv.hash_blocks(filler), order=(0, 0))
    cold = prompt(2, 1)
    c0, c1 = cands([e0, e1])
    e2 = Executor("e2")
    e2.kv.intend("filler", filler, e2.kv.hash_blocks(filler), order=(0, 0))
    [c2] = cands([e2], keys=("k",), in_flight_prefill=(0,))
    d = choose(RoutingPolicy.PREFIX, [c0, c2], cold, e0.kv.hash_blocks(cold), None, 0,
               sources=[c1])
    assert d.index in (0, 1) and d.pull_source is None
