"""CORS on the HTTP API (`--allowed-origins`, router/http_cors.py): preflights answered before
the key check for allowed origins only, every answer to an allowed origin marked (streams
too), nothing for other origins or without the flag."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest
from fake_engine import make_tokenizer
from http_rig import http_edge
from pagedserve.router.edge_security import ApiKeys
from pagedserve.router.http_cors import parse_origins

APP = "https://app.example.com"
KEY = {"Authorization": "Bearer sk-cors"}
PREFLIGHT = {"Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type, x-request-id"}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory)


@contextlib.asynccontextmanager
async def server(tok, origins):
    async with http_edge(tok, api_keys=ApiKeys(["sk-cors"]), allowed_origins=origins) as (
            engine, _, _metrics, base), aiohttp.ClientSession(base) as session:
        yield engine, session


def test_parse_origins():
    assert parse_origins("") == ()
    assert parse_origins("*") == ("*",)
    assert parse_origins(f" {APP} , HTTP://LocalHost:3000/ ,{APP}") == (
        APP, "http://localhost:3000")
    for bad in ("app.example.com", "https://app.example.com/path", "https://a b"):
        with pytest.raises(ValueError, match="is not an origin"):
            parse_origins(bad)


def test_allowed_origin_preflight_and_answers(tok):
    async def main():
        async with server(tok, (APP, "http://localhost:3000")) as (engine, s):
            async with s.options("/v1/chat/completions",
                                 headers={"Origin": APP, **PREFLIGHT}) as r:
                assert r.status == 204  # before the key check: a preflight carries no key
                assert r.headers["Access-Control-Allow-Origin"] == APP
                assert r.headers["Access-Control-Allow-Methods"] == "GET, POST, OPTIONS"
                assert r.headers["Access-Control-Allow-Headers"] == PREFLIGHT[
                    "Access-Control-Request-Headers"]
                assert r.headers["Access-Control-Max-Age"] == "600"
            async with s.options("/v1/completions", headers={
                    "Origin": "https://evil.example", **PREFLIGHT}) as r:
                assert r.status == 403 and "Access-Control-Allow-Origin" not in r.headers
            body = {"prompt": "Once upon", "max_tokens": 2}
            for origin, marked in ((APP, True), ("HTTP://LOCALHOST:3000", True),
                                   ("https://evil.example", False), (None, False)):
                headers = {**KEY, **({"Origin": origin} if origin else {})}
                async with s.post("/v1/completions", json=body, headers=headers) as r:
                    assert r.status == 200
                    assert ("Access-Control-Allow-Origin" in r.headers) == marked, origin
                    if marked:
                        assert r.headers["Access-Control-Allow-Origin"] == origin
                        assert r.headers["Access-Control-Expose-Headers"] == "X-Request-Id"
                        assert r.headers["Vary"] == "Origin"
            # a stream and a refused key are marked too: the page can read why
            async with s.post("/v1/completions", json={**body, "stream": True},
                              headers={**KEY, "Origin": APP}) as r:
                assert r.headers["Access-Control-Allow-Origin"] == APP
                assert (await r.text()).endswith("data: [DONE]\n\n")
            async with s.post("/v1/completions", json=body, headers={"Origin": APP}) as r:
                assert r.status == 401 and r.headers["Access-Control-Allow-Origin"] == APP
    asyncio.run(asyncio.wait_for(main(), 30))


def test_any_origin_and_none(tok):
    async def main():
        async with server(tok, ("*",)) as (_, s):
            async with s.options("/v1/models", headers={"Origin": "https://x.dev",
                                                        **PREFLIGHT}) as r:
                assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == "*"
            async with s.get("/v1/models", headers={**KEY, "Origin": "https://x.dev"}) as r:
                assert r.headers["Access-Control-Allow-Origin"] == "*" and "Vary" not in r.headers
        async with server(tok, ()) as (_, s):  # the default: no origin allowed
            async with s.options("/v1/models", headers={"Origin": APP, **PREFLIGHT}) as r:
                assert r.status in (401, 405) and "Access-Control-Allow-Origin" not in r.headers
            async with s.get("/v1/models", headers={**KEY, "Origin": APP}) as r:
                assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
    asyncio.run(asyncio.wait_for(main(), 30))
