"""The router's pipelined step loop, in process, against a simulated executor that answers
plans exactly when the test says so.

`SimExecutor` plays the executor's side of the protocol: it keeps each request's output
tokens, feeds every marked decode the token it sampled itself in the previous step (and
checks that it did sample one there), and samples a deterministic token per (request,
output position), so any lost, duplicated or reordered token shows in the outputs. Tests
hold plans unanswered to reach the states of issue 11: late stops with plans in flight,
aborts, preemption with a token in flight, forks, failed steps. KV invariants are checked
after every plan (`debug_checks`).
"""

from __future__ import annotations

import asyncio

import pytest
from pagedserve.protos import wire
from pagedserve.router.engine import EngineConfig
from pagedserve.router.scheduler import PreemptionMode
from pipeline_rig import (
    BS,
    EOS,
    SimExecutor,
    expected,
    free_blocks,
    make_engine,
    run,
    settle,
    sim_token,
    submit,
)

# ---------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_outputs_identical_at_depths_1_to_4_with_plans_in_flight(depth):
    async def main():
        engine, ex = make_engine(depth)
        a = await submit(engine, "a", [1, 2, 3, 4, 5], max_tokens=9)
        b = await submit(engine, "b", [6, 7], max_tokens=5)
        await ex.wait_plans(1)
        if depth >= 2:
            await ex.wait_plans(depth)  # plans 2 to depth left before plan 1 was answered
            for k, plan in enumerate(ex.unanswered()[1:], start=1):
                assert plan.feed_sampled.tolist() == [1, 1]
                assert plan.token_ids.tolist() == [-1, -1]
                assert plan.positions.tolist() == [4 + k, 1 + k]
        else:
            await asyncio.sleep(0.01)
            assert len(ex.unanswered()) == 1
        await ex.run_until_done([a, b])
        assert a.tokens() == expected("a#0", 9) and b.tokens() == expected("b#0", 5)
        assert a.finish().finish_reason == "length" and a.usage.completion_tokens == 9
        while ex.unanswered():  # a plan that only drops the finished requests
            assert not ex.unanswered()[0].request_ids
            await ex.answer()
        assert free_blocks(engine) == (64, 64)
    run(main())


def test_late_eos_streams_nothing_extra_and_frees_blocks_after_the_last_plan():
    async def main():
        engine, ex = make_engine(2)
        ex.overrides[("a#0", 1)] = EOS  # the second output token is EOS
        a = await submit(engine, "a", [1, 2, 3], max_tokens=10)
        await ex.answer()  # plan 1 (prefill) -> token 0; plans 2 and 3 go out
        await ex.wait_plans(2)
        await ex.answer()  # plan 2 -> EOS: plan 3 (in flight) still decodes a
        assert a.done and a.tokens() == [sim_token("a#0", 0), EOS]
        assert a.finish().finish_reason == "stop" and a.usage.completion_tokens == 2
        assert a.finish().stop_token_id == EOS
        held = free_blocks(engine)
        assert held[0] < 64 and held[1] == 64  # a's blocks wait for plan 3's result
        plan3 = ex.unanswered()[0]
        assert plan3.request_ids == ["a#0"] and plan3.feed_sampled.tolist() == [1]
        await ex.answer()  # its token for a is dropped
        assert a.tokens() == [sim_token("a#0", 0), EOS] and a.usage.completion_tokens == 2
        assert free_blocks(engine) == (64, 64)
        assert "pagedserve_generation_tokens_total 2.0" in engine.metrics.render().decode()
    run(main())


def test_late_stop_string_streams_nothing_extra():
    async def main():
        engine, ex = make_engine(2)
        # Output tokens 0..: 'S' 'T' then anything; the stop string "ST" is found by the
        # text stage after plans 3 and 4 already carry a's decodes.
        s, t = ord("S") - 65, ord("T") - 65
        ex.overrides[("a#0", 0)] = s
        ex.overrides[("a#0", 1)] = t
        a = await submit(engine, "a", [1, 2, 3], max_tokens=10, stop=("ST",))
        await ex.answer(2)
        assert a.done and a.text() == "" and a.finish().stop_string == "ST"
        assert a.finish().finish_reason == "stop" and a.usage.completion_tokens == 2
        assert a.tokens() == [s, t]
        while ex.unanswered():
            await ex.answer()
        assert a.tokens() == [s, t] and a.usage.completion_tokens == 2
        assert free_blocks(engine) == (64, 64)
    run(main())


