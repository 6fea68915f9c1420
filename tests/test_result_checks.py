"""router/result_checks.py: an executor's sampled tokens outside the vocabulary fail their
requests alone (the rows taken out of the result exactly, top-k entries with them), and the
router's step loop carries on with the rest (the pipeline rig)."""

from __future__ import annotations

import asyncio
import math

import msgspec
import numpy as np
import pipeline_rig as rig
import pytest
from pagedserve.protos import wire
from pagedserve.protos.wire import WireError
from pagedserve.router.result_checks import bad_token_rows, out_of_vocab_errors, without_rows
from pipeline_rig import expected, make_engine, run, settle, submit


def _result(tokens, top_counts=None, **kw) -> wire.StepResult:
    n = len(tokens)
    return wire.StepResult(step_id=7, request_ids=[f"r{i}#0" for i in range(n)],
                           token_ids=np.array(tokens, np.int32), top_counts=top_counts, **kw)


@pytest.mark.parametrize("tokens, bad", [([0, 5, 9], None), ([], None), ([10], [0]),
                                         ([3, -1, 9, 10, 2**31 - 1], [1, 3, 4])])
def test_bad_rows_are_those_outside_the_vocabulary(tokens, bad):
    found = bad_token_rows(_result(tokens), 10)
    assert (found.tolist() if found is not None else None) == bad


def test_the_bad_rows_leave_the_result_with_their_logprobs_and_top_entries():
    counts = np.array([2, 0, 3, 1], np.int32)
    result = _result([4, 99, -3, 6], counts,
                     logprobs=np.array([-0.1, -0.2, -0.3, -0.4], np.float32),
                     top_token_ids=np.arange(10, 16, dtype=np.int32),
                     top_logprobs=np.arange(6, dtype=np.float32) * -1.0,
                     errors=[wire.RequestError("x#0", "other")], forward_s=0.5)
    result.validate()
    bad = bad_token_rows(result, 20)
    assert bad.tolist() == [1, 2]
    kept = without_rows(result, bad)
    kept.validate()
    assert kept.request_ids == ["r0#0", "r3#0"] and kept.token_ids.tolist() == [4, 6]
    assert kept.logprobs.tolist() == pytest.approx([-0.1, -0.4])
    assert kept.top_counts.tolist() == [2, 1]
    assert kept.top_token_ids.tolist() == [10, 11, 15]  # row 2's 12-14 gone with it
    assert kept.top_logprobs.tolist() == [0.0, -1.0, -5.0]
    assert kept.errors == result.errors and kept.forward_s == 0.5 and kept.step_id == 7
    errors = out_of_vocab_errors(result, bad, 20)
    assert [e.request_id for e in errors] == ["r1#0", "r2#0"]
    assert "token 99" in errors[0].message and "token -3" in errors[1].message


def test_a_top_k_id_outside_the_vocabulary_condemns_its_row():
    counts = np.array([1, 2, 0], np.int32)
    result = _result([1, 2, 3], counts, top_token_ids=np.array([4, 5, -7], np.int32),
                     top_logprobs=np.zeros(3, np.float32))
    result.validate()
    assert bad_token_rows(result, 10).tolist() == [1]
    assert bad_token_rows(msgspec.structs.replace(
        result, top_token_ids=np.array([4, 5, 6], np.int32)), 10) is None


@pytest.mark.parametrize("top_ids", [np.zeros(2, np.int32), np.zeros((1, 1), np.int32)])
def test_top_entries_that_no_count_owns_are_malformed(top_ids):
    result = _result([1], np.array([0 if top_ids.ndim == 1 else 1], np.int32),
                     top_token_ids=top_ids, top_logprobs=np.zeros(top_ids.shape[0], np.float32))
    with pytest.raises(WireError, match="top_token_ids must have"):
        result.validate()


def test_a_negative_top_count_is_malformed():
    result = _result([1, 2], np.array([2, -1], np.int32),
                     top_token_ids=np.array([1], np.int32),
                     top_logprobs=np.array([0.0], np.float32))
    with pytest.raises(WireError, match="negative top count"):
        result.validate()


