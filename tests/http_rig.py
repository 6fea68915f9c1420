"""The OpenAI HTTP edge's test rig: a real aiohttp server on port 0 over a fake Engine
(fake_engine.py), and the client helpers of test_http_edge.py and test_http_errors.py."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
from fake_engine import FakeEngine
from pagedserve.router.frontend import Frontend
from pagedserve.router.http_server import start_http_server
from pagedserve.router.metrics import RouterMetrics
from pagedserve.router.validation import Limits

MODEL = "tiny-chat"


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
