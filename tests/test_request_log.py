"""The request log (`--log-requests`, Frontend.log_request): one line per request that ended,
through either edge, with its status, finish reasons, token counts and latencies, never its
prompt or output; JSON keys of their own with --log-format json; off by default."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import aiohttp
import grpc
import pytest
from fake_engine import FakeEngine, make_tokenizer
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2_grpc as pb_grpc
from pagedserve.router.frontend import Frontend
from pagedserve.router.grpc_server import start_server
from pagedserve.router.http_server import start_http_server
from pagedserve.router.metrics import RouterMetrics
from pagedserve.router.validation import Limits

from pagedserve.logs import JsonFormatter

PROMPT = "Once upon a time in a quiet village"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory)


@contextlib.asynccontextmanager
async def edges(tok, log_requests=True, step_s=0.002):
    engine = FakeEngine(tok, step_s=step_s)
    frontend = Frontend(engine, tok, Limits(vocab_size=tok.vocab_size, max_model_len=256),
                        RouterMetrics(), log_requests=log_requests)
    http = await start_http_server(frontend, "127.0.0.1", 0, served_model_name="m",
                                   max_model_len=256)
    server, port = await start_server(frontend, "127.0.0.1", 0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{http.port}") as session:
            yield engine, session, pb_grpc.GeneratorStub(channel)
    finally:
        await channel.close()
        await server.stop(0)
        await http.stop()


def _records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "pagedserve.requests"]


def test_each_ending_is_one_line(tok, caplog):
    caplog.set_level(logging.INFO, logger="pagedserve.requests")

    async def main():
        async with edges(tok) as (engine, http, stub):
            prompt_len = len(tok.encode(PROMPT))
            async with http.post("/v1/completions", json={
                    "prompt": PROMPT, "max_tokens": 4, "n": 2, "temperature": 0.5}) as r:
                assert r.status == 200
                http_reply = await r.json()
            async with http.post("/v1/completions", json={"prompt": "x", "max_tokens": -1}) as r:
                assert r.status == 400
            reply = await stub.Generate(pb.GenerateRequest(
                request_id="g-1", prompt=PROMPT, params=pb.SamplingParams(max_tokens=3)))
            assert len(reply.completions[0].token_ids) == 3
            # a stream its client leaves after the first tokens
            engine.step_s = 0.05
            call = stub.Stream(pb.GenerateRequest(request_id="gone-1", prompt=PROMPT,
                                                  params=pb.SamplingParams(max_tokens=50)))
            async for chunk in call:
                if chunk.token_ids:
                    break
            call.cancel()
            await asyncio.sleep(0.3)
            return prompt_len, http_reply
    prompt_len, http_reply = asyncio.run(asyncio.wait_for(main(), 30))
    recs = _records(caplog)
    assert [(r.api, r.status) for r in recs] == [
        ("http", "OK"), ("http", "INVALID_ARGUMENT"), ("grpc", "OK"), ("grpc", "CANCELLED")]
    ok, bad, grpc_ok, gone = recs
    assert ok.request_id.startswith(http_reply["id"]) and ok.finish == "length,length"
    cached = http_reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert (ok.prompt_tokens, ok.output_tokens, ok.cached_tokens) == (prompt_len, 8, cached)
    assert 0 < ok.ttft_ms <= ok.e2e_ms
    assert bad.request_id == "-" and bad.finish == "-" and bad.output_tokens == 0
    assert not hasattr(bad, "ttft_ms")
    assert grpc_ok.request_id == "g-1" and grpc_ok.output_tokens == 3
    assert gone.request_id == "gone-1" and gone.finish == "-" and 1 <= gone.output_tokens < 50
    for r in recs:  # never the prompt's or the output's text
        line = r.getMessage()
        assert "Once upon" not in line and "quiet" not in line
        assert line.startswith(f"request_id={r.request_id} api={r.api} status={r.status} ")


def test_json_lines_carry_the_fields_as_keys(tok, caplog):
    caplog.set_level(logging.INFO, logger="pagedserve.requests")

    async def main():
        async with edges(tok) as (_, http, _stub), http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}) as r:
            assert r.status in (200, 400)  # the fake tokenizer may have no template
    asyncio.run(asyncio.wait_for(main(), 30))
    (rec,) = _records(caplog)
    data = json.loads(JsonFormatter().format(rec))
    assert data["logger"] == "pagedserve.requests"
    for key in ("request_id", "api", "status", "finish", "prompt_tokens", "cached_tokens",
                "output_tokens", "e2e_ms"):
        assert key in data, key
    assert isinstance(data["prompt_tokens"], int) and isinstance(data["e2e_ms"], float)


def test_off_by_default(tok, caplog):
    caplog.set_level(logging.INFO, logger="pagedserve.requests")

    async def main():
        async with edges(tok, log_requests=False) as (_, http, _stub), \
                http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}) as r:
            assert r.status == 200
    asyncio.run(asyncio.wait_for(main(), 30))
    assert _records(caplog) == []


# ------------------------------------------------------------------------- X-Request-Id


def test_x_request_id_names_the_request_and_comes_back(tok, caplog):
    """A client's X-Request-Id is the request's id (response id, engine ids, request log,
    abort by id); every answer carries X-Request-Id; a live id again is 409; a malformed
    one is a 400 naming the header."""
    caplog.set_level(logging.INFO, logger="pagedserve.requests")

    async def main():
        async with edges(tok) as (engine, http, stub):
            hdr = {"X-Request-Id": "trace-42"}
            async with http.post("/v1/completions", headers=hdr, json={
                    "prompt": [PROMPT, "Another prompt"], "max_tokens": 2}) as r:
                assert r.status == 200 and r.headers["X-Request-Id"] == "trace-42"
                assert (await r.json())["id"] == "cmpl-trace-42"
            assert [s.request_id for s in engine.submitted] == ["cmpl-trace-42-0",
                                                                "cmpl-trace-42-1"]
            async with http.post("/v1/embeddings", headers={"X-Request-Id": "e-1"},
                                 json={"input": "hi"}) as r:
                assert r.headers["X-Request-Id"] == "e-1"
            # no header: the response's own id comes back
            async with http.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                    "stream": True}) as r:
                rid = r.headers["X-Request-Id"]
                first = json.loads((await r.content.readline()).decode()[len("data: "):])
                assert rid.startswith("chatcmpl-") and first["id"] == rid
                await r.read()
            # a live id again: 409, the first one unharmed
            engine.step_s = 0.05
            slow = asyncio.ensure_future(http.post("/v1/completions", headers={
                "X-Request-Id": "dup"}, json={"prompt": PROMPT, "max_tokens": 6}))
            await asyncio.sleep(0.1)
            async with http.post("/v1/completions", headers={"X-Request-Id": "dup"},
                                 json={"prompt": PROMPT, "max_tokens": 2}) as r:
                assert r.status == 409 and r.headers["X-Request-Id"] == "dup"
            first_dup = await slow
            assert first_dup.status == 200
            first_dup.release()
            engine.step_s = 0.002
            # gRPC Abort finds it by the id the client chose
            hung = asyncio.ensure_future(http.post("/v1/completions", headers={
                "X-Request-Id": "to-abort"}, json={"prompt": PROMPT, "max_tokens": 200,
                                                   "ignore_eos": True}))
            await asyncio.sleep(0.2)
            await stub.Abort(pb.AbortRequest(request_id="cmpl-to-abort-0"))
            aborted = await hung
            assert (await aborted.json())["choices"][0]["finish_reason"] == "abort"
            for bad in ("has space", "x" * 257, "caf\u00e9"):
                async with http.post("/v1/completions", headers={"X-Request-Id": bad},
                                     json={"prompt": PROMPT, "max_tokens": 2}) as r:
                    assert r.status == 400 and "X-Request-Id" not in r.headers
                    assert (await r.json())["error"]["param"] == "X-Request-Id"
            async with http.post("/v1/completions", headers={"X-Request-Id": "bad-body"},
                                 json={"prompt": PROMPT, "max_tokens": -1}) as r:
                assert r.status == 400 and r.headers["X-Request-Id"] == "bad-body"
    asyncio.run(asyncio.wait_for(main(), 30))
    ids = [r.request_id for r in _records(caplog)]
    assert ids[:2] == ["cmpl-trace-42-0", "cmpl-trace-42-1"] and "embd-e-1-0" in ids
