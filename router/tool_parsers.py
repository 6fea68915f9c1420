"""Tool calls in a model's own syntax (`--tool-call-parser`), for tool_choice "auto": the
model decides between text and calls, and its output is split into content and calls here.

* `hermes`: each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (JSON,
  whitespace around it allowed), the format of Hermes, Qwen2.5, Qwen3 and SmolLM3 templates,
  which list the tools for the model themselves.
* `qwen3_coder`: each call is ``<tool_call><function=NAME><parameter=P>VALUE</parameter>...
  </function></tool_call>`` (newlines around the parts), Qwen3-Coder's XML-like format: a
  value is text, made the type its parameter's schema gives (a number, a boolean, an array
  or object as JSON; kept as text when it does not parse).
* `llama3_json`: an output that is a JSON object ``{"name": ..., "parameters": {...}}``
  (several separated by ``;``) is calls, anything else content: Llama 3.1 and 3.3's format
  for custom tools (the ``<|python_tag|>`` before it is a special token, not in the text).
* `pythonic`: an output that is a Python list of calls, ``[f(a=1, b="x"), g()]``, is calls
  (arguments literals only), anything else content: Llama 3.2's and Llama 4's format.
* `mistral`: content, then ``[TOOL_CALLS]`` and calls to the end of the output, either a
  JSON array of ``{"name", "arguments"[, "id"]}`` (tokenizers before v11: Mistral 7B v0.3,
  Mistral Nemo) or ``NAME[ARGS]{...}`` (v11 on: Mistral Small 3.x, Devstral, Magistral;
  ``NAME[CALL_ID]ID[ARGS]{...}`` where the model writes an id), each call after a
  ``[TOOL_CALLS]`` of its own or straight after the one before. The markers are special
  tokens, so requests with tools keep special tokens in their text (unless the client
  sends ``skip_special_tokens: true``). Mistral's templates take only ids of 9 letters and
  digits: this parser's calls, and the forced calls of a server running it, get such ids
  (the model's own when it wrote a valid one).

One state machine serves streams and whole texts (`feed` text as it comes, then `finish`; a
whole text is one feed). Tagged formats (hermes, qwen3_coder): outside a call, text is
content, except a tail that may be the start of ``<tool_call>`` (held back until the next
text decides); inside one, text is held until ``</tool_call>``, then the call goes out
whole (its arguments as JSON text). Once a call has been seen, whitespace-only content
between calls is dropped. A call that does not parse, or that has no name, is given back
as content, tags included, and so is a call left open when the output ends (unless what it
holds parses: a model may stop at EOS before the closing tag). Mistral's: before
the marker as tagged formats; after it, each call goes out once its JSON closes, and what
follows the last call that is not one is given back at the end (with the marker, when no
call parsed after it). Whole-output formats
(llama3_json, pythonic): the first character that is not whitespace decides: the opener
(``{``, ``[``) holds the output until it ends, then it goes out as calls, or as content if
it is not calls after all; any other character makes the whole output content, streamed
as it comes. Nothing the model wrote is lost: content + calls account for every character
but tags and the whitespace between calls, with one exception: under
``parallel_tool_calls: false`` (``max_calls=1``) a second and later call is dropped, as the
client asked for at most one.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass, field

PARSERS = ("none", "hermes", "qwen3_coder", "llama3_json", "pythonic", "mistral")
_ALNUM = string.ascii_letters + string.digits


def tool_call_id(style: str = "") -> str:
    """A new call id; `style` "mistral": 9 letters and digits, the only ids Mistral's
    chat templates take back."""
    if style == "mistral":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedPiece:
    """What one feed (or the finish) gives out: new content and whole calls, in order."""

    content: str = ""
    calls: list[dict] = field(default_factory=list)  # OpenAI tool_calls entries, with index


class _Calls:
    """What every parser shares: the calls given out (at most `max_calls`), their ids."""

    def __init__(self, max_calls: int | None = None, schemas: dict | None = None) -> None:
        self.num_calls = 0
        self.max_calls = max_calls
        self.schemas = schemas or {}  # function name -> its parameters' JSON schema

    ID_STYLE = ""  # tool_call_id's
    SPECIAL_MARKERS = False  # its markers are special tokens: the text must keep them
    _buf: str  # the text held back, each parser's

    def _emit(self, piece: ParsedPiece, name: str, arguments, call_id: str = "") -> None:
        if self.max_calls is not None and self.num_calls >= self.max_calls:
            return  # parallel_tool_calls false: a call after the first is not given out
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        piece.calls.append({"index": self.num_calls,
                            "id": call_id or tool_call_id(self.ID_STYLE), "type": "function",
                            "function": {"name": name, "arguments": arguments}})
        self.num_calls += 1

    def _content(self, piece: ParsedPiece, text: str) -> None:
        if text and not (self.num_calls and text.isspace()):
            piece.content += text

    def _content_before(self, piece: ParsedPiece, tag: str) -> bool:
        """The buffer's text before `tag` out as content; True when the buffer now starts
        with `tag`, False when it holds none (a tail that may be its start is kept)."""
        at = self._buf.find(tag)
        if at < 0:
            keep = _partial_suffix(self._buf, tag)
            self._content(piece, self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._content(piece, self._buf[:at])
        self._buf = self._buf[at:]
        return True


class TaggedParser(_Calls):
    """Calls between ``<tool_call>`` and ``</tool_call>``, text around them (the module
    docstring); `_parse` reads a call's body."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, max_calls: int | None = None, schemas: dict | None = None) -> None:
        super().__init__(max_calls, schemas)
        self._buf = ""
        self._in_call = False

    def feed(self, text: str) -> ParsedPiece:
        piece = ParsedPiece()
        self._buf += text
        while True:
            if not self._in_call:
                if not self._content_before(piece, self.START):
                    return piece
                self._buf = self._buf[len(self.START):]
                self._in_call = True
            at = self._buf.find(self.END)
            if at < 0:
                return piece
            body, self._buf = self._buf[:at], self._buf[at + len(self.END):]
            self._in_call = False
            self._call(piece, body, self.START + body + self.END)

    def finish(self) -> ParsedPiece:
        """The end of the output: what was held back."""
        piece = ParsedPiece()
        rest, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            self._call(piece, rest, self.START + rest)
        else:
            self._content(piece, rest)
        return piece

    def _call(self, piece: ParsedPiece, body: str, original: str) -> None:
        parsed = self._parse(body)
        if parsed is None:
            piece.content += original  # not a call after all: the model's text, unchanged
            return
        self._emit(piece, *parsed)

    def _parse(self, body: str) -> tuple[str, object] | None:
        raise NotImplementedError


