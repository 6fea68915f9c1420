"""Prefill dedup (Scheduler._admit_waiting): a request whose prefix another request on the
same executor is computing waits for those blocks instead of computing them again, and
computes what is missing when that request ends, is preempted or moves away. Exact
expectations on what each step schedules; KV invariants after every step."""

from __future__ import annotations

import asyncio

from pagedserve.kvmanager import KVCacheManager
from pagedserve.protos import wire
from pagedserve.router.plan_builder import build_plan
from pagedserve.router.scheduler import PreemptionMode, Scheduler, SchedulerConfig
from pagedserve.router.sequence import RequestGroup
from pagedserve.router.types import RequestSpec, SamplingSpec
from pipeline_rig import BS, SimExecutor, expected, make_engine, run, submit


class _Assembler:
    finished = False
    num_tokens = 0


def group(rid: str, prompt: list[int], arrival: int, priority: int = 0,
          max_tokens: int = 64) -> RequestGroup:
    spec = RequestSpec(rid, tuple(prompt), SamplingSpec(max_tokens=max_tokens),
                       priority=priority)
    return RequestGroup(spec, [_Assembler()], arrival)


def step(sched: Scheduler, kv: KVCacheManager, step_id: int):
    """One plan at depth 1: schedule, build, send; the result samples token 7 for every
    sequence at its end; a request at max_tokens ends (and leaves the scheduler)."""
    out = sched.schedule()
    build_plan(step_id, out, kv, (1,))
    kv.end_step()
    kv.check_invariants()
    leaked, orphans = sched.num_leaked_blocks()
    assert leaked == 0 and orphans == []
    for seq in out.sampled:
        seq.num_pending -= 1
        seq.token_ids.append(7)
        if seq.num_output_tokens >= seq.group.spec.sampling.max_tokens:
            sched.remove(seq.group)
    return out


def scheduled(out) -> list[tuple[str, int, int]]:
    """(sample, first position computed, tokens computed) of each scheduled sample."""
    return [(s.seq.seq_id, s.seq.num_computed_tokens - s.num_new_tokens, s.num_new_tokens)
            for s in out.scheduled]


P = list(range(1000, 3048))  # a new 2,048-token prefix


def test_concurrent_requests_of_one_new_prefix_compute_it_once():
    kv = KVCacheManager(600, 0, 16, watermark=0.0, debug_checks=True)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=8192, max_model_len=4096))
    groups = [group(f"r{i}", P + [i] * 10, i + 1) for i in range(4)]
    for g in groups:
        sched.add(g)
    out = step(sched, kv, 1)
    # r0 computes the prompt; r1-r3 see its blocks intended in the same plan build and wait.
    assert scheduled(out) == [("r0#0", 0, 2058)]
    assert [g.prefix_wait_tokens for g in groups] == [0, 2048, 2048, 2048]
    out = step(sched, kv, 2)
    assert scheduled(out) == [("r0#0", 2058, 1), ("r1#0", 2048, 10), ("r2#0", 2048, 10),
                              ("r3#0", 2048, 10)]
    assert [g.cached_prompt_tokens for g in groups] == [0, 2048, 2048, 2048]
    assert (kv.prefix_query_tokens, kv.prefix_hit_tokens) == (4 * 2058, 3 * 2048)


def test_chunked_prefill_waiters_pin_what_is_cached_under_the_cap():
    kv = KVCacheManager(600, 0, 16, watermark=0.0, debug_checks=True)  # pins: 150 blocks
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=700, max_model_len=4096))
    groups = [group(f"r{i}", P + [i] * 10, i + 1) for i in range(4)]
    for g in groups:
        sched.add(g)
    assert [scheduled(step(sched, kv, n)) for n in (1, 2)] == [[("r0#0", 0, 700)],
                                                                [("r0#0", 700, 700)]]
    out = step(sched, kv, 3)
    # r0's last chunk leaves 42 tokens of budget: the others look, and wait for the 656
    # intended tokens past the 1,392 cached (87 blocks) after its second chunk; they pin
    # those, r1 all 87 blocks and r2 the 63 left under the cap, r3 none.
    assert scheduled(out) == [("r0#0", 1400, 658)]
    assert [g.prefix_wait_tokens for g in groups] == [0, 656, 656, 656]
    assert [g.pinned_tokens for g in groups] == [0, 1392, 1008, 0]
    assert kv.stats().num_pinned_blocks == kv.max_pinned_blocks == 150
    out = step(sched, kv, 4)
    assert scheduled(out) == [("r0#0", 2058, 1), ("r1#0", 2048, 10), ("r2#0", 2048, 10),
                              ("r3#0", 2048, 10)]
    assert [g.cached_prompt_tokens for g in groups] == [0, 2048, 2048, 2048]
    assert kv.stats().num_pinned_blocks == 0


P1, P2 = list(range(10, 26)), list(range(30, 46))  # 4 blocks each (block size 4)


