"""Speculative decoding by n-gram lookup, the router's side (router/speculative.py): the
lookup against a brute-force reference, the flag's JSON, the drafter's history, the wire's
checks, and the step loop with `SimExecutor` answering drafted rows as an executor does
(a row emits its samples up to the first that differs from the draft after it): outputs
token for token those of decoding without drafts, one plan in flight while a sample
speculates, drafts within max_tokens, stops inside a row, preemption, migration, every
block back."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedserve.protos import wire
from pagedserve.router.scheduler import PreemptionMode
from pagedserve.router.speculative import (
    Drafter,
    SpeculativeConfig,
    SpeculativeConfigError,
    lookup,
    parse_speculative_config,
)
from pagedserve.router.types import RequestSpec
from pipeline_rig import (
    BS,
    EOS,
    SimExecutor,
    expected,
    free_blocks,
    make_engine,
    run,
    settle,
    submit,
)

# ------------------------------------------------------------------------- the lookup


def _reference(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The longest suffix of lo..hi tokens occurring earlier; its latest place wins."""
    length = len(tokens)
    for n in range(min(hi, length - 1), lo - 1, -1):
        suffix = tokens[length - n:]
        for end in range(length - 2, n - 2, -1):
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []


def test_lookup_examples():
    t = np.array([1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert lookup(t, 4, 1, 3).tolist() == [4, 5, 9, 1]
    assert lookup(t, 2, 1, 3).tolist() == [4, 5]
    # the latest occurrence of the longest suffix: [5, 6] ends at 1 and 4 -> after 4
    assert lookup(np.array([5, 6, 7, 5, 6, 8, 5, 6]), 3, 1, 2).tolist() == [8, 5, 6]
    # a longer match beats a later shorter one: [1, 2] at 0..1, [2] alone later at 4
    assert lookup(np.array([1, 2, 7, 8, 2, 9, 1, 2]), 2, 1, 2).tolist() == [7, 8]
    assert lookup(np.array([1, 2, 7, 8, 2, 9, 1, 2]), 2, 1, 1).tolist() == [9, 1]
    assert lookup(np.array([1, 2, 3]), 4, 1, 3).tolist() == []  # nothing repeats
    assert lookup(np.array([4, 4]), 3, 2, 3).tolist() == []  # too short for n_min 2
    assert lookup(np.array([4, 4]), 3, 1, 3).tolist() == [4]
    assert lookup(np.array([4, 4, 4, 4]), 0, 1, 3).tolist() == []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 5),
       st.integers(1, 4), st.integers(0, 3))
def test_lookup_equals_the_brute_force_reference(tokens, k, lo, extra):
    hi = lo + extra
    assert lookup(np.array(tokens), k, lo, hi).tolist() == _reference(tokens, k, lo, hi)


# ------------------------------------------------------------------------- the flag


def test_parse_speculative_config():
    assert parse_speculative_config(None) is None
    assert parse_speculative_config("  ") is None
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4}') == \
        SpeculativeConfig(4, 5, 5)
    assert parse_speculative_config('{"num_speculative_tokens": 3, "prompt_lookup_max": 4}') \
        == SpeculativeConfig(3, 4, 4)
    assert parse_speculative_config(
        '{"num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}') == \
        SpeculativeConfig(3, 4, 2)
    assert parse_speculative_config('{"num_speculative_tokens": 2, "prompt_lookup_min": 3}') \
        == SpeculativeConfig(2, 3, 3)
    cfg = parse_speculative_config(SpeculativeConfig(3, 4, 2).to_json())
    assert cfg == SpeculativeConfig(3, 4, 2) and cfg.drafts_at(10**6)
    cfg = parse_speculative_config('{"num_speculative_tokens": 2, "disable_by_batch_size": 8}')
    assert cfg.disable_by_batch_size == 8 and cfg.drafts_at(7) and not cfg.drafts_at(8)
    assert parse_speculative_config(cfg.to_json()) == cfg


