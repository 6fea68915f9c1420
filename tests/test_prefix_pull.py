"""Prefix pulls (router/prefix_pull.py) in process: two simulated executors (pipeline_rig)
that answer `kv_export` with bytes naming each block, round-robin routing so a request's
prefix is on the other executor, and the exact blocks, bytes, holds and plans of each move;
then every way a pull ends early (abort, source lost, target lost). KV invariants are
checked after every plan (`debug_checks`)."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
from pagedserve.protos import wire
from pagedserve.router.engine import EngineConfig, RouterEngine
from pagedserve.router.routing import RoutingPolicy
from pagedserve.router.types import ModelInfoData
from pipeline_rig import (
    BS,
    EOS,
    CharTokenizer,
    FakeLink,
    SimExecutor,
    expected,
    run,
    submit,
)

BLOCK_BYTES = 8
PROMPT = list(range(1, 1 + 6 * BS))  # six full blocks
TAIL = [40, 41, 42]


def block_bytes(executor_id: str, block_id: int) -> np.ndarray:
    """What simulated executor `executor_id` exports for its device block `block_id`."""
    return np.full(BLOCK_BYTES, (block_id * 7 + (3 if executor_id == "e0" else 5)) % 256,
                   np.uint8)


class PullSim(SimExecutor):
    """SimExecutor that exports bytes naming each block and takes 1 ms a step plus 1 ms a
    token (so routing learns that computing a prompt costs time)."""

    def result_for(self, plan: wire.StepPlan) -> wire.StepResult:
        result = super().result_for(plan)
        fields = {"forward_s": 1e-3 + 1e-3 * int(plan.num_new_tokens.sum())}
        if plan.kv_export is not None:
            fields["kv_export_data"] = np.concatenate(
                [block_bytes(self.id, int(b)) for b in plan.kv_export])
        return msgspec.structs.replace(result, **fields)


def make_cluster(depth: int = 2, modes: tuple[str, str] = ("null", "null"),
                 **cfg) -> tuple[RouterEngine, PullSim, PullSim]:
    """Engine and executors e0, e1 (`modes`: their disaggregation modes); `cfg`:
    EngineConfig's fields over round-robin routing with pulls on."""
    config = EngineConfig(model_fingerprint="fp", block_size=BS, max_model_len=128,
                          pipeline_depth=depth, debug_checks=True, watermark=0.0,
                          **{"routing": RoutingPolicy.ROUND_ROBIN, "kv_pull": True, **cfg})
    info = ModelInfoData("m", "LlamaForCausalLM", 128, 64, BS, "float32", (EOS,))
    engine = RouterEngine(config, CharTokenizer(), info)
    engine.link = FakeLink()
    sims = []
    for name, mode in zip(("e0", "e1"), modes, strict=True):
        hello = wire.Hello(executor_id=name, model_fingerprint="fp", device="cpu",
                           dtype="float32", block_size=BS, num_gpu_blocks=64,
                           num_cpu_blocks=16, max_model_len=128, kv_format="f32:test",
                           kv_block_bytes=BLOCK_BYTES, disaggregation_mode=mode)
        assert engine.membership.on_hello(name.encode(), hello).accepted
        sims.append(PullSim(engine, name))
    return engine, sims[0], sims[1]


def all_free(engine) -> bool:
    if engine.pulls.active:
        return False
    for h in engine.executors.values():
        st = h.kv.stats()
        if st.gpu.num_free_blocks != 64 or h.kv._holds or h.pulls:
            return False
    return True


async def warm(engine, e0: PullSim, prompt: list[int] = PROMPT) -> list[int]:
    """Request w on e0 (round-robin's first turn): its prompt's blocks end up cached there.
    Returns their ids."""
    w = await submit(engine, "w", prompt + [50], max_tokens=2)
    await e0.run_until_done([w])
    while e0.unanswered():
        await e0.answer()
    kv = engine.executors["e0"].kv
    hashes = kv.hash_blocks(prompt + TAIL)
    return list(kv.lookup(prompt + TAIL, hashes).block_ids)


