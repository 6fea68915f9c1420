"""A thinking model's reasoning apart from its answer (`--reasoning-parser`): what the model
writes between ``<think>`` and ``</think>`` goes out as the chat message's
`reasoning_content` (the field vLLM and DeepSeek's API use), the rest as `content`.

The two parsers differ only in where the reasoning may start:

* `qwen3`: only where the output opens with ``<think>`` (whitespace before it allowed). An
  output that opens with anything else has no reasoning: all of it is content (Qwen3 with
  `chat_template_kwargs: {"enable_thinking": false}`, whose template writes an empty think
  block into the prompt).
* `deepseek_r1`: the template opens ``<think>`` in the prompt, so the output starts inside
  the reasoning; a ``<think>`` the model writes first anyway is dropped.

The reasoning ends at the first ``</think>``; everything after it is content, unchanged
(the tool-call parser, when on, reads only that). An output that ends (max_tokens, a stop
string, an abort) before ``</think>`` was all reasoning.

One state machine serves streams and whole texts (`feed` text as it comes, then `finish`; a
whole text is one feed): a tail that may be the start of the tag it waits for is held back
until the next text decides it, as tool_parsers.py holds a partial ``<tool_call>``. Nothing
is lost: reasoning + content is the output less the two tags (and, for qwen3, the
whitespace before ``<think>``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .tool_parsers import _partial_suffix

PARSERS = ("none", "qwen3", "deepseek_r1")
START, END = "<think>", "</think>"


@dataclass
class ReasoningPiece:
    """What one feed (or the finish) gives out."""

    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    # states: OPENING (before the output shows whether it opens with <think>), REASONING,
    # CONTENT (after </think>, or an output without reasoning)
    OPENING, REASONING, CONTENT = range(3)

    def __init__(self, opens_in_reasoning: bool) -> None:
        self.opens_in_reasoning = opens_in_reasoning  # deepseek_r1: the prompt opened <think>
        self._state = self.OPENING
        self._buf = ""

    def feed(self, text: str) -> ReasoningPiece:
        piece = ReasoningPiece()
        self._buf += text
        if self._state == self.OPENING:
            head = self._buf.lstrip()
            if head.startswith(START):
                self._buf = head[len(START):]
                self._state = self.REASONING
            elif START.startswith(head):
                return piece  # empty, or a partial <think>: not decided yet
            else:
                self._state = self.REASONING if self.opens_in_reasoning else self.CONTENT
        if self._state == self.REASONING:
            at = self._buf.find(END)
            if at < 0:
                keep = _partial_suffix(self._buf, END)
                piece.reasoning = self._buf[:len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                return piece
            piece.reasoning, self._buf = self._buf[:at], self._buf[at + len(END):]
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
    if name == "qwen3":
        return ReasoningParser(opens_in_reasoning=False)
    if name == "deepseek_r1":
        return ReasoningParser(opens_in_reasoning=True)
    return None


def split_reasoning(name: str, text: str) -> tuple[str, str]:
    """A whole output's (reasoning, content) under the parser `name`."""
    parser = make_reasoning_parser(name)
    if parser is None:
        return "", text
    first, last = parser.feed(text), parser.finish()
    return first.reasoning + last.reasoning, first.content + last.content
