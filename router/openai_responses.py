"""OpenAI responses from the engine's outputs: one JSON body, or the server-sent-event chunks
of a stream (`ChoiceWriter`; the HTTP edge, http_server.py, writes them).

Choices are numbered prompt index × n + sample index. A chat reply whose tool_choice made the
model call a function (openai_formats.ToolMode) carries `tool_calls` instead of content:

* a named function: the output is its arguments; one call, finish_reason "stop" (OpenAI's
  for a forced function). Streamed, the first chunk of the choice opens the call (id, name)
  and every chunk after it adds to `function.arguments`;
* "required": the output is a JSON array of {"name", "parameters"}; one call per element,
  arguments = the parameters as JSON text, finish_reason "tool_calls". Streamed, the calls go
  out in one chunk when the choice ends (the array is only known then);
* "auto" (with --tool-call-parser): the output is split by the model's own syntax
  (tool_parsers.py) into content and calls; finish_reason "tool_calls" when it called one.
  Streamed, content flows as it comes and each call goes out whole once it is closed.

An output that is not a complete call (cut by max_tokens or a stop string, or aborted) is sent
as the content it is, with its own finish_reason.
"""

from __future__ import annotations

import dataclasses
import json

from .openai_logprobs import (
    TokenText,
    chat_logprobs_json,
    completion_logprobs_json,
    echo_logprobs_json,
    prompt_logprobs_json,
)
from .openai_protocol import ApiRequest, add_usage, stop_reason, usage_json
from .reasoning_parsers import make_reasoning_parser, split_reasoning
from .tool_parsers import make_parser, tool_call_id
from .types import CompletionDelta, RequestOutput, Usage


