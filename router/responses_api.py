"""OpenAI's Responses API (`POST /v1/responses`) over the chat path: a body is translated into
the chat completions body it means (chat_body), run as a chat request, and its chat reply or
chat chunks are written back as a Response object or as the Responses stream's typed events
(ResponsesWriter, which wraps the chat ChoiceWriter).

What maps to what:

* `input` (a string: one user turn; or a list of items) and `instructions` (a system turn
  first) -> `messages`. Items: messages (`role` user / system / developer / assistant,
  `content` a string or `input_text` / `output_text` parts), `function_call` (an assistant
  turn's tool call; consecutive calls join one turn), `function_call_output` (a tool turn),
  `reasoning` (dropped, as templates drop earlier turns' reasoning). Other item and part
  types (images, files, built-in tools' items) are a 400 naming the item.
* `max_output_tokens` -> `max_completion_tokens`; `text.format` (text, json_object,
  json_schema) -> `response_format`; `tools` (flat function definitions) and `tool_choice`
  (`{"type": "function", "name"}` for a named one) -> chat's nested forms;
  `temperature`, `top_p`, `parallel_tool_calls`, `stream`, `user` and vLLM's sampling
  extras as they are. `include: ["message.output_text.logprobs"]` or `top_logprobs` ->
  chat's logprobs: the message's output_text part carries every output token's scores
  (a reasoning's tokens' too: chat scores tokens, not items), streamed on the text deltas.
* `store` (default true), `previous_response_id`, `conversation` and `background` are the
  stored responses' and conversations' (responses_turns.py, http_responses.py,
  http_conversations.py: a turn's history is resolved before this translation);
  `metadata` is echoed.

The output items, in order: a `reasoning` item (with --reasoning-parser, when the model
thought), a `message` with one `output_text` part (when it wrote text), one `function_call`
per tool call. `status` is "completed", or "incomplete" with `incomplete_details.reason`
"max_output_tokens" when the length cut it. Streamed: `response.created`,
`response.in_progress`, then each item's `output_item.added`, its deltas
(`reasoning_text.delta`, `output_text.delta`, `function_call_arguments.delta`: a named
call's arguments as they are generated, a parsed or required call's whole) and `.done`
events, and
`response.completed` (or `response.incomplete`) with the whole Response; every event has
a `type` and a `sequence_number`, and goes out as `event: TYPE` + `data: JSON`.
"""

from __future__ import annotations

import uuid
from typing import Any

from .errors import InvalidRequest
from .openai_fields import bad, json_type, optional_bool, optional_str
from .openai_responses import ChoiceWriter, WrappedChatWriter
from .types import RequestOutput

# chat body field -> the Responses field a client sent it as (for errors naming the field)
_FIELD_OF = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
             "response_format": "text.format", "messages": "input", "logprobs": "top_logprobs"}
# passed to the chat body as they are
_SAME = ("temperature", "top_p", "parallel_tool_calls", "stream", "user", "seed", "top_k",
         "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "ignore_eos",
         "min_tokens", "priority", "cache_salt", "chat_template_kwargs", "include_reasoning",
         "skip_special_tokens", "stop_token_ids")


def response_field(exc: InvalidRequest) -> InvalidRequest:
    """A chat-path error renamed to the Responses field the client sent (`messages[2]` ->
    `input[2]`, `max_completion_tokens` -> `max_output_tokens`)."""
    field = exc.field or ""
    head, dot, rest = field.partition(".")
    base, bracket, index = head.partition("[")
    renamed = _FIELD_OF.get(base)
    if renamed is None:
        return exc
    new = renamed + bracket + index + dot + rest
    message = str(exc)
    if message.startswith(field):
        message = new + message[len(field):]
    if base in ("max_tokens", "max_completion_tokens"):  # the length check names it too
        message = message.replace(f"+ {base} (", f"+ {renamed} (")
    return InvalidRequest(message, field=new)


