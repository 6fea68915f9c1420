"""Prompt logprobs (SamplingParams.prompt_logprobs) and the completions API's `echo` through a
real router and executor whose steps take at most 16 tokens (so prompts are scored chunk by
chunk) and whose cache is small (recompute preemption): every prompt token's score equals
transformers' log-softmax at that position, top-k included; samples, streams, repeats of a
cached prompt and preempted requests give the same scores; echo returns them the way
lm-evaluation-harness reads them."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import grpc
import pytest
from cluster_harness import Cluster, request
from pagedserve.router.chat_template import render_chat_ids
from pagedserve.router.tokenizer import Tokenizer

from pagedserve.tinymodels import build_model

PROMPT_IDS = list(range(3, 60))  # 57 tokens: four chunks of at most 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def cluster(model_dir):
    with Cluster(model_dir, num_executors=1,
                 router_args=["--max-num-batched-tokens", "16", "--preemption-mode", "recompute"],
                 executor_args=["--num-gpu-blocks", "24"]).running() as c:
        yield c


@pytest.fixture(scope="module")
def reference(model_dir):
    """transformers' log-softmax over the prompt, fp32, one thread."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def scores(ids: list[int]):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return scores


def rank_range(lp_row, token: int) -> range:
    """The ranks a token may have at a position, given 2e-4 of float noise: 1 + the tokens
    surely more likely, up to 1 + those possibly more likely."""
    v = lp_row[token].item()
    return range(int((lp_row > v + 2e-4).sum()) + 1, int((lp_row > v - 2e-4).sum()) + 2)


def check_scores(got, ids, lp, k):
    assert [p.token_id for p in got] == ids[1:]
    for i, p in enumerate(got):
        assert p.logprob == pytest.approx(lp[i, ids[i + 1]].item(), abs=2e-4)
        assert p.HasField("rank") and p.rank in rank_range(lp[i], ids[i + 1])
        top = lp[i].topk(k) if k else None
        assert [t.token_id for t in p.top] == (top.indices.tolist() if k else [])
        for t, v in zip(p.top, top.values.tolist() if k else [], strict=True):
            assert t.logprob == pytest.approx(v, abs=2e-4)


def test_prompt_scores_equal_hf_chunk_after_chunk(cluster, reference):
    lp = reference(PROMPT_IDS)
    for k in (0, 3):
        resp = cluster.stub.Generate(request(token_ids=PROMPT_IDS, max_tokens=2,
                                             temperature=0.0, prompt_logprobs=k), timeout=60)
        check_scores(resp.prompt_logprobs, PROMPT_IDS, lp, k)
        assert resp.usage.cached_prompt_tokens == 0  # scored: computed, never served cached
    plain = cluster.stub.Generate(request(token_ids=PROMPT_IDS, max_tokens=2, temperature=0.0),
                                  timeout=60)
    assert len(plain.prompt_logprobs) == 0


def test_samples_and_streams_carry_the_scores_once(cluster, reference):
    lp = reference(PROMPT_IDS)
    resp = cluster.stub.Generate(request(token_ids=PROMPT_IDS, max_tokens=3, temperature=1.0,
                                         seed=5, n=2, prompt_logprobs=1), timeout=60)
    assert len(resp.completions) == 2
    check_scores(resp.prompt_logprobs, PROMPT_IDS, lp, 1)
    chunks = list(cluster.stub.Stream(request(token_ids=PROMPT_IDS, max_tokens=3,
                                              temperature=0.0, prompt_logprobs=2), timeout=60))
    assert all(len(c.prompt_logprobs) == 0 for c in chunks[:-1])
    assert chunks[-1].HasField("usage")
    check_scores(chunks[-1].prompt_logprobs, PROMPT_IDS, lp, 2)
    with pytest.raises(grpc.RpcError) as bad:
        cluster.stub.Generate(request(token_ids=PROMPT_IDS, prompt_logprobs=21), timeout=30)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_logprobs" in bad.value.details()


