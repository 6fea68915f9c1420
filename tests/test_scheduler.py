"""The per-executor scheduler driven directly with a KVCacheManager (no executor): exact
expectations on what each step schedules, in what order, and how it preempts."""

from __future__ import annotations

from pagedserve.kvmanager import KVCacheManager
from pagedserve.router.plan_builder import build_plan
from pagedserve.router.scheduler import PreemptionMode, Scheduler, SchedulerConfig
from pagedserve.router.sequence import RequestGroup
from pagedserve.router.types import RequestSpec, SamplingSpec


class _Assembler:
    finished = False
    num_tokens = 0


def _group(rid: str, prompt_len: int, *, arrival: int, priority: int = 0, n: int = 1,
           max_tokens: int = 64, start: int = 3) -> RequestGroup:
    spec = RequestSpec(rid, tuple(range(start, start + prompt_len)),
                       SamplingSpec(max_tokens=max_tokens, n=n), priority=priority)
    return RequestGroup(spec, [_Assembler() for _ in range(n)], arrival)


def _step(sched: Scheduler, kv: KVCacheManager, step: int = 1):
    out = sched.schedule()
    plan = build_plan(step, out, kv, (1,))
    kv.end_step()
    kv.check_invariants()
    # The result (depth 1): the fake executor samples token 7 for every sequence that
    # reached its end.
    for seq in out.sampled:
        seq.num_pending -= 1
        seq.token_ids.append(7)
    return out, plan


def _scheduled(out):
    return [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled]


def test_priority_then_arrival_order_and_chunked_prefill():
    kv = KVCacheManager(64, 0, 16)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=40))
    sched.add(_group("late", 30, arrival=2, start=100))
    sched.add(_group("urgent", 30, arrival=3, priority=-1, start=200))
    sched.add(_group("early", 30, arrival=1, start=300))
    out, plan = _step(sched, kv)
    # Budget 40: urgent's whole prompt, then 10 tokens of early's (a chunk, no sample).
    assert _scheduled(out) == [("urgent#0", 30), ("early#0", 10)]
    assert plan.do_sample.tolist() == [1, 0]
    assert plan.num_computed_tokens.tolist() == [0, 0]
    assert [r.request_id for r in plan.new_requests] == ["urgent#0", "early#0"]
    out, plan = _step(sched, kv, 2)
    # Running first (urgent decodes, early's next chunk), then late's first chunk.
    assert _scheduled(out) == [("urgent#0", 1), ("early#0", 20), ("late#0", 19)]
    assert plan.num_computed_tokens.tolist() == [30, 10, 0]
    assert plan.positions.tolist()[:2] == [30, 10]
    assert plan.new_requests[0].request_id == "late#0"


def test_prefix_hit_starts_after_the_cached_blocks():
    kv = KVCacheManager(64, 0, 16)
    sched = Scheduler(kv, SchedulerConfig())
    a = _group("a", 40, arrival=1)
    sched.add(a)
    _step(sched, kv)
    sched.finish_seq(a.seqs[0])
    sched.remove(a)
    sched.add(_group("b", 40, arrival=2))
    out, plan = _step(sched, kv, 2)
    assert _scheduled(out) == [("b#0", 8)]  # 2 full blocks (32 tokens) cached
    assert plan.num_computed_tokens.tolist() == [32]
    assert plan.block_table_starts.tolist() == [0] and plan.block_table_lens.tolist() == [3]


