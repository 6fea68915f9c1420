"""The OpenAI HTTP edge over a fake Engine (a real aiohttp server on port 0, real HTTP clients):
response shapes, server-sent events, any JSON body (a request or a 400), tool calls, and the
api="http" request metrics. Errors, limits, draining and disconnects: test_http_errors.py."""

from __future__ import annotations

import aiohttp
import pytest
from fake_engine import FakeEngine, make_tokenizer
from http_rig import ANY_JSON, MODEL, _metric, _post, _run, _sse, http_edge, serve
from pagedserve.router.frontend import Frontend
from pagedserve.router.http_server import start_http_server
from pagedserve.router.metrics import RouterMetrics
from pagedserve.router.tokenizer import Tokenizer
from pagedserve.router.validation import Limits


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return make_tokenizer(tmp_path_factory)


# ------------------------------------------------------------------ shapes


def test_models_and_health(tok):
    async def main():
        async with serve(tok) as (engine, frontend, http, _):
            async with http.get("/v1/models") as r:
                body = await r.json()
            assert r.status == 200 and body["object"] == "list"
            assert [m["id"] for m in body["data"]] == [MODEL]
            assert body["data"][0]["object"] == "model" and body["data"][0]["max_model_len"] == 256
            async with http.get(f"/v1/models/{MODEL}") as r:
                assert r.status == 200 and (await r.json())["id"] == MODEL
            async with http.get("/v1/models/other") as r:
                assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
            async with http.get("/health") as r:
                assert r.status == 200
            engine.serving = False
            async with http.get("/health") as r:
                assert r.status == 503 and "no executor" in (await r.json())["error"]["message"]

    _run(main())


def test_served_model_name_aliases(tok):
    """--served-model-name primary,alias,...: every name listed and accepted, the reply
    naming the one the request used; any other name 404."""
    from pagedserve.router.openai_fields import served_names
    assert served_names(" a , b,a,, My Model ") == ("a", "b", "My Model")

    async def main():
        async with http_edge(tok, served_model_name="qwen-local,gpt-4o-mini") as (
                _, _f, _m, base), aiohttp.ClientSession(base) as http:
            async with http.get("/v1/models") as r:
                cards = (await r.json())["data"]
            assert [c["id"] for c in cards] == ["qwen-local", "gpt-4o-mini"]
            assert all("parent" not in c for c in cards)
            for name in ("gpt-4o-mini", "qwen-local", None):
                body = {"prompt": "Once upon", "max_tokens": 2,
                        **({"model": name} if name else {})}
                status, reply = await _post(http, "/v1/completions", body)
                assert status == 200 and reply["model"] == (name or "qwen-local")
            status, reply = await _post(http, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "model": "gpt-4o-mini"})
            assert status == 200 and reply["model"] == "gpt-4o-mini"
            status, reply = await _post(http, "/v1/completions", {"prompt": "x",
                                                                  "model": "gpt-4"})
            assert status == 404 and "'gpt-4o-mini'" in reply["error"]["message"]
    _run(main())


def test_completion_unary_shape_and_usage(tok):
    async def main():
        async with serve(tok) as (engine, _, http, metrics):
            status, body = await _post(http, "/v1/completions", {
                "model": MODEL, "prompt": "Once upon", "max_tokens": 5, "n": 2,
                "temperature": 0, "seed": -3, "user": "u1", "unknown_field": [1, 2]})
            assert status == 200, body
            assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
            assert body["model"] == MODEL and isinstance(body["created"], int)
            assert [c["index"] for c in body["choices"]] == [0, 1]
            for c in body["choices"]:
                assert c["finish_reason"] == "length" and c["logprobs"] is None
                assert isinstance(c["text"], str) and c["text"]
            prompt_len = len(tok.encode("Once upon"))
            assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 10,
                                     "total_tokens": prompt_len + 10,
                                     "prompt_tokens_details": {"cached_tokens": 3},
                                     "completion_tokens_details": {
                                         "accepted_prediction_tokens": 0,
                                         "rejected_prediction_tokens": 0}}
            spec = engine.submitted[-1]
            assert spec.sampling.n == 2 and spec.sampling.seed == 2**64 - 3
            assert _metric(metrics, "pagedserve_request_success_total",
                           finish_reason="length", api="http") == 2
            assert _metric(metrics, "pagedserve_request_success_total",
                           finish_reason="length", api="grpc") == 0

    _run(main())


