"""--reasoning-parser (router/reasoning_parsers.py): a thinking model's <think> (or
[THINK]) text apart from its answer, the same whatever the stream's chunking, and nothing
lost; Mistral's tags are special tokens, kept in the text of its chat requests."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedserve.router.reasoning_parsers import (
    FORMATS,
    PARSERS,
    make_reasoning_parser,
    split_reasoning,
)


@pytest.mark.parametrize("name, text, reasoning, content", [
    ("qwen3", "<think>\nAdd them.\n</think>\n\n4", "\nAdd them.\n", "\n\n4"),
    ("qwen3", "  \n<think>x</think>y", "x", "y"),            # whitespace before the tag
    ("qwen3", "4, no thinking", "", "4, no thinking"),       # enable_thinking false
    ("qwen3", "<think>cut by max_tokens", "cut by max_tokens", ""),
    ("qwen3", "<thin", "", "<thin"),                          # a partial tag is its text
    ("qwen3", "", "", ""),
    ("qwen3", "a <think>b</think> c", "", "a <think>b</think> c"),  # not at the start
    ("deepseek_r1", "Add them.\n</think>\n\n4", "Add them.\n", "\n\n4"),
    ("deepseek_r1", "<think>\nAdd.</think>4", "\nAdd.", "4"),
    ("deepseek_r1", "still thinking", "still thinking", ""),
    ("deepseek_r1", "x</think>y</think>z", "x", "y</think>z"),  # the first end tag ends it
    ("deepseek_r1", "</thi", "</thi", ""),
    ("none", "<think>x</think>y", "", "<think>x</think>y"),
    ("mistral", "[THINK]Add them.[/THINK]It is 4.", "Add them.", "It is 4."),
    ("mistral", "\n[THINK]x[/THINK]", "x", ""),
    ("mistral", "It is 4.", "", "It is 4."),                # no [THINK]: all content
    ("mistral", "[THINK]cut by max_tokens", "cut by max_tokens", ""),
    ("mistral", "<think>x</think>y", "", "<think>x</think>y"),  # not its tags
    ("mistral", "[THINK]a[/THINK]b[/THINK]c", "a", "b[/THINK]c"),
    ("mistral", "[THI", "", "[THI"),
])
def test_whole_outputs(name, text, reasoning, content):
    assert split_reasoning(name, text) == (reasoning, content)


def test_a_stream_holds_back_only_what_may_be_a_tag():
    parser = make_reasoning_parser("qwen3")
    got = [parser.feed(t) for t in ("<th", "ink>Let", " me</th", "ink>Hi", "!")]
    assert [(p.reasoning, p.content) for p in got] == [
        ("", ""), ("Let", ""), (" me", ""), ("", "Hi"), ("", "!")]
    last = parser.finish()
    assert (last.reasoning, last.content) == ("", "")


def _pieces(name):
    """Text pieces for the parser `name`: its tags whole, cut and alone, and plain text."""
    start, end = FORMATS[name].start, FORMATS[name].end
    return st.sampled_from([start, end, start[:3], start[3:], end[:2], end[2:], start[0],
                            start[-1], start[1:-1], "a", " ", "\n", "é🙂"])


@settings(max_examples=400, deadline=None)
@given(data=st.data(), name=st.sampled_from(["qwen3", "deepseek_r1", "mistral"]),
       cuts=st.lists(st.integers(0, 60), max_size=6))
def test_any_chunking_gives_the_whole_texts_split(data, name, cuts):
    """Streamed in any chunks, the pieces add up to the whole output's split; and
    reasoning + content is the output less the tags that split it."""
    start, end = FORMATS[name].start, FORMATS[name].end
    text = "".join(data.draw(st.lists(_pieces(name), max_size=12)))
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    parser = make_reasoning_parser(name)
    reasoning = content = ""
    for a, b in zip(bounds, bounds[1:], strict=False):
        piece = parser.feed(text[a:b])
        reasoning, content = reasoning + piece.reasoning, content + piece.content
    last = parser.finish()
    got = (reasoning + last.reasoning, content + last.content)
    assert got == split_reasoning(name, text)
    head = text.lstrip()
    if head.startswith(start):
        body = head[len(start):]
    else:  # deepseek_r1 starts inside the reasoning; the others have none
        body = text if name == "deepseek_r1" else None
    if body is None:
        assert got == ("", text)
    elif end in body:
        cut = body.index(end)
        assert got == (body[:cut], body[cut + len(end):])
    else:
        assert got == (body, "")


def test_mistral_chat_requests_keep_special_tokens_for_its_tags():
    from pagedserve.router.openai_protocol import chat_request

    def params(parser, **body):
        api = chat_request({"messages": [{"role": "user", "content": "Hi"}], **body},
                           reasoning_parser=parser)
        return api.reasoning, api.requests[0].params.keep_special_tokens

    assert params("mistral") == ("mistral", True)
    assert params("mistral", skip_special_tokens=True) == ("mistral", False)
    assert params("mistral", skip_special_tokens=False) == ("mistral", True)
    assert params("qwen3") == ("qwen3", False)  # <think> is no special token
    assert params("none") == ("", False)
    # a format from the first token: nothing to split, nothing kept for it
    assert params("mistral", response_format={"type": "json_object"}) == ("", False)


def test_mistral_tags_survive_detokenization_only_when_special_tokens_are_kept(tmp_path):
    """A tokenizer where [THINK] and [/THINK] are special tokens (as in Magistral's):
    sampled ids -> the router's text -> the parser."""
    from pagedserve.router.detokenizer import TextAssembler
    from pagedserve.router.tokenizer import Tokenizer
    from pagedserve.router.types import SamplingSpec
    from tokenizers import Tokenizer as HFTokenizer

    from pagedserve.tinymodels import build_tokenizer
    build_tokenizer(tmp_path)
    raw = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    raw.add_special_tokens(["[THINK]", "[/THINK]"])
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_dir(tmp_path)
    ids = tok.encode("[THINK]Add them.[/THINK]It is 4.", add_special_tokens=False)
    assert tok.is_special(ids[0])
    results = {}
    for keep in (True, False):
        asm = TextAssembler(tok, SamplingSpec(max_tokens=100, keep_special_tokens=keep), [])
        out = "".join(asm.append(t).text for t in ids) + asm.finish("stop")
        results[keep] = split_reasoning("mistral", out)
    assert results[True] == ("Add them.", "It is 4.")
    assert results[False] == ("", "Add them.It is 4.")


def test_the_flag_offers_every_parser():
    import argparse

    from pagedserve.flags import add_server_flags
    parser = argparse.ArgumentParser()
    add_server_flags(parser)
    for name in PARSERS:
        assert parser.parse_args(["--reasoning-parser", name]).reasoning_parser == name


# ------------------------------------------------------------------ the HTTP API


from fake_engine import make_tokenizer  # noqa: E402
from http_rig import MODEL, _post, _run, _sse, scripted  # noqa: E402

THOUGHT = "<think>\nAdd them.\n</think>\n\nIt is 4."
ASK = {"model": MODEL, "messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 200}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory)


async def _both(session, body) -> tuple[dict, list[dict]]:
    """The unary reply's message and the stream's deltas of one choice."""
    status, reply = await _post(session, "/v1/chat/completions", body)
    assert status == 200, reply
    events = await _sse(session, "/v1/chat/completions", {**body, "stream": True})
    return reply["choices"][0]["message"], [e["choices"][0]["delta"] for e in events[:-1]
                                           if e["choices"]]


def _joined(deltas, key):
    return "".join(d.get(key) or "" for d in deltas)


def test_chat_replies_carry_the_reasoning_apart(tok):
    async def main():
        async with scripted(tok, THOUGHT, reasoning_parser="qwen3") as (_, session):
            message, deltas = await _both(session, ASK)
            assert message == {"role": "assistant", "content": "\n\nIt is 4.",
                               "reasoning_content": "\nAdd them.\n"}
            assert _joined(deltas, "reasoning_content") == "\nAdd them.\n"
            assert _joined(deltas, "content") == "\n\nIt is 4."
            first = next(i for i, d in enumerate(deltas) if d.get("content"))
            assert not any(d.get("reasoning_content") for d in deltas[first:])  # then answer
            message, deltas = await _both(session, {**ASK, "include_reasoning": False})
            assert message["reasoning_content"] is None and message["content"] == "\n\nIt is 4."
            assert not _joined(deltas, "reasoning_content")
            # a format from the first token: no reasoning to split
            status, reply = await _post(session, "/v1/chat/completions",
                                        {**ASK, "response_format": {"type": "json_object"}})
            assert status == 200 and "reasoning_content" not in reply["choices"][0]["message"]
            status, reply = await _post(session, "/v1/completions",
                                        {"prompt": "2+2?", "max_tokens": 200})
            assert reply["choices"][0]["text"] == THOUGHT  # completions: the text as it is
        async with scripted(tok, THOUGHT) as (_, session):  # no parser: the model's text
            message, _ = await _both(session, ASK)
            assert message == {"role": "assistant", "content": THOUGHT}
        async with scripted(tok, "Add them.</think>4", reasoning_parser="deepseek_r1") as (_, session):
            message, deltas = await _both(session, ASK)
            assert (message["reasoning_content"], message["content"]) == ("Add them.", "4")
            assert (_joined(deltas, "reasoning_content"), _joined(deltas, "content")) == \
                ("Add them.", "4")
        async with scripted(tok, "[THINK]Add them.[/THINK]It is 4.",
                            reasoning_parser="mistral") as (_, session):
            message, deltas = await _both(session, ASK)
            assert (message["reasoning_content"], message["content"]) == ("Add them.",
                                                                          "It is 4.")
            assert (_joined(deltas, "reasoning_content"), _joined(deltas, "content")) == \
                ("Add them.", "It is 4.")
        async with scripted(tok, "<think>cut", reasoning_parser="qwen3") as (_, session):
            message, _ = await _both(session, ASK)
            assert message == {"role": "assistant", "content": None, "reasoning_content": "cut"}

    _run(main())


def test_tool_calls_are_found_in_the_content_only(tok):
    """With both parsers: a <tool_call> written while thinking is reasoning, not a call."""
    text = ('<think>Maybe <tool_call>{"name": "f", "arguments": {}}</tool_call>?</think>'
            'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '</tool_call>')
    body = {**ASK, "tools": [{"type": "function", "function": {"name": "get_weather"}}]}

    async def main():
        async with scripted(tok, text, reasoning_parser="qwen3",
                           tool_call_parser="hermes") as (_, session):
            message, deltas = await _both(session, body)
            assert message["reasoning_content"].startswith("Maybe <tool_call>")
            assert message["content"] == "Sure. "
            [call] = message["tool_calls"]
            assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
            assert _joined(deltas, "reasoning_content") == message["reasoning_content"]
            assert _joined(deltas, "content") == "Sure. "
            assert [c["function"] for d in deltas for c in d.get("tool_calls", [])] == \
                [call["function"]]

    _run(main())