def chat_body(body: dict) -> dict:
    """The chat completions body a Responses body means (raises InvalidRequest naming the
    Responses field)."""
    optional_bool(body, "store")
    optional_bool(body, "background")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad("metadata", f"must be an object, got {json_type(metadata)}")
    chat: dict[str, Any] = {key: body[key] for key in _SAME if key in body}
    if "model" in body:
        chat["model"] = body["model"]
    messages: list[dict] = []
    instructions = optional_str(body, "instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    messages += input_messages(body.get("input"))
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    fmt = _text_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    include = body.get("include")
    if include is not None and not (isinstance(include, list)
                                    and all(isinstance(x, str) for x in include)):
        raise bad("include", f"must be an array of strings, got {json_type(include)}")
    top = body.get("top_logprobs")
    if "message.output_text.logprobs" in (include or ()) or top is not None:
        chat["logprobs"] = True
        if top is not None:
            chat["top_logprobs"] = top
    tools = body.get("tools")
    if tools is not None:
        chat["tools"] = _tools(tools)
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"] = _tool_choice(choice)
    return chat


def input_messages(value: Any) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad("input", "must be a string or a non-empty array of input items")
    messages: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(where, "must be an object (a message or a function call item)")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or not role:
                raise bad(f"{where}.role", "is required (a string)")
            messages.append({"role": role, "content": _content(where, item.get("content"))})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where),
                                 "arguments": _string(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                # the text and calls of one response, parallel calls: one assistant turn
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                raise bad(f"{where}.output", f"must be a string, got {json_type(output)}")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": output})
        elif kind == "reasoning":
            continue  # an earlier turn's reasoning: templates leave it out
        else:
            raise bad(f"{where}.type", f"input item type {kind!r} is not supported (message, "
                      "function_call, function_call_output, reasoning)")
    if not messages:
        raise bad("input", "holds no message")
    return messages


def _content(where: str, content: Any) -> str | list[dict]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}.content", f"must be a string or an array of text parts, got "
                  f"{json_type(content)}")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise bad(f"{where}.content[{j}].type", f"content part type {kind!r} is not "
                      "supported (only input_text and output_text)")
        text = part.get("text")
        if not isinstance(text, str):
            raise bad(f"{where}.content[{j}].text", "must be a string")
        parts.append({"type": "text", "text": text})
    return parts


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad(f"{where}.{key}", f"must be a string, got {json_type(value)}")
    return value