def test_max_tokens_omitted_runs_to_the_context_limit(tok):
    async def main():
        async with serve(tok, max_model_len=64) as (engine, _, http, _):
            await _post(http, "/v1/completions", {"prompt": "Once upon", "ignore_eos": True,
                                                  "stop_token_ids": [], "max_tokens": None})
            assert engine.submitted[-1].sampling.max_tokens == 64 - len(tok.encode("Once upon"))

    _run(main())


def test_prompt_tokenizing_fields_as_vllm_takes_them(tok):
    """add_special_tokens (completions: BOS unless false; chat: none unless true) and
    truncate_prompt_tokens (the last k; -1: no cut) reach the engine's prompt."""
    async def main():
        async with serve(tok) as (engine, _, http, _):
            async def ids(path, **fields):
                body = {"prompt": "Once upon a time", "max_tokens": 2, **fields}
                if path.endswith("chat/completions"):
                    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                            **fields}
                status, reply = await _post(http, path, body)
                assert status == 200, reply
                return list(engine.submitted[-1].prompt_token_ids)

            whole = await ids("/v1/completions")
            assert whole[0] == tok.bos_token_id
            assert await ids("/v1/completions", add_special_tokens=False) == whole[1:]
            assert await ids("/v1/completions", truncate_prompt_tokens=2) == whole[-2:]
            assert await ids("/v1/completions", truncate_prompt_tokens=-1) == whole
            chat = await ids("/v1/chat/completions")
            assert chat[0] != tok.bos_token_id
            assert await ids("/v1/chat/completions", add_special_tokens=True) == \
                [tok.bos_token_id, *chat]

    _run(main())


def test_completion_prompt_list_numbers_choices_by_prompt(tok):
    async def main():
        async with serve(tok) as (engine, _, http, _):
            ids = tok.encode("A list")
            status, body = await _post(http, "/v1/completions", {
                "prompt": ["Once upon", ids], "max_tokens": 3, "n": 2})
            assert status == 200, body
            assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
            assert sorted(tuple(s.prompt_token_ids) for s in engine.submitted) == \
                sorted([tuple(tok.encode("Once upon")), tuple(ids)])
            assert body["usage"]["completion_tokens"] == 12

    _run(main())


def test_completion_top_logprobs_hold_the_chosen_token_too():
    """Legacy completions: the `logprobs` most likely tokens plus the chosen one when it is
    not among them ("up to logprobs+1 elements", OpenAI's reference); chat's stay top-k."""
    from pagedserve.router.openai_logprobs import chat_logprobs_json, completion_logprobs_json
    from pagedserve.router.types import TokenLogprob
    text = {3: "a", 4: "b", 5: "c"}.__getitem__
    lps = [TokenLogprob(3, -0.1, ((3, -0.1), (4, -2.5))),    # the top token chosen
           TokenLogprob(5, -4.0, ((4, -0.2), (3, -1.9)))]    # a token outside the top 2
    got = completion_logprobs_json(lps, text, offset=10)
    assert got == {"tokens": ["a", "c"], "token_logprobs": [-0.1, -4.0],
                   "top_logprobs": [{"a": -0.1, "b": -2.5}, {"b": -0.2, "a": -1.9, "c": -4.0}],
                   "text_offset": [10, 11]}
    assert [len(e["top_logprobs"]) for e in chat_logprobs_json(lps, text)] == [2, 2]


def test_completion_logprobs(tok):
    async def main():
        async with serve(tok) as (_, _, http, _):
            status, body = await _post(http, "/v1/completions", {
                "prompt": "Once upon", "max_tokens": 4, "logprobs": 2})
            assert status == 200, body
            lp = body["choices"][0]["logprobs"]
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 4
            assert lp["token_logprobs"] == [-0.5] * 4
            assert all(len(top) <= 2 for top in lp["top_logprobs"])
            assert lp["text_offset"][0] == 0
            assert lp["text_offset"] == sorted(lp["text_offset"])

    _run(main())


