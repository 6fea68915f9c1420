"""Domain errors of the router and their gRPC status codes — the one place they are mapped.

Code anywhere in the router raises one of these; only the gRPC edge (grpc_server.py) turns it
into a status, with `grpc_code()`. Anything else that escapes a handler is a bug and becomes
INTERNAL (and is logged); a bad request is never INTERNAL.
"""

from __future__ import annotations

import grpc


class PagedServeError(Exception):
    """Base of every error that ends one request with a precise gRPC status."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidRequest(PagedServeError):
    """A bad request: a value out of range, an empty prompt, a token id ≥ vocab, a request that
    could never fit (max_model_len, one executor's KV cache). `field` names the culprit."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class AlreadyExists(PagedServeError):
    """A request with this id is live."""

    code = grpc.StatusCode.ALREADY_EXISTS


class NotFound(PagedServeError):
    """No live request has this id (Abort); no stored response has this id. `field` names
    the field that gave the id, if one did."""

    code = grpc.StatusCode.NOT_FOUND

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class QueueFull(PagedServeError):
    """The waiting queue holds --max-queue-len requests."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(PagedServeError):
    """No executor is up, the router is draining, or the executor running a request died and no
    live executor can take it over."""

    code = grpc.StatusCode.UNAVAILABLE


def grpc_code(exc: BaseException) -> grpc.StatusCode:
    """The status code for an exception that ends a request (INTERNAL for anything unknown)."""
    if isinstance(exc, PagedServeError):
        return exc.code
    return grpc.StatusCode.INTERNAL


def grpc_details(exc: BaseException) -> str:
    """The status details for an exception: the domain message, or a generic line for a bug
    (internal details are logged, not sent)."""
    if isinstance(exc, PagedServeError):
        return exc.message
    return f"internal error ({type(exc).__name__})"
