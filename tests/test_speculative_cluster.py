"""Speculative decoding (--speculative-config, ngram) in a real cluster: router, one API
worker, a CPU executor. The model's attention and MLP outputs are scaled down (x0.01) so
its greedy text repeats itself now and then, as real text does, while still depending on
the context: drafts get confirmed. Greedy outputs equal transformers'; seeded sampled
outputs (n=2, penalties, logprobs) equal those of the same cluster without speculation;
streams, stop strings, max_tokens and the OpenAI API through a worker hold; under a small
KV cache, preemption keeps every token and every block comes back. And the benchmark's
smallest run."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from cluster_harness import Cluster, HFReference, assert_greedy_match, concurrently, request
from safetensors.torch import load_file, save_file
from test_structured_cluster import structured

from pagedserve.tinymodels import build_model

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                   "prompt_lookup_min": 1})
PROMPTS = ["a b c d a b c d a b c d", "Once upon a time there was a small language model",
           "1 2 3 1 2 3 1 2 3 1 2 3 1 2 3", "The router owns the block tables."]
MAX_TOKENS = 48
STRUCTURED = [  # formats that force runs of tokens between free choices
    ("choice", ["the router owns the block tables", "the executor owns the cache"]),
    ("regex", "(alpha|beta)-[0-9]{2}-(gamma|delta) done"),
    ("json_schema", json.dumps({
        "type": "object", "additionalProperties": False, "required": ["kind", "size"],
        "properties": {"kind": {"enum": ["router", "executor"]},
                       "size": {"type": "integer", "minimum": 0, "maximum": 99}}})),
]
SAMPLED = dict(max_tokens=32, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True, n=2,
               repetition_penalty=1.1, frequency_penalty=0.2, logprobs=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model = build_model(tmp_path_factory.mktemp("spec_cluster") / "llama", "llama")
    weights = load_file(str(model / "model.safetensors"))
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * 0.01
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    return model


@pytest.fixture(scope="module")
def hf(model_dir):
    return HFReference(model_dir)


@pytest.fixture(scope="module")
def cluster(model_dir):
    c = Cluster(model_dir, num_executors=1,
                router_args=["--speculative-config", SPEC, "--api-workers", "1",
                             "--served-model-name", "spec"])
    with c.running():
        yield c


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def _greedy(cluster) -> list[list[int]]:
    resps = concurrently(lambda p: cluster.stub.Generate(
        request(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), timeout=120),
        PROMPTS)
    return [list(r.completions[0].token_ids) for r in resps]


def test_greedy_equals_transformers_with_drafts_confirmed(cluster, hf):
    got = _greedy(cluster)
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        ref, gaps = hf.greedy(hf.encode(prompt), MAX_TOKENS)
        assert_greedy_match(tokens, ref, gaps)
    m = cluster.metrics()
    drafts = _metric(m, "pagedserve_spec_decode_num_draft_tokens_total")
    accepted = _metric(m, "pagedserve_spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < accepted <= drafts, (drafts, accepted)
    cluster.wait_blocks_free()


def _constrained(prompt: str, kind: str, value, **params):
    req = request(prompt, max_tokens=40, logprobs=1, **params)
    req.params.structured_output.CopyFrom(structured(kind, value))
    return req


def test_sampled_outputs_equal_those_without_speculation(cluster, model_dir):
    """Seeded sampling, and structured output (greedy and sampled) whose drafts are the
    tokens the format forces (router/grammar_drafts.py), masked per drafted position on
    the executor: the same tokens and logprobs as the same cluster without drafts."""
    constrained = [_constrained(p, kind, value, **params) for p in PROMPTS[:2]
                   for kind, value in STRUCTURED
                   for params in (dict(temperature=0.0), dict(temperature=0.9, seed=3, n=2))]

    accepted = "pagedserve_spec_decode_num_accepted_tokens_total"

    def sampled(c):
        before = _metric(c.metrics(), accepted)
        resps = concurrently(lambda r: c.stub.Generate(r, timeout=120), constrained)
        c.constrained_accepted = _metric(c.metrics(), accepted) - before
        resps += concurrently(lambda p: c.stub.Generate(request(p, **SAMPLED), timeout=120),
                              PROMPTS)
        return [[(list(x.token_ids), [lp.logprob for lp in x.logprobs])
                 for x in r.completions] for r in resps]

    with_drafts = sampled(cluster)
    assert cluster.constrained_accepted > 40  # forced tokens went as drafts
    plain = Cluster(model_dir, num_executors=1)
    with plain.running():
        without = sampled(plain)
    for ours, theirs in zip(with_drafts, without, strict=True):
        for (tokens, lps), (want, want_lps) in zip(ours, theirs, strict=True):
            assert tokens == want and len(lps) == len(tokens)
            np.testing.assert_allclose(lps, want_lps, atol=1e-4)


def test_stream_stop_string_and_max_tokens(cluster):
    prompt = PROMPTS[0]
    full = cluster.stub.Generate(request(prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                         ignore_eos=True), timeout=60).completions[0]
    chunks = list(cluster.stub.Stream(request(prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                              ignore_eos=True, logprobs=0), timeout=60))
    assert [t for c in chunks for t in c.token_ids] == list(full.token_ids)
    assert "".join(c.text for c in chunks) == full.text
    assert sum(len(c.logprobs) for c in chunks) == MAX_TOKENS
    for n in (1, 5, 7):
        got = cluster.stub.Generate(request(prompt, max_tokens=n, temperature=0.0,
                                            ignore_eos=True), timeout=60)
        assert list(got.completions[0].token_ids) == list(full.token_ids[:n])
        assert got.usage.completion_tokens == n
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
    body = json.dumps({"model": "spec", "prompt": prompt, "max_tokens": MAX_TOKENS,
                       "temperature": 0, "ignore_eos": True, "stop": [stop]}).encode()
    req = urllib.request.Request(f"http://{cluster.http_address}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        out = json.loads(resp.read())
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == full.text[:full.text.index(stop)]
    cluster.wait_blocks_free()


def test_preemption_with_drafts_keeps_tokens_and_blocks(model_dir, hf):
    c = Cluster(model_dir, num_executors=1,
                router_args=["--speculative-config", SPEC, "--preemption-mode", "recompute",
                             "--block-size", "8"],
                executor_args=["--num-gpu-blocks", "9", "--block-size", "8"])
    with c.running():
        got = _greedy(c)
        m = c.metrics()
        assert _metric(m, "pagedserve_preemptions_total") >= 1
        assert _metric(m, "pagedserve_spec_decode_num_accepted_tokens_total") > 0
        c.wait_blocks_free()
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        ref, gaps = hf.greedy(hf.encode(prompt), MAX_TOKENS)
        assert_greedy_match(tokens, ref, gaps)


def test_spec_decode_bench_quick(model_dir):
    """benchmarks/spec_decode_bench.py in its smallest setting on this model: its JSON
    line, and in float32 the same tokens with and without drafts."""
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "spec_decode_bench.py"), "--model",
         str(model_dir), "--workloads", "echo", "--concurrency", "1", "--rounds", "1",
         "--max-tokens", "16", "--dtype", "float32"],
        cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [json.loads(x) for x in proc.stdout.splitlines() if x.strip()]
    assert line["bench"] == "spec_decode_bench" and line["case"] == "echo_c1"
    for key in ("plain_output_tok_per_s", "spec_output_tok_per_s", "speedup_ratio",
                "plain_tpot_ms", "spec_tpot_ms", "acceptance_ratio",
                "draft_tokens_per_output_token"):
        assert line[key] >= 0, key
    assert line["same_outputs"] is True and 4 <= line["output_tokens"] <= 4 * 16
