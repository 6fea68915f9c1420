"""OpenAI's Conversations API on the HTTP edge: a conversation is a list of items kept by
the server (router/response_store.py, beside the stored responses), which a Responses
request names (`conversation`) to be given those items first and to have its input and
output added to them once it has answered (responses_turns.py, http_responses.py).

    POST   /v1/conversations                  {"items": [...], "metadata": {...}}
                                              -> {"id": "conv_...", "object":
                                                  "conversation", "created_at", "metadata"}
    GET    /v1/conversations/{id}             the conversation
    POST   /v1/conversations/{id}             {"metadata": {...}}: replaced
    DELETE /v1/conversations/{id}             {"id", "object": "conversation.deleted",
                                               "deleted": true}
    GET    /v1/conversations/{id}/items       ?limit=&order=&after= (newest first)
    POST   /v1/conversations/{id}/items       {"items": [...]} -> the list added
    GET    /v1/conversations/{id}/items/{item_id}
    DELETE /v1/conversations/{id}/items/{item_id}  -> the conversation

Items are the Responses API's input items (messages, function calls and their outputs,
reasoning), each given an `id` when it has none. Metadata: at most 16 string pairs (keys
up to 64 characters, values up to 512), as OpenAI's. With `--responses-store-mb 0` there is
nowhere to keep them: every route is a 400 saying so.
"""

from __future__ import annotations

import time
import uuid

import msgspec
from aiohttp import web

from .errors import InvalidRequest, NotFound
from .http_errors import answered, dumps_json, error_response, read_json
from .http_responses import item_page
from .openai_fields import bad, json_type, metadata_of
from .response_store import CONVERSATION
from .responses_turns import input_items

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


def items_of(body: dict, required: bool) -> list[dict]:
    """A body's `items` as input items with ids (InvalidRequest naming `items[i]`)."""
    items = body.get("items")
    if items is None and not required:
        return []
    if not isinstance(items, list) or (required and not items):
        raise bad("items", f"must be a{' non-empty' if required else 'n'} array of items, "
                  f"got {json_type(items)}")
    if not items:
        return []
    try:
        return input_items(items)
    except InvalidRequest as exc:
        field = (exc.field or "").replace("input", "items", 1)
        raise InvalidRequest(str(exc).replace("input", "items", 1), field=field) from None


class ConversationRoutes:
    """The Conversations API's routes over the store (a ResponseStore, or an API worker's
    RemoteResponses)."""

    def __init__(self, store) -> None:
        self.store = store

    def add_routes(self, app: web.Application) -> None:
        on = self.store.enabled  # off: every route says why (--responses-store-mb 0)
        for method, path, handler in (
                ("POST", "/v1/conversations", self.create),
                ("GET", "/v1/conversations/{id}", self.retrieve),
                ("POST", "/v1/conversations/{id}", self.update),
                ("DELETE", "/v1/conversations/{id}", self.delete),
                ("GET", "/v1/conversations/{id}/items", self.list_items),
                ("POST", "/v1/conversations/{id}/items", self.add_items),
                ("GET", "/v1/conversations/{id}/items/{item_id}", self.get_item),
                ("DELETE", "/v1/conversations/{id}/items/{item_id}", self.delete_item)):
            app.router.add_route(method, path, handler if on else self.off)

    async def off(self, request: web.Request) -> web.Response:
        return error_response(InvalidRequest("this server keeps no conversations "
                                             "(--responses-store-mb 0)"))

    async def _record(self, conversation_id: str) -> dict:
        record = await self.store.get(conversation_id, CONVERSATION)
        if record is None:
            raise NotFound(f"no conversation has the id {conversation_id!r}",
                           field="conversation_id")
        return _decode(record)

    @answered
    async def create(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        conversation = {"id": f"conv_{uuid.uuid4().hex}", "object": "conversation",
                        "created_at": int(time.time()),
                        "metadata": metadata_of(body.get("metadata"))}
        record = _encode({"conversation": conversation, "items": items_of(body, False)})
        if not await self.store.put_conversation(conversation["id"], record):
            raise InvalidRequest("the conversation is larger than the whole store "
                                 "(--responses-store-mb)", field="items")
        return web.json_response(conversation, dumps=dumps_json)

    @answered
    async def retrieve(self, request: web.Request) -> web.Response:
        record = await self._record(request.match_info["id"])
        return web.json_response(record["conversation"], dumps=dumps_json)

    @answered
    async def update(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        if "metadata" not in body:
            raise bad("metadata", "is required")
        record = await self.store.edit_conversation(request.match_info["id"],
                                                    metadata=metadata_of(body["metadata"]))
        return web.json_response(_decode(record)["conversation"], dumps=dumps_json)

    @answered
    async def delete(self, request: web.Request) -> web.Response:
        conversation_id = request.match_info["id"]
        if not await self.store.delete(conversation_id, CONVERSATION):
            raise NotFound(f"no conversation has the id {conversation_id!r}",
                           field="conversation_id")
        return web.json_response({"id": conversation_id, "object": "conversation.deleted",
                                  "deleted": True})

    @answered
    async def list_items(self, request: web.Request) -> web.Response:
        record = await self._record(request.match_info["id"])
        return web.json_response(item_page(record["items"], request), dumps=dumps_json)

    @answered
    async def add_items(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        items = items_of(body, True)
        await self.store.edit_conversation(request.match_info["id"], append=items)
        return web.json_response({"object": "list", "data": items,
                                  "first_id": items[0]["id"], "last_id": items[-1]["id"],
                                  "has_more": False}, dumps=dumps_json)

    @answered
    async def get_item(self, request: web.Request) -> web.Response:
        record = await self._record(request.match_info["id"])
        item_id = request.match_info["item_id"]
        for item in record["items"]:
            if item.get("id") == item_id:
                return web.json_response(item, dumps=dumps_json)
        raise NotFound(f"conversation {request.match_info['id']!r} has no item {item_id!r}",
                       field="item_id")

    @answered
    async def delete_item(self, request: web.Request) -> web.Response:
        record = await self.store.edit_conversation(request.match_info["id"],
                                                    drop_item=request.match_info["item_id"])
        return web.json_response(_decode(record)["conversation"], dumps=dumps_json)
