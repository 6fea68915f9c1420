"""The decode lane (router/decode_lane.py) plans exactly what the scheduler's loop plans.

Two worlds are driven alike: the same requests, priorities, aborts, samples and early stops,
at pipeline depth 2, one scheduler with the lane and one without. After every step their
plans must be the same plan up to row order -- every request's row (start, tokens, input,
positions, slots, table change, sampling, feed), the new requests, forks, drops,
preemptions, and the swap and copy pairs (so the blocks were taken in the same order) --
and the lane's columns must agree with the objects (`DecodeLane.verify`, run by the
scheduler under `debug_checks`). The cache is sized so that some steps use the lane and
others fall back to the loop (the budget or the free blocks bind), and requests cross block
boundaries, register blocks, stop early, are preempted and aborted.
"""

from __future__ import annotations

import asyncio

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from pagedserve.kvmanager import KVCacheManager
from pagedserve.router import app
from pagedserve.router.plan_builder import build_plan
from pagedserve.router.scheduler import PreemptionMode, Scheduler, SchedulerConfig
from pagedserve.router.sequence import RequestGroup
from pagedserve.router.types import RequestSpec, SamplingSpec
from pipeline_rig import EOS, expected, free_blocks, make_engine, run, submit

BS = 4
DEPTH = 2
STOP = 7  # a sampled 7 ends a sample (an EOS-like stop), when the request allows it
PREFIXES = ([5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 20, 21, 22, 23], [30, 31, 32])


class _Assembler:
    finished = False
    num_tokens = 0


def _sample(seq_id: str, pos: int) -> int:
    return (len(seq_id) * 7 + pos * 3) % 11


class _World:
    def __init__(self, lane: bool, num_blocks: int, budget: int, prefix_caching: bool,
                 depth: int = DEPTH) -> None:
        self.kv = KVCacheManager(num_blocks, 16, BS, watermark=0.0, hash_algo="builtin",
                                 enable_prefix_caching=prefix_caching, debug_checks=lane)
        self.sched = Scheduler(self.kv, SchedulerConfig(
            max_num_seqs=24, max_num_batched_tokens=budget, max_model_len=48,
            preemption_mode=PreemptionMode.AUTO, decode_lane_min_running=1 if lane else 0,
            pipeline_depth=depth))
        self.live: dict[str, RequestGroup] = {}
        self.in_flight: list = []
        self.to_complete: set[str] = set()
        self.step = 0
        self.lane_steps = 0


def _rows(plan) -> dict:
    """Each request's row of a plan, keyed by request id (order-free)."""
    rows = {}
    t = 0
    table_ofs = 0
    feed = plan.feed_sampled
    for i, rid in enumerate(plan.request_ids):
        k = int(plan.num_new_tokens[i])
        n_ids = int(plan.block_table_lens[i])
        rows[rid] = (int(plan.num_computed_tokens[i]), k, int(plan.do_sample[i]),
                     int(feed[i]) if feed is not None else 0,
                     plan.token_ids[t:t + k].tolist(), plan.positions[t:t + k].tolist(),
                     plan.slot_mapping[t:t + k].tolist(), int(plan.block_table_starts[i]),
                     plan.block_table_ids[table_ofs:table_ofs + n_ids].tolist())
        t += k
        table_ofs += n_ids
    assert t == len(plan.token_ids) and table_ofs == len(plan.block_table_ids)
    return rows


