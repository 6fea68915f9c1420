"""Router edge: the gRPC servicer over a fake Engine (real grpc.aio server on port 0, real stubs).

The fake engine uses TextAssembler exactly as the real engine is meant to: one per sample,
`append(token)` after every step, `finish("abort")` on abort.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import subprocess
import time
import urllib.request

import grpc
import pytest
from fake_engine import FakeEngine, eventually, make_tokenizer
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2_grpc as pb_grpc
from pagedserve.router.frontend import Frontend
from pagedserve.router.grpc_server import SERVICE_NAME, start_server
from pagedserve.router.metrics import RouterMetrics
from pagedserve.router.tokenizer import Tokenizer
from pagedserve.router.validation import Limits


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return make_tokenizer(tmp_path_factory)


@contextlib.asynccontextmanager
async def serve(tok, step_s=0.002, max_model_len=256, **kwargs):
    engine = FakeEngine(tok, step_s=step_s)
    metrics = RouterMetrics()
    limits = Limits(vocab_size=tok.vocab_size, max_model_len=max_model_len)
    server, port = await start_server(
        Frontend(engine, tok, limits, metrics), "127.0.0.1", 0, health_poll_s=0.02, **kwargs,
    )
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield engine, pb_grpc.GeneratorStub(channel), channel, server, metrics
    finally:
        await channel.close()
        await server.stop(0)


def _run(coro):
    asyncio.run(asyncio.wait_for(coro, 30))


def _failures(metrics: RouterMetrics, code: str) -> float:
    return metrics.registry.get_sample_value("pagedserve_request_failure_total", {"code": code, "api": "grpc"}) or 0.0


def _req(rid="", prompt="Once upon", **params):
    return pb.GenerateRequest(request_id=rid, prompt=prompt, params=pb.SamplingParams(**params))


async def _read_rest(call):
    out = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        out.append(msg)
    return out


async def _collect(stub, req):
    chunks = [c async for c in stub.Stream(req)]
    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    for c in chunks:
        texts[c.index] = texts.get(c.index, "") + c.text
        ids.setdefault(c.index, []).extend(c.token_ids)
    return chunks, texts, ids


# --------------------------------------------------------------------------- tests


def test_generate_and_stream_agree(tok):
    async def main():
        async with serve(tok) as (engine, stub, *_rest, metrics):
            params = dict(max_tokens=40, n=2, stop=["テキ", "words"], seed=1, logprobs=2)
            resp = await stub.Generate(_req("g1", **params))
            assert resp.request_id == "g1" and len(resp.completions) == 2
            chunks, texts, ids = await _collect(stub, _req("s1", **params))
            for c in resp.completions:
                assert c.finish_reason == pb.STOP and c.stop_string in ("テキ", "words")
                assert texts[c.index] == c.text and ids[c.index] == list(c.token_ids)
                assert len(c.logprobs) == len(c.token_ids) and len(c.logprobs[0].top) == 2
                assert not c.HasField("stop_token_id")
            assert resp.completions[0].text == "Hello there, 日本語の"
            # finish fields only on each sample's last chunk; usage only on the final chunk
            for index in (0, 1):
                mine = [c for c in chunks if c.index == index]
                assert [c.finish_reason != pb.FINISH_REASON_UNSPECIFIED for c in mine] == [
                    False] * (len(mine) - 1) + [True]
            assert [c.HasField("usage") for c in chunks] == [False] * (len(chunks) - 1) + [True]
            usage = chunks[-1].usage
            assert usage == resp.usage and usage.cached_prompt_tokens == 3
            assert usage.prompt_tokens == len(tok.encode("Once upon"))
            assert usage.completion_tokens == sum(len(c.token_ids) for c in resp.completions)
            length = await stub.Generate(_req(max_tokens=5))
            assert length.completions[0].finish_reason == pb.LENGTH
            assert len(length.completions[0].token_ids) == 5
            assert engine.submitted[-1].request_id == length.request_id != ""
            assert metrics.registry.get_sample_value(
                "pagedserve_request_success_total", {"finish_reason": "stop", "api": "grpc"}) == 4
            assert metrics.registry.get_sample_value(
                "pagedserve_time_to_first_token_seconds_count") == 3

    _run(main())


def test_server_assigns_unique_ids(tok):
    async def main():
        async with serve(tok) as (_e, stub, *_):
            a, b = await asyncio.gather(stub.Generate(_req(max_tokens=2)), stub.Generate(_req(max_tokens=2)))
            assert a.request_id and b.request_id and a.request_id != b.request_id
            chunks = [c async for c in stub.Stream(_req(max_tokens=2))]
            assert chunks[0].request_id and all(c.request_id == chunks[0].request_id for c in chunks)

    _run(main())


def test_abort_running_stream_and_pending_generate(tok):
    async def main():
        async with serve(tok, step_s=0.02) as (engine, stub, *_rest, metrics):
            call = stub.Stream(_req("a1", max_tokens=200))
            first = await call.read()
            assert first.request_id == "a1"
            await stub.Abort(pb.AbortRequest(request_id="a1"))
            rest = await _read_rest(call)
            assert rest[-1].finish_reason == pb.ABORT and rest[-1].HasField("usage")
            assert await call.code() == grpc.StatusCode.OK
            pending = asyncio.ensure_future(stub.Generate(_req("a2", max_tokens=200)))
            await asyncio.sleep(0.1)
            await stub.Abort(pb.AbortRequest(request_id="a2"))
            resp = await pending
            assert resp.completions[0].finish_reason == pb.ABORT
            assert 0 < len(resp.completions[0].token_ids) < 200
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Abort(pb.AbortRequest(request_id="nope"))
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            assert _failures(metrics, "NOT_FOUND") == 1

    _run(main())


def test_already_exists_and_engine_errors(tok):
    async def main():
        async with serve(tok, step_s=0.02) as (engine, stub, *_rest, metrics):
            call = stub.Stream(_req("dup", max_tokens=100))
            await call.read()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Generate(_req("dup"))
            assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
            call.cancel()
            engine.queue_full = True
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Generate(_req("q"))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert _failures(metrics, "ALREADY_EXISTS") == 1
            assert _failures(metrics, "RESOURCE_EXHAUSTED") == 1

    _run(main())


@pytest.mark.parametrize(
    "req, field",
    [
        (_req(temperature=math.nan), "temperature"),
        (_req(prompt=""), "prompt"),
        (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[10**6])), "prompt_token_ids"),
        (_req(max_tokens=300), "max_tokens"),
        (_req(n=17), "n"),
    ],
)
def test_bad_requests_are_invalid_argument(tok, req, field):
    async def main():
        async with serve(tok) as (engine, stub, *_rest, metrics):
            for rpc in (stub.Generate, stub.Stream):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    call = rpc(req)
                    if rpc is stub.Stream:
                        [c async for c in call]
                    else:
                        await call
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert field in info.value.details()
            assert not engine.submitted
            assert _failures(metrics, "INVALID_ARGUMENT") == 2

    _run(main())


def test_client_cancel_aborts_the_request(tok):
    async def main():
        async with serve(tok, step_s=0.02) as (engine, stub, *_rest, metrics):
            call = stub.Stream(_req("c1", max_tokens=200))
            await call.read()
            call.cancel()
            await eventually(lambda: "c1" in engine.aborted and not engine.live)
            assert "c1" in engine.aborted and not engine.live
            assert _failures(metrics, "CANCELLED") == 1
            task = asyncio.ensure_future(stub.Generate(_req("c2", max_tokens=200)))
            await asyncio.sleep(0.1)
            task.cancel()
            await eventually(lambda: "c2" in engine.aborted)
            assert "c2" in engine.aborted

    _run(main())


def test_deadline_exceeded_aborts_the_request(tok):
    async def main():
        async with serve(tok, step_s=0.02) as (engine, stub, *_rest, metrics):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Generate(_req("d1", max_tokens=200), timeout=0.2)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await eventually(lambda: "d1" in engine.aborted)
            assert "d1" in engine.aborted
            assert engine.submitted[0].deadline is not None
            await eventually(lambda: _failures(metrics, "DEADLINE_EXCEEDED") == 1)
            assert _failures(metrics, "DEADLINE_EXCEEDED") == 1
            assert _failures(metrics, "CANCELLED") == 0

    _run(main())


def test_client_gone_near_its_deadline_counts_as_deadline_exceeded(tok):
    """The client's own deadline timer cancels the call; that cancel can arrive a little
    before the server's copy of the deadline passes (CI saw CANCELLED counted once)."""
    fe = Frontend(FakeEngine(tok), tok, Limits(vocab_size=tok.vocab_size, max_model_len=64))
    now = time.monotonic()
    gone = asyncio.CancelledError()
    assert fe.ending_code(gone, now + 0.03) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert fe.ending_code(gone, now - 1.0) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert fe.ending_code(gone, now + 5.0) == grpc.StatusCode.CANCELLED
    assert fe.ending_code(gone, None) == grpc.StatusCode.CANCELLED
    assert fe.ending_code(ConnectionResetError(), now + 0.03) == grpc.StatusCode.DEADLINE_EXCEEDED


