"""A request id reused right after an abort: nothing still on its way for the old request
(tokens and errors of plans sent before it ended, an edge's late abort) reaches the new one.
In process, against tests/pipeline_rig.py's simulated executor (tests/test_edge_hub.py has
the API workers' side)."""

from __future__ import annotations

from pagedserve.protos import wire
from pagedserve.router.types import RequestSpec, SamplingSpec
from pipeline_rig import expected, free_blocks, make_engine, run, settle, submit


def test_a_token_for_an_aborted_request_never_reaches_a_new_one_with_its_id():
    """Abort with plans in flight, then a new request under the same id: the aborted one's
    late tokens are dropped (they are matched to the plan's samples, not to whatever request
    holds the id now); the new request's outputs are exactly its own."""
    async def main():
        engine, ex = make_engine(2)
        old = await submit(engine, "a", [1, 2, 3, 4, 5, 6], max_tokens=20)
        await ex.answer()
        await ex.wait_plans(2)  # plans 2 and 3 both decode the old a#0
        assert engine.abort("a")
        new = await submit(engine, "a", [9, 8, 7], max_tokens=5)
        await settle()
        assert old.done and old.finish().finish_reason == "abort"
        await ex.run_until_done([new])
        assert new.tokens() == expected("a#0", 5)
        assert new.usage.prompt_tokens == 3 and new.usage.completion_tokens == 5
        while ex.unanswered():
            await ex.answer()
        await settle()
        assert free_blocks(engine) == (64, 64)
    run(main())


def test_an_error_for_an_aborted_request_never_fails_a_new_one_with_its_id():
    """As above for the executor's per-request errors (and prompt scores, matched the same
    way): a result of a plan sent before the new request was admitted is not about it."""
    import msgspec

    async def main():
        engine, ex = make_engine(2)
        old = await submit(engine, "a", [1, 2, 3, 4, 5, 6], max_tokens=20)
        await ex.answer()
        await ex.wait_plans(2)
        assert engine.abort("a")
        new = await submit(engine, "a", [9, 8, 7], max_tokens=5)
        await settle()
        plan = ex.unanswered()[0]
        result = ex.result_for(plan)
        result = msgspec.structs.replace(
            result, errors=[*result.errors, wire.RequestError("a#0", "boom")])
        ex.answered += 1
        engine.steps.on_result(ex.id, result)
        await settle()
        await ex.run_until_done([new])
        assert old.done and new.error is None
        assert new.tokens() == expected("a#0", 5) and new.finish().finish_reason == "length"
    run(main())


def test_an_edge_leaving_an_ended_request_never_aborts_a_new_one_with_its_id():
    """Client A's request "x" is ended by the Abort RPC and a new "x" is submitted before A's
    edge leaves its session (A hung up, unread final item): the edge's abort is A's only."""
    from pagedserve.router.frontend import Frontend
    from pagedserve.router.validation import Limits

    async def main():
        engine, ex = make_engine(2)
        frontend = Frontend(engine, engine.tokenizer, Limits(vocab_size=100, max_model_len=128))
        spec_a = RequestSpec("x", (1, 2, 3), SamplingSpec(max_tokens=8, temperature=0.0))
        async with frontend.request("x", lambda: spec_a, api="grpc", arrival=0.0):
            await ex.answer()
            assert engine.abort("x")  # the Abort RPC, from another client
            new = await submit(engine, "x", [4, 5], max_tokens=3)
            # A leaves without reading its final item (client gone)
        assert "x" in engine.live
        await ex.run_until_done([new])
        assert new.tokens() == expected("x#0", 3) and new.finish().finish_reason == "length"
        # and an edge leaving its own live request still aborts it
        spec_b = RequestSpec("y", (1, 2), SamplingSpec(max_tokens=50, temperature=0.0))
        async with frontend.request("y", lambda: spec_b, api="grpc", arrival=0.0):
            await ex.answer()
        assert "y" not in engine.live
    run(main())
