"""Weights updated while a real cluster serves (router with an API worker, two executors,
`--enable-weight-updates`; router/weight_sync.py): through the API worker's HTTP routes an
update waits for the running stream (its tokens all the old model's) and holds a new
request (its tokens all the new model's, none of the old KV reused); a checkpoint of
another model is refused with nothing changed; a retract pause cuts a stream, the weights
change under it and it ends with the new model's continuation; a stream frozen in place
(vLLM's /pause?mode=keep) goes on where it was, or, with new weights loaded meanwhile, is
retracted and goes on with them; an executor joining afterwards loads the new weights
before it takes a request."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
from cluster_harness import Cluster, HFReference, assert_greedy_match, post_json, request
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
from test_models import PROMPTS

from pagedserve.tinymodels import build_model

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("weight_cluster")
    return {"old": build_model(root / "old", seed=0),
            "new": build_model(root / "new", seed=1, dtype="bfloat16"),
            "newer": build_model(root / "newer", seed=2),
            "other": build_model(root / "other", seed=1, num_layers=3)}


@pytest.fixture(scope="module")
def refs(dirs):
    cache = {}

    def greedy(name, prompt, n=MAX_TOKENS):
        if name not in cache:
            cache.clear()  # one model in memory at a time
            cache[name] = HFReference(dirs[name])
        return cache[name].greedy(list(prompt), n)
    return greedy


@pytest.fixture(scope="module")
def cluster(dirs):
    c = Cluster(dirs["old"], num_executors=2,
                router_args=["--api-workers", "1", "--enable-weight-updates",
                             "--weight-version", "step-0"])
    with c.running():
        yield c


def _get(cluster, path: str):
    with urllib.request.urlopen(f"http://{cluster.http_address}{path}", timeout=30) as r:
        return r.status, json.loads(r.read())


def _completion(cluster, prompt) -> dict:
    status, body = post_json(cluster, "/v1/completions", {
        "model": "old", "prompt": list(prompt), "max_tokens": MAX_TOKENS,
        "temperature": 0, "ignore_eos": True, "return_token_ids": True})  # (a rollout's)
    assert status == 200, body
    assert body["choices"][0]["prompt_token_ids"] == list(prompt)
    return body


def _tokens(body: dict) -> list[int]:
    return body["choices"][0]["token_ids"]


class _Stream(threading.Thread):
    """A gRPC stream consumed in the background: its tokens as they come."""

    def __init__(self, cluster, prompt, max_tokens: int) -> None:
        super().__init__()
        self.req = request(token_ids=list(prompt), max_tokens=max_tokens, temperature=0.0,
                           ignore_eos=True)
        self.cluster = cluster
        self.tokens: list[int] = []
        self.finish = ""
        self.started = threading.Event()
        self.start()

    def run(self) -> None:
        for chunk in self.cluster.stub.Stream(self.req, timeout=120):
            self.tokens.extend(chunk.token_ids)
            self.finish = chunk.finish_reason or self.finish
            self.started.set()


def _in_thread(fn):
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("r", fn()))
    thread.start()
    return thread, out


def test_an_update_waits_for_the_running_and_holds_the_new(cluster, dirs, refs):
    assert _get(cluster, "/get_weight_version") == (200, {"weight_version": "step-0"})
    prompt = PROMPTS[1]
    assert _tokens(_completion(cluster, prompt)) == refs("old", prompt)[0]
    stream = _Stream(cluster, PROMPTS[0], 300)
    assert stream.started.wait(60)
    update, result = _in_thread(lambda: post_json(cluster, "/update_weights_from_disk", {
        "model_path": str(dirs["new"]), "weight_version": "step-1"}))
    time.sleep(0.2)
    assert stream.is_alive(), "the stream ended before the update: make it longer"
    held, held_result = _in_thread(lambda: _completion(cluster, prompt))  # waits for it
    update.join(120)
    held.join(120)
    stream.join(120)
    assert result["r"] == (200, {"success": True, "message": "Succeeded to update model weights.",
                                 "num_paused_requests": 1}), cluster.logs()
    # the stream ran to its end on the old weights: the update waited for it
    assert_greedy_match(stream.tokens, *refs("old", PROMPTS[0], 300))
    # the held request: the new model's tokens, its cached prompt blocks not reused
    body = held_result["r"]
    assert _tokens(body) == refs("new", prompt)[0]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert _get(cluster, "/get_weight_version") == (200, {"weight_version": "step-1"})


def test_another_models_checkpoint_is_refused_and_nothing_changes(cluster, dirs, refs):
    status, body = post_json(cluster, "/update_weights_from_disk",
                             {"model_path": str(dirs["other"])})
    assert status == 400 and body["success"] is False, body
    assert body["message"].startswith("executor exec") and body["message"].endswith(
        f"weights {dirs['other']}: config.json num_layers is 3, the running model's is 2 "
        "(weights of another model)")
    for bad, field in (({"model_path": ""}, "model_path"),
                       ({"model_path": "x", "flush_cache": False}, "flush_cache"),
                       ({"model_path": "x", "load_format": "gguf"}, "load_format")):
        status, body = post_json(cluster, "/update_weights_from_disk", bad)
        assert status == 400 and body["message"].startswith(f"{field}: "), body
    assert _tokens(_completion(cluster, PROMPTS[2])) == refs("new", PROMPTS[2])[0]
    assert _get(cluster, "/get_weight_version") == (200, {"weight_version": "step-1"})
    metrics = cluster.metrics()
    for line in ('pagedserve_weight_updates_total{outcome="loaded"} 1.0',
                 'pagedserve_weight_updates_total{outcome="refused"} 1.0',
                 "pagedserve_generation_held 0.0"):
        assert line in metrics, line


def test_a_retracted_stream_goes_on_with_the_weights_loaded_while_paused(cluster, dirs, refs):
    prompt = [7, *PROMPTS[0][1:]]
    stream = _Stream(cluster, prompt, 400)
    assert stream.started.wait(60)
    assert post_json(cluster, "/pause_generation", {"mode": "retract"}) == (
        200, {"message": "Generation paused (retract)."})
    time.sleep(0.5)  # a token in flight at the pause lands; none come after
    cut = len(stream.tokens)
    status, body = post_json(cluster, "/update_weights_from_disk",
                             {"model_path": str(dirs["newer"])})
    assert (status, body["num_paused_requests"]) == (200, 1), body
    assert len(stream.tokens) == cut and stream.is_alive()
    assert post_json(cluster, "/continue_generation", {})[0] == 200
    stream.join(120)
    assert 0 < cut < 400 and len(stream.tokens) == 400
    assert_greedy_match(stream.tokens[:cut], *refs("new", prompt, cut))
    rest = refs("newer", prompt + stream.tokens[:cut], 400 - cut)
    assert_greedy_match(stream.tokens[cut:], *rest)
    # abort: a running stream ends at once; a new request waits for the continue
    stream = _Stream(cluster, prompt, 200)
    assert stream.started.wait(60)
    assert post_json(cluster, "/pause_generation", {"mode": "abort"})[0] == 200
    stream.join(30)
    assert stream.finish == pb.ABORT and len(stream.tokens) < 200
    held, out = _in_thread(lambda: _completion(cluster, PROMPTS[2]))
    time.sleep(0.3)
    assert held.is_alive()
    assert post_json(cluster, "/continue_generation", {})[0] == 200
    held.join(60)
    assert _tokens(out["r"]) == refs("newer", PROMPTS[2])[0]
    status, body = post_json(cluster, "/pause_generation", {"mode": "freeze"})
    assert status == 400 and "mode: 'freeze' is not one of abort, retract" in str(body)


def test_a_frozen_stream_keeps_its_place_and_an_update_retracts_it(cluster, dirs, refs):
    """vLLM's /pause?mode=keep: a stream stops where it is and goes on at /resume, one
    model's tokens throughout; frozen, then new weights: it is retracted (its KV is the old
    weights') and goes on with the new ones."""
    prompt = [9, *PROMPTS[0][1:]]
    stream = _Stream(cluster, prompt, 400)
    assert stream.started.wait(60)
    assert post_json(cluster, "/pause?mode=keep", {}) == (200, {"status": "paused"})
    assert _get(cluster, "/is_paused") == (200, {"is_paused": True})
    time.sleep(0.3)
    cut = len(stream.tokens)
    time.sleep(0.3)
    assert len(stream.tokens) == cut and 0 < cut < 400 and stream.is_alive()
    assert post_json(cluster, "/resume", {}) == (200, {"status": "resumed"})
    stream.join(120)
    assert_greedy_match(stream.tokens, *refs("newer", prompt, 400))
    assert _get(cluster, "/is_paused") == (200, {"is_paused": False})
    stream = _Stream(cluster, prompt, 400)
    assert stream.started.wait(60)
    assert post_json(cluster, "/pause?mode=keep", {})[0] == 200
    time.sleep(0.3)
    cut = len(stream.tokens)
    status, body = post_json(cluster, "/update_weights_from_disk",
                             {"model_path": str(dirs["new"])})
    assert (status, body["num_paused_requests"]) == (200, 1), body
    assert post_json(cluster, "/resume", {})[0] == 200
    stream.join(120)
    assert 0 < cut < 400 and len(stream.tokens) == 400
    assert_greedy_match(stream.tokens[:cut], *refs("newer", prompt, cut))
    assert_greedy_match(stream.tokens[cut:], *refs("new", prompt + stream.tokens[:cut],
                                                   400 - cut))


def test_zz_an_executor_joining_loads_the_new_weights_first(cluster, dirs, refs):
    """A new executor (its --model: the old weights) joins, loads the cluster's, and after
    both original executors are killed serves the new model's tokens."""
    cluster.start_executor("late")
    cluster.wait_executors(3)
    for name in ("exec0", "exec1"):
        cluster.executors[name].kill()
    deadline = time.monotonic() + 30
    while sum(e.healthy for e in cluster.status().executors) > 1 and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    assert [e.id for e in cluster.status().executors if e.healthy] == ["late"]
    assert _tokens(_completion(cluster, PROMPTS[0])) == refs("new", PROMPTS[0])[0]
    assert "executor late runs weights " + str(dirs["new"]) in cluster.logs(None)