def test_abort_with_two_plans_in_flight():
    async def main():
        engine, ex = make_engine(2)
        a = await submit(engine, "a", [1, 2, 3, 4, 5, 6], max_tokens=20)
        b = await submit(engine, "b", [7, 8], max_tokens=4)
        await ex.answer()
        await ex.wait_plans(2)
        assert engine.abort("a")
        await settle()
        assert a.done and a.finish().finish_reason == "abort"
        n_before = len(a.tokens())
        assert free_blocks(engine)[0] < 64  # held for the plans in flight
        await ex.run_until_done([b])
        while ex.unanswered():
            await ex.answer()
        assert len(a.tokens()) == n_before and b.tokens() == expected("b#0", 4)
        assert any("a#0" in p.finished_ids for p in ex.plans)
        await settle()
        assert free_blocks(engine) == (64, 64)
    run(main())


@pytest.mark.parametrize("mode", [PreemptionMode.RECOMPUTE, PreemptionMode.SWAP])
def test_preemption_with_a_token_in_flight_keeps_that_token(mode):
    """Six blocks of 4 tokens: a and b grow until one must be preempted while the plan
    before carries its decode; its output stays token-exact."""
    async def main():
        engine, ex = make_engine(2, num_gpu_blocks=6, num_cpu_blocks=8, mode=mode)
        a = await submit(engine, "a", [1, 2, 3], max_tokens=14)
        b = await submit(engine, "b", [4, 5, 6], max_tokens=14)
        await ex.run_until_done([a, b])
        assert a.tokens() == expected("a#0", 14) and b.tokens() == expected("b#0", 14)
        kinds = engine.executors["e0"].scheduler.num_preemptions
        assert kinds[mode] >= 1
        # The victim was preempted while the plan before the preempting one sampled it.
        for k, plan in enumerate(ex.plans[1:], start=1):
            dropped_or_swapped = set(plan.finished_ids) or plan.swap_out.shape[0]
            if dropped_or_swapped and set(ex.plans[k - 1].request_ids) & {"a#0", "b#0"}:
                break
        else:
            raise AssertionError("no preemption with a plan in flight")
        await settle()
        assert free_blocks(engine) == (6, 6)
    run(main())


def test_fork_planned_while_the_parent_prefill_is_in_flight():
    async def main():
        engine, ex = make_engine(2)
        c = await submit(engine, "c", [1, 2, 3, 4, 5, 6], max_tokens=5, n=3)
        await ex.wait_plans(2)
        plan1, plan2 = ex.unanswered()[:2]
        assert plan1.request_ids == ["c#0"] and plan1.do_sample.tolist() == [0]
        assert [(f.parent_id, f.child_id) for f in plan2.forks] == [("c#0", "c#1"),
                                                                    ("c#0", "c#2")]
        await ex.run_until_done([c])
        for i in range(3):
            assert c.tokens(i) == expected(f"c#{i}", 5)
        assert c.usage.completion_tokens == 15
    run(main())


def test_failed_step_with_the_next_plan_in_flight_fails_its_requests_once():
    async def main():
        engine, ex = make_engine(2)
        a = await submit(engine, "a", [1, 2, 3], max_tokens=10)
        await ex.answer()
        await ex.wait_plans(2)
        plan2 = ex.unanswered()[0]
        ex.answered += 1
        engine.steps.on_result("e0", wire.StepResult(
            step_id=plan2.step_id, executor_id="e0",
            errors=[wire.RequestError("", "CUDA error: an illegal memory access")]))
        await settle()
        assert a.done and a.error is not None and "failed" in str(a.error)
        assert not engine.executors["e0"].healthy
        resets = [m for m in engine.link.sent if isinstance(m, wire.Shutdown)]
        assert len(resets) == 1 and not resets[0].exit
        # The executor's answer to plan 3 (its marked decode errors: no sample in plan 2)
        # arrives later and is ignored.
        plan3 = ex.unanswered()[0]
        result3 = ex.result_for(plan3)
        assert [e.request_id for e in result3.errors] == ["a#0"]
        assert engine.steps.on_result("e0", result3) is False
    run(main())