@pytest.mark.parametrize("text,message", [
    ("ngram", "not a JSON object"),
    ("[1]", "not a JSON object"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method 'eagle' is not served"),
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be an integer in [1, 15]"),
    ('{"num_speculative_tokens": 16}', "num_speculative_tokens must be an integer in [1, 15]"),
    ('{"num_speculative_tokens": 2.0}', "num_speculative_tokens must be an integer"),
    ('{"num_speculative_tokens": 2, "prompt_lookup_max": 0}', "prompt_lookup_max must be"),
    ('{"num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 3}',
     "prompt_lookup_min must not exceed prompt_lookup_max"),
    ('{"num_speculative_tokens": 2, "model": "x"}', "unsupported key(s) model"),
    ('{"num_speculative_tokens": 2, "disable_by_batch_size": 0}',
     "disable_by_batch_size must be an integer"),
])
def test_parse_speculative_config_refusals(text, message):
    with pytest.raises(SpeculativeConfigError) as exc:
        parse_speculative_config(text)
    assert message in str(exc.value)


def test_the_router_flag_refuses_a_bad_config_in_one_line(tmp_path):
    from pagedserve.cli import main
    with pytest.raises(SystemExit) as exc:
        main(["router", "--model", str(tmp_path), "--speculative-config",
              '{"method": "medusa", "num_speculative_tokens": 2}'])
    assert exc.value.code == 2


# ------------------------------------------------------------------------- the drafter


class _Seq:
    def __init__(self, seq_id: str, token_ids: list[int]) -> None:
        self.seq_id, self.token_ids, self.num_pending = seq_id, token_ids, 0
        self.group = SimpleNamespace(spec=RequestSpec(seq_id, (1,)))  # (no prediction)


def test_the_drafter_copies_only_new_tokens_and_restarts_for_a_new_sequence():
    drafter = Drafter(SpeculativeConfig(3, 2, 1))
    seq = _Seq("a#0", [1, 2, 3, 1])
    assert drafter.search(seq, 3) == [2, 3, 1]
    assert drafter.search(seq, 2) == [2, 3]
    seq.token_ids.extend([2, 9])  # ... 1 2 9: [2, 9] never occurred, [9] neither
    assert drafter.search(seq, 3) == []
    seq.token_ids.extend(list(range(10, 100)) + [2])  # the buffer grows past 64
    assert drafter.search(seq, 3) == [9, 10, 11]
    other = _Seq("a#0", [7, 8, 7])  # a new request that took the id
    assert drafter.search(other, 3) == [8, 7]
    drafter.forget("a#0")
    assert len(drafter) == 0


def test_the_drafter_backs_off_after_misses_and_resumes_on_a_confirmed_draft():
    drafter = Drafter(SpeculativeConfig(2, 1, 1))
    seq = _Seq("a#0", [1, 2, 3])  # nothing repeats: every other decode looks again
    pattern = []
    for _ in range(6):
        pattern.append(drafter.wants_drafts(seq))
        assert drafter.decode(seq, 5) == []
    assert pattern == [True, False] * 3
    seq2 = _Seq("b#0", [5, 6, 5])
    assert drafter.decode(seq2, 5) == [6, 5]
    drafter.confirmed(seq2, 2, 0)  # rejected: one miss costs no skip, the next row 1 draft
    assert drafter.wants_drafts(seq2) and drafter.decode(seq2, 5) == [6]
    drafter.confirmed(seq2, 1, 0)  # a second in a row: skip 1
    assert not drafter.wants_drafts(seq2) and drafter.decode(seq2, 5) == []
    assert drafter.wants_drafts(seq2) and drafter.decode(seq2, 5) == [6]
    drafter.confirmed(seq2, 1, 1)  # confirmed: the run of misses ends, 2 drafts again
    assert drafter.wants_drafts(seq2) and drafter.decode(seq2, 5) == [6, 5]
    drafter.confirmed(seq2, 2, 0)
    assert drafter.wants_drafts(seq2)  # one miss again: no skip
    pattern = []  # rejected again and again: skip 1, 3, 7, 15, 15
    for _ in range(46):
        wants = drafter.wants_drafts(seq2)
        pattern.append(wants)
        drafts = drafter.decode(seq2, 5)
        if drafts:
            drafter.confirmed(seq2, len(drafts), 0)
    assert [i for i, w in enumerate(pattern) if w] == [0, 2, 6, 14, 30]
    seq2.num_pending = 1  # a token in flight: no lookup
    assert drafter.decode(seq2, 5) == []


def test_the_draft_length_follows_what_was_confirmed():
    drafter = Drafter(SpeculativeConfig(6, 1, 1))
    seq = _Seq("a#0", [9, 1, 2, 3, 4, 5, 6, 7, 9])  # after 9: 1 2 3 4 5 6 7 9 ...
    lengths = []
    for drafted, confirmed in ((6, 6), (6, 0), (1, 1), (2, 2), (4, 2), (3, 3), (6, 5)):
        drafts = drafter.decode(seq, 10)
        assert len(drafts) == drafted, (lengths, drafts)
        lengths.append(len(drafts))
        drafter.confirmed(seq, len(drafts), confirmed)
    # then: all 6 confirmed -> 6 (at most k); 0 -> 1; 1 of 1 -> 2; 2 of 2 -> 4; 2 of 4 -> 3;
    # 3 of 3 -> 6; 5 of 6 -> 6
    assert len(drafter.decode(seq, 10)) == 6
    assert len(drafter.decode(seq, 2)) == 2  # the limit still binds


# ------------------------------------------------------------------------- the wire


def _plan(**kw) -> wire.StepPlan:
    base = dict(step_id=1, request_ids=["a"], num_computed_tokens=wire.int32([5]),
                num_new_tokens=wire.int32([3]), do_sample=np.array([1], np.uint8),
                token_ids=wire.int32([1, 2, 3]), positions=wire.int32([5, 6, 7]),
                slot_mapping=np.array([5, 6, 7], np.int64),
                block_table_starts=wire.int32([0]), block_table_lens=wire.int32([0]),
                num_draft_tokens=np.array([2], np.uint8))
    base.update(kw)
    return wire.StepPlan(**base)


def test_wire_checks_the_draft_counts():
    _plan().validate()
    for bad in (dict(num_draft_tokens=np.array([3], np.uint8)),  # not fewer than tokens
                dict(num_draft_tokens=np.array([1, 1], np.uint8)),  # one a row
                dict(do_sample=np.array([0], np.uint8)),  # a drafted row samples
                dict(feed_sampled=np.array([1], np.uint8))):  # and is never fed
        with pytest.raises(wire.WireError):
            _plan(**bad).validate()


# ------------------------------------------------------------------------- the step loop

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)


