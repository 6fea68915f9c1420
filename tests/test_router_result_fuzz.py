"""The router's step loop against an executor whose results go wrong in every per-request way
a buggy one could send (each still well-formed on the wire): a token outside the
vocabulary, a row for a request the plan did not sample or that does not exist, a row twice,
a sampled request with neither a token nor an error, an error naming a request outside the
plan or none at all, a result for a step never planned, prompt scores at positions past the
prompt or with top ids outside the vocabulary, timings that are not finite numbers >= 0; with
one executor or two (then wrong rows and errors may name the other's requests). Whatever the
mix (hypothesis), the step loop keeps serving: the executors stay healthy, every request
ends (its tokens, or an error), the KV invariants hold after every plan (the rig's debug
checks) and every block comes back. Requests no result went wrong for (a row twice is dropped, an error from the
wrong executor ignored: those too) end without an error, with exactly the executor's
tokens."""

from __future__ import annotations

import asyncio
import math

import msgspec
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pagedserve.protos import wire
from pagedserve.router.scheduler import PreemptionMode
from pipeline_rig import BS, VOCAB, SimExecutor, expected, make_engine, run, settle, submit

FAULTS = ("out_of_vocab", "foreign_row", "unknown_row", "twice", "missing", "stray_error",
          "unknown_error", "bogus_step", "prompt_scores", "timings")


def wild_prompt_scores(data, ids: list[str]) -> dict:
    """Prompt scores for some of ``ids`` (and for nobody): any positions, any top-k count,
    top ids in or out of the vocabulary (shapes consistent, as the wire requires)."""
    chosen = data.draw(st.lists(st.sampled_from([*ids, "nobody#0"]), min_size=1, max_size=3))
    starts = [data.draw(st.integers(0, 14)) for _ in chosen]
    counts = [data.draw(st.integers(0, 14)) for _ in chosen]
    ks = [data.draw(st.integers(0, 2)) for _ in chosen]
    n, k = sum(counts), sum(c * kk for c, kk in zip(counts, ks, strict=True))
    top = data.draw(st.lists(st.sampled_from([0, 5, VOCAB - 1, VOCAB, -1]), min_size=k,
                             max_size=k))
    return {"prompt_ids": chosen, "prompt_starts": np.array(starts, np.int32),
            "prompt_counts": np.array(counts, np.int32), "prompt_ks": np.array(ks, np.int32),
            "prompt_logprobs": np.full(n, -1.5, np.float32),
            "prompt_top_token_ids": np.array(top, np.int32),
            "prompt_top_logprobs": np.full(k, -2.0, np.float32)}


def _rows(result: wire.StepResult, keep: list[int], extra: list[tuple[str, int]] = ()):
    """``result`` with the rows ``keep`` (indices, in that order) and ``extra`` rows."""
    ids = [result.request_ids[i] for i in keep] + [rid for rid, _ in extra]
    tokens = [int(result.token_ids[i]) for i in keep] + [tok for _, tok in extra]
    return msgspec.structs.replace(result, request_ids=ids,
                                   token_ids=np.array(tokens, dtype=np.int32))


