"""The HTTP edge's errors: a domain error (errors.py) or a gRPC status as an HTTP status and
OpenAI's error object ({"error": {"message", "type", "param", "code"}}): 400 bad input, 401
no valid API key, 404 unknown model or route, 409 a live request id, 429 queue full, 503 no
executor or draining, 500 only for a bug."""

from __future__ import annotations

import functools
import json

import grpc
import msgspec
from aiohttp import web

from .errors import InvalidRequest, NotFound, PagedServeError, grpc_code, grpc_details

UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED

_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
}
_ERROR_TYPE = {400: "invalid_request_error", 404: "invalid_request_error",
               409: "invalid_request_error", 413: "invalid_request_error",
               405: "invalid_request_error", 429: "rate_limit_error",
               503: "service_unavailable_error", 500: "server_error"}
encode_json = msgspec.json.Encoder().encode  # JSON bytes (the HTTP edge's bodies and events)


def http_status(code: grpc.StatusCode) -> int:
    return _STATUS.get(code, 500)


def error_json(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPE.get(status, "server_error"),
                      "param": param, "code": code}}


def error_for(exc: BaseException) -> tuple[int, dict]:
    """(HTTP status, error object) for an exception that ended a request."""
    code = grpc_code(exc)
    status = http_status(code)
    param = exc.field if isinstance(exc, (InvalidRequest, NotFound)) else None
    err_code = "model_not_found" if isinstance(exc, ModelNotFound) else code.name.lower()
    return status, error_json(status, grpc_details(exc), param, err_code)


def error_response(exc: BaseException) -> web.Response:
    status, body = error_for(exc)
    return web.json_response(body, status=status, dumps=dumps_json)


def dumps_json(obj) -> str:
    return encode_json(obj).decode()


class ModelNotFound(NotFound):
    """A request named a model this server does not serve."""


async def read_json(request: web.Request) -> dict:
    """A request's body as a JSON object; InvalidRequest (400) naming what is wrong."""
    raw = await request.read()
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise InvalidRequest(f"the body is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    return body


def answered(handler):
    """A route method whose domain errors are answered with their status and OpenAI's
    error object."""
    @functools.wraps(handler)
    async def route(self, request: web.Request) -> web.StreamResponse:
        try:
            return await handler(self, request)
        except PagedServeError as exc:
            return error_response(exc)
    return route


def query_int(request: web.Request, key: str, default: int, low: int,
              high: int | None = None) -> int:
    """An integer query parameter within [low, high] (InvalidRequest naming it)."""
    raw = request.query.get(key)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidRequest(f"{key} must be an integer, got {raw!r}", field=key) from None
    if value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f"at least {low}"
        raise InvalidRequest(f"{key} must be {bound}, got {value}", field=key)
    return value