def test_model_info_and_cluster_status(tok):
    async def main():
        async with serve(tok) as (_e, stub, *_):
            info = await stub.GetModelInfo(pb.ModelInfoRequest())
            assert (info.model, info.max_model_len, list(info.eos_token_ids)) == ("tiny", 256, [1])
            status = await stub.GetClusterStatus(pb.ClusterStatusRequest())
            assert status.executors[0].id == "e0" and status.executors[0].waiting == 2
            assert (status.prefix_cache_queries, status.prefix_cache_hits) == (10, 4)

    _run(main())


def test_health_transitions_and_draining(tok):
    async def main():
        async with serve(tok) as (engine, stub, channel, server, _m):
            health = health_pb2_grpc.HealthStub(channel)

            async def status(service):
                resp = await health.Check(health_pb2.HealthCheckRequest(service=service))
                return resp.status

            async def wait_for(service, want):
                for _ in range(200):
                    if await status(service) == want:
                        return
                    await asyncio.sleep(0.01)
                raise AssertionError(f"{service!r} never became {want}")

            serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
            assert await status("") == serving
            assert await status(SERVICE_NAME) == serving
            engine.serving = False
            await wait_for(SERVICE_NAME, not_serving)
            assert await status("") == serving
            engine.serving = True
            await wait_for(SERVICE_NAME, serving)
            await server.drain()
            assert await status("") == not_serving and await status(SERVICE_NAME) == not_serving
            await asyncio.sleep(0.05)
            assert await status(SERVICE_NAME) == not_serving  # the poller keeps it down
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Generate(_req())
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    _run(main())