def test_a_request_on_the_executor_lacking_its_prefix_receives_those_blocks():
    async def main():
        engine, e0, e1 = make_cluster()
        cached = await warm(engine, e0)
        assert len(cached) == 6
        b = await submit(engine, "b", PROMPT + TAIL, max_tokens=3)  # turn 2: e1
        group = engine.live["b"]
        h0 = engine.executors["e0"]
        assert group.executor_id == "e1" and group.pull is not None
        assert group.pull.block_ids == tuple(cached) and group.pull.first == 0
        assert h0.kv._holds[group.pull] == tuple(cached)
        for bid in cached:  # held: out of e0's free queue, ref count 1
            assert h0.kv.gpu.blocks[bid].ref_cnt == 1
        await e0.wait_plans(1)
        await asyncio.sleep(0.12)  # e1 looks again (RETRY_S) and plans nothing for b
        assert not e1.unanswered()
        export = e0.unanswered()[0]
        assert export.kv_export.tolist() == cached and export.num_seqs == 0
        await e0.answer()
        assert group.pull is None and not h0.kv._holds
        await e1.wait_plans(1)
        plan = e1.unanswered()[0]
        cpu_ids = plan.kv_import.tolist()
        assert len(cpu_ids) == 6
        assert plan.kv_import_data.tobytes() == b"".join(
            block_bytes("e0", bid).tobytes() for bid in cached)
        assert sorted(plan.swap_in[:, 0].tolist()) == sorted(cpu_ids)  # imports, swapped in
        assert plan.request_ids == ["b#0"] and plan.num_new_tokens.tolist() == [3]
        # the cost model pairs the plan's swap_s with the blocks received and swapped in
        assert engine.executors["e1"].in_flight[0].num_blocks_moved == 6 + 6
        await e1.run_until_done([b])
        assert b.tokens() == expected("b#0", 3)
        assert b.usage.cached_prompt_tokens == 6 * BS
        await drain(engine, e0, e1)
        assert all_free(engine)
        text = engine.metrics.render().decode()
        assert 'pagedserve_kv_pulls_total{executor="e1"} 1.0' in text
        assert 'pagedserve_kv_blocks_received_total{executor="e1"} 6.0' in text
    run(main())


def test_an_export_that_sends_no_bytes_leaves_the_prefix_to_compute(caplog):
    """The source's export failed (executor/model_runner.py `_export`: a result without
    bytes): the request computes its whole prompt on the target, nothing is imported, and
    the router says why."""
    async def main():
        engine, e0, e1 = make_cluster()
        await warm(engine, e0)
        e0.result_for = lambda plan: msgspec.structs.replace(
            PullSim.result_for(e0, plan), kv_export_data=None)
        b = await submit(engine, "b", PROMPT + TAIL, max_tokens=3)
        assert engine.live["b"].pull is not None
        await e0.wait_plans(1)
        await e0.answer()
        await e1.wait_plans(1)
        plan = e1.unanswered()[0]
        assert plan.kv_import is None and plan.num_new_tokens.tolist() == [len(PROMPT) + 3]
        await e1.run_until_done([b])
        assert b.tokens() == expected("b#0", 3) and b.usage.cached_prompt_tokens == 0
        await drain(engine, e0, e1)
        assert all_free(engine)
        assert "pagedserve_kv_pulls_total{" not in engine.metrics.render().decode()
    run(main())
    assert "executor e0 sent no KV bytes for 6 blocks" in caplog.text


def test_no_pull_when_off_or_nothing_is_cached_elsewhere():
    async def main():
        engine, e0, e1 = make_cluster()
        a = await submit(engine, "a", PROMPT + TAIL, max_tokens=2)  # e0: nothing anywhere
        assert engine.live["a"].pull is None
        b = await submit(engine, "b", [9, 8, 7, 6, 5, 4, 3, 2, 1], max_tokens=2)  # e1
        assert engine.live["b"].pull is None
        await asyncio.gather(e0.run_until_done([a]), e1.run_until_done([b]))
        engine.pulls.enabled = False
        c = await submit(engine, "c", PROMPT + [33, 34], max_tokens=2)  # e0
        d = await submit(engine, "d", PROMPT + [35, 36], max_tokens=2)  # e1: would pull
        assert engine.live["d"].pull is None
        await asyncio.gather(e0.run_until_done([c]), e1.run_until_done([d]))
        assert d.usage.cached_prompt_tokens == 0
    run(main())


async def drain(engine, *sims) -> None:
    for _ in range(200):
        if not any(s.unanswered() for s in sims if engine.executors[s.id].healthy):
            await asyncio.sleep(0.06)
            if not any(s.unanswered() for s in sims if engine.executors[s.id].healthy):
                return
        for s in sims:
            if s.unanswered() and engine.executors[s.id].healthy:
                await s.answer()
    raise AssertionError("plans kept coming")


def test_an_aborted_request_ends_its_pull_and_the_hold():
    async def main():
        engine, e0, e1 = make_cluster()
        await warm(engine, e0)
        b = await submit(engine, "b", PROMPT + TAIL, max_tokens=3)
        assert engine.live["b"].pull is not None
        assert engine.abort("b")
        await drain(engine, e0, e1)
        assert b.done and all_free(engine)
        assert not engine.executors["e1"].imports
    run(main())


def test_the_source_lost_mid_pull_the_request_computes_its_prompt():
    async def main():
        engine, e0, e1 = make_cluster()
        await warm(engine, e0)
        b = await submit(engine, "b", PROMPT + TAIL, max_tokens=3)
        await e0.wait_plans(1)  # the export is in flight
        engine.membership.executor_lost(engine.executors["e0"], "test")
        assert engine.live["b"].pull is None
        await e1.wait_plans(1)
        plan = e1.unanswered()[0]
        assert plan.kv_import is None and plan.num_new_tokens.tolist() == [len(PROMPT) + 3]
        await e1.run_until_done([b])
        assert b.tokens() == expected("b#0", 3) and b.usage.cached_prompt_tokens == 0
        await drain(engine, e1)
        assert engine.executors["e1"].kv.stats().gpu.num_free_blocks == 64
    run(main())


