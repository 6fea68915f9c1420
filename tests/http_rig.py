"""The OpenAI HTTP edge's test rig: a real aiohttp server on port 0 over a fake Engine
(fake_engine.py), the client helpers of the HTTP tests, and their any-JSON strategy."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
from fake_engine import FakeEngine
from hypothesis import strategies as st
from pagedserve.router.frontend import Frontend
from pagedserve.router.http_server import start_http_server
from pagedserve.router.metrics import RouterMetrics
from pagedserve.router.validation import Limits

MODEL = "tiny-chat"

# Any JSON value (for bodies' fields): a request or a 400 naming the field, never a 500.
ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=6)


@contextlib.asynccontextmanager
async def http_edge(tok, step_s=0.002, max_model_len=256, log_requests=False, **server):
    """The HTTP edge on port 0 over a FakeEngine, `server`: start_http_server's keywords
    (served_model_name MODEL unless given). Yields (engine, frontend, metrics, base URL)."""
    engine = FakeEngine(tok, step_s=step_s)
    metrics = RouterMetrics()
    frontend = Frontend(engine, tok, Limits(vocab_size=tok.vocab_size,
                                             max_model_len=max_model_len), metrics,
                        log_requests=log_requests)
    server.setdefault("served_model_name", MODEL)
    http = await start_http_server(frontend, "127.0.0.1", 0, max_model_len=max_model_len,
                                   **server)
    try:
        yield engine, frontend, metrics, f"http://127.0.0.1:{http.port}"
    finally:
        await http.stop()


@contextlib.asynccontextmanager
async def serve(tok, step_s=0.002, max_model_len=256):
    async with http_edge(tok, step_s, max_model_len) as (engine, frontend, metrics, base):
        session = aiohttp.ClientSession(base)
        try:
            yield engine, frontend, session, metrics
        finally:
            await session.close()


@contextlib.asynccontextmanager
async def scripted(tok, text: str | None = None, **parsers):
    """A server whose engine answers every request with `text` then EOS (the fake's own
    script when None); `parsers`: start_http_server's tool_call_parser / reasoning_parser.
    Yields (engine, client session)."""
    engine = FakeEngine(tok)
    if text is not None:
        engine.script = tok.encode(text)[1:] + [tok.eos_token_ids[0]]
    frontend = Frontend(engine, tok, Limits(vocab_size=tok.vocab_size, max_model_len=256),
                        RouterMetrics())
    server = await start_http_server(frontend, "127.0.0.1", 0, served_model_name=MODEL,
                                     max_model_len=256, **parsers)
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as session:
            yield engine, session
    finally:
        await server.stop()


def fail_every_submit(engine) -> None:
    """Every request the engine takes fails before its first output (UNAVAILABLE)."""
    async def failing(spec):
        async def outputs():
            from pagedserve.router.errors import Unavailable
            raise Unavailable("the executor running the request died")
            yield  # pragma: no cover
        return outputs()
    engine.submit = failing


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


async def named_events(response, limit: int | None = None) -> list[dict]:
    """A named SSE stream's events (the Responses API's): `event: TYPE` then `data: JSON`,
    each data's type its name; at most `limit` (then the caller leaves)."""
    events, name = [], None
    assert response.status == 200, await response.text()
    async for line in response.content:
        line = line.decode().rstrip("\n")
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            event = json.loads(line[len("data: "):])
            assert event["type"] == name
            events.append(event)
            if limit is not None and len(events) == limit:
                break
        else:
            assert not line, line
    return events
