"""Tool calls in a model's own syntax (`--tool-call-parser`), for tool_choice "auto": the
model decides between text and calls, and its output is split into content and calls here.

`hermes`: each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (JSON,
whitespace around it allowed), the format of Hermes, Qwen2.5, Qwen3 and SmolLM3 templates,
which list the tools for the model themselves.

One state machine serves streams and whole texts (`HermesParser.feed` text as it comes, then
`finish`; a whole text is one feed): outside a call, text is content, except a tail that may
be the start of ``<tool_call>`` (held back until the next text decides); inside one, text is
held until ``</tool_call>``, then the call goes out whole (its arguments as JSON text). Once a
call has been seen, whitespace-only content between calls is dropped. A call whose JSON does
not parse, or that has no name, is given back as content, tags included, and so is a call
left open when the output ends (unless what it holds parses: a model may stop at EOS before
the closing tag). Nothing the model wrote is lost: content + calls account for every
character but tags and the whitespace between calls, with one exception: under
``parallel_tool_calls: false`` (``max_calls=1``) a second and later call is dropped, as the
client asked for at most one.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

PARSERS = ("none", "hermes")


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedPiece:
    """What one feed (or the finish) gives out: new content and whole calls, in order."""

    content: str = ""
    calls: list[dict] = field(default_factory=list)  # OpenAI tool_calls entries, with index


class HermesParser:
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, max_calls: int | None = None) -> None:
        self._buf = ""
        self._in_call = False
        self.num_calls = 0
        self.max_calls = max_calls

    def feed(self, text: str) -> ParsedPiece:
        piece = ParsedPiece()
        self._buf += text
        while True:
            if not self._in_call:
                at = self._buf.find(self.START)
                if at < 0:
                    keep = _partial_suffix(self._buf, self.START)
                    self._content(piece, self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return piece
                self._content(piece, self._buf[:at])
                self._buf = self._buf[at + len(self.START):]
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

    def _content(self, piece: ParsedPiece, text: str) -> None:
        if text and not (self.num_calls and text.isspace()):
            piece.content += text

    def _call(self, piece: ParsedPiece, body: str, original: str) -> None:
        try:
            call = json.loads(body)
        except ValueError:
            call = None
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            piece.content += original  # not a call after all: the model's text, unchanged
            return
        if self.max_calls is not None and self.num_calls >= self.max_calls:
            return  # parallel_tool_calls false: a call after the first is not given out
        arguments = call.get("arguments", call.get("parameters", {}))
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        piece.calls.append({"index": self.num_calls, "id": tool_call_id(), "type": "function",
                            "function": {"name": call["name"], "arguments": arguments}})
        self.num_calls += 1


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def make_parser(name: str, parallel: bool = True) -> HermesParser | None:
    """The parser `name` (--tool-call-parser); `parallel` false: at most one call out."""
    if name == "hermes":
        return HermesParser(max_calls=None if parallel else 1)
    return None
