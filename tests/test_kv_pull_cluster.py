"""Prefix pulls on a real cluster (router/prefix_pull.py): two executors, round-robin
routing (so a request's prefix is on the other executor) and `--kv-pull auto`. The second
request of a prefix receives its blocks from the executor that computed them: outputs equal
transformers' token for token, the metrics count the pull and the blocks, the receiving
executor finds them cached, and nothing is left held on either executor."""

from __future__ import annotations

import random
import re

import pytest
from cluster_harness import Cluster, HFReference, assert_greedy_match, concurrently, request

from pagedserve.tinymodels import build_model

BS = 16
MAX_TOKENS = 10
EXECUTORS = ("exec0", "exec1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def hf(model_dir):
    return HFReference(model_dir)


@pytest.fixture(scope="module")
def cluster(model_dir):
    with Cluster(model_dir, num_executors=2,
                 router_args=["--routing", "round-robin", "--kv-pull", "auto"],
                 executor_args=["--num-gpu-blocks", "96", "--num-cpu-blocks", "64"]
                 ).running() as c:
        yield c


def _metric(text: str, name: str, executor: str) -> float:
    m = re.search(rf'^{name}\{{executor="{executor}"\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _counts(cluster) -> dict[str, tuple[float, float, float]]:
    """Per executor: (pulls received, blocks received, prefix-cache hit tokens)."""
    text = cluster.metrics()
    return {e: (_metric(text, "pagedserve_kv_pulls_total", e),
                _metric(text, "pagedserve_kv_blocks_received_total", e),
                _metric(text, "pagedserve_prefix_cache_hits_total", e)) for e in EXECUTORS}


def _delta(after, before):
    return {e: tuple(a - b for a, b in zip(after[e], before[e], strict=True))
            for e in EXECUTORS}


def _generate(cluster, ids):
    resp = cluster.stub.Generate(request(token_ids=ids, max_tokens=MAX_TOKENS,
                                         temperature=0.0, ignore_eos=True), timeout=120)
    return list(resp.completions[0].token_ids)


def _assert_all_free(cluster):
    status = cluster.wait_blocks_free()
    for e in status.executors:
        assert e.healthy, e
        assert e.num_free_gpu_blocks == e.num_gpu_blocks, (e, cluster.logs())
        assert e.num_free_cpu_blocks == e.num_cpu_blocks, (e, cluster.logs())
        assert e.running == e.waiting == 0, e


def test_the_second_request_of_a_prefix_pulls_its_blocks(cluster, hf):
    """A computes a 64-token prefix on one executor; B (the same prefix, another tail) goes
    to the other by turn, which receives the prefix's 4 blocks and computes only B's tail:
    its hit tokens grow by exactly the 64 pulled ones."""
    rng = random.Random(7)
    vocab = hf.model.config.vocab_size
    prefix = [rng.randrange(3, vocab) for _ in range(64)]
    a = prefix + [rng.randrange(3, vocab) for _ in range(9)]
    b = prefix + [rng.randrange(3, vocab) for _ in range(13)]
    before = _counts(cluster)
    got_a = _generate(cluster, a)
    got_b = _generate(cluster, b)
    for ids, got in ((a, got_a), (b, got_b)):
        ref, gaps = hf.greedy(ids, MAX_TOKENS)
        assert_greedy_match(got, ref, gaps)
    delta = _delta(_counts(cluster), before)
    pulled = [e for e in EXECUTORS if delta[e][0]]
    assert len(pulled) == 1, (delta, cluster.logs())
    assert delta[pulled[0]] == (1.0, 4.0, 64.0), delta
    _assert_all_free(cluster)


def test_concurrent_requests_sharing_prefixes(cluster, hf):
    """Ten at once, two groups of four sharing a 48- or 80-token prefix, two alone: every
    output exact, every block free after (pulled or computed, whichever routing chose)."""
    rng = random.Random(11)
    vocab = hf.model.config.vocab_size
    prompts = []
    for length in (48, 80):
        shared = [rng.randrange(3, vocab) for _ in range(length)]
        prompts += [shared + [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 20))]
                    for _ in range(4)]
    prompts += [[rng.randrange(3, vocab) for _ in range(40)] for _ in range(2)]
    outs = concurrently(lambda ids: _generate(cluster, ids), prompts)
    for ids, got in zip(prompts, outs, strict=True):
        assert isinstance(got, list), got
        ref, gaps = hf.greedy(ids, MAX_TOKENS)
        assert_greedy_match(got, ref, gaps)
    _assert_all_free(cluster)


def test_a_stream_left_early_frees_everything(cluster, hf):
    """A request that pulls, read as a stream and left after its first tokens; then the same
    prompt in full: exact, and nothing held anywhere."""
    rng = random.Random(13)
    vocab = hf.model.config.vocab_size
    prefix = [rng.randrange(3, vocab) for _ in range(96)]
    _generate(cluster, prefix + [5, 6, 7])
    stream = cluster.stub.Stream(request(token_ids=prefix + [8, 9], max_tokens=40,
                                                 temperature=0.0, ignore_eos=True),
                                         timeout=120)
    next(iter(stream))
    stream.cancel()
    ids = prefix + [10, 11, 12]
    ref, gaps = hf.greedy(ids, MAX_TOKENS)
    assert_greedy_match(_generate(cluster, ids), ref, gaps)
    _assert_all_free(cluster)
