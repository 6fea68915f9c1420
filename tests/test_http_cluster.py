"""The OpenAI API of a real cluster (router + one executor process), driven by the official
`openai` SDK (max_retries=0): models.list, completions and chat completions (unary and
streaming, n=2, stop, seed, logprobs), greedy chat equal to HF apply_chat_template + generate,
a predicted output (the same tokens, its drafts counted),
a client that disconnects mid-stream (0 blocks leaked), bad input, 429 on a full queue, a
second router beside this one (no port collision), and — last — draining: 503 for new requests
and an `abort` ending for an open stream, exit code 0."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import aiohttp
import openai
import pytest
from cluster_harness import READY, Cluster, HFReference, free_port

from pagedserve.tinymodels import build_model

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Where is the paged KV cache? Ünïcödé 🙂"},
    {"role": "assistant", "content": "In blocks."},
    {"role": "user", "content": "And the prefix cache?"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # A 4k context: the draining test's stream must outlast --shutdown-timeout on any
    # machine (at 1k, a fast one finished it inside the 3 s).
    return build_model(tmp_path_factory.mktemp("chat"), "llama", num_kv_heads=2,
                       max_position_embeddings=4096)


@pytest.fixture(scope="module")
def cluster(model_dir):
    c = Cluster(model_dir, num_executors=1, executor_args=["--num-gpu-blocks", "300"],
                router_args=["--max-queue-len", "2", "--shutdown-timeout", "3"])
    with c.running():
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused",
                         max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_name(model_dir):
    from pathlib import Path
    return Path(model_dir).name


def test_models_list(client, model_name):
    assert [m.id for m in client.models.list().data] == [model_name]


def test_greedy_chat_equals_hf_apply_chat_template(client, model_name, model_dir):
    hf = HFReference(model_dir)
    ids = hf.tokenizer.apply_chat_template(CONVERSATION, tokenize=True,
                                           add_generation_prompt=True, return_dict=False)
    expected, gaps = hf.greedy(list(ids), 24)
    decisive = next((j for j, g in enumerate(gaps) if g < 1e-3), len(gaps))
    assert decisive >= 8, "the test model's greedy logits are not decisive"
    reply = client.chat.completions.create(
        model=model_name, messages=CONVERSATION, max_tokens=decisive, temperature=0,
        extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    assert choice.message.content == hf.tokenizer.decode(expected[:decisive],
                                                         skip_special_tokens=True)
    assert choice.finish_reason == "length"
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens == decisive


def test_a_prediction_changes_no_token_and_counts_its_drafts(client, model_name, model_dir):
    """Predicted Outputs through the OpenAI SDK, on a router without --speculative-config:
    the greedy reply is the same with its own text as the prediction (40 tokens in three
    drafted decodes: 15, 15 and 6 drafts, every one confirmed) and with a prediction wrong
    from its middle on (some drafts rejected). The reply is made of whole-word tokens
    (allowed_token_ids) so its text tokenizes back to its tokens (the random model's bytes
    would not)."""
    tok = HFReference(model_dir).tokenizer
    words = [t for t in range(tok.vocab_size) if re.fullmatch(r" [a-z]+", tok.decode([t]))
             and tok.encode(tok.decode([t]), add_special_tokens=False) == [t]]

    def chat(**kw):
        return client.chat.completions.create(
            model=model_name, messages=CONVERSATION, max_tokens=40, temperature=0,
            extra_body={"ignore_eos": True, "allowed_token_ids": words}, **kw)

    def counts(reply):
        details = reply.usage.completion_tokens_details
        return details.accepted_prediction_tokens, details.rejected_prediction_tokens

    plain = chat()
    text = plain.choices[0].message.content
    assert counts(plain) == (0, 0)
    right = chat(prediction={"type": "content", "content": text})
    assert right.choices[0].message.content == text and counts(right) == (36, 0)
    half = len(text) // 2
    wrong = chat(prediction={"type": "content", "content": [
        {"type": "text", "text": text[:half]}, {"type": "text", "text": " zq" * 20}]})
    assert wrong.choices[0].message.content == text
    assert counts(wrong)[1] > 0, counts(wrong)


def test_allowed_token_ids_and_bad_words_over_http(client, model_name, model_dir):
    """vLLM's allowed_token_ids and bad_words through the OpenAI SDK's extra_body: sampled
    outputs hold allowed tokens only; a greedy completion never writes a banned one-token
    word (its free completion did)."""
    allowed = list(range(30, 60))
    reply = client.completions.create(
        model=model_name, prompt="Once upon a time", max_tokens=12, temperature=1.0, n=3,
        seed=5, logprobs=0, extra_body={"allowed_token_ids": allowed, "ignore_eos": True,
                                        "return_tokens_as_token_ids": True})
    for choice in reply.choices:
        ids = [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
        assert len(ids) == 12 and set(ids) <= set(allowed), ids
    def greedy_ids(**extra):
        reply = client.completions.create(
            model=model_name, prompt="Once upon a time", max_tokens=12, temperature=0,
            logprobs=0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True,
                                    **extra})
        return [int(t.removeprefix("token_id:")) for t in reply.choices[0].logprobs.tokens]

    free = greedy_ids()
    tok = HFReference(model_dir).tokenizer
    # a token of the free completion that is a word of its own: its text encodes to it
    word, token = next((tok.decode([t]), t) for t in free if tok.decode([t]).strip() and (
        tok.encode(tok.decode([t]).lstrip(), add_special_tokens=False) == [t]
        or tok.encode(" " + tok.decode([t]).lstrip(), add_special_tokens=False) == [t]))
    banned = greedy_ids(bad_words=[word])
    assert token in free and token not in banned and banned != free


def test_completions_unary_stream_n_seed_stop_logprobs(client, model_name):
    kw = dict(model=model_name, prompt="The router owns", max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})
    unary = client.completions.create(**kw)
    text = unary.choices[0].text
    assert unary.choices[0].finish_reason == "length" and unary.usage.completion_tokens == 12
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)
                       if c.choices)
    assert streamed == text
    # stop: a piece of the greedy text ends it there
    stop = text[len(text) // 2:len(text) // 2 + 3]
    if stop.strip():
        cut = client.completions.create(**kw, stop=[stop])
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].text == text[:text.index(stop)]
    # n=2 sampled with a seed: the same twice, two different samples
    sampled = dict(model=model_name, prompt="The router owns", max_tokens=10, n=2,
                   temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    a = client.completions.create(**sampled)
    b = client.completions.create(**sampled)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert [c.index for c in a.choices] == [0, 1]
    # logprobs: greedy picks the top token
    lp = client.completions.create(**kw, logprobs=3).choices[0].logprobs
    assert len(lp.tokens) == 12
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)


def test_chat_stream_concatenates_to_unary_with_usage_and_logprobs(client, model_name):
    kw = dict(model=model_name, messages=CONVERSATION[:2], max_completion_tokens=10,
              temperature=0, extra_body={"ignore_eos": True})
    unary = client.chat.completions.create(**kw, logprobs=True, top_logprobs=2)
    entries = unary.choices[0].logprobs.content
    assert len(entries) == 10 and all(len(e.top_logprobs) == 2 for e in entries)
    assert all(e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-4) for e in entries)
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == unary.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_bad_input_gets_an_error_object_and_the_server_keeps_serving(client, model_name):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_name, prompt="x", max_tokens=10**6)
    assert err.value.status_code == 400 and "max_tokens" in err.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-this-one", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_name, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url",
                                          "image_url": {"url": "http://x/y.png"}}]}])
    assert client.completions.create(model=model_name, prompt="x", max_tokens=2).choices


def test_disconnect_mid_stream_leaks_no_block(cluster, client, model_name):
    stream = client.completions.create(model=model_name, prompt="A long story", stream=True,
                                       max_tokens=400, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    status = cluster.wait_blocks_free(timeout_s=20)
    assert all(e.num_free_gpu_blocks == e.num_gpu_blocks for e in status.executors)
    assert "pagedserve_kv_blocks_leaked{" in cluster.metrics()
    for line in cluster.metrics().splitlines():
        if line.startswith("pagedserve_kv_blocks_leaked{"):
            assert float(line.rsplit(" ", 1)[1]) == 0
        if line.startswith("pagedserve_request_failure_total{") and 'api="http"' in line \
                and 'code="CANCELLED"' in line:
            assert float(line.rsplit(" ", 1)[1]) >= 1


def test_a_full_queue_is_429(cluster, model_name):
    async def burst():
        async with aiohttp.ClientSession(f"http://{cluster.http_address}") as http:
            body = {"model": model_name, "prompt": "burst", "max_tokens": 4}

            async def one():
                async with http.post("/v1/completions", json=body) as r:
                    return r.status, await r.json()
            return await asyncio.gather(*[one() for _ in range(24)])

    replies = asyncio.run(burst())
    codes = sorted({status for status, _ in replies})
    assert codes == [200, 429], codes
    refused = next(reply for status, reply in replies if status == 429)
    assert refused["error"]["type"] == "rate_limit_error"
    assert "queue is full" in refused["error"]["message"]
    cluster.wait_blocks_free(timeout_s=20)


def test_a_second_router_beside_this_one(cluster, model_dir):
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.cli", "router", "--model", str(model_dir),
         "--port", "0", "--metrics-port", "-1", "--http-port", "0",
         "--executor-bind", f"tcp://127.0.0.1:{free_port()}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not READY.search(line):
            line = proc.stdout.readline()
        m = READY.search(line)
        assert m, line
        assert m.group(4) not in ("off", cluster.http_address)
        with pytest.raises(urllib.error.HTTPError) as err:  # no executor: 503
            urllib.request.urlopen(f"http://{m.group(4)}/health", timeout=10)
        assert err.value.code == 503
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    taken = cluster.http_address.rsplit(":", 1)[1]  # this cluster's HTTP port: one line, exit 2
    busy = subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", "router", "--model", str(model_dir),
         "--port", "0", "--metrics-port", "-1", "--http-port", taken,
         "--executor-bind", f"tcp://127.0.0.1:{free_port()}"],
        capture_output=True, text=True, timeout=60)
    assert busy.returncode == 2, busy.stderr
    assert busy.stderr.strip().splitlines()[-1].startswith(
        f"pagedserve router: cannot bind the HTTP server to 127.0.0.1:{taken}"), busy.stderr
    assert "Traceback" not in busy.stderr


def test_draining_503_and_abort_endings(cluster, model_name):
    """Runs last: SIGTERM the router with a stream open."""
    body = {"model": model_name, "prompt": "Drain me", "stream": True,  # to the context end
            "extra": 1, "ignore_eos": True}

    async def main():
        events = []
        async with aiohttp.ClientSession(f"http://{cluster.http_address}") as http, \
                http.post("/v1/completions", json=body) as r:
            async for line in r.content:
                events.append(line.decode().strip())
                if len([e for e in events if e]) == 3:
                    break
            cluster.router.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            async with http.post("/v1/completions", json={
                    "model": model_name, "prompt": "late", "max_tokens": 2}) as refused:
                assert refused.status == 503
                assert "draining" in (await refused.json())["error"]["message"]
            async with http.get("/health") as health:
                assert health.status == 503
            async for line in r.content:
                events.append(line.decode().strip())
        return [e[len("data: "):] for e in events if e]

    events = asyncio.run(main())
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
    assert cluster.router.wait(timeout=30) == 0
