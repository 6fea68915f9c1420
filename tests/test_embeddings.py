"""POST /v1/embeddings on a real cluster (router + one CPU executor), with the router's HTTP
edge in the router process and in an API worker (`--api-workers 1`: the vector crosses the
edge wire): each input's vector equal to transformers' final hidden state of its last token
(fp32, normalized), through chunked prefill (chunks of 32 tokens) and a prefix-cache hit;
the OpenAI SDK (base64 by default); dimensions, normalize=false; every bad input a 400 or
404 naming its field; no block held after."""

from __future__ import annotations

import base64
import json

import numpy as np
import openai
import pytest
from cluster_harness import Cluster, HFReference, post_json

from pagedserve.tinymodels import build_model

TEXTS = ["The paged KV cache", "Prefix caching by hash chains " * 6,  # two chunks and more
         "Ünïcödé 🙂 and a third prompt"]
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("embed"), "llama", num_kv_heads=2,
                       max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def hf(model_dir):
    return HFReference(model_dir)


@pytest.fixture(scope="module", params=[0, 1], ids=["in-router", "api-worker"])
def cluster(request, model_dir):
    c = Cluster(model_dir, num_executors=1, executor_args=["--num-gpu-blocks", "64"],
                router_args=["--max-num-batched-tokens", "32",
                             "--api-workers", str(request.param)])
    with c.running():
        yield c


def hidden_last(hf, ids: list[int]) -> np.ndarray:
    torch = hf.torch
    with torch.no_grad():
        out = hf.model(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[-1][0, -1].double().numpy()


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def post(cluster, body: dict) -> tuple[int, dict]:
    return post_json(cluster, "/v1/embeddings", body)


def test_vectors_equal_transformers_last_hidden_state(cluster, hf, model_dir):
    model = model_dir.name
    ids = [hf.encode(t) for t in TEXTS]
    assert len(ids[1]) > 64  # prefilled in three chunks of at most 32 tokens
    status, body = post(cluster, {"model": model, "input": TEXTS + [ids[0][:5]]})
    assert status == 200, body
    assert body["object"] == "list" and body["model"] == model
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    assert body["usage"] == {"prompt_tokens": sum(map(len, ids)) + 5,
                             "total_tokens": sum(map(len, ids)) + 5}
    for d, prompt in zip(body["data"], ids + [ids[0][:5]], strict=True):
        got, want = np.array(d["embedding"]), unit(hidden_last(hf, prompt))
        assert d["object"] == "embedding" and got.shape == want.shape
        assert abs(np.linalg.norm(got) - 1) < 1e-5
        np.testing.assert_allclose(got, want, atol=2e-5)
    # the same text again: its prefix from the cache (all but the last token), the same vector
    before = _cached(cluster)
    status, again = post(cluster, {"input": TEXTS[1]})
    assert status == 200
    np.testing.assert_allclose(again["data"][0]["embedding"], body["data"][1]["embedding"],
                               atol=1e-6)
    assert _cached(cluster) - before >= len(ids[1]) // 16 * 16 - 16
    # whole blocks (32 tokens, cached whole the second time but for the last token, which
    # is computed again) and a one-token input
    whole = (ids[1] * 2)[:32]
    for _ in range(2):
        status, body = post(cluster, {"input": [whole, [7]]})
        assert status == 200, body
        for d, prompt in zip(body["data"], [whole, [7]], strict=True):
            np.testing.assert_allclose(d["embedding"], unit(hidden_last(hf, prompt)),
                                       atol=2e-5)
    assert cluster.wait_blocks_free().executors[0].num_free_gpu_blocks == 64


def _counter(cluster, name: str) -> float:
    """The sum of a counter's series."""
    values = [float(line.split()[-1]) for line in cluster.metrics().splitlines()
              if line.startswith((name + " ", name + "{"))]
    assert values, f"no {name}"
    return sum(values)


def _cached(cluster) -> float:
    return _counter(cluster, "pagedserve_prefix_cache_hits_total")


def test_the_openai_sdk_base64_dimensions_and_raw_vectors(cluster, hf, model_dir):
    client = openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused",
                           max_retries=0, timeout=60)
    generated = _counter(cluster, "pagedserve_generation_tokens_total")
    raw = hidden_last(hf, hf.encode(TEXTS[0]))
    reply = client.embeddings.create(model=model_dir.name, input=TEXTS[0])  # base64 on the wire
    np.testing.assert_allclose(reply.data[0].embedding, unit(raw), atol=2e-5)
    assert reply.usage.prompt_tokens == len(hf.encode(TEXTS[0]))
    status, body = post(cluster, {"input": TEXTS[0], "dimensions": 8,
                                  "encoding_format": "base64"})
    assert status == 200
    short = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(short, unit(raw[:8]), atol=2e-5)
    status, body = post(cluster, {"input": [TEXTS[0]], "normalize": False})
    assert status == 200
    np.testing.assert_allclose(body["data"][0]["embedding"], raw, rtol=1e-4, atol=1e-4)
    # the token each input samples and drops is no generated token
    assert _counter(cluster, "pagedserve_generation_tokens_total") == generated


