"""A model's chat template, rendered with jinja2 as transformers' `apply_chat_template` renders
it — without transformers or torch.

Where the template comes from (the first found in the model directory): `chat_template.jinja`,
`chat_template.json` (`{"chat_template": ...}`), `tokenizer_config.json`'s `chat_template` (a
string, or a list of `{"name", "template"}` of which `default` is used).

What the template sees, as in transformers: `messages`, `add_generation_prompt`, `tools` (the
request's tool definitions, or None) and `documents` (None), the named special tokens of tokenizer_config.json as strings (`bos_token`,
`eos_token`, `unk_token`, `pad_token`, ..., and model-specific `*_token` keys); globals
`raise_exception`, `strftime_now`, `dict`, `namespace` (no underscore names); a `tojson`
filter with transformers' signature (no HTML escaping, non-ASCII kept); trim_blocks and
lstrip_blocks; loop controls (`{% break %}`, `{% continue %}`); the `{% generation %}` block
(its body is rendered). Everything runs in jinja2's ImmutableSandboxedEnvironment. A message's
keys whose value is None are dropped, and a message's reasoning (`reasoning_content`,
`thinking` or `reasoning`) is given under the first two names, as transformers does.

Content. A message's `content` is a string or a list of text parts
`{"type": "text", "text": ...}`; any other part type is rejected. A template written for
string content (`message['content'] + ...`, most text models') gets the parts' texts joined
with "\\n": a client that sends `[{"type": "text", "text": "Hi"}]` means "Hi", and that is what
the model sees (transformers would hand such a template the list, and it fails or prints the
list). A template that iterates over a message's content (`{% for part in message['content'] %}`,
multimodal-style templates) gets the parts as a list, unchanged, as transformers passes them.
vLLM decides the same way.

Tokens. The rendered text is tokenized without adding special tokens, as apply_chat_template
does: the template writes the ones it wants (a Llama-style `{{ bos_token }}` is the only BOS).

Errors. A conversation that is malformed, or that the template rejects (`raise_exception`, or
any error while rendering) is an `InvalidRequest` naming the field (`messages[2].content[0].type`,
`messages`). A template that does not compile is logged once when the model loads; its chat
requests are then rejected with the compile error, and plain prompts are served as usual.
"""

from __future__ import annotations

import codecs
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import InvalidRequest

log = logging.getLogger("pagedserve.router")

_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
# What the renderer itself gives every template (besides the special tokens).
_RENDERER_NAMES = ("messages", "tools", "documents", "add_generation_prompt")
FIELD = "messages"


# ------------------------------------------------------------------ the jinja environment


class _Raised(jinja2.TemplateError):
    """What `raise_exception(message)` raises: the template rejects the conversation."""


