"""LoRA adapters on a real cluster (router with an API worker, one executor, both started
with `--lora-modules` and `--max-loras 4`): the OpenAI API's `model` and gRPC's
`lora_adapter` pick an adapter, whose greedy tokens are transformers + PEFT's; adapters
never share prefix-cache blocks with each other or the base model; names are listed and
unknown ones refused; an executor serving other adapters is refused at registration;
`pagedserve bench --lora-modules`; preemption (recompute and swap) and an executor's SIGKILL
keep every token. Adapters loaded and unloaded while serving (/v1/load_lora_adapter,
/v1/unload_lora_adapter through the API worker): PEFT's tokens, their own prefix-cache
blocks per load, an unload that lets running streams finish, a joining executor loading
them before it runs their requests."""

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
                                       target_modules=("q_proj", "v_proj", "down_proj")),
            "rt": build_lora_adapter(model, root / "rt", rank=8, alpha=8, seed=3),
            # (in the folder of --lora-dir, beside a folder that is not an adapter)
            "rt2": build_lora_adapter(model, root / "on_demand" / "rt2", rank=2, alpha=4,
                                      seed=4, target_modules=("o_proj", "up_proj")),
            "not_adapter": _mkdir(root / "on_demand" / "not_adapter")}


def _mkdir(path):
    path.mkdir(parents=True)
    return path


@pytest.fixture(scope="module")
def cluster(dirs):
    modules = ["--lora-modules", f"sql={dirs['sql']},chat={dirs['chat']}", "--max-loras", "4"]
    c = Cluster(dirs["model"], num_executors=1,
                executor_args=[*modules, "--max-lora-rank", "8"],
                router_args=[*modules, "--api-workers", "1", "--served-model-name", "base",
                             "--lora-dir", str(dirs["rt2"].parent)])
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


# ------------------------------------------------------------------ loaded while serving


def _lora(cluster, action: str, **body) -> tuple[int, str]:
    """POST /v1/{action}_lora_adapter: (status, the reply's text or error message)."""
    req = urllib.request.Request(f"http://{cluster.http_address}/v1/{action}_lora_adapter",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())["error"]["message"]


def _wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _names(cluster) -> list[str]:
    return [m["id"] for m in _get(cluster, "/v1/models")[1]["data"]]


