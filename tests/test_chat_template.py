"""Chat templates in the router (router/chat_template.py) and the chat form of GenerateRequest.

Rendered ids equal transformers' `apply_chat_template(..., tokenize=True,
add_generation_prompt=True)` for the test models' templates (ChatML; Llama 2's with BOS in the
template and a tokenizer that adds BOS too) and the built-in model's (skipped when it cannot be
prepared), over several conversations; text parts reach a string template joined with "\\n"
and a part-iterating template as a list; the template's globals, filters and blocks behave as
transformers'; every malformed conversation and template error is an InvalidRequest naming the
field; the router renders without importing torch or transformers.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import grpc
import pytest
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
from pagedserve.router.chat_template import ChatTemplate, render_chat, render_chat_ids
from pagedserve.router.errors import InvalidRequest
from pagedserve.router.tokenizer import Tokenizer
from pagedserve.router.validation import Limits, request_from_pb

TEXT = lambda *texts: [{"type": "text", "text": t} for t in texts]  # noqa: E731

CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "  Hello! How can I help?  "},
     {"role": "user", "content": "Ünïcödé, 日本語のテキスト, emoji 🙂🚀, ±∞≠≤≥"}],
    [{"role": "system", "content": TEXT("Be brief.")},
     {"role": "user", "content": TEXT("first part", "second part ✓")},
     {"role": "assistant", "content": "ok"},
     {"role": "user", "content": "a </s> b <s> c"}],  # special tokens' text, as HF reads it
]


def _joined(messages):
    """What transformers must be given for a string template: text parts joined by "\\n"."""
    return [{**m, "content": "\n".join(p["text"] for p in m["content"])}
            if isinstance(m["content"], list) else m for m in messages]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from pagedserve.tinymodels import build_tokenizer
    root = tmp_path_factory.mktemp("chat")
    for name in ("chatml", "llama"):
        build_tokenizer(root / name, chat_template=name)
    build_tokenizer(root / "none", chat_template=None)
    return {name: root / name for name in ("chatml", "llama", "none")}


@pytest.fixture(scope="module")
def builtin_dir():
    from pagedserve.models import ModelSourceError, resolve_model
    try:
        return resolve_model("default")
    except ModelSourceError as exc:
        pytest.skip(f"the built-in model cannot be prepared here: {exc}")


def _assert_ids_equal_hf(model_dir):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    ours = Tokenizer.from_dir(model_dir)
    for messages in CONVERSATIONS:
        want = hf.apply_chat_template(_joined(messages), tokenize=True,
                                      add_generation_prompt=True, return_dict=False)
        assert render_chat_ids(ours, messages) == list(want), messages
    return ours


@pytest.mark.parametrize("name", ["chatml", "llama"])
def test_rendered_ids_equal_apply_chat_template(model_dirs, name):
    ours = _assert_ids_equal_hf(model_dirs[name])
    chat = render_chat(ours, CONVERSATIONS[1])
    bos = ours.bos_token_id
    if name == "llama":  # one BOS: the template's; encoding with BOS added would give two
        assert chat.token_ids[0] == bos and chat.token_ids[1] != bos
        assert ours.encode(chat.text)[:2] == [bos, bos]
    else:
        assert bos not in chat.token_ids


def test_builtin_model_ids_equal_apply_chat_template(builtin_dir):
    _assert_ids_equal_hf(builtin_dir)


PARTS_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}[{{ p['type'] }}:{{ p['text'] }}]{% endfor %}"
    "{% endif %}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def test_text_parts_reach_the_template_as_it_reads_content(model_dirs):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(model_dirs["chatml"]))
    messages = CONVERSATIONS[3]
    ours = ChatTemplate(PARTS_TEMPLATE, {})
    assert ours.content_as_parts  # iterates over parts: the list, as transformers passes it
    assert ours.render(messages) == hf.apply_chat_template(
        messages, chat_template=PARTS_TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert "[text:first part][text:second part ✓]" in ours.render(messages)
    chatml = Tokenizer.from_dir(model_dirs["chatml"]).chat_template
    assert not chatml.content_as_parts  # string content: parts joined with "\n"
    assert "user\nfirst part\nsecond part ✓<|im_end|>" in chatml.render(messages)
    for loop in ("{% set c = message.content %}{% for p in c %}{{ p.text }}{% endfor %}",
                 "{% for p in message['content'] | selectattr('type', 'equalto', 'text') %}"
                 "{{ p.text }}{% endfor %}"):
        assert ChatTemplate("{% for message in messages %}" + loop + "{% endfor %}")\
            .content_as_parts


FEATURES_TEMPLATE = """{{ bos_token }}{% set ns = namespace(n=0, last='') %}
{% for m in messages %}
    {% if m.role == 'skip' %}{% continue %}{% endif %}
    {% if loop.index > 4 %}{% break %}{% endif %}
    {% set ns.n = ns.n + 1 %}{% set ns.last = m.role %}
    {% generation %}{{ m.role | upper }}: {{ m.content }}{% endgeneration %}
    {{ m | tojson }} {{ dict(a=1, b='é') | tojson(indent=1, sort_keys=True) }}
{% endfor %}
{{ ns.n }} {{ ns.last }} {{ strftime_now('%Y')[:2] }} {{ eos_token }}{{ pad_token }}
{% if add_generation_prompt %}ASSISTANT:{% endif %}"""


def test_template_globals_filters_and_blocks_as_transformers(model_dirs):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(model_dirs["chatml"]))
    template = ChatTemplate(FEATURES_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>",
                                                "pad_token": "<pad>"})
    messages = [{"role": "system", "content": "日本語 🙂 <b>&</b>", "name": "x"},
                {"role": "skip", "content": "hidden"},
                {"role": "user", "content": "q", "reasoning_content": "hmm"},
                {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"},
                {"role": "user", "content": "after the break"}]
    for add in (True, False):
        assert template.render(messages, add_generation_prompt=add) == hf.apply_chat_template(
            messages, chat_template=FEATURES_TEMPLATE, tokenize=False,
            add_generation_prompt=add)
    assert '"日本語 🙂 <b>&</b>"' in template.render(messages)  # tojson: no escaping


def test_template_sources_and_special_tokens(tmp_path):
    config = {"bos_token": {"content": "<B>", "special": True}, "eos_token": "<E>",
              "image_token": "<img>", "add_bos_token": True,
              "chat_template": [{"name": "tool_use", "template": "T"},
                                {"name": "default", "template": "{{ bos_token }}{{ image_token }}"
                                                                "{{ eos_token }}"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    msgs = [{"role": "user", "content": "x"}]
    template = ChatTemplate.from_dir(tmp_path)
    assert template.special_tokens == {"bos_token": "<B>", "eos_token": "<E>",
                                       "image_token": "<img>"}
    assert template.render(msgs) == "<B><img><E>"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "json"}))
    assert ChatTemplate.from_dir(tmp_path).render(msgs) == "json"
    (tmp_path / "chat_template.jinja").write_text("jinja")
    assert ChatTemplate.from_dir(tmp_path).render(msgs) == "jinja"


def test_no_template_is_rejected_saying_so(model_dirs):
    tok = Tokenizer.from_dir(model_dirs["none"])
    assert tok.chat_template is None
    with pytest.raises(InvalidRequest, match="the model has no chat template") as info:
        render_chat_ids(tok, [{"role": "user", "content": "hi"}])
    assert info.value.field == "messages"


@pytest.mark.parametrize("messages, field", [
    ([], "messages"),
    ("hello", "messages"),
    ([{"content": "hi"}], "messages[0].role"),
    ([{"role": None, "content": "hi"}], "messages[0].role"),
    ([{"role": "", "content": "hi"}], "messages[0].role"),
    ([{"role": 3, "content": "hi"}], "messages[0].role"),
    ([{"role": "user", "content": "a"}, "b"], "messages[1]"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": {"type": "text", "text": "a"}}], "messages[0].content"),
    ([{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
      {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[2].content[0].type"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "b"}]}],
     "messages[0].content[1].type"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "messages[0].content[0].text"),
    ([{"role": "user", "content": ["a"]}], "messages[0].content[0]"),
])
def test_malformed_conversations_name_the_field(model_dirs, messages, field):
    tok = Tokenizer.from_dir(model_dirs["chatml"])
    with pytest.raises(InvalidRequest) as info:
        render_chat_ids(tok, messages)
    assert info.value.field == field and info.value.message.startswith(field + ":")


def test_template_errors_are_invalid_requests(model_dirs, caplog):
    llama = Tokenizer.from_dir(model_dirs["llama"])
    with pytest.raises(InvalidRequest, match="rejects the conversation: Only system, user and "
                                             "assistant roles are supported!"):
        render_chat_ids(llama, [{"role": "tool", "content": "42"}])
    chatml = Tokenizer.from_dir(model_dirs["chatml"])
    with pytest.raises(InvalidRequest, match="cannot render the conversation"):
        render_chat_ids(chatml, [{"role": "assistant", "content": None}])  # key dropped
    escapes = ["{{ messages.__class__.__mro__ }}", "{{ ''.__class__.__subclasses__() }}",
               "{% set ns = namespace() %}{% set ns._x = 1 %}", "{{ messages.append(1) }}"]
    for source in escapes:  # the sandbox refuses: a bad request, never a 500
        with pytest.raises(InvalidRequest, match="cannot render"):
            ChatTemplate(source).render([{"role": "user", "content": "x"}])
    broken = model_dirs["chatml"].parent / "broken"
    broken.mkdir()
    (broken / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    with caplog.at_level(logging.WARNING, logger="pagedserve.router"):
        template = ChatTemplate.from_dir(broken)
    assert "does not compile: line 1" in template.error and template.error in caplog.text
    with pytest.raises(InvalidRequest, match=r"the model.s chat template \(.*chat_template"
                                             r".jinja\) does not compile: line 1"):
        template.render([{"role": "user", "content": "x"}])


PREFILLS = [
    [{"role": "user", "content": "Capital of France?"},
     {"role": "assistant", "content": "The capital is"}],
    [{"role": "user", "content": "List two."},
     {"role": "assistant", "content": "  1. red\n2. "}],          # spaces the template keeps
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": TEXT("first", "Hello,")}],  # parts: the last continued
]
THINKING_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and "
    "not enable_thinking %}<think></think>{% endif %}{% endif %}")


@pytest.mark.parametrize("name", ["chatml", "llama"])
def test_continue_final_message_equals_transformers(model_dirs, name):
    """The prompt ends where the last message's text does, as apply_chat_template's
    continue_final_message leaves it: the model continues that message."""
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(model_dirs[name]))
    ours = Tokenizer.from_dir(model_dirs[name])
    for messages in PREFILLS:
        want = hf.apply_chat_template(_joined(messages), tokenize=False,
                                      add_generation_prompt=False, continue_final_message=True)
        got = render_chat(ours, messages, add_generation_prompt=False,
                          continue_final_message=True)
        assert got.text == want, messages
        assert got.text.endswith(("The capital is", "2. ", "Hello,"))
    trimmed = ChatTemplate(THINKING_TEMPLATE, {})  # strips the content: its spaces go too
    assert trimmed.render(PREFILLS[1], add_generation_prompt=False,
                          continue_final_message=True) == \
        "<user>List two.</user><assistant>1. red\n2."


def test_chat_template_kwargs_reach_the_template_as_transformers_passes_them(model_dirs):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(model_dirs["chatml"]))
    template = ChatTemplate(THINKING_TEMPLATE, {"eos_token": "</s>"})
    messages = CONVERSATIONS[1]
    for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        assert template.render(messages, template_kwargs=kwargs) == hf.apply_chat_template(
            messages, chat_template=THINKING_TEMPLATE, tokenize=False,
            add_generation_prompt=True, **kwargs)
    assert template.render(messages, template_kwargs={"enable_thinking": False})\
        .endswith("<assistant><think></think>")


@pytest.mark.parametrize("kwargs, field, match", [
    ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message",
     "cannot be set with add_generation_prompt"),
    ({"add_generation_prompt": False, "continue_final_message": True,
      "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": " "}]},
     "continue_final_message", "no text to continue"),
    ({"template_kwargs": {"messages": []}}, "chat_template_kwargs", "messages: set by the server"),
    ({"template_kwargs": {"eos_token": "x", "tools": 1}}, "chat_template_kwargs",
     "eos_token, tools: set by the server"),
])
def test_template_options_misused_are_invalid_requests(kwargs, field, match):
    template = ChatTemplate(THINKING_TEMPLATE, {"eos_token": "</s>"})
    messages = kwargs.pop("messages", PREFILLS[0])
    with pytest.raises(InvalidRequest, match=match) as info:
        template.render(messages, **kwargs)
    assert info.value.field == field
    hidden = ChatTemplate("{% for m in messages %}{{ m.role }}{% endfor %}")  # no content out
    with pytest.raises(InvalidRequest, match="does not write the last message"):
        hidden.render(PREFILLS[0], add_generation_prompt=False, continue_final_message=True)


# ------------------------------------------------------------------ GenerateRequest.messages


def _chat(*messages: pb.ChatMessage, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=pb.ChatMessages(messages=list(messages)), **kw)


def test_request_from_pb_renders_messages(model_dirs):
    tok = Tokenizer.from_dir(model_dirs["llama"])
    limits = Limits(vocab_size=tok.vocab_size, max_model_len=256)
    request = _chat(pb.ChatMessage(role="system", content="Be brief."),
                    pb.ChatMessage(role="user", parts=[pb.ChatContentPart(type="text", text="a"),
                                                       pb.ChatContentPart(type="text", text="b")]))
    spec = request_from_pb(request, tokenizer=tok, limits=limits)
    want = render_chat(tok, [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": TEXT("a", "b")}])
    assert list(spec.prompt_token_ids) == want.token_ids and spec.prompt_text == want.text
    assert spec.prompt_text.endswith("[INST] a\nb [/INST]")
    plain = request_from_pb(pb.GenerateRequest(prompt="Hello"), tokenizer=tok, limits=limits)
    assert list(plain.prompt_token_ids) == tok.encode("Hello")  # old clients: unchanged, BOS
    assert plain.prompt_token_ids[0] == tok.bos_token_id and plain.prompt_text == "Hello"


def test_request_from_pb_takes_the_template_options(model_dirs):
    tok = Tokenizer.from_dir(model_dirs["chatml"])
    limits = Limits(vocab_size=tok.vocab_size, max_model_len=256)
    turns = [pb.ChatMessage(role="user", content="Capital of France?"),
             pb.ChatMessage(role="assistant", content="The capital is")]
    plain = [{"role": m.role, "content": m.content} for m in turns]

    def text(**options):
        chat = pb.ChatMessages(messages=turns, **options)
        return request_from_pb(pb.GenerateRequest(messages=chat), tokenizer=tok,
                               limits=limits).prompt_text

    assert text() == render_chat(tok, plain).text  # unset: the generation prompt
    assert text(add_generation_prompt=False) == render_chat(
        tok, plain, add_generation_prompt=False).text
    # continue_final_message alone: the generation prompt off
    assert text(continue_final_message=True).endswith("<|im_start|>assistant\nThe capital is")
    with pytest.raises(InvalidRequest) as info:
        text(continue_final_message=True, add_generation_prompt=True)
    assert info.value.field == "continue_final_message"
    for bad, field in (("[1]", "chat_template_kwargs_json"), ("{", "chat_template_kwargs_json"),
                       ('{"tools": []}', "chat_template_kwargs")):
        with pytest.raises(InvalidRequest) as info:
            text(chat_template_kwargs_json=bad)
        assert info.value.field == field


@pytest.mark.parametrize("request_, field", [
    (_chat(), "messages"),
    (_chat(pb.ChatMessage(role="user", content="a"), pb.ChatMessage(content="b")),
     "messages[1].role"),
    (_chat(pb.ChatMessage(role="user", content="a",
                          parts=[pb.ChatContentPart(type="text", text="b")])), "messages[0]"),
    (_chat(pb.ChatMessage(role="user", parts=[pb.ChatContentPart(type="text", text="b"),
                                              pb.ChatContentPart(type="image", text="c")])),
     "messages[0].parts[1].type"),
    (_chat(pb.ChatMessage(role="user", content="x" * 2000)), "messages"),  # > max_model_len
])
def test_request_from_pb_rejects_bad_messages(model_dirs, request_, field):
    tok = Tokenizer.from_dir(model_dirs["chatml"])
    limits = Limits(vocab_size=tok.vocab_size, max_model_len=256)
    with pytest.raises(InvalidRequest) as info:
        request_from_pb(request_, tokenizer=tok, limits=limits)
    assert info.value.field == field
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_router_renders_without_torch_or_transformers(model_dirs):
    code = ("import sys\n"
            "from pagedserve.router import app, grpc_server, validation\n"
            "from pagedserve.router.tokenizer import Tokenizer\n"
            "from pagedserve.router.chat_template import render_chat_ids\n"
            "tok = Tokenizer.from_dir(sys.argv[1])\n"
            "assert render_chat_ids(tok, [{'role': 'user', 'content': 'hi'}])\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code, str(model_dirs["llama"])],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
