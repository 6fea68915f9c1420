"""Offloading on a real cluster (router + one CPU executor, `--kv-offloading-size`): the
conversations' prefixes no longer fit the device's blocks, and their next turns find them in
CPU blocks. Outputs equal transformers' token for token, the hits are served from the host
(metrics, `cached_prompt_tokens`), and every block is free at the end."""

from __future__ import annotations

import random

import pytest
from cluster_harness import Cluster, HFReference, assert_greedy_match, request

from pagedserve.tinymodels import build_model

NUM_CONVERSATIONS = 5
PROMPT_TOKENS = 90
MAX_TOKENS = 10
NEW_TURN_TOKENS = 6
# 20 device blocks of 16 hold two conversations (7 blocks each after a turn); 80 CPU blocks
# hold every conversation's full blocks (6 each).
EXECUTOR_ARGS = ["--num-gpu-blocks", "20", "--num-cpu-blocks", "80"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def hf(model_dir):
    return HFReference(model_dir)


@pytest.fixture(scope="module")
def cluster(model_dir):
    with Cluster(model_dir, num_executors=1, router_args=["--kv-offloading-size", "0.01"],
                 executor_args=EXECUTOR_ARGS).running() as c:
        yield c


def _metric(cluster, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in cluster.metrics().splitlines()
               if line.startswith(name + "{"))


def _generate(cluster, ids):
    resp = cluster.stub.Generate(request(token_ids=ids, max_tokens=MAX_TOKENS,
                                         temperature=0.0, ignore_eos=True), timeout=120)
    return list(resp.completions[0].token_ids), resp.usage.cached_prompt_tokens


def test_turns_come_back_from_the_host(cluster, hf):
    rng = random.Random(7)
    vocab = hf.model.config.vocab_size
    history = [[rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)]
               for _ in range(NUM_CONVERSATIONS)]
    for turn in range(2):
        for conv in history:  # one at a time: the cache's contents follow exactly
            got, cached = _generate(cluster, conv)
            ref, gaps = hf.greedy(conv, MAX_TOKENS)
            assert_greedy_match(got, ref, gaps)
            if turn:
                # the whole earlier turn (prompt and output, 100 tokens) in six full
                # blocks: every conversation but the last two was evicted from the device
                assert cached == 96, cluster.logs()
            conv += got + [rng.randrange(3, vocab) for _ in range(NEW_TURN_TOKENS)]
    # the first three conversations' six blocks each came back from the host
    assert _metric(cluster, "pagedserve_prefix_cache_cpu_hits_total") >= 3 * 96
    assert _metric(cluster, "pagedserve_kv_offloaded_blocks_total") >= 5 * 6
    status = cluster.wait_blocks_free()
    e = status.executors[0]
    assert (e.num_free_gpu_blocks, e.num_free_cpu_blocks) == (e.num_gpu_blocks,
                                                              e.num_cpu_blocks)


def test_concurrent_turns_under_pressure(cluster, hf):
    """Every conversation at once: admissions swap host blocks in while others' are being
    offloaded and the device preempts; the outputs stay exact."""
    from cluster_harness import concurrently
    rng = random.Random(11)
    vocab = hf.model.config.vocab_size
    convs = [[rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)]
             for _ in range(NUM_CONVERSATIONS)]
    for _ in range(2):
        results = concurrently(lambda ids: _generate(cluster, ids), convs)
        for conv, result in zip(convs, results, strict=True):
            assert not isinstance(result, Exception), (result, cluster.logs())
            ref, gaps = hf.greedy(conv, MAX_TOKENS)
            assert_greedy_match(result[0], ref, gaps)
            conv += result[0] + [rng.randrange(3, vocab) for _ in range(NEW_TURN_TOKENS)]
    status = cluster.wait_blocks_free()
    e = status.executors[0]
    assert (e.num_free_gpu_blocks, e.num_free_cpu_blocks) == (e.num_gpu_blocks,
                                                              e.num_cpu_blocks)


def test_kv_offload_bench_quick(model_dir):
    """benchmarks/kv_offload_bench.py in a small setting on this model: a JSON line per
    config, the offloaded run's turns served from the host, outputs the same (float32)."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "kv_offload_bench.py"), "--model",
         str(model_dir), "--workloads", "multi_turn_3x", "--configs", "off,offload",
         "--scale", "0.1", "--output-tokens", "4", "--device-blocks", "24",
         "--host-blocks", "72", "--dtype", "float32"],
        cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    off, on = [json.loads(x) for x in proc.stdout.splitlines() if x.strip()]
    assert (off["case"], on["case"]) == ("multi_turn_3x/off", "multi_turn_3x/offload")
    # 16 conversations of 51 tokens, then 2 turns of 4 more (+4 output) each: the later
    # turns' three full blocks come back from the host, none survive on 24 device blocks
    assert off["cached_tokens"] == 0 and off["offloaded_blocks"] == 0
    assert on["cpu_hit_tokens"] == on["cached_tokens"] == 16 * 2 * 48
    assert on["prompt_tokens_computed"] == off["prompt_tokens_computed"] - 16 * 2 * 48
    assert on["same_outputs"] is True and on["wall_s"] > 0 and on["ttft_p50_ms"] > 0
