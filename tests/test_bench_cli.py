"""`pagedserve bench` end to end: a one-executor cluster on a tiny model, each dataset with a
few requests, `--json` parses and holds the promised keys. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cluster_harness import Cluster

from pagedserve.tinymodels import build_model

KEYS = ("bench", "case", "completed", "failed", "duration_s", "total_input_tokens",
        "total_output_tokens", "request_throughput_req_per_s", "output_throughput_tok_per_s",
        "total_token_throughput_tok_per_s", "prefix_hit_ratio")
LATENCIES = ("ttft", "tpot", "itl", "e2e")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = build_model(tmp_path_factory.mktemp("bench_model"), "llama", hidden_size=64,
                        num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=128)
    c = Cluster(model, num_executors=1, executor_args=["--num-gpu-blocks", "256"]).start()
    yield c
    c.stop()


def _bench(cluster, *args: str, address: str | None = None) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", "bench", "--address", address or cluster.address,
         "--metrics-address", cluster.metrics_address, "--json", *args],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout
    res = json.loads(lines[0])
    for key in KEYS:
        assert key in res, key
    stats = ("mean", *(k.rsplit("_", 1)[1] for k in res if k.startswith("ttft_ms_p")))
    assert len(stats) > 1
    for name in LATENCIES:
        for stat in stats:
            assert res[f"{name}_ms_{stat}"] is not None, (name, stat)
    assert res["bench"] == "pagedserve_bench"
    assert res["failed"] == 0 and "errors" not in res
    return res


def test_random_dataset_poisson(cluster):
    res = _bench(cluster, "--dataset", "random", "--num-prompts", "6",
                 "--input-len-range", "8:40", "--output-len-range", "4:8",
                 "--request-rate", "50", "--burstiness", "0.5", "--seed", "3")
    assert res["case"] == "random" and res["completed"] == 6
    # ignore_eos: every request produced exactly its max_tokens, 4..8 each.
    assert 6 * 4 <= res["total_output_tokens"] <= 6 * 8
    assert 6 * 8 <= res["total_input_tokens"] <= 6 * 40


def test_goodput_and_chosen_percentiles(cluster):
    """Objectives no request can miss count every request good; one none can meet (a
    whole request in a microsecond) counts none; the latencies carry the percentiles asked."""
    args = ("--num-prompts", "3", "--input-len-range", "8:8", "--output-len-range", "3:3",
            "--metric-percentiles", "25,99.9")
    res = _bench(cluster, *args, "--goodput", "ttft:60000", "tpot:60000", "e2el:60000")
    assert res["goodput_slos_ms"] == {"ttft": 60000, "tpot": 60000, "e2el": 60000}
    assert res["good_completed"] == res["completed"] == 3
    assert res["request_goodput_req_per_s"] == res["request_throughput_req_per_s"]
    assert res["ttft_ms_p25"] <= res["ttft_ms_p99.9"] and "ttft_ms_p90" not in res
    res = _bench(cluster, *args, "--goodput", "e2el:0.001")
    assert res["good_completed"] == 0 and res["request_goodput_req_per_s"] == 0.0


def test_shared_prefix_dataset_hits_cache(cluster):
    # Concurrency 1: the second question of a tenant finds the first one's prefix cached.
    res = _bench(cluster, "--dataset", "shared-prefix", "--tenants", "2",
                 "--prefix-len", "64", "--questions-per-tenant", "3", "--question-len", "8",
                 "--output-len-range", "4:4", "--max-concurrency", "1")
    assert res["completed"] == 6 and res["total_output_tokens"] == 24
    assert res["total_input_tokens"] == 6 * 72
    assert res["prefix_hit_ratio"] > 0.4
    assert res["prefix_cache_queries_tokens"] == 6 * 72


def test_openai_backend_runs_the_same_workload_over_http(cluster):
    """--backend openai: the shared-prefix workload as streamed /v1/completions (token-id
    prompts) gives the same token counts and cache hits as over gRPC."""
    res = _bench(cluster, "--backend", "openai", "--vocab-size", "512",
                 "--dataset", "shared-prefix", "--tenants", "2", "--prefix-len", "64",
                 "--questions-per-tenant", "3", "--question-len", "8",
                 "--output-len-range", "4:4", "--max-concurrency", "1", "--seed", "5",
                 address=cluster.http_address)
    assert res["backend"] == "openai" and res["completed"] == 6
    assert res["total_output_tokens"] == 24 and res["total_input_tokens"] == 6 * 72
    assert res["prefix_hit_ratio"] > 0.4 and res["cached_prompt_tokens"] > 0
    bad = subprocess.run([sys.executable, "-m", "pagedserve.cli", "bench", "--backend", "openai",
                          "--address", cluster.http_address, "--num-prompts", "1", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "--vocab-size" in bad.stderr


def test_openai_embeddings_backend(cluster):
    """--backend openai-embeddings: the shared-prefix workload as POST /v1/embeddings: every
    prompt's tokens counted, no output, the prefixes from the cache; latency = the reply."""
    proc = subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", "bench", "--backend", "openai-embeddings",
         "--address", cluster.http_address, "--metrics-address", cluster.metrics_address,
         "--json", "--vocab-size", "512", "--dataset", "shared-prefix", "--tenants", "2",
         "--prefix-len", "64", "--questions-per-tenant", "3", "--question-len", "8",
         "--max-concurrency", "1", "--seed", "6"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout)
    assert res["backend"] == "openai-embeddings" and res["completed"] == 6
    assert res["failed"] == 0 and "errors" not in res
    assert res["total_input_tokens"] == 6 * 72 and res["total_output_tokens"] == 0
    assert res["prefix_hit_ratio"] > 0.4
    assert res["ttft_ms_p50"] == res["e2e_ms_p50"] > 0 and res["tpot_ms_p50"] is None