def _chain(abort_after: int | None):
    """x computes P1; a (P1 P2 ..) waits for x; b (P1 P2 ..) waits for x and for a."""
    kv = KVCacheManager(64, 0, 4, watermark=0.0, debug_checks=True)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=64, max_model_len=256))
    x, a, b = group("x", P1 + [1], 1), group("a", P1 + P2 + [2], 2), group("b", P1 + P2 + [3, 3], 3)
    for g in (x, a, b):
        sched.add(g)
    steps = []
    for n in (1, 2, 3):
        steps.append(scheduled(step(sched, kv, n)))
        if n == 1:
            assert [g.prefix_wait_tokens for g in (x, a, b)] == [0, 16, 32]
        if n == abort_after:
            sched.remove(a)  # the abort path (and the migration path on the old executor)
    return steps, b


def test_waiters_follow_a_chain_of_requests_computing_their_prefix():
    steps, b = _chain(None)
    assert steps == [[("x#0", 0, 17)],
                     [("x#0", 17, 1), ("a#0", 16, 17)],  # b waits for a's P2
                     [("x#0", 18, 1), ("a#0", 33, 1), ("b#0", 32, 2)]]
    assert b.cached_prompt_tokens == 32


def test_the_waiter_of_an_aborted_request_computes_what_is_missing():
    steps, b = _chain(abort_after=1)
    assert steps == [[("x#0", 0, 17)],
                     [("x#0", 17, 1), ("b#0", 16, 18)],  # P2 is b's to compute now
                     [("x#0", 18, 1), ("b#0", 34, 1)]]
    assert b.cached_prompt_tokens == 16


def _short_of_blocks(mode: PreemptionMode):
    """8 blocks of 4 tokens (8 CPU blocks for swap), 8 tokens a step: r (priority -5, 4
    tokens, 4 outputs) and a (priority 2, a 28-token prompt prefilled in chunks), queued;
    a runs out of blocks in step 4 and preempts itself."""
    kv = KVCacheManager(8, 8 if mode is PreemptionMode.SWAP else 0, 4, watermark=0.0,
                        debug_checks=True, max_pinned_fraction=1.0)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=8, max_model_len=256,
                                          preemption_mode=mode))
    prompt = list(range(10, 38))
    r = group("r", [1, 2, 3, 4], 1, priority=-5, max_tokens=4)
    a = group("a", prompt, 2, priority=2)
    sched.add(r)
    sched.add(a)
    return kv, sched, prompt, r, a


def test_the_waiter_computes_what_is_missing_when_the_first_request_is_preempted():
    """a (priority 2) is prefilling P in chunks when b (priority 0, sharing P's first 20
    tokens) arrives: a intends them. Out of blocks, a preempts itself (recompute) and queues
    again behind b: b computes what is missing, then a waits for b."""
    kv, sched, prompt, r, a = _short_of_blocks(PreemptionMode.RECOMPUTE)
    b = group("b", prompt[:20] + [50, 51, 52, 53], 3, priority=0)

    def b_waits_for() -> int:
        s = b.seqs[0]
        hit = kv.lookup(s.token_ids, s.block_hashes)
        return kv.intended_tokens(s.token_ids, s.block_hashes, None, len(hit),
                                  before=b.sort_key, exclude=s.seq_id)

    assert scheduled(step(sched, kv, 1)) == [("r#0", 0, 4), ("a#0", 0, 4)]
    sched.add(b)
    assert scheduled(step(sched, kv, 2)) == [("r#0", 4, 1), ("a#0", 4, 7)]
    assert scheduled(step(sched, kv, 3)) == [("r#0", 5, 1), ("a#0", 11, 7)]
    assert b_waits_for() == 4  # block 4 (tokens 16-19): a computes it next
    out = step(sched, kv, 4)  # r ends; a is short of blocks and preempts itself
    assert scheduled(out) == [("r#0", 6, 1)]
    assert [(g.request_id, m) for g, m in out.preempted] == [("a", PreemptionMode.RECOMPUTE)]
    assert b_waits_for() == 0  # a queues behind b: its intent no longer binds b
    out = step(sched, kv, 5)
    assert scheduled(out) == [("b#0", 16, 8)]  # a's cached blocks, then what is missing
    assert b.cached_prompt_tokens == 16
    a_seq = a.seqs[0]
    hit = kv.lookup(a_seq.token_ids, a_seq.block_hashes)
    assert len(hit) == 5  # a's own 4 blocks and b's block 4
    assert kv.intended_tokens(a_seq.token_ids, a_seq.block_hashes, None, len(hit),
                              before=a.sort_key, exclude=a_seq.seq_id) == 0


def test_abort_with_the_prefill_plan_in_flight_leaves_its_blocks_to_the_waiter():
    """Depth 2: plan 1 computes a's prompt (b waits); a is aborted before plan 1 is answered.
    The blocks plan 1 computes stay cached (held by the fence), so b's plan 2 hits them."""
    kv = KVCacheManager(32, 0, 4, watermark=0.0, debug_checks=True)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=64, max_model_len=256))
    a, b = group("a", P1 + P2 + [1], 1), group("b", P1 + P2 + [2, 2], 2)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    build_plan(1, out, kv, (1,))
    kv.end_step(1)
    assert scheduled(out) == [("a#0", 0, 33)] and b.prefix_wait_tokens == 32
    sched.remove(a)
    out = sched.schedule()
    build_plan(2, out, kv, (1,))
    kv.end_step(2)
    assert scheduled(out) == [("b#0", 32, 2)] and b.cached_prompt_tokens == 32
    assert set(kv.block_table("b#0")[:8]) & kv.gpu.held_free_ids() == set()
    kv.plan_answered(1)
    kv.plan_answered(2)
    kv.check_invariants()
    assert sched.num_leaked_blocks() == (0, [])