def test_reflection_lists_the_services(tok):
    async def main():
        async with serve(tok) as (_e, _s, channel, *_):
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)

            async def requests():
                yield reflection_pb2.ServerReflectionRequest(list_services="")

            names = []
            async for resp in stub.ServerReflectionInfo(requests()):
                names = [s.name for s in resp.list_services_response.service]
            assert SERVICE_NAME in names and "grpc.health.v1.Health" in names

    _run(main())


DESIGN_METRICS = [
    "pagedserve_requests_running", "pagedserve_requests_waiting", "pagedserve_requests_swapped",
    "pagedserve_kv_blocks_total", "pagedserve_kv_blocks_free", "pagedserve_kv_cache_usage_ratio",
    "pagedserve_kv_cpu_blocks_total", "pagedserve_kv_cpu_blocks_free", "pagedserve_kv_blocks_leaked",
    "pagedserve_prefix_cache_queries_total", "pagedserve_prefix_cache_hits_total",
    "pagedserve_preemptions_total", "pagedserve_migrations_total", "pagedserve_prompt_tokens_total",
    "pagedserve_generation_tokens_total", "pagedserve_request_success_total",
    "pagedserve_request_failure_total", "pagedserve_executors_healthy",
    "pagedserve_time_to_first_token_seconds", "pagedserve_inter_token_latency_seconds",
    "pagedserve_time_per_output_token_seconds", "pagedserve_e2e_request_latency_seconds",
    "pagedserve_queue_time_seconds", "pagedserve_step_forward_seconds",
]