def test_n2_computes_the_prompt_once_then_forks():
    kv = KVCacheManager(64, 0, 16)
    sched = Scheduler(kv, SchedulerConfig())
    g = _group("g", 20, arrival=1, n=2)
    sched.add(g)
    out, plan = _step(sched, kv)
    assert _scheduled(out) == [("g#0", 19)] and plan.do_sample.tolist() == [0]
    out, plan = _step(sched, kv, 2)
    assert [(f.parent_id, f.child_id, f.sample_index) for f in plan.forks] == [("g#0", "g#1", 1)]
    assert _scheduled(out) == [("g#0", 1), ("g#1", 1)]
    assert plan.do_sample.tolist() == [1, 1]
    # Both write position 19 in the shared second block: the first writer (g#0) gets a
    # fresh copy of it, g#1 keeps the original.
    t0, t1 = kv.block_table("g#0"), kv.block_table("g#1")
    assert t0[0] == t1[0] and t0[1] != t1[1]
    assert plan.copy.tolist() == [[t1[1], t0[1]]]
    assert not plan.new_requests  # the child came by fork, not as a new request


def test_blocks_short_preempts_the_latest_lowest_priority_once_per_step():
    # 8 blocks of 4 tokens; 4 requests of 8 tokens (2 blocks each) fill the cache.
    kv = KVCacheManager(8, 0, 4, watermark=0.0)
    sched = Scheduler(kv, SchedulerConfig(preemption_mode=PreemptionMode.RECOMPUTE))
    groups = [_group(f"r{i}", 8, arrival=i, start=10 * i + 3) for i in range(4)]
    for g in groups:
        sched.add(g)
    out, _ = _step(sched, kv)
    assert len(out.scheduled) == 4 and kv.num_free_gpu_blocks == 0
    # Every decode now needs a third block: r3 (latest) is preempted, and the blocks it
    # frees cover the others' needs from the next step on, so nothing else is preempted.
    out, plan = _step(sched, kv, 2)
    assert [(g.request_id, m) for g, m in out.preempted] == [("r3", PreemptionMode.RECOMPUTE)]
    assert _scheduled(out) == []
    assert plan.finished_ids == ["r3#0"]
    # r0 and r1 take r3's two blocks; r2 finds none and is the only victim left.
    out, plan = _step(sched, kv, 3)
    assert [(g.request_id, m) for g, m in out.preempted] == [("r2", PreemptionMode.RECOMPUTE)]
    assert _scheduled(out) == [("r0#0", 1), ("r1#0", 1)]
    assert [g.request_id for g in sched.waiting] == ["r2", "r3"]


def test_a_group_preempting_itself_takes_back_its_rows_of_the_step():
    # 4 blocks of 4 tokens; one n=2 group, forked after its 6th prompt token.
    kv = KVCacheManager(4, 0, 4, watermark=0.0)
    sched = Scheduler(kv, SchedulerConfig(preemption_mode=PreemptionMode.SWAP))
    g = _group("g", 7, arrival=1, n=2)
    sched.add(g)
    assert _scheduled(_step(sched, kv)[0]) == [("g#0", 6)]
    _step(sched, kv, 2)  # the fork; g#0 copies the shared block 1 into block 2
    assert _scheduled(_step(sched, kv, 3)[0]) == [("g#0", 1), ("g#1", 1)]
    assert kv.num_free_gpu_blocks == 1
    # Position 8 needs a new block each: g#0 takes the last one and is committed, g#1
    # finds none and the group is its own victim. g#0's row is taken back (its pending
    # token too) and the group is recomputed: swapping it would keep a step half done.
    out, plan = _step(sched, kv, 4)
    assert out.preempted == [(g, PreemptionMode.RECOMPUTE)]
    assert _scheduled(out) == [] and out.sampled == [] and out.num_tokens == 0
    assert out.num_decode_seqs == 0 and plan.request_ids == []
    assert [(s.num_pending, s.num_computed_tokens) for s in g.seqs] == [(0, 0), (0, 0)]
    assert sorted(plan.finished_ids) == ["g#0", "g#1"]
    assert kv.num_free_gpu_blocks == 4 and [x.request_id for x in sched.waiting] == ["g"]


