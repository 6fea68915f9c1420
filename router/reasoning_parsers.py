"""A thinking model's reasoning apart from its answer (`--reasoning-parser`): what the model
writes between its start and end tags goes out as the chat message's `reasoning_content`
(the field vLLM and DeepSeek's API use), the rest as `content`.

The parsers differ in their tags and in where the reasoning may start:

* `qwen3`: ``<think>`` ... ``</think>``, only where the output opens with ``<think>``
  (whitespace before it allowed). An output that opens with anything else has no reasoning:
  all of it is content (Qwen3 with `chat_template_kwargs: {"enable_thinking": false}`, whose
  template writes an empty think block into the prompt).
* `deepseek_r1`: the same tags; the template opens ``<think>`` in the prompt, so the output
  starts inside the reasoning; a ``<think>`` the model writes first anyway is dropped.
* `mistral`: ``[THINK]`` ... ``[/THINK]`` (Magistral, and Mistral models of tokenizer v13
  on), where the output opens with ``[THINK]``, as `qwen3`. Its tags are special tokens,
  which the router's text drops by default: a chat request under this parser keeps special
  tokens in its text unless it sends `skip_special_tokens` itself (`keeps_special_tokens`),
  as the `mistral` tool-call parser's requests do.

The reasoning ends at the first end tag; everything after it is content, unchanged (the
tool-call parser, when on, reads only that). An output that ends (max_tokens, a stop
string, an abort) before the end tag was all reasoning.

One state machine serves streams and whole texts (`feed` text as it comes, then `finish`; a
whole text is one feed): a tail that may be the start of the tag it waits for is held back
until the next text decides it, as tool_parsers.py holds a partial ``<tool_call>``. Nothing
is lost: reasoning + content is the output less the two tags (and, for an output that must
open with its start tag, the whitespace before it).
"""

from __future__ import annotations

from dataclasses import dataclass

from .tool_parsers import _partial_suffix


@dataclass(frozen=True)
class ReasoningFormat:
    """A parser's tags, whether the output starts inside the reasoning (the prompt opened
    it), and whether the tags are special tokens (kept in the text for the parser)."""

    start: str
    end: str
    opens_in_reasoning: bool = False
    special_tags: bool = False


FORMATS = {
    "qwen3": ReasoningFormat("<think>", "</think>"),
    "deepseek_r1": ReasoningFormat("<think>", "</think>", opens_in_reasoning=True),
    "mistral": ReasoningFormat("[THINK]", "[/THINK]", special_tags=True),
}
PARSERS = ("none", *FORMATS)


@dataclass
class ReasoningPiece:
    """What one feed (or the finish) gives out."""

    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    # states: OPENING (before the output shows whether it opens with <think>), REASONING,
    # CONTENT (after </think>, or an output without reasoning)
    OPENING, REASONING, CONTENT = range(3)

    def __init__(self, form: ReasoningFormat) -> None:
        self.start, self.end = form.start, form.end
        self.opens_in_reasoning = form.opens_in_reasoning  # deepseek_r1: the prompt opened it
        self._state = self.OPENING
        self._buf = ""

    def feed(self, text: str) -> ReasoningPiece:
        piece = ReasoningPiece()
        self._buf += text
        if self._state == self.OPENING:
            head = self._buf.lstrip()
            if head.startswith(self.start):
                self._buf = head[len(self.start):]
                self._state = self.REASONING
            elif self.start.startswith(head):
                return piece  # empty, or a partial <think>: not decided yet
            else:
                self._state = self.REASONING if self.opens_in_reasoning else self.CONTENT
        if self._state == self.REASONING:
            at = self._buf.find(self.end)
            if at < 0:
                keep = _partial_suffix(self._buf, self.end)
                piece.reasoning = self._buf[:len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                return piece
            piece.reasoning, self._buf = self._buf[:at], self._buf[at + len(self.end):]
            self._state = self.CONTENT
        piece.content, self._buf = self._buf, ""
        return piece

    def finish(self) -> ReasoningPiece:
        """The end of the output: what was held back (a partial tag is the text it is)."""
        rest, self._buf = self._buf, ""
        if self._state == self.CONTENT or (self._state == self.OPENING
                                           and not self.opens_in_reasoning):
            return ReasoningPiece(content=rest)
        return ReasoningPiece(reasoning=rest)


def make_reasoning_parser(name: str) -> ReasoningParser | None:
    """The parser `name` (--reasoning-parser), None for "none"."""
    form = FORMATS.get(name)
    return ReasoningParser(form) if form else None


def keeps_special_tokens(name: str) -> bool:
    """Whether the parser `name` reads tags that are special tokens (kept in the text)."""
    form = FORMATS.get(name)
    return form is not None and form.special_tags


def split_reasoning(name: str, text: str) -> tuple[str, str]:
    """A whole output's (reasoning, content) under the parser `name`."""
    parser = make_reasoning_parser(name)
    if parser is None:
        return "", text
    first, last = parser.feed(text), parser.finish()
    return first.reasoning + last.reasoning, first.content + last.content