def test_metrics_endpoint_serves_the_design_names():
    m = RouterMetrics()
    assert m.serve(-1) is None
    port = m.serve(0)
    try:
        m.set_executor_gauges("e0", running=1, waiting=2, swapped=0, num_gpu_blocks=10,
                              num_free_gpu_blocks=4, num_cpu_blocks=8, num_free_cpu_blocks=8)
        m.add_prefix_cache("e0", 32, 16)
        m.inc_preemption("e0", "swap")
        m.inc_failure(grpc.StatusCode.UNAVAILABLE, api="grpc")
        m.observe_step_forward("e0", 0.00012)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        m.shutdown()
    types = {line.split()[2] for line in body.splitlines() if line.startswith("# TYPE")}
    for name in DESIGN_METRICS:
        assert name in types or name.removesuffix("_total") in types, name
    assert 'pagedserve_kv_cache_usage_ratio{executor="e0"} 0.6' in body
    assert 'pagedserve_preemptions_total{executor="e0",mode="swap"} 1.0' in body
    assert 'pagedserve_request_failure_total{api="grpc",code="UNAVAILABLE"} 1.0' in body
    assert 'pagedserve_step_forward_seconds_bucket{executor="e0",le="0.0001"} 0.0' in body
    assert 'pagedserve_step_forward_seconds_bucket{executor="e0",le="0.00025"} 1.0' in body
    with pytest.raises(ValueError):
        m.inc_preemption("e0", "teleport")


def test_long_prompt_is_tokenized_off_the_loop(tok):
    async def main():
        async with serve(tok, max_model_len=100_000) as (engine, stub, *_):
            prompt = "the quick brown fox " * 1000
            resp = await stub.Generate(_req(prompt=prompt, max_tokens=2), timeout=10)
            assert len(resp.completions[0].token_ids) == 2
            assert engine.submitted[-1].prompt_token_ids == tuple(tok.encode(prompt))

    _run(main())


def test_tls_flags_must_be_complete():
    from pagedserve.router.edge_security import server_credentials

    assert server_credentials(None, None) is None
    with pytest.raises(ValueError, match="go together"):
        server_credentials("cert.pem", None)
    with pytest.raises(ValueError, match="needs --tls-cert"):
        server_credentials(None, None, "ca.pem")
    with pytest.raises(ValueError, match="cannot read"):
        server_credentials("/nonexistent/cert.pem", "/nonexistent/key.pem")


