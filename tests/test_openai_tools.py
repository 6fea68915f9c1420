"""Tool calls over the OpenAI API without a cluster: `tools` / `tool_choice` into the chat
template and an output schema (openai_formats.tool_calls), the conversation's tool turns
through the gRPC form and back (messages_to_pb → messages_from_pb), and the replies built
from engine outputs (ChoiceWriter), unary and streamed, with exact expected JSON."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedserve.router.chat_template import ChatTemplate
from pagedserve.router.errors import InvalidRequest
from pagedserve.router.openai_formats import ToolMode
from pagedserve.router.openai_logprobs import TokenText
from pagedserve.router.openai_protocol import chat_request
from pagedserve.router.openai_responses import ChoiceWriter
from pagedserve.router.types import CompletionDelta, RequestOutput, Usage
from pagedserve.router.validation import messages_from_pb, tools_from_pb

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping"}}]
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]


def chat(**body):
    return chat_request({"messages": MESSAGES, "tools": TOOLS, **body})


def schema_of(api) -> dict:
    return json.loads(api.requests[0].params.structured_output.json_schema)


def test_named_function_constrains_the_output_to_its_parameters():
    api = chat(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert api.tools == ToolMode("get_weather")
    assert schema_of(api) == WEATHER
    assert json.loads(api.requests[0].messages.tools_json) == TOOLS
    api = chat(tool_choice={"type": "function", "function": {"name": "ping"}})
    assert schema_of(api) == {"type": "object"}  # no parameters: any object


def test_required_is_an_array_of_calls_of_the_defined_functions():
    api = chat(tool_choice="required")
    assert api.tools == ToolMode(None, parallel=True)
    call = {"type": "object", "additionalProperties": False,
            "required": ["name", "parameters"]}
    assert schema_of(api) == {"type": "array", "minItems": 1, "items": {"anyOf": [
        {**call, "properties": {"name": {"const": "get_weather"}, "parameters": WEATHER}},
        {**call, "properties": {"name": {"const": "ping"}, "parameters": {"type": "object"}}},
    ]}}
    api = chat(tool_choice="required", parallel_tool_calls=False)
    assert api.tools == ToolMode(None, parallel=False) and schema_of(api)["maxItems"] == 1


def test_none_keeps_the_tools_for_the_template_only():
    api = chat(tool_choice="none")
    assert api.tools is None
    assert not api.requests[0].params.HasField("structured_output")
    assert json.loads(api.requests[0].messages.tools_json) == TOOLS
    assert chat_request({"messages": MESSAGES}).tools is None


@pytest.mark.parametrize("body, field, match", [
    ({}, "tool_choice", '"auto"'),  # the default with tools
    ({"tool_choice": "auto"}, "tool_choice", "parser"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in tools"),
    ({"tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
    ({"tool_choice": "required", "parallel_tool_calls": "yes"}, "parallel_tool_calls",
     "boolean"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "function"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name", "required"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name", "twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters", "schema"),
    ({"tools": {"a": 1}}, "tools", "array"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"functions": [{"name": "f"}]}, "functions", "deprecated"),
])
def test_bad_tool_requests_are_400_naming_the_field(body, field, match):
    with pytest.raises(InvalidRequest, match=match) as info:
        chat(**body)
    assert info.value.field == field


def test_tool_turns_reach_the_template():
    """An assistant turn that called a tool, the tool's answer and the tools themselves go
    through the gRPC form into the template as transformers would pass them."""
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    messages = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": calls},
                           {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
                            "content": "18C"}]
    pb_chat = chat_request({"messages": messages, "tools": TOOLS,
                            "tool_choice": "none"}).requests[0].messages
    got = messages_from_pb(pb_chat)
    assert got[1] == {"role": "assistant", "content": "", "tool_calls": calls}
    assert got[2] == {"role": "tool", "content": "18C", "tool_call_id": "call_1",
                      "name": "get_weather"}
    template = ChatTemplate(
        "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}{{ c.function.name }}{{ c.function.arguments }}"
        "{% endfor %}{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}{% endfor %}")
    text = template.render(got, tools=tools_from_pb(pb_chat))
    assert text == ('[tool get_weather][tool ping]<user>weather in Paris?'
                    '<assistant>get_weather{"city": "Paris"}<tool>18C#call_1')


# --------------------------------------------------------------------------- replies


def writer(tools: ToolMode, stream: bool = False) -> ChoiceWriter:
    choice = ("required" if tools.name is None
              else {"type": "function", "function": {"name": tools.name}})
    api = chat(tool_choice=choice, stream=stream)
    return ChoiceWriter(api, "chatcmpl-1", 7, "m", TokenText(None))


def out(*deltas, usage=None) -> RequestOutput:
    return RequestOutput("r", tuple(deltas), usage)


def test_unary_named_and_required_replies():
    w = writer(ToolMode("get_weather"))
    w.add(0, out(CompletionDelta(0, '{"city": '),
                 CompletionDelta(0, '"Paris"}', finish_reason="stop", stop_token_id=2),
                 usage=Usage(5, 4)))
    choice = w.response()["choices"][0]
    [call] = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert choice["message"]["content"] is None and choice["finish_reason"] == "stop"

    w = writer(ToolMode(None))
    text = '[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "ping", ' \
           '"parameters": {}}]'
    w.add(0, out(CompletionDelta(0, text, finish_reason="stop"), usage=Usage(5, 9)))
    choice = w.response()["choices"][0]
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"name": "ping", "arguments": "{}"}]
    assert choice["finish_reason"] == "tool_calls"

    w = writer(ToolMode(None))  # cut by max_tokens: not a call, the text as it is
    w.add(0, out(CompletionDelta(0, '[{"name": "ping", "par', finish_reason="length"),
                 usage=Usage(5, 9)))
    choice = w.response()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": '[{"name": "ping", "par'}
    assert choice["finish_reason"] == "length"


def deltas_of(chunks) -> list[tuple[dict, str | None]]:
    return [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in chunks]


def test_streamed_named_call_grows_its_arguments():
    w = writer(ToolMode("get_weather"), stream=True)
    chunks = w.chunks(0, out(CompletionDelta(0, '{"city"', token_ids=(5,))))
    chunks += w.chunks(0, out(CompletionDelta(0, "", token_ids=(6,))))  # held-back text
    chunks += w.chunks(0, out(CompletionDelta(0, ': "Oslo"}', token_ids=(7,),
                                              finish_reason="stop")))
    [(first, first_finish), (second, finish)] = deltas_of(chunks)
    assert first_finish is None
    call_id = first["tool_calls"][0]["id"]
    assert first == {"tool_calls": [{"index": 0, "id": call_id, "type": "function",
                                     "function": {"name": "get_weather",
                                                  "arguments": '{"city"'}}]}
    assert second == {"tool_calls": [{"index": 0, "function": {"arguments": ': "Oslo"}'}}]}
    assert finish == "stop"


def test_streamed_required_calls_go_out_when_the_choice_ends():
    w = writer(ToolMode(None), stream=True)
    assert w.chunks(0, out(CompletionDelta(0, '[{"name": "ping", ', token_ids=(5,)))) == []
    chunks = w.chunks(0, out(CompletionDelta(0, '"parameters": {}}]', token_ids=(6,),
                                             finish_reason="stop")))
    [(delta, finish)] = deltas_of(chunks)
    [call] = delta["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "ping", "arguments": "{}"}
    assert finish == "tool_calls"
    w = writer(ToolMode(None), stream=True)  # aborted mid-array: the text, as content
    w.chunks(0, out(CompletionDelta(0, '[{"na', token_ids=(5,))))
    [(delta, finish)] = deltas_of(w.chunks(0, out(CompletionDelta(0, "", finish_reason="abort"))))
    assert delta == {"content": '[{"na'} and finish == "abort"


# --------------------------------------------------------------------------- auto (hermes)

HERMES = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>')


def parse_all(chunks: list[str]):
    from pagedserve.router.tool_parsers import HermesParser
    parser, content, calls = HermesParser(), "", []
    for piece in [*(parser.feed(c) for c in chunks), parser.finish()]:
        content += piece.content
        calls += piece.calls
    return content, [(c["index"], c["function"]["name"], c["function"]["arguments"])
                     for c in calls]


def test_hermes_parser_splits_content_and_calls():
    assert parse_all([HERMES]) == ("Let me check. ", [
        (0, "get_weather", '{"city": "Paris"}'), (1, "ping", "{}")])
    assert parse_all(["no call here, a < b and <tool"]) == ("no call here, a < b and <tool",
                                                            [])
    bad = 'x <tool_call>{"name": oops}</tool_call> y'
    assert parse_all([bad]) == (bad, [])  # not JSON: the text, unchanged
    assert parse_all(['<tool_call>{"name": "f", "arguments": {"a": 1}}']) == (
        "", [(0, "f", '{"a": 1}')])  # stopped before the closing tag: still a call
    assert parse_all(['<tool_call>{"name": "f", "argu']) == ('<tool_call>{"name": "f", "argu',
                                                            [])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(HERMES)), max_size=12))
def test_hermes_parser_streams_whatever_the_chunking(cuts):
    """Fed in any chunks, the parser gives what it gives for the whole text."""
    bounds = [0, *sorted(cuts), len(HERMES)]
    chunks = [HERMES[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert parse_all(chunks) == parse_all([HERMES])


def test_auto_tool_choice_needs_a_parser_and_uses_it():
    api = chat_request({"messages": MESSAGES, "tools": TOOLS}, tool_call_parser="hermes")
    assert api.tools == ToolMode(None, True, "hermes")
    assert not api.requests[0].params.HasField("structured_output")  # the output is free
    w = ChoiceWriter(api, "chatcmpl-1", 7, "m", TokenText(None))
    w.add(0, out(CompletionDelta(0, HERMES, finish_reason="stop"), usage=Usage(5, 30)))
    choice = w.response()["choices"][0]
    assert choice["message"]["content"] == "Let me check. "
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"name": "ping", "arguments": "{}"}]
    assert choice["finish_reason"] == "tool_calls"
    w = ChoiceWriter(api, "chatcmpl-1", 7, "m", TokenText(None))  # no call: plain content
    w.add(0, out(CompletionDelta(0, "It is sunny.", finish_reason="stop"), usage=Usage(5, 3)))
    assert w.response()["choices"][0]["message"] == {"role": "assistant",
                                                     "content": "It is sunny."}
    assert w.response()["choices"][0]["finish_reason"] == "stop"


def test_auto_with_parallel_tool_calls_false_keeps_the_first_call():
    api = chat_request({"messages": MESSAGES, "tools": TOOLS, "parallel_tool_calls": False},
                       tool_call_parser="hermes")
    assert api.tools == ToolMode(None, False, "hermes")
    w = ChoiceWriter(api, "chatcmpl-1", 7, "m", TokenText(None))
    w.add(0, out(CompletionDelta(0, HERMES, finish_reason="stop"), usage=Usage(5, 30)))
    choice = w.response()["choices"][0]
    assert choice["message"]["content"] == "Let me check. "
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert choice["finish_reason"] == "tool_calls"
    stream = chat_request({"messages": MESSAGES, "tools": TOOLS, "stream": True,
                           "parallel_tool_calls": False}, tool_call_parser="hermes")
    w = ChoiceWriter(stream, "chatcmpl-1", 7, "m", TokenText(None))
    chunks = []
    for k, text in enumerate([HERMES[:60], HERMES[60:110], HERMES[110:]]):
        chunks += w.chunks(0, out(CompletionDelta(0, text, token_ids=(k,),
                                                  finish_reason="stop" if k == 2 else None)))
    calls = [c for chunk in chunks for choice in chunk["choices"]
             for c in choice["delta"].get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather")]


def test_auto_streams_content_then_whole_calls():
    api = chat_request({"messages": MESSAGES, "tools": TOOLS, "stream": True},
                       tool_call_parser="hermes")
    w = ChoiceWriter(api, "chatcmpl-1", 7, "m", TokenText(None))
    pieces = [HERMES[:20], HERMES[20:70], HERMES[70:]]
    chunks = []
    for k, text in enumerate(pieces):
        last = k == len(pieces) - 1
        chunks += w.chunks(0, out(CompletionDelta(0, text, token_ids=(k,),
                                                  finish_reason="stop" if last else None)))
    got = deltas_of(chunks)
    assert got[0] == ({"content": "Let me check. "}, None)
    calls = [c for d, _ in got for c in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather"),
                                                                    (1, "ping")]
    assert got[-1][1] == "tool_calls"
