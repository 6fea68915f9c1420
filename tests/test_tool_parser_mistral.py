"""`--tool-call-parser mistral` (router/tool_parsers.py MistralParser): both of Mistral's
formats after ``[TOOL_CALLS]`` (a JSON array before tokenizer v11, ``NAME[ARGS]{...}`` from
it on, ``[CALL_ID]`` ids), any chunking equal to the whole text, everything that is not a
call given back as content, 9-character ids that Mistral's template takes back, and the
markers kept in the text of a tokenizer where they are special tokens."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedserve.router.tool_parsers import make_parser, tool_call_id

OLD = ('Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo", '
       '"days": 3}, "id": "abcDEF123"}, {"name": "ping", "arguments": {}, "id": "bad id"}]')
NEW = ('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "days": 3}[TOOL_CALLS]ping[ARGS]{}'
       'lookup[CALL_ID]Zz9Zz9Zz9[ARGS]{"q": "a ] b }"}')
WANT_NEW = [("get_weather", {"city": "Oslo", "days": 3}), ("ping", {}),
            ("lookup", {"q": "a ] b }"})]
MISTRAL_ID = re.compile(r"^[A-Za-z0-9]{9}$")


def parse(chunks: list[str], parallel: bool = True):
    """(content, [(name, arguments)], ids) of `chunks` fed in turn, then finished."""
    parser, content, calls = make_parser("mistral", parallel), "", []
    for piece in [*(parser.feed(c) for c in chunks), parser.finish()]:
        content += piece.content
        calls += piece.calls
    assert [c["index"] for c in calls] == list(range(len(calls)))
    assert all(c["type"] == "function" and MISTRAL_ID.match(c["id"]) for c in calls)
    return (content, [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                      for c in calls], [c["id"] for c in calls])


def test_the_json_array_of_older_tokenizers():
    content, calls, ids = parse([OLD])
    assert content == "Let me check. "
    assert calls == [("get_weather", {"city": "Oslo", "days": 3}), ("ping", {})]
    assert ids[0] == "abcDEF123" and ids[1] != "bad id"  # the model's id when valid
    # one object instead of an array; arguments as a JSON string; "parameters"
    assert parse(['[TOOL_CALLS]{"name": "f", "arguments": "{\\"a\\": 1}"}'])[:2] == \
        ("", [("f", {"a": 1})])
    assert parse(['[TOOL_CALLS] [{"name": "f", "parameters": {"a": 2}}]'])[:2] == \
        ("", [("f", {"a": 2})])


def test_name_args_calls_of_v11_tokenizers():
    content, calls, ids = parse([NEW])
    assert content == "" and calls == WANT_NEW
    assert ids[2] == "Zz9Zz9Zz9" and len(set(ids)) == 3
    # content first; whitespace between calls dropped; a call straight after the last
    text = 'Sure.\n[TOOL_CALLS]a[ARGS]{"x": 1} \n b[ARGS] {"y": [1, 2]}\n'
    assert parse([text])[:2] == ("Sure.\n", [("a", {"x": 1}), ("b", {"y": [1, 2]})])


@pytest.mark.parametrize("text", [
    "[TOOL_CALLS] I cannot call a tool for that.",     # prose after the marker
    '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}',  # cut short
    '[TOOL_CALLS] [{"arguments": {}}]',                 # no name
    '[TOOL_CALLS] [1, 2]',                              # not calls
    '[TOOL_CALLS]f[ARGS][1, 2]',                        # arguments not an object
    '[TOOL_CALLS]f g[ARGS]{}',                          # not a name
    "[TOOL_CALLS]",                                     # a bare marker
    "no calls, only [TOOL_ words and [brackets]",       # content, a partial marker
])
def test_what_is_not_a_call_is_content_unchanged(text):
    assert parse([text])[:2] == (text, [])


def test_text_after_the_calls_is_content_at_the_end():
    text = '[TOOL_CALLS]f[ARGS]{"a": 1} and then some words'
    parser = make_parser("mistral")
    first = parser.feed(text)
    assert [c["function"]["name"] for c in first.calls] == ["f"] and first.content == ""
    last = parser.finish()
    assert last.content == " and then some words" and not last.calls
    # a marker whose call does not parse after good ones comes back with its text
    assert parse(['[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]oops'])[:2] == \
        ("[TOOL_CALLS]oops", [("f", {})])


def test_calls_stream_as_each_closes():
    parser = make_parser("mistral")
    assert parser.feed("Checking").content == "Checking"
    assert parser.feed(" now [TOOL").content == " now "  # a partial marker held back
    piece = parser.feed('_CALLS]get_weather[ARGS]{"city": "Os')
    assert piece.content == "" and not piece.calls
    piece = parser.feed('lo"}[TOOL_CALLS]ping[ARGS]{')
    assert [c["function"]["name"] for c in piece.calls] == ["get_weather"]
    assert [c["function"]["name"] for c in parser.feed("}").calls] == ["ping"]
    assert parser.finish().content == ""


def test_parallel_false_keeps_the_first_call():
    for text in (OLD, NEW):
        assert [n for n, _ in parse([text], parallel=False)[1]] == ["get_weather"]


@pytest.mark.parametrize("text", [OLD, NEW, "[TOOL_CALLS] nope", 'x [TOOL_CALLS]f[ARGS]{} y'])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_chunking_gives_the_whole_texts_split(text, data):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    bounds = [0, *sorted(cuts), len(text)]
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert parse(chunks)[:2] == parse([text])[:2]


def test_ids_of_every_call_style():
    assert MISTRAL_ID.match(tool_call_id("mistral"))
    assert tool_call_id().startswith("call_") and tool_call_id("hermes").startswith("call_")


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_chat_requests_keep_special_tokens_for_the_parser_and_forced_calls_get_its_ids():
    from pagedserve.router.openai_logprobs import TokenText
    from pagedserve.router.openai_protocol import chat_request
    from pagedserve.router.openai_responses import ChoiceWriter
    from pagedserve.router.types import CompletionDelta, RequestOutput, Usage

    def params(parser, **body):
        api = chat_request({"messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS,
                            **body}, tool_call_parser=parser)
        return api, api.requests[0].params

    assert params("mistral")[1].keep_special_tokens
    assert not params("mistral", skip_special_tokens=True)[1].keep_special_tokens
    assert params("mistral", skip_special_tokens=False)[1].keep_special_tokens
    assert not params("hermes")[1].keep_special_tokens
    assert not params("mistral", tool_choice="required")[1].keep_special_tokens
    forced = {"required": '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]',
              "named": '{"city": "Oslo"}'}
    for kind, text in forced.items():
        choice = "required" if kind == "required" else \
            {"type": "function", "function": {"name": "get_weather"}}
        for parser, pattern in (("mistral", MISTRAL_ID), ("hermes", re.compile("^call_"))):
            api, _ = params(parser, tool_choice=choice)
            w = ChoiceWriter(api, "chatcmpl-1", 7, "m", TokenText(None))
            w.add(0, RequestOutput("r", (CompletionDelta(0, text, token_ids=(5,),
                                                         finish_reason="stop"),), Usage(5, 9)))
            calls = w.response()["choices"][0]["message"]["tool_calls"]
            assert [c["function"]["name"] for c in calls] == ["get_weather"]
            assert pattern.match(calls[0]["id"]), (kind, parser, calls)


def test_parsed_calls_go_back_through_mistrals_template():
    """The ids this parser gives are the ones Mistral's template accepts on the next turn
    (it raises on any other length)."""
    from pagedserve.router.chat_template import ChatTemplate
    from test_chat_templates_popular import SPECIAL, TEMPLATES, _through_the_wire
    calls = make_parser("mistral").feed(NEW).calls
    template = ChatTemplate((TEMPLATES / "mistral.jinja").read_text(), SPECIAL)
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{k: v for k, v in c.items() if k != "index"} for c in calls]},
                *({"role": "tool", "tool_call_id": c["id"], "content": "{}"} for c in calls)]
    got, tools = _through_the_wire(messages, TOOLS)
    text = template.render(got, tools=tools)
    assert all(f'"id": "{c["id"]}"' in text and f'"call_id": "{c["id"]}"' in text
               for c in calls)
    bad = [{**messages[1], "tool_calls": [{**messages[1]["tool_calls"][0],
                                           "id": tool_call_id()}]}]
    got, tools = _through_the_wire([messages[0], *bad], TOOLS)
    with pytest.raises(Exception, match="9"):
        template.render(got, tools=tools)


def test_the_markers_survive_detokenization_only_when_special_tokens_are_kept(tmp_path):
    """A tokenizer where [TOOL_CALLS] and [ARGS] are special tokens (as in Mistral's):
    sampled ids -> the router's text -> the parser."""
    from pagedserve.router.detokenizer import TextAssembler
    from pagedserve.router.tokenizer import Tokenizer
    from pagedserve.router.types import SamplingSpec
    from tokenizers import Tokenizer as HFTokenizer

    from pagedserve.tinymodels import build_tokenizer
    build_tokenizer(tmp_path)
    raw = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    raw.add_special_tokens(["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"])
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_dir(tmp_path)
    text = 'Hi [TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.is_special(ids[tok.encode("Hi ", add_special_tokens=False).__len__()])
    results = {}
    for keep in (True, False):
        asm = TextAssembler(tok, SamplingSpec(max_tokens=100, keep_special_tokens=keep), [])
        out = "".join(asm.append(t).text for t in ids) + asm.finish("stop")
        results[keep] = parse([out])[:2]
    assert results[True] == ("Hi ", [("get_weather", {"city": "Oslo"})])
    assert results[False] == ('Hi get_weather{"city": "Oslo"}', [])


def test_the_flag_offers_every_parser():
    import argparse

    from pagedserve.router.tool_parsers import PARSERS

    from pagedserve.flags import add_server_flags
    parser = argparse.ArgumentParser()
    add_server_flags(parser)
    for name in PARSERS:
        assert parser.parse_args(["--tool-call-parser", name]).tool_call_parser == name
