"""`--api-workers 2`: a real router whose gRPC and HTTP edges run in two worker processes on
shared ports, one executor. Greedy outputs equal HF's token for token through both APIs and
many connections (so both workers serve); the Abort RPC reaches a request another worker
runs; a duplicate id on another worker is ALREADY_EXISTS; bad input, a full queue; the
workers' request metrics reach the router's /metrics; a client gone and a killed worker leak
no block and the worker comes back; last, draining: UNAVAILABLE for new requests, ABORT for
an open stream, exit code 0 and no worker left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from api_worker_rig import (
    metric,
    new_stub,
    open_stream,
    start_router,
    stub_on,
    wait_for_tokens,
    with_id,
    worker_pids,
)
from cluster_harness import Cluster, HFReference, assert_greedy_match, free_port, request
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb

from pagedserve.tinymodels import build_model

PROMPTS = ["The paged cache", "Routers route", "A block table maps", "Copy on write",
           "Prefix hashes chain", "Swap or recompute"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # A 4k context: the draining test's stream must outlast --shutdown-timeout on any
    # machine (at 1k, a fast one finished it inside the 3 s).
    return build_model(tmp_path_factory.mktemp("workers"), "llama", num_kv_heads=2,
                       max_position_embeddings=4096)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    c = Cluster(model_dir, num_executors=1, executor_args=["--num-gpu-blocks", "256"],
                router_args=["--api-workers", "2", "--max-queue-len", "6",
                             "--shutdown-timeout", "3", "--batch-dir",
                             str(tmp_path_factory.mktemp("batches"))])
    with c.running():
        yield c


@pytest.fixture(scope="module")
def hf(model_dir):
    return HFReference(model_dir)


def test_two_workers_listen_and_answer(cluster):
    assert len(worker_pids(cluster.router.pid)) == 2
    info = cluster.stub.GetModelInfo(pb.ModelInfoRequest(), timeout=10)
    assert info.vocab_size > 0 and info.dtype == "float32"
    assert [e.healthy for e in cluster.status().executors] == [True]


def test_greedy_equals_hf_over_many_connections(cluster, hf):
    expected = {p: hf.greedy(hf.encode(p), 12) for p in PROMPTS}

    def one(i: int):
        prompt = PROMPTS[i % len(PROMPTS)]
        channel, stub = new_stub(cluster)
        try:
            req = request(prompt, max_tokens=12, temperature=0, ignore_eos=True)
            if i % 2:
                chunks = list(stub.Stream(req, timeout=60))
                ids = [t for c in chunks for t in c.token_ids]
                assert chunks[-1].finish_reason == pb.LENGTH
            else:
                ids = list(stub.Generate(req, timeout=60).completions[0].token_ids)
            return prompt, ids
        finally:
            channel.close()

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(24)))
    for prompt, ids in results:
        tokens, gaps = expected[prompt]
        assert_greedy_match(ids, tokens, gaps)
    # HTTP, also on the workers' shared port
    body = json.dumps({"model": Path(cluster.model_dir).name, "prompt": PROMPTS[0],
                       "max_tokens": 12, "temperature": 0, "ignore_eos": True}).encode()
    reply = urllib.request.urlopen(urllib.request.Request(
        f"http://{cluster.http_address}/v1/completions", body,
        {"Content-Type": "application/json"}), timeout=60)
    choice = json.loads(reply.read())["choices"][0]
    assert choice["text"] == hf.tokenizer.decode(expected[PROMPTS[0]][0])
    assert cluster.wait_blocks_free().executors[0].num_free_gpu_blocks == 256


def test_stop_strings_found_in_the_workers_text(cluster):
    """The core sends tokens; each worker assembles the text and finds stop strings: the cut,
    include_stop_str_in_output, streams equal to unary, usage = tokens handed out, n = 2."""
    stub = cluster.stub
    base = stub.Generate(request("Stop strings", max_tokens=40, temperature=0,
                                 ignore_eos=True), timeout=60).completions[0]
    text = base.text
    stops = [text[i:i + 3] for i in range(len(text) // 3, len(text) - 3)
             if text[i:i + 3].strip() and "\ufffd" not in text[i:i + 3]]
    assert stops, text
    stop = stops[0]
    cut_at = text.index(stop)
    kw = dict(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])
    cut = stub.Generate(request("Stop strings", **kw), timeout=60)
    c = cut.completions[0]
    assert (c.text, c.finish_reason, c.stop_string) == (text[:cut_at], pb.STOP, stop)
    assert list(c.token_ids) == list(base.token_ids[:len(c.token_ids)])
    assert len(c.token_ids) < len(base.token_ids)
    assert cut.usage.completion_tokens == len(c.token_ids)
    chunks = list(stub.Stream(request("Stop strings", **kw), timeout=60))
    assert "".join(ch.text for ch in chunks) == c.text
    assert [t for ch in chunks for t in ch.token_ids] == list(c.token_ids)
    assert chunks[-1].usage.completion_tokens == len(c.token_ids)
    incl = stub.Generate(request("Stop strings", include_stop_str_in_output=True, **kw),
                         timeout=60).completions[0]
    assert incl.text == text[:cut_at + len(stop)]
    sampled = stub.Generate(request("Stop strings", max_tokens=40, temperature=1.0, seed=3,
                                    n=2, ignore_eos=True, stop=[stop, text[:2]]), timeout=60)
    assert sum(len(x.token_ids) for x in sampled.completions) == \
        sampled.usage.completion_tokens
    for x in sampled.completions:
        assert stop not in x.text and text[:2] not in x.text
    assert cluster.wait_blocks_free().executors[0].num_free_gpu_blocks == 256


def test_a_stop_string_found_in_a_worker_stops_the_sample_in_the_core(cluster):
    """The core does not see stop strings: the worker that finds one tells it (StopSample),
    and the core stops computing the sample a few steps later, not at max_tokens."""
    stub = cluster.stub
    kw = dict(max_tokens=160, temperature=0, ignore_eos=True)
    text = stub.Generate(request("Stop early", **kw), timeout=60).completions[0].text
    stops = [text[i:i + 3] for i in range(4, len(text) // 4)
             if text[i:i + 3].strip() and "\ufffd" not in text[i:i + 3]
             and text[i:i + 3] not in text[:i]]
    assert stops, text
    generated = metric(cluster.metrics(), "pagedserve_generation_tokens_total")
    cut = stub.Generate(request("Stop early", stop=[stops[0]], **kw), timeout=60)
    assert cut.completions[0].finish_reason == pb.STOP
    n_cut = len(cut.completions[0].token_ids)
    assert cluster.wait_blocks_free().executors[0].num_free_gpu_blocks == 256
    in_core = metric(cluster.metrics(), "pagedserve_generation_tokens_total") - generated
    assert n_cut <= in_core < n_cut + 40 < 160, (n_cut, in_core)


def test_a_batch_over_the_workers_answers_as_online_requests(cluster):
    """The Batch API through the workers (files and batches shared in --batch-dir, calls
    landing on either worker): every line's answer equals the same request sent online
    (greedy), in input order, past a window of 3 (half of --max-queue-len 6)."""
    import json
    import time

    import openai
    client = openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused",
                           max_retries=0, timeout=60)
    model = Path(cluster.model_dir).name
    bodies = [{"model": model, "prompt": p, "max_tokens": 5, "temperature": 0,
               "ignore_eos": True} for p in PROMPTS * 2]
    lines = [json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions",
                         "body": b}) for i, b in enumerate(bodies)]
    upload = client.files.create(file=("in.jsonl", "\n".join(lines).encode()),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                  completion_window="24h")
    deadline = time.monotonic() + 60
    while (batch := client.batches.retrieve(batch.id)).status != "completed":
        assert time.monotonic() < deadline and batch.status in ("validating", "in_progress",
                                                                "finalizing"), batch
        time.sleep(0.05)
    assert (batch.request_counts.completed, batch.error_file_id) == (12, None)
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert [x["custom_id"] for x in out] == [f"q{i}" for i in range(12)]
    for line, body in zip(out, bodies, strict=True):
        online = client.completions.create(**{k: v for k, v in body.items()
                                               if k != "ignore_eos"},
                                           extra_body={"ignore_eos": True})
        assert line["response"]["body"]["choices"][0]["text"] == online.choices[0].text


def test_openai_chat_stream_and_a_disconnect_over_the_workers(cluster):
    """The OpenAI SDK on the workers' HTTP port: a chat stream concatenates to the unary
    reply with usage; a predicted reply is the same, its drafts counted; a client that
    disconnects mid-stream leaks no block."""
    import openai
    client = openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused",
                           max_retries=0, timeout=60)
    model = Path(cluster.model_dir).name
    kw = dict(model=model, messages=[{"role": "user", "content": "Route me"}],
              max_completion_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    unary = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == unary.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == unary.usage.completion_tokens == 10
    # a prediction is tokenized in the worker, drafted in the core, counted in the usage
    # the core sends back with the request's last output
    predicted = client.chat.completions.create(**kw, prediction={
        "type": "content", "content": unary.choices[0].message.content})
    assert predicted.choices[0].message.content == unary.choices[0].message.content
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0
    stream = client.completions.create(model=model, prompt="A long story", stream=True,
                                       max_tokens=400, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    assert cluster.wait_blocks_free(timeout_s=20).executors[0].num_free_gpu_blocks == 256
    time.sleep(0.2)  # the workers batch their metrics every 50 ms
    assert metric(cluster.metrics(),
                  'pagedserve_request_failure_total{api="http",code="CANCELLED"}') >= 1


def test_structured_output_tool_calls_and_echo_through_the_workers(cluster):
    """The workers validate and compile formats and build tool-call replies: a choice format
    with a logit bias, a named tool call, a bad format's 400 naming the client's field; and
    echo with prompt logprobs."""
    import openai
    client = openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused",
                           max_retries=0, timeout=60)
    model = Path(cluster.model_dir).name
    for seed in range(3):
        reply = client.completions.create(
            model=model, prompt="Pick one", max_tokens=8, temperature=1.0, seed=seed,
            extra_body={"guided_choice": ["red", "green", "blue"]}, logit_bias={"5": -100})
        assert reply.choices[0].text in ("red", "green", "blue")
        assert reply.choices[0].finish_reason == "stop"
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "required": ["color"], "additionalProperties": False,
        "properties": {"color": {"enum": ["red", "green"]}}}}}]
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Pick"}], tools=tools,
        tool_choice={"type": "function", "function": {"name": "pick"}}, max_tokens=20,
        temperature=0)
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "pick"
    assert json.loads(call.function.arguments)["color"] in ("red", "green")
    # the same tool through Anthropic's Messages API: a tool_use block, its input streamed
    import anthropic
    claude = anthropic.Anthropic(base_url=f"http://{cluster.http_address}", api_key="x",
                                 max_retries=0, timeout=60)
    pick = {"name": "pick", "input_schema": tools[0]["function"]["parameters"]}
    kw = dict(model=model, max_tokens=20, extra_body={"temperature": 0}, tools=[pick],
              tool_choice={"type": "tool", "name": "pick"},
              messages=[{"role": "user", "content": "Pick"}])
    message = claude.messages.create(**kw)
    [use] = message.content
    assert use.type == "tool_use" and use.input["color"] in ("red", "green")
    assert message.stop_reason == "tool_use"
    with claude.messages.stream(**kw) as stream:
        assert stream.get_final_message().content[0].input == use.input
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model, prompt="x", max_tokens=4,
                                  extra_body={"guided_regex": "(unclosed"})
    assert bad.value.body["param"] == "guided_regex"
    # Prompt logprobs travel from the core to the worker with the request's usage.
    echo = client.completions.create(model=model, prompt=[5, 6, 7, 8], max_tokens=1,
                                     logprobs=1, echo=True, temperature=0)
    token_logprobs = echo.choices[0].logprobs.token_logprobs
    assert len(token_logprobs) == 5 and token_logprobs[0] is None
    assert all(isinstance(v, float) for v in token_logprobs[1:])


def test_abort_and_duplicate_id_on_the_same_and_the_other_worker(cluster):
    for case in ("other", "other", "same"):
        request_id = f"cross-{case}-{time.monotonic_ns()}"
        ch_a, stub_a, owner_a = stub_on(cluster, None)
        chunks: list = []
        ended = threading.Event()
        thread = open_stream(stub_a, request_id, chunks, ended)
        wait_for_tokens(chunks)
        ch_b, stub_b, owner_b = stub_on(cluster, owner_a if case == "other" else None,
                                         want=owner_a if case == "same" else None)
        assert (owner_a != owner_b) == (case == "other")
        with pytest.raises(grpc.RpcError) as dup:
            stub_b.Generate(with_id(request("dup", max_tokens=2), request_id), timeout=10)
        assert dup.value.code() == grpc.StatusCode.ALREADY_EXISTS
        stub_b.Abort(pb.AbortRequest(request_id=request_id), timeout=10)
        assert ended.wait(30)
        thread.join(5)
        assert not isinstance(chunks[-1], grpc.RpcError), chunks[-1]
        assert chunks[-1].finish_reason == pb.ABORT
        with pytest.raises(grpc.RpcError) as gone:
            stub_b.Abort(pb.AbortRequest(request_id=request_id), timeout=10)
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND
        ch_a.close()
        ch_b.close()
    assert cluster.wait_blocks_free().executors[0].num_free_gpu_blocks == 256


def test_bad_input_and_a_full_queue(cluster):
    with pytest.raises(grpc.RpcError) as bad:
        cluster.stub.Generate(request(token_ids=[10**6], max_tokens=2), timeout=10)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    # 24 calls at once on one connection: they reach the core within a step, past the
    # queue's 6 places. On a loaded machine they may trickle in slower than steps admit
    # them: a burst is tried up to three times (seen once in a full-suite run).
    seen: set = set()
    for _ in range(3):
        calls = [cluster.stub.Generate.future(request("burst", max_tokens=40, ignore_eos=True),
                                              timeout=60) for _ in range(24)]
        seen |= {call.code() for call in calls}
        cluster.wait_blocks_free()
        if grpc.StatusCode.RESOURCE_EXHAUSTED in seen:
            break
    assert seen == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, seen


def test_worker_request_metrics_reach_the_router(cluster):
    # the workers batch their metrics every 50 ms, each worker its own: wait until every
    # expected count is in (on a loaded machine a fixed 0.2 s was seen to fall short)
    expected = {
        'pagedserve_request_success_total{api="grpc",finish_reason="length"}': 24,
        'pagedserve_request_success_total{api="http"': 1,
        'pagedserve_request_success_total{api="grpc",finish_reason="abort"}': 3,
        'pagedserve_request_failure_total{api="grpc",code="ALREADY_EXISTS"}': 3,
        'pagedserve_request_failure_total{api="grpc",code="RESOURCE_EXHAUSTED"}': 1,
        "pagedserve_time_to_first_token_seconds_count": 25,
    }
    deadline = time.monotonic() + 10
    text = cluster.metrics()
    while time.monotonic() < deadline and any(metric(text, k) < v for k, v in expected.items()):
        time.sleep(0.1)
        text = cluster.metrics()
    assert {k: metric(text, k) for k in expected if metric(text, k) < expected[k]} == {}
    assert metric(text, "pagedserve_inter_token_latency_seconds_count") > 0


def test_a_killed_worker_is_replaced_and_leaks_nothing(cluster):
    """SIGKILL a worker with streams open on both: its streams break (the clients see an
    error), the core aborts their requests, the other worker's streams go on, a new worker
    takes the dead one's place, and no block leaks."""
    victim = None
    streams = []
    for i, case in enumerate(("any", "other")):
        channel, stub, owner = stub_on(cluster, victim if case == "other" else None)
        victim = victim or owner
        chunks: list = []
        ended = threading.Event()
        open_stream(stub, f"kill-{i}", chunks, ended)
        streams.append((channel, owner, chunks, ended))
    for _, _, chunks, _ in streams:
        wait_for_tokens(chunks)
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = worker_pids(cluster.router.pid)
        if len(now) == 2 and victim not in now:
            break
        time.sleep(0.2)
    assert len(worker_pids(cluster.router.pid)) == 2, cluster.logs()
    cluster.channel.close()  # it may have been on the dead worker
    cluster.channel, cluster.stub = new_stub(cluster)
    (ch0, _, broken, broken_end), (ch1, _, alive, alive_end) = streams
    assert broken_end.wait(30)
    assert isinstance(broken[-1], grpc.RpcError), broken[-1]
    assert not alive_end.is_set()  # the other worker's stream goes on
    cluster.stub.Abort(pb.AbortRequest(request_id="kill-1"), timeout=10)
    assert alive_end.wait(30) and alive[-1].finish_reason == pb.ABORT
    with pytest.raises(grpc.RpcError) as gone:  # the core aborted the broken one itself
        cluster.stub.Abort(pb.AbortRequest(request_id="kill-0"), timeout=10)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    assert cluster.wait_blocks_free(timeout_s=20).executors[0].num_free_gpu_blocks == 256
    ch0.close()
    ch1.close()
    for _ in range(4):  # fresh connections: served whichever worker takes them
        channel, stub = new_stub(cluster)
        assert len(stub.Generate(request("after", max_tokens=3, ignore_eos=True), timeout=30)
                   .completions[0].token_ids) == 3
        channel.close()
    text = cluster.metrics()
    assert metric(text, "pagedserve_kv_blocks_leaked{") == 0
    assert metric(text, "pagedserve_api_worker_restarts_total") == 1


