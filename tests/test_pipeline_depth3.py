"""Pipeline depth 3 at the scheduler: a sample whose token in flight comes from a plan
older than the last one sent waits for it (the executor feeds a marked decode only from
the step just before). Exact expectations on what each plan schedules and marks."""

from __future__ import annotations

from pagedserve.kvmanager import KVCacheManager
from pagedserve.router.plan_builder import build_plan
from pagedserve.router.scheduler import Scheduler, SchedulerConfig
from pagedserve.router.sequence import RequestGroup
from pagedserve.router.types import RequestSpec, SamplingSpec


class _Assembler:
    finished = False
    num_tokens = 0


def _group(rid: str, prompt: list[int], arrival: int, priority: int) -> RequestGroup:
    spec = RequestSpec(rid, tuple(prompt), SamplingSpec(max_tokens=50), priority=priority)
    group = RequestGroup(spec, [_Assembler()], arrival)
    group.executor_id = "e0"
    return group


class _Rig:
    def __init__(self, depth: int) -> None:
        self.kv = KVCacheManager(64, 0, 4, watermark=0.0, debug_checks=True,
                                 enable_prefix_caching=False)
        self.sched = Scheduler(self.kv, SchedulerConfig(
            max_num_batched_tokens=4, max_model_len=128, pipeline_depth=depth,
            decode_lane_min_running=0))
        self.in_flight: list = []
        self.step = 0

    def send(self) -> list[tuple[str, int, int, int]]:
        """Schedule and send a plan: (sample, first position, tokens, marked) per row."""
        out = self.sched.schedule()
        self.step += 1
        plan = build_plan(self.step, out, self.kv, (99,))
        self.kv.end_step(self.step)
        self.in_flight.append((plan, out))
        feed = plan.feed_sampled if plan.feed_sampled is not None else [0] * plan.num_seqs
        return [(rid, int(plan.num_computed_tokens[i]), int(plan.num_new_tokens[i]),
                 int(feed[i])) for i, rid in enumerate(plan.request_ids)]

    def answer(self) -> None:
        """The oldest plan's result: token 5 for every sample it sampled."""
        plan, out = self.in_flight.pop(0)
        self.kv.plan_answered(plan.step_id)
        for seq in out.sampled:
            seq.num_pending -= 1
            seq.token_ids.append(5)


def _skipping_run(depth: int) -> list:
    """`a` (priority 1) decodes; `p` (priority 0, a 10-token prompt) arrives and its chunks
    take the 4-token budget, so `a` sits out a plan while its token from the plan before is
    still in flight. Plans are sent until `depth` are in flight, then the oldest is
    answered, three times over."""
    rig = _Rig(depth)
    rig.sched.add(_group("a", [1, 2, 3], 1, priority=1))
    plans = [rig.send()]  # a's prompt
    rig.answer()
    plans.append(rig.send())  # a decodes its first output token (known)
    rig.sched.add(_group("p", list(range(10, 20)), 2, priority=0))
    for _ in range(3):
        while len(rig.in_flight) < depth:
            plans.append(rig.send())
        rig.answer()
    return plans


def test_a_sample_that_sat_out_the_last_plan_waits_for_its_older_token_at_depth_3():
    assert _skipping_run(3) == [
        [("a#0", 0, 3, 0)],
        [("a#0", 3, 1, 0)],  # its first output token is known here: not marked
        # a's token of the plan before is fed (marked); p is admitted behind it
        [("a#0", 4, 1, 1), ("p#0", 0, 3, 0)],
        # p (higher priority) takes the budget: a sits out, its token in flight
        [("p#0", 3, 4, 0)],
        # budget for a again, but its token in flight is from 2 plans back, which the
        # executor cannot feed (it feeds from the step just before): a waits
        # (without the rule: ("a#0", 5, 1, 1) here, an error on the executor)
        [("p#0", 7, 3, 0)],
        # that token is back: a decodes it as a known token
        [("p#0", 10, 1, 1), ("a#0", 5, 1, 0)],
    ]


def test_at_depth_2_the_token_in_flight_always_comes_from_the_last_plan():
    # The same arrivals at depth 2: the plan after the one a sat out is built only once
    # a's older token is back, so nothing waits.
    assert _skipping_run(2) == [
        [("a#0", 0, 3, 0)],
        [("a#0", 3, 1, 0)],
        [("a#0", 4, 1, 1), ("p#0", 0, 3, 0)],
        [("p#0", 3, 4, 0)],
        [("p#0", 7, 3, 0), ("a#0", 5, 1, 0)],
    ]