def test_requests_spread_over_several_connections(cluster):
    res = _bench(cluster, "--num-prompts", "6", "--input-len-range", "8:16",
                 "--output-len-range", "3:3", "--connections", "3", "--seed", "5")
    assert res["completed"] == 6 and res["total_output_tokens"] == 18
    bad = subprocess.run([sys.executable, "-m", "pagedserve.cli", "bench", "--connections",
                          "0"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "--connections" in bad.stderr


def test_file_dataset(cluster, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('hello world\n{"prompt": "The quick brown fox", "max_tokens": 5}\n\n')
    res = _bench(cluster, "--dataset", "file", "--file", str(prompts), "--num-prompts", "4",
                 "--output-len-range", "3:3", "--max-concurrency", "2")
    assert res["case"] == "file" and res["completed"] == 4
    assert res["total_output_tokens"] == 3 + 5 + 3 + 5


def test_openai_chat_backend(cluster, tmp_path):
    """--backend openai-chat: the file's text prompts as streamed /v1/chat/completions (one
    user message each, the model's chat template), fixed output lengths; token-id datasets
    refused."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('hello world\n{"prompt": "The quick brown fox", "max_tokens": 5}\n')
    res = _bench(cluster, "--backend", "openai-chat", "--dataset", "file", "--file",
                 str(prompts), "--num-prompts", "4", "--output-len-range", "3:3",
                 "--max-concurrency", "2", address=cluster.http_address)
    assert res["backend"] == "openai-chat" and res["completed"] == 4
    assert res["total_output_tokens"] == 3 + 5 + 3 + 5
    # the chat template wraps each prompt: more input tokens than the plain prompts have
    plain = _bench(cluster, "--backend", "openai", "--dataset", "file", "--file",
                   str(prompts), "--num-prompts", "4", "--output-len-range", "3:3",
                   address=cluster.http_address)
    assert res["total_input_tokens"] > plain["total_input_tokens"]
    bad = subprocess.run([sys.executable, "-m", "pagedserve.cli", "bench", "--backend",
                          "openai-chat", "--address", cluster.http_address, "--num-prompts",
                          "1", "--vocab-size", "512", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "--dataset file or sharegpt" in bad.stderr


def test_sharegpt_dataset(cluster, tmp_path):
    """--dataset sharegpt: first turns as prompts, the second turns' token counts (the
    served model's tokenizer) as output lengths, vLLM's filter applied, over gRPC and as
    chat."""
    from pagedserve.router.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(cluster.model_dir)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota",
             "kappa"]
    conversations = []
    for i in range(8):
        human = " ".join(words[: 3 + i])
        gpt = " ".join(reversed(words[: 2 + i]))
        conversations.append({"id": str(i), "conversations": [
            {"from": "human", "value": human}, {"from": "gpt", "value": gpt}]})
    conversations.append({"id": "one-turn", "conversations": [{"from": "human", "value": "x"}]})
    conversations.append({"id": "short", "conversations": [
        {"from": "human", "value": "alpha beta gamma delta"}, {"from": "gpt", "value": "ok"}]})
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(conversations))
    expected = {}
    for c in conversations:
        turns = c["conversations"]
        if len(turns) < 2:
            continue
        n_in = len(tok.encode(turns[0]["value"]))
        n_out = len(tok.encode(turns[1]["value"], add_special_tokens=False))
        if min(n_in, n_out) >= 4:
            expected[turns[0]["value"]] = n_out
    args = ("--dataset", "sharegpt", "--file", str(data), "--tokenizer",
            str(cluster.model_dir), "--num-prompts", "50", "--max-concurrency", "4")
    res = _bench(cluster, *args)
    assert res["case"] == "sharegpt" and res["completed"] == len(expected) < 10
    assert res["total_output_tokens"] == sum(expected.values())  # ignore_eos: exactly
    chat = _bench(cluster, "--backend", "openai-chat", *args, address=cluster.http_address)
    assert chat["completed"] == len(expected)
    assert chat["total_output_tokens"] == sum(expected.values())
    no_tok = subprocess.run([sys.executable, "-m", "pagedserve.cli", "bench", "--address",
                             cluster.address, "--dataset", "sharegpt", "--file", str(data),
                             "--json"], capture_output=True, text=True, timeout=60)
    assert no_tok.returncode != 0 and "--tokenizer" in no_tok.stderr


def test_readable_table_and_bad_flags(cluster):
    proc = subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", "bench", "--address", cluster.address,
         "--num-prompts", "2", "--input-len-range", "8:8", "--output-len-range", "2:2",
         "--no-progress"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "output throughput (tok/s)" in proc.stdout and "TTFT" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "pagedserve.cli", "bench",
                          "--input-len-range", "9:3"], capture_output=True, text=True,
                         timeout=30)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