class HermesParser(TaggedParser):
    def _parse(self, body: str) -> tuple[str, object] | None:
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            return None
        return call["name"], call.get("arguments", call.get("parameters", {}))


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?$", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


class Qwen3CoderParser(TaggedParser):
    def _parse(self, body: str) -> tuple[str, object] | None:
        m = _FUNCTION.match(body)
        if m is None:
            return None
        name = m.group(1).strip()
        properties = (self.schemas.get(name) or {}).get("properties") or {}
        arguments = {}
        for key, raw in _PARAMETER.findall(m.group(2)):
            key = key.strip()
            arguments[key] = _typed(raw.strip("\n"), (properties.get(key) or {}).get("type"))
        return name, arguments


_JSON_TYPES = {"integer": (int,), "number": (int, float), "boolean": (bool,),
               "array": (list,), "object": (dict,), "null": (type(None),)}


def _typed(value: str, kind) -> object:
    """A qwen3_coder parameter's text as its schema's `type` says (a list of types: any of
    them; none given: JSON when it parses); the text itself when it is not of that type."""
    if kind == "string":
        return value
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    if kind is None:
        return parsed
    for name in kind if isinstance(kind, list) else [kind]:
        types = _JSON_TYPES.get(name, ())
        if isinstance(parsed, types) and not (name in ("integer", "number")
                                              and isinstance(parsed, bool)):
            return parsed
    return value


class WholeOutputParser(_Calls):
    """An output that opens with `OPENER` is calls (`_parse_all`), else content (the module
    docstring)."""

    OPENER = ""

    def __init__(self, max_calls: int | None = None, schemas: dict | None = None) -> None:
        super().__init__(max_calls, schemas)
        self._buf = ""
        self._mode = ""  # "": undecided; "calls": held; "content": streamed

    def feed(self, text: str) -> ParsedPiece:
        piece = ParsedPiece()
        if self._mode == "content":
            piece.content = text
            return piece
        self._buf += text
        if not self._mode and self._buf.strip():
            self._mode = "calls" if self._buf.lstrip().startswith(self.OPENER) else "content"
            if self._mode == "content":
                piece.content, self._buf = self._buf, ""
        return piece

    def finish(self) -> ParsedPiece:
        piece = ParsedPiece()
        rest, self._buf = self._buf, ""
        calls = self._parse_all(rest.strip()) if self._mode == "calls" else None
        if calls is None:
            piece.content = rest
        else:
            for name, arguments in calls:
                self._emit(piece, name, arguments)
        return piece

    def _parse_all(self, text: str) -> list[tuple[str, object]] | None:
        raise NotImplementedError