class LaneMachine(RuleBasedStateMachine):
    num_blocks = 40
    budget = 20
    request_share = 0.25
    prefix_caching = True
    depth = DEPTH  # plans in flight

    def __init__(self) -> None:
        super().__init__()
        self.worlds = [_World(lane, self.num_blocks, self.budget, self.prefix_caching,
                              self.depth) for lane in (True, False)]
        self.sampled_last: set[str] = set()  # samples the last plan sent samples
        self.n = 0

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 3), max_size=9),
          priority=st.integers(0, 2), max_tokens=st.integers(1, 30),
          n=st.sampled_from([1, 1, 1, 2]), stops=st.booleans())
    def arrive(self, prefix, suffix, priority, max_tokens, n, stops):
        # (the engine refuses a request that could never fit: here, one that needs more
        # than a share of the cache)
        if n * -(-(len(prefix) + len(suffix) + max_tokens) // BS) \
                > self.num_blocks * self.request_share:
            return
        self.n += 1
        rid = f"q{self.n}"
        spec = RequestSpec(rid, tuple(prefix + suffix), SamplingSpec(
            max_tokens=max_tokens, n=n, stop_token_ids=(STOP,) if stops else ()),
            priority=priority)
        for w in self.worlds:
            group = RequestGroup(spec, [_Assembler() for _ in range(n)], self.n)
            seq = group.seqs[0]
            hit = w.kv.lookup(seq.token_ids, w.kv.hash_blocks(seq.token_ids, None,
                                                              seq.block_hashes))
            if hit.block_ids:
                group.pinned_tokens = w.kv.pin(seq.seq_id, hit).num_tokens
            group.executor_id = "e0"
            w.sched.add(group)
            w.live[rid] = group

    @precondition(lambda self: self.worlds[0].live)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.worlds[0].live)))
        for w in self.worlds:
            w.sched.remove(w.live.pop(rid))
            w.to_complete.discard(rid)

    @precondition(lambda self: len(self.worlds[0].in_flight) < self.depth)
    @rule()
    def send(self):
        plans = []
        for w in self.worlds:
            out = w.sched.schedule()
            if out.empty:
                w.kv.end_step()
                plans.append(None)
                continue
            w.lane_steps += out.rows.lane is not None
            w.step += 1
            plan = build_plan(w.step, out, w.kv, (99,))
            w.kv.end_step(w.step)
            w.in_flight.append((plan, out))
            plans.append((plan, out))
        a, b = plans
        assert (a is None) == (b is None)
        if a is None:
            return
        (pa, oa), (pb, ob) = a, b
        assert _rows(pa) == _rows(pb)
        # the executor feeds a marked decode from the plan just before only
        ids = pa.request_ids
        if pa.feed_sampled is not None:
            fed = {ids[i] for i in pa.feed_sampled.nonzero()[0].tolist()}
            assert fed <= self.sampled_last, sorted(fed - self.sampled_last)
        self.sampled_last = {ids[i] for i in pa.do_sample.nonzero()[0].tolist()}
        assert len(pa.request_ids) == len(set(pa.request_ids))
        assert [r.request_id for r in pa.new_requests] == \
            [r.request_id for r in pb.new_requests]
        assert [(f.parent_id, f.child_id) for f in pa.forks] == \
            [(f.parent_id, f.child_id) for f in pb.forks]
        assert pa.finished_ids == pb.finished_ids
        for name in ("swap_out", "swap_in", "copy"):
            assert np.array_equal(getattr(pa, name), getattr(pb, name)), name
        assert [(g.request_id, m) for g, m in oa.preempted] == \
            [(g.request_id, m) for g, m in ob.preempted]
        # the sampling rows in plan order are the samples in `sampled`, in both worlds
        for plan, out in ((pa, oa), (pb, ob)):
            sampling = [rid for rid, s in zip(plan.request_ids, plan.do_sample.tolist(),
                                              strict=True) if s]
            assert sampling == [s.seq_id for s in out.sampled]
            assert out.num_tokens == len(plan.token_ids)
        assert self.worlds[0].sched.num_running_seqs() == self.worlds[1].sched.num_running_seqs()

    @precondition(lambda self: self.worlds[0].in_flight)
    @rule()
    def answer(self):
        for w in self.worlds:
            plan, out = w.in_flight.pop(0)
            w.kv.plan_answered(plan.step_id)
            for seq in out.sampled:
                seq.num_pending -= 1
            for seq in sorted(out.sampled, key=lambda s: s.seq_id):
                group = seq.group
                if w.live.get(group.request_id) is not group or seq.finished:
                    continue
                tok = _sample(seq.seq_id, len(seq.token_ids))
                seq.token_ids.append(tok)
                sp = group.spec.sampling
                if tok in sp.stop_token_ids or seq.num_output_tokens >= sp.max_tokens:
                    w.sched.finish_seq(seq)
                    if all(s.finished for s in group.seqs):
                        w.to_complete.add(group.request_id)

    @precondition(lambda self: self.worlds[0].to_complete)
    @rule()
    def complete(self):
        for w in self.worlds:
            for rid in sorted(w.to_complete):
                w.sched.remove(w.live.pop(rid))
            w.to_complete.clear()

    @invariant()
    def same_state(self):
        a, b = self.worlds
        assert a.to_complete == b.to_complete and sorted(a.live) == sorted(b.live)
        for rid, ga in a.live.items():
            gb = b.live[rid]
            assert ga.status == gb.status
            for sa, sb in zip(ga.seqs, gb.seqs, strict=True):
                assert (sa.token_ids, sa.num_computed_tokens, sa.num_pending, sa.finished) == \
                    (sb.token_ids, sb.num_computed_tokens, sb.num_pending, sb.finished)
                if a.kv.has_request(sa.seq_id):
                    assert a.kv.block_table(sa.seq_id) == b.kv.block_table(sb.seq_id)
                    assert a.kv.num_tokens(sa.seq_id) == b.kv.num_tokens(sb.seq_id)
        # the same blocks registered in the prefix cache, under the same hashes
        assert {h: blk.block_id for h, blk in a.kv.gpu.cached.items()} == \
            {h: blk.block_id for h, blk in b.kv.gpu.cached.items()}
        assert a.kv.stats() == b.kv.stats()
        for w in self.worlds:
            w.kv.check_invariants()
            assert w.sched.num_leaked_blocks() == (0, [])
        lane = a.sched.lane
        assert all(s.group.status.value == "running" for s in lane.seqs)
        lane.verify()

    def teardown(self):
        a = self.worlds[0]
        for _ in range(3000):
            if a.to_complete:
                self.complete()
            if not a.live and not a.in_flight:
                break
            sent = a.step
            if len(a.in_flight) < self.depth and a.live:
                self.send()
            if a.step == sent:
                assert a.in_flight, f"nothing scheduled for {sorted(a.live)}"
                self.answer()
            self.same_state()
        assert not a.live
        assert len(a.sched.lane) == 0
        for w in self.worlds:
            assert w.kv.num_free_gpu_blocks == w.kv.stats().gpu.num_total_blocks


LaneMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60,
                                         deadline=None)
TestLaneMachine = LaneMachine.TestCase


class TightLaneMachine(LaneMachine):
    """A cache small enough that blocks bind: preemptions and steps the lane gives up."""

    num_blocks = 16
    budget = 12
    request_share = 0.6


TightLaneMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=60,
                                              deadline=None)
TestTightLaneMachine = TightLaneMachine.TestCase


class NoPrefixCachingLaneMachine(LaneMachine):
    prefix_caching = False


NoPrefixCachingLaneMachine.TestCase.settings = settings(max_examples=60,
                                                        stateful_step_count=60, deadline=None)
TestNoPrefixCachingLaneMachine = NoPrefixCachingLaneMachine.TestCase


class Depth3LaneMachine(TightLaneMachine):
    """Three plans in flight, blocks binding: members whose token in flight is older than
    the last plan wait, in the lane as in the loop."""

    depth = 3


Depth3LaneMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=60,
                                               deadline=None)
TestDepth3LaneMachine = Depth3LaneMachine.TestCase


def test_steady_decodes_take_the_lane_and_the_loop_serves_the_rest():
    """Exact expectations on one run: 6 requests of 4-token prompts (one block each) and a
    budget of 20 tokens. Step 1 computes 5 prompts, step 2 their first decodes through the
    loop (they join the lane) and the 6th prompt, step 3 the 5 in the lane and the 6th's
    first decode through the loop; from then on the lane plans all 6, and every 4th step
    a member's slot opens a new block: taken in the lane, sent as its row's table change
    (5 in step 6, the 6th in step 7, and so on)."""
    m = LaneMachine()
    for i in range(6):
        m.arrive(prefix=list(PREFIXES[2]), suffix=[i], priority=0, max_tokens=30, n=1,
                 stops=False)
    a = m.worlds[0]
    steps = []
    for _ in range(12):
        if len(a.in_flight) == DEPTH:
            m.answer()
        m.send()
        m.same_state()
        rows = a.in_flight[-1][1].rows
        lane = rows.lane
        steps.append((len(lane.ids) if lane is not None else 0, len(rows.rows),
                      int(lane.table_changed.sum()) if lane is not None else 0))
    assert steps == [(0, 5, 0), (0, 6, 0), (5, 1, 0), (6, 0, 0), (6, 0, 0), (6, 0, 5),
                     (6, 0, 1), (6, 0, 0), (6, 0, 0), (6, 0, 5), (6, 0, 1), (6, 0, 0)]
    assert a.lane_steps == 10 and len(a.sched.lane) == 6
    m.teardown()  # every request to its end: the lane empties
    assert len(a.sched.lane) == 0 and not a.sched.lane.rows


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_the_engine_streams_every_token_with_the_lane(depth):
    """The whole engine (pipeline_rig's simulated executor, which feeds marked decodes its
    own samples and answers in plan order) with the lane from 8 running requests on: 40
    requests of different lengths, some ending early on EOS, one aborted; every stream
    gets exactly its tokens, and every block is free at the end."""
    async def main():
        engine, ex = make_engine(depth, num_gpu_blocks=512, decode_lane_min_running=8)
        lane = engine.executors["e0"].scheduler.lane
        streams, want = [], {}
        for i in range(40):
            rid = f"r{i}"
            n = 1 + (i * 7) % 30
            if i % 5 == 0:  # EOS as output token i % 9 (when within max_tokens)
                ex.overrides[(f"{rid}#0", i % 9)] = EOS
            streams.append(await submit(engine, rid, [3 + i % 11] * (1 + i % 9), max_tokens=n))
            toks = expected(f"{rid}#0", n)
            if i % 5 == 0 and i % 9 < n:
                toks = toks[: i % 9] + [EOS]
            want[rid] = toks
        most = 0
        for _ in range(300):
            if all(s.done for s in streams):
                break
            if ex.plans and len(ex.plans) == 6:
                engine.abort("r3")
            if ex.unanswered():
                await ex.answer()
            else:
                await asyncio.sleep(0.002)
            most = max(most, len(lane))
        assert all(s.done for s in streams)
        assert most >= 20  # the lane planned most of them
        for i, s in enumerate(streams):
            rid = f"r{i}"
            if rid == "r3":
                assert s.finish().finish_reason == "abort"
                assert s.tokens() == want[rid][: len(s.tokens())]
                continue
            assert s.tokens() == want[rid], rid
        while ex.unanswered():
            await ex.answer()
        assert free_blocks(engine) == (512, 512)
        assert len(lane) == 0
    run(main())


def test_a_bad_lane_setting_stops_the_router_at_start(monkeypatch):
    monkeypatch.setenv(app.DECODE_LANE_ENV, "16")
    assert app.decode_lane_min_running() == 16
    monkeypatch.setenv(app.DECODE_LANE_ENV, "0")  # off
    assert app.decode_lane_min_running() == 0
    monkeypatch.delenv(app.DECODE_LANE_ENV)
    assert app.decode_lane_min_running() == SchedulerConfig.decode_lane_min_running == 48
    for bad in ("-1", "many", "1.5"):
        monkeypatch.setenv(app.DECODE_LANE_ENV, bad)
        with pytest.raises(SystemExit, match=app.DECODE_LANE_ENV):
            app.decode_lane_min_running()
