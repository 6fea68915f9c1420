"""Anthropic's Messages API (`POST /v1/messages`, router/anthropic_messages.py) over the chat
path: the reply and the stream in the Messages API's shapes, stop reasons, cached prompt
tokens apart, the prefill of a trailing assistant turn, its errors, `x-api-key`, and the
Anthropic SDK itself against the edge."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from fake_engine import make_tokenizer
from http_rig import http_edge, scripted
from pagedserve.router.edge_security import ApiKeys

TEXT = "Paris is the capital of France. It is known for the Eiffel Tower."
BODY = {"model": "tiny-chat", "max_tokens": 64, "system": "Be brief.",
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def _events(reply) -> list[tuple[str, dict]]:
    """(event name, data) of a named SSE stream."""
    events, name = [], None
    async for raw in reply.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data = json.loads(line[6:])
            assert data["type"] == name  # each event's name is its data's type
            events.append((name, data))
    return events


def test_reply_and_stream_shapes(tok):
    async def main():
        async with scripted(tok, TEXT) as (engine, s):
            async with s.post("/v1/messages", json=BODY) as r:
                assert r.status == 200
                reply = await r.json()
            spec = engine.submitted[-1]
            async with s.post("/v1/messages", json={**BODY, "stream": True}) as r:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                events = await _events(r)
            return reply, spec, events
    reply, spec, events = _run(main())
    assert reply["id"].startswith("msg_") and reply["type"] == "message"
    assert reply["role"] == "assistant" and reply["model"] == "tiny-chat"
    assert reply["content"] == [{"type": "text", "text": TEXT}]
    assert (reply["stop_reason"], reply["stop_sequence"]) == ("end_turn", None)
    usage = reply["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(spec.prompt_token_ids)
    assert usage["cache_creation_input_tokens"] == 0 and usage["output_tokens"] > 0
    assert spec.sampling.max_tokens == 64
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[1] == "content_block_start"
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == TEXT
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == usage["output_tokens"]


def test_stop_reasons_and_prefill(tok):
    async def main():
        async with scripted(tok, TEXT) as (engine, s):
            async with s.post("/v1/messages", json={**BODY, "max_tokens": 3}) as r:
                cut = await r.json()
            async with s.post("/v1/messages", json={**BODY, "stop_sequences": ["France"]}) as r:
                stopped = await r.json()
            prefill = {**BODY, "messages": [*BODY["messages"],
                                            {"role": "assistant", "content": "The answer is"}]}
            async with s.post("/v1/messages", json=prefill) as r:
                assert r.status == 200
            return cut, stopped, engine.submitted[-1]
    cut, stopped, spec = _run(main())
    assert cut["stop_reason"] == "max_tokens" and cut["usage"]["output_tokens"] == 3
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "France")
    assert stopped["content"][0]["text"] == "Paris is the capital of "
    rendered = tok.decode(list(spec.prompt_token_ids))
    assert rendered.endswith("The answer is")  # continued, no new assistant turn after it


def test_errors_in_the_messages_apis_shape(tok):
    cases = [
        ({**BODY, "max_tokens": None}, 400, "max_tokens"),
        ({**BODY, "tools": [{"name": "f"}]}, 400, "tool_choice"),  # auto: needs a parser
        ({**BODY, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
         "tools[0].type"),
        ({**BODY, "tools": [{"name": "f"}], "tool_choice": {"type": "some"}}, 400,
         "tool_choice.type"),
        ({**BODY, "messages": [{"role": "user", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, 400,
         "messages[0].content[0].type"),
        ({**BODY, "messages": [{"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}]}, 400,
         "messages[0].content[0].input"),
        ({**BODY, "thinking": {"type": "maybe"}}, 400, "thinking.type"),
        ({**BODY, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {}}]}]}, 400, "messages[0].content[0].type"),
        ({**BODY, "messages": [{"role": "system", "content": "x"}]}, 400, "messages[0].role"),
        ({**BODY, "messages": []}, 400, "messages"),
        ({**BODY, "stop_sequences": [""]}, 400, "stop_sequences"),
        ({**BODY, "model": "claude-opus"}, 404, None),
    ]

    async def main():
        async with scripted(tok, TEXT) as (_, s):
            for body, status, field in cases:
                async with s.post("/v1/messages", json=body) as r:
                    reply = await r.json()
                assert r.status == status, (body, reply)
                assert reply["type"] == "error", reply
                assert reply["error"]["type"] == ("invalid_request_error" if status == 400
                                                  else "not_found_error")
                if field:
                    assert field in reply["error"]["message"], (field, reply)
    _run(main())


def test_anthropic_sdk_with_x_api_key(tok):
    anthropic = pytest.importorskip("anthropic")

    async def main():
        async with http_edge(tok, api_keys=ApiKeys(["sk-ant-local"])) as (engine, _, _m, base):
            engine.script = tok.encode(TEXT)[1:] + [tok.eos_token_ids[0]]
            client = anthropic.AsyncAnthropic(base_url=base, api_key="sk-ant-local",
                                              max_retries=0)
            message = await client.messages.create(
                model="tiny-chat", max_tokens=64, system="Be brief.",
                messages=[{"role": "user", "content": "What is the capital of France?"}])
            assert message.content[0].text == TEXT and message.stop_reason == "end_turn"
            async with client.messages.stream(
                    model="tiny-chat", max_tokens=64,
                    messages=[{"role": "user", "content": "Hi"}]) as stream:
                text = "".join([t async for t in stream.text_stream])
                final = await stream.get_final_message()
            assert text == TEXT and final.usage.output_tokens == message.usage.output_tokens
            wrong = anthropic.AsyncAnthropic(base_url=base, api_key="sk-wrong", max_retries=0)
            with pytest.raises(anthropic.AuthenticationError):
                await wrong.messages.create(model="tiny-chat", max_tokens=4,
                                            messages=[{"role": "user", "content": "Hi"}])
            async with aiohttp.ClientSession(base) as s, s.post(  # the header alone
                    "/v1/messages", json=BODY, headers={"x-api-key": "sk-ant-local"}) as r:
                assert r.status == 200
    _run(main())


WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


def test_tools_and_their_history_become_the_chat_request():
    from pagedserve.router.anthropic_messages import chat_body
    chat = chat_body({
        "max_tokens": 9, "tools": [WEATHER], "thinking": {"type": "disabled"},
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "Weather in Oslo and Rome?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Two calls.", "signature": "s"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Oslo"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather",
                 "input": {"city": "Rome"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Rain"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "No station"}]},
                {"type": "text", "text": "And tomorrow?"}]}]})
    call = {"type": "function", "function": {"name": "get_weather"}}
    assert chat == {
        "max_tokens": 9, "tool_choice": "required", "parallel_tool_calls": False,
        "chat_template_kwargs": {"enable_thinking": False},
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "The weather in a city.",
            "parameters": WEATHER["input_schema"]}}],
        "messages": [
            {"role": "user", "content": "Weather in Oslo and Rome?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "toolu_1", **call, "function": {"name": "get_weather",
                                                       "arguments": '{"city": "Oslo"}'}},
                {"id": "toolu_2", **call, "function": {"name": "get_weather",
                                                       "arguments": '{"city": "Rome"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "Rain"},
            {"role": "tool", "tool_call_id": "toolu_2", "content": "No station"},
            {"role": "user", "content": "And tomorrow?"}]}
    named = chat_body({"max_tokens": 9, "tools": [WEATHER], "messages": [
        {"role": "user", "content": "x"}], "tool_choice": {"type": "tool",
                                                          "name": "get_weather"}})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    only_results = chat_body({"max_tokens": 9, "messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]})
    assert only_results["messages"] == [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "t", "content": ""}]
    with pytest.raises(Exception, match="text only"):
        chat_body({"max_tokens": 9, "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                               "input": {}}]}]})


def test_a_tool_call_is_a_tool_use_block_unary_and_streamed(tok):
    said = ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '</tool_call>')
    body = {**BODY, "tools": [WEATHER], "max_tokens": 100}

    async def main():
        async with scripted(tok, said, tool_call_parser="hermes") as (engine, s):
            async with s.post("/v1/messages", json=body) as r:
                assert r.status == 200
                reply = await r.json()
            async with s.post("/v1/messages", json={**body, "stream": True}) as r:
                events = await _events(r)
            async with s.post("/v1/messages/count_tokens",
                              json={k: v for k, v in body.items() if k != "max_tokens"}) as r:
                counted = await r.json()
            return reply, events, counted, engine.submitted[-1]
    reply, events, counted, spec = _run(main())
    [text, use] = reply["content"]
    assert text == {"type": "text", "text": "Let me check. "}
    assert use["type"] == "tool_use" and use["name"] == "get_weather"
    assert use["input"] == {"city": "Oslo"} and use["id"]
    assert reply["stop_reason"] == "tool_use"
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [b["type"] for b in starts] == ["text", "tool_use"]
    assert starts[1]["name"] == "get_weather" and starts[1]["input"] == {}
    partial = "".join(d["delta"]["partial_json"] for n, d in events
                      if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == {"city": "Oslo"}
    assert [d["index"] for n, d in events if n == "content_block_stop"] == [0, 1]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    assert counted == {"input_tokens": len(spec.prompt_token_ids)}


def test_a_named_tool_streams_its_input_as_it_comes(tok):
    args = '{"city": "Oslo, Norway"}'
    body = {**BODY, "tools": [WEATHER], "max_tokens": 100,
            "tool_choice": {"type": "tool", "name": "get_weather"}}

    async def main():
        async with scripted(tok, args) as (_, s):
            async with s.post("/v1/messages", json=body) as r:
                reply = await r.json()
            async with s.post("/v1/messages", json={**body, "stream": True}) as r:
                events = await _events(r)
            return reply, events
    reply, events = _run(main())
    assert [b["type"] for b in reply["content"]] == ["tool_use"]
    assert reply["content"][0]["input"] == {"city": "Oslo, Norway"}
    assert reply["stop_reason"] == "tool_use"
    pieces = [d["delta"]["partial_json"] for n, d in events if n == "content_block_delta"]
    assert len(pieces) > 1 and "".join(pieces) == args


def test_the_anthropic_sdk_runs_a_tool_loop(tok):
    anthropic = pytest.importorskip("anthropic")
    said = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'

    async def main():
        async with http_edge(tok, tool_call_parser="hermes") as (engine, _, _m, base):
            engine.script = tok.encode(said)[1:] + [tok.eos_token_ids[0]]
            client = anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0)
            messages = [{"role": "user", "content": "Weather in Oslo?"}]
            first = await client.messages.create(model="tiny-chat", max_tokens=100,
                                                 tools=[WEATHER], messages=messages)
            [use] = first.content
            assert (use.type, use.name, use.input) == ("tool_use", "get_weather",
                                                       {"city": "Oslo"})
            messages += [{"role": "assistant", "content": first.content},
                         {"role": "user", "content": [{"type": "tool_result",
                                                       "tool_use_id": use.id,
                                                       "content": "Sunny, 21 C"}]}]
            count = await client.messages.count_tokens(model="tiny-chat", tools=[WEATHER],
                                                       messages=messages)
            again = await client.messages.create(model="tiny-chat", max_tokens=100,
                                                 tools=[WEATHER], messages=messages)
            assert again.stop_reason == "tool_use"
            assert count.input_tokens == len(engine.submitted[-1].prompt_token_ids)
            assert "Sunny, 21 C" in engine.submitted[-1].prompt_text
    _run(main())