def test_a_port_in_use_is_one_line_and_exit_2(cluster, model_dir):
    taken = cluster.http_address.rsplit(":", 1)[1]
    busy = subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", "router", "--model", str(model_dir),
         "--api-workers", "2", "--port", "0", "--metrics-port", "-1", "--http-port", taken,
         "--executor-bind", f"tcp://127.0.0.1:{free_port()}"],
        capture_output=True, text=True, timeout=60)
    assert busy.returncode == 2, busy.stderr
    assert busy.stderr.strip().splitlines()[-1] == (
        f"pagedserve router: cannot bind 127.0.0.1:{taken}: Address already in use")
    assert "Traceback" not in busy.stderr


def test_a_killed_router_takes_its_workers_and_frees_the_ports(model_dir):
    """SIGKILL of the router (no drain): its workers exit at once (within the parent check,
    no grace), and a new router binds the same ports."""
    port, http_port = free_port(), free_port()
    first = start_router(model_dir, port, http_port)
    workers = worker_pids(first.pid)
    assert len(workers) == 2
    first.kill()
    first.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in workers):
        time.sleep(0.05)
    assert not any(Path(f"/proc/{p}").exists() for p in workers)
    second = start_router(model_dir, port, http_port)
    try:
        assert len(worker_pids(second.pid)) == 2
    finally:
        second.terminate()
        assert second.wait(30) == 0


def test_draining_then_exit_with_no_worker_left(cluster):
    """Runs last: SIGTERM the router with a stream open."""
    pids = worker_pids(cluster.router.pid)
    chunks: list = []
    ended = threading.Event()
    channel, stub = new_stub(cluster)
    open_stream(stub, "drain-me", chunks, ended)
    wait_for_tokens(chunks)
    cluster.router.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(grpc.RpcError) as late:
        stub.Generate(request("late", max_tokens=2), timeout=10)
    assert late.value.code() == grpc.StatusCode.UNAVAILABLE
    health = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="pagedserve.v1.Generator"), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert ended.wait(30)
    assert chunks[-1].finish_reason == pb.ABORT
    channel.close()
    assert cluster.router.wait(timeout=30) == 0
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or \
            Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