def test_tokens_as_token_ids(tok):
    """vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:N"; the text is
    the text."""
    async def main():
        async with serve(tok) as (_, _, http, _):
            status, body = await _post(http, "/v1/completions", {
                "prompt": "Once upon", "max_tokens": 3, "logprobs": 1,
                "return_tokens_as_token_ids": True})
            assert status == 200, body
            lp = body["choices"][0]["logprobs"]
            assert all(t.startswith("token_id:") and t[9:].isdigit() for t in lp["tokens"])
            assert all(k.startswith("token_id:") for top in lp["top_logprobs"] for k in top)
            assert body["choices"][0]["text"] and "token_id" not in body["choices"][0]["text"]
            events = await _sse(http, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "stream": True, "logprobs": True, "top_logprobs": 1,
                "return_tokens_as_token_ids": True})
            entries = [e for c in events[:-1] for ch in c["choices"]
                       for e in ((ch.get("logprobs") or {}).get("content") or [])]
            assert len(entries) == 2 and all(e["token"].startswith("token_id:") for e in entries)

    _run(main())


def test_return_token_ids_unary_and_streamed(tok):
    """vLLM's return_token_ids (what RL rollouts read back): each choice's output ids and
    its prompt's (a completion's on its choice, a chat's on the reply); streamed, each
    chunk's own ids, the prompt's on the first chunk (a completion's: each choice's first)."""
    async def main():
        async with serve(tok) as (engine, _, http, _):
            body = {"prompt": ["Once upon", "A list"], "max_tokens": 4, "n": 2,
                    "return_token_ids": True}
            status, reply = await _post(http, "/v1/completions", body)
            assert status == 200, reply
            prompts = [list(s.prompt_token_ids) for s in engine.submitted]
            script = engine.script
            for i, choice in enumerate(reply["choices"]):
                assert choice["prompt_token_ids"] == prompts[i // 2]
                assert choice["token_ids"] == [script[(p + i % 2) % len(script)]
                                               for p in range(4)]
                assert tok.decode(choice["token_ids"]) == choice["text"]
            events = await _sse(http, "/v1/completions", {**body, "stream": True})
            streamed: dict[int, list[int]] = {}
            for chunk in events[:-1]:
                (choice,) = chunk["choices"]
                i = choice["index"]
                assert ("prompt_token_ids" in choice) == (i not in streamed)
                if i not in streamed:
                    assert choice["prompt_token_ids"] == prompts[i // 2]
                streamed.setdefault(i, []).extend(choice["token_ids"])
            assert streamed == {c["index"]: c["token_ids"] for c in reply["choices"]}
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                    "return_token_ids": True}
            status, reply = await _post(http, "/v1/chat/completions", chat)
            assert reply["prompt_token_ids"] == list(engine.submitted[-1].prompt_token_ids)
            assert reply["choices"][0]["token_ids"] == script[:3]
            events = await _sse(http, "/v1/chat/completions", {**chat, "stream": True})
            assert events[0]["prompt_token_ids"] == reply["prompt_token_ids"]
            assert all("prompt_token_ids" not in e for e in events[1:-1])
            assert [t for e in events[:-1] for t in e["choices"][0]["token_ids"]] == script[:3]
            status, plain = await _post(http, "/v1/chat/completions",
                                        {**chat, "return_token_ids": False})
            assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]

    _run(main())


