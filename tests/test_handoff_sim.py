"""Prefill/decode disaggregation (router/handoff.py) in process: two simulated executors
(pipeline_rig), e0 in prefill mode and e1 in decode mode.

* n > 1: the samples fork on e0, sample their first tokens in one plan, and move together:
  the prompt's blocks are exported once, imported once, and every sample computes only its
  tail on e1; a sample that ended with its first token stays ended.
* `--kv-pull auto`: a conversation's next turn, computed on e0, pulls the last answer's
  blocks from e1, where that answer was decoded (router/prefix_pull.py), instead of
  computing them.

KV invariants are checked after every plan (`debug_checks`)."""

from __future__ import annotations

import asyncio

from pagedserve.protos import wire
from pagedserve.router.engine import RouterEngine
from pipeline_rig import BS, EOS, expected, run, submit
from test_prefix_pull import PullSim, all_free, block_bytes, drain
from test_prefix_pull import make_cluster as prefix_pull_cluster

PROMPT = list(range(1, 1 + 6 * BS)) + [40, 41, 42]  # six full blocks and a tail of three
SAMPLES = ("b#0", "b#1", "b#2")


def make_cluster(kv_pull: bool = False) -> tuple[RouterEngine, PullSim, PullSim]:
    """e0 in prefill mode, e1 in decode mode (routing moot: one executor takes requests)."""
    return prefix_pull_cluster(modes=("prefill", "decode"), kv_pull=kv_pull)


def _rows(plan: wire.StepPlan) -> dict[str, int]:
    return dict(zip(plan.request_ids, plan.num_new_tokens.tolist(), strict=True))


def test_the_samples_move_together_with_the_prompt_blocks_sent_once():
    async def main():
        engine, e0, e1 = make_cluster()
        b = await submit(engine, "b", PROMPT, max_tokens=4, n=3)
        assert engine.live["b"].executor_id == "e0"  # prompts go to the prefill executor
        while not any(p.kv_export is not None for p in e0.plans):
            await e0.answer()
        [export] = [p for p in e0.plans if p.kv_export is not None]
        # the plan after the fork: every sample's last prompt token, sampled, and the
        # prompt's six full blocks, shared by the samples, exported once
        assert _rows(export) == dict.fromkeys(SAMPLES, 1)
        assert list(export.do_sample) == [True] * 3
        h0 = engine.executors["e0"]
        blocks = h0.kv.block_table("b#0")[:6]
        assert export.kv_export.tolist() == blocks
        assert engine.live["b"].handoff == "e1"
        while e0.unanswered():
            await e0.answer()
        group = engine.live["b"]
        assert group.executor_id == "e1" and group.handoff is None
        assert all(len(s.token_ids) == len(PROMPT) + 1 for s in group.seqs)
        assert not any(p.num_seqs for p in e0.plans[e0.plans.index(export) + 1:])
        await e1.wait_plans(1)
        plan = e1.unanswered()[0]
        assert len(plan.kv_import) == 6
        assert plan.kv_import_data.tobytes() == b"".join(
            block_bytes("e0", bid).tobytes() for bid in blocks)
        assert sorted(plan.swap_in[:, 0].tolist()) == sorted(plan.kv_import.tolist())
        # each sample: the prompt's tail and its first token, the blocks a cache hit
        assert _rows(plan) == dict.fromkeys(SAMPLES, 3 + 1)
        await e1.run_until_done([b])
        for i, sid in enumerate(SAMPLES):
            assert b.tokens(i) == expected(sid, 4), sid
        await drain(engine, e0, e1)
        assert all_free(engine)
        text = engine.metrics.render().decode()
        assert 'pagedserve_handoffs_total{executor="e0"} 1.0' in text
        assert 'pagedserve_kv_blocks_received_total{executor="e1"} 6.0' in text
    run(main())


