"""Stateful property test of the scheduler with intended prefixes and prefill dedup, against
a simulated executor, at pipeline depth 2 (and 3: `Depth3Machine`, `Depth3LaneMachine`; 4:
`Depth4Machine`).

Requests share a few prefixes (and a tiny vocabulary, so outputs repeat), arrive with
random priorities, are aborted at random, and run through a small KV cache, so requests
wait for each other's prefixes, are preempted (swap or recompute) and migrate-like removals
happen with plans in flight. The simulated executor runs each plan when it is answered, in
plan order: swap-out, swap-in, copy, then for every scheduled sample it *reads* the keys and
values of the positions before its chunk (through the slots of its table when the plan was
built) and writes its chunk. Checked after every rule:

- every position a plan reads holds exactly that request's tokens up to it: a waiter that
  was admitted on blocks nobody computed, or a hit on a block a plan in flight will still
  overwrite, shows as wrong contents;
- `check_invariants()` (the intended index included), no leaked block and no orphan KV
  request or intent (`Scheduler.num_leaked_blocks`);
- a waiting request only ever waits for an intent of a live request here;
- every decode a plan marks to be fed the executor's own sample sampled in the plan sent
  just before (the executor feeds from that step only).

At the end every request finishes (no waiter waits forever), and then every block is free
and no intent is left.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from pagedserve.kvmanager import KVCacheManager
from pagedserve.router.plan_builder import build_plan
from pagedserve.router.scheduler import PreemptionMode, Scheduler, SchedulerConfig
from pagedserve.router.sequence import RequestGroup
from pagedserve.router.types import RequestSpec, SamplingSpec

BS = 4
PREFIXES = ([5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 20, 21, 22, 23], [30, 31, 32, 33])
UNKNOWN = "?"  # a position whose input token never reached the router (a late stop)


def _check_block_moves(plan) -> None:
    """DESIGN's rule: a plan never names a block as both a source and a destination (nor
    one destination twice)."""
    so, si, cp = plan.swap_out.tolist(), plan.swap_in.tolist(), plan.copy.tolist()
    dev_src = {g for g, _ in so} | {s for s, _ in cp}
    dev_dst = {g for _, g in si} | {d for _, d in cp}
    assert not dev_src & dev_dst, ("device", so, si, cp)
    assert not {c for _, c in so} & {c for c, _ in si}, ("cpu", so, si)
    for pairs in (so, si, cp):
        assert len({d for _, d in pairs}) == len(pairs), ("destination twice", pairs)


class _Assembler:
    finished = False
    num_tokens = 0


def _sample(seq_id: str, pos: int) -> int:
    return (len(seq_id) + pos) % 3


class SchedulerMachine(RuleBasedStateMachine):
    prefix_caching = True
    lane_min_running = 0  # the scheduler's loop alone (LaneSchedulerMachine: the lane too)
    depth = 2  # plans in flight

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(12, 6, BS, watermark=0.0, max_pinned_fraction=0.25,
                                 hash_algo="builtin", enable_prefix_caching=self.prefix_caching)
        self.sched = Scheduler(self.kv, SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=12, max_model_len=64,
            preemption_mode=PreemptionMode.AUTO, decode_lane_min_running=self.lane_min_running,
            pipeline_depth=self.depth))
        self.live: dict[str, RequestGroup] = {}
        self.n = 0
        self.step = 0
        self.in_flight: list[dict] = []
        self.sampled_last: set[str] = set()  # samples the last plan sent samples
        # Requests whose every sample finished in a result: the router's text stage removes
        # them after the next plan is sent (step_loop: apply, fill, text stage), so a plan
        # may be scheduled with them still queued (rule `complete`).
        self.to_complete: set[str] = set()
        self.gpu: dict[int, list] = {}
        self.cpu: dict[int, list] = {}
        self.weights = 0  # weight updates so far (router/weight_sync.py): K/V depend on them

    # ------------------------------------------------------------ the router's side

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 2), max_size=6),
          priority=st.integers(0, 2), max_tokens=st.integers(1, 5), n=st.sampled_from([1, 1, 2]))
    def arrive(self, prefix, suffix, priority, max_tokens, n):
        self.n += 1
        rid = f"q{self.n}"
        spec = RequestSpec(rid, tuple(prefix + suffix),
                           SamplingSpec(max_tokens=max_tokens, n=n), priority=priority)
        group = RequestGroup(spec, [_Assembler() for _ in range(n)], self.n)
        seq = group.seqs[0]
        hit = self.kv.lookup(seq.token_ids, self.kv.hash_blocks(seq.token_ids, None,
                                                                seq.block_hashes))
        if hit.block_ids:  # as routing does: pin the cached prefix on the chosen executor
            group.pinned_tokens = self.kv.pin(seq.seq_id, hit).num_tokens
        group.executor_id = "e0"
        self.sched.add(group)
        self.live[rid] = group

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.sched.remove(self.live.pop(rid))
        self.to_complete.discard(rid)

    @precondition(lambda self: len(self.in_flight) < self.depth)
    @rule()
    def send(self):
        kv = self.kv
        out = self.sched.schedule()
        # Routing's count of running samples is exact right after a step is scheduled.
        assert self.sched.num_running_seqs() == self._running_seqs()
        if out.empty:
            kv.end_step()
            return
        self.step += 1
        reads = []
        for item in out.scheduled:
            seq = item.seq
            start = seq.num_computed_tokens - item.num_new_tokens
            reads.append((seq, kv.slot_mapping(seq.seq_id, 0, start).tolist()))
        plan = build_plan(self.step, out, kv, (99,))
        kv.end_step(self.step)
        _check_block_moves(plan)
        ids = plan.request_ids
        if plan.feed_sampled is not None:
            fed = {ids[i] for i in plan.feed_sampled.nonzero()[0].tolist()}
            assert fed <= self.sampled_last, (self.step, sorted(fed - self.sampled_last))
        self.sampled_last = {ids[i] for i in plan.do_sample.nonzero()[0].tolist()}
        self.in_flight.append({"plan": plan, "out": out, "reads": reads})

    @precondition(lambda self: self.in_flight)
    @rule()
    def answer(self):
        """The oldest plan runs on the executor; its result comes back."""
        entry = self.in_flight.pop(0)
        plan, out = entry["plan"], entry["out"]
        gpu, cpu = self.gpu, self.cpu
        for g, c in plan.swap_out.tolist():
            cpu[c] = list(gpu.get(g, [None] * BS))
        for c, g in plan.swap_in.tolist():
            gpu[g] = list(cpu.get(c, [None] * BS))
        for s, d in plan.copy.tolist():
            gpu[d] = list(gpu.get(s, [None] * BS))
        for seq, slots in entry["reads"]:
            if seq.group.request_id not in self.live:
                continue
            for p, slot in enumerate(slots):
                got = gpu.get(slot // BS, [None] * BS)[slot % BS]
                assert got == (self.weights, tuple(seq.token_ids[: p + 1])), (seq.seq_id, p, got)
        t = 0
        slots = plan.slot_mapping.tolist()
        for i, item in enumerate(out.scheduled):
            seq = item.seq
            start = int(plan.num_computed_tokens[i])
            for p in range(start, start + item.num_new_tokens):
                slot = slots[t]
                t += 1
                known = p < len(seq.token_ids)
                gpu.setdefault(slot // BS, [None] * BS)[slot % BS] = \
                    (self.weights, tuple(seq.token_ids[: p + 1])) if known else UNKNOWN
        self.kv.plan_answered(plan.step_id)
        for seq in out.sampled:
            seq.num_pending -= 1
            group = seq.group
            if group.request_id not in self.live or seq.finished:
                continue  # ended meanwhile: the token is dropped
            seq.token_ids.append(_sample(seq.seq_id, len(seq.token_ids)))
            if seq.num_output_tokens >= group.spec.sampling.max_tokens:
                self.sched.finish_seq(seq)
                if all(s.finished for s in group.seqs):
                    self.to_complete.add(group.request_id)

    @precondition(lambda self: self.to_complete)
    @rule()
    def complete(self):
        """The text stage: requests whose samples all finished are removed."""
        for rid in sorted(self.to_complete):
            self.sched.remove(self.live.pop(rid))
        self.to_complete.clear()

    @rule(mode=st.sampled_from(["", "hold", "retract", "freeze"]))
    def hold(self, mode):
        """Admission held for a weight update or a pause (router/weight_sync.py)."""
        self.sched.hold = mode

    @precondition(lambda self: self.sched.hold == "hold" and not self.in_flight
                  and not self.sched.running and not self.sched.swapped)
    @rule()
    def update_weights(self):
        """Nothing runs: new weights, every prefix cache reset. A plan reading a block of
        the old weights after it fails the read check of `answer`."""
        assert self.kv.reset_prefix_cache() == 0
        self.weights += 1

    # ------------------------------------------------------------ checks

    def _running_seqs(self) -> int:
        return sum(len(g.active_seqs()) for g in self.sched.running)

    @invariant()
    def accounting(self):
        # ... and between steps samples only leave the running groups: it is never low.
        assert self.sched.num_running_seqs() >= self._running_seqs()
        self.kv.check_invariants()
        assert self.sched.num_leaked_blocks() == (0, [])
        live_seqs = {s.seq_id for g in self.live.values() for s in g.seqs}
        assert set(self.kv.intent_ids()) <= live_seqs

    def teardown(self):
        self.sched.hold = ""
        for _ in range(400):
            if self.to_complete:
                self.complete()
            if not self.live and not self.in_flight:
                break
            sent = self.step
            if len(self.in_flight) < self.depth and self.live:
                self.send()
            if self.step == sent:  # nothing new to send: the oldest plan's result
                if not self.in_flight:
                    raise AssertionError(f"nothing scheduled for {sorted(self.live)}")
                self.answer()
            self.accounting()
        assert not self.live, f"requests never finished: {sorted(self.live)}"
        assert self.kv.intent_ids() == [] and self.kv.num_intended_tokens == 0
        assert self.kv.num_free_gpu_blocks == self.kv.stats().gpu.num_total_blocks


# 400 runs of 40 rules (~5 s): enough to find, in each of 3 tries, the window `complete`
# models (before cc1bbfb a plan scheduled in it crashed on a finished group; 100 x 30 did not).
SchedulerMachine.TestCase.settings = settings(max_examples=400, stateful_step_count=40,
                                              deadline=None)
TestSchedulerMachine = SchedulerMachine.TestCase


class NoPrefixCachingMachine(SchedulerMachine):
    """The same without prefix caching (no hits, no waits for prefixes): recomputed n > 1
    requests fork again from one computation of their prompt."""

    prefix_caching = False


NoPrefixCachingMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40,
                                                    deadline=None)
TestNoPrefixCachingMachine = NoPrefixCachingMachine.TestCase


class LaneSchedulerMachine(SchedulerMachine):
    """The same with the decode lane planning steady decodes from one running group on
    (router/decode_lane.py): every position a plan reads still holds its tokens."""

    lane_min_running = 1


LaneSchedulerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40,
                                                  deadline=None)
TestLaneSchedulerMachine = LaneSchedulerMachine.TestCase


class Depth3Machine(SchedulerMachine):
    """Three plans in flight: a sample whose token in flight is not the last plan's waits
    for it (the executor feeds marked decodes from the step just before only)."""

    depth = 3


Depth3Machine.TestCase.settings = settings(max_examples=300, stateful_step_count=40,
                                           deadline=None)
TestDepth3Machine = Depth3Machine.TestCase


class Depth3LaneMachine(Depth3Machine):
    """Depth 3 with the decode lane."""

    lane_min_running = 1


Depth3LaneMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40,
                                               deadline=None)
TestDepth3LaneMachine = Depth3LaneMachine.TestCase


class Depth4Machine(SchedulerMachine):
    """Four plans in flight (the deepest --pipeline-depth), the decode lane on."""

    depth = 4
    lane_min_running = 1


Depth4Machine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                           deadline=None)
TestDepth4Machine = Depth4Machine.TestCase


def test_n2_request_whose_prompt_is_cached_but_its_last_token_is_scheduled_when_admitted():
    """Found by the machine: an n = 2 request whose prompt is cached up to its last token
    has nothing of sample 0 to compute. It is forked when admitted and both samples get
    their last prompt token in that same step (before, the step scheduled nothing, and the
    engine looked again only after its idle retry)."""
    machine = SchedulerMachine()
    machine.arrive(max_tokens=1, n=1, prefix=list(PREFIXES[0]), priority=0, suffix=[])
    machine.send()
    machine.answer()
    machine.send()
    machine.answer()
    machine.complete()
    machine.arrive(max_tokens=1, n=2, prefix=list(PREFIXES[0]), priority=0, suffix=[0])
    out = machine.sched.schedule()
    group = machine.live["q2"]
    assert group.forked and [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [
        ("q2#0", 1), ("q2#1", 1)]
    assert [(p.seq_id, c.seq_id) for p, c in out.forks] == [("q2#0", "q2#1")]
    assert [s.num_computed_tokens for s in group.seqs] == [9, 9]
    machine.kv.end_step()
    machine.kv.check_invariants()