def test_preempted_requests_keep_each_score_once(cluster, reference):
    """Six scored requests with long outputs overflow the 24 blocks: recompute preemption
    computes their prompts again; the scores are still one per prompt token, as alone."""
    prompts = [[5 + i] + PROMPT_IDS[i:i + 30] for i in range(6)]
    results: list = [None] * 6

    def run(i):
        try:
            results[i] = cluster.stub.Generate(request(
                token_ids=prompts[i], max_tokens=60, temperature=0.0, ignore_eos=True,
                prompt_logprobs=1), timeout=120)
        except grpc.RpcError as exc:
            results[i] = exc

    before = _preemptions(cluster)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert _preemptions(cluster) > before
    for ids, resp in zip(prompts, results, strict=True):
        assert not isinstance(resp, Exception), (resp, cluster.logs())
        check_scores(resp.prompt_logprobs, ids, reference(ids), 1)
    status = cluster.wait_blocks_free()
    assert status.executors[0].num_free_gpu_blocks == status.executors[0].num_gpu_blocks


def _preemptions(cluster) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in cluster.metrics().splitlines()
               if line.startswith("pagedserve_preemptions_total{"))


def _post(cluster, body: dict, path: str = "/v1/completions") -> dict:
    req = urllib.request.Request(f"http://{cluster.http_address}{path}",
                                 json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def check_vllm_scores(got, ids, lp, k):
    """vLLM's `prompt_logprobs` form: null, then {id: {logprob, rank, decoded_token}} per
    token with the prompt's own token (its rank computed) and the top k (their places)."""
    assert got[0] is None and len(got) == len(ids)
    for i, entries in enumerate(got[1:]):
        top = lp[i].topk(k).indices.tolist() if k else []
        assert set(entries) == {str(t) for t in [ids[i + 1], *top]}
        for t, e in entries.items():
            assert e["logprob"] == pytest.approx(lp[i, int(t)].item(), abs=2e-4)
            if int(t) == ids[i + 1]:  # the prompt's own token: its rank in the distribution
                assert e["rank"] in rank_range(lp[i], ids[i + 1])
            else:
                assert e["rank"] == top.index(int(t)) + 1
            assert isinstance(e["decoded_token"], str)


def test_http_prompt_logprobs_as_vllm_returns_them(cluster, reference, model_dir):
    """vLLM's extra field on both APIs: completions give each choice the scores of its
    prompt, chat the reply (of the rendered conversation); with echo and logprobs both asked,
    each gets its own top-k; not in a stream."""
    lp = reference(PROMPT_IDS)
    reply = _post(cluster, {"prompt": PROMPT_IDS, "max_tokens": 2, "temperature": 0, "n": 2,
                            "prompt_logprobs": 2})
    for choice in reply["choices"]:
        check_vllm_scores(choice["prompt_logprobs"], PROMPT_IDS, lp, 2)
    both = _post(cluster, {"prompt": PROMPT_IDS, "max_tokens": 1, "temperature": 0,
                           "prompt_logprobs": 3, "logprobs": 1, "echo": True})["choices"][0]
    check_vllm_scores(both["prompt_logprobs"], PROMPT_IDS, lp, 3)
    assert all(top is None or len(top) <= 2 for top in both["logprobs"]["top_logprobs"])
    messages = [{"role": "user", "content": "Hi there"}]
    chat = _post(cluster, {"messages": messages, "max_tokens": 1, "prompt_logprobs": 0},
                 "/v1/chat/completions")
    assert "prompt_logprobs" not in chat["choices"][0]
    ids = render_chat_ids(Tokenizer.from_dir(model_dir), messages)
    check_vllm_scores(chat["prompt_logprobs"], ids, reference(ids), 0)
    assert "prompt_logprobs" not in _post(cluster, {"prompt": "a", "max_tokens": 1})["choices"][0]
    with pytest.raises(urllib.error.HTTPError) as bad:
        _post(cluster, {"prompt": "a", "max_tokens": 1, "prompt_logprobs": 1, "stream": True})
    assert bad.value.code == 400


def test_echo_with_max_tokens_0_is_the_prompt_alone(cluster, reference):
    """The legacy API's scoring request (older lm-eval, OpenAI's GPT-3 recipe): echo,
    max_tokens 0: every choice is its prompt and the prompt's scores, nothing generated
    (no text, token or count; finish "length"), also in a stream; max_tokens 0 without
    echo is still a 400."""
    ids = PROMPT_IDS[:12]
    lp = reference(ids)
    reply = _post(cluster, {"prompt": ids, "max_tokens": 0, "logprobs": 1, "echo": True,
                            "n": 2, "temperature": 0})
    assert reply["usage"]["completion_tokens"] == 0
    assert reply["usage"]["prompt_tokens"] == len(ids)
    for choice in reply["choices"]:
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(ids) and choice["finish_reason"] == "length"
        assert "".join(logprobs["tokens"]) == choice["text"]
        assert logprobs["token_logprobs"][0] is None
        for i in range(1, len(ids)):
            assert logprobs["token_logprobs"][i] == pytest.approx(lp[i - 1, ids[i]].item(),
                                                                  abs=2e-4)
    body = json.dumps({"prompt": "The router owns", "max_tokens": 0, "echo": True,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"http://{cluster.http_address}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        events = [json.loads(line[6:]) for line in resp.read().decode().splitlines()
                  if line.startswith("data: {")]
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == "The router owns"
    ends = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert ends == ["length"] and events[-1]["usage"]["completion_tokens"] == 0
    with pytest.raises(urllib.error.HTTPError) as bad:
        _post(cluster, {"prompt": "a", "max_tokens": 0})
    assert bad.value.code == 400


def test_echo_as_lm_evaluation_harness_reads_it(cluster, reference):
    """lm-eval's loglikelihood request: token ids, max_tokens 1, logprobs 1, echo. The
    logprobs cover prompt then completion; the first token's is null; the rest are the
    prompt scores, and the top-1 tells whether each token was the greedy one."""
    ids = PROMPT_IDS[:20]
    lp = reference(ids)
    reply = _post(cluster, {"prompt": ids, "max_tokens": 1, "logprobs": 1, "echo": True,
                            "temperature": 0})
    choice = reply["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 1
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for i in range(1, len(ids)):
        assert logprobs["token_logprobs"][i] == pytest.approx(lp[i - 1, ids[i]].item(), abs=2e-4)
        # the top-1 and, when it is another token, the prompt's own (OpenAI: up to logprobs+1)
        top = logprobs["top_logprobs"][i]
        assert max(top.values()) == pytest.approx(lp[i - 1].max().item(), abs=2e-4)
        assert top[logprobs["tokens"][i]] == pytest.approx(lp[i - 1, ids[i]].item(), abs=2e-4)
        assert len(top) == (1 if lp[i - 1].argmax().item() == ids[i] else 2)
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    grpc_text = cluster.stub.Generate(request(token_ids=ids, max_tokens=1, temperature=0.0),
                                      timeout=60).completions[0].text
    assert choice["text"].endswith(grpc_text) and len(choice["text"]) > len(grpc_text)
    text = _post(cluster, {"prompt": "The router owns", "max_tokens": 3, "echo": True,
                           "temperature": 0})["choices"][0]
    assert text["text"].startswith("The router owns") and text["logprobs"] is None
    # without the BOS: the echoed tokens are the prompt's own, one score each
    bare = _post(cluster, {"prompt": "The router owns", "max_tokens": 1, "echo": True,
                           "logprobs": 0, "temperature": 0, "add_special_tokens": False})
    logprobs = bare["choices"][0]["logprobs"]
    assert bare["usage"]["prompt_tokens"] == len(logprobs["tokens"]) - 1
    assert "".join(logprobs["tokens"]) == bare["choices"][0]["text"]