def test_request_error_in_step_n_fails_it_once_and_the_next_plan_error_is_ignored():
    async def main():
        engine, ex = make_engine(2)
        a = await submit(engine, "a", [1, 2, 3], max_tokens=10)
        b = await submit(engine, "b", [4, 5, 6], max_tokens=6)
        await ex.answer()
        await ex.wait_plans(2)
        plan2 = ex.unanswered()[0]
        result = ex.result_for(plan2)
        keep = [i for i, r in enumerate(result.request_ids) if r != "a#0"]
        ex.last.pop("a#0")
        ex.answered += 1
        engine.steps.on_result("e0", wire.StepResult(
            step_id=plan2.step_id, executor_id="e0",
            request_ids=[result.request_ids[i] for i in keep],
            token_ids=result.token_ids[keep], errors=[wire.RequestError("a#0", "bad slot")]))
        await settle()
        assert a.done and a.error is not None
        await ex.run_until_done([b])
        assert b.tokens() == expected("b#0", 6)
        while ex.unanswered():
            await ex.answer()
        assert engine.executors["e0"].healthy
        await settle()
        assert free_blocks(engine) == (64, 64)
    run(main())


def test_executor_lost_with_two_plans_in_flight_resumes_from_the_last_received_token():
    async def main():
        engine, ex = make_engine(2)
        a = await submit(engine, "a", [1, 2, 3], max_tokens=8)
        await ex.answer(3)
        await ex.wait_plans(2)
        received = len(engine.live["a"].seqs[0].token_ids) - 3
        hello = wire.Hello(executor_id="e1", model_fingerprint="fp", device="cpu",
                           dtype="float32", block_size=BS, num_gpu_blocks=64,
                           num_cpu_blocks=8, max_model_len=128)
        engine.membership.on_hello(b"e1", hello)
        ex2 = SimExecutor(engine, "e1")
        assert 'pagedserve_kv_blocks_free{executor="e0"}' in _metrics(engine)
        engine.membership.executor_lost(engine.executors["e0"], "killed")
        await ex2.wait_plans(1)
        new = ex2.unanswered()[0].new_requests[0]
        assert new.request_id == "a#0" and len(new.output_token_ids) == received
        await ex2.run_until_done([a])
        assert a.tokens() == expected("a#0", 8)
        # the lost executor's gauges are gone (its counters stay); e1's are there
        text = _metrics(engine)
        assert 'executor="e0"' not in "".join(
            line for line in text.splitlines() if line.startswith(
                ("pagedserve_kv_", "pagedserve_requests_")))
        assert 'pagedserve_kv_blocks_free{executor="e1"}' in text
    run(main())


def _metrics(engine) -> str:
    engine.update_gauges(next(iter(h for h in engine.executors.values() if h.healthy)))
    return engine.metrics.render().decode()


def test_overdue_plan_makes_the_executor_dead_and_its_requests_migrate():
    async def main():
        engine, ex = make_engine(2, step_timeout_s=0.05, heartbeat_timeout_s=60)
        hung = []
        engine.membership.on_hung = lambda eid, why: hung.append((eid, why))
        monitor = asyncio.ensure_future(engine.membership.monitor_loop())
        try:
            await submit(engine, "a", [1, 2, 3], max_tokens=8)
            await ex.wait_plans(2)
            assert ex.unanswered()[0].deadline_s > 0.05  # warm-up plans get more
            for _ in range(200):
                if hung:
                    break
                await asyncio.sleep(0.01)
            assert hung and hung[0][0] == "e0" and "unanswered" in hung[0][1]
            assert not engine.executors["e0"].healthy
        finally:
            monitor.cancel()
    run(main())