def test_an_adapter_loaded_while_serving_runs_as_peft_and_is_refused_when_it_cannot(
        cluster, dirs, tmp_path):
    """Loaded through the API worker: listed (HTTP and gRPC), PEFT's tokens over both APIs;
    every bad load is refused with its reason and changes nothing; the fourth slot is the
    last; unloaded, it is gone and its name refused."""
    assert _lora(cluster, "load", lora_name="rt", lora_path=str(dirs["rt"])) == (
        200, "Success: LoRA adapter 'rt' added successfully.")
    assert _names(cluster) == ["base", "sql", "chat", "rt"]
    gauges = {line.split()[0]: float(line.split()[1]) for line in cluster.metrics().splitlines()
              if line.startswith("pagedserve_lora_adapter")}
    assert gauges == {"pagedserve_lora_adapters": 3.0, "pagedserve_lora_adapter_slots": 4.0}
    info = cluster.stub.GetModelInfo(pb.ModelInfoRequest(), timeout=10)
    assert list(info.lora_adapters) == ["sql", "chat", "rt"]
    ref, _ = peft_reference(dirs["model"], dirs["rt"], PROMPTS[1], MAX_TOKENS)
    assert _token_ids(_completion(cluster, "rt", PROMPTS[1])) == ref
    req = request(token_ids=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    req.lora_adapter = "rt"
    assert list(cluster.stub.Generate(req, timeout=60).completions[0].token_ids) == ref

    bad = [({"lora_name": "rt", "lora_path": str(dirs["rt"])},
            400, "The lora adapter 'rt' has already been loaded"),
           ({"lora_name": "sql", "lora_path": str(dirs["rt"])},
            400, "The lora adapter 'sql' has already been loaded"),
           ({"lora_name": "base", "lora_path": str(dirs["rt"])},
            400, "lora_name: 'base' is the served model's name"),
           ({"lora_name": "x"}, 400, "lora_path: a non-empty string is required"),
           ({"lora_name": "x y", "lora_path": "/a"}, 400,
            "lora_name: must be 1 to 256 characters without spaces, commas or slashes"),
           ({"lora_name": "x", "lora_path": str(tmp_path / "none")}, 400,
            f"LoRA adapter 'x' could not be loaded: executor exec0: LoRA adapter x: "
            f"{tmp_path / 'none'} is not a directory"),
           ({"lora_name": "x", "lora_path": str(dirs["model"])}, 400,
            f"LoRA adapter 'x' could not be loaded: executor exec0: LoRA adapter x: "
            f"{dirs['model']} has no adapter_config.json")]
    for body, status, message in bad:
        assert _lora(cluster, "load", **body) == (status, message), body
    assert _lora(cluster, "load", lora_name="x", lora_path=str(dirs["rt2"]))[0] == 200
    assert _lora(cluster, "load", lora_name="y", lora_path=str(dirs["rt2"])) == (
        400, "all 4 LoRA adapter slots are in use (--max-loras): unload an adapter first")
    assert _names(cluster) == ["base", "sql", "chat", "rt", "x"]
    assert _lora(cluster, "unload", lora_name="x")[0] == 200

    assert _lora(cluster, "unload", lora_name="rt") == (
        200, "Success: LoRA adapter 'rt' removed successfully.")
    assert _lora(cluster, "unload", lora_name="rt") == (
        404, "The lora adapter 'rt' cannot be found.")
    assert _lora(cluster, "unload", lora_name="sql") == (
        400, "The lora adapter 'sql' was given with --lora-modules and cannot be unloaded")
    assert _names(cluster) == ["base", "sql", "chat"]
    status, body = post_json(cluster, "/v1/completions", {"model": "rt", "prompt": "hi"})
    assert status == 404 and "'rt' does not exist" in body["error"]["message"]
    with pytest.raises(grpc.RpcError) as err:
        cluster.stub.Generate(req, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_name_loaded_again_never_reuses_the_old_adapters_cache(cluster, dirs):
    """'rt' served a 41-token prompt (its second request from the cache), unloaded, then
    'rt' loaded from another adapter: the same prompt computes again (no cached token) and
    gets the new adapter's tokens; its next request is cached again."""
    prompt = [11, *PROMPTS[1][1:]]

    def cached_and_ids():
        body = _completion(cluster, "rt", prompt)
        details = body["usage"].get("prompt_tokens_details") or {}
        return details.get("cached_tokens", 0), _token_ids(body)

    _lora(cluster, "load", lora_name="rt", lora_path=str(dirs["rt"]))
    first = [cached_and_ids(), cached_and_ids()]
    assert _lora(cluster, "unload", lora_name="rt")[0] == 200
    # (the unload may still be under way on the executor: the load waits for it)
    assert _lora(cluster, "load", lora_name="rt", lora_path=str(dirs["rt2"]))[0] == 200
    second = [cached_and_ids(), cached_and_ids()]
    old, _ = peft_reference(dirs["model"], dirs["rt"], prompt, MAX_TOKENS)
    new, _ = peft_reference(dirs["model"], dirs["rt2"], prompt, MAX_TOKENS)
    assert old != new
    assert first == [(0, old), (32, old)] and second == [(0, new), (32, new)]
    assert _lora(cluster, "unload", lora_name="rt")[0] == 200


def test_an_unload_lets_running_streams_finish_then_frees_the_slot(cluster, dirs):
    """Unloaded mid-stream: answered at once, new requests refused, the stream ends with
    PEFT's tokens; the slot is taken again only once it has ended."""
    import threading

    assert _lora(cluster, "load", lora_name="rt", lora_path=str(dirs["rt"]))[0] == 200
    assert _lora(cluster, "load", lora_name="fill", lora_path=str(dirs["rt2"]))[0] == 200
    prompt, max_tokens = [12, *PROMPTS[0][1:]], 96
    req = request(token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    req.lora_adapter = "rt"
    tokens: list[int] = []
    started = threading.Event()

    def consume():
        for chunk in cluster.stub.Stream(req, timeout=120):
            tokens.extend(chunk.token_ids)
            started.set()

    thread = threading.Thread(target=consume)
    thread.start()
    assert started.wait(60)
    assert _lora(cluster, "unload", lora_name="rt")[0] == 200
    running = thread.is_alive()
    status, message = _lora(cluster, "load", lora_name="x", lora_path=str(dirs["rt2"]))
    if thread.is_alive():  # the unloaded adapter's slot is still held by the stream
        assert (status, message) == (400, "all 4 LoRA adapter slots are in use (--max-loras): "
                                          "unload an adapter first")
    assert _completion_status(cluster, "rt") == 404
    thread.join(120)
    assert running, "the stream ended before the unload: make it longer"
    ref, _ = peft_reference(dirs["model"], dirs["rt"], prompt, max_tokens)
    assert tokens == ref
    assert _lora(cluster, "load", lora_name="x", lora_path=str(dirs["rt2"]))[0] == 200
    for name in ("x", "fill"):
        assert _lora(cluster, "unload", lora_name=name)[0] == 200


def test_an_adapter_of_the_lora_dir_loads_when_a_request_names_it(cluster, dirs):
    """--lora-dir: 'rt2' (a folder there, never loaded) named by a completion through the API
    worker and by gRPC: loaded on demand, PEFT's tokens, then listed; a folder there that
    is not an adapter stays unknown."""
    ref, _ = peft_reference(dirs["model"], dirs["rt2"], PROMPTS[0], MAX_TOKENS)
    assert "rt2" not in _names(cluster)
    assert _token_ids(_completion(cluster, "rt2", PROMPTS[0])) == ref
    assert _names(cluster)[-1] == "rt2"
    assert _lora(cluster, "unload", lora_name="rt2")[0] == 200
    req = request(token_ids=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0,
                  ignore_eos=True)
    req.lora_adapter = "rt2"
    assert list(cluster.stub.Generate(req, timeout=60).completions[0].token_ids) == ref
    assert _lora(cluster, "unload", lora_name="rt2")[0] == 200
    assert _completion_status(cluster, "not_adapter") == 404


def _completion_status(cluster, model: str) -> int:
    return post_json(cluster, "/v1/completions", {"model": model, "prompt": [5, 6],
                                                  "max_tokens": 1})[0]


def test_zz_streams_of_adapters_survive_an_executor_kill(cluster, dirs):
    """Runs last: an adapter is loaded, then a second executor joins with the same
    adapters (the loaded one loaded on it first); greedy streams of the three adapters and
    the base model run on the two; the executor holding more of them is SIGKILLed
    mid-stream; every stream completes on the other with transformers + PEFT's tokens (its
    requests re-sent there with their adapter, prompt and output so far)."""
    import signal
    import threading

    assert _lora(cluster, "load", lora_name="rt", lora_path=str(dirs["rt"]))[0] == 200
    cluster.start_executor("exec1")
    cluster.wait_executors(2)
    _wait_for(lambda: any("LoRA adapter rt loaded from" in line
                          for line in cluster.readers[-1].lines))  # exec1's
    names = ["sql", "chat", "base", "rt", "sql", "chat", "base", "rt"]
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