def _text_format(text: Any) -> dict | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad("text", f"must be an object, got {json_type(text)}")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad("text.format", f"must be an object, got {json_type(fmt)}")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise bad("text.format.type", f"must be text, json_object or json_schema, got {kind!r}")


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise bad("tools", f"must be an array of tools, got {json_type(tools)}")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad(f"tools[{i}].type", f"tool type {kind!r} is not supported (only "
                      "function)")
        out.append({"type": "function", "function": {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice  # "auto", "none", "required", or what chat rejects naming tool_choice


# --------------------------------------------------------------------------- replies


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(usage: dict | None) -> dict | None:
    if usage is None:
        return None
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens":
                                     usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def _message_item(item_id: str, text: str, logprobs: list, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": logprobs}]}


def _reasoning_item(item_id: str, text: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(call: dict, status: str = "completed") -> dict:
    return {"type": "function_call", "id": _new_id("fc"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": status}


class ResponsesWriter(WrappedChatWriter):
    """A Response (unary) or the Responses stream's events, from the chat path's outputs;
    the same calls as ChoiceWriter, so the HTTP edge runs both alike."""

    def __init__(self, body: dict, chat: ChoiceWriter, response_id: str, created: int,
                 model: str):
        super().__init__(chat)
        self.base = {
            "id": response_id, "object": "response", "created_at": created, "model": model,
            "status": "in_progress", "error": None, "incomplete_details": None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "truncation": body.get("truncation") or "disabled",
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "metadata": body.get("metadata") or {}, "store": body.get("store") is True,
            "background": body.get("background") is True,
            "previous_response_id": body.get("previous_response_id"),
            "conversation": body.get("conversation"), "output": [],
            "usage": None}
        self.seq = 0
        self.open: str | None = None  # the item being streamed: reasoning, message or call
        self.items: list[dict] = []  # the stream's closed items, in order
        self.text = {"reasoning": "", "message": ""}
        self.item_id = ""
        self.call: dict = {}  # the tool call being streamed (chat's form, with its index)
        self.scored: list[dict] = []  # logprobs of tokens not yet on a text delta
        self.message_scores: list[dict] = []  # logprobs the message's deltas carried
        self.finish: str | None = None
        self.failed = False
        self.final: dict | None = None  # the finished Response (completed, incomplete, failed)

    # ------------------------------------------------------------------ unary

    def response(self) -> dict:
        reply = self.chat.response()
        choice = reply["choices"][0]
        message = choice["message"]
        output = []
        if message.get("reasoning_content"):
            output.append(_reasoning_item(_new_id("rs"), message["reasoning_content"]))
        if message.get("content"):
            scored = (choice.get("logprobs") or {}).get("content") or []
            output.append(_message_item(_new_id("msg"), message["content"], scored))
        output += [_call_item(c) for c in message.get("tool_calls") or []]
        return self._finished(output, choice["finish_reason"], reply["usage"])

    def _finished(self, output: list[dict], finish: str | None, usage: dict | None) -> dict:
        cut = finish == "length"
        self.final = {**self.base, "status": "incomplete" if cut else "completed",
                      "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                      "output": output, "usage": _usage(usage)}
        return self.final

    # ------------------------------------------------------------------ stream

    def _event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def first_chunks(self) -> list[dict]:
        return [self._event("response.created", response=self.base),
                self._event("response.in_progress", response=self.base)]

    def chunks(self, prompt_index: int, out: RequestOutput) -> list[dict]:
        events: list[dict] = []
        for chunk in self.chat.chunks(prompt_index, out):
            choice = chunk["choices"][0]
            delta = choice.get("delta") or {}
            self.scored += (choice.get("logprobs") or {}).get("content") or []
            if delta.get("reasoning_content"):
                events += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            if choice.get("finish_reason") is not None:
                self.finish = choice["finish_reason"]
        return events

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open != kind:
            events += self._close()
            self.open, self.text[kind] = kind, ""
            self.item_id = _new_id("rs" if kind == "reasoning" else "msg")
            item = ({"type": "reasoning", "id": self.item_id, "summary": [], "content": []}
                    if kind == "reasoning" else
                    {"type": "message", "id": self.item_id, "status": "in_progress",
                     "role": "assistant", "content": []})
            part = ({"type": "reasoning_text", "text": ""} if kind == "reasoning" else
                    {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            events += [self._event("response.output_item.added", output_index=len(self.items),
                                   item=item),
                       self._event("response.content_part.added", item_id=self.item_id,
                                   output_index=len(self.items), content_index=0, part=part)]
        self.text[kind] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else \
            "response.output_text.delta"
        extra = {}
        if kind == "message":  # the tokens scored since the last text delta (reasoning's too)
            extra["logprobs"], self.scored = self.scored, []
            self.message_scores += extra["logprobs"]
        events.append(self._event(name, item_id=self.item_id, output_index=len(self.items),
                                  content_index=0, delta=text, **extra))
        return events

    def _call(self, call: dict) -> list[dict]:
        """A chat tool-call delta: a new index opens a function_call item (closing the item
        before it), every piece of arguments is a delta of the open one (a named call's grow
        chunk by chunk; a parsed or required call comes whole)."""
        events = []
        if self.open != "call" or self.call["index"] != call["index"]:
            events += self._close()
            self.open, self.item_id = "call", _new_id("fc")
            self.call = {"index": call["index"], "id": call.get("id", ""), "function": {
                "name": call["function"].get("name", ""), "arguments": ""}}
            item = {**_call_item(self.call, status="in_progress"), "id": self.item_id}
            events.append(self._event("response.output_item.added",
                                      output_index=len(self.items), item=item))
        piece = call["function"].get("arguments", "")
        if piece:
            self.call["function"]["arguments"] += piece
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=self.item_id, output_index=len(self.items),
                                      delta=piece))
        return events

    def _close(self) -> list[dict]:
        """The `.done` events of the item being streamed."""
        if self.open is None:
            return []
        if self.open == "call":
            self.open, index = None, len(self.items)
            item = {**_call_item(self.call), "id": self.item_id}
            self.items.append(item)
            return [self._event("response.function_call_arguments.done", item_id=self.item_id,
                                output_index=index, arguments=item["arguments"]),
                    self._event("response.output_item.done", output_index=index, item=item)]
        kind, text, index = self.open, self.text[self.open], len(self.items)
        self.open = None
        if kind == "reasoning":
            item = _reasoning_item(self.item_id, text)
            done = self._event("response.reasoning_text.done", item_id=self.item_id,
                               output_index=index, content_index=0, text=text)
        else:
            item = _message_item(self.item_id, text, self.message_scores)
            done = self._event("response.output_text.done", item_id=self.item_id,
                               output_index=index, content_index=0, text=text,
                               logprobs=self.message_scores)
        self.items.append(item)
        return [done,
                self._event("response.content_part.done", item_id=self.item_id,
                            output_index=index, content_index=0, part=item["content"][0]),
                self._event("response.output_item.done", output_index=index, item=item)]

    def failure_chunks(self, error_event: dict) -> list[dict]:
        """The stream's end when the request failed after it started."""
        self.failed = True
        err = error_event["error"]
        failed = self.final = {**self.base, "status": "failed", "output": self.items,
                               "error": {"code": err.get("code"), "message": err["message"]}}
        return [self._event("error", code=err.get("code"), message=err["message"],
                            param=err.get("param")),
                self._event("response.failed", response=failed)]

    def closing_chunks(self) -> list[dict]:
        """The open item's end and the whole Response."""
        if self.failed:
            return []
        events = self._close()
        final = self._finished(self.items, self.finish,
                               self.chat.usage_chunk()["usage"])
        kind = "response.incomplete" if final["status"] == "incomplete" else \
            "response.completed"
        events.append(self._event(kind, response=final))
        return events