def _raise_exception(message: str):
    raise _Raised(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's `namespace`, refusing underscore-prefixed attribute names (they could reach
    interpreter internals)."""

    def __init__(*args, **kwargs):  # noqa: N805 - jinja2's own signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a namespace attribute may not start with an underscore: {name!r}")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks):
    renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=dict, namespace=_Namespace)
    return env


def _iterates_content(ast: jinja2.nodes.Template) -> bool:
    """Whether the template loops over a message's content (`for p in message['content']`,
    `message.content | selectattr(...)`, or a variable set from it)."""

    def is_content(node) -> bool:
        while isinstance(node, jinja2.nodes.Filter):
            node = node.node
        if isinstance(node, jinja2.nodes.Getitem):
            return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
        return isinstance(node, jinja2.nodes.Getattr) and node.attr == "content"

    aliases = {a.target.name for a in ast.find_all(jinja2.nodes.Assign)
               if isinstance(a.target, jinja2.nodes.Name) and is_content(a.node)}
    for loop in ast.find_all(jinja2.nodes.For):
        node = loop.iter
        while isinstance(node, jinja2.nodes.Filter):
            node = node.node
        if is_content(node) or (isinstance(node, jinja2.nodes.Name) and node.name in aliases):
            return True
    return False


# ------------------------------------------------------------------ the template


class ChatTemplate:
    """One model's chat template, compiled once; `render` is thread-safe."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, *,
                 origin: str = "") -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.origin = origin
        self.error: str | None = None  # why the template does not compile, if it does not
        self.content_as_parts = False  # the template iterates over content parts
        env = _environment()
        try:
            ast = env.parse(source)
            self._template = env.from_string(ast)
        except jinja2.TemplateSyntaxError as exc:
            self._template = None
            where = f" ({origin})" if origin else ""
            self.error = f"chat template{where} does not compile: line {exc.lineno}: " \
                         f"{exc.message}"
            return
        self.content_as_parts = _iterates_content(ast)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The directory's template, or None when it has none. One that does not compile is
        returned with `error` set (and logged): its chat requests are rejected."""
        model_dir = Path(model_dir)
        config = _read_json(model_dir / "tokenizer_config.json")
        found = _find_template(model_dir, config)
        if found is None:
            return None
        source, origin = found
        template = cls(source, special_tokens_of(model_dir, config), origin=origin)
        if template.error:
            log.warning("%s: chat requests will be rejected", template.error)
        return template

    @classmethod
    def given(cls, value: str, model_dir: str | Path) -> ChatTemplate:
        """`--chat-template` (vLLM's): the path of a Jinja file, or the template itself on one
        line (its backslash escapes, such as \\n, decoded), in place of the model's. With
        `model_dir`'s special tokens. ValueError, one line, when it is neither or does not
        compile: a template the operator chose fails the start, not every chat request."""
        path = Path(value).expanduser()
        if path.is_file():
            try:
                source, origin = path.read_text(encoding="utf-8"), str(path)
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"--chat-template {value}: cannot read it: {exc}") from None
        elif "{{" in value or "{%" in value:
            source, origin = codecs.decode(value, "unicode_escape"), "--chat-template"
        else:
            raise ValueError(f"--chat-template {value!r}: no such file (nor a template: it "
                             "has no {{ or {%)")
        model_dir = Path(model_dir)
        config = _read_json(model_dir / "tokenizer_config.json")
        template = cls(source, special_tokens_of(model_dir, config), origin=origin)
        if template.error:
            raise ValueError(template.error)
        return template

    def render(self, messages: Sequence[Any], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: Sequence[Any] | None = None,
               template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text of `messages` (dicts with `role` and `content`: a string or text
        parts), with the assistant's generation prompt unless asked otherwise; `tools` (the
        OpenAI tool definitions, or None) is the template's `tools`; `template_kwargs` extra
        variables (not the names the renderer sets). `continue_final_message`: the text ends
        where the last message's content does (`_continuation`). Raises InvalidRequest for a
        malformed conversation or one the template rejects."""
        if self._template is None:
            raise InvalidRequest(f"{FIELD}: the model's {self.error}", field=FIELD)
        if continue_final_message and add_generation_prompt:
            raise _bad("continue_final_message", "cannot be set with add_generation_prompt: "
                       "the one continues the last message, the other starts a new one")
        extra = self._check_template_kwargs(template_kwargs or {})
        checked = check_messages(messages)
        chat = [self._template_message(m) for m in checked]
        try:
            text = self._template.render(
                messages=chat, tools=_plain(list(tools)) if tools else None, documents=None,
                add_generation_prompt=add_generation_prompt, **{**self.special_tokens, **extra})
        except _Raised as exc:
            raise InvalidRequest(f"{FIELD}: the chat template rejects the conversation: "
                                 f"{exc.message}", field=FIELD) from None
        except Exception as exc:  # noqa: BLE001 - a template is code: any failure is this input's
            raise InvalidRequest(f"{FIELD}: the chat template cannot render the conversation: "
                                 f"{type(exc).__name__}: {exc}", field=FIELD) from None
        return _continuation(text, checked[-1]) if continue_final_message else text

    def _check_template_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        taken = sorted(set(kwargs) & ({*_RENDERER_NAMES, *self.special_tokens}))
        if taken:
            raise _bad("chat_template_kwargs", f"{', '.join(taken)}: set by the server, "
                       "not by chat_template_kwargs")
        return {str(k): _plain(v) for k, v in kwargs.items()}

    def _template_message(self, message: dict[str, Any]) -> dict[str, Any]:
        content = message.get("content")
        if isinstance(content, list) and not self.content_as_parts:
            message = {**message, "content": "\n".join(part["text"] for part in content)}
        return message


def _continuation(text: str, final: dict[str, Any]) -> str:
    """continue_final_message: `text` cut where the last message's content ends, so the model
    continues that message (an assistant prefill) rather than reading the end-of-turn marks
    the template writes after it. Templates often strip a content's surrounding spaces, so its
    stripped text is looked for from the end; its trailing spaces are kept when the template
    wrote them too. Text parts: the last one is what is continued."""
    content = final.get("content")
    if isinstance(content, list):
        content = content[-1]["text"] if content else ""
    core = (content or "").strip()
    if not core:
        raise _bad("continue_final_message", "the last message has no text to continue")
    at = text.rfind(core)
    if at < 0:
        raise _bad("continue_final_message", "the chat template does not write the last "
                   "message's text as given, so it cannot be continued")
    end = at + len(core)
    trailing = content[len(content.rstrip()):]
    if trailing and text.startswith(trailing, end):
        end += len(trailing)
    return text[:end]


# ------------------------------------------------------------------ the shared request path


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A rendered conversation: its text and its token ids (no special token added)."""

    text: str
    token_ids: list[int]


def render_chat(tokenizer, messages: Sequence[Any], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, tools: Sequence[Any] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> ChatPrompt:
    """The conversation `messages` (OpenAI's form: a list of {role, content: str | [text
    parts]}, other keys passed to the template) rendered with `tokenizer.chat_template`
    (`ChatTemplate.render`'s options) and tokenized without adding special tokens. Raises
    InvalidRequest naming the field: no chat template, a malformed message, a template error.
    CPU-bound (a long conversation takes milliseconds): callers on an event loop may run it
    in a thread."""
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        raise InvalidRequest(f"{FIELD}: the model has no chat template; send a prompt "
                             "(text or token ids) instead", field=FIELD)
    text = template.render(messages, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, tools=tools,
                           template_kwargs=template_kwargs)
    return ChatPrompt(text, tokenizer.encode(text, add_special_tokens=False))


def render_chat_ids(tokenizer, messages: Sequence[Any], *,
                    add_generation_prompt: bool = True) -> list[int]:
    """`render_chat(...).token_ids`: the prompt token ids of a conversation."""
    return render_chat(tokenizer, messages, add_generation_prompt=add_generation_prompt).token_ids


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """Validated copies of `messages`: a non-empty list of objects, each with a non-empty
    string `role` and a `content` that is a string, a list of text parts, or absent/None;
    None-valued keys dropped, reasoning aliased as transformers does. Raises InvalidRequest
    naming the field."""
    if not isinstance(messages, (list, tuple)):
        raise _bad(FIELD, "must be a list of messages")
    if not messages:
        raise _bad(FIELD, "must hold at least one message")
    return [_check_message(i, m) for i, m in enumerate(messages)]


def _check_message(i: int, message: Any) -> dict[str, Any]:
    where = f"{FIELD}[{i}]"
    if not isinstance(message, dict):
        raise _bad(where, "must be an object with a role and a content")
    out = {k: _plain(v) for k, v in message.items() if v is not None and isinstance(k, str)}
    role = out.get("role")
    if role is None:
        raise _bad(f"{where}.role", "required")
    if not isinstance(role, str) or not role:
        raise _bad(f"{where}.role", "must be a non-empty string")
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = [_check_part(f"{where}.content[{j}]", p) for j, p in enumerate(content)]
    elif content is not None and not isinstance(content, str):
        raise _bad(f"{where}.content", "must be a string or a list of text parts")
    reasoning = next((out[k] for k in _REASONING_KEYS if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def _check_part(where: str, part: Any) -> dict[str, str]:
    if not isinstance(part, dict):
        raise _bad(where, 'must be a content part {"type": "text", "text": ...}')
    kind = part.get("type")
    if kind != "text":
        raise _bad(f"{where}.type", f"content part type {kind!r} is not supported "
                                    "(only 'text')")
    text = part.get("text")
    if not isinstance(text, str):
        raise _bad(f"{where}.text", "must be a string")
    return {"type": "text", "text": text}


def _plain(value: Any) -> Any:
    """JSON-shaped copy of a value the template will see (anything else becomes its type
    name, as transformers does: templates must not reach arbitrary objects)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


def _bad(field: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{field}: {message}", field=field)


# ------------------------------------------------------------------ loading


def _find_template(model_dir: Path, config: dict[str, Any]) -> tuple[str, str] | None:
    """(template source, where it came from), or None."""
    jinja_path = model_dir / "chat_template.jinja"
    if jinja_path.is_file():
        return jinja_path.read_text(encoding="utf-8"), str(jinja_path)
    value = _read_json(model_dir / "chat_template.json").get("chat_template")
    origin = str(model_dir / "chat_template.json")
    if not isinstance(value, str):
        value = config.get("chat_template")
        origin = str(model_dir / "tokenizer_config.json")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return (value, origin) if isinstance(value, str) and value else None


def special_tokens_of(model_dir: Path, config: dict[str, Any]) -> dict[str, str]:
    """The special tokens transformers passes to templates: the named ones and any
    model-specific `*_token` of tokenizer_config.json (special_tokens_map.json fills gaps)."""
    legacy = _read_json(model_dir / "special_tokens_map.json")
    extra = config.get("extra_special_tokens")
    sources = [legacy, config, extra if isinstance(extra, dict) else {}]
    tokens: dict[str, str] = {}
    for source in sources:
        for key, value in source.items():
            if key in _NAMED_TOKENS or (key.endswith("_token") and source is not legacy):
                content = value.get("content") if isinstance(value, dict) else value
                if isinstance(content, str):
                    tokens[key] = content
    return tokens


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
