"""Bad input: hypothesis-generated GenerateRequests over gRPC (wild values in every field) get
only OK, INVALID_ARGUMENT, ALREADY_EXISTS or RESOURCE_EXHAUSTED -- never INTERNAL, never a
hang -- and the server stays healthy with every block back; malformed ZeroMQ messages sent
to the router's executor socket are rejected and logged while it keeps serving."""

from __future__ import annotations

import math
import time

import grpc
import msgspec
import numpy as np
import pytest
import zmq
from cluster_harness import request
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pagedserve.protos import wire
from pagedserve.protos.codec import Codec
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
from wire_fake_executor import fake_cluster

from pagedserve.tinymodels import build_model

BLOCKS = 256
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
           grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.RESOURCE_EXHAUSTED}
TRIED = {"examples": 0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("llama"), "llama", num_kv_heads=2)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    c, _ = fake_cluster(model_dir, tmp_path_factory.mktemp("fake"), 1,
                        router_args=["--max-queue-len", "64"], num_gpu_blocks=BLOCKS)
    with c.running():
        yield c


def _healthy(cluster) -> None:
    status = cluster.wait_blocks_free(timeout_s=10)
    assert all(e.healthy and e.num_free_gpu_blocks == e.num_gpu_blocks
               for e in status.executors), status
    health = health_pb2_grpc.HealthStub(cluster.channel)
    resp = health.Check(health_pb2.HealthCheckRequest(service="pagedserve.v1.Generator"),
                        timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    assert "Traceback" not in cluster.logs()


U32 = st.one_of(st.integers(0, 40), st.integers(0, 2**32 - 1))
WILD_FLOAT = st.one_of(st.floats(width=32), st.sampled_from([math.nan, math.inf, -math.inf,
                                                             0.0, -0.0, 1e-45, 3.4e38]))
TEXT = st.one_of(st.text(max_size=40), st.just(""), st.just("\x00"),
                 st.text(alphabet="ab\u00e9\u4e2d\U0001f600", min_size=3000, max_size=5000))


@st.composite
def params(draw):
    p = pb.SamplingParams()
    for name, strat in [("max_tokens", st.one_of(st.integers(0, 12), U32)),
                        ("temperature", WILD_FLOAT), ("top_p", WILD_FLOAT),
                        ("top_k", st.integers(-(2**31), 2**31 - 1)), ("min_p", WILD_FLOAT),
                        ("seed", st.integers(0, 2**64 - 1)),
                        ("min_tokens", U32), ("n", st.one_of(st.integers(0, 3), U32)),
                        ("logprobs", st.one_of(st.integers(0, 25), U32)),
                        ("repetition_penalty", WILD_FLOAT), ("presence_penalty", WILD_FLOAT),
                        ("frequency_penalty", WILD_FLOAT), ("ignore_eos", st.booleans()),
                        ("include_stop_str_in_output", st.booleans()),
                        ("keep_special_tokens", st.booleans())]:
        if draw(st.booleans()):
            setattr(p, name, draw(strat))
    p.stop.extend(draw(st.lists(TEXT, max_size=20)))
    p.stop_token_ids.extend(draw(st.lists(U32, max_size=20)))
    if draw(st.booleans()):
        p.logit_bias.update(draw(st.dictionaries(U32, WILD_FLOAT, max_size=5)))
    if draw(st.booleans()):
        p.allowed_token_ids.extend(draw(st.lists(U32, max_size=5)))
    if draw(st.booleans()):
        p.bad_words.extend(draw(st.lists(TEXT, max_size=3)))
    if draw(st.booleans()):
        so = p.structured_output
        kind = draw(st.sampled_from(["json_schema", "json_object", "regex", "choice",
                                     "grammar"]))
        if kind == "json_object":
            so.json_object = draw(st.booleans())
        elif kind == "choice":
            so.choice.choices.extend(draw(st.lists(TEXT, max_size=3)))
        else:
            setattr(so, kind, draw(st.one_of(TEXT, st.sampled_from(
                ['{"type": "object"}', '{"enum": [1, "a"]}', "[a-z]{1,3}", 'start: "x" | "y"',
                 "(", '{"type": 7}', "start: undefined"]))))
    return p


@st.composite
def valid_params(draw):
    """Values inside every range (DESIGN §3), then at most one wild field."""
    p = pb.SamplingParams(
        max_tokens=draw(st.integers(1, 8)), n=draw(st.integers(1, 2)),
        temperature=draw(st.sampled_from([0.0, 0.5, 1.0, 2.0])),
        top_p=draw(st.sampled_from([0.1, 0.9, 1.0])), top_k=draw(st.integers(-1, 50)),
        min_p=draw(st.sampled_from([0.0, 0.05, 1.0])), seed=draw(st.integers(0, 2**64 - 1)),
        ignore_eos=draw(st.booleans()),
        presence_penalty=draw(st.sampled_from([-2.0, 0.0, 1.5])),
        frequency_penalty=draw(st.sampled_from([-2.0, 0.0, 2.0])),
        repetition_penalty=draw(st.sampled_from([0.5, 1.0, 1.3])))
    if draw(st.booleans()):
        p.logprobs = draw(st.integers(0, 5))
    p.stop.extend(draw(st.lists(st.text(min_size=1, max_size=5), max_size=3)))
    p.stop_token_ids.extend(draw(st.lists(st.integers(0, 511), max_size=3)))
    if draw(st.booleans()):
        wild = draw(params())
        field = draw(st.sampled_from([f.name for f in pb.SamplingParams.DESCRIPTOR.fields]))
        if field in ("stop", "stop_token_ids", "allowed_token_ids", "bad_words"):
            getattr(p, field)[:] = getattr(wild, field)
        elif field == "logit_bias":
            p.logit_bias.clear()
            p.logit_bias.update(wild.logit_bias)
        elif field == "structured_output":
            p.structured_output.CopyFrom(wild.structured_output)
        elif wild.HasField(field) if field in _OPTIONAL else True:
            setattr(p, field, getattr(wild, field))
    return p


_OPTIONAL = {f.name for f in pb.SamplingParams.DESCRIPTOR.fields if f.has_presence}


@st.composite
def requests(draw):
    req = pb.GenerateRequest(params=draw(st.one_of(params(), valid_params())),
                             priority=draw(st.integers(-(2**31), 2**31 - 1)),
                             cache_salt=draw(st.one_of(st.just(""), TEXT)))
    req.request_id = draw(st.one_of(st.just(""), st.sampled_from(["dup", "dup2"]), TEXT))
    kind = draw(st.sampled_from(["text", "ids", "ids", "none"]))
    if kind == "text":
        req.prompt = draw(TEXT)
    elif kind == "ids":
        req.prompt_token_ids.ids.extend(draw(st.one_of(
            st.lists(st.integers(0, 511), min_size=1, max_size=40),
            st.lists(st.one_of(st.integers(0, 511), U32), max_size=2000))))
    return req


def _call(cluster, req: pb.GenerateRequest, stream: bool) -> grpc.StatusCode:
    try:
        if stream:
            for _ in cluster.stub.Stream(req, timeout=20):
                pass
        else:
            cluster.stub.Generate(req, timeout=20)
    except grpc.RpcError as exc:
        assert exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED, f"hang: {req}"
        return exc.code()
    return grpc.StatusCode.OK


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(reqs=st.lists(requests(), min_size=1, max_size=3), stream=st.booleans())
def test_fuzz_generate(cluster, reqs, stream):
    """Up to three requests at once (so duplicate live ids happen), unary or streaming."""
    TRIED["examples"] += 1
    futures = [cluster.stub.Generate.future(r, timeout=20) for r in reqs[1:]]
    codes = [_call(cluster, reqs[0], stream)]
    for f in futures:
        try:
            f.result()
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            assert exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED, "hang"
            codes.append(exc.code())
    for code, r in zip(codes, reqs, strict=True):
        TRIED[code.name] = TRIED.get(code.name, 0) + 1
        assert code in ALLOWED, (code, r)


def test_fuzz_left_server_healthy(cluster):
    print(f"\nfuzz: {TRIED}")
    _healthy(cluster)
    resp = cluster.stub.Generate(request(token_ids=[5, 6, 7], max_tokens=3, temperature=0.0),
                                 timeout=10)
    assert len(resp.completions[0].token_ids) == 3


# ----------------------------------------------------------------------- ZeroMQ frames


def _hello(**over) -> wire.Hello:
    fields = dict(executor_id="intruder", model_fingerprint="0" * 64, device="cpu",
                  dtype="float32", block_size=16, num_gpu_blocks=8, num_cpu_blocks=0,
                  max_model_len=1024)
    fields.update(over)
    return wire.Hello(**fields)


def test_malformed_frames_to_router(cluster):
    codec = Codec()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(cluster.zmq)
    try:
        good_plan_head = codec.encode(wire.StepResult(step_id=1, executor_id="f0",
                                                      request_ids=["x"],
                                                      token_ids=np.array([1], np.int32)))
        bad = [
            [b"garbage"], [b""], [b"\xc1"], [b"\x92\x01"],  # not msgpack / truncated
            [msgspec.msgpack.encode({"type": "nope", "version": 1})],  # unknown tag
            [msgspec.msgpack.encode({"type": "heartbeat", "version": 99,
                                     "executor_id": "f0", "time_s": 0.0})],  # wrong version
            [good_plan_head[0]],  # array reference to a frame that is not there
            [good_plan_head[0], b"\x00" * 3],  # array frame of the wrong size
            [b"x"] * 65,  # too many frames
            [msgspec.msgpack.encode({"type": "result", "version": 1, "step_id": "one"})],
            [codec.encode(wire.StepResult(step_id=1, executor_id="f0", request_ids=["a", "b"],
                                          token_ids=np.array([1], np.int32)))[0],
             np.array([1], np.int32).tobytes()],  # shapes disagree
        ]
        for frames in bad:
            sock.send_multipart(frames)
        # Well-formed but wrong: result for an unknown step / unknown executor, a plan
        # sent to the router, refused hellos.
        for msg in [wire.StepResult(step_id=10**9, executor_id="f0"),
                    wire.StepResult(step_id=1, executor_id="nobody"),
                    wire.ErrorReport(message="hi", step_id=5, executor_id="nobody"),
                    wire.StepPlan(step_id=1)]:
            sock.send_multipart(codec.encode(msg))
        for hello, why in [(_hello(), "different model"),
                           (_hello(block_size=32), "block size"),
                           (_hello(protocol_version=wire.PROTOCOL_VERSION + 1), "protocol version"),
                           (_hello(num_gpu_blocks=0), "no KV-cache blocks"),
                           (_hello(num_cpu_blocks=-3), "-3 CPU blocks"),
                           (_hello(num_gpu_blocks=10**12), "more than the 67108864"),
                           (_hello(max_model_len=64), "max_model_len 64 is below")]:
            if why != "different model":
                hello = msgspec.structs.replace(
                    hello, model_fingerprint=_fingerprint(cluster))
            sock.send_multipart(codec.encode(hello))
            welcome = None
            while not isinstance(welcome, wire.Welcome):  # skip "register again" answers
                assert sock.poll(5000), why
                welcome = codec.decode(sock.recv_multipart())
                if not isinstance(welcome, wire.Welcome):
                    assert isinstance(welcome, wire.Shutdown) and not welcome.exit, welcome
            assert isinstance(welcome, wire.Welcome) and not welcome.accepted, welcome
            assert why in welcome.reason, welcome.reason
    finally:
        sock.close(0)
        ctx.term()
    time.sleep(0.3)
    logs = cluster.logs()
    assert logs.count("rejected a malformed message") >= len(bad) - 1, logs
    # f0's result from this socket, not the one f0 registered on: dropped by the link
    assert "a StepResult for executor f0 came from a connection other than" in logs
    status = cluster.status()
    assert [e.id for e in status.executors] == ["f0"] and status.executors[0].healthy
    resp = cluster.stub.Generate(request(token_ids=[5, 6, 7], max_tokens=3, temperature=0.0),
                                 timeout=10)
    assert len(resp.completions[0].token_ids) == 3
    _healthy(cluster)


def _fingerprint(cluster) -> str:
    import hashlib
    from pathlib import Path
    return hashlib.sha256((Path(cluster.model_dir) / "config.json").read_bytes()).hexdigest()