def _four_with_swap():
    """Four 8-token prompts prefilled in 8 blocks of 4 tokens, swap preemption: the next
    step's decodes need a block more each, so the latest, r3, is swapped out then."""
    kv = KVCacheManager(8, 8, 4, watermark=0.0)
    sched = Scheduler(kv, SchedulerConfig(preemption_mode=PreemptionMode.SWAP))
    groups = [_group(f"r{i}", 8, arrival=i, start=10 * i + 3, max_tokens=4) for i in range(4)]
    for g in groups:
        sched.add(g)
    _step(sched, kv)
    return kv, sched, groups


def test_swap_mode_moves_the_victim_and_brings_it_back_first():
    kv, sched, groups = _four_with_swap()
    out, plan = _step(sched, kv, 2)
    assert [(g.request_id, m) for g, m in out.preempted] == [("r3", PreemptionMode.SWAP)]
    assert plan.swap_out.shape == (2, 2) and not plan.finished_ids
    assert [g.request_id for g in sched.swapped] == ["r3"]
    # Finish r0 and r1: r3 comes back (swap-in) before anything new.
    for g in groups[:2]:
        sched.finish_seq(g.seqs[0])
        sched.remove(g)
    sched.add(_group("new", 3, arrival=9, start=200))
    kv.begin_step()
    kv.end_step()
    out, plan = _step(sched, kv, 3)
    assert plan.swap_in.shape[0] == 2
    ids = [s for s, _ in _scheduled(out)]
    assert ids.index("r3#0") < ids.index("new#0")


def test_leaked_blocks_are_counted_and_their_owner_named():
    kv = KVCacheManager(16, 0, 4)
    sched = Scheduler(kv, SchedulerConfig())
    g = _group("live", 6, arrival=1)
    sched.add(g)
    _step(sched, kv)
    assert sched.num_leaked_blocks() == (0, [])
    # Blocks allocated for a request the scheduler does not know: a leak.
    kv.allocate("ghost#0", list(range(50, 59)), 9)
    assert sched.num_leaked_blocks() == (3, ["ghost#0"])
    kv.free("ghost#0")
    sched.finish_seq(g.seqs[0])
    sched.remove(g)
    assert sched.num_leaked_blocks() == (0, [])
    assert kv.stats().gpu.num_free_blocks == 16


def test_cost_model_learns_from_executor_timings():
    from pagedserve.router.cost_model import CostModel
    from pytest import approx
    cost = CostModel(s_per_block=1e-3, s_per_token=1e-3)
    # 10 blocks to move out and in (20 ms) vs 100 tokens to recompute (100 ms): swap.
    assert cost.prefer_swap(num_blocks=10, num_tokens=100)
    # The link turns out slow (50 ms per block moved): recompute wins after a few steps.
    for _ in range(20):
        cost.observe_swap(num_blocks=4, seconds=0.2)
    assert cost.s_per_block > 0.04
    assert not cost.prefer_swap(num_blocks=10, num_tokens=100)
    # Prefill turns out fast (0.1 ms per token): recomputing 100 tokens (10 ms) beats the
    # slow link again.
    cost.observe_prefill(num_tokens=512, seconds=0.0512)
    cost.observe_prefill(num_tokens=128, seconds=0.0128)
    assert cost.s_per_token == approx(1e-4, rel=0.01)
    assert not cost.prefer_swap(num_blocks=10, num_tokens=100)
    assert cost.prefer_swap(num_blocks=1, num_tokens=2000)


def test_n2_with_a_chunked_prompt_forks_before_the_last_prompt_token():
    kv = KVCacheManager(64, 0, 16)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=16))
    g = _group("g", 40, arrival=1, n=2)
    sched.add(g)
    chunks = [_scheduled(_step(sched, kv, i)[0]) for i in range(1, 4)]
    # 39 prompt tokens in chunks of 16, 16, 7: sample 0 never computes the last one itself.
    assert chunks == [[("g#0", 16)], [("g#0", 16)], [("g#0", 7)]]
    out, plan = _step(sched, kv, 4)
    assert [(f.parent_id, f.child_id) for f in plan.forks] == [("g#0", "g#1")]
    assert _scheduled(out) == [("g#0", 1), ("g#1", 1)] and plan.do_sample.tolist() == [1, 1]


