"""Anthropic's Messages API (`POST /v1/messages`) over the chat path, for clients written
against it (the Anthropic SDKs, tools built on them) pointed at a local model: a body is
translated into the chat completions body it means (`chat_body`), run as a chat request,
and its reply or stream is written back in the Messages API's shapes (`MessagesWriter`,
wrapping the chat ChoiceWriter, as responses_api.py does for OpenAI's Responses API).

What maps to what:

* `system` (a string or text blocks) -> a system message first; `messages` (roles user and
  assistant; `content` a string or text blocks) -> `messages`. A conversation that ends
  with an assistant turn is continued from its text (the Messages API's prefill; chat's
  `continue_final_message`). Other block types (images, documents, tool_use, tool_result,
  thinking) and `tools` are a 400 naming the field: this route carries text.
* `max_tokens` (required, as the Messages API requires it), `stop_sequences` -> `stop`,
  `temperature`, `top_p`, `top_k`, `stream`; `metadata` is accepted and ignored.
* The reply: `content` holds a `thinking` block (with --reasoning-parser, when the model
  thought) and a `text` block; `stop_reason` is `end_turn`, `max_tokens`, `stop_sequence`
  (with `stop_sequence` the string that matched) or `pause_turn` for a request the server
  ended early (a drain, no executor left: send the conversation with the partial answer
  to go on); `usage` counts `input_tokens` apart from `cache_read_input_tokens` (the
  prompt tokens the prefix cache served), as the Messages API does.
* Streamed: `message_start`, each block's `content_block_start`, `content_block_delta`
  (`thinking_delta` / `text_delta`) and `content_block_stop`, then `message_delta` (stop
  reason, output tokens) and `message_stop`, each as `event: TYPE` + `data: JSON`; a
  failure once the stream started is an `error` event.
* Errors are the Messages API's: `{"type": "error", "error": {"type", "message"}}`.
  The API key may come as `x-api-key` (what its SDKs send) as well as a bearer token.
"""

from __future__ import annotations

from typing import Any

from .errors import InvalidRequest
from .openai_fields import bad, json_type
from .openai_responses import ChoiceWriter, WrappedChatWriter
from .types import RequestOutput

_SAME = ("temperature", "top_p", "top_k", "stream")
_REFUSED = {"tools": "tools are not supported on /v1/messages (use /v1/chat/completions)",
            "tool_choice": "tools are not supported on /v1/messages",
            "thinking": "extended thinking settings are not supported (a thinking model "
                        "thinks as its template says; --reasoning-parser splits it out)"}
_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403:
               "permission_error", 404: "not_found_error", 409: "invalid_request_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def chat_body(body: dict) -> dict:
    """The chat completions body a Messages API body means (module docstring); 400s name
    the Messages field."""
    for key, why in _REFUSED.items():
        if body.get(key) is not None:
            raise bad(key, why)
    if body.get("max_tokens") is None:
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
        messages.append({"role": role, "content": _text(turn.get("content"),
                                                        f"{where}.content")})
    chat = {"messages": messages, "max_tokens": body["max_tokens"]}
    if turns[-1].get("role") == "assistant":  # prefill: continue the assistant's text
        chat.update(continue_final_message=True, add_generation_prompt=False)
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


def _stop_reason(finish: str | None, stop: Any) -> tuple[str, str | None]:
    if finish == "length":
        return "max_tokens", None
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


class MessagesWriter(WrappedChatWriter):
    """A Message (unary) or the Messages stream's events, from the chat path's outputs;
    the same calls as ChoiceWriter, so the HTTP edge runs both alike."""

    def __init__(self, chat: ChoiceWriter, message_id: str, model: str) -> None:
        super().__init__(chat)
        self.base = {"id": message_id, "type": "message", "role": "assistant",
                     "model": model, "content": [], "stop_reason": None,
                     "stop_sequence": None}
        self.open: str | None = None  # "thinking" or "text": the block being streamed
        self.index = -1
        self.finish: str | None = None
        self.stop: Any = None
        self.usage: dict | None = None
        self.failed = False

    # ------------------------------------------------------------------ unary

    def response(self) -> dict:
        reply = self.chat.response()
        choice = reply["choices"][0]
        message = choice["message"]
        content = []
        if message.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": message["reasoning_content"],
                            "signature": ""})
        content.append({"type": "text", "text": message.get("content") or ""})
        stop_reason, stop_sequence = _stop_reason(choice["finish_reason"],
                                                  choice.get("stop_reason"))
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
        stop_reason, stop_sequence = _stop_reason(self.finish, self.stop)
        usage = _usage(self.usage)
        return events + [
            {"type": "message_delta", "delta": {"stop_reason": stop_reason,
                                                "stop_sequence": stop_sequence},
             "usage": {"output_tokens": usage["output_tokens"]}},
            {"type": "message_stop"}]
