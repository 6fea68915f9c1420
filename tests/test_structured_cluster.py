"""Structured output and logit_bias through a real router and executor (one cluster, a small
KV cache, recompute preemption):

* greedy constrained decoding equals transformers generating with the same llguidance mask
  as a logits processor, token for token, EOS included (regex, choice, JSON schema);
* logit_bias equals transformers' sequence_bias, greedy;
* sampled JSON (n = 3) parses and fits its schema; the OpenAI API's response_format and
  guided_choice, streamed and not;
* grammars replayed after recompute preemption: the same tokens as each request alone.
"""

from __future__ import annotations

import json
import threading
import urllib.request

import grpc
import numpy as np
import pytest
from cluster_harness import Cluster, request
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
from pagedserve.router.structured import build_grammar

from pagedserve.tinymodels import build_model

EOS = 1
PROMPTS = ["Once upon a time there was a small language model",
           "def generate(prompt, max_tokens=16):",
           "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000"]
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "n"], "additionalProperties": False}
FORMATS = {
    "regex": ("regex", "[0-9]{2,4}-[a-z]{1,5}"),
    "choice": ("choice", ["yes", "no", "maybe not"]),
    "json_schema": ("json_schema", json.dumps(SCHEMA)),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def cluster(model_dir):
    # 24 blocks of 16 tokens: one request fits, six long ones at once do not.
    with Cluster(model_dir, num_executors=1, router_args=["--preemption-mode", "recompute"],
                 executor_args=["--num-gpu-blocks", "24"]).running() as c:
        yield c


@pytest.fixture(scope="module")
def hf(model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(model_dir))


def structured(kind: str, value) -> pb.StructuredOutput:
    so = pb.StructuredOutput()
    if kind == "choice":
        so.choice.choices.extend(value)
    else:
        setattr(so, kind, value)
    return so


class _GrammarMask:
    """A transformers logits processor: llguidance's mask for the tokens generated so far."""

    def __init__(self, model_dir, grammar: str, prompt_len: int) -> None:
        import llguidance
        text = (model_dir / "tokenizer.json").read_text()
        self.tok = llguidance.LLTokenizer(text, n_vocab=512, eos_token=[EOS])
        self.matcher = llguidance.LLMatcher(self.tok, grammar)
        self.prompt_len, self.consumed = prompt_len, 0

    def __call__(self, input_ids, scores):
        import torch
        new = input_ids[0, self.prompt_len + self.consumed:].tolist()
        assert self.matcher.consume_tokens(new)
        self.consumed += len(new)
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = torch.from_numpy(np.unpackbits(bits, bitorder="little")[:scores.shape[1]])
        return scores.masked_fill(allowed.unsqueeze(0) == 0, float("-inf"))


def hf_generate(hf, prompt_ids, max_tokens, processors=(), **kwargs):
    import torch
    from transformers import LogitsProcessorList
    model, tokenizer = hf
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             do_sample=False, logits_processor=LogitsProcessorList(processors),
                             output_scores=True, return_dict_in_generate=True,
                             pad_token_id=tokenizer.pad_token_id, **kwargs)
    gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return out.sequences[0, len(prompt_ids):].tolist(), gaps


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_greedy_constrained_matches_hf_with_the_same_mask(cluster, hf, model_dir, fmt):
    kind, value = FORMATS[fmt]
    grammar = build_grammar(kind, value)
    for prompt in PROMPTS:
        prompt_ids = hf[1](prompt).input_ids
        req = request(token_ids=prompt_ids, max_tokens=60, temperature=0.0)
        req.params.structured_output.CopyFrom(structured(kind, value))
        got = cluster.stub.Generate(req, timeout=60).completions[0]
        expected, gaps = hf_generate(hf, prompt_ids, 60,
                                     [_GrammarMask(model_dir, grammar, len(prompt_ids))],
                                     eos_token_id=EOS)
        for j, (a, b) in enumerate(zip(got.token_ids, expected, strict=False)):
            if a != b:
                assert gaps[j] < 1e-3, (fmt, prompt, j, list(got.token_ids), expected)
                break
        else:
            assert list(got.token_ids) == expected
            assert got.finish_reason == pb.STOP and got.stop_token_id == EOS
        if kind == "json_schema":
            assert set(json.loads(got.text)) == {"name", "n"}
        elif kind == "choice":
            assert got.text in value


def test_logit_bias_matches_hf_sequence_bias(cluster, hf):
    bias = {40: 6.0, 41: 6.0, 100: -100.0, 7: 3.5}
    for prompt in PROMPTS:
        prompt_ids = hf[1](prompt).input_ids
        plain, _ = hf_generate(hf, prompt_ids, 24, eos_token_id=None, min_new_tokens=24)
        expected, gaps = hf_generate(hf, prompt_ids, 24, eos_token_id=None, min_new_tokens=24,
                                     sequence_bias={(t,): v for t, v in bias.items()})
        assert expected != plain  # the bias changes the greedy path
        got = cluster.stub.Generate(request(token_ids=prompt_ids, max_tokens=24,
                                            temperature=0.0, ignore_eos=True,
                                            logit_bias=bias), timeout=60)
        ids = list(got.completions[0].token_ids)
        for j, (a, b) in enumerate(zip(ids, expected, strict=False)):
            if a != b:
                assert gaps[j] < 1e-3, (prompt, j, ids, expected)
                break
        else:
            assert ids == expected