def _make_certs(d):
    def sh(*args):
        subprocess.run(args, check=True, capture_output=True, cwd=d)

    sh("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-keyout", "ca.key",
       "-out", "ca.pem", "-subj", "/CN=test-ca")
    for name in ("server", "client"):
        sh("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
           f"{name}.csr", "-subj", "/CN=localhost")
        (d / f"{name}.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
        sh("openssl", "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
           "-CAcreateserial", "-days", "1", "-out", f"{name}.pem", "-extfile", f"{name}.ext")


def test_mutual_tls(tok, tmp_path):
    try:
        _make_certs(tmp_path)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("openssl is not available")
    p = {n: str(tmp_path / n) for n in ("server.pem", "server.key", "ca.pem")}

    async def main():
        engine = FakeEngine(tok)
        limits = Limits(vocab_size=tok.vocab_size, max_model_len=256)
        server, port = await start_server(
            Frontend(engine, tok, limits), "127.0.0.1", 0,
            tls_cert=p["server.pem"], tls_key=p["server.key"], tls_client_ca=p["ca.pem"],
        )
        read = lambda n: (tmp_path / n).read_bytes()  # noqa: E731
        try:
            good = grpc.ssl_channel_credentials(read("ca.pem"), read("client.key"), read("client.pem"))
            async with grpc.aio.secure_channel(f"127.0.0.1:{port}", good) as ch:
                resp = await pb_grpc.GeneratorStub(ch).Generate(_req(max_tokens=3), timeout=10)
                assert len(resp.completions[0].token_ids) == 3
            no_cert = grpc.ssl_channel_credentials(read("ca.pem"))
            async with grpc.aio.secure_channel(f"127.0.0.1:{port}", no_cert) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await pb_grpc.GeneratorStub(ch).Generate(_req(max_tokens=3), timeout=5)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(0)

    _run(main())


def test_a_call_that_ended_before_its_answer_is_one_info_line(caplog):
    """grpc's asyncio server logs ERROR + traceback when a handler's answer finds the call
    already ended (client deadline at that moment): the server's filter makes it one INFO
    line; other grpc errors stay as they are."""
    import logging

    from pagedserve.router.grpc_server import LATE_END_FILTER

    grpc_log = logging.getLogger("grpc._cython.cygrpc")
    grpc_log.addFilter(LATE_END_FILTER)
    try:
        with caplog.at_level(logging.INFO, logger="grpc._cython.cygrpc"):
            try:
                raise RuntimeError('Failed "execute_batch"')
            except RuntimeError:
                grpc_log.exception("ExecuteBatchError raised in core by servicer method [%s]",
                                   "/pagedserve.v1.Generator/Generate")
                grpc_log.exception("Unexpected [ValueError] raised by servicer method [/x]")
    finally:
        grpc_log.removeFilter(LATE_END_FILTER)
    late, other = caplog.records
    assert late.levelno == logging.INFO and late.exc_info is None
    assert late.getMessage() == ("/pagedserve.v1.Generator/Generate: the call ended (client "
                                 "deadline or cancel) before its final message was sent")
    assert other.levelno == logging.ERROR and other.exc_info is not None


def test_stream_chunks_are_the_same_message_on_the_steady_path():
    """chunk_to_pb builds the steady token's chunk with only its set fields: the bytes equal
    the full form's; any ending, stop or logprob takes the full form."""
    from pagedserve.router.grpc_server import chunk_to_pb
    from pagedserve.router.types import CompletionDelta, TokenLogprob

    def full(rid, d):
        chunk = pb.GenerateStreamResponse(
            request_id=rid, index=d.index, text=d.text, token_ids=d.token_ids,
            finish_reason={None: 0, "length": pb.LENGTH, "stop": pb.STOP}[d.finish_reason],
            stop_string=d.stop_string or "",
            logprobs=[pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                                      top=[pb.TopLogprob(token_id=t, logprob=v)
                                           for t, v in lp.top]) for lp in d.logprobs])
        if d.stop_token_id is not None:
            chunk.stop_token_id = d.stop_token_id
        return chunk

    for d in (CompletionDelta(0, " hi", (5,)), CompletionDelta(1, "", (7, 8)),
              CompletionDelta(2, "é", ()), CompletionDelta(0, "", (9,), finish_reason="length"),
              CompletionDelta(0, "x", (3,), (TokenLogprob(3, -0.5, ((3, -0.5), (4, -1.0))),)),
              CompletionDelta(1, "", (2,), finish_reason="stop", stop_token_id=2),
              CompletionDelta(0, "ab", (6,), finish_reason="stop", stop_string="END")):
        got = chunk_to_pb("r-1", d)
        assert got == full("r-1", d), d
        assert got.SerializeToString() == full("r-1", d).SerializeToString()
    assert chunk_to_pb("r", CompletionDelta(0, "", (2,), finish_reason="stop",
                                            stop_token_id=2)).HasField("stop_token_id")