def required_calls(text: str, ids: str = "") -> list[dict] | None:
    """The tool calls of a "required" output (a JSON array of {"name", "parameters"}), or
    None when the text is not such an array (cut short); `ids`: their id style."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) for c in items):
        return None
    return [{"id": tool_call_id(ids), "type": "function",
             "function": {"name": c["name"],
                          "arguments": json.dumps(c.get("parameters", {}), ensure_ascii=False)}}
            for c in items]


class ChoiceWriter:
    """Builds the response (or the SSE chunks) of one API request from its outputs."""

    sse_done = True  # a stream ends with `data: [DONE]`
    sse_named = False  # events are `data: JSON` alone

    def __init__(self, api: ApiRequest, response_id: str, created: int, model: str,
                 token_text: TokenText):
        self.api = api
        kind = ("chat.completion.chunk" if api.stream else "chat.completion") if api.chat \
            else "text_completion"
        self.head = {"id": response_id, "object": kind, "created": created, "model": model}
        self.token_text = token_text
        self.num_choices = len(api.requests) * api.n
        self.text: dict[int, list[str]] = {}
        self.logprobs: dict[int, list] = {}
        self.ended: dict[int, CompletionDelta] = {}
        self.usage: Usage | None = None
        self.offsets: dict[int, int] = {}
        self.sent_tokens = False
        self.stop_token_ids = tuple(api.requests[0].params.stop_token_ids)
        self.tools = api.tools if api.chat else None
        self.prompt_logprobs: dict[int, tuple] = {}  # prompt index -> its scores
        self.call_ids: dict[int, str] = {}  # a named call's id per choice (streams)
        self.parsers: dict = {}  # tool_choice "auto": each choice's parser (streams)
        self.reasoners: dict = {}  # --reasoning-parser: each choice's parser (streams)
        self.prompts: list = []  # each prompt's token ids (set by the edge once submitted)
        self.streamed_tokens = 0  # continuous usage: the tokens the stream has carried
        self.token_ids: dict[int, list[int]] = {}  # vLLM's return_token_ids: each choice's
        self.ids_sent: set[int] = set()  # return_token_ids: choices whose prompt went out

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def _index(self, prompt_index: int, delta: CompletionDelta) -> int:
        return prompt_index * self.api.n + delta.index

    # ------------------------------------------------------------------ unary

    def _shown(self, out: RequestOutput) -> RequestOutput:
        """`out` as the client sees it: with echo and max_tokens 0 (`echo_only`) the one
        token sampled is dropped, text, logprobs, ids and count, and the choice ends by
        its length (0)."""
        if not self.api.echo_only:
            return out
        usage = out.usage and dataclasses.replace(out.usage, completion_tokens=0)
        deltas = tuple(CompletionDelta(d.index, finish_reason="length")
                       for d in out.deltas if d.finish_reason is not None)
        return dataclasses.replace(out, deltas=deltas, usage=usage)

    def add(self, prompt_index: int, out: RequestOutput) -> None:
        out = self._shown(out)
        if out.prompt_logprobs:
            self.prompt_logprobs[prompt_index] = out.prompt_logprobs
        for delta in out.deltas:
            i = self._index(prompt_index, delta)
            self.text.setdefault(i, []).append(delta.text)
            self.logprobs.setdefault(i, []).extend(delta.logprobs)
            self.token_ids.setdefault(i, []).extend(delta.token_ids)
            if delta.finish_reason is not None:
                self.ended[i] = delta
        self.usage = add_usage(self.usage, out.usage)

    def response(self) -> dict:
        choices = []
        for i in range(self.num_choices):
            text = "".join(self.text.get(i, ()))
            end = self.ended.get(i)
            choice: dict = {"index": i}
            lps = self.logprobs.get(i, [])
            finish = end.finish_reason if end else None
            reasoning = None
            if self.api.chat and self.api.reasoning:
                reasoning, text = split_reasoning(self.api.reasoning, text)
            if self.api.chat and self.tools is not None and self.tools.parser:
                choice["message"], finish = self._parsed_message(text, finish)
                choice["logprobs"] = ({"content": chat_logprobs_json(lps, self.token_text)}
                                      if self.api.logprobs is not None else None)
            elif self.api.chat:
                choice["message"] = {"role": "assistant", "content": text}
                calls = self._calls(text, finish)
                if calls is not None:
                    choice["message"] = {"role": "assistant", "content": None,
                                         "tool_calls": calls}
                    finish = "stop" if self.tools.name else "tool_calls"
                choice["logprobs"] = ({"content": chat_logprobs_json(lps, self.token_text)}
                                      if self.api.logprobs is not None else None)
            else:
                prefix = self._echo(i // self.api.n) if self.api.echo else ""
                choice["text"] = prefix + text
                choice["logprobs"] = None
                if self.api.logprobs is not None:
                    choice["logprobs"] = completion_logprobs_json(lps, self.token_text,
                                                                  len(prefix))
                    if self.api.echo:
                        choice["logprobs"] = _joined(self._echo_logprobs(i // self.api.n),
                                                     choice["logprobs"])
            if reasoning is not None:
                choice["message"] = self._with_reasoning(choice["message"], reasoning)
            choice["finish_reason"] = finish
            choice["stop_reason"] = stop_reason(end, self.stop_token_ids) if end else None
            if self.api.prompt_logprobs is not None and not self.api.chat:
                choice["prompt_logprobs"] = self._prompt_logprobs(i // self.api.n)
            if self.api.return_token_ids:  # vLLM's: the prompt's on a completion's choice
                choice["token_ids"] = self.token_ids.get(i, [])
                if not self.api.chat:
                    choice["prompt_token_ids"] = list(self.prompts[i // self.api.n])
            choices.append(choice)
        body = {**self.head, "choices": choices, "usage": usage_json(self.usage)}
        if self.api.return_token_ids and self.api.chat:
            body["prompt_token_ids"] = list(self.prompts[0])
        if self.api.prompt_logprobs is not None and self.api.chat:
            body["prompt_logprobs"] = self._prompt_logprobs(0)  # vLLM: the chat reply's own
        return body

    def _prompt_logprobs(self, prompt_index: int) -> list:
        return prompt_logprobs_json(self.prompt_logprobs.get(prompt_index, ()), self.token_text,
                                    self.api.prompt_logprobs)

    def _with_reasoning(self, message: dict, reasoning: str) -> dict:
        """The message with its `reasoning_content` (null when none, or not asked for) and no
        empty content (null, as vLLM gives it)."""
        return {"role": "assistant", "content": message.get("content") or None,
                "reasoning_content": (reasoning or None) if self.api.include_reasoning else None,
                **{k: v for k, v in message.items() if k not in ("role", "content")}}

    def _calls(self, text: str, finish: str | None) -> list[dict] | None:
        """The tool calls of a finished choice's whole text (None: not a call)."""
        if self.tools is None or finish != "stop":
            return None
        if self.tools.name is None:
            return required_calls(text, self.tools.ids)
        return [{"id": tool_call_id(self.tools.ids), "type": "function",
                 "function": {"name": self.tools.name, "arguments": text}}]

    def _parsed_message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """tool_choice "auto": the whole text split by the model's tool-call syntax."""
        parser = make_parser(self.tools.parser, self.tools.parallel,
                             self.tools.schemas)
        first, last = parser.feed(text), parser.finish()
        content = first.content + last.content
        calls = [{k: v for k, v in c.items() if k != "index"} for c in first.calls + last.calls]
        if not calls:
            return {"role": "assistant", "content": content}, finish
        return ({"role": "assistant", "content": content or None, "tool_calls": calls},
                "tool_calls" if finish == "stop" else finish)

    # ------------------------------------------------------------------ stream

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = {**self.head, "choices": choices}
        if self.api.continuous_usage:  # vLLM's: the counts so far on every chunk
            chunk["usage"] = {"prompt_tokens": self.prompt_tokens,
                              "completion_tokens": self.streamed_tokens,
                              "total_tokens": self.prompt_tokens + self.streamed_tokens}
        elif self.api.include_usage:
            chunk["usage"] = None
        return chunk

    def _echo(self, prompt_index: int) -> str:
        """The prompt as echo writes it: its text, or its token ids decoded."""
        req = self.api.requests[prompt_index]
        if req.WhichOneof("input") == "prompt":
            return req.prompt
        return self.token_text.decode(req.prompt_token_ids.ids)

    def _first_prompt_token(self, prompt_index: int) -> int:
        req = self.api.requests[prompt_index]
        if req.WhichOneof("input") == "prompt":
            add = req.add_special_tokens if req.HasField("add_special_tokens") else True
            return self.token_text.encode(req.prompt, add_special_tokens=add)[0]
        return req.prompt_token_ids.ids[0]

    def _echo_logprobs(self, prompt_index: int) -> dict:
        return echo_logprobs_json(self._first_prompt_token(prompt_index),
                                  self.prompt_logprobs.get(prompt_index, ()), self.token_text,
                                  self.api.logprobs)

    def first_chunks(self) -> list[dict]:
        """Chat: one chunk per choice whose delta carries the role. Completions with echo:
        one chunk per choice with its prompt."""
        if not self.api.chat:
            if not self.api.echo:
                return []
            chunks = []
            for i in range(self.num_choices):
                prefix = self._echo(i // self.api.n)
                self.offsets[i] = len(prefix)
                chunks.append(self._chunk([{"index": i, "text": prefix, "logprobs": None,
                                            "finish_reason": None, "stop_reason": None}]))
            return chunks
        chunks = [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}])
                  for i in range(self.num_choices)]
        if self.api.return_token_ids:  # vLLM's: the prompt's ids on the first chunk only
            chunks[0]["prompt_token_ids"] = list(self.prompts[0])
            for chunk in chunks:
                chunk["choices"][0]["token_ids"] = []
        return chunks

    def chunks(self, prompt_index: int, out: RequestOutput) -> list[dict]:
        out = self._shown(out)
        self.usage = add_usage(self.usage, out.usage)
        chunks = []
        for delta in out.deltas:
            if not (delta.text or delta.token_ids or delta.logprobs
                    or delta.finish_reason is not None):
                continue
            i = self._index(prompt_index, delta)
            self.sent_tokens = self.sent_tokens or bool(delta.token_ids)
            self.streamed_tokens += len(delta.token_ids)
            choice: dict = {"index": i}
            want_lp = self.api.logprobs is not None
            if self.api.chat:
                text, thought = self._reasoning_delta(i, delta)
                choice["delta"] = {"content": text} if text else {}
                if self.tools is not None:
                    choice["delta"] = self._tool_delta(i, text, delta.finish_reason)
                if thought:
                    choice["delta"] = {"reasoning_content": thought, **choice["delta"]}
                choice["logprobs"] = ({"content": chat_logprobs_json(delta.logprobs,
                                                                     self.token_text)}
                                      if want_lp and delta.logprobs else None)
            else:
                choice["text"] = delta.text
                offset = self.offsets.get(i, 0)
                choice["logprobs"] = (completion_logprobs_json(delta.logprobs, self.token_text,
                                                               offset)
                                      if want_lp and delta.logprobs else None)
                self.offsets[i] = offset + len(delta.text)
            choice["finish_reason"] = delta.finish_reason
            if (self.tools is not None and self.tools.name is None
                    and delta.finish_reason == "stop" and (
                        "tool_calls" in choice["delta"]
                        or (i in self.parsers and self.parsers[i].num_calls))):
                choice["finish_reason"] = "tool_calls"
            choice["stop_reason"] = (stop_reason(delta, self.stop_token_ids)
                                     if delta.finish_reason else None)
            if self.api.return_token_ids:
                self._stream_ids(choice, i, delta)
            if delta.finish_reason is not None:
                self.ended[i] = delta
            if self.tools is not None and not (choice["delta"] or choice["finish_reason"]
                                               or choice["logprobs"]):
                continue  # a held-back token of a "required" array
            chunks.append(self._chunk([choice]))
        return chunks

    def _stream_ids(self, choice: dict, i: int, delta: CompletionDelta) -> None:
        """return_token_ids in a stream: each chunk's own tokens; a completion's choice
        carries its prompt's ids on its first chunk (echo's included)."""
        choice["token_ids"] = list(delta.token_ids)
        if not self.api.chat and i not in self.ids_sent:
            self.ids_sent.add(i)
            choice["prompt_token_ids"] = list(self.prompts[i // self.api.n])

    def _reasoning_delta(self, i: int, delta: CompletionDelta) -> tuple[str, str]:
        """A streamed chat delta's (content text, reasoning text) under --reasoning-parser
        (all content without one; the reasoning empty when not asked for)."""
        if not self.api.reasoning:
            return delta.text, ""
        parser = self.reasoners.get(i)
        if parser is None:
            parser = self.reasoners[i] = make_reasoning_parser(self.api.reasoning)
        piece = parser.feed(delta.text)
        if delta.finish_reason is not None:
            last = parser.finish()
            piece.reasoning += last.reasoning
            piece.content += last.content
        return piece.content, piece.reasoning if self.api.include_reasoning else ""

    def _tool_delta(self, i: int, text: str, finish_reason: str | None) -> dict:
        """A streamed chat delta of a tool-calling choice (`text`: its content): a named call
        opens with its id and name and grows its arguments by each text; a "required" array
        is held back and goes out as its calls when the choice ends (or as content if it is
        not a whole array)."""
        if self.tools.parser:
            parser = self.parsers.get(i)
            if parser is None:
                parser = self.parsers[i] = make_parser(self.tools.parser, self.tools.parallel,
                                                       self.tools.schemas)
            piece = parser.feed(text)
            if finish_reason is not None:
                last = parser.finish()
                piece.content += last.content
                piece.calls += last.calls
            out: dict = {"content": piece.content} if piece.content else {}
            if piece.calls:
                out["tool_calls"] = piece.calls
            return out
        if self.tools.name is not None:
            if not text:
                return {}
            call: dict = {"index": 0, "function": {"arguments": text}}
            if i not in self.call_ids:
                self.call_ids[i] = tool_call_id(self.tools.ids)
                call = {"index": 0, "id": self.call_ids[i], "type": "function",
                        "function": {"name": self.tools.name, "arguments": text}}
            return {"tool_calls": [call]}
        held = self.text.setdefault(i, [])
        held.append(text)
        if finish_reason is None:
            return {}
        text = "".join(held)
        calls = required_calls(text, self.tools.ids) if finish_reason == "stop" else None
        if calls is None:
            return {"content": text} if text else {}
        return {"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]}

    def failure_chunks(self, error_event: dict) -> list[dict]:
        """After the stream started: `error_event` (the error object) when no token was
        sent, else an `abort` ending for every unfinished choice."""
        if not self.sent_tokens:
            return [error_event]
        chunks = []
        for i in range(self.num_choices):
            if i in self.ended:
                continue
            choice: dict = {"index": i, "finish_reason": "abort", "stop_reason": None,
                            "logprobs": None}
            if self.api.chat:
                choice["delta"] = {}
            else:
                choice["text"] = ""
            chunks.append(self._chunk([choice]))
        return chunks

    def closing_chunks(self) -> list[dict]:
        """What a stream sends after its last output: the usage when asked for."""
        return [self.usage_chunk()] if self.api.include_usage else []

    def usage_chunk(self) -> dict:
        return {**self.head, "choices": [], "usage": usage_json(self.usage)}


def _joined(prompt: dict, completion: dict) -> dict:
    """Two legacy logprobs objects, one after the other."""
    return {key: prompt[key] + completion[key] for key in prompt}


class WrappedChatWriter:
    """A writer of another API's shapes over the chat path (the Responses API, Anthropic's
    Messages API): it keeps the chat ChoiceWriter as `chat` and forwards what the HTTP edge
    gives every writer; its events go out named (`event: TYPE`), with no `[DONE]`."""

    sse_done = False
    sse_named = True

    def __init__(self, chat: ChoiceWriter) -> None:
        self.chat = chat

    @property
    def prompts(self) -> list:
        return self.chat.prompts

    @prompts.setter
    def prompts(self, value: list) -> None:
        self.chat.prompts = value

    @property
    def prompt_tokens(self) -> int:
        return self.chat.prompt_tokens

    def add(self, prompt_index: int, out: RequestOutput) -> None:
        self.chat.add(prompt_index, out)