def test_a_sample_ended_by_its_first_token_stays_ended_and_the_others_move():
    async def main():
        engine, e0, e1 = make_cluster()
        e0.overrides[("b#1", 0)] = EOS
        b = await submit(engine, "b", PROMPT, max_tokens=4, n=3)
        while engine.live["b"].executor_id == "e0":
            await e0.answer()
        group = engine.live["b"]
        assert [s.finished for s in group.seqs] == [False, True, False]
        await e1.wait_plans(1)
        assert set(_rows(e1.unanswered()[0])) == {"b#0", "b#2"}
        await e1.run_until_done([b])
        assert b.tokens(1) == [EOS] and b.finish(1).finish_reason == "stop"
        assert b.tokens(0) == expected("b#0", 4) and b.tokens(2) == expected("b#2", 4)
        await drain(engine, e0, e1)
        assert all_free(engine)
    run(main())


def test_the_next_turn_pulls_the_last_answer_from_the_decode_executor():
    async def main():
        engine, e0, e1 = make_cluster(kv_pull=True)
        first = PROMPT[:4 * BS]
        a = await submit(engine, "a", first, max_tokens=2 * BS + 5)
        await asyncio.gather(e0.run_until_done([a]), e1.run_until_done([a]))
        await drain(engine, e0, e1)
        answer = a.tokens()
        assert answer == expected("a#0", 2 * BS + 5)
        # e0 holds the first prompt's four blocks; e1 those and two of the answer (its
        # last token never entered the cache)
        h0, h1 = engine.executors["e0"], engine.executors["e1"]
        turn = first + answer + [40, 41]
        hashes = h0.kv.hash_blocks(turn)
        assert len(h0.kv.lookup(turn, hashes).block_ids) == 4
        on_e1 = list(h1.kv.lookup(turn, hashes).block_ids)
        assert len(on_e1) == 6
        b = await submit(engine, "b", turn, max_tokens=3)
        group = engine.live["b"]
        assert group.executor_id == "e0" and group.pull is not None
        assert (group.pull.source, group.pull.first) == ("e1", 4)
        assert group.pull.block_ids == tuple(on_e1[4:])
        await e1.wait_plans(1)
        export = e1.unanswered()[0]
        assert export.kv_export.tolist() == on_e1[4:] and export.num_seqs == 0
        await e1.answer()
        await e0.wait_plans(1)
        plan = e0.unanswered()[0]
        assert plan.kv_import_data.tobytes() == b"".join(
            block_bytes("e1", bid).tobytes() for bid in on_e1[4:])
        assert plan.num_new_tokens.tolist() == [len(turn) - 6 * BS]  # after the 6 blocks
        await asyncio.gather(e0.run_until_done([b]), e1.run_until_done([b]))
        assert b.tokens() == expected("b#0", 3)
        assert b.usage.cached_prompt_tokens == 6 * BS
        await drain(engine, e0, e1)
        assert all_free(engine)
        text = engine.metrics.render().decode()
        assert 'pagedserve_kv_pulls_total{executor="e0"} 1.0' in text
    run(main())


def test_no_pull_from_the_decode_executor_when_pulls_are_off():
    async def main():
        engine, e0, e1 = make_cluster()
        first = PROMPT[:4 * BS]
        a = await submit(engine, "a", first, max_tokens=2 * BS + 5)
        await asyncio.gather(e0.run_until_done([a]), e1.run_until_done([a]))
        turn = first + a.tokens() + [40, 41]
        b = await submit(engine, "b", turn, max_tokens=3)
        assert engine.live["b"].pull is None
        await e0.wait_plans(1)  # all but the first prompt's four blocks computed
        assert e0.unanswered()[0].num_new_tokens.tolist() == [len(turn) - 4 * BS]
        await asyncio.gather(e0.run_until_done([b]), e1.run_until_done([b]))
        assert b.tokens() == expected("b#0", 3)
        await drain(engine, e0, e1)
        assert all_free(engine)
    run(main())