@pytest.mark.parametrize("body, status, field", [
    ({}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": ""}, 400, "input"),
    ({"input": ["ok", ""]}, 400, "input[1]"),
    ({"input": [[1, 2], "x", 3.5]}, 400, "input[2]"),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "x", "dimensions": 0}, 400, "dimensions"),
    ({"input": "x", "dimensions": 100_000}, 400, "dimensions"),
    ({"input": [1] * MAX_MODEL_LEN}, 400, "input"),  # the dropped token's place
    ({"input": ["x", [10**9]]}, 400, "input[1]"),
    ({"input": "x", "model": "no-such-model"}, 404, "model"),
])
def test_bad_input_names_its_field(cluster, body, status, field):
    got, reply = post(cluster, body)
    assert got == status, reply
    error = reply["error"]
    assert error["param"] == field or field in error["message"], error
    assert cluster.wait_blocks_free().executors[0].num_free_gpu_blocks == 64


def test_rerank_and_score_are_cosines_of_transformers_vectors(cluster, hf, model_dir):
    """/v1/rerank (Jina's, Cohere's) and /v1/score: each pair's score the cosine of the two
    texts' vectors (transformers' last hidden states), each text embedded once; best first,
    top_n, documents as objects; errors naming the field the text came from."""
    vec = {t: unit(hidden_last(hf, hf.encode(t))) for t in TEXTS}
    query, docs = TEXTS[0], TEXTS[1:] + [TEXTS[0]]
    want = [float(vec[query] @ vec[d]) for d in docs]
    submitted = _counter(cluster, "pagedserve_prompt_tokens_total")
    status, body = post_json(cluster, "/v1/rerank", {
        "model": model_dir.name, "query": query,
        "documents": [docs[0], {"text": docs[1]}, docs[2]]})
    assert status == 200, body
    assert body["id"].startswith("rerank-") and body["model"] == model_dir.name
    order = sorted(range(3), key=lambda i: -want[i])
    assert [r["index"] for r in body["results"]] == order and order[0] == 2  # itself
    for r in body["results"]:
        assert abs(r["relevance_score"] - want[r["index"]]) < 1e-4
        assert r["document"] == {"text": docs[r["index"]]}
    tokens = sum(len(hf.encode(t)) for t in TEXTS)  # the query once, though twice asked
    assert body["usage"]["prompt_tokens"] == tokens
    assert _counter(cluster, "pagedserve_prompt_tokens_total") - submitted == tokens
    status, top = post_json(cluster, "/rerank", {"query": query, "documents": docs,
                                                 "top_n": 1, "return_documents": False})
    assert [r["index"] for r in top["results"]] == [2] and "document" not in top["results"][0]
    status, scored = post_json(cluster, "/v1/score", {"text_1": query, "text_2": docs})
    assert status == 200 and scored["object"] == "list"
    assert [d["index"] for d in scored["data"]] == [0, 1, 2]
    for d in scored["data"]:
        assert d["object"] == "score" and abs(d["score"] - want[d["index"]]) < 1e-4
    status, pairwise = post_json(cluster, "/score", {"text_1": [TEXTS[1], TEXTS[2]],
                                                     "text_2": [TEXTS[2], TEXTS[2]]})
    assert abs(pairwise["data"][0]["score"] - float(vec[TEXTS[1]] @ vec[TEXTS[2]])) < 1e-4
    assert abs(pairwise["data"][1]["score"] - 1.0) < 1e-4
    for path, bad_body, field in [
        ("/v1/rerank", {"query": "", "documents": ["x"]}, "query"),
        ("/v1/rerank", {"query": "q", "documents": ["x", ""]}, "documents[1]"),
        ("/v1/rerank", {"query": "q", "documents": ["x", 5]}, "documents[1]"),
        ("/v1/rerank", {"query": "q", "documents": "x"}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["x"], "top_n": 0}, "top_n"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c"]}, "text_2"),
        ("/v1/score", {"text_1": "a", "text_2": ["b", [1] * MAX_MODEL_LEN]}, "text_2[1]"),
    ]:
        status, err = post_json(cluster, path, bad_body)
        assert status == 400 and err["error"]["param"] == field, (bad_body, err)
    assert cluster.wait_blocks_free().executors[0].num_free_gpu_blocks == 64


def test_embed_bench_quick(model_dir):
    """benchmarks/embed_bench.py in a small setting on this model (float32): a JSON line
    per workload and side, the same vectors on both sides, the instruction computed once."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "embed_bench.py"), "--model",
         str(model_dir), "--workloads", "instructed_queries,short", "--scale", "0.05",
         "--dtype", "float32", "--batch", "4", "--concurrency", "2"],
        cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.strip()]
    assert [x["case"] for x in lines] == [
        "instructed_queries/pagedserve", "instructed_queries/transformers",
        "short/pagedserve", "short/transformers"]
    queries, _, short, _ = lines
    assert queries["inputs"] == 12 and short["inputs"] == 25
    assert queries["min_cosine"] > 0.9999 and short["min_cosine"] > 0.9999
    # 12 queries of 64 + 16 tokens: the instruction's 4 blocks computed once
    assert queries["tokens_computed"] == 12 * 16 + 64, queries
    assert short["tokens_computed"] == 25 * 8
