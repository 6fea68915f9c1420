"""API keys (`--api-key`, router/edge_security.py): the flag's parsing, the bearer check, both
edges refusing a call without a valid key before the engine sees it (HTTP 401 with OpenAI's
error object, gRPC UNAUTHENTICATED, each counted), the open probes, the OpenAI SDK and
pagedserve's clients with a key, and a real router whose API workers hold the keys."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import aiohttp
import grpc
import pytest
from cluster_harness import router_alone
from fake_engine import FakeEngine, make_tokenizer
from grpc_health.v1 import health_pb2, health_pb2_grpc
from http_rig import http_edge
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2_grpc as pb_grpc
from pagedserve.router.edge_security import (
    INVALID,
    MISSING,
    ApiKeys,
    bearer_token,
    grpc_metadata,
    parse_api_keys,
    read_key_file,
)
from pagedserve.router.frontend import Frontend
from pagedserve.router.grpc_server import start_server
from pagedserve.router.http_server import start_http_server
from pagedserve.router.metrics import RouterMetrics
from pagedserve.router.validation import Limits

from pagedserve.flags import FlagError
from pagedserve.serve import without_api_keys

KEYS = ("sk-first-0123456789", "sk-second/rotated+key==")
CLI = [sys.executable, "-m", "pagedserve.cli"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory)


def _run(coro):
    asyncio.run(asyncio.wait_for(coro, 30))


def _refusals(metrics: RouterMetrics, api: str) -> float:
    return metrics.registry.get_sample_value(
        "pagedserve_request_failure_total", {"code": "UNAUTHENTICATED", "api": api}) or 0.0


# ------------------------------------------------------------------------ the flag, the check


def test_parse_api_keys():
    assert parse_api_keys("") == ()
    assert parse_api_keys("abc") == ("abc",)
    assert parse_api_keys(" a-1 , b.2~ ,a-1") == ("a-1", "b.2~")  # trimmed, each once
    assert parse_api_keys("tok/en+68==") == ("tok/en+68==",)
    for bad, why in [("a,,b", "key 2 of the list is empty"), ("a,", "key 2 of the list"),
                     ("a b", "key 1 has a character"), ("k=x", "key 1 has a character"),
                     ("ok,caf\u00e9", "key 2 has a character"), ("x" * 1025, "longer than 1024")]:
        with pytest.raises(ValueError, match=why) as info:
            parse_api_keys(bad)
        assert bad not in str(info.value) or len(bad) < 4  # the key itself is never echoed


def test_bearer_token_and_check():
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer   abc ") == "abc"
    for no in (None, "", "Bearer", "Bearer  ", "Basic abc", "abc"):
        assert bearer_token(no) is None
    keys = ApiKeys(KEYS)
    assert len(keys) == 2 and keys and not ApiKeys()
    assert ApiKeys().check(None) is None  # no keys: everything allowed
    assert keys.check(None) == MISSING and keys.check("Basic sk-first-0123456789") == MISSING
    assert keys.check("Bearer sk-first-012345678") == INVALID  # a prefix is not the key
    assert keys.check("Bearer sk-first-01234567890") == INVALID
    assert keys.check("Bearer SK-FIRST-0123456789") == INVALID  # case matters
    assert keys.check("Bearer \udcff") == INVALID  # undecodable header bytes: no crash
    for key in KEYS:
        assert keys.check(f"Bearer {key}") is None


def test_key_file_lines_comments_and_errors(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# rotation of 2026-11\n\n  sk-a  \nsk-b,sk-c\n# sk-old\nsk-a\n")
    assert read_key_file(str(f)) == ("sk-a", "sk-b", "sk-c")
    f.write_text("sk-a\nsk bad\n")
    with pytest.raises(ValueError, match="line 2: key 1 has a character") as info:
        read_key_file(str(f))
    assert "sk bad" not in str(info.value)


def test_key_file_is_re_read_when_it_changes(tmp_path, caplog):
    """Rotation without a restart: a new key valid and a removed one refused once the file
    changes; a bad or missing file keeps the keys read before (said once); an emptied file
    refuses every key (it never opens the API)."""
    caplog.set_level(logging.INFO, logger="pagedserve.router.edge_security")
    f = tmp_path / "keys"
    f.write_text("sk-one\n")
    keys = ApiKeys(["sk-flag"], file=str(f), recheck_s=0)
    assert keys and len(keys) == 2
    assert keys.check("Bearer sk-one") is None and keys.check("Bearer sk-flag") is None

    def rewrite(text):  # a new inode, as a Secret's update or an editor's save gives
        tmp = tmp_path / "keys.new"
        tmp.write_text(text)
        os.replace(tmp, f)

    rewrite("sk-two\n")
    assert keys.check("Bearer sk-two") is None and keys.check("Bearer sk-one") == INVALID
    assert keys.check("Bearer sk-flag") is None  # --api-key's stay
    rewrite("sk-three\nnot a key\n")
    for _ in range(3):
        assert keys.check("Bearer sk-two") is None and keys.check("Bearer sk-three") == INVALID
    f.unlink()
    assert keys.check("Bearer sk-two") is None
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and "line 2" in errors[0] and "No such file" in errors[1]
    assert all("the 1 key(s) read before stay valid" in e for e in errors)
    rewrite("# no keys for now\n")
    assert keys.check("Bearer sk-two") == INVALID and keys.check(None) == MISSING
    assert keys.check("Bearer sk-flag") is None
    only_file = ApiKeys(file=str(f), recheck_s=0)
    assert only_file and only_file.check("Bearer anything") == INVALID  # empty: closed
    assert "(changed)" in caplog.text


def test_key_file_is_looked_at_once_a_recheck(tmp_path):
    f = tmp_path / "keys"
    f.write_text("sk-one\n")
    keys = ApiKeys(file=str(f), recheck_s=3600)
    f.write_text("sk-two-longer\n")
    assert keys.check("Bearer sk-one") is None  # not looked at again yet
    keys._next_check = 0.0  # the hour passed
    assert keys.check("Bearer sk-one") == INVALID and keys.check("Bearer sk-two-longer") is None


def test_flag_and_environment_never_show_a_key(monkeypatch, capsys):
    from pagedserve.cli import _server_parser
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "sk-from-env-42,sk-other")
    parser = _server_parser("pagedserve router", "")
    assert parser.parse_args([]).api_key == ("sk-from-env-42", "sk-other")
    assert parser.parse_args(["--api-key", "k1"]).api_key == ("k1",)
    assert "sk-from-env-42" not in parser.format_help()
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "sk-bad key")
    with pytest.raises(FlagError) as info:
        _server_parser("pagedserve router", "")
    assert "sk-bad" not in str(info.value) and "PAGEDSERVE_API_KEY=(not shown)" in str(info.value)


def test_executors_never_get_the_keys():
    argv = ["--api-key", "k1", "--executors", "2", "--api-key=k2", "--api-k", "k3",
            "--api-workers", "0", "--api-ke=k4", "--model", "m"]
    assert without_api_keys(argv) == ["--executors", "2", "--api-workers", "0", "--model", "m"]


# ------------------------------------------------------------------------------- HTTP edge


def keyed_edge(tok):
    return http_edge(tok, served_model_name="m", api_keys=ApiKeys(KEYS))


def test_http_refuses_without_a_key_and_serves_with_one(tok):
    async def main():
        async with keyed_edge(tok) as (engine, _, metrics, base), \
                aiohttp.ClientSession(base) as s:
            body = {"model": "m", "prompt": "Once upon", "max_tokens": 3}
            for headers, message in [({}, MISSING),
                                     ({"Authorization": "Bearer sk-wrong"}, INVALID),
                                     ({"Authorization": f"Basic {KEYS[0]}"}, MISSING)]:
                for method, path in [("POST", "/v1/completions"), ("GET", "/v1/models"),
                                     ("POST", "/tokenize"), ("GET", "/no/such/route")]:
                    async with s.request(method, path, json=body, headers=headers) as r:
                        assert r.status == 401, (path, headers)
                        assert r.headers["WWW-Authenticate"] == "Bearer"
                        assert await r.json() == {"error": {
                            "message": message, "type": "invalid_request_error",
                            "param": None, "code": "invalid_api_key"}}
            assert engine.submitted == []  # nothing reached the engine
            assert _refusals(metrics, "http") == 12
            for path in ("/health", "/version"):  # the probes stay open
                async with s.get(path) as r:
                    assert r.status == 200, path
            for key in KEYS:  # either key of a rotation
                auth = {"Authorization": f"Bearer {key}"}
                async with s.post("/v1/completions", json=body, headers=auth) as r:
                    assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 3
                async with s.get("/no/such/route", headers=auth) as r:
                    assert r.status == 404  # with a key, the route's own answer
            assert len(engine.submitted) == 2 and _refusals(metrics, "http") == 12
    _run(main())


def test_openai_sdk_with_the_key(tok):
    openai = pytest.importorskip("openai")

    async def main():
        async with keyed_edge(tok) as (engine, _, _metrics, base):
            good = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEYS[1], max_retries=0)
            out = await good.completions.create(model="m", prompt="Once upon", max_tokens=2)
            assert out.usage.completion_tokens == 2
            bad = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="sk-nope", max_retries=0)
            with pytest.raises(openai.AuthenticationError) as info:
                await bad.models.list()
            assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
            await good.close()
            await bad.close()
    _run(main())


def test_bench_sends_the_key(tok):
    """`pagedserve bench --api-key` over HTTP (openai) and gRPC: every request passes; the
    same without the key: every request is refused."""
    from pagedserve.bench import BenchConfig, run_bench

    async def bench(cfg):
        engine = FakeEngine(tok)
        frontend = Frontend(engine, tok, Limits(vocab_size=tok.vocab_size, max_model_len=256),
                            RouterMetrics())
        keys = ApiKeys(KEYS)
        http = await start_http_server(frontend, "127.0.0.1", 0, served_model_name="m",
                                       max_model_len=256, api_keys=keys)
        server, port = await start_server(frontend, "127.0.0.1", 0, api_keys=keys)
        try:
            cfg.address = f"127.0.0.1:{http.port if cfg.backend == 'openai' else port}"
            return await run_bench(cfg)
        finally:
            await http.stop()
            await server.stop(0)

    for backend in ("openai", "grpc"):
        for key, completed in ((KEYS[1], 4), (None, 0)):
            cfg = BenchConfig(address="", backend=backend, num_prompts=4, model="m",
                              vocab_size=tok.vocab_size, input_len_range=(4, 8),
                              output_len_range=(2, 3), progress=False, api_key=key)
            if backend == "grpc" and key is None:  # its first call, GetModelInfo, is refused
                with pytest.raises(grpc.aio.AioRpcError, match="UNAUTHENTICATED"):
                    asyncio.run(bench(cfg))
                continue
            res = asyncio.run(bench(cfg))
            assert (res["completed"], res["failed"]) == (completed, 4 - completed), res


# ------------------------------------------------------------------------------- gRPC edge


def test_grpc_refuses_every_generator_method_without_a_key(tok):
    async def main():
        engine = FakeEngine(tok)
        metrics = RouterMetrics()
        frontend = Frontend(engine, tok, Limits(vocab_size=tok.vocab_size, max_model_len=256),
                            metrics)
        server, port = await start_server(frontend, "127.0.0.1", 0, health_poll_s=0.02,
                                          api_keys=ApiKeys(KEYS))
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = pb_grpc.GeneratorStub(channel)
        req = pb.GenerateRequest(prompt="Once upon", params=pb.SamplingParams(max_tokens=3))
        calls = {
            "Generate": lambda md: stub.Generate(req, metadata=md, timeout=10),
            "Stream": lambda md: _drain(stub.Stream(req, metadata=md, timeout=10)),
            "Abort": lambda md: stub.Abort(pb.AbortRequest(request_id="x"), metadata=md),
            "GetModelInfo": lambda md: stub.GetModelInfo(pb.ModelInfoRequest(), metadata=md),
            "GetClusterStatus": lambda md: stub.GetClusterStatus(pb.ClusterStatusRequest(),
                                                                 metadata=md),
        }
        try:
            for md, message in [((), MISSING), (grpc_metadata("sk-wrong"), INVALID),
                                ((("authorization", KEYS[0]),), MISSING)]:
                for name, call in calls.items():
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await call(md)
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
                    assert info.value.details() == message
            assert engine.submitted == [] and _refusals(metrics, "grpc") == 15
            health = health_pb2_grpc.HealthStub(channel)  # open without a key
            reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            for key in KEYS:
                md = grpc_metadata(key)
                resp = await calls["Generate"](md)
                assert len(resp.completions[0].token_ids) == 3
                chunks = await calls["Stream"](md)
                assert sum(len(c.token_ids) for c in chunks) == 3
                assert (await calls["GetModelInfo"](md)).vocab_size == tok.vocab_size
            assert len(engine.submitted) == 4 and _refusals(metrics, "grpc") == 15
        finally:
            await channel.close()
            await server.stop(0)
    _run(main())


async def _drain(call) -> list:
    return [chunk async for chunk in call]


# ------------------------------------------------------- a real router, through API workers


def test_router_with_api_workers_needs_a_key(tmp_path_factory):
    """`pagedserve router --api-key K1 --api-key-file F(K2) --api-workers 1` (no executor: a
    request that gets past the key meets UNAVAILABLE, the engine's answer), pagedserve's
    own clients, and F rotated while it runs (the worker re-reads it)."""
    from pagedserve.tinymodels import build_model
    work = tmp_path_factory.mktemp("keys")
    model = str(build_model(work / "tiny", hidden_size=32,
                            num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64))
    key_file = work / "api-keys"
    key_file.write_text(f"# the second key\n{KEYS[1]}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    missing = subprocess.run(CLI + ["router", "--model", model, "--api-key-file",
                                    str(work / "nope")], capture_output=True, text=True,
                             env=env, timeout=60)
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        f"pagedserve router: --api-key-file {work / 'nope'}: No such file or directory"]
    with router_alone(model, "--api-workers", "1", "--api-key", KEYS[0], "--api-key-file",
                      str(key_file), "--log-requests", "--allowed-origins",
                      "https://ui.example", env=env) as (m, lines, proc):
        address, http = m.group(1), "http://" + m.group(4)
        assert any("need an API key (1 from --api-key, the others from" in line
                   for line in lines), "".join(lines)
        assert not any(k in line for line in lines for k in KEYS)  # never logged

        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.GeneratorStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.GetModelInfo(pb.ModelInfoRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert stub.GetModelInfo(pb.ModelInfoRequest(), timeout=10,
                                     metadata=grpc_metadata(KEYS[1])).block_size == 16

        def get(path, key=None):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            try:
                with urllib.request.urlopen(urllib.request.Request(http + path, headers=headers),
                                            timeout=10) as r:
                    return r.status
            except urllib.error.HTTPError as exc:
                return exc.code
        assert get("/v1/models") == 401 and get("/v1/models", "sk-no") == 401
        assert get("/v1/models", KEYS[0]) == 200
        assert get("/health") == 503  # open: no executor yet, not 401
        # --allowed-origins reaches the API worker: a browser's preflight, before the key
        preflight = urllib.request.Request(
            http + "/v1/chat/completions", method="OPTIONS",
            headers={"Origin": "https://ui.example", "Access-Control-Request-Method": "POST"})
        with urllib.request.urlopen(preflight, timeout=10) as r:
            assert r.status == 204
            assert r.headers["Access-Control-Allow-Origin"] == "https://ui.example"

        def generate(*args, key_env=None):
            run_env = dict(env, **({"PAGEDSERVE_API_KEY": key_env} if key_env else {}))
            return subprocess.run(CLI + ["generate", "hi", "--address", address,
                                         "--timeout", "20", *args],
                                  capture_output=True, text=True, env=run_env, timeout=60)
        refused = generate("--api-key", "sk-wrong")
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr, refused.stderr
        for passed in (generate("--api-key", KEYS[0]), generate(key_env=",".join(KEYS))):
            # past the key: the engine's own answer (no executor has joined)
            assert passed.returncode == 1 and "UNAVAILABLE" in passed.stderr, passed.stderr

        # rotation: the file's key replaced while the router runs, no restart
        new = work / "api-keys.new"
        new.write_text("sk-rotated-in\n")
        os.replace(new, key_file)
        time.sleep(1.2)  # FILE_RECHECK_S
        assert get("/v1/models", "sk-rotated-in") == 200
        assert get("/v1/models", KEYS[1]) == 401 and get("/v1/models", KEYS[0]) == 200
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.GeneratorStub(channel)
            assert stub.GetModelInfo(pb.ModelInfoRequest(), timeout=10,
                                     metadata=grpc_metadata("sk-rotated-in")).block_size == 16
            with pytest.raises(grpc.RpcError) as info:
                stub.GetModelInfo(pb.ModelInfoRequest(), timeout=10,
                                  metadata=grpc_metadata(KEYS[1]))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    rest = proc.stdout.read()
    # --log-requests in the API worker: the two requests past the key, not the refusals
    logged = [x for x in rest.splitlines() if "pagedserve.requests" in x]
    assert len(logged) == 2 and all("api=grpc status=UNAVAILABLE" in x for x in logged), rest