def test_scheduler_at_depth_2_with_the_benchmark_fake_and_eos_positions():
    """The router core without asyncio (as scheduler_bench drives it) at depth 2: plans are
    built one ahead of the results, the benchmark fake feeds marked decodes and samples EOS
    at output position 6; every request ends there, under KV pressure (preemptions), with
    no protocol violation, and every block is free at the end."""
    import sys
    from dataclasses import replace
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from fake_executor import PipelinedFake, ResultApplier, make_groups
    from pagedserve.kvmanager import KVCacheManager
    from pagedserve.router.plan_builder import build_plan
    from pagedserve.router.scheduler import Scheduler, SchedulerConfig
    from pagedserve.router.sequence import RequestGroup

    eos = 5
    kv = KVCacheManager(24, 16, BS, watermark=0.0)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=32, max_model_len=128))
    applier = ResultApplier(sched, 128, eos_token_ids=(eos,))
    for g in make_groups([[7 + i, 8, 9 + i, 10, 11] for i in range(12)], max_tokens=20):
        spec = g.spec
        g = RequestGroup(replace(spec, sampling=replace(spec.sampling, ignore_eos=False)),
                         [g.seqs[0].assembler], g.sort_key[1])
        applier.add(g)
    fake = PipelinedFake(eos_token_id=eos, eos_at=6)
    in_flight: list = []
    step = marked = 0
    for _ in range(400):
        while len(in_flight) < 2:
            out = sched.schedule()
            if out.empty:
                kv.end_step()
                break
            step += 1
            plan = build_plan(step, out, kv, (eos,))
            marked += int(plan.feed_sampled is not None)
            fake.receive(plan)
            kv.end_step(step)
            in_flight.append((step, out.sampled))
        if not in_flight:
            break
        done_step, sampled = in_flight.pop(0)
        result = fake.answer()
        assert result.step_id == done_step and not result.errors
        kv.plan_answered(done_step)
        applier.apply(result, sampled)
        kv.check_invariants()
    assert not applier.live and applier.num_finished == 12 and not fake.violations
    assert applier.num_tokens == 12 * 7 and marked > 10  # each ended at its EOS
    assert sum(sched.num_preemptions.values()) > 0
    assert kv.num_free_gpu_blocks == 24


def test_the_periodic_invariant_check_takes_a_bounded_share_of_the_loop(monkeypatch):
    """The O(blocks) KV invariant check runs at most INVARIANT_CPU_SHARE of the time (a
    100 ms check: again after 50 s, not every 5 s); leaks are still counted every interval;
    with debug_checks it runs after every step."""
    from types import SimpleNamespace

    from pagedserve.router import step_loop

    clock = {"now": 1000.0, "perf": 0.0}
    checks: list[float] = []
    leak_counts: list[float] = []

    class KV:
        def check_invariants(self):
            checks.append(clock["now"])
            clock["perf"] += 0.1  # what the check cost

    def leaked():
        leak_counts.append(clock["now"])
        return 0, []

    monkeypatch.setattr(step_loop, "time", SimpleNamespace(
        monotonic=lambda: clock["now"], perf_counter=lambda: clock["perf"]))
    config = EngineConfig(model_fingerprint="x", invariant_check_interval_s=5.0)
    loop = step_loop.StepLoop(SimpleNamespace(config=config, metrics=None,
                                              info=SimpleNamespace(vocab_size=64)))
    handle = SimpleNamespace(id="e0", kv=KV(), scheduler=SimpleNamespace(
        num_leaked_blocks=leaked), last_check=0.0, next_full_check=0.0, num_leaked_blocks=0)
    for t in (1000.0, 1001.0, 1006.0, 1030.0, 1049.0, 1055.0, 1056.0):
        clock["now"] = t
        loop.check_accounting(handle)
    assert checks == [1000.0, 1055.0]  # the first interval tick 50 s after a 0.1 s check
    assert leak_counts == [1000.0, 1006.0, 1030.0, 1049.0, 1055.0]  # every 5 s
    config.debug_checks = True
    clock["now"] = 1056.5
    loop.check_accounting(handle)
    assert checks[-1] == 1056.5


@pytest.mark.parametrize("mode", [PreemptionMode.RECOMPUTE, PreemptionMode.SWAP])
def test_a_preempted_request_whose_token_in_flight_ends_it_is_not_admitted(mode):
    """Preempted with its last token in flight: when that token arrives the request's only
    sample is finished, and the plan sent before the text stage completes the request must
    pass the group over in the waiting/swapped queue (it crashed the step loop: IndexError
    in _admit_waiting, found by http_soak.py with 30 blocks). The two requests outgrow the
    6 blocks at about 10 tokens each; every pair of lengths around that puts the preemption
    at a different point."""
    async def main(len_a, len_b):
        engine, ex = make_engine(2, num_gpu_blocks=6, num_cpu_blocks=8, mode=mode)
        a = await submit(engine, "a", [1, 2, 3], max_tokens=len_a)
        b = await submit(engine, "b", [4, 5, 6], max_tokens=len_b)
        await ex.run_until_done([a, b])
        assert engine.executors["e0"].healthy, (len_a, len_b)
        assert a.tokens() == expected("a#0", len_a)
        assert b.tokens() == expected("b#0", len_b)
        while ex.unanswered():  # plans sent before the last results came back
            await ex.answer()
        await settle()
        assert free_blocks(engine) == (6, 6), (len_a, len_b)

    for len_a in range(6, 16):
        for len_b in range(6, 16):
            run(main(len_a, len_b))


