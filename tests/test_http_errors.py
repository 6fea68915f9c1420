"""The OpenAI HTTP edge's failures over a fake Engine: every bad input's status and error
object, 429/503, draining, clients that disconnect (mid-stream, mid-write, unary), a stream
that fails before its first token, mutual TLS, a port in use."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest
from fake_engine import FakeEngine, eventually, make_tokenizer
from http_rig import MODEL, _metric, _post, _run, _sse, fail_every_submit, serve
from pagedserve.router.frontend import Frontend
from pagedserve.router.http_server import start_http_server
from pagedserve.router.tokenizer import Tokenizer
from pagedserve.router.validation import Limits


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return make_tokenizer(tmp_path_factory)


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
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400,
     "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "n": 2, "top_p": 0.5}, 400,
     "top_p"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "n": 2, "stop": "."}, 400,
     "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2,
                              "use_beam_search": True, "response_format":
                              {"type": "json_object"}}, 400, "structured_output"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "n": 2,
                         "length_penalty": 11}, 400, "length_penalty"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "n": 2,
                         "early_stopping": "soon"}, 400, "early_stopping"),
    ("/v1/completions", {"prompt": "x", "length_penalty": 2}, 400, "length_penalty"),
    ("/v1/completions", {"prompt": "x", "early_stopping": True}, 400, "early_stopping"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": "yes"}, 400, "use_beam_search"),
    ("/v1/completions", {"prompt": "x", "logits_processors": ["m.f"]}, 400,
     "logits_processors"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "allowed_token_ids": [1, "2"]}, 400, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [10**9]}, 400,
     "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "bad_words": [1]}, 400, "bad_words"),
    ("/v1/completions", {"prompt": "x", "bad_words": ["ok", "  "]}, 400, "bad_words"),
    ("/v1/completions", {"prompt": "x", "bad_words": ["w"] * 129}, 400, "bad_words"),
    ("/v1/completions", {"prompt": "x", "return_tokens_as_token_ids": 1}, 400,
     "return_tokens_as_token_ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "return_token_ids": "yes"}, 400, "return_token_ids"),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": -2}, 400,
     "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "x", "add_special_tokens": "no"}, 400, "add_special_tokens"),
    ("/v1/completions", {"prompt": "x", "echo": True, "truncate_prompt_tokens": 1}, 400,
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


LONG_STREAM = {"prompt": "Once upon", "max_tokens": 200, "ignore_eos": True, "stream": True}


async def _leave_mid_stream(engine, http, metrics, *, close: bool) -> None:
    """Read a long stream's first event, then the request ends early: by the client closing
    the connection (`close`), or (the connection still open) by what the server does;
    either way it is aborted, and counted CANCELLED once."""
    async with http.post("/v1/completions", json=LONG_STREAM) as r:
        await r.content.readline()
        rid = next(iter(engine.live))
        if not close:
            await eventually(lambda: rid in engine.aborted and not engine.live)
    await eventually(lambda: rid in engine.aborted and not engine.live)
    assert rid in engine.aborted and not engine.live
    await eventually(lambda: _metric(metrics, "pagedserve_request_failure_total",
                                     code="CANCELLED", api="http"))
    assert _metric(metrics, "pagedserve_request_failure_total", code="CANCELLED",
                   api="http") == 1


def test_client_disconnect_aborts_the_request(tok):
    async def main():
        async with serve(tok, step_s=0.02) as (engine, _, http, metrics):
            await _leave_mid_stream(engine, http, metrics, close=True)
            body = LONG_STREAM
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

    real_send, sends = http_server.send_events, []

    async def send_then_reset(stream, chunks, writer, done=False):
        sends.append(len(chunks))
        if len(sends) == 3:
            raise ConnectionResetError("Cannot write to closing transport")
        await real_send(stream, chunks, writer, done)

    monkeypatch.setattr(http_server, "send_events", send_then_reset)

    async def main():
        async with serve(tok, step_s=0.02) as (engine, _, http, metrics):
            await _leave_mid_stream(engine, http, metrics, close=False)

    with caplog.at_level(logging.ERROR):
        _run(main())
    assert len(sends) == 3
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_stream_failure_before_the_first_token_is_an_error_event(tok):
    async def main():
        async with serve(tok) as (engine, _, http, _):
            fail_every_submit(engine)
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