def _check_sample(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"name", "n"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 6
    assert isinstance(value["n"], int) and 0 <= value["n"] <= 999


def test_sampled_json_parses_and_fits_the_schema(cluster):
    req = request(prompt=PROMPTS[0], max_tokens=60, temperature=1.0, seed=7, n=3)
    req.params.structured_output.json_schema = json.dumps(SCHEMA)
    resp = cluster.stub.Generate(req, timeout=120)
    assert len(resp.completions) == 3
    for c in resp.completions:
        assert c.finish_reason == pb.STOP, c
        _check_sample(c.text)
    assert len({c.text for c in resp.completions}) > 1  # three samples, not one thrice


def _post(cluster, path: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://{cluster.http_address}{path}",
                                 json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_openai_response_format_and_guided_choice(cluster):
    rf = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
    body = {"messages": [{"role": "user", "content": "an item please"}], "max_tokens": 60,
            "temperature": 0.8, "seed": 3, "response_format": rf}
    status, raw = _post(cluster, "/v1/chat/completions", body)
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    assert choice["finish_reason"] == "stop"
    _check_sample(choice["message"]["content"])
    status, raw = _post(cluster, "/v1/chat/completions", {**body, "stream": True})
    assert status == 200
    chunks = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == choice["message"]["content"]  # same seed, same tokens
    status, raw = _post(cluster, "/v1/completions", {
        "prompt": PROMPTS[1], "max_tokens": 10, "temperature": 1.0, "n": 4, "seed": 1,
        "guided_choice": ["alpha", "beta", "gamma delta"]})
    assert status == 200, raw
    for c in json.loads(raw)["choices"]:
        assert c["text"] in ("alpha", "beta", "gamma delta") and c["finish_reason"] == "stop"
    status, raw = _post(cluster, "/v1/completions", {"prompt": "x", "guided_regex": "(a"})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "guided_regex", error


def test_grammars_replay_after_recompute_preemption(cluster):
    """Six sampled requests with long constrained outputs at once overflow the 24 blocks:
    recompute preemption resends their output so far and the executor replays it into a
    fresh matcher. Each gives the tokens it gives alone."""
    so = structured("regex", "([0-9]{2} ){30}[a-z]{1,3}")

    def req(i):
        r = request(prompt=PROMPTS[i % 3], max_tokens=120, temperature=1.0, seed=100 + i)
        r.params.structured_output.CopyFrom(so)
        return r

    def preemptions() -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in cluster.metrics().splitlines()
                   if line.startswith("pagedserve_preemptions_total{"))

    alone = [cluster.stub.Generate(req(i), timeout=60).completions[0] for i in range(6)]
    before = preemptions()
    together: list = [None] * 6

    def run(i):
        try:
            together[i] = cluster.stub.Generate(req(i), timeout=120).completions[0]
        except grpc.RpcError as exc:
            together[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert preemptions() > before
    for a, b in zip(alone, together, strict=True):
        assert not isinstance(b, Exception), (b, cluster.logs())
        assert list(b.token_ids) == list(a.token_ids)
        assert a.finish_reason == pb.STOP and len(a.text.split()) == 31
    status = cluster.wait_blocks_free()
    assert status.executors[0].num_free_gpu_blocks == status.executors[0].num_gpu_blocks


TOOL_PARAMS = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
               "properties": {"city": {"type": "string", "maxLength": 8},
                              "unit": {"enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": TOOL_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["zone"],
             "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}]


def test_tool_calls_over_http_are_the_constrained_output(cluster):
    """A named tool_choice's arguments are what gRPC generates for the same conversation and
    tools with the function's parameters as the schema; "required" (streamed, one call)
    calls a defined function with arguments that fit it."""
    question = "What is the weather in Paris?"
    body = {"messages": [{"role": "user", "content": question}], "tools": TOOLS,
            "max_tokens": 60, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    status, raw = _post(cluster, "/v1/chat/completions", body)
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    args = json.loads(call["function"]["arguments"])
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    req = pb.GenerateRequest(params=pb.SamplingParams(max_tokens=60, temperature=0.0))
    req.messages.messages.add(role="user", content=question)
    req.messages.tools_json = json.dumps(TOOLS)
    req.params.structured_output.json_schema = json.dumps(TOOL_PARAMS)
    assert cluster.stub.Generate(req, timeout=60).completions[0].text == \
        call["function"]["arguments"]

    status, raw = _post(cluster, "/v1/chat/completions", {
        **body, "tool_choice": "required", "parallel_tool_calls": False, "stream": True,
        "temperature": 1.0, "seed": 11})
    assert status == 200
    chunks = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: {")]
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert len(calls) == 1 and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    name, args = calls[0]["function"]["name"], json.loads(calls[0]["function"]["arguments"])
    if name == "get_weather":
        assert set(args) == {"city", "unit"}
    else:
        assert name == "get_time" and args["zone"] in ("UTC", "CET")