def test_a_step_that_only_swaps_in_is_sent():
    """A group swapped in whose samples get no tokens in that step (its allocation short,
    say) leaves a plan with no rows but a swap-in. It is not empty: held back, the
    swap-in would ride with a later plan, which may swap the same blocks out again first
    (the executor swaps out before it swaps in) and lose their contents (found by the
    state machine, without prefix caching)."""
    from pagedserve.router.plan_builder import PlanRows
    from pagedserve.router.scheduler import SchedulerOutput

    kv = KVCacheManager(8, 8, 4, watermark=0.0)
    kv.allocate("a#0", list(range(6)), 6)
    kv.swap_out(["a#0"])
    kv.take_block_ops()
    kv.begin_step()
    assert SchedulerOutput(PlanRows(kv)).empty
    kv.swap_in(["a#0"])
    out = SchedulerOutput(PlanRows(kv))
    assert not out.empty and kv.has_block_ops
    plan = build_plan(1, out, kv, (1,))
    kv.end_step(1)
    assert plan.swap_in.tolist() == [[0, 2], [1, 3]] and plan.request_ids == []
    assert not kv.has_block_ops and SchedulerOutput(PlanRows(kv)).empty


def test_a_better_priority_takes_a_seat_from_the_worst_running_group():
    """max_num_seqs 2, both seats held by batch-like requests (priority 9): an online one
    (priority 0) arriving preempts the latest of them (recompute) and takes its seat in
    the same step; the other keeps decoding; the preempted one comes back when a seat
    frees (never in the plan that dropped it)."""
    kv = KVCacheManager(64, 0, 16)
    sched = Scheduler(kv, SchedulerConfig(max_num_seqs=2,
                                          preemption_mode=PreemptionMode.RECOMPUTE))
    for i in range(2):
        sched.add(_group(f"b{i}", 8, arrival=i, priority=9, start=10 * i + 3))
    _step(sched, kv)
    sched.add(_group("online", 8, arrival=5, start=200))
    out, plan = _step(sched, kv, 2)
    assert [(g.request_id, m) for g, m in out.preempted] == [("b1", PreemptionMode.RECOMPUTE)]
    assert _scheduled(out) == [("b0#0", 1), ("online#0", 8)] and plan.finished_ids == ["b1#0"]
    assert [r.request_id for r in plan.new_requests] == ["online#0"]
    out, _ = _step(sched, kv, 3)
    assert _scheduled(out) == [("online#0", 1), ("b0#0", 1)]
    assert [g.request_id for g in sched.waiting] == ["b1"]


def test_equal_or_worse_priorities_and_capped_groups_keep_their_seats():
    kv = KVCacheManager(64, 0, 16)
    sched = Scheduler(kv, SchedulerConfig(max_num_seqs=1, preemption_cap=1))
    running = _group("r", 8, arrival=0, priority=5)
    sched.add(running)
    _step(sched, kv)
    for i, priority in enumerate((5, 7)):  # same, then worse: they wait
        sched.add(_group(f"w{i}", 8, arrival=1 + i, priority=priority, start=50 + 10 * i))
        out, _ = _step(sched, kv, 2 + i)
        assert out.preempted == [] and _scheduled(out) == [("r#0", 1)]
    running.num_preemptions = 1  # preempted as often as the cap allows: it keeps its seat
    sched.add(_group("w2", 8, arrival=4, priority=0, start=90))
    out, _ = _step(sched, kv, 4)
    assert out.preempted == [] and _scheduled(out) == [("r#0", 1)]