def test_a_request_ahead_in_order_computes_instead_of_waiting():
    """b (priority -1) is admitted before a (priority 0), so it does not wait for a's
    intent; a then waits for b."""
    kv = KVCacheManager(64, 0, 4, watermark=0.0, debug_checks=True)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=64, max_model_len=256))
    a, b = group("a", P1 + [1], 1), group("b", P1 + [2], 2, priority=-1)
    sched.add(a)
    sched.add(b)
    assert scheduled(step(sched, kv, 1)) == [("b#0", 0, 17)]
    assert (a.prefix_wait_tokens, b.prefix_wait_tokens) == (16, 0)
    assert scheduled(step(sched, kv, 2)) == [("b#0", 17, 1), ("a#0", 16, 1)]


def test_waiters_follow_a_migrated_request_to_its_new_executor():
    """e0 runs a (computing P) and b (waiting for it) when it dies: both migrate to e1, b
    behind a; routing sees a's intended prefix there and b waits for it again (depth 1, so
    that b's wait outlasts a plan)."""
    async def main():
        engine, ex0 = make_engine(1, num_gpu_blocks=64)
        prompt = P1 + P2
        a = await submit(engine, "a", prompt + [1], max_tokens=3)
        b = await submit(engine, "b", prompt + [2, 2], max_tokens=3)
        await ex0.wait_plans(1)
        first = ex0.unanswered()[0]
        assert first.request_ids == ["a#0"] and engine.live["b"].prefix_wait_tokens == 32
        hello = wire.Hello(executor_id="e1", model_fingerprint="fp", device="cpu",
                           dtype="float32", block_size=BS, num_gpu_blocks=64,
                           num_cpu_blocks=8, max_model_len=128)
        engine.membership.on_hello(b"e1", hello)
        ex1 = SimExecutor(engine, "e1")
        engine.membership.executor_lost(engine.executors["e0"], "killed")
        await ex1.wait_plans(1)
        plan = ex1.unanswered()[0]
        assert plan.request_ids == ["a#0"] and engine.live["b"].executor_id == "e1"
        assert engine.live["b"].prefix_wait_tokens == 32
        await ex1.answer()
        await ex1.wait_plans(1)
        plan = ex1.unanswered()[0]
        assert plan.request_ids == ["a#0", "b#0"]
        assert plan.num_computed_tokens.tolist() == [33, 32]
        await ex1.run_until_done([a, b])
        assert a.tokens() == expected("a#0", 3) and b.tokens() == expected("b#0", 3)
        assert (a.usage.cached_prompt_tokens, b.usage.cached_prompt_tokens) == (0, 32)
        kv = engine.executors["e1"].kv
        assert kv.intent_ids() == [] and kv.stats().num_pinned_blocks == 0
    run(asyncio.wait_for(main(), 20))


def test_a_request_swapped_in_mid_prompt_intends_the_rest_again():
    """a is prefilling its 28 tokens in chunks when it runs out of blocks and is swapped out
    (its intent released); swapped back in, with tokens 26-27 still to compute, it intends
    them again: a request sharing its prompt sees block 6 (tokens 24-27) as coming."""
    kv, sched, prompt, r, a = _short_of_blocks(PreemptionMode.SWAP)
    assert scheduled(step(sched, kv, 1)) == [("r#0", 0, 4), ("a#0", 0, 4)]
    assert scheduled(step(sched, kv, 2)) == [("r#0", 4, 1), ("a#0", 4, 7)]
    assert scheduled(step(sched, kv, 3)) == [("r#0", 5, 1), ("a#0", 11, 7)]
    out = step(sched, kv, 4)  # r ends; a is short of blocks and swaps itself out
    assert scheduled(out) == [("r#0", 6, 1)]
    assert [(g.request_id, m) for g, m in out.preempted] == [("a", PreemptionMode.SWAP)]
    assert not kv.has_intent("a#0")
    out = step(sched, kv, 5)
    assert scheduled(out) == [("a#0", 18, 8)]  # swapped in, tokens 18-25
    assert kv.has_intent("a#0")
    other = prompt + [99]
    hashes: list = []
    kv.hash_blocks(other, None, hashes)
    hit = kv.lookup(other, hashes)
    assert len(hit) == 6  # a's blocks 0-5, registered as computed
    assert kv.intended_tokens(other, hashes, None, len(hit)) == 4  # block 6, a computes next
    out = step(sched, kv, 6)
    assert scheduled(out) == [("a#0", 26, 2)]
    assert not kv.has_intent("a#0")  # scheduled through its prompt: released
