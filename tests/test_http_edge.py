"""The OpenAI HTTP edge over a fake Engine (a real aiohttp server on port 0, real HTTP clients):
response shapes, server-sent events, every bad input's status and error object, 429/503,
draining, a client that disconnects, and the api="http" request metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import aiohttp
import pytest
from fake_engine import FakeEngine, eventually, make_tokenizer
from pagedserve.router.frontend import Frontend
from pagedserve.router.http_server import start_http_server
from pagedserve.router.metrics import RouterMetrics
from pagedserve.router.tokenizer import Tokenizer
from pagedserve.router.validation import Limits

MODEL = "tiny-chat"


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return make_tokenizer(tmp_path_factory)


@contextlib.asynccontextmanager
async def serve(tok, step_s=0.002, max_model_len=256):
    engine = FakeEngine(tok, step_s=step_s)
    metrics = RouterMetrics()
    frontend = Frontend(engine, tok, Limits(vocab_size=tok.vocab_size,
                                             max_model_len=max_model_len), metrics)
    server = await start_http_server(frontend, "127.0.0.1", 0, served_model_name=MODEL,
                                     max_model_len=max_model_len)
    session = aiohttp.ClientSession(f"http://127.0.0.1:{server.port}")
    try:
        yield engine, frontend, session, metrics
    finally:
        await session.close()
        await server.stop()


def _run(coro):
    asyncio.run(asyncio.wait_for(coro, 30))


async def _post(session, path, body):
    async with session.post(path, json=body) as r:
        return r.status, await r.json()


async def _sse(session, path, body) -> list:
    """The events of a stream: parsed JSON objects, then the string "[DONE]"."""
    events = []
    async with session.post(path, json=body) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        async for line in r.content:
            line = line.decode().rstrip("\n")
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _metric(metrics, name, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


# ------------------------------------------------------------------ shapes


def test_models_and_health(tok):
    async def main():
        async with serve(tok) as (engine, frontend, http, _):
            async with http.get("/v1/models") as r:
                body = await r.json()
            assert r.status == 200 and body["object"] == "list"
            assert [m["id"] for m in body["data"]] == [MODEL]
            assert body["data"][0]["object"] == "model" and body["data"][0]["max_model_len"] == 256
            async with http.get(f"/v1/models/{MODEL}") as r:
                assert r.status == 200 and (await r.json())["id"] == MODEL
            async with http.get("/v1/models/other") as r:
                assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
            async with http.get("/health") as r:
                assert r.status == 200
            engine.serving = False
            async with http.get("/health") as r:
                assert r.status == 503 and "no executor" in (await r.json())["error"]["message"]

    _run(main())


def test_completion_unary_shape_and_usage(tok):
    async def main():
        async with serve(tok) as (engine, _, http, metrics):
            status, body = await _post(http, "/v1/completions", {
                "model": MODEL, "prompt": "Once upon", "max_tokens": 5, "n": 2,
                "temperature": 0, "seed": -3, "user": "u1", "unknown_field": [1, 2]})
            assert status == 200, body
            assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
            assert body["model"] == MODEL and isinstance(body["created"], int)
            assert [c["index"] for c in body["choices"]] == [0, 1]
            for c in body["choices"]:
                assert c["finish_reason"] == "length" and c["logprobs"] is None
                assert isinstance(c["text"], str) and c["text"]
            prompt_len = len(tok.encode("Once upon"))
            assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 10,
                                     "total_tokens": prompt_len + 10,
                                     "prompt_tokens_details": {"cached_tokens": 3}}
            spec = engine.submitted[-1]
            assert spec.sampling.n == 2 and spec.sampling.seed == 2**64 - 3
            assert _metric(metrics, "pagedserve_request_success_total",
                           finish_reason="length", api="http") == 2
            assert _metric(metrics, "pagedserve_request_success_total",
                           finish_reason="length", api="grpc") == 0

    _run(main())


def test_max_tokens_omitted_runs_to_the_context_limit(tok):
    async def main():
        async with serve(tok, max_model_len=64) as (engine, _, http, _):
            await _post(http, "/v1/completions", {"prompt": "Once upon", "ignore_eos": True,
                                                  "stop_token_ids": [], "max_tokens": None})
            assert engine.submitted[-1].sampling.max_tokens == 64 - len(tok.encode("Once upon"))

    _run(main())


def test_completion_prompt_list_numbers_choices_by_prompt(tok):
    async def main():
        async with serve(tok) as (engine, _, http, _):
            ids = tok.encode("A list")
            status, body = await _post(http, "/v1/completions", {
                "prompt": ["Once upon", ids], "max_tokens": 3, "n": 2})
            assert status == 200, body
            assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
            assert sorted(tuple(s.prompt_token_ids) for s in engine.submitted) == \
                sorted([tuple(tok.encode("Once upon")), tuple(ids)])
            assert body["usage"]["completion_tokens"] == 12

    _run(main())


def test_completion_logprobs(tok):
    async def main():
        async with serve(tok) as (_, _, http, _):
            status, body = await _post(http, "/v1/completions", {
                "prompt": "Once upon", "max_tokens": 4, "logprobs": 2})
            assert status == 200, body
            lp = body["choices"][0]["logprobs"]
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 4
            assert lp["token_logprobs"] == [-0.5] * 4
            assert all(len(top) <= 2 for top in lp["top_logprobs"])
            assert lp["text_offset"][0] == 0
            assert lp["text_offset"] == sorted(lp["text_offset"])

    _run(main())


def test_chat_unary_and_stream(tok):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                             {"type": "text", "text": "there"}]}]

    async def main():
        async with serve(tok) as (engine, _, http, _):
            status, body = await _post(http, "/v1/chat/completions", {
                "model": MODEL, "messages": messages, "max_completion_tokens": 6,
                "logprobs": True, "top_logprobs": 1})
            assert status == 200, body
            assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
            choice = body["choices"][0]
            assert choice["message"]["role"] == "assistant"
            assert choice["finish_reason"] == "length"
            entries = choice["logprobs"]["content"]
            assert len(entries) == 6 and all(len(e["top_logprobs"]) == 1 for e in entries)
            assert entries[0]["bytes"] == list(entries[0]["token"].encode())
            assert engine.submitted[-1].sampling.logprobs == 1
            prompt = engine.submitted[-1].prompt_text
            assert "<|im_start|>system\nBe brief.<|im_end|>" in prompt
            assert prompt.endswith("<|im_start|>assistant\n")

            events = await _sse(http, "/v1/chat/completions", {
                "messages": messages, "max_tokens": 6, "stream": True,
                "stream_options": {"include_usage": True}})
            assert events[-1] == "[DONE]"
            chunks = events[:-1]
            assert all(c["object"] == "chat.completion.chunk" for c in chunks)
            assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
            assert all(c["usage"] is None for c in chunks[:-1])
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
            assert text == choice["message"]["content"]
            assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"

    _run(main())


def test_completion_stream_concatenates_to_unary(tok):
    async def main():
        async with serve(tok) as (_, _, http, _):
            body = {"prompt": "Once upon", "max_tokens": 8, "n": 2, "stop": "日本"}
            _, unary = await _post(http, "/v1/completions", body)
            events = await _sse(http, "/v1/completions", {**body, "stream": True})
            assert events[-1] == "[DONE]" and "usage" not in events[0]
            for i in (0, 1):
                parts = [c["choices"][0] for c in events[:-1] if c["choices"][0]["index"] == i]
                assert "".join(p["text"] for p in parts) == unary["choices"][i]["text"]
                assert parts[-1]["finish_reason"] == unary["choices"][i]["finish_reason"]
                assert parts[-1]["stop_reason"] == unary["choices"][i]["stop_reason"]

    _run(main())


# ------------------------------------------------------------------ errors


BAD = [
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": 101}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 99}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "logprobs": 99}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, 400,
     "echo"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 300}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt_token_ids"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400,
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0].type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "logprobs": True, "top_logprobs": 21}, 400, "logprobs"),
]


def test_bad_inputs_get_their_status_and_error_object(tok):
    async def main():
        async with serve(tok) as (engine, _, http, metrics):
            for path, body, status, param in BAD:
                got, reply = await _post(http, path, body)
                assert got == status, (body, reply)
                err = reply["error"]
                assert set(err) == {"message", "type", "param", "code"}, reply
                assert err["param"] == param, (body, err)
                assert err["type"] == "invalid_request_error" and err["message"]
            assert _metric(metrics, "pagedserve_request_failure_total",
                           code="INVALID_ARGUMENT", api="http") == len(BAD) - 1
            assert _metric(metrics, "pagedserve_request_failure_total",
                           code="NOT_FOUND", api="http") == 1
            for raw in (b"{not json", b"[1, 2]"):
                async with http.post("/v1/completions", data=raw) as r:
                    assert r.status == 400 and "JSON" in (await r.json())["error"]["message"]
            async with http.get("/v1/nothing") as r:
                assert r.status == 404 and "error" in await r.json()
            async with http.get("/v1/completions") as r:
                assert r.status == 405 and "error" in await r.json()
            assert engine.submitted == []  # nothing bad reached the engine
            _, ok = await _post(http, "/v1/completions", {"prompt": "x", "max_tokens": 2})
            assert ok["choices"][0]["finish_reason"] == "length"  # still serving

    _run(main())


def test_queue_full_is_429_and_no_executor_503(tok):
    async def main():
        async with serve(tok) as (engine, _, http, metrics):
            engine.queue_full = True
            status, body = await _post(http, "/v1/completions", {"prompt": "x"})
            assert status == 429 and body["error"]["type"] == "rate_limit_error"
            engine.queue_full = False
            engine.serving = False
            status, body = await _post(http, "/v1/chat/completions",
                                       {"messages": [{"role": "user", "content": "hi"}]})
            assert status == 503 and body["error"]["code"] == "unavailable"
            assert _metric(metrics, "pagedserve_request_failure_total",
                           code="RESOURCE_EXHAUSTED", api="http") == 1
            assert _metric(metrics, "pagedserve_request_failure_total",
                           code="UNAVAILABLE", api="http") == 1

    _run(main())


def test_draining_refuses_new_requests_and_streams_end_with_abort(tok):
    async def main():
        async with serve(tok, step_s=0.02) as (engine, frontend, http, _):
            body = {"prompt": "Once upon", "max_tokens": 200, "ignore_eos": True,
                    "stream": True}
            reader = asyncio.ensure_future(_sse(http, "/v1/completions", body))
            while not engine.live:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            frontend.draining = True
            status, reply = await _post(http, "/v1/completions", {"prompt": "x"})
            assert status == 503 and "draining" in reply["error"]["message"]
            async with http.get("/health") as r:
                assert r.status == 503
            for rid in list(engine.live):  # the engine's drain deadline: abort what runs
                engine.abort(rid)
            events = await reader
            assert events[-1] == "[DONE]"
            assert events[-2]["choices"][0]["finish_reason"] == "abort"

    _run(main())


def test_client_disconnect_aborts_the_request(tok):
    async def main():
        async with serve(tok, step_s=0.02) as (engine, _, http, metrics):
            body = {"prompt": "Once upon", "max_tokens": 200, "ignore_eos": True,
                    "stream": True}
            async with http.post("/v1/completions", json=body) as r:
                await r.content.readline()
                rid = next(iter(engine.live))
            # the connection is closed here, mid-stream
            await eventually(lambda: rid in engine.aborted and not engine.live)
            assert rid in engine.aborted and not engine.live
            await eventually(lambda: _metric(metrics, "pagedserve_request_failure_total",
                                             code="CANCELLED", api="http"))
            assert _metric(metrics, "pagedserve_request_failure_total", code="CANCELLED",
                           api="http") == 1
            # a unary request whose client goes away is aborted too
            task = asyncio.ensure_future(_post(http, "/v1/completions", {**body,
                                                                          "stream": False}))
            while not engine.live:
                await asyncio.sleep(0.01)
            rid = next(iter(engine.live))
            task.cancel()
            await eventually(lambda: rid in engine.aborted)
            assert rid in engine.aborted

    _run(main())


def test_a_write_that_finds_the_client_gone_ends_the_stream_quietly(tok, monkeypatch, caplog):
    """A client that closes mid-stream can make a write fail before aiohttp cancels the
    handler (ClientConnectionResetError, a ConnectionError): the request is aborted and
    counted, and aiohttp logs no 'Error handling request' with a traceback."""
    from pagedserve.router import http_server

    real_send, sends = http_server._send, []

    async def send_then_reset(stream, chunks, done=False):
        sends.append(len(chunks))
        if len(sends) == 3:
            raise ConnectionResetError("Cannot write to closing transport")
        await real_send(stream, chunks, done)

    monkeypatch.setattr(http_server, "_send", send_then_reset)

    async def main():
        async with serve(tok, step_s=0.02) as (engine, _, http, metrics):
            body = {"prompt": "Once upon", "max_tokens": 200, "ignore_eos": True,
                    "stream": True}
            async with http.post("/v1/completions", json=body) as r:
                await r.content.readline()
                rid = next(iter(engine.live))
                await eventually(lambda: rid in engine.aborted and not engine.live)
            assert rid in engine.aborted and not engine.live
            await eventually(lambda: _metric(metrics, "pagedserve_request_failure_total",
                                             code="CANCELLED", api="http"))

    with caplog.at_level(logging.ERROR):
        _run(main())
    assert len(sends) == 3
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_stream_failure_before_the_first_token_is_an_error_event(tok):
    async def main():
        async with serve(tok) as (engine, _, http, _):
            async def failing(spec):
                async def outputs():
                    from pagedserve.router.errors import Unavailable
                    raise Unavailable("the executor running the request died")
                    yield  # pragma: no cover
                return outputs()
            engine.submit = failing
            events = await _sse(http, "/v1/completions", {"prompt": "x", "stream": True})
            assert events[-1] == "[DONE]"
            assert events[0]["error"]["code"] == "unavailable"

    _run(main())


def test_mutual_tls_applies_to_http(tok, tmp_path):
    import ssl
    import subprocess

    from test_router_edge_grpc import _make_certs
    try:
        _make_certs(tmp_path)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("openssl is not available")
    p = {n: str(tmp_path / n) for n in ("server.pem", "server.key", "ca.pem", "client.pem",
                                        "client.key")}

    async def main():
        frontend = Frontend(FakeEngine(tok), tok, Limits(vocab_size=tok.vocab_size,
                                                         max_model_len=256))
        server = await start_http_server(frontend, "127.0.0.1", 0, served_model_name=MODEL,
                                         max_model_len=256, tls_cert=p["server.pem"],
                                         tls_key=p["server.key"], tls_client_ca=p["ca.pem"])
        url = f"https://127.0.0.1:{server.port}/v1/completions"
        body = {"prompt": "Once upon", "max_tokens": 3}
        try:
            good = ssl.create_default_context(cafile=p["ca.pem"])
            good.load_cert_chain(p["client.pem"], p["client.key"])
            async with aiohttp.ClientSession() as http:
                async with http.post(url, json=body, ssl=good) as r:
                    assert r.status == 200
                    assert (await r.json())["usage"]["completion_tokens"] == 3
                no_cert = ssl.create_default_context(cafile=p["ca.pem"])
                with pytest.raises(aiohttp.ClientError):
                    async with http.post(url, json=body, ssl=no_cert) as r:
                        await r.read()
                with pytest.raises(aiohttp.ClientError):  # plaintext to a TLS port
                    async with http.post(url.replace("https", "http"), json=body) as r:
                        await r.read()
        finally:
            await server.stop()

    _run(main())


def test_a_port_in_use_is_one_clear_error(tok):
    import socket

    async def main():
        frontend = Frontend(FakeEngine(tok), tok, Limits(vocab_size=tok.vocab_size,
                                                         max_model_len=256))
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = busy.getsockname()[1]
            with pytest.raises(OSError, match=f"cannot bind the HTTP server to "
                                              f"127.0.0.1:{port}"):
                await start_http_server(frontend, "127.0.0.1", port, served_model_name=MODEL,
                                        max_model_len=256)

    _run(main())


# ------------------------------------------------------------------ any JSON: 400 or a request

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=6)
_FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
           "top_p", "n", "stream", "stream_options", "stop", "seed", "presence_penalty",
           "frequency_penalty", "logprobs", "top_logprobs", "user", "top_k", "min_p",
           "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
           "skip_special_tokens", "priority", "cache_salt", "echo", "best_of"]
_GOOD = {"prompt": "Once upon", "messages": [{"role": "user", "content": "hi"}]}


@settings(max_examples=200, deadline=None)
@given(chat=st.booleans(), body=st.dictionaries(st.sampled_from(_FIELDS), _JSON, max_size=5))
def test_any_json_body_is_a_request_or_a_400(tok, chat, body):
    """Whatever the field values: a clean InvalidRequest (400 with the field), never another
    exception (a 500)."""
    from pagedserve.router.errors import InvalidRequest
    from pagedserve.router.openai_protocol import chat_request, completion_request
    from pagedserve.router.validation import request_from_pb

    body = {**{k: v for k, v in _GOOD.items() if k == ("messages" if chat else "prompt")},
            **body}
    limits = Limits(vocab_size=tok.vocab_size, max_model_len=256)
    try:
        api = chat_request(body) if chat else completion_request(body)
        for request in api.requests:
            request_from_pb(request, tokenizer=tok, limits=limits, request_id="r",
                            default_max_tokens=None)
    except InvalidRequest as exc:
        assert exc.field and str(exc).startswith(exc.field), exc


def test_auto_tool_choice_with_the_hermes_parser(tok):
    """--tool-call-parser hermes: tool_choice "auto" lets the model answer freely and its
    <tool_call> blocks become the reply's tool_calls, unary and streamed; without the
    parser, auto is a 400."""
    hermes = ('Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
              '\n</tool_call>')
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "weather?"}],
            "tools": tools, "max_tokens": 200}

    async def main():
        async with serve(tok) as (engine, frontend, session, metrics):
            status, err = await _post(session, "/v1/chat/completions", body)
            assert status == 400 and err["error"]["param"] == "tool_choice"
        engine = FakeEngine(tok)
        engine.script = tok.encode(hermes)[1:] + [tok.eos_token_ids[0]]
        frontend = Frontend(engine, tok, Limits(vocab_size=tok.vocab_size, max_model_len=256),
                            RouterMetrics())
        server = await start_http_server(frontend, "127.0.0.1", 0, served_model_name=MODEL,
                                         max_model_len=256, tool_call_parser="hermes")
        async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as session:
            status, reply = await _post(session, "/v1/chat/completions", body)
            assert status == 200, reply
            choice = reply["choices"][0]
            assert choice["finish_reason"] == "tool_calls"
            assert choice["message"]["content"] == "Checking. "
            [call] = choice["message"]["tool_calls"]
            assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
            events = await _sse(session, "/v1/chat/completions", {**body, "stream": True})
            deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
            assert "".join(d.get("content") or "" for d in deltas) == "Checking. "
            calls = [c for d in deltas for c in d.get("tool_calls", [])]
            assert [c["function"] for c in calls] == [call["function"]]
            assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
        await server.stop()

    _run(main())
