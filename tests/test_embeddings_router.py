"""The router's side of an embedding request (SamplingSpec.embed), against a simulated
executor: the plan tells the executor (NewRequest.sampling.embed), the vector that comes
with the step computing the prompt's last token ends the request's stream (the token
sampled with it is not the point, but flows as any); a vector never sent, or one that is
not finite, fails the request with UNAVAILABLE (an executor's bug) and every block comes
back; a vector for a request that is not an embedding one is ignored."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from pagedserve.protos import wire
from pagedserve.router.errors import Unavailable
from pipeline_rig import free_blocks, make_engine, run, settle, submit

PROMPT = list(range(3, 43))  # 40 tokens: three chunks of at most 16
HIDDEN = 6


def with_embeddings(result: wire.StepResult, plan: wire.StepPlan, vectors: dict[str, object],
                    prompt_len: int) -> wire.StepResult:
    """``result`` plus ``vectors[request id]`` for each row that computed its prompt's last
    token (None: that request's left out)."""
    ids, rows = [], []
    for i, rid in enumerate(plan.request_ids):
        done = int(plan.num_computed_tokens[i]) + int(plan.num_new_tokens[i]) == prompt_len
        if done and rid in vectors and vectors[rid] is not None:
            ids.append(rid)
            rows.append(np.asarray(vectors[rid], dtype=np.float32))
    if not ids:
        return result
    return msgspec.structs.replace(result, embed_ids=ids, embeddings=np.stack(rows))


async def _drive(vector, *, embed: bool = True):
    engine, ex = make_engine(max_num_batched_tokens=16)
    start = free_blocks(engine)
    stream = await submit(engine, "q", PROMPT, max_tokens=1, embed=embed)
    for _ in range(20):
        if stream.done:
            break
        if ex.unanswered():
            plan = ex.unanswered()[0]
            ex.answered += 1
            result = with_embeddings(ex.result_for(plan), plan, {"q#0": vector}, len(PROMPT))
            engine.steps.on_result(ex.id, result)
        await settle()
    new = [r for p in ex.plans for r in p.new_requests]
    assert [r.sampling.embed for r in new] == [embed]
    await settle()
    assert free_blocks(engine)[1] == start[1]  # every block back (cached ones count free)
    return stream


def test_the_vector_ends_the_stream():
    vector = np.arange(HIDDEN, dtype=np.float32) - 2.5
    stream = run(_drive(vector))
    assert stream.error is None and stream.done
    last = stream.outputs[-1]
    assert last.finished and last.usage.prompt_tokens == len(PROMPT)
    np.testing.assert_array_equal(last.embedding, vector)


@pytest.mark.parametrize("vector", [None, [0.0, np.nan, 1.0, 0.0, 0.0, 0.0]],
                         ids=["never-sent", "not-finite"])
def test_a_missing_or_broken_vector_fails_the_request(vector):
    stream = run(_drive(vector))
    assert isinstance(stream.error, Unavailable), stream.error
    assert "embedding" in str(stream.error)


def test_a_vector_for_a_generation_request_is_ignored():
    stream = run(_drive(np.ones(HIDDEN), embed=False))
    assert stream.error is None and stream.outputs[-1].embedding is None
