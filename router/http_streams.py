"""The HTTP edge's streams: server-sent events written from a writer's chunks, and the
outputs of a request's sessions merged as they come."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from aiohttp import web

from .frontend import RequestSession
from .http_errors import encode_json
from .types import RequestOutput


def sse_frames(chunks: list[dict], named: bool) -> list[bytes]:
    """Each chunk as one server-sent event: `data: JSON`, and `event: TYPE` before it
    where the API names its events (the Responses API)."""
    if named:
        return [b"event: " + chunk["type"].encode() + b"\ndata: " + encode_json(chunk) + b"\n\n"
                for chunk in chunks]
    return [b"data: " + encode_json(chunk) + b"\n\n" for chunk in chunks]


async def send_events(stream: web.StreamResponse, chunks: list[dict], writer,
                      done: bool = False) -> None:
    """Server-sent events for `chunks` (and the closing `[DONE]`), in one write."""
    events = sse_frames(chunks, writer.sse_named)
    if done:
        events.append(b"data: [DONE]\n\n")
    if events:
        await stream.write(b"".join(events))


async def merge_sessions(sessions: list[RequestSession]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every session as they come; one session is iterated
    directly. A failure of any ends the merge (the others are aborted by their sessions)."""
    if len(sessions) == 1:
        async for out in sessions[0]:
            yield 0, out
        return
    iters = [aiter(s) for s in sessions]
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iters)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                yield i, out
                pending[asyncio.ensure_future(anext(iters[i]))] = i
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