def test_a_token_outside_the_vocabulary_fails_its_request_alone():
    """Request a's second token comes back as -1 (an executor's bug): a fails with the token
    named, b gets all its tokens, the executor stays healthy and every block comes back."""
    async def main():
        engine, ex = make_engine(2)
        a = await submit(engine, "a", [1, 2, 3], max_tokens=10)
        b = await submit(engine, "b", [4, 5, 6], max_tokens=6)
        ex.overrides[("a#0", 1)] = -1
        ex.overrides[("b#0", 9)] = rig.VOCAB  # never reached: b stops at 6
        await ex.run_until_done([a, b])
        assert a.error is not None and "token -1" in str(a.error)
        assert a.tokens() == expected("a#0", 1)
        assert b.error is None and b.tokens() == expected("b#0", 6)
        while ex.unanswered():
            await ex.answer()
        assert engine.executors["e0"].healthy
        assert rig.free_blocks(engine) == (64, 64)
    run(main())


def _answer_with(ex, change) -> None:
    """Answer the oldest plan with ``change(result)`` instead of the executor's result."""
    plan = ex.unanswered()[0]
    ex.answered += 1
    ex.engine.steps.on_result(ex.id, change(ex.result_for(plan)))


def _replace_rows(result, ids, tokens):
    return msgspec.structs.replace(result, request_ids=ids,
                                   token_ids=np.array(tokens, dtype=np.int32))


def test_a_row_twice_counts_once_and_a_row_for_another_request_is_dropped():
    async def main():
        engine, ex = make_engine(2)
        a = await submit(engine, "a", [1, 2, 3], max_tokens=5)
        b = await submit(engine, "b", [4, 5], max_tokens=5)
        await ex.answer()  # both prefills
        await ex.wait_plans(1)
        # a's row twice (with another token the second time), then a row for "b" is left
        # as it is; one plan later a row for a request this plan did not sample
        _answer_with(ex, lambda r: _replace_rows(
            r, [*r.request_ids, r.request_ids[0]], [*r.token_ids.tolist(), 9]))
        await settle()
        await ex.wait_plans(1)
        plan = ex.unanswered()[0]
        assert set(plan.request_ids) == {"a#0", "b#0"}
        _answer_with(ex, lambda r: _replace_rows(
            r, [*r.request_ids, "nobody#0"], [*r.token_ids.tolist(), 7]))
        await settle()
        await ex.run_until_done([a, b])
        assert a.tokens() == expected("a#0", 5) and b.tokens() == expected("b#0", 5)
        while ex.unanswered():
            await ex.answer()
        assert engine.executors["e0"].healthy and rig.free_blocks(engine) == (64, 64)
    run(main())


@pytest.mark.parametrize("how", ["missing", "replaced", "empty"])
def test_a_sample_answered_with_nothing_fails_its_request_instead_of_hanging(how):
    """A sampled request with neither a token nor an error in the result (its row left out,
    taken by a row for another request, or no rows at all) would never be planned again;
    it fails, the other request carries on."""
    async def main():
        engine, ex = make_engine(1)
        a = await submit(engine, "a", [1, 2, 3], max_tokens=4)
        b = await submit(engine, "b", [4, 5], max_tokens=4)
        await ex.answer()
        await ex.wait_plans(1)

        def change(r):
            keep = [i for i, rid in enumerate(r.request_ids) if rid != "a#0"]
            ids = [r.request_ids[i] for i in keep]
            tokens = r.token_ids[keep].tolist()
            if how == "replaced":  # as many rows as samples, one for a request not planned
                ids, tokens = [*ids, "nobody#0"], [*tokens, 3]
            elif how == "empty":
                ids, tokens = [], []
            return _replace_rows(r, ids, tokens)
        _answer_with(ex, change)
        await settle()
        assert a.done and "answered no token for a#0" in str(a.error)
        if how == "empty":  # b's token was left out too
            assert b.done and b.error is not None
        else:
            await ex.run_until_done([b])
            assert b.error is None and b.tokens() == expected("b#0", 4)
        while ex.unanswered():
            await ex.answer()
        assert engine.executors["e0"].healthy and rig.free_blocks(engine) == (64, 64)
    run(main())


