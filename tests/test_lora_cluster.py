"""LoRA adapters on a real cluster (router with an API worker, one executor, both started
with `--lora-modules`): the OpenAI API's `model` and gRPC's `lora_adapter` pick an adapter,
whose greedy tokens are transformers + PEFT's; adapters never share prefix-cache blocks
with each other or the base model; names are listed and unknown ones refused; an executor
serving other adapters is refused at registration; `pagedserve bench --lora-modules`;
preemption (recompute and swap) and an executor's SIGKILL keep every token."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import grpc
import pytest
from cluster_harness import Cluster, concurrently, post_json, request
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
from test_lora import peft_reference
from test_models import PROMPTS

from pagedserve.tinymodels import build_lora_adapter, build_model

pytest.importorskip("peft")
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_cluster")
    model = build_model(root / "qwen2", "qwen2")
    return {"model": model,
            "sql": build_lora_adapter(model, root / "sql", rank=8, alpha=16, seed=1),
            "chat": build_lora_adapter(model, root / "chat", rank=4, alpha=8, seed=2,
                                       target_modules=("q_proj", "v_proj", "down_proj"))}


@pytest.fixture(scope="module")
def cluster(dirs):
    modules = ["--lora-modules", f"sql={dirs['sql']},chat={dirs['chat']}"]
    c = Cluster(dirs["model"], num_executors=1, executor_args=modules,
                router_args=[*modules, "--api-workers", "1", "--served-model-name", "base"])
    with c.running():
        yield c


def _get(cluster, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://{cluster.http_address}{path}", timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _completion(cluster, model: str, prompt: list[int]) -> dict:
    status, body = post_json(cluster, "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "return_tokens_as_token_ids": True, "logprobs": 0})
    assert status == 200, body
    return body


def _token_ids(body: dict) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["tokens"]]


def test_the_openai_model_field_picks_the_adapter(cluster, dirs):
    for model, adapter in (("sql", dirs["sql"]), ("chat", dirs["chat"]), ("base", None)):
        body = _completion(cluster, model, PROMPTS[0])
        assert body["model"] == model
        ref, _ = peft_reference(dirs["model"], adapter, PROMPTS[0], MAX_TOKENS)
        assert _token_ids(body) == ref, model
    base, _ = peft_reference(dirs["model"], None, PROMPTS[0], MAX_TOKENS)
    for adapter in ("sql", "chat"):
        assert peft_reference(dirs["model"], dirs[adapter], PROMPTS[0], MAX_TOKENS)[0] != base


def test_grpc_lora_adapter_field_and_model_info(cluster, dirs):
    req = request(token_ids=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0.0,
                  ignore_eos=True)
    req.lora_adapter = "chat"
    reply = cluster.stub.Generate(req, timeout=60)
    ref, _ = peft_reference(dirs["model"], dirs["chat"], PROMPTS[1], MAX_TOKENS)
    assert list(reply.completions[0].token_ids) == ref
    info = cluster.stub.GetModelInfo(pb.ModelInfoRequest(), timeout=10)
    assert list(info.lora_adapters) == ["sql", "chat"]
    req.lora_adapter = "nope"
    with pytest.raises(grpc.RpcError) as err:
        cluster.stub.Generate(req, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == ("lora_adapter: unknown LoRA adapter 'nope' "
                                   "(served: sql, chat)")


def test_adapters_never_share_prefix_cache_blocks(cluster):
    """The same 41-token prompt (two full blocks of 16) under each name: the second request
    of one name is served its two blocks from the cache, a first of another name none."""
    prompt = [7, *PROMPTS[1][1:]]  # a prompt no other test sent
    cached = []
    for model in ("sql", "sql", "chat", "base", "chat", "base"):
        usage = _completion(cluster, model, prompt)["usage"]
        cached.append((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    assert cached == [0, 32, 0, 0, 32, 32]


def test_models_are_listed_and_unknown_ones_refused(cluster):
    status, listing = _get(cluster, "/v1/models")
    assert status == 200
    assert [(m["id"], m.get("parent")) for m in listing["data"]] == [
        ("base", None), ("sql", "base"), ("chat", "base")]
    assert _get(cluster, "/v1/models/chat")[1]["parent"] == "base"
    status, body = post_json(cluster, "/v1/chat/completions", {
        "model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    assert status == 404
    assert body["error"]["message"] == ("the model 'nope' does not exist; this server serves "
                                        "'base', 'sql', 'chat'")
    status, body = post_json(cluster, "/tokenize", {"model": "sql", "prompt": "hi there"})
    assert status == 200 and body["count"] > 0


def test_chat_with_an_adapter(cluster, dirs):
    status, body = post_json(cluster, "/v1/chat/completions", {
        "model": "sql", "messages": [{"role": "user", "content": "select"}],
        "max_tokens": 4, "temperature": 0})
    assert status == 200, body
    assert body["model"] == "sql" and body["usage"]["completion_tokens"] >= 1


def test_an_executor_serving_other_adapters_is_refused(cluster, dirs):
    proc = cluster._spawn(["executor", "--model", str(dirs["model"]), "--router", cluster.zmq,
                           "--executor-id", "odd", "--lora-modules", f"sql={dirs['sql']}"],
                          "odd")
    try:
        assert proc.wait(timeout=120) == 3
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(0.2)  # the reader thread's last lines
    tail = cluster.logs(n=None)
    assert ("refused executor odd: LoRA adapters sql, the router serves chat, sql (start "
            "both with the same --lora-modules)") in tail


def test_bench_spreads_requests_over_adapters(cluster):
    """`pagedserve bench --lora-modules`: each request runs one of the names, drawn at
    random, over gRPC and over the OpenAI API (a name the server lacks fails those
    requests: the field travels)."""
    import subprocess
    import sys

    def bench(address, *args):
        proc = subprocess.run(
            [sys.executable, "-m", "pagedserve.cli", "bench", "--address", address, "--json",
             "--num-prompts", "8", "--input-len-range", "8:16", "--output-len-range", "3:3",
             "--seed", "2", *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout)

    for address, extra in ((cluster.address, ()),
                           (cluster.http_address, ("--backend", "openai", "--vocab-size",
                                                   "512"))):
        good = bench(address, "--lora-modules", "sql,chat", *extra)
        assert (good["completed"], good["failed"], good["total_output_tokens"]) == (8, 0, 24)
        mixed = bench(address, "--lora-modules", "sql,nope", *extra)
        assert mixed["completed"] > 0 and mixed["failed"] > 0
        assert mixed["completed"] + mixed["failed"] == 8


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_adapter_requests_keep_their_tokens(dirs, mode):
    """Six streams of two adapters and the base model on 12 device blocks (they need ~24):
    preempted by `mode` and resumed (recompute: sent again with their adapter), each ends
    with transformers + PEFT's tokens, and every block comes back."""
    modules = ["--lora-modules", f"sql={dirs['sql']},chat={dirs['chat']}"]
    c = Cluster(dirs["model"], num_executors=1, router_args=[*modules, "--preemption-mode", mode],
                executor_args=[*modules, "--num-gpu-blocks", "12", "--swap-space", "0.05"])
    names = ["sql", "chat", "base"] * 2
    prompts = [[20 + i, *PROMPTS[0][1:]] for i in range(len(names))]
    max_tokens = 48
    refs = [peft_reference(dirs["model"], dirs.get(n), p, max_tokens)[0]
            for n, p in zip(names, prompts, strict=True)]
    with c.running():
        def run(i):
            req = request(token_ids=prompts[i], max_tokens=max_tokens, temperature=0.0,
                          ignore_eos=True)
            req.lora_adapter = "" if names[i] == "base" else names[i]
            return list(c.stub.Generate(req, timeout=120).completions[0].token_ids)
        results = concurrently(run, list(range(len(names))))
        assert results == refs
        preempted = sum(float(line.rsplit(" ", 1)[1]) for line in c.metrics().splitlines()
                        if line.startswith("pagedserve_preemptions_total{")
                        and f'mode="{mode}"' in line)
        assert preempted > 0
        e = c.wait_blocks_free().executors[0]
        assert e.num_free_gpu_blocks == e.num_gpu_blocks