def test_held_admission_serves_the_running_and_swapped_groups_only():
    """Held (a weight update waiting for the running requests): r0 decodes, the swapped r3
    comes back, the new request and the recompute-preempted one wait; released, they run."""
    kv, sched, groups = _four_with_swap()
    out, _ = _step(sched, kv, 2)
    assert [g.request_id for g in sched.swapped] == ["r3"]
    sched.hold = "hold"
    sched.add(_group("new", 3, arrival=9, start=200))
    for g in groups[1:3]:
        sched.finish_seq(g.seqs[0])
        sched.remove(g)
    out, plan = _step(sched, kv, 3)
    assert _scheduled(out) == [("r0#0", 1), ("r3#0", 1)] and plan.swap_in.shape[0] == 2
    assert [g.request_id for g in sched.waiting] == ["new"]
    sched.hold = ""
    out, _ = _step(sched, kv, 4)
    assert _scheduled(out) == [("r0#0", 1), ("r3#0", 1), ("new#0", 3)]


def test_retract_preempts_every_group_by_recompute_then_holds():
    """SGLang's "retract" pause: r0 and r1 run, r3 is swapped; one step drops them all from
    the executor (with r2, finished), r3's CPU blocks are freed too, no block stays held,
    nothing is admitted; released after a prefix-cache reset, they compute their tokens
    so far again, in arrival order."""
    kv, sched, groups = _four_with_swap()
    _step(sched, kv, 2)
    assert [g.request_id for g in sched.swapped] == ["r3"]
    sched.finish_seq(groups[2].seqs[0])
    sched.remove(groups[2])
    sched.hold = "retract"
    out, plan = _step(sched, kv, 3)
    assert [(g.request_id, m) for g, m in out.preempted] == [
        ("r1", PreemptionMode.RECOMPUTE), ("r0", PreemptionMode.RECOMPUTE),
        ("r3", PreemptionMode.RECOMPUTE)]
    assert _scheduled(out) == [] and sorted(plan.finished_ids) == ["r0#0", "r1#0", "r2#0", "r3#0"]
    assert sched.hold == "hold" and not sched.running and not sched.swapped
    assert [g.request_id for g in sched.waiting] == ["r0", "r1", "r3"]
    st = kv.stats()
    assert st.gpu.num_free_blocks == 8 and st.cpu.num_free_blocks == 8
    out, _ = _step(sched, kv, 4)
    assert out.empty
    assert kv.reset_prefix_cache() == 0  # new weights: none of the old KV is found again
    sched.hold = ""
    out, _ = _step(sched, kv, 5)
    assert _scheduled(out) == [("r0#0", 9), ("r1#0", 9)]  # 8 prompt tokens + 1 output each


def test_frozen_groups_keep_their_blocks_and_go_on_where_they_were():
    """A pause "keep" (vLLM's; SGLang's in_place): no group is scheduled, nothing is
    admitted, every block stays; an abort meanwhile still reaches the executor; unfrozen,
    the running ones decode on from where they were (the 9th token of each needs a third
    block: as before the freeze, the latest is swapped out for the others)."""
    kv, sched, groups = _four_with_swap()
    sched.hold = "freeze"
    free = kv.num_free_gpu_blocks
    sched.add(_group("new", 3, arrival=9, start=200))
    out, _ = _step(sched, kv, 2)
    assert out.empty and kv.num_free_gpu_blocks == free
    sched.remove(groups[3])
    out, plan = _step(sched, kv, 3)
    assert _scheduled(out) == [] and plan.finished_ids == ["r3#0"]
    sched.hold = ""  # r3's blocks went back: r0 and r1 take them; r2 is swapped for its own
    out, _ = _step(sched, kv, 4)
    assert _scheduled(out) == [("r0#0", 1), ("r1#0", 1)]
    assert [(g.request_id, m) for g, m in out.preempted] == [("r2", PreemptionMode.SWAP)]
    assert [g.request_id for g in sched.waiting] == ["new"]
