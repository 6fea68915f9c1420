"""The tool-call parsers beside hermes (router/tool_parsers.py): qwen3_coder's XML calls
typed by their schemas, llama3_json's and pythonic's whole-output calls; each gives for any
chunking of a stream what it gives for the whole text, gives text that is not calls back as
content, unchanged, and keeps one call under parallel_tool_calls false; and through the chat
route, unary and streamed."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedserve.router.tool_parsers import make_parser

SCHEMAS = {"get_weather": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "hours": {"type": "array"}, "zip": {"type": "string"}, "ratio": {"type": ["number", "null"]}}},
    "ping": {"type": "object", "properties": {}}}

QWEN3_CODER = ("I will look. <tool_call>\n<function=get_weather>\n<parameter=city>\nOslo, "
               "Norway\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\n"
               "true\n</parameter>\n<parameter=hours>\n[6, 12]\n</parameter>\n<parameter=zip>"
               "\n0150\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n</function>\n"
               "</tool_call>\n<tool_call>\n<function=ping>\n</function>\n</tool_call>")
LLAMA3_JSON = ('{"name": "get_weather", "parameters": {"city": "Oslo", "days": 3}}; '
               '{"name": "ping", "parameters": {}}')
PYTHONIC = '[get_weather(city="Oslo", days=3, hours=[6, 12]), ping()]'
OUTPUTS = {"qwen3_coder": QWEN3_CODER, "llama3_json": LLAMA3_JSON, "pythonic": PYTHONIC}


def parse(name: str, chunks: list[str], parallel: bool = True):
    parser, content, calls = make_parser(name, parallel, SCHEMAS), "", []
    for piece in [*(parser.feed(c) for c in chunks), parser.finish()]:
        content += piece.content
        calls += piece.calls
    assert [c["index"] for c in calls] == list(range(len(calls)))
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                     for c in calls]


def test_qwen3_coder_calls_take_their_schemas_types():
    assert parse("qwen3_coder", [QWEN3_CODER]) == ("I will look. ", [
        ("get_weather", {"city": "Oslo, Norway", "days": 3, "metric": True, "hours": [6, 12],
                         "zip": "0150", "ratio": 0.5}),
        ("ping", {})])
    # a value that is not its type stays text; no schema: JSON when it parses
    odd = ("<tool_call><function=get_weather><parameter=days>three</parameter><parameter="
           "other>{\"a\": 1}</parameter><parameter=note>plain words</parameter></function>"
           "</tool_call>")
    assert parse("qwen3_coder", [odd]) == ("", [("get_weather", {
        "days": "three", "other": {"a": 1}, "note": "plain words"})])
    bad = "x <tool_call>no function here</tool_call> y"
    assert parse("qwen3_coder", [bad]) == (bad, [])


def test_llama3_json_and_pythonic_are_calls_only_when_the_output_is():
    assert parse("llama3_json", [LLAMA3_JSON]) == ("", [
        ("get_weather", {"city": "Oslo", "days": 3}), ("ping", {})])
    assert parse("pythonic", [PYTHONIC]) == ("", [
        ("get_weather", {"city": "Oslo", "days": 3, "hours": [6, 12]}), ("ping", {})])
    for name, text in [("llama3_json", 'It is {"name": "x"}'), ("llama3_json", '{"a": 1}'),
                       ("llama3_json", '{"name": "f", "parameters": {'),
                       ("pythonic", "[1, 2]"), ("pythonic", "[f(x)]"),
                       ("pythonic", "[f(a=g())]"), ("pythonic", "Sure: [f()]"),
                       ("pythonic", "[f(a=1)"), ("pythonic", "  ")]:
        assert parse(name, [text]) == (text, []), (name, text)


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_parallel_false_keeps_the_first_call(name):
    content, calls = parse(name, [OUTPUTS[name]], parallel=False)
    assert [n for n, _ in calls] == ["get_weather"]


@pytest.mark.parametrize("name", sorted(OUTPUTS))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_chunking_gives_the_whole_texts_split(name, data):
    text = OUTPUTS[name]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    bounds = [0, *sorted(cuts), len(text)]
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert parse(name, chunks) == parse(name, [text])


def test_content_streams_at_once_when_the_output_is_not_calls():
    parser = make_parser("pythonic")
    assert parser.feed("  ").content == ""  # undecided: held
    assert parser.feed("Hello [").content == "  Hello ["
    assert parser.feed("world").content == "world"
    assert parser.finish().content == ""


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_the_chat_route_splits_unary_and_streamed_replies(name):
    from pagedserve.router.openai_logprobs import TokenText
    from pagedserve.router.openai_protocol import chat_request
    from pagedserve.router.openai_responses import ChoiceWriter
    from pagedserve.router.types import CompletionDelta, RequestOutput, Usage

    tools = [{"type": "function", "function": {"name": n, "parameters": schema}}
             for n, schema in SCHEMAS.items()]
    text = OUTPUTS[name]
    replies = []
    for stream in (False, True):
        api = chat_request({"messages": [{"role": "user", "content": "Weather?"}],
                            "tools": tools, "stream": stream}, tool_call_parser=name)
        w = ChoiceWriter(api, "chatcmpl-1", 7, "m", TokenText(None))
        half = len(text) // 2
        outs = [RequestOutput("r", (CompletionDelta(0, text[:half], token_ids=(5,)),)),
                RequestOutput("r", (CompletionDelta(0, text[half:], token_ids=(6,),
                                                    finish_reason="stop"),), Usage(5, 30))]
        if not stream:
            for o in outs:
                w.add(0, o)
            choice = w.response()["choices"][0]
            replies.append((choice["message"].get("content"), choice["message"]["tool_calls"],
                            choice["finish_reason"]))
            continue
        chunks = [c for o in outs for c in w.chunks(0, o)]
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        calls = [call for c in chunks for call in c["choices"][0]["delta"].get("tool_calls")
                 or []]
        replies.append((content or None, calls, chunks[-1]["choices"][0]["finish_reason"]))
    (content, calls, finish), (s_content, s_calls, s_finish) = replies
    assert finish == s_finish == "tool_calls" and content == s_content
    assert [c["function"] for c in calls] == [c["function"] for c in s_calls]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "ping"]
