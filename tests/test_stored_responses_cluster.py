"""Stored Responses and conversations through `--api-workers 2` (a real router, one
executor): the store is the router core's, so whichever worker a call lands on (a new
connection a call: the kernel spreads them) finds what another worker stored; a chain and a
conversation's turn equal the same conversation sent whole (greedy) and reuse its cached
blocks; a background response cancelled through another connection frees its blocks; a
background stream left and read again; the core's metric counts every worker's."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from api_worker_rig import metric
from cluster_harness import Cluster

from pagedserve.tinymodels import build_model

PROMPTS = ["The paged cache", "Routers route", "A block table maps", "Copy on write",
           "Prefix hashes chain", "Swap or recompute"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model_dir = build_model(tmp_path_factory.mktemp("stored"), "llama", num_kv_heads=2,
                            max_position_embeddings=4096)  # a long background run
    c = Cluster(model_dir, num_executors=1, executor_args=["--num-gpu-blocks", "256"],
                router_args=["--api-workers", "2"])
    with c.running():
        yield c


def test_stored_responses_are_one_store_for_both_workers(cluster):
    """The OpenAI SDK, a new connection a call (so calls land on either worker): a stored
    Response read back anywhere; a turn continued by previous_response_id equals the same
    conversation sent whole (greedy) and reuses the first turn's cached blocks; a background
    response cancelled through another connection frees its blocks; a background stream left
    after 5 events is read again from event 4 to its end."""
    import openai

    def client():
        return openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused",
                             max_retries=0, timeout=60)
    model = Path(cluster.model_dir).name
    kw = dict(model=model, max_output_tokens=6, temperature=0)
    question = " ".join(PROMPTS)  # several blocks of prompt
    first = client().responses.create(input=question, **kw)
    assert first.store and first.output_text
    for _ in range(6):
        assert client().responses.retrieve(first.id).output_text == first.output_text
    second = client().responses.create(input="Go on", previous_response_id=first.id, **kw)
    whole = client().responses.create(input=[
        {"role": "user", "content": question},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Go on"}], store=False, **kw)
    assert second.output_text == whole.output_text
    assert second.usage.input_tokens == whole.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16
    items = client().responses.input_items.list(second.id, order="asc").data
    assert [i.type for i in items] == ["message"] * 3 and items[1].id == first.output[0].id

    bg = client().responses.create(input="A long story", background=True, model=model,
                                   max_output_tokens=3000, extra_body={"ignore_eos": True})
    assert bg.status == "queued"
    deadline = time.monotonic() + 30
    while client().responses.retrieve(bg.id).status == "queued":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert client().responses.cancel(bg.id).status == "cancelled"
    assert cluster.wait_blocks_free(timeout_s=20).executors[0].num_free_gpu_blocks == 256
    assert client().responses.retrieve(bg.id).status == "cancelled"

    head = []
    with client().responses.create(input="Count", background=True, stream=True,
                                   **{**kw, "max_output_tokens": 20}) as stream:
        for event in stream:
            head.append(event)
            if len(head) == 5:
                break
    rid = head[0].response.id
    rest = list(client().responses.retrieve(rid, stream=True, starting_after=3))
    assert [e.sequence_number for e in rest] == list(range(4, 4 + len(rest)))
    assert rest[0] == head[4] and rest[-1].type == "response.incomplete"
    final = client().responses.retrieve(rid)
    assert final.output_text == rest[-1].response.output_text and final.background
    conv = client().conversations.create(items=[
        {"type": "message", "role": "user", "content": question},
        {"type": "message", "role": "assistant", "content": first.output_text}])
    turn = client().responses.create(input="Go on", conversation=conv.id, **kw)
    assert turn.output_text == second.output_text  # the same conversation as the chain's
    items = client().conversations.items.list(conv.id, order="asc").data
    assert len(items) == 4 and items[-1].id == turn.output[0].id
    client().conversations.delete(conv.id)
    stored = metric(cluster.metrics(), "pagedserve_responses_stored ")
    client().responses.delete(rid)
    with pytest.raises(openai.NotFoundError):
        client().responses.retrieve(rid)
    assert stored >= 4 and metric(cluster.metrics(), "pagedserve_responses_stored ") == \
        stored - 1  # the core's store: every worker's responses
