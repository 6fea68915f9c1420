"""Pipelined steps with real executor processes: depths 1 to 4 give the same tokens
(greedy equal to HF, seeded sampling with penalties and logprobs identical), under KV
pressure that preempts; and an executor that hangs inside a step (fault injection) is
declared dead, its requests finishing on the other executor token for token."""

from __future__ import annotations

import pytest
from cluster_harness import Cluster, HFReference, assert_greedy_match, concurrently, request
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb

from pagedserve.tinymodels import build_model

PROMPTS = [
    "Once upon a time there was a small language model",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "The router owns the block tables and plans every step of every batch.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000",
]
MAX_TOKENS = 40
SAMPLED = dict(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, top_k=40, seed=77,
               ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.4,
               presence_penalty=0.2, logprobs=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("llama"), "llama", num_kv_heads=2)


@pytest.fixture(scope="module")
def hf(model_dir):
    return HFReference(model_dir)


def _run_depth(model_dir, depth: int, hf) -> tuple[list, list]:
    """Greedy (checked against HF) and seeded sampled outputs at one pipeline depth, on one
    executor whose KV cache is small enough to preempt."""
    cluster = Cluster(model_dir, num_executors=1,
                      router_args=["--pipeline-depth", str(depth)],
                      executor_args=["--num-gpu-blocks", "14", "--swap-space", "0.02"])
    try:
        cluster.start()
        greedy = concurrently(lambda p: cluster.stub.Generate(
            request(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), timeout=120),
            PROMPTS)
        for prompt, resp in zip(PROMPTS, greedy, strict=True):
            assert not isinstance(resp, Exception), (resp, cluster.logs())
            ref, gaps = hf.greedy(hf.encode(prompt), MAX_TOKENS)
            assert_greedy_match(list(resp.completions[0].token_ids), ref, gaps)
        sampled = concurrently(lambda p: cluster.stub.Generate(
            request(p, n=2, **SAMPLED), timeout=120), PROMPTS)
        out = []
        for resp in sampled:
            assert not isinstance(resp, Exception), (resp, cluster.logs())
            out.append([(list(c.token_ids), [lp.logprob for lp in c.logprobs],
                         [[t.token_id for t in lp.top] for lp in c.logprobs])
                        for c in resp.completions])
        metrics = cluster.metrics()
        assert "pagedserve_executor_gap_seconds_count" in metrics
        status = cluster.wait_blocks_free()
        assert all(e.num_free_gpu_blocks == e.num_gpu_blocks for e in status.executors)
        preempted = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                        if line.startswith("pagedserve_preemptions_total{"))
        return out, preempted
    finally:
        cluster.stop()


def test_depths_1_to_4_give_identical_tokens_under_preemption(model_dir, hf):
    depth1, preempted1 = _run_depth(model_dir, 1, hf)
    for depth in (2, 3, 4):
        deeper, preempted = _run_depth(model_dir, depth, hf)
        assert preempted1 > 0 and preempted > 0  # the KV pressure preempted at each depth
        for req1, req2 in zip(depth1, deeper, strict=True):
            for (tokens1, lps1, tops1), (tokens2, lps2, tops2) in zip(req1, req2, strict=True):
                assert tokens1 == tokens2 and tops1 == tops2, depth
                # Logprobs agree up to float rounding: a step's batch differs between the
                # depths, and a CPU matmul's rounding depends on the batch.
                assert max(abs(a - b) for a, b in zip(lps1, lps2, strict=True)) < 1e-3


def test_executor_hung_inside_a_step_is_dead_and_its_requests_move(model_dir, hf):
    """exec0 sleeps 60 s inside its 6th step (PAGEDSERVE_FAULT_SLEEP_IN_STEP): past the
    plan's deadline it stops heartbeating and the router counts it dead; its streams
    finish on exec1, identical to HF."""
    cluster = Cluster(model_dir, num_executors=2,
                      router_args=["--step-timeout", "1"],
                      executor_args=["--num-gpu-blocks", "256"],
                      executor_env={"exec0": {"PAGEDSERVE_FAULT_SLEEP_IN_STEP": "6:60"}})
    try:
        cluster.start()
        prompts = [f"{p} {i}" for i in range(2) for p in PROMPTS]
        results = concurrently(lambda p: list(cluster.stub.Stream(
            request(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
            timeout=120)), prompts)
        for prompt, chunks in zip(prompts, results, strict=True):
            assert not isinstance(chunks, Exception), (chunks, cluster.logs())
            ref, gaps = hf.greedy(hf.encode(prompt), MAX_TOKENS)
            assert_greedy_match([t for c in chunks for t in c.token_ids], ref, gaps)
            assert chunks[-1].finish_reason == pb.LENGTH
        healthy = {e.id: e.healthy for e in cluster.status().executors}
        assert healthy == {"exec0": False, "exec1": True}, cluster.logs()
        logs = cluster.logs()
        assert "overran its deadline" in logs or "unanswered" in logs, logs
    finally:
        hung = cluster.executors.get("exec0")
        if hung is not None:  # still asleep in its step: SIGTERM would wait 15 s for nothing
            hung.kill()
        cluster.stop()
