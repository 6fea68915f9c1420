"""Stored and background Responses on the HTTP edge (router/response_store.py keeps them,
responses_turns.py makes a request a turn of its conversation).

    POST   /v1/responses {..., "store": true}     the Response, stored once it has answered
                                                 (the default; store: false keeps nothing)
    POST   /v1/responses {..., "previous_response_id": ID}
                                                 continues that response's conversation
    POST   /v1/responses {..., "background": true} the Response at once, status "queued"; it
                                                 runs on without the client (read it with
                                                 GET); with stream: true its events, which
                                                 a client may leave and read again
    GET    /v1/responses/{id}                    the stored Response (a background one as it
                                                 stands: queued, in_progress, then finished)
    GET    /v1/responses/{id}?stream=true&starting_after=N
                                                 a background stream's events after
                                                 sequence number N, then the live ones
    GET    /v1/responses/{id}/input_items?limit=&order=&after=
                                                 the conversation the model was given
    POST   /v1/responses/{id}/cancel             a background response stopped: "cancelled"
    DELETE /v1/responses/{id}                    {"id", "object": "response", "deleted": true}

A background response runs in the process that took it (a task of its own: the client's
connection can go), writing its record to the store as it goes (queued, in_progress, the
finished Response) and, when streamed, every event. Its requests are the engine's as any
other's: a cancel (through any API worker) aborts them and frees their blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack

from aiohttp import web

from .errors import AlreadyExists, InvalidRequest, NotFound, PagedServeError
from .http_errors import answered, dumps_json, encode_json, error_for, query_int
from .http_streams import merge_sessions, sse_frames
from .responses_api import response_field
from .responses_turns import (
    ResponseTurn,
    resolve_turn,
    stored_input_items,
    stored_response,
)

log = logging.getLogger(__name__)

EVENTS_WAIT_S = 10.0  # a stream reader's wait for the next events (then it asks again)
MAX_ITEMS_LIMIT = 100  # input_items' `limit`, as OpenAI's

# (exit stack) -> the request's sessions, entered on the stack
OpenSessions = Callable[[AsyncExitStack], Awaitable[list]]


class ResponsesRoutes:
    """The stored Responses' routes and the background runs of this process."""

    def __init__(self, store) -> None:
        self.store = store  # a ResponseStore, or RemoteResponses in an API worker
        self._tasks: dict[str, asyncio.Task] = {}  # background responses running here

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/responses/{id}", self.retrieve)
        app.router.add_delete("/v1/responses/{id}", self.delete)
        app.router.add_post("/v1/responses/{id}/cancel", self.cancel)
        app.router.add_get("/v1/responses/{id}/input_items", self.list_input_items)

    async def stop(self) -> None:
        """Cancel the background responses running here (the process is stopping)."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ creating

    async def turn(self, body: dict, fits=None) -> ResponseTurn:
        return await resolve_turn(self.store, body, fits)

    async def check_new_id(self, turn: ResponseTurn, response_id: str) -> None:
        """A client-chosen id (X-Request-Id) that names a stored response is a 409: the new
        response could not be stored under it, and a continuation would read the old one."""
        if turn.store and await self.store.get(response_id) is not None:
            raise AlreadyExists(f"a stored response has the id {response_id!r}: choose "
                                "another X-Request-Id, or delete it first")

    async def save(self, turn: ResponseTurn, response_id: str, final: dict | None) -> None:
        """A foreground response's record, before its last bytes go to the client (a
        client chaining from it at once finds it), and its conversation's new items."""
        if turn.store and final is not None:
            await self.store.put(response_id, turn.record(final))
        await self._add_to_conversation(turn, final)

    async def _add_to_conversation(self, turn: ResponseTurn, final: dict | None) -> None:
        """A finished response's input and output items appended to its conversation (a
        failed or cancelled one adds nothing)."""
        if turn.conversation is None or final is None or final["status"] not in (
                "completed", "incomplete"):
            return
        try:
            await self.store.edit_conversation(turn.conversation,
                                               append=turn.own_items + final["output"])
        except NotFound:
            log.info("conversation %s was deleted before response %s finished",
                     turn.conversation, final["id"])
        except InvalidRequest as exc:  # (the conversation kept as it was)
            log.warning("response %s's items not added to its conversation: %s",
                        final["id"], exc)

    async def start_background(self, request: web.Request, turn: ResponseTurn, writer,
                               response_id: str, request_ids: list[str],
                               open_sessions: OpenSessions, stream: bool) -> web.StreamResponse:
        """Store the response as queued, run it in a task of its own, and answer: the
        queued Response, or (stream) its events as they are stored."""
        queued = {**writer.base, "status": "queued"}
        await self.store.put(response_id, turn.record(queued), background=True,
                             request_ids=tuple(request_ids))
        task = asyncio.ensure_future(self._run(turn, writer, response_id, open_sessions,
                                               stream))
        self._tasks[response_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(response_id, None))
        if not stream:
            return web.Response(body=encode_json(queued), content_type="application/json")
        return await self._stream_stored(request, response_id, after=-1)

    async def _run(self, turn: ResponseTurn, writer, response_id: str,
                   open_sessions: OpenSessions, stream: bool) -> None:
        """A background response from its sessions to its stored end (events first, then
        the record: a reader seeing it finished has every event)."""
        store = self.store
        try:
            closing: list[dict] = []
            try:
                async with AsyncExitStack() as stack:
                    sessions = await open_sessions(stack)
                    writer.prompts = [s.spec.prompt_token_ids for s in sessions]
                    running = {**writer.base, "status": "in_progress"}
                    if not await store.put(response_id, turn.record(running), update=True):
                        return  # cancelled or deleted while queued: the stack aborts them
                    if stream:
                        await self._add_events(response_id, writer.first_chunks())
                    async for i, out in merge_sessions(sessions):
                        if stream:
                            await self._add_events(response_id, writer.chunks(i, out))
                        else:
                            writer.add(i, out)
                closing = writer.closing_chunks() if stream else [writer.response()]
            except PagedServeError as exc:
                if isinstance(exc, InvalidRequest):
                    exc = response_field(exc)  # the field as the client named it
                closing = writer.failure_chunks(error_for(exc)[1])
            if stream:
                await self._add_events(response_id, closing)
            if await store.put(response_id, turn.record(writer.final), update=True):
                await self._add_to_conversation(turn, writer.final)  # not when cancelled
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a bug: the response failed, logged
            log.exception("background response %s failed", response_id)
            failed = {**writer.base, "status": "failed",
                      "error": {"code": "server_error", "message": str(exc) or
                                type(exc).__name__}}
            await store.put(response_id, turn.record(failed), update=True)

    async def _add_events(self, response_id: str, chunks: list[dict]) -> None:
        if chunks:
            await self.store.add_events(response_id, sse_frames(chunks, named=True))

    async def _stream_stored(self, request: web.Request, response_id: str,
                             after: int) -> web.StreamResponse:
        """A background stream's stored events after sequence number `after`, then the
        live ones until it is over (the client may leave: the response runs on)."""
        events, over = await self.store.events(response_id, after, 0)  # NotFound first
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                             "Cache-Control": "no-cache"})
        await stream.prepare(request)
        try:
            while True:
                if events:
                    await stream.write(b"".join(events))
                    after += len(events)
                if over:
                    break
                events, over = await self.store.events(response_id, after, EVENTS_WAIT_S)
        except NotFound:
            pass  # deleted (or dropped) while streamed: the stream just ends
        except ConnectionError:
            return stream
        await stream.write_eof()
        return stream

    # ------------------------------------------------------------------ reading

    async def _record(self, request: web.Request) -> bytes:
        response_id = request.match_info["id"]
        record = await self.store.get(response_id) if self.store.enabled else None
        if record is None:
            raise NotFound(f"no stored response has the id {response_id!r}",
                           field="response_id")
        return record

    @answered
    async def retrieve(self, request: web.Request) -> web.StreamResponse:
        if request.query.get("stream", "false").lower() in ("1", "true"):
            after = query_int(request, "starting_after", -1, low=-1)
            return await self._stream_stored(request, request.match_info["id"], after)
        return web.json_response(stored_response(await self._record(request)),
                                 dumps=dumps_json)

    @answered
    async def list_input_items(self, request: web.Request) -> web.Response:
        """OpenAI's list of the items the model was given (item_page)."""
        items = stored_input_items(await self._record(request))
        return web.json_response(item_page(items, request), dumps=dumps_json)

    # ------------------------------------------------------------------ stopping

    @answered
    async def cancel(self, request: web.Request) -> web.Response:
        response_id = request.match_info["id"]
        await self._record(request)
        record = await self.store.cancel(response_id)
        self._cancel_task(response_id)
        return web.json_response(stored_response(record), dumps=dumps_json)

    @answered
    async def delete(self, request: web.Request) -> web.Response:
        response_id = request.match_info["id"]
        await self._record(request)
        await self.store.delete(response_id)
        self._cancel_task(response_id)
        return web.json_response({"id": response_id, "object": "response", "deleted": True})

    def _cancel_task(self, response_id: str) -> None:
        """The background run here, if it is here (the store aborted its requests
        wherever it runs)."""
        task = self._tasks.get(response_id)
        if task is not None:
            task.cancel()


def item_page(items: list[dict], request: web.Request) -> dict:
    """OpenAI's list of items (a response's input items, a conversation's): newest first
    unless `order=asc`, `limit` of them (1-100, default 20) after the item `after`."""
    limit = query_int(request, "limit", 20, low=1, high=MAX_ITEMS_LIMIT)
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest(f"order must be asc or desc, got {order!r}", field="order")
    if order == "desc":
        items = items[::-1]
    after = request.query.get("after")
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise InvalidRequest(f"no item has the id {after!r}", field="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
