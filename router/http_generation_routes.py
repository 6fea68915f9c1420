"""The HTTP edge's generation routes (http_server.OpenAIApp.generate runs them all): each
route's reply id prefix and, for an API served over the chat path (OpenAI's Responses API,
Anthropic's Messages API), its body's chat form, its fields' names in errors, its writer
and its errors' shape."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from .anthropic_messages import MessagesWriter, error_body, messages_field
from .anthropic_messages import chat_body as messages_body
from .errors import InvalidRequest
from .http_errors import error_for, error_response
from .responses_api import ResponsesWriter, chat_body, response_field


def messages_error_response(exc: BaseException) -> web.Response:
    """An error in the Messages API's shape."""
    status, body = error_for(exc)
    return web.json_response(error_body(status, body["error"]["message"]), status=status)


@dataclass(frozen=True)
class GenerationRoute:
    """A generation route: its reply ids' prefix and, for an API run over the chat path
    (the Responses API, Anthropic's Messages API), its body's chat form, its fields' names
    in errors, its writer (wrapping the chat writer) and its errors' shape."""

    prefix: str
    to_chat: Callable[[dict], dict] | None = None
    renamed: Callable[[InvalidRequest], InvalidRequest] = lambda exc: exc
    writer: Callable | None = None  # (body, chat writer, id, created, model) -> writer
    error_response: Callable[[BaseException], web.Response] = error_response


ROUTES = {
    "completions": GenerationRoute("cmpl-"),
    "chat": GenerationRoute("chatcmpl-"),
    "responses": GenerationRoute("resp_", chat_body, response_field, ResponsesWriter),
    "messages": GenerationRoute("msg_", messages_body, messages_field,
                                lambda body, chat, rid, created, model:
                                MessagesWriter(chat, rid, model), messages_error_response),
}
