"""Anthropic's Messages API (`POST /v1/messages`) over the chat path, for clients written
against it (the Anthropic SDKs, tools built on them) pointed at a local model: a body is
translated into the chat completions body it means (`chat_body`), run as a chat request,
and its reply or stream is written back in the Messages API's shapes (`MessagesWriter`,
wrapping the chat ChoiceWriter, as responses_api.py does for OpenAI's Responses API).

What maps to what:

* `system` (a string or text blocks) -> a system message first; `messages` (roles user and
  assistant; `content` a string or blocks) -> `messages`: text blocks are the turn's text,
  an assistant turn's `tool_use` blocks its tool calls (`input` as the arguments' JSON), a
  user turn's `tool_result` blocks one tool message each (its text: a string or text
  blocks; `is_error` has no place in a chat template), before the turn's text; an earlier
  turn's `thinking` blocks are dropped (templates drop earlier reasoning). A conversation
  that ends with an assistant turn of text is continued from it (the Messages API's
  prefill; chat's `continue_final_message`). Other block types (images, documents) are a
  400 naming the block.
* `tools` (custom tools: `name`, `description`, `input_schema`) -> chat's function tools;
  `tool_choice` `auto` / `any` / `tool` (`name`) / `none` -> chat's `auto` / `required` /
  the named function / `none`, `disable_parallel_tool_use` -> `parallel_tool_calls`
  false. Server tools (`type` other than `custom`) are a 400. As on chat, `auto` (the
  default with tools) needs --tool-call-parser.
* `thinking` `{"type": "enabled"}` / `{"type": "disabled"}` -> the chat template's
  `enable_thinking` (a thinking model's switch, e.g. Qwen3's; `budget_tokens` is not
  enforced).
* `max_tokens` (required, as the Messages API requires it), `stop_sequences` -> `stop`,
  `temperature`, `top_p`, `top_k`, `stream`; `metadata` is accepted and ignored.
* The reply: `content` holds a `thinking` block (with --reasoning-parser, when the model
  thought), a `text` block (left out when the model only called tools) and a `tool_use`
  block a call (`id`, `name`, `input`); `stop_reason` is `end_turn`, `tool_use`,
  `max_tokens`, `stop_sequence` (with `stop_sequence` the string that matched) or
  `pause_turn` for a request the server ended early (a drain, no executor left: send the
  conversation with the partial answer to go on); `usage` counts `input_tokens` apart from
  `cache_read_input_tokens` (the prompt tokens the prefix cache served), as the Messages
  API does.
* Streamed: `message_start`, each block's `content_block_start`, `content_block_delta`
  (`thinking_delta` / `text_delta` / a tool call's `input_json_delta`: its arguments' JSON
  as it comes) and `content_block_stop`, then `message_delta` (stop reason, output tokens)
  and `message_stop`, each as `event: TYPE` + `data: JSON`; a failure once the stream
  started is an `error` event.
* `POST /v1/messages/count_tokens` (the same body without `max_tokens`): `{"input_tokens"}`,
  the prompt's tokens as the request would be given them (tools included).
* Errors are the Messages API's: `{"type": "error", "error": {"type", "message"}}`.
  The API key may come as `x-api-key` (what its SDKs send) as well as a bearer token.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import InvalidRequest
from .openai_fields import bad, json_type
from .openai_responses import ChoiceWriter, WrappedChatWriter
from .types import RequestOutput

_SAME = ("temperature", "top_p", "top_k", "stream")
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403:
               "permission_error", 404: "not_found_error", 409: "invalid_request_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def chat_body(body: dict, counting: bool = False) -> dict:
    """The chat completions body a Messages API body means (module docstring); 400s name
    the Messages field. `counting`: a count_tokens body (no max_tokens)."""
    if body.get("max_tokens") is None and not counting:
        raise bad("max_tokens", "is required")
    messages = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _text(system, "system")})
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise bad("messages", "must be a non-empty array of messages")
    for i, turn in enumerate(turns):
        where = f"messages[{i}]"
        if not isinstance(turn, dict):
            raise bad(where, f"must be an object, got {json_type(turn)}")
        role = turn.get("role")
        if role not in ("user", "assistant"):
            raise bad(f"{where}.role", f"must be user or assistant, got {role!r}")
        messages += _turn(role, turn.get("content"), f"{where}.content")
    chat: dict[str, Any] = {"messages": messages}
    if not counting:
        chat["max_tokens"] = body["max_tokens"]
    if turns[-1].get("role") == "assistant":  # prefill: continue the assistant's text
        if messages[-1].get("tool_calls"):
            raise bad(f"messages[{len(turns) - 1}]", "a conversation may end with an "
                      "assistant turn of text only (a prefill to continue)")
        chat.update(continue_final_message=True, add_generation_prompt=False)
    _tools(body, chat)
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled"):
            raise bad("thinking.type", f"must be enabled or disabled, got {kind!r}")
        chat["chat_template_kwargs"] = {"enable_thinking": kind == "enabled"}
    for key in _SAME:
        if key in body:
            chat[key] = body[key]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    if body.get("stream"):  # message_delta's usage comes from the chat stream's last chunk
        chat["stream_options"] = {"include_usage": True}
    return chat


_FIELD_OF = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens"}


def messages_field(exc: InvalidRequest) -> InvalidRequest:
    """A chat-path error renamed to the Messages field the client sent (`stop` ->
    `stop_sequences`)."""
    new = _FIELD_OF.get(exc.field or "")
    if new is None:
        return exc
    return InvalidRequest(str(exc).replace(exc.field, new, 1), field=new)


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {
        "type": _ERROR_TYPE.get(status, "api_error" if status >= 500 else
                                "invalid_request_error"), "message": message}}


def _turn(role: str, content: Any, field: str) -> list[dict]:
    """A Messages turn as chat messages: a user turn's tool results (one tool message
    each) then its text; an assistant turn's text and tool calls in one message."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad(field, f"must be a string or an array of content blocks, got "
                         f"{json_type(content)}")
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        where = f"{field}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise bad(f"{where}.text", f"must be a string, got {json_type(block.get('text'))}")
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            arguments = block.get("input")
            if not isinstance(arguments, dict):
                raise bad(f"{where}.input", f"must be an object, got {json_type(arguments)}")
            calls.append({"id": _string(block, "id", where), "type": "function", "function": {
                "name": _string(block, "name", where),
                "arguments": json.dumps(arguments, ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            output = block.get("content", "")
            results.append({"role": "tool", "tool_call_id": _string(block, "tool_use_id", where),
                            "content": _text(output, f"{where}.content")})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        else:
            raise bad(f"{where}.type", f"block type {kind!r} is not supported in a {role} "
                      "turn (text; tool_use in assistant turns, tool_result in user turns)")
    if role == "user":
        return results + ([{"role": "user", "content": "\n".join(texts)}]
                          if texts or not results else [])
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
        message["content"] = message["content"] or None
    return [message]


def _string(block: dict, key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str) or not value:
        raise bad(f"{where}.{key}", f"must be a non-empty string, got {json_type(value)}")
    return value


def _tools(body: dict, chat: dict) -> None:
    """`tools` and `tool_choice` as chat's."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools", f"must be an array of tools, got {json_type(tools)}")
        chat["tools"] = []
        for i, tool in enumerate(tools):
            kind = tool.get("type", "custom") if isinstance(tool, dict) else None
            if kind != "custom":
                raise bad(f"tools[{i}].type", f"tool type {kind!r} is not supported (custom "
                          "tools: name, description, input_schema)")
            function = {"name": _string(tool, "name", f"tools[{i}]"),
                        "parameters": tool.get("input_schema") or {"type": "object"}}
            if tool.get("description") is not None:
                function["description"] = tool["description"]
            chat["tools"].append({"type": "function", "function": function})
    choice = body.get("tool_choice")
    if choice is None:
        return
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool":
        chat["tool_choice"] = {"type": "function",
                               "function": {"name": _string(choice, "name", "tool_choice")}}
    elif kind in _TOOL_CHOICES:
        chat["tool_choice"] = _TOOL_CHOICES[kind]
    else:
        raise bad("tool_choice.type", f"must be auto, any, tool or none, got {kind!r}")
    if choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False


def _text(content: Any, field: str) -> str:
    """A string, or text blocks joined (other block types refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(field, f"must be a string or an array of content blocks, got "
                         f"{json_type(content)}")
    texts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise bad(f"{field}[{j}].type", f"only text blocks are supported, got {kind!r}")
        texts.append(block["text"])
    return "\n".join(texts)


def _stop_reason(finish: str | None, stop: Any, called: bool) -> tuple[str, str | None]:
    """The Messages stop reason of a chat finish (`called`: the reply has tool_use blocks;
    a named tool's call finishes "stop" on chat, as OpenAI's does)."""
    if finish == "length":
        return "max_tokens", None
    if finish == "tool_calls" or called and finish == "stop":
        return "tool_use", None
    if finish == "abort":
        return "pause_turn", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def _usage(usage: dict | None) -> dict:
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": usage.get("prompt_tokens", 0) - cached,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": usage.get("completion_tokens", 0)}


def _tool_use(call_id: str, name: str, arguments: str) -> dict:
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:  # a call cut by max_tokens: its text as it stands
        value = {"_partial_arguments": arguments}
    return {"type": "tool_use", "id": call_id, "name": name,
            "input": value if isinstance(value, dict) else {"value": value}}


class MessagesWriter(WrappedChatWriter):
    """A Message (unary) or the Messages stream's events, from the chat path's outputs;
    the same calls as ChoiceWriter, so the HTTP edge runs both alike."""

    def __init__(self, chat: ChoiceWriter, message_id: str, model: str) -> None:
        super().__init__(chat)
        self.base = {"id": message_id, "type": "message", "role": "assistant",
                     "model": model, "content": [], "stop_reason": None,
                     "stop_sequence": None}
        self.open: str | None = None  # "thinking", "text" or "callN": the block streamed
        self.index = -1
        self.finish: str | None = None
        self.stop: Any = None
        self.usage: dict | None = None
        self.failed = False
        self.called = False  # a tool_use block was streamed

    # ------------------------------------------------------------------ unary

    def response(self) -> dict:
        reply = self.chat.response()
        choice = reply["choices"][0]
        message = choice["message"]
        content = []
        if message.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": message["reasoning_content"],
                            "signature": ""})
        calls = message.get("tool_calls") or []
        if message.get("content") or not calls:
            content.append({"type": "text", "text": message.get("content") or ""})
        content += [_tool_use(call["id"], call["function"]["name"],
                              call["function"]["arguments"]) for call in calls]
        stop_reason, stop_sequence = _stop_reason(choice["finish_reason"],
                                                  choice.get("stop_reason"), bool(calls))
        return {**self.base, "content": content, "stop_reason": stop_reason,
                "stop_sequence": stop_sequence, "usage": _usage(reply.get("usage"))}

    # ------------------------------------------------------------------ stream

    def first_chunks(self) -> list[dict]:
        usage = {"input_tokens": self.prompt_tokens, "output_tokens": 0}
        return [{"type": "message_start", "message": {**self.base, "usage": usage}}]

    def chunks(self, prompt_index: int, out: RequestOutput) -> list[dict]:
        events: list[dict] = []
        for chunk in self.chat.chunks(prompt_index, out):
            if chunk.get("usage"):
                self.usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if delta.get("reasoning_content"):
                    events += self._delta("thinking", delta["reasoning_content"])
                if delta.get("content"):
                    events += self._delta("text", delta["content"])
                for call in delta.get("tool_calls") or ():
                    events += self._call(call)
                if choice.get("finish_reason") is not None:
                    self.finish, self.stop = choice["finish_reason"], choice.get("stop_reason")
        return events

    def _delta(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open != kind:
            events += self._close()
            self.open, self.index = kind, self.index + 1
            block = {"type": "thinking", "thinking": "", "signature": ""} \
                if kind == "thinking" else {"type": "text", "text": ""}
            events.append({"type": "content_block_start", "index": self.index,
                           "content_block": block})
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" \
            else {"type": "text_delta", "text": text}
        events.append({"type": "content_block_delta", "index": self.index, "delta": delta})
        return events

    def _call(self, call: dict) -> list[dict]:
        """A chat tool-call delta: a new call opens a tool_use block (closing the block
        before it); its arguments' pieces are input_json_deltas."""
        events = []
        if self.open != f"call{call['index']}":
            events += self._close()
            self.open, self.index = f"call{call['index']}", self.index + 1
            self.called = True
            block = {"type": "tool_use", "id": call.get("id", ""),
                     "name": call["function"].get("name", ""), "input": {}}
            events.append({"type": "content_block_start", "index": self.index,
                           "content_block": block})
        piece = call["function"].get("arguments") or ""
        if piece:
            events.append({"type": "content_block_delta", "index": self.index,
                           "delta": {"type": "input_json_delta", "partial_json": piece}})
        return events

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]

    def failure_chunks(self, error_event: dict) -> list[dict]:
        """After the stream started: the error as an `error` event."""
        error = error_event.get("error") or {}
        self.failed = True
        return [{"type": "error", "error": {"type": "api_error",
                                            "message": error.get("message", "")}}]

    def closing_chunks(self) -> list[dict]:
        if self.failed:  # the error event ended it
            return []
        for chunk in self.chat.closing_chunks():  # the usage chunk (include_usage)
            if chunk.get("usage"):
                self.usage = chunk["usage"]
        if self.index < 0:  # nothing was written: an empty text block, as a reply has
            events = self._delta("text", "")[:1]
        else:
            events = []
        events += self._close()
        stop_reason, stop_sequence = _stop_reason(self.finish, self.stop, self.called)
        usage = _usage(self.usage)
        return events + [
            {"type": "message_delta", "delta": {"stop_reason": stop_reason,
                                                "stop_sequence": stop_sequence},
             "usage": {"output_tokens": usage["output_tokens"]}},
            {"type": "message_stop"}]