class Llama3JsonParser(WholeOutputParser):
    OPENER = "{"

    def _parse_all(self, text: str) -> list[tuple[str, object]] | None:
        decoder, at, calls = json.JSONDecoder(), 0, []
        while at < len(text):
            try:
                call, at = decoder.raw_decode(text, at)
            except ValueError:
                return None
            if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
                return None
            calls.append((call["name"], call.get("parameters", call.get("arguments", {}))))
            while at < len(text) and text[at] in " \t\r\n;":
                at += 1
        return calls or None


class PythonicParser(WholeOutputParser):
    OPENER = "["

    def _parse_all(self, text: str) -> list[tuple[str, object]] | None:
        try:
            tree = ast.parse(text, mode="eval").body
        except SyntaxError:
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and not node.args and all(k.arg for k in node.keywords)):
                return None
            try:
                arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            except ValueError:
                return None
            calls.append((node.func.id, arguments))
        return calls


_MISTRAL_NAME = re.compile(
    r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[CALL_ID\]\s*([A-Za-z0-9]*)\s*)?\[ARGS\]\s*")
_JSON = json.JSONDecoder()


class MistralParser(_Calls):
    """Content, then ``[TOOL_CALLS]`` and calls (the module docstring).

    After the marker the buffer is read call by call: a marker is dropped; ``[`` or ``{``
    opens the JSON of the older format (an array of calls, or one), ``NAME[ARGS]`` the
    newer one's JSON arguments. A call can only be complete when a ``]`` or ``}`` has
    arrived since the last attempt, so a long call is not parsed again at every token.
    What is left when the output ends did not parse: content."""

    MARKER = "[TOOL_CALLS]"
    ID_STYLE = "mistral"
    SPECIAL_MARKERS = True

    def __init__(self, max_calls: int | None = None, schemas: dict | None = None) -> None:
        super().__init__(max_calls, schemas)
        self._buf = ""
        self._in_calls = False
        self._marker = False  # a marker was read and no call parsed since

    def feed(self, text: str) -> ParsedPiece:
        piece = ParsedPiece()
        self._buf += text
        if not self._in_calls:
            if not self._content_before(piece, self.MARKER):
                return piece
            self._in_calls = True
            self._read_calls(piece)
        elif "}" in text or "]" in text:
            self._read_calls(piece)
        return piece

    def finish(self) -> ParsedPiece:
        piece = ParsedPiece()
        if self._in_calls:
            self._read_calls(piece)
        rest, self._buf = self._buf, ""
        self._content(piece, self.MARKER + rest if self._marker else rest)
        return piece

    def _read_calls(self, piece: ParsedPiece) -> None:
        while True:
            text = self._buf.lstrip()
            if text.startswith(self.MARKER):
                self._buf, self._marker = text[len(self.MARKER):], True
                continue
            if not text:
                return
            if text[0] in "[{":
                try:
                    value, end = _JSON.raw_decode(text)
                except ValueError:
                    return  # not closed yet (or not JSON: content at the end)
                calls = _mistral_json_calls(value)
            else:
                m = _MISTRAL_NAME.match(text)
                if m is None:
                    return
                try:
                    arguments, end = _JSON.raw_decode(text, m.end())
                except ValueError:
                    return
                calls = [(m.group(1), arguments, m.group(2) or "")] \
                    if isinstance(arguments, dict) else None
            if calls is None:
                return
            for name, arguments, call_id in calls:
                valid = len(call_id) == 9 and call_id.isascii() and call_id.isalnum()
                self._emit(piece, name, arguments, call_id if valid else "")
            self._buf, self._marker = text[end:], False


def _mistral_json_calls(value) -> list[tuple[str, object, str]] | None:
    """(name, arguments, id) of the older format's array (or single object) of calls;
    None when any entry is not a call."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if not isinstance(arguments, (dict, str)):
            return None
        call_id = item.get("id")
        calls.append((item["name"], arguments, call_id if isinstance(call_id, str) else ""))
    return calls or None


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


_PARSER_CLASSES = {"hermes": HermesParser, "qwen3_coder": Qwen3CoderParser,
                   "llama3_json": Llama3JsonParser, "pythonic": PythonicParser,
                   "mistral": MistralParser}


def keeps_special_tokens(parser: str) -> bool:
    """Whether `parser` reads markers that are special tokens (kept in the text)."""
    cls = _PARSER_CLASSES.get(parser)
    return cls is not None and cls.SPECIAL_MARKERS


def make_parser(name: str, parallel: bool = True, schemas: dict | None = None):
    """The parser `name` (--tool-call-parser; None for "none"); `parallel` false: at most
    one call out; `schemas`: each function's parameters schema (qwen3_coder's types)."""
    cls = _PARSER_CLASSES.get(name)
    return cls(max_calls=None if parallel else 1, schemas=schemas) if cls else None