def _echo_prompt(seq_id: str, n: int) -> list[int]:
    """A prompt holding the tokens the simulated executor will sample for `seq_id`, so
    each lookup finds what comes next (every draft is confirmed)."""
    return [EOS - 1] + expected(seq_id, n)


def test_confirmed_drafts_give_the_same_tokens_in_fewer_steps():
    async def main():
        engine, ex = make_engine(2, speculative=SPEC)
        a = await submit(engine, "a", _echo_prompt("a#0", 40), max_tokens=30)
        await ex.run_one_in_flight([a])
        assert a.tokens() == expected("a#0", 30)
        assert a.finish().finish_reason == "length" and a.usage.completion_tokens == 30
        drafted = [p for p in ex.plans if p.num_draft_tokens is not None]
        # the prefill samples token 0; then 4 drafts a row, each confirmed: 5 tokens a step
        assert [p.num_draft_tokens.tolist() for p in drafted] == [[4]] * 5 + [[3]]
        assert drafted[0].token_ids.tolist() == expected("a#0", 5)
        assert drafted[0].positions.tolist() == list(range(41, 46))
        m = engine.metrics.render().decode()
        assert 'pagedserve_spec_decode_num_drafts_total{executor="e0"} 6.0' in m
        assert 'pagedserve_spec_decode_num_draft_tokens_total{executor="e0"} 23.0' in m
        assert 'pagedserve_spec_decode_num_accepted_tokens_total{executor="e0"} 23.0' in m
        assert "pagedserve_generation_tokens_total 30.0" in m
        while ex.unanswered():
            await ex.answer()
        assert free_blocks(engine) == (64, 64)
    run(main())


