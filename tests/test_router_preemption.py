"""Preemption forced by a small KV cache, in recompute, swap and auto modes: outputs stay
HF-identical and preemptions are counted. Plus the waiting-queue cap. One executor per
cluster, one cluster per mode."""

from __future__ import annotations

import threading

import grpc
import pytest
from cluster_harness import Cluster, HFReference, assert_greedy_match, concurrently, request

from pagedserve.tinymodels import build_model

PROMPTS = [
    "Once upon a time there was a small language model",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "The router owns the block tables and plans every step of every batch.",
    "When memory runs out the scheduler preempts a request by swap or recompute.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000",
]
MAX_TOKENS = 60


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("qwen2"), "qwen2", num_kv_heads=2)


@pytest.fixture(scope="module")
def hf(model_dir):
    return HFReference(model_dir)


@pytest.fixture(scope="module")
def prompt_ids(hf):
    # Token ids, not text: transformers 5 loads a Qwen2 directory with Qwen2Tokenizer, which
    # replaces the synthetic tokenizer.json's pre-tokenizer (digits split one by one), so
    # text would tokenize differently from the router's `tokenizers` load. Real Qwen2
    # checkpoints carry that same pre-tokenizer in tokenizer.json.
    return [hf.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def references(hf, prompt_ids):
    return [hf.greedy(ids, MAX_TOKENS) for ids in prompt_ids]


def _run_all(cluster, prompt_ids):
    return concurrently(lambda ids: cluster.stub.Generate(
        request(token_ids=ids, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
        timeout=120), prompt_ids)


def _preemptions(cluster, mode: str) -> float:
    total = 0.0
    for line in cluster.metrics().splitlines():
        if line.startswith("pagedserve_preemptions_total{") and f'mode="{mode}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


# 6 requests of ~14 + 60 tokens need ~30 blocks of 16 at their peak; 12 blocks hold ~40%.
@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_preemption_keeps_outputs_identical(model_dir, prompt_ids, references, mode):
    cluster = Cluster(model_dir, num_executors=1,
                      router_args=["--preemption-mode", mode],
                      executor_args=["--num-gpu-blocks", "12", "--swap-space", "0.05"])
    try:
        cluster.start()
        results = _run_all(cluster, prompt_ids)
        for (ref, gaps), resp in zip(references, results, strict=True):
            assert not isinstance(resp, Exception), (resp, cluster.logs())
            assert_greedy_match(list(resp.completions[0].token_ids), ref, gaps)
        # n = 2 groups under the same pressure: forks, group swap and recompute of forks.
        pairs = [None] * 3

        def run_pair(i):
            try:
                pairs[i] = cluster.stub.Generate(
                    request(token_ids=prompt_ids[i], max_tokens=MAX_TOKENS, temperature=0.0,
                            ignore_eos=True, n=2), timeout=120)
            except grpc.RpcError as exc:
                pairs[i] = exc
        threads = [threading.Thread(target=run_pair, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        for (ref, gaps), resp in zip(references[:3], pairs, strict=True):
            assert not isinstance(resp, Exception), (resp, cluster.logs())
            assert [c.index for c in resp.completions] == [0, 1]
            for c in resp.completions:
                assert_greedy_match(list(c.token_ids), ref, gaps)
        recompute = _preemptions(cluster, "recompute")
        swap = _preemptions(cluster, "swap")
        if mode == "recompute":
            assert recompute > 0 and swap == 0
        elif mode == "swap":
            assert swap > 0
        else:
            assert recompute + swap > 0
        status = cluster.wait_blocks_free()
        e = status.executors[0]
        assert e.num_free_gpu_blocks == e.num_gpu_blocks
        assert e.num_free_cpu_blocks == e.num_cpu_blocks
    finally:
        cluster.stop()


def test_full_waiting_queue_is_resource_exhausted(model_dir):
    cluster = Cluster(model_dir, num_executors=1,
                      router_args=["--max-queue-len", "2", "--max-num-seqs", "1"],
                      executor_args=["--num-gpu-blocks", "64"])
    try:
        cluster.start()
        codes = []
        lock = threading.Lock()

        def run(i):
            try:
                cluster.stub.Generate(request(PROMPTS[i % 6], max_tokens=40, temperature=0.0,
                                              ignore_eos=True), timeout=120)
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
            with lock:
                codes.append(code)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert set(codes) == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
        assert codes.count(grpc.StatusCode.OK) >= 3
        # The server still serves afterwards.
        resp = cluster.stub.Generate(request(PROMPTS[0], max_tokens=3), timeout=60)
        assert len(resp.completions[0].token_ids) == 3
    finally:
        cluster.stop()


def test_only_executor_killed_ends_every_request_unavailable_quickly(model_dir):
    import signal
    import time
    cluster = Cluster(model_dir, num_executors=1, executor_args=["--num-gpu-blocks", "64"])
    try:
        cluster.start()
        codes: list = []
        lock = threading.Lock()
        started = threading.Barrier(9, timeout=60)

        def run(i):
            r = request(PROMPTS[i % 6], max_tokens=500, temperature=0.0, ignore_eos=True)
            try:
                for n, _ in enumerate(cluster.stub.Stream(r, timeout=120)):
                    if n == 0:
                        started.wait()
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
            with lock:
                codes.append(code)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        started.wait()
        cluster.executors["exec0"].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        for t in threads:
            t.join(60)
        assert all(not t.is_alive() for t in threads), "a request hung"
        assert codes == [grpc.StatusCode.UNAVAILABLE] * 8
        # Death is detected within --heartbeat-timeout (1 s here) plus a poll interval.
        assert time.monotonic() - t0 < 5
        with pytest.raises(grpc.RpcError) as err:
            cluster.stub.Generate(request(PROMPTS[0], max_tokens=2), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        cluster.stop()
