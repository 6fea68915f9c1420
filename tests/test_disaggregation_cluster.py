"""Prefill/decode disaggregation on a real cluster (router/handoff.py): exec0 runs
`--disaggregation-mode prefill`, exec1 `decode`. Every request's prompt is computed on
exec0, its first token sampled there, its blocks moved to exec1, which computes only the
tail and decodes. Outputs equal transformers' token for token; the metrics count every
move and block; nothing is left held on either executor; a request ending at its first
token stays put; the samples of n > 1 move together; with the decode executor gone, the prefill executor serves alone."""

from __future__ import annotations

import random
import re
import signal
import time

import pytest
from cluster_harness import Cluster, HFReference, assert_greedy_match, concurrently, request

from pagedserve.tinymodels import build_model

BS = 16
MAX_TOKENS = 12
EXECUTOR_ARGS = ["--num-gpu-blocks", "96", "--num-cpu-blocks", "96"]
MODES = {"exec0": {"PAGEDSERVE_DISAGGREGATION_MODE": "prefill"},
         "exec1": {"PAGEDSERVE_DISAGGREGATION_MODE": "decode"}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def hf(model_dir):
    return HFReference(model_dir)


@pytest.fixture(scope="module")
def cluster(model_dir):
    with Cluster(model_dir, num_executors=2, executor_args=EXECUTOR_ARGS,
                 executor_env=MODES).running() as c:
        yield c


def _metric(cluster, name: str, executor: str) -> float:
    pattern = re.compile(rf'^{name}\{{executor="{executor}"\}} (\S+)$', re.M)
    m = pattern.search(cluster.metrics())
    return float(m.group(1)) if m else 0.0


def _counts(cluster) -> tuple[float, float, float, float]:
    """(handoffs from exec0, blocks exec1 received, exec1's prompt tokens looked up, of
    them found cached)."""
    return (_metric(cluster, "pagedserve_handoffs_total", "exec0"),
            _metric(cluster, "pagedserve_kv_blocks_received_total", "exec1"),
            _metric(cluster, "pagedserve_prefix_cache_queries_total", "exec1"),
            _metric(cluster, "pagedserve_prefix_cache_hits_total", "exec1"))


def _generate(cluster, ids, max_tokens=MAX_TOKENS):
    resp = cluster.stub.Generate(request(token_ids=ids, max_tokens=max_tokens,
                                         temperature=0.0, ignore_eos=True), timeout=120)
    return list(resp.completions[0].token_ids)


def _assert_all_free(cluster):
    status = cluster.wait_blocks_free()
    for e in (e for e in status.executors if e.healthy):
        assert e.num_free_gpu_blocks == e.num_gpu_blocks, (e, cluster.logs())
        assert e.num_free_cpu_blocks == e.num_cpu_blocks, (e, cluster.logs())
        assert e.running == e.waiting == 0, e


def test_prompts_move_with_their_blocks(cluster, hf):
    """One request at a time, so every count is exact: each prompt's full blocks move
    (no prefix shared), and exec1 finds them all cached: it computes only the tail."""
    rng = random.Random(3)
    vocab = hf.model.config.vocab_size
    before = _counts(cluster)
    blocks = queried = 0
    for n in (5, 16, 40, 64, 77):
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        got = _generate(cluster, ids)
        ref, gaps = hf.greedy(ids, MAX_TOKENS)
        assert_greedy_match(got, ref, gaps)
        blocks += n // BS
        queried += n + 1  # the prompt and the first token, sampled on exec0
    handoffs, received, queries, hits = (a - b for a, b in zip(_counts(cluster), before,
                                                               strict=True))
    assert handoffs == 5, cluster.logs()
    assert received == blocks
    assert queries == queried
    assert hits == blocks * BS  # every received block was a hit: computed once only
    _assert_all_free(cluster)


def test_concurrent_requests_and_a_shared_prefix(cluster, hf):
    """Eight at once, four sharing a 48-token prefix: outputs exact; the shared blocks
    exec1 holds already are not sent again."""
    rng = random.Random(5)
    vocab = hf.model.config.vocab_size
    shared = [rng.randrange(3, vocab) for _ in range(48)]
    prompts = [shared + [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 30))]
               for _ in range(4)]
    prompts += [[rng.randrange(3, vocab) for _ in range(rng.randrange(20, 70))]
                for _ in range(4)]
    before = _counts(cluster)
    outs = concurrently(lambda ids: _generate(cluster, ids), prompts)
    for ids, got in zip(prompts, outs, strict=True):
        assert isinstance(got, list), got
        ref, gaps = hf.greedy(ids, MAX_TOKENS)
        assert_greedy_match(got, ref, gaps)
    handoffs, received, _, _ = (a - b for a, b in zip(_counts(cluster), before, strict=True))
    assert handoffs == 8
    assert received <= sum(len(p) // BS for p in prompts)
    _assert_all_free(cluster)


def test_streams_and_aborts(cluster, hf):
    """A stream read to its end and one left after its first tokens: the first is exact,
    the second's blocks are freed wherever they were."""
    rng = random.Random(9)
    vocab = hf.model.config.vocab_size
    ids = [rng.randrange(3, vocab) for _ in range(50)]
    stream = cluster.stub.Stream(request(token_ids=ids, max_tokens=MAX_TOKENS,
                                         temperature=0.0, ignore_eos=True), timeout=120)
    got = [t for part in stream for t in part.token_ids]
    ref, gaps = hf.greedy(ids, MAX_TOKENS)
    assert_greedy_match(got, ref, gaps)
    left = cluster.stub.Stream(request(token_ids=ids[::-1], max_tokens=200,
                                       temperature=0.0, ignore_eos=True), timeout=120)
    next(iter(left))
    left.cancel()
    _assert_all_free(cluster)


def test_a_request_ending_at_its_first_token_stays(cluster, hf):
    rng = random.Random(13)
    ids = [rng.randrange(3, hf.model.config.vocab_size) for _ in range(33)]
    before = _counts(cluster)
    got = _generate(cluster, ids, max_tokens=1)
    ref, gaps = hf.greedy(ids, 1)
    assert_greedy_match(got, ref, gaps)
    assert _counts(cluster)[0] == before[0]
    _assert_all_free(cluster)


def test_the_samples_of_n_2_move_together(cluster, hf):
    """n = 2: both samples sample their first token on exec0 and move in one handoff; the
    prompt's blocks go once; both outputs exact."""
    rng = random.Random(17)
    ids = [rng.randrange(3, hf.model.config.vocab_size) for _ in range(45)]
    before = _counts(cluster)
    resp = cluster.stub.Generate(request(token_ids=ids, max_tokens=MAX_TOKENS, n=2,
                                         temperature=0.0, ignore_eos=True), timeout=120)
    ref, gaps = hf.greedy(ids, MAX_TOKENS)
    assert len(resp.completions) == 2
    for completion in resp.completions:
        assert_greedy_match(list(completion.token_ids), ref, gaps)
    handoffs, received, _, hits = (a - b for a, b in zip(_counts(cluster), before,
                                                         strict=True))
    assert (handoffs, received) == (1, len(ids) // BS), cluster.logs()
    assert hits == 2 * received * BS  # each sample found every received block cached
    _assert_all_free(cluster)


def _wait_healthy(cluster, n: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if sum(e.healthy for e in cluster.status().executors) == n:
            return
        time.sleep(0.1)
    raise AssertionError(cluster.logs())


def test_the_prefill_executor_lost_with_requests_on_both(cluster, hf):
    """exec0 killed while streams run: those it held (their prompts being computed, or
    marked to move) go to exec1, which then takes new requests alone; every output exact
    and nothing held. exec0 comes back for the next test."""
    rng = random.Random(21)
    vocab = hf.model.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (30, 60, 90, 120)]
    streams = []
    for ids in prompts:
        streams.append(cluster.stub.Stream(request(token_ids=ids, max_tokens=40,
                                                   temperature=0.0, ignore_eos=True),
                                           timeout=120))
    first = next(iter(streams[0]))  # the first request is out of its prompt
    cluster.executors["exec0"].send_signal(signal.SIGKILL)
    cluster.executors["exec0"].wait(10)
    outs = [list(first.token_ids) + [t for part in streams[0] for t in part.token_ids]]
    outs += [[t for part in s for t in part.token_ids] for s in streams[1:]]
    for ids, got in zip(prompts, outs, strict=True):
        ref, gaps = hf.greedy(ids, 40)
        assert_greedy_match(got, ref, gaps)
    _wait_healthy(cluster, 1)
    ids = prompts[0][::-1]
    ref, gaps = hf.greedy(ids, MAX_TOKENS)
    assert_greedy_match(_generate(cluster, ids), ref, gaps)  # exec1 alone
    _assert_all_free(cluster)
    cluster.start_executor("exec0", MODES["exec0"])
    _wait_healthy(cluster, 2)


def test_without_the_decode_executor_the_prefill_one_serves(cluster, hf):
    """Last (it stops exec1): requests then stay on exec0 from prompt to end."""
    cluster.executors["exec1"].send_signal(signal.SIGKILL)
    cluster.executors["exec1"].wait(10)
    _wait_healthy(cluster, 1)
    rng = random.Random(17)
    ids = [rng.randrange(3, hf.model.config.vocab_size) for _ in range(40)]
    before = _counts(cluster)[0]
    got = _generate(cluster, ids)
    ref, gaps = hf.greedy(ids, MAX_TOKENS)
    assert_greedy_match(got, ref, gaps)
    assert _counts(cluster)[0] == before
    _assert_all_free(cluster)
