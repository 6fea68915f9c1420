"""The router through gRPC with two real executor processes over ZeroMQ (one cluster for the
whole module): HF-identical greedy text, streams, prefix routing, n=2, stop strings,
cancellation, bad input, and an executor dying. The executor kill runs last."""

from __future__ import annotations

import re
import signal
import threading
import time

import grpc
import pytest
from cluster_harness import Cluster, HFReference, assert_greedy_match, request
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb

from pagedserve.tinymodels import build_model

PROMPTS = [
    "Hello, world! The router",
    "A paged KV cache stores keys and values in fixed-size blocks. Prefix caching lets",
    "def generate(prompt",
    "Once upon a time there was a small language model that lived on a CPU. It was not "
    "very clever, but it was honest about what it was. One day",
    "1 2 3",
    "Tenant B asks about shipping.",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("llama"), "llama", num_kv_heads=2)


@pytest.fixture(scope="module")
def cluster(model_dir):
    c = Cluster(model_dir, num_executors=2, executor_args=["--num-gpu-blocks", "512"])
    with c.running():
        yield c


@pytest.fixture(scope="module")
def hf(model_dir):
    return HFReference(model_dir)


def _metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _concurrently(fn, items):
    results = [None] * len(items)

    def run(i, item):
        try:
            results[i] = fn(item)
        except Exception as exc:  # surfaced by the caller
            results[i] = exc
    threads = [threading.Thread(target=run, args=(i, x)) for i, x in enumerate(items)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def test_concurrent_greedy_unary_and_stream_equal_hf(cluster, hf):
    max_tokens = 14
    ids = [hf.encode(p) for p in PROMPTS]
    refs = [hf.greedy(x, max_tokens) for x in ids]

    def unary(prompt):
        return cluster.stub.Generate(
            request(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True), timeout=60)

    def stream(prompt):
        return list(cluster.stub.Stream(
            request(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True), timeout=60))

    unary_out = _concurrently(unary, PROMPTS)
    stream_out = _concurrently(stream, PROMPTS)
    for prompt_ids, (ref, gaps), resp, chunks in zip(ids, refs, unary_out, stream_out,
                                                    strict=True):
        assert not isinstance(resp, Exception), resp
        assert not isinstance(chunks, Exception), chunks
        comp = resp.completions[0]
        assert_greedy_match(list(comp.token_ids), ref, gaps)
        assert comp.finish_reason == pb.LENGTH
        assert resp.usage.prompt_tokens == len(prompt_ids)
        assert resp.usage.completion_tokens == max_tokens
        # A sample's chunks concatenate to exactly what Generate returns.
        assert "".join(c.text for c in chunks) == comp.text
        assert [t for c in chunks for t in c.token_ids] == list(comp.token_ids)
        assert chunks[-1].finish_reason == pb.LENGTH
        assert chunks[-1].usage.completion_tokens == max_tokens
    assert cluster.wait_blocks_free().executors


def test_prompt_token_ids_and_text_agree(cluster, hf):
    ids = hf.encode(PROMPTS[1])
    a = cluster.stub.Generate(request(PROMPTS[1], max_tokens=6, temperature=0.0), timeout=60)
    b = cluster.stub.Generate(request(token_ids=ids, max_tokens=6, temperature=0.0), timeout=60)
    assert list(a.completions[0].token_ids) == list(b.completions[0].token_ids)
    assert a.usage.prompt_tokens == len(ids)


def test_shared_prefix_second_wave_lands_where_the_prefix_is(cluster, hf):
    prefix = ("System: you are the billing assistant of tenant Z. Answer briefly and "
              "politely, cite the invoice number, never guess amounts. " * 3)
    first = cluster.stub.Generate(request(prefix + "Q0: hi", max_tokens=2, temperature=0.0),
                                  timeout=60)
    assert first.usage.cached_prompt_tokens == 0
    before = cluster.metrics()
    hits_before = {e.id: _metric(before, "pagedserve_prefix_cache_hits_total", executor=e.id)
                   for e in cluster.status().executors}
    wave = [prefix + f"Q{i}: what is my balance number {i}?" for i in range(1, 5)]
    responses = _concurrently(
        lambda p: cluster.stub.Generate(request(p, max_tokens=3, temperature=0.0), timeout=60),
        wave)
    prefix_len = len(hf.encode(prefix))
    for r in responses:
        assert not isinstance(r, Exception), r
        assert r.usage.cached_prompt_tokens >= (prefix_len // 16 - 1) * 16 > 0
    after = cluster.metrics()
    gained = {eid: _metric(after, "pagedserve_prefix_cache_hits_total", executor=eid) - h
              for eid, h in hits_before.items()}
    # Every hit of the wave is on one executor: the one holding the prefix.
    assert sorted(v > 0 for v in gained.values()) == [False, True], gained
    status = cluster.status()
    assert status.prefix_cache_hits > 0 and status.prefix_cache_queries > 0


def test_n2_computes_the_prompt_once_and_samples_independently(cluster, hf):
    prompt = PROMPTS[3]
    before = _metric(cluster.metrics(), "pagedserve_prefix_cache_queries_total")
    resp = cluster.stub.Generate(
        request(prompt, max_tokens=10, temperature=1.0, seed=7, n=2, ignore_eos=True),
        timeout=60)
    after = _metric(cluster.metrics(), "pagedserve_prefix_cache_queries_total")
    prompt_len = len(hf.encode(prompt))
    # Only sample 0 was admitted (looked up); sample 1 was forked from it (shared blocks).
    assert after - before == prompt_len
    assert [c.index for c in resp.completions] == [0, 1]
    a, b = (list(c.token_ids) for c in resp.completions)
    assert len(a) == len(b) == 10 and a != b
    assert resp.usage.completion_tokens == 20 and resp.usage.prompt_tokens == prompt_len
    again = cluster.stub.Generate(
        request(prompt, max_tokens=10, temperature=1.0, seed=7, n=2, ignore_eos=True),
        timeout=60)
    assert [list(c.token_ids) for c in again.completions] == [a, b]  # seeded: reproducible
    greedy = cluster.stub.Generate(
        request(prompt, max_tokens=8, temperature=0.0, n=2, ignore_eos=True), timeout=60)
    ref, gaps = hf.greedy(hf.encode(prompt), 8)
    for c in greedy.completions:
        assert_greedy_match(list(c.token_ids), ref, gaps)
    assert cluster.wait_blocks_free().executors


def test_n2_whose_prompt_is_cached_up_to_its_last_token(cluster, hf):
    """A 33-token prompt (block size 16): once it has run, 32 of its tokens are cached, so a
    later n = 2 request of it has nothing of sample 0 to compute and is forked as it is
    admitted (router/admission.py `_fork_now`): the same seeded samples as the first run
    (which computed the prompt, then forked), and greedy samples equal to HF's."""
    ids = list(range(40, 73))

    def run(**params):
        resp = cluster.stub.Generate(request(token_ids=ids, max_tokens=6, n=2,
                                             ignore_eos=True, **params), timeout=60)
        return [list(c.token_ids) for c in resp.completions]

    cold = run(temperature=1.0, seed=11)
    assert len(cold) == 2 and cold[0] != cold[1]
    assert run(temperature=1.0, seed=11) == cold
    ref, gaps = hf.greedy(ids, 6)
    for tokens in run(temperature=0.0):
        assert_greedy_match(tokens, ref, gaps)
    assert cluster.wait_blocks_free().executors


def test_stop_string_across_token_boundaries(cluster, hf):
    prompt = PROMPTS[0]
    full = cluster.stub.Generate(request(prompt, max_tokens=16, temperature=0.0,
                                         ignore_eos=True), timeout=60).completions[0]
    ids = list(full.token_ids)
    # A stop string spanning the boundary between output tokens 3 and 4.
    t3 = hf.tokenizer.decode(ids[:4])
    t4 = hf.tokenizer.decode(ids[:5])
    cut = len(hf.tokenizer.decode(ids[:3]))
    stop = full.text[cut + max(0, len(t3) - cut - 1): len(t4)]
    assert stop and stop in full.text
    start = full.text.index(stop)
    resp = cluster.stub.Generate(request(prompt, max_tokens=16, temperature=0.0,
                                         ignore_eos=True, stop=[stop]), timeout=60)
    c = resp.completions[0]
    assert c.finish_reason == pb.STOP and c.stop_string == stop
    assert c.text == full.text[:start]
    assert list(c.token_ids) == ids[: len(c.token_ids)] and len(c.token_ids) < 16
    inc = cluster.stub.Generate(request(prompt, max_tokens=16, temperature=0.0, ignore_eos=True,
                                        stop=[stop], include_stop_str_in_output=True),
                                timeout=60).completions[0]
    assert inc.text == full.text[: start + len(stop)]
    chunks = list(cluster.stub.Stream(request(prompt, max_tokens=16, temperature=0.0,
                                              ignore_eos=True, stop=[stop]), timeout=60))
    assert "".join(x.text for x in chunks) == c.text
    assert chunks[-1].stop_string == stop


@pytest.mark.parametrize("make, field", [
    (lambda: request("", max_tokens=4), "prompt"),
    (lambda: request(token_ids=[10**6], max_tokens=4), "prompt_token_ids"),
    (lambda: request("hi", max_tokens=0), "max_tokens"),
    (lambda: request("hi", max_tokens=100000), "max_tokens"),
    (lambda: request("hi", temperature=-1.0), "temperature"),
    (lambda: request("hi", top_p=0.0), "top_p"),
    (lambda: request("hi", top_k=-5), "top_k"),
    (lambda: request("hi", min_p=1.5), "min_p"),
    (lambda: request("hi", n=0), "n"),
    (lambda: request("hi", n=99), "n"),
    (lambda: request("hi", logprobs=99), "logprobs"),
    (lambda: request("hi", stop=[""]), "stop"),
    (lambda: request("hi", min_tokens=50, max_tokens=4), "min_tokens"),
    (lambda: request("hi", repetition_penalty=0.0), "repetition_penalty"),
    (lambda: request("hi", presence_penalty=3.0), "presence_penalty"),
])
def test_bad_input_is_invalid_argument(cluster, make, field):
    with pytest.raises(grpc.RpcError) as err:
        cluster.stub.Generate(make(), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field.split("_")[0] in err.value.details().lower()


def test_request_that_can_never_fit_the_kv_cache_is_rejected(cluster):
    # 512 blocks of 16 = 8192 tokens per executor; 16 samples of 900 tokens cannot fit.
    with pytest.raises(grpc.RpcError) as err:
        cluster.stub.Generate(request("hi", max_tokens=900, n=16), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_duplicate_live_id_and_unknown_abort(cluster):
    long = request(PROMPTS[0], max_tokens=400, temperature=0.0, ignore_eos=True)
    long.request_id = "dup-1"
    stream = cluster.stub.Stream(long, timeout=60)
    next(stream)  # it is live now
    with pytest.raises(grpc.RpcError) as err:
        cluster.stub.Generate(long, timeout=30)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    cluster.stub.Abort(pb.AbortRequest(request_id="dup-1"), timeout=10)
    rest = list(stream)
    assert rest[-1].finish_reason == pb.ABORT
    with pytest.raises(grpc.RpcError) as err:
        cluster.stub.Abort(pb.AbortRequest(request_id="no-such-request"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert _all_free(cluster)


def _all_free(cluster) -> bool:
    status = cluster.wait_blocks_free()
    return all(e.num_free_gpu_blocks == e.num_gpu_blocks for e in status.executors if e.healthy)


def test_cancel_deadline_and_abort_free_every_block(cluster):
    def long(i):
        r = request(PROMPTS[i % len(PROMPTS)], max_tokens=500, temperature=0.8, seed=i,
                    ignore_eos=True)
        r.request_id = f"cancel-{i}"
        return r

    # Client cancellation mid-stream.
    streams = [cluster.stub.Stream(long(i), timeout=60) for i in range(4)]
    for s in streams:
        next(s)
    for s in streams:
        s.cancel()
    # Deadlines passing mid-generation, unary and stream.
    with pytest.raises(grpc.RpcError) as err:
        cluster.stub.Generate(long(10), timeout=0.3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(grpc.RpcError) as err:
        list(cluster.stub.Stream(long(11), timeout=0.3))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # Abort of a pending unary Generate returns the partial result with ABORT.
    fut = cluster.stub.Generate.future(long(12), timeout=60)
    time.sleep(0.3)
    cluster.stub.Abort(pb.AbortRequest(request_id="cancel-12"), timeout=10)
    resp = fut.result()
    assert resp.completions[0].finish_reason == pb.ABORT
    assert _all_free(cluster)
    # The gauges follow at the step loop's next turn (after the last result or the abort's
    # wake-up), a moment after the KV state the status reads.
    deadline = time.monotonic() + 5
    while True:
        text = cluster.metrics()
        gauges = [(_metric(text, "pagedserve_kv_blocks_free", executor=e.id),
                   _metric(text, "pagedserve_kv_blocks_total", executor=e.id))
                  for e in cluster.status().executors]
        if all(free == total for free, total in gauges):
            break
        assert time.monotonic() < deadline, gauges
        time.sleep(0.05)


def test_health_and_model_info(cluster, model_dir):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    health = health_pb2_grpc.HealthStub(cluster.channel)
    for service in ("", "pagedserve.v1.Generator"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    info = cluster.stub.GetModelInfo(pb.ModelInfoRequest(), timeout=10)
    assert info.architecture == "LlamaForCausalLM" and info.block_size == 16
    assert info.max_model_len == 1024 and list(info.eos_token_ids) == [1]
    names = re.findall(r"^# TYPE (\S+)", cluster.metrics(), re.M)
    for name in ("pagedserve_requests_running", "pagedserve_kv_blocks_free",
                 "pagedserve_time_to_first_token_seconds", "pagedserve_step_forward_seconds",
                 "pagedserve_prefix_cache_hits", "pagedserve_executors_healthy"):
        assert any(n.startswith(name) for n in names), name


def _streams_through_an_executor_stop(cluster, hf, victim: str, sig) -> dict:
    """16 greedy streams; `sig` is sent to `victim` once the streams are under way. Every
    stream must complete with the HF text: the router migrates the victim's requests."""
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(16)]
    max_tokens = 48
    refs = [hf.greedy(hf.encode(p), max_tokens) for p in prompts]
    # Seeded sampling (with penalties) must also survive the move token for token: the
    # expected tokens come from an undisturbed run first.
    sampled_params = dict(max_tokens=max_tokens, temperature=0.9, top_p=0.95, seed=1234,
                          ignore_eos=True, frequency_penalty=0.5)
    sampled_prompts = [f"{PROMPTS[i]} sampled {i}" for i in range(4)]
    sampled_refs = [list(cluster.stub.Generate(request(p, **sampled_params), timeout=60)
                         .completions[0].token_ids) for p in sampled_prompts]
    # Both executors serving before the streams are placed (under a full suite's load the
    # 1 s heartbeat timeout can have one re-registering: then the victim holds nothing)
    cluster.wait_executors(2)
    migrations_before = _metric(cluster.metrics(), "pagedserve_migrations_total")
    results: dict[int, object] = {}
    first_chunk = threading.Barrier(len(prompts) + 1, timeout=60)

    def consume(i):
        r = request(prompts[i], max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        try:
            chunks = []
            for n, chunk in enumerate(cluster.stub.Stream(r, timeout=120)):
                chunks.append(chunk)
                if n == 0:
                    first_chunk.wait()
            results[i] = chunks
        except (grpc.RpcError, threading.BrokenBarrierError) as exc:
            results[i] = exc

    def consume_sampled(i):
        try:
            chunks = list(cluster.stub.Stream(request(sampled_prompts[i], **sampled_params),
                                              timeout=120))
            results[100 + i] = [t for c in chunks for t in c.token_ids]
        except grpc.RpcError as exc:
            results[100 + i] = exc

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(prompts))]
    threads += [threading.Thread(target=consume_sampled, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    first_chunk.wait()  # every greedy request is running somewhere
    cluster.executors[victim].send_signal(sig)
    for t in threads:
        t.join(120)
    assert all(not t.is_alive() for t in threads), "a request hung"
    for i, (ref, gaps) in enumerate(refs):
        chunks = results[i]
        assert not isinstance(chunks, Exception), (i, chunks, cluster.logs())
        tokens = [t for c in chunks for t in c.token_ids]
        assert_greedy_match(tokens, ref, gaps)  # no token duplicated or missing
        assert chunks[-1].finish_reason == pb.LENGTH
    for i, expected in enumerate(sampled_refs):
        assert results[100 + i] == expected, (i, results[100 + i], expected)
    migrated = _metric(cluster.metrics(), "pagedserve_migrations_total") - migrations_before
    print(f"{victim} stopped by {sig!r}: {migrated:.0f} of {len(prompts) + 4} requests migrated")
    assert migrated > 0, cluster.logs(200)
    return results


def test_zy_sigterm_executor_hands_its_requests_over(cluster, hf):
    """Scale-down loses nothing: exec1 says goodbye and its requests move to exec0."""
    _streams_through_an_executor_stop(cluster, hf, "exec1", signal.SIGTERM)
    assert cluster.executors["exec1"].wait(timeout=30) == 0
    healthy = {e.id: e.healthy for e in cluster.status().executors}
    assert healthy == {"exec0": True, "exec1": False}
    # A restarted executor rejoins (same id) and gets work again.
    cluster.start_executor("exec1")
    cluster.wait_executors(2)
    before = _metric(cluster.metrics(), "pagedserve_prefix_cache_queries_total", executor="exec1")
    _concurrently(lambda p: cluster.stub.Generate(request(p, max_tokens=4), timeout=60),
                  [f"{p} again" for p in PROMPTS])
    after = _metric(cluster.metrics(), "pagedserve_prefix_cache_queries_total", executor="exec1")
    assert after > before


def test_zz_killed_executor_requests_migrate_and_complete(cluster, hf):
    """Runs last: SIGKILL exec1 mid-generation; its requests finish on exec0."""
    _streams_through_an_executor_stop(cluster, hf, "exec1", signal.SIGKILL)
    healthy = {e.id: e.healthy for e in cluster.status().executors}
    assert healthy == {"exec0": True, "exec1": False}
    assert _all_free(cluster)
