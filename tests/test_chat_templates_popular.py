"""Popular models' chat templates (tests/chat_templates/: the shapes of Qwen3's, Llama 3.1's,
DeepSeek-R1's, Gemma's and Mistral's, written out here, as the checks below need only the
jinja they use) rendered by the router as transformers' apply_chat_template renders them,
through the path a request takes: OpenAI messages -> ChatMessages (protobuf) -> the
template. Tools and tool turns, reasoning in an assistant turn (`reasoning_content` or
`<think>` in its content), text parts, chat_template_kwargs, the generation prompt on and off,
continue_final_message, and a template that rejects a conversation (an InvalidRequest here,
a TemplateError there)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
from pagedserve.router.chat_template import ChatTemplate
from pagedserve.router.errors import InvalidRequest
from pagedserve.router.openai_protocol import messages_to_pb
from pagedserve.router.validation import messages_from_pb, tools_from_pb

TEMPLATES = Path(__file__).parent / "chat_templates"
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CALL = {"id": "call12345", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}}

PLAIN = [{"role": "system", "content": "You are terse."},
         {"role": "user", "content": "Name three colours."}]
TURNS = [{"role": "user", "content": "Hi!"},
         {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello! 🙂"},
         {"role": "user", "content": "Ünïcödé  and spaces  "}]
REASONED = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
            {"role": "user", "content": [{"type": "text", "text": "And 3+3?"},
                                         {"type": "text", "text": "Briefly."}]}]
TOOL_TURNS = [{"role": "user", "content": "Weather in Oslo?"},
              {"role": "assistant", "content": None, "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call12345", "content": '{"temp": 3}'}]
# transformers drops a None content (as the router does): DeepSeek's template then fails on
# it, so that template gets the empty string the router's wire form gives a null anyway
TOOL_TURNS_EMPTY = [TOOL_TURNS[0], {**TOOL_TURNS[1], "content": ""}, TOOL_TURNS[2]]
PREFILL = [{"role": "user", "content": "Capital of France?"},
           {"role": "assistant", "content": "The capital is"}]

CASES = {  # template: the conversations it accepts, with tools or not
    "qwen3": [(PLAIN, None), (TURNS, None), (REASONED, None), (TOOL_TURNS, TOOLS),
              (PLAIN, TOOLS)],
    "llama31": [(PLAIN, None), (TURNS, None), (TOOL_TURNS, TOOLS), (PLAIN, TOOLS)],
    "deepseek_r1": [(PLAIN, None), (TURNS, None), (REASONED, None), (TOOL_TURNS_EMPTY, None)],
    "gemma": [(TURNS, None), (REASONED, None)],
    "mistral": [(PLAIN, None), (TURNS, None), (TOOL_TURNS, TOOLS)],
}


def _joined(messages):
    return [{**m, "content": "\n".join(p["text"] for p in m["content"])}
            if isinstance(m.get("content"), list) else m for m in messages]


def _through_the_wire(messages, tools):
    """What validation hands the template for an HTTP request with these fields."""
    chat = messages_to_pb(messages)
    if tools:
        chat.tools_json = json.dumps(tools)
    return messages_from_pb(chat), tools_from_pb(chat)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    from transformers import AutoTokenizer

    from pagedserve.tinymodels import build_tokenizer
    path = tmp_path_factory.mktemp("popular") / "tok"
    build_tokenizer(path, chat_template="chatml")
    return AutoTokenizer.from_pretrained(str(path))


def _hf_render(hf, source, messages, tools, **kwargs):
    # the test tokenizer's own special tokens give way to SPECIAL, as ours get them
    return hf.apply_chat_template(_joined(messages), chat_template=source, tools=tools,
                                  tokenize=False, **SPECIAL, **kwargs)


@pytest.mark.parametrize("name", sorted(CASES))
def test_popular_templates_render_as_transformers(hf, name):
    source = (TEMPLATES / f"{name}.jinja").read_text()
    ours = ChatTemplate(source, SPECIAL)
    assert ours.error is None
    for messages, tools in CASES[name]:
        got_messages, got_tools = _through_the_wire(messages, tools)
        for add in (True, False):
            want = _hf_render(hf, source, messages, tools, add_generation_prompt=add)
            got = ours.render(got_messages, tools=got_tools, add_generation_prompt=add)
            assert got == want, (name, messages, tools, add)
        kwargs = {"enable_thinking": False, "date_string": "01 Jan 2026"}
        assert ours.render(got_messages, tools=got_tools, template_kwargs=kwargs) == \
            _hf_render(hf, source, messages, tools, add_generation_prompt=True, **kwargs)


@pytest.mark.parametrize("name", ["qwen3", "llama31", "deepseek_r1", "mistral"])
def test_popular_templates_continue_a_prefill_as_transformers(hf, name):
    source = (TEMPLATES / f"{name}.jinja").read_text()
    messages, _ = _through_the_wire(PREFILL, None)
    got = ChatTemplate(source, SPECIAL).render(messages, add_generation_prompt=False,
                                               continue_final_message=True)
    assert got == _hf_render(hf, source, PREFILL, None, add_generation_prompt=False,
                             continue_final_message=True)
    assert got.endswith("The capital is")


@pytest.mark.parametrize("name, messages, says", [
    ("gemma", PLAIN, "System role not supported"),
    ("gemma", [PLAIN[1], PLAIN[1]], "roles must alternate"),
    ("llama31", [{"role": "assistant", "tool_calls": [CALL, CALL]}], "single tool-calls"),
    ("mistral", [{"role": "user", "content": "a"}, {"role": "tool", "content": "x",
                                                    "tool_call_id": "short"}], "length 9"),
])
def test_a_template_that_rejects_a_conversation_is_an_invalid_request(hf, name, messages, says):
    import jinja2
    source = (TEMPLATES / f"{name}.jinja").read_text()
    with pytest.raises(jinja2.TemplateError, match=says):
        _hf_render(hf, source, messages, None, add_generation_prompt=True)
    got_messages, _ = _through_the_wire(messages, None)
    with pytest.raises(InvalidRequest, match=says) as info:
        ChatTemplate(source, SPECIAL).render(got_messages)
    assert info.value.field == "messages"


def test_the_wire_keeps_what_templates_read():
    """The fields these templates read survive the protobuf form (pb.ChatMessages)."""
    got, tools = _through_the_wire(TOOL_TURNS, TOOLS)
    assert got[1]["tool_calls"] == [CALL] and got[2]["tool_call_id"] == "call12345"
    assert tools == TOOLS
    assert isinstance(messages_to_pb(REASONED), pb.ChatMessages)