def test_zz_streams_of_adapters_survive_an_executor_kill(cluster, dirs):
    """Runs last: a second executor joins with the same adapters; greedy streams of both
    adapters and the base model run on the two; the executor holding more of them is
    SIGKILLed mid-stream; every stream completes on the other with transformers + PEFT's
    tokens (its requests re-sent there with their adapter, prompt and output so far)."""
    import signal
    import threading

    cluster.start_executor("exec1")
    cluster.wait_executors(2)
    names = ["sql", "chat", "base", "sql", "chat", "base", "sql", "chat"]
    prompts = [[9 + i, *PROMPTS[i % 2][1:]] for i in range(len(names))]
    max_tokens = 32
    refs = [peft_reference(dirs["model"], dirs.get(n), p, max_tokens)[0]
            for n, p in zip(names, prompts, strict=True)]
    results: dict[int, object] = {}
    started = threading.Barrier(len(names) + 1, timeout=60)

    def consume(i):
        req = request(token_ids=prompts[i], max_tokens=max_tokens, temperature=0.0,
                      ignore_eos=True)
        req.lora_adapter = "" if names[i] == "base" else names[i]
        try:
            tokens = []
            for n, chunk in enumerate(cluster.stub.Stream(req, timeout=120)):
                tokens.extend(chunk.token_ids)
                if n == 0:
                    started.wait()
            results[i] = tokens
        except (grpc.RpcError, threading.BrokenBarrierError) as exc:
            results[i] = exc

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(names))]
    for t in threads:
        t.start()
    started.wait()
    running = {e.id: e.running for e in cluster.status().executors if e.healthy}
    victim = max(running, key=running.get)
    assert running[victim] > 0
    cluster.executors[victim].send_signal(signal.SIGKILL)
    for t in threads:
        t.join(timeout=120)
    for i, ref in enumerate(refs):
        assert results[i] == ref, (i, names[i], results[i])
    healthy = {e.id: e.healthy for e in cluster.status().executors}
    assert list(healthy.values()).count(True) == 1
    migrated = [line for line in cluster.metrics().splitlines()
                if line.startswith("pagedserve_migrations_total ")]
    assert migrated and float(migrated[0].split()[1]) >= 1  # the kill was mid-stream


def test_embeddings_run_the_adapter_the_model_field_names(cluster, dirs):
    """/v1/embeddings with an adapter's name as `model`: the last-token hidden state of
    transformers + PEFT with that adapter (the base model's without one), normalized."""
    import numpy as np
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    for name in ("sql", None):
        model = AutoModelForCausalLM.from_pretrained(str(dirs["model"]), dtype=torch.float32)
        if name is not None:
            model = PeftModel.from_pretrained(model, str(dirs[name]))
        with torch.no_grad():
            out = model.eval()(torch.tensor([PROMPTS[0]]), output_hidden_states=True)
        want = out.hidden_states[-1][0, -1].double().numpy()
        status, body = post_json(cluster, "/v1/embeddings",
                                 {"model": name or "base", "input": [PROMPTS[0]]})
        assert status == 200, body
        assert body["model"] == (name or "base")
        np.testing.assert_allclose(body["data"][0]["embedding"], want / np.linalg.norm(want),
                                   atol=2e-5)