def test_a_rejected_draft_keeps_the_sampled_token_and_the_rest_follows():
    async def main():
        engine, ex = make_engine(2, speculative=SPEC)
        ex.overrides[("a#0", 3)] = 61  # the executor samples 61 where the draft says else
        ex.overrides[("a#0", 12)] = 60
        a = await submit(engine, "a", _echo_prompt("a#0", 40), max_tokens=24)
        await ex.run_one_in_flight([a])
        want = expected("a#0", 24)
        want[3], want[12] = 61, 60
        assert a.tokens() == want
        # computed positions stay exact: the SimExecutor checks each row's input is its
        # last token, and the KV manager's invariants run after every plan
        kv = engine.executors["e0"].kv
        m = engine.metrics.render().decode()
        accepted = float(m.split('pagedserve_spec_decode_num_accepted_tokens_total{executor="e0"} ')
                         [1].split()[0])
        assert 0 < accepted < 23
        while ex.unanswered():
            await ex.answer()
        assert free_blocks(engine) == (64, 64) and not kv.request_ids()
    run(main())


def test_drafts_never_reach_past_max_tokens_or_max_model_len():
    async def main():
        engine, ex = make_engine(2, speculative=SPEC)
        a = await submit(engine, "a", _echo_prompt("a#0", 40), max_tokens=8)
        b = await submit(engine, "b", _echo_prompt("b#0", 100), max_tokens=30)  # 101 + 30 > 128
        await ex.run_one_in_flight([a, b])
        assert a.tokens() == expected("a#0", 8) and a.finish().finish_reason == "length"
        assert b.finish().finish_reason == "length" and len(b.tokens()) == 128 - 101
        assert b.tokens() == expected("b#0", 27)
        for plan in ex.plans:
            if plan.num_draft_tokens is not None:
                ends = plan.num_computed_tokens + plan.num_new_tokens
                assert ends.max() <= 127
        assert "pagedserve_generation_tokens_total 35.0" in engine.metrics.render().decode()
        while ex.unanswered():
            await ex.answer()
        assert free_blocks(engine) == (64, 64)
    run(main())


def test_eos_and_a_stop_string_inside_a_drafted_row_end_it_there():
    async def main():
        engine, ex = make_engine(2, speculative=SPEC)
        ex.overrides[("a#0", 7)] = EOS  # drafts say otherwise: the row ends there
        a = await submit(engine, "a", _echo_prompt("a#0", 40), max_tokens=30)
        toks = expected("b#0", 40)
        stop = "".join(chr(65 + t) for t in toks[8:10])
        b = await submit(engine, "b", _echo_prompt("b#0", 40), max_tokens=30, stop=(stop,))
        await ex.run_one_in_flight([a, b])
        assert a.tokens() == expected("a#0", 7) + [EOS]
        assert a.finish().finish_reason == "stop" and a.usage.completion_tokens == 8
        assert b.finish().stop_string == stop and b.tokens() == toks[:10]
        assert b.usage.completion_tokens == 10
        while ex.unanswered():
            await ex.answer()
        assert free_blocks(engine) == (64, 64)
    run(main())


def test_n2_samples_speculate_after_the_fork():
    async def main():
        engine, ex = make_engine(2, speculative=SPEC)
        c = await submit(engine, "c", _echo_prompt("c#0", 30), max_tokens=20, n=2,
                         temperature=1.0, seed=3)
        await ex.run_one_in_flight([c])
        assert c.tokens(0) == expected("c#0", 20) and c.tokens(1) == expected("c#1", 20)
        first = [p for p in ex.plans if p.num_draft_tokens is not None][0]
        assert first.forks == [] and "c#0" in first.request_ids
        while ex.unanswered():
            await ex.answer()
        assert free_blocks(engine) == (64, 64)
    run(main())


def test_a_grammar_request_gets_no_drafts_and_keeps_pipelining():
    async def main():
        engine, ex = make_engine(2, speculative=SPEC)
        g = await submit(engine, "g", _echo_prompt("g#0", 30), max_tokens=10,
                         grammar='start: /[A-Z]+/')
        await ex.answer()
        await ex.wait_plans(2)  # two plans in flight, as without speculation
        await ex.run_until_done([g])
        assert g.tokens() == expected("g#0", 10)
        assert all(p.num_draft_tokens is None for p in ex.plans)
    run(main())