def test_continuous_usage_stats_count_every_chunk(tok):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the counts so far;
    the last ones agree with the final usage."""
    async def main():
        async with serve(tok) as (_, _, http, _):
            events = await _sse(http, "/v1/completions", {
                "prompt": ["Once upon", "A list"], "max_tokens": 5, "n": 2, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
            chunks = events[:-1]
            final = chunks[-1]["usage"]
            assert chunks[-1]["choices"] == [] and final["completion_tokens"] == 20
            counts = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
            assert counts == sorted(counts) and counts[-1] == 20 and counts[0] == 1
            assert all(c["usage"]["prompt_tokens"] == final["prompt_tokens"] and
                       c["usage"]["total_tokens"] == final["prompt_tokens"] +
                       c["usage"]["completion_tokens"] for c in chunks[:-1])

    _run(main())


def test_chat_unary_and_stream(tok):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                             {"type": "text", "text": "there"}]}]

    async def main():
        async with serve(tok) as (engine, _, http, _):
            status, body = await _post(http, "/v1/chat/completions", {
                "model": MODEL, "messages": messages, "max_completion_tokens": 6,
                "logprobs": True, "top_logprobs": 1})
            assert status == 200, body
            assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
            choice = body["choices"][0]
            assert choice["message"]["role"] == "assistant"
            assert choice["finish_reason"] == "length"
            entries = choice["logprobs"]["content"]
            assert len(entries) == 6 and all(len(e["top_logprobs"]) == 1 for e in entries)
            assert entries[0]["bytes"] == list(entries[0]["token"].encode())
            assert engine.submitted[-1].sampling.logprobs == 1
            prompt = engine.submitted[-1].prompt_text
            assert "<|im_start|>system\nBe brief.<|im_end|>" in prompt
            assert prompt.endswith("<|im_start|>assistant\n")

            events = await _sse(http, "/v1/chat/completions", {
                "messages": messages, "max_tokens": 6, "stream": True,
                "stream_options": {"include_usage": True}})
            assert events[-1] == "[DONE]"
            chunks = events[:-1]
            assert all(c["object"] == "chat.completion.chunk" for c in chunks)
            assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
            assert all(c["usage"] is None for c in chunks[:-1])
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
            assert text == choice["message"]["content"]
            assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"

    _run(main())


def test_chat_template_fields_as_vllm_takes_them(tok):
    """add_generation_prompt, continue_final_message (an assistant prefill continued) and
    chat_template_kwargs reach the template; misuse is a 400 naming the field."""
    turns = [{"role": "user", "content": "Capital of France?"},
             {"role": "assistant", "content": "The capital is"}]

    async def main():
        async with serve(tok) as (engine, _, http, _):
            async def prompt(**fields):
                status, body = await _post(http, "/v1/chat/completions", {
                    "messages": turns, "max_tokens": 2, **fields})
                assert status == 200, body
                return engine.submitted[-1].prompt_text

            assert (await prompt()).endswith("The capital is<|im_end|>\n<|im_start|>assistant\n")
            assert (await prompt(add_generation_prompt=False)).endswith(
                "The capital is<|im_end|>\n")
            for fields in ({"continue_final_message": True},
                           {"continue_final_message": True, "add_generation_prompt": False}):
                assert (await prompt(**fields)).endswith("assistant\nThe capital is")
            await prompt(chat_template_kwargs={"enable_thinking": False})
            for fields, param in (
                    ({"continue_final_message": True, "add_generation_prompt": True},
                     "continue_final_message"),
                    ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
                    ({"chat_template_kwargs": {"messages": 1}}, "chat_template_kwargs"),
                    ({"continue_final_message": "yes"}, "continue_final_message")):
                status, body = await _post(http, "/v1/chat/completions",
                                           {"messages": turns, **fields})
                assert status == 400 and body["error"]["param"] == param, body

    _run(main())


def test_prediction_as_openai_clients_send_it(tok):
    """`prediction` (Predicted Outputs) as a string or as text parts reaches the engine as
    the text's token ids; a malformed one is a 400 naming the field; usage carries
    completion_tokens_details."""
    code = "def f(x):\n    return x"
    parts = [{"type": "text", "text": "def f(x):\n"}, {"type": "text", "text": "    return x"}]
    chat = {"messages": [{"role": "user", "content": "Rename f to g."}], "max_tokens": 2}

    async def main():
        async with serve(tok) as (engine, _, http, _):
            for content in (code, parts):
                status, body = await _post(http, "/v1/chat/completions", {
                    **chat, "prediction": {"type": "content", "content": content}})
                assert status == 200, body
                assert engine.submitted[-1].sampling.prediction == tuple(
                    tok.encode(code, add_special_tokens=False))
                assert body["usage"]["completion_tokens_details"] == {
                    "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
            for fields, param in (
                    ({"prediction": code}, "prediction"),
                    ({"prediction": {"type": "url", "content": code}}, "prediction.type"),
                    ({"prediction": {"type": "content", "content": 3}}, "prediction.content"),
                    ({"prediction": {"type": "content", "content": [{"type": "image_url"}]}},
                     "prediction.content[0]"),
                    ({"prediction": {"type": "content", "content": code}, "n": 2,
                      "use_beam_search": True}, "prediction")):
                status, body = await _post(http, "/v1/chat/completions", {**chat, **fields})
                assert status == 400 and body["error"]["param"] == param, body

    _run(main())


def test_completion_stream_concatenates_to_unary(tok):
    async def main():
        async with serve(tok) as (_, _, http, _):
            body = {"prompt": "Once upon", "max_tokens": 8, "n": 2, "stop": "日本"}
            _, unary = await _post(http, "/v1/completions", body)
            events = await _sse(http, "/v1/completions", {**body, "stream": True})
            assert events[-1] == "[DONE]" and "usage" not in events[0]
            for i in (0, 1):
                parts = [c["choices"][0] for c in events[:-1] if c["choices"][0]["index"] == i]
                assert "".join(p["text"] for p in parts) == unary["choices"][i]["text"]
                assert parts[-1]["finish_reason"] == unary["choices"][i]["finish_reason"]
                assert parts[-1]["stop_reason"] == unary["choices"][i]["stop_reason"]

    _run(main())


# ------------------------------------------------------------------ any JSON: 400 or a request

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
           "top_p", "n", "stream", "stream_options", "stop", "seed", "presence_penalty",
           "frequency_penalty", "logprobs", "top_logprobs", "user", "top_k", "min_p",
           "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
           "skip_special_tokens", "priority", "cache_salt", "echo", "best_of",
           "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
           "prompt_logprobs", "return_tokens_as_token_ids", "return_token_ids",
           "use_beam_search", "bad_words",
           "allowed_token_ids", "length_penalty", "early_stopping",
           "add_special_tokens", "truncate_prompt_tokens", "include_reasoning", "prediction"]
_GOOD = {"prompt": "Once upon", "messages": [{"role": "user", "content": "hi"}]}


@settings(max_examples=200, deadline=None)
@given(chat=st.booleans(), body=st.dictionaries(st.sampled_from(_FIELDS), ANY_JSON, max_size=5))
def test_any_json_body_is_a_request_or_a_400(tok, chat, body):
    """Whatever the field values: a clean InvalidRequest (400 with the field), never another
    exception (a 500)."""
    from pagedserve.router.errors import InvalidRequest
    from pagedserve.router.openai_protocol import chat_request, completion_request
    from pagedserve.router.validation import request_from_pb

    body = {**{k: v for k, v in _GOOD.items() if k == ("messages" if chat else "prompt")},
            **body}
    limits = Limits(vocab_size=tok.vocab_size, max_model_len=256)
    try:
        api = chat_request(body) if chat else completion_request(body)
        for request in api.requests:
            request_from_pb(request, tokenizer=tok, limits=limits, request_id="r",
                            default_max_tokens=None)
    except InvalidRequest as exc:
        assert exc.field and str(exc).startswith(exc.field), exc


def test_auto_tool_choice_with_the_hermes_parser(tok):
    """--tool-call-parser hermes: tool_choice "auto" lets the model answer freely and its
    <tool_call> blocks become the reply's tool_calls, unary and streamed; without the
    parser, auto is a 400."""
    hermes = ('Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
              '\n</tool_call>')
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "weather?"}],
            "tools": tools, "max_tokens": 200}

    async def main():
        async with serve(tok) as (engine, frontend, session, metrics):
            status, err = await _post(session, "/v1/chat/completions", body)
            assert status == 400 and err["error"]["param"] == "tool_choice"
        engine = FakeEngine(tok)
        engine.script = tok.encode(hermes)[1:] + [tok.eos_token_ids[0]]
        frontend = Frontend(engine, tok, Limits(vocab_size=tok.vocab_size, max_model_len=256),
                            RouterMetrics())
        server = await start_http_server(frontend, "127.0.0.1", 0, served_model_name=MODEL,
                                         max_model_len=256, tool_call_parser="hermes")
        async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as session:
            status, reply = await _post(session, "/v1/chat/completions", body)
            assert status == 200, reply
            choice = reply["choices"][0]
            assert choice["finish_reason"] == "tool_calls"
            assert choice["message"]["content"] == "Checking. "
            [call] = choice["message"]["tool_calls"]
            assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
            events = await _sse(session, "/v1/chat/completions", {**body, "stream": True})
            deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
            assert "".join(d.get("content") or "" for d in deltas) == "Checking. "
            calls = [c for d in deltas for c in d.get("tool_calls", [])]
            assert [c["function"] for c in calls] == [call["function"]]
            assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
        await server.stop()

    _run(main())
