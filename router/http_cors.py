"""Cross-origin requests from browsers to the HTTP API (`--allowed-origins`).

A web page can call the API from a user's browser only where the server says its origin may
(CORS). pagedserve says so for no origin unless told: a page open in a browser on the same
machine as a loopback `serve` would otherwise be able to use it (vLLM allows every origin by
default; this is the other choice). `--allowed-origins https://app.example.com,...` names
the origins allowed, `*` allows any.

For an allowed `Origin`: a preflight (`OPTIONS` with `Access-Control-Request-Method`) is
answered 204 before any other check (a browser sends no credentials on it, so the API key
check comes after), allowing GET and POST, the headers the browser asks for, for 10 minutes;
every answer carries `Access-Control-Allow-Origin` (the origin itself; `*` when any is
allowed) and exposes `X-Request-Id`. A preflight from another origin gets 403 and no CORS
header; its other requests get no CORS header either, so the browser keeps the answer from
the page. Requests without `Origin` (every non-browser client) are untouched.
"""

from __future__ import annotations

import re

from aiohttp import web

_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s,?#]+")
ANY = "*"
PREFLIGHT_MAX_AGE_S = 600
METHODS = "GET, POST, OPTIONS"
EXPOSED = "X-Request-Id"


def parse_origins(value: str) -> tuple[str, ...]:
    """`--allowed-origins`: comma-separated origins (scheme://host[:port]) or `*`; "" ->
    none. ValueError naming a malformed one."""
    origins = []
    for item in value.split(","):
        item = item.strip()
        if not item:
            continue
        origin = item if item == ANY else item.lower().removesuffix("/")
        if origin != ANY and not _ORIGIN.fullmatch(origin):
            raise ValueError(f"{item!r} is not an origin (scheme://host[:port], no path) "
                             "or *")
        origins.append(origin)
    return tuple(dict.fromkeys(origins))


class Cors:
    """The middleware and the response hook of one set of allowed origins."""

    def __init__(self, origins: tuple[str, ...]) -> None:
        self.any = ANY in origins
        self.origins = frozenset(o for o in origins if o != ANY)

    def allows(self, origin: str | None) -> bool:
        return origin is not None and (self.any or origin.lower() in self.origins)

    def _allow_origin(self, origin: str) -> str:
        return ANY if self.any else origin

    @web.middleware
    async def preflight(self, request: web.Request, handler):
        if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
            return await handler(request)
        origin = request.headers.get("Origin")
        if not self.allows(origin):
            return web.json_response({"error": {
                "message": f"origin {origin!r} is not allowed (--allowed-origins)",
                "type": "invalid_request_error", "param": None, "code": "cors_origin"}},
                status=403)
        headers = {"Access-Control-Allow-Origin": self._allow_origin(origin),
                   "Access-Control-Allow-Methods": METHODS,
                   "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S), "Vary": "Origin"}
        asked = request.headers.get("Access-Control-Request-Headers")
        if asked:
            headers["Access-Control-Allow-Headers"] = asked
        return web.Response(status=204, headers=headers)

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """Every answer to an allowed origin says so (streamed ones too)."""
        origin = request.headers.get("Origin")
        if response.status == 204 and "Access-Control-Allow-Origin" in response.headers:
            return  # the preflight's own
        if self.allows(origin):
            response.headers["Access-Control-Allow-Origin"] = self._allow_origin(origin)
            response.headers["Access-Control-Expose-Headers"] = EXPOSED
            if not self.any:
                response.headers["Vary"] = "Origin"