@pytest.mark.parametrize("mode", [PreemptionMode.RECOMPUTE, PreemptionMode.SWAP])
def test_preemption_with_drafts_keeps_outputs_exact(mode):
    async def main():
        engine, ex = make_engine(2, num_gpu_blocks=14, num_cpu_blocks=16, mode=mode,
                                 speculative=SPEC)
        a = await submit(engine, "a", _echo_prompt("a#0", 14), max_tokens=26)
        b = await submit(engine, "b", _echo_prompt("b#0", 14), max_tokens=26)
        await ex.run_one_in_flight([a, b])
        assert a.tokens() == expected("a#0", 26) and b.tokens() == expected("b#0", 26)
        assert engine.executors["e0"].scheduler.num_preemptions[mode] >= 1
        assert ex.num_drafted > 4
        while ex.unanswered():
            await ex.answer()
        await settle()
        assert free_blocks(engine) == (14, 14)
    run(main())


def test_an_executor_lost_with_a_drafted_plan_in_flight_resumes_exactly():
    async def main():
        engine, ex = make_engine(2, speculative=SPEC)
        a = await submit(engine, "a", _echo_prompt("a#0", 40), max_tokens=24)
        await ex.answer(2)
        await ex.wait_plans(1)
        assert ex.unanswered()[0].num_draft_tokens is not None
        hello = wire.Hello(executor_id="e1", model_fingerprint="fp", device="cpu",
                           dtype="float32", block_size=BS, num_gpu_blocks=64,
                           num_cpu_blocks=8, max_model_len=128)
        engine.membership.on_hello(b"e1", hello)
        ex2 = SimExecutor(engine, "e1")
        engine.membership.executor_lost(engine.executors["e0"], "killed")
        await ex2.run_one_in_flight([a])
        assert a.tokens() == expected("a#0", 24)
        assert ex2.num_drafted >= 1
    run(main())


def test_an_executor_answering_past_a_rejected_draft_fails_that_request():
    async def main():
        engine, ex = make_engine(2, speculative=SPEC)
        ex.overrides[("a#0", 2)] = 61  # the first drafted row stops at its second token
        honest = ex.result_for

        def lying(plan):  # ... and this executor answers one token more anyway
            result = honest(plan)
            if plan.num_draft_tokens is None or "a#0" not in result.request_ids:
                return result
            at = len(result.request_ids) - result.request_ids[::-1].index("a#0")
            return wire.StepResult(step_id=result.step_id, executor_id=result.executor_id,
                                   request_ids=[*result.request_ids[:at], "a#0",
                                                *result.request_ids[at:]],
                                   token_ids=np.insert(result.token_ids, at, 5).astype(np.int32),
                                   forward_s=1e-3)
        ex.result_for = lying
        a = await submit(engine, "a", _echo_prompt("a#0", 40), max_tokens=20)
        b = await submit(engine, "b", [1, 2, 3], max_tokens=6)
        await ex.run_one_in_flight([a, b])
        assert a.error is not None and "drafts wrongly" in str(a.error)
        assert b.tokens() == expected("b#0", 6)
        while ex.unanswered():
            await ex.answer()
        await settle()
        assert free_blocks(engine) == (64, 64)
    run(main())


def test_no_drafts_while_as_many_requests_run_as_disable_by_batch_size():
    async def main():
        spec = SpeculativeConfig(4, 3, 1, disable_by_batch_size=2)
        engine, ex = make_engine(2, speculative=spec)
        a = await submit(engine, "a", _echo_prompt("a#0", 40), max_tokens=30)
        b = await submit(engine, "b", _echo_prompt("b#0", 40), max_tokens=6)
        await ex.run_one_in_flight([a, b])
        assert a.tokens() == expected("a#0", 30) and b.tokens() == expected("b#0", 6)
        both = [p for p in ex.plans if {"a#0", "b#0"} <= set(p.request_ids)]
        assert both and all(p.num_draft_tokens is None for p in both)
        assert any(p.feed_sampled is not None for p in both)  # they pipelined
        alone = [p for p in ex.plans if p.request_ids == ["a#0"]]
        assert any(p.num_draft_tokens is not None for p in alone)  # b ended: a drafts
        while ex.unanswered():
            await ex.answer()
        assert free_blocks(engine) == (64, 64)
    run(main())