@pytest.mark.parametrize("first, count, top, ranks, why", [
    (1, 4, [3, 4], None, ""), (0, 5, [], None, ""),
    (2, 4, [], None, "positions 2..5 of a 5-token prompt"), (6, 0, [], None, "positions 6..5"),
    (1, 2, [3, 64], None, "top-k ids outside the vocabulary of 64"),
    (1, 2, [-1], None, "top-k ids outside"), (1, 2, [], [1, 64], ""),
    (1, 2, [], [0, 1], "ranks outside 1..64"), (1, 2, [], [1, 65], "ranks outside")])
def test_prompt_scores_must_be_the_prompts(first, count, top, ranks, why):
    from pagedserve.router.result_checks import prompt_scores_wrong
    wrong = prompt_scores_wrong(first, count, 5, np.array(top, np.int32), rig.VOCAB,
                                None if ranks is None else np.array(ranks, np.int32))
    assert (wrong.startswith(why) if why else wrong == ""), wrong


def test_timings_that_are_not_finite_and_non_negative_are_taken_as_0(caplog):
    from pagedserve.router.result_checks import sane_timings
    good = _result([1], forward_s=0.5, gap_s=0.0, swap_s=0.25, sample_s=1e-4)
    assert sane_timings(good) is good
    bad = msgspec.structs.replace(good, executor_id="clock-bug", forward_s=math.nan,
                                  gap_s=-1.0, swap_s=math.inf)
    fixed = sane_timings(bad)
    assert (fixed.forward_s, fixed.gap_s, fixed.swap_s, fixed.sample_s) == (0.0, 0.0, 0.0, 1e-4)
    assert fixed.token_ids.tolist() == [1]
    sane_timings(bad)
    assert caplog.text.count("clock-bug sent timings") == 1  # once an executor


def test_an_executor_cannot_fail_or_answer_a_request_that_lives_on_another():
    """a runs on e0, b on e1; e0's results name b (an error, then a token): b goes on as
    e1 answers it, and e0's own request is unaffected (depth 1: e0's plan after the first
    is built once b has arrived, so only the executor tells b is not e0's)."""
    async def main():
        engine, ex0 = make_engine(1)
        a = await submit(engine, "a", [1, 2, 3], max_tokens=4)
        await ex0.wait_plans(1)
        hello = wire.Hello(executor_id="e1", model_fingerprint="fp", device="cpu",
                           dtype="float32", block_size=rig.BS, num_gpu_blocks=64,
                           num_cpu_blocks=8, max_model_len=128)
        engine.membership.on_hello(b"e1", hello)
        ex1 = rig.SimExecutor(engine, "e1")
        b = await submit(engine, "b", [7, 8, 9, 10], max_tokens=4)
        await ex1.wait_plans(1)
        assert engine.live["b"].executor_id == "e1"
        await ex0.answer()  # e0's next plans are built after b arrived
        await ex0.wait_plans(1)
        _answer_with(ex0, lambda r: msgspec.structs.replace(
            r, errors=[wire.RequestError("b#0", "not mine")]))
        await settle()
        _answer_with(ex0, lambda r: _replace_rows(
            r, [*r.request_ids, "b#0"], [*r.token_ids.tolist(), 11]))
        await settle()
        assert not b.done
        while not (a.done and b.done):
            for ex in (ex0, ex1):
                if ex.unanswered():
                    await ex.answer()
            await asyncio.sleep(0.001)
        assert a.error is None and a.tokens() == expected("a#0", 4)
        assert b.error is None and b.tokens() == expected("b#0", 4)
    run(main())