def test_without_prefix_caching_a_recomputed_n2_request_shares_its_prompt_again():
    """No prefix caching, recompute preemption: the two samples of an n = 2 request hold
    one copy of their prompt only because they forked from one computation of it. Recomputed,
    they fork again (sample 0 recomputes the prompt); with n copies this request (5 prompt
    blocks, 3 more per sample) would need 14 of the 12 blocks and swap or recompute itself
    for ever. Here it finishes token-exact beside the request that preempted it."""
    async def main():
        engine, ex = make_engine(2, num_gpu_blocks=12, num_cpu_blocks=0,
                                 mode=PreemptionMode.RECOMPUTE, enable_prefix_caching=False)
        a = await submit(engine, "a", [1, 2, 3, 4, 5, 6, 7], max_tokens=14)
        b = await submit(engine, "b", list(range(8, 28)), max_tokens=6, n=2,
                         temperature=1.0, seed=3)
        await ex.run_until_done([a, b], max_steps=400)
        assert engine.executors["e0"].healthy
        sched = engine.executors["e0"].scheduler
        assert sched.num_preemptions[PreemptionMode.RECOMPUTE] >= 1
        assert a.tokens() == expected("a#0", 14)
        assert b.tokens(0) == expected("b#0", 6) and b.tokens(1) == expected("b#1", 6)
        while ex.unanswered():
            await ex.answer()
        await settle()
        assert free_blocks(engine) == (12, 12)
    run(main())


def test_the_step_trace_is_complete_once_the_engine_stops(monkeypatch, tmp_path):
    """`PAGEDSERVE_STEP_TRACE`: one line per answered plan, all written out at the engine's
    stop (the router freezes its start-up objects out of the collector, so the trace's
    buffered last lines would otherwise never be flushed)."""
    import json

    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("PAGEDSERVE_STEP_TRACE", str(path))

    async def main():
        engine, ex = make_engine(2)
        a = await submit(engine, "a", [1, 2, 3], max_tokens=6)
        await ex.run_until_done([a])
        answered = ex.answered
        await engine.stop()
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        assert [x["step_id"] for x in lines] == list(range(1, answered + 1))
        assert sum(x["num_sampled"] for x in lines) >= 6

    run(main())


def test_a_busy_loop_refreshes_gauges_at_most_each_interval_and_exactly_when_idle(monkeypatch):
    """Gauges cost tens of µs a step: while results keep coming they are refreshed at most
    every GAUGE_INTERVAL_S; when the loop runs out of plans they are refreshed at once."""
    from pagedserve.router import step_loop
    monkeypatch.setattr(step_loop, "GAUGE_INTERVAL_S", 3600.0)

    async def main():
        engine, ex = make_engine(2)
        value = engine.metrics.registry.get_sample_value
        labels = {"executor": "e0"}
        calls = []
        update = engine.update_gauges
        engine.update_gauges = lambda handle: (calls.append(1), update(handle))
        a = await submit(engine, "a", [1, 2, 3, 4, 5], max_tokens=12)
        b = await submit(engine, "b", [6, 7], max_tokens=12)
        await ex.wait_plans(2)
        await ex.answer()
        await ex.answer()
        await settle()
        busy = len(calls)
        assert busy <= 2  # once after the first result (the interval starts), not per step
        assert value("pagedserve_requests_running", labels) == 2
        await ex.run_until_done([a, b])
        while ex.unanswered():
            await ex.answer()
        await settle()
        assert len(calls) - busy <= 2  # the idle refresh, not one per answered step
        assert value("pagedserve_requests_running", labels) == 0
        assert value("pagedserve_kv_cache_usage_ratio", labels) == 0.0  # every block free
        assert free_blocks(engine) == (64, 64)
    run(main())
