"""`X-Request-Id` on the HTTP edge: a client's own id for its request, and the id of every
answer in a response header (as OpenAI's API answers with `x-request-id`).

A generation or embeddings request that carries `X-Request-Id: ID` (1-256 visible ASCII
characters) runs under that id: the response's `id` is the route's prefix and ID
(`cmpl-ID`, `chatcmpl-ID`, `resp_ID`, `embd-ID`), the engine's requests are `cmpl-ID-0`,
`cmpl-ID-1`, ... (one a prompt or input, as without the header), and so the request log,
the router's log lines and a gRPC `Abort` name what the client named. A request whose id is
still live gets 409 (ALREADY_EXISTS), as over gRPC. Without the header the id is random.
Every answer of those routes (errors too) carries `X-Request-Id`: the client's, or the
response's `id`. A malformed header is a 400 naming `X-Request-Id`.
"""

from __future__ import annotations

import re
import uuid

from aiohttp import web

from .errors import InvalidRequest

HEADER = "X-Request-Id"
MAX_CHARS = 256
_ID = re.compile(rf"[\x21-\x7e]{{1,{MAX_CHARS}}}")
# The request's storage key of the id its answer carries (RequestKey from aiohttp 3.12)
_KEY = web.RequestKey("pagedserve_request_id", str) if hasattr(web, "RequestKey") \
    else "pagedserve_request_id"


def request_base(request: web.Request) -> str:
    """The id the request runs under: the client's X-Request-Id, or a random one; the answer
    will carry it (echo_request_id). InvalidRequest for a malformed header."""
    given = request.headers.get(HEADER)
    if given is None:
        base = uuid.uuid4().hex
    elif _ID.fullmatch(given):
        base = given
    else:
        raise InvalidRequest(f"{HEADER} must be 1-{MAX_CHARS} visible ASCII characters "
                             "(no spaces)", field=HEADER)
    request[_KEY] = given  # the client's, echoed as given (None: the response id is)
    return base


def answer_id(request: web.Request, response_id: str) -> None:
    """The id this request's answer carries when the client gave none: its response id."""
    if request.get(_KEY) is None:
        request[_KEY] = response_id


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: the answer's X-Request-Id (streamed answers too: the headers
    go out when they are prepared)."""
    value = request.get(_KEY)
    if value is None and HEADER in request.headers and _ID.fullmatch(request.headers[HEADER]):
        value = request.headers[HEADER]  # refused before its id was taken (a bad body)
    if value is not None:
        response.headers[HEADER] = value
