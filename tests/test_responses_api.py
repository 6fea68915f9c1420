"""OpenAI's Responses API (router/responses_api.py) over a fake engine: a body becomes the
chat request it means (input items, instructions, text.format, flat tools); the reply is a
Response with its output items and usage; a stream is typed, numbered events whose deltas add
up to the unary output; errors name the Responses field the client sent."""

from __future__ import annotations

import pytest
from fake_engine import make_tokenizer
from http_rig import ANY_JSON, MODEL, _post, _run, fail_every_submit, named_events, scripted
from pagedserve.router.errors import InvalidRequest
from pagedserve.router.responses_api import chat_body
from pagedserve.router.validation import Limits

TOOLS = [{"type": "function", "name": "get_weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory)


async def _events(session, body) -> list[dict]:
    """A Responses stream's events: `event: TYPE` then `data: JSON` each, no [DONE]."""
    async with session.post("/v1/responses", json={**body, "stream": True}) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = await named_events(r)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_bodies_become_the_chat_requests_they_mean():
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    chat = chat_body({
        "model": MODEL, "instructions": "Be brief.", "max_output_tokens": 9, "top_p": 0.5,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                  {"type": "reasoning", "id": "rs_1", "summary": []},
                  call, {**call, "call_id": "c2"},
                  {"type": "function_call_output", "call_id": "c1", "output": "ok"},
                  {"type": "message", "role": "assistant",
                   "content": [{"type": "output_text", "text": "Done."}]}],
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "strict": True}},
        "tools": TOOLS, "tool_choice": {"type": "function", "name": "get_weather"},
        "store": True, "metadata": {"k": "v"}})
    assert chat == {
        "model": MODEL, "top_p": 0.5, "max_completion_tokens": 9,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            {"role": "assistant", "content": [{"type": "text", "text": "Done."}]}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "x", "schema": {}, "strict": True}},
        "tools": [{"type": "function", "function": {"name": "get_weather",
                                                    "parameters": TOOLS[0]["parameters"]}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    assert chat_body({"input": "Hi"})["messages"] == [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("body, field", [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "input_image"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[0].call_id"),
    ({"input": "x", "background": "yes"}, "background"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "x", "include": "all"}, "include"),
    ({"input": "x", "metadata": ["k"]}, "metadata"),
])
def test_bad_bodies_name_the_responses_field(body, field):
    with pytest.raises(InvalidRequest) as info:
        chat_body(body)
    assert info.value.field == field and str(info.value).startswith(field)


def test_unary_and_streamed_responses_agree(tok):
    async def main():
        async with scripted(tok) as (engine, session):
            body = {"model": MODEL, "input": "Once upon", "instructions": "Be brief.",
                    "max_output_tokens": 6, "metadata": {"k": "v"}}
            status, reply = await _post(session, "/v1/responses", body)
            assert status == 200, reply
            assert reply["id"].startswith("resp_") and reply["object"] == "response"
            assert (reply["status"], reply["incomplete_details"]) == \
                ("incomplete", {"reason": "max_output_tokens"})
            [message] = reply["output"]
            assert message["type"] == "message" and message["role"] == "assistant"
            text = message["content"][0]["text"]
            assert text and message["content"][0]["type"] == "output_text"
            usage = reply["usage"]
            assert usage["output_tokens"] == 6 and usage["total_tokens"] == \
                usage["input_tokens"] + 6
            assert reply["metadata"] == {"k": "v"} and reply["max_output_tokens"] == 6
            prompt = engine.submitted[-1].prompt_text
            assert "system\nBe brief." in prompt and prompt.endswith("assistant\n")

            events = await _events(session, body)
            types = [e["type"] for e in events]
            assert types[:4] == ["response.created", "response.in_progress",
                                 "response.output_item.added", "response.content_part.added"]
            assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                                  "response.output_item.done", "response.incomplete"]
            deltas = "".join(e["delta"] for e in events
                             if e["type"] == "response.output_text.delta")
            assert deltas == text == events[-1]["response"]["output"][0]["content"][0]["text"]
            assert events[-1]["response"]["usage"] == usage

    _run(main())


def test_tool_calls_and_reasoning_are_output_items(tok):
    thought = ('<think>They want weather.</think>Checking. <tool_call>{"name": "get_weather", '
               '"arguments": {"city": "Oslo"}}</tool_call>')
    body = {"input": "Weather in Oslo?", "tools": TOOLS, "max_output_tokens": 200}

    async def main():
        async with scripted(tok, thought, reasoning_parser="qwen3",
                           tool_call_parser="hermes") as (_, session):
            status, reply = await _post(session, "/v1/responses", body)
            assert status == 200 and reply["status"] == "completed", reply
            kinds = [o["type"] for o in reply["output"]]
            assert kinds == ["reasoning", "message", "function_call"]
            assert reply["output"][0]["content"][0]["text"] == "They want weather."
            assert reply["output"][1]["content"][0]["text"] == "Checking. "
            call = reply["output"][2]
            assert (call["name"], call["arguments"]) == ("get_weather", '{"city": "Oslo"}')
            assert call["call_id"].startswith("call_") and call["status"] == "completed"

            events = await _events(session, body)
            done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
            assert [i["type"] for i in done] == kinds
            assert [e["output_index"] for e in events
                    if e["type"] == "response.output_item.added"] == [0, 1, 2]
            assert "".join(e["delta"] for e in events
                           if e["type"] == "response.reasoning_text.delta") == \
                "They want weather."
            assert events[-1]["type"] == "response.completed"
            assert [o["type"] for o in events[-1]["response"]["output"]] == kinds

    _run(main())


def test_a_named_calls_arguments_stream_as_they_come(tok):
    args = '{"city": "Oslo, Norway"}'
    body = {"input": "Weather?", "tools": TOOLS, "max_output_tokens": 200,
            "tool_choice": {"type": "function", "name": "get_weather"}}

    async def main():
        async with scripted(tok, args) as (_, session):
            status, reply = await _post(session, "/v1/responses", body)
            assert [(o["type"], o["name"], o["arguments"]) for o in reply["output"]] == \
                [("function_call", "get_weather", args)]
            events = await _events(session, body)
            pieces = [e["delta"] for e in events
                      if e["type"] == "response.function_call_arguments.delta"]
            assert len(pieces) > 1 and "".join(pieces) == args
            [added] = [e for e in events if e["type"] == "response.output_item.added"]
            [done] = [e for e in events if e["type"] == "response.function_call_arguments.done"]
            assert added["item"]["status"] == "in_progress" and done["arguments"] == args
            assert added["item"]["id"] == done["item_id"] == events[-1]["response"]["output"][0]["id"]

    _run(main())


def test_logprobs_ride_on_the_message(tok):
    body = {"input": "Once upon", "max_output_tokens": 5, "top_logprobs": 2,
            "include": ["message.output_text.logprobs"]}

    async def main():
        async with scripted(tok) as (_, session):
            status, reply = await _post(session, "/v1/responses", body)
            scored = reply["output"][0]["content"][0]["logprobs"]
            assert len(scored) == 5 and all(len(e["top_logprobs"]) == 2 for e in scored)
            assert set(scored[0]) == {"token", "logprob", "bytes", "top_logprobs"}
            events = await _events(session, body)
            streamed = [e for ev in events if ev["type"] == "response.output_text.delta"
                        for e in ev["logprobs"]]
            assert streamed == scored
            [done] = [ev for ev in events if ev["type"] == "response.output_text.done"]
            assert done["logprobs"] == scored
            status, reply = await _post(session, "/v1/responses", {"input": "x",
                                                                    "max_output_tokens": 2})
            assert reply["output"][0]["content"][0]["logprobs"] == []

    _run(main())


def test_errors_name_the_field_the_client_sent(tok):
    async def main():
        async with scripted(tok) as (_, session):
            for body, field in (({"input": "x", "max_output_tokens": 10**4}, "max_output_tokens"),
                                ({"input": [{"role": "user", "content": 3}]},
                                 "input[0].content"),
                                ({"input": "x", "model": "other"}, None)):
                status, reply = await _post(session, "/v1/responses", body)
                assert status in (400, 404) and reply["error"]["param"] == field, reply
                assert field != "max_output_tokens" or \
                    "+ max_output_tokens (10000) > max_model_len" in reply["error"]["message"]

    _run(main())


def test_a_stream_that_fails_ends_with_error_and_failed_events(tok):
    async def main():
        async with scripted(tok) as (engine, session):
            fail_every_submit(engine)
            events = await _events(session, {"input": "x"})
            assert [e["type"] for e in events] == ["response.created", "response.in_progress",
                                                   "error", "response.failed"]
            assert events[2]["code"] == "unavailable"
            assert events[3]["response"]["status"] == "failed"

    _run(main())


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_ITEM = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning",
                             "input_image"]) | ANY_JSON,
    "role": st.sampled_from(["user", "assistant", "system"]) | ANY_JSON,
    "content": st.text(max_size=5) | ANY_JSON, "call_id": st.text(max_size=3) | ANY_JSON,
    "name": ANY_JSON, "arguments": ANY_JSON, "output": ANY_JSON})
_FIELDS = ["instructions", "max_output_tokens", "temperature", "top_p", "text", "tools",
           "include", "top_logprobs",
           "tool_choice", "parallel_tool_calls", "previous_response_id", "store", "metadata",
           "model"]


@settings(max_examples=200, deadline=None)
@given(items=st.lists(_ITEM, max_size=3) | ANY_JSON,
       body=st.dictionaries(st.sampled_from(_FIELDS), ANY_JSON, max_size=4))
def test_any_responses_body_is_a_request_or_a_400(tok, items, body):
    from pagedserve.router.openai_protocol import chat_request
    from pagedserve.router.responses_api import response_field
    from pagedserve.router.validation import request_from_pb
    limits = Limits(vocab_size=tok.vocab_size, max_model_len=256)
    try:
        try:
            api = chat_request(chat_body({**body, "input": items}))
            for request in api.requests:
                request_from_pb(request, tokenizer=tok, limits=limits, request_id="r",
                                default_max_tokens=None)
        except InvalidRequest as exc:
            raise response_field(exc) from None
    except InvalidRequest as exc:
        assert exc.field and str(exc).startswith(exc.field), exc