def corrupt(data, result: wire.StepResult, plan: wire.StepPlan, live_ids: list[str],
            lives_on):
    """(the result to send, the sample ids it may fail, a bogus result or None).
    ``lives_on(sample id)``: the executor that request is on."""
    fault = data.draw(st.sampled_from(FAULTS))
    n = len(result.request_ids)
    rows = list(range(n))
    hit: set[str] = set()
    bogus = None
    if fault == "out_of_vocab" and n:
        i = data.draw(st.integers(0, n - 1))
        bad = data.draw(st.sampled_from([-1, -(2**31), VOCAB, VOCAB + 7, 2**31 - 1]))
        result = _rows(result, rows[:i] + rows[i + 1:], [(result.request_ids[i], bad)])
        hit.add(result.request_ids[-1])
    elif fault == "foreign_row":  # a live request the plan did not sample
        others = [r for r in live_ids if r not in plan.request_ids]
        if others:
            result = _rows(result, rows, [(data.draw(st.sampled_from(others)),
                                           data.draw(st.integers(0, VOCAB - 3)))])
    elif fault == "unknown_row":
        result = _rows(result, rows, [("nobody#0", 5)])
    elif fault == "twice" and n:  # the second row is dropped: nothing goes wrong
        i = data.draw(st.integers(0, n - 1))
        result = _rows(result, rows + [i])
    elif fault == "missing" and n:
        i = data.draw(st.integers(0, n - 1))
        hit.add(result.request_ids[i])
        result = _rows(result, rows[:i] + rows[i + 1:])
    elif fault == "stray_error":  # an error for a live request outside the plan
        others = [r for r in live_ids if r not in plan.request_ids]
        if others:
            rid = data.draw(st.sampled_from(others))
            if lives_on(rid) == result.executor_id:  # another executor's is not failed
                hit.add(rid)
            result = msgspec.structs.replace(
                result, errors=[*result.errors, wire.RequestError(rid, "stray")])
    elif fault == "unknown_error":
        result = msgspec.structs.replace(
            result, errors=[*result.errors, wire.RequestError("nobody#0", "who?")])
    elif fault == "prompt_scores":
        scores = wild_prompt_scores(data, list(result.request_ids) or live_ids)
        hit.update(scores["prompt_ids"])  # scored wrongly, or not as the executor would
        result = msgspec.structs.replace(result, **scores)
    elif fault == "timings":  # the tokens are right, the clocks are not
        wild = st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 1e300])
        result = msgspec.structs.replace(result, forward_s=data.draw(wild),
                                         gap_s=data.draw(wild), swap_s=data.draw(wild),
                                         sample_s=data.draw(wild))
    elif fault == "bogus_step":
        bogus = wire.StepResult(step_id=plan.step_id + 1000, executor_id=result.executor_id,
                                request_ids=list(result.request_ids),
                                token_ids=result.token_ids.copy())
    result.validate()  # what the router's link checks when it decodes one
    return result, hit, bogus


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_wild_results_leave_the_step_loop_serving(data):
    depth = data.draw(st.sampled_from([1, 2, 4]))
    # few blocks: requests preempted (recomputed or swapped) between wrong results
    blocks = data.draw(st.sampled_from([12, 20, 64]))
    mode = data.draw(st.sampled_from(list(PreemptionMode)))
    two = data.draw(st.booleans())  # a second executor: requests, wrong rows and errors
    # for a request that lives on the other one
    specs = data.draw(st.lists(st.tuples(st.integers(1, 12), st.integers(1, 8),
                                         st.integers(1, 2), st.sampled_from([None, 1, 2])),
                               min_size=1, max_size=4))

    async def main():
        engine, ex0 = make_engine(depth, num_gpu_blocks=blocks, mode=mode)
        executors = [ex0]
        if two:
            engine.membership.on_hello(b"e1", wire.Hello(
                executor_id="e1", model_fingerprint="fp", device="cpu", dtype="float32",
                block_size=BS, num_gpu_blocks=blocks, num_cpu_blocks=16, max_model_len=128))
            executors.append(SimExecutor(engine, "e1"))
        streams = {}
        for k, (prompt_len, max_tokens, n, prompt_logprobs) in enumerate(specs):
            rid = f"r{k}"
            prompt = [(k * 5 + j) % (VOCAB - 2) for j in range(prompt_len)]
            streams[rid] = (await submit(engine, rid, prompt, max_tokens=max_tokens, n=n,
                                         prompt_logprobs=prompt_logprobs), max_tokens, n)
        wronged: set[str] = set()  # sample ids a result went wrong for
        for _ in range(400):
            if all(s.done for s, _, _ in streams.values()):
                break
            waiting = [ex for ex in executors if ex.unanswered()]
            if not waiting:
                await asyncio.sleep(0.002)
                continue
            ex = data.draw(st.sampled_from(waiting))
            plan = ex.unanswered()[0]
            ex.answered += 1
            result = ex.result_for(plan)
            if data.draw(st.integers(0, 3)) == 0:  # a quarter of the results go wrong
                live = [f"{rid}#{i}" for rid, (_, _, n) in streams.items() for i in range(n)]
                result, hit, bogus = corrupt(
                    data, result, plan, live,
                    lambda sid: getattr(engine.live.get(sid.rpartition("#")[0]),
                                        "executor_id", None))
                wronged |= hit
                if bogus is not None:
                    engine.steps.on_result(ex.id, bogus)
            engine.steps.on_result(ex.id, result)
            await settle()
            assert all(engine.executors[e.id].healthy for e in executors)
        assert all(s.done for s, _, _ in streams.values()), "a request never ended"
        for rid, (stream, max_tokens, n) in streams.items():
            wrong = {f"{rid}#{i}" for i in range(n)} & wronged
            if not wrong:  # no result went wrong for it: served as if none had
                assert stream.error is None, (rid, stream.error)
                for i in range(n):
                    assert stream.tokens(i) == expected(f"{rid}#{i}", max_tokens)
        for ex in executors:
            while ex.unanswered():  # plans that only drop what ended
                await ex.answer()
        await settle()
        for ex in executors:
            handle = engine.executors[ex.id]
            assert handle.healthy
            cost = handle.scheduler.cost
            assert math.isfinite(cost.s_per_token) and math.isfinite(cost.s_per_seq)
            assert (handle.kv.num_free_gpu_blocks, handle.kv.stats().gpu.num_free_blocks) \
                == (blocks, blocks)

    run(main())