def test_the_source_lost_while_its_export_result_is_applied():
    """The plan exporting the blocks is answered, but applying its result fails (the step
    loop counts e0 lost after taking the plan off its queue): the request on e1 is not left
    waiting for a pull that will never end; it computes its prompt."""
    async def main():
        engine, e0, e1 = make_cluster()
        await warm(engine, e0)
        b = await submit(engine, "b", PROMPT + TAIL, max_tokens=3)
        await e0.wait_plans(1)
        steps = engine.steps
        real = steps.apply_result

        def broken(handle, plan, result):
            if handle.id == "e0":
                raise RuntimeError("test: applying e0's result fails")
            return real(handle, plan, result)

        steps.apply_result = broken
        await e0.answer()
        assert not engine.executors["e0"].healthy and engine.live["b"].pull is None
        assert not engine.pulls.active
        await e1.run_until_done([b])
        assert b.tokens() == expected("b#0", 3) and b.usage.cached_prompt_tokens == 0
        await drain(engine, e1)
        assert engine.executors["e1"].kv.stats().gpu.num_free_blocks == 64
    run(main())


def test_the_target_lost_mid_pull_the_request_migrates_and_the_hold_ends():
    async def main():
        engine, e0, e1 = make_cluster()
        await warm(engine, e0)
        b = await submit(engine, "b", PROMPT + TAIL, max_tokens=3)
        pull = engine.live["b"].pull
        await e0.wait_plans(1)
        engine.membership.executor_lost(engine.executors["e1"], "test")
        group = engine.live["b"]
        assert group.executor_id == "e0" and group.pull is None  # its cache is there
        await e0.answer()  # the export's result: nothing imported anywhere
        assert not engine.executors["e0"].kv._holds and pull.group.pull is None
        await e0.run_until_done([b])
        assert b.tokens() == expected("b#0", 3) and b.usage.cached_prompt_tokens == 6 * BS
        await drain(engine, e0)
        assert engine.executors["e0"].kv.stats().gpu.num_free_blocks == 64
    run(main())


def test_two_requests_pulling_one_prefix_import_it_once():
    async def main():
        engine, e0, e1 = make_cluster()
        cached = await warm(engine, e0)
        await submit(engine, "x", [60, 61], max_tokens=1)  # turn 2: e1 (not a pull)
        b = await submit(engine, "b", PROMPT + TAIL, max_tokens=2)  # turn 3: e0, cached
        c = await submit(engine, "c", PROMPT + [44, 45], max_tokens=2)  # turn 4: e1, pulls
        assert engine.live["b"].pull is None and engine.live["c"].pull is not None
        d = await submit(engine, "d", [1, 2, 3, 4, 5, 6, 7], max_tokens=2)  # e0
        e = await submit(engine, "e", PROMPT + [46], max_tokens=2)  # e1: waits for c
        # e's match on e1 is c's intent: no second pull of the same blocks
        assert engine.live["e"].pull is None
        await drain(engine, e0, e1)
        assert c.tokens() == expected("c#0", 2) and e.tokens() == expected("e#0", 2)
        assert c.usage.cached_prompt_tokens == 6 * BS
        assert e.usage.cached_prompt_tokens == 6 * BS
        assert b.done and d.done
        assert engine.executors["e1"].kv.num_imported_blocks == len(cached)
        assert all_free(engine)
    run(main())


def test_a_plan_of_exports_between_pipelined_decodes_at_depth_3():
    """e0 decodes r with three plans in flight when a pull's export-only plan goes out
    between them: no later plan feeds r a token sampled before that plan (the executor
    feeds from the step just before: SimExecutor fails the row otherwise), and r's output
    is exact."""
    async def main():
        engine, e0, e1 = make_cluster(depth=3)
        prompt = list(range(1, 1 + 20 * BS))  # (long enough for e0 to learn its rate)
        await warm(engine, e0, prompt)
        await submit(engine, "x", [60, 61], max_tokens=1)  # turn 1: e1
        r = await submit(engine, "r", [7, 8, 9], max_tokens=12)  # turn 2: e0
        await e0.answer(2)  # r decodes, plans in flight
        b = await submit(engine, "b", prompt + TAIL, max_tokens=3)  # turn 3: e1, pulls
        assert engine.live["b"].pull is not None
        await drain(engine, e0, e1)
        assert r.tokens() == expected("r#0", 12) and r.error is None
        assert b.tokens() == expected("b#0", 3)
        assert b.usage.cached_prompt_tokens == 16 * BS  # e1's 16 CPU blocks: all it can take
        rowless = [p for p in e0.plans if p.kv_export is not None]
        assert len(rowless) == 1 and rowless[0].num_seqs == 0
        assert all_free(engine)
    run(main())
