"""Who may use the public edges (gRPC and HTTP alike): TLS (`--tls-cert`, `--tls-key`,
`--tls-client-ca`) and API keys (`--api-key`). `edge_security(args)` turns the flags into
the keyword arguments both servers take.

API keys: with keys configured, every call to the generation API must carry one of them as a bearer
token, the OpenAI clients' way: HTTP `Authorization: Bearer KEY` (what the OpenAI SDK sends
for `api_key=`), gRPC the same pair as call metadata (`authorization: Bearer KEY`). A call
without a valid key is refused before anything of it is read or queued: HTTP 401 with
OpenAI's error object (`code: invalid_api_key`) and `WWW-Authenticate: Bearer`, gRPC
UNAUTHENTICATED; each refusal counts in pagedserve_request_failure_total{code=
"UNAUTHENTICATED"} of its API, so an operator can alert on a flood of them.

Open without a key, for probes and orchestrators: HTTP `GET /health` and `/version`, gRPC's
`grpc.health.v1.Health` and server reflection (they say whether the server is up and what
its API looks like, nothing of anyone's requests). Everything else needs a key: /v1/*,
/tokenize and /detokenize on HTTP, every pagedserve.v1.Generator method on gRPC.

Several keys may be valid at once (comma-separated: rotate by adding the new key, moving
clients, then removing the old one). A presented token is compared with every key in
constant time (`hmac.compare_digest` over their SHA-256 digests, so neither a key's content
nor its length leaks through timing). Keys are no substitute for TLS: over plain text anyone
on the path reads them (README "Security model").
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import ssl
import time
from collections.abc import Iterable

import grpc

# RFC 6750's token68 characters: what a bearer token may be made of (no space, no comma).
_KEY = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
MAX_KEY_CHARS = 1024
FILE_RECHECK_S = 1.0  # how often an --api-key-file is looked at (on calls needing a key)
_GONE = (-1, -1, -1)  # the file's stamp while it cannot be found
API_KEY_ENV = "PAGEDSERVE_API_KEY"  # the --api-key flag's variable (flags.env_name)

log = logging.getLogger(__name__)

# Services callable without a key (gRPC full service names).
OPEN_GRPC_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                      "grpc.reflection.v1.ServerReflection")
# HTTP routes callable without a key (GET).
OPEN_HTTP_PATHS = frozenset({"/health", "/version"})

MISSING = ("this server needs an API key: send it as the header "
           "'Authorization: Bearer KEY'")
INVALID = "the API key given is not valid on this server"


def parse_api_keys(value: str) -> tuple[str, ...]:
    """The `--api-key` flag: one key or several separated by commas ("" -> none). ValueError
    naming what is wrong with a key (never echoing it)."""
    keys = []
    for i, key in enumerate(value.split(",")):
        key = key.strip()
        if not key:
            if value.strip():
                raise ValueError(f"key {i + 1} of the list is empty")
            continue
        if len(key) > MAX_KEY_CHARS:
            raise ValueError(f"key {i + 1} is longer than {MAX_KEY_CHARS} characters")
        if not _KEY.fullmatch(key):
            raise ValueError(f"key {i + 1} has a character a bearer token cannot carry "
                             "(letters, digits and -._~+/ only, '=' at the end)")
        keys.append(key)
    return tuple(dict.fromkeys(keys))


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` value (scheme case-insensitive), or
    None when there is none."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def read_key_file(path: str) -> tuple[str, ...]:
    """The keys of an --api-key-file: one a line (or several, comma-separated); blank lines
    and lines starting with # skipped. OSError when it cannot be read, ValueError naming
    the line of a bad key (never the key)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    keys: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            keys += parse_api_keys(line)
        except ValueError as exc:
            raise ValueError(f"line {number}: {exc}") from None
    return tuple(dict.fromkeys(keys))


def _digests(keys: Iterable[str]) -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(k.encode()).digest() for k in keys)


class ApiKeys:
    """The keys a server accepts: `keys` (--api-key) and those in `file` (--api-key-file).
    Neither given: no key needed (every call allowed). Given a file, keys are needed even
    while it holds none (then every call is refused: an emptied file never opens the API).

    The file is re-read when it changes (its modification time, size or inode, looked at
    no more than every `recheck_s` seconds, on the calls that need a key): rotating keys
    needs no restart, which would cost every block table. A Kubernetes Secret mounted as
    a file is replaced that way. A file that cannot be read or holds a bad key leaves the
    keys as they were, and says so once in the log."""

    def __init__(self, keys: Iterable[str] = (), file: str | None = None,
                 recheck_s: float = FILE_RECHECK_S) -> None:
        self._fixed = _digests(keys)
        self.file = file
        self._recheck_s = recheck_s
        self._from_file: tuple[bytes, ...] = ()
        self._stamp: tuple[int, int, int] | None = None
        self._next_check = 0.0
        self._read = False
        self.enabled = bool(self._fixed) or file is not None
        self._refresh()

    def __bool__(self) -> bool:
        return self.enabled

    def __len__(self) -> int:
        return len(self._fixed) + len(self._from_file)

    def _refresh(self) -> None:
        if self.file is None:
            return
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + self._recheck_s
        try:
            st = os.stat(self.file)
        except OSError as exc:
            if self._stamp != _GONE:  # said once; read again once it is back
                self._stamp = _GONE
                self._keep(exc.strerror or str(exc))
            return
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp == self._stamp:
            return
        self._stamp = stamp  # a bad version is said once, not at every recheck
        try:
            keys = read_key_file(self.file)
        except OSError as exc:
            self._keep(exc.strerror or str(exc))
            return
        except ValueError as exc:
            self._keep(str(exc))
            return
        self._from_file = _digests(keys)
        log.info("--api-key-file %s: %d key(s)%s", self.file, len(keys),
                 " (changed)" if self._read else "")
        self._read = True

    def _keep(self, why: str) -> None:
        log.error("--api-key-file %s: %s; the %d key(s) read before stay valid", self.file,
                  why, len(self._from_file))

    def check(self, authorization: str | None) -> str | None:
        """None when a call with this `authorization` value may proceed, else why not
        (MISSING or INVALID)."""
        if not self.enabled:
            return None
        self._refresh()
        token = bearer_token(authorization)
        if token is None:
            return MISSING
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        match = False
        for key in self._fixed + self._from_file:  # every key compared: the time does
            match |= hmac.compare_digest(digest, key)  # not say which matched
        return None if match else INVALID


# --------------------------------------------------------------------------- TLS


def tls_enabled(tls_cert: str | None, tls_key: str | None,
                tls_client_ca: str | None = None) -> bool:
    """Whether the TLS flags ask for TLS (both APIs read them alike); ValueError for an
    incomplete set."""
    if not tls_cert and not tls_key:
        if tls_client_ca:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return False
    if not (tls_cert and tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    return True


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def server_credentials(
    tls_cert: str | None, tls_key: str | None, tls_client_ca: str | None = None
) -> grpc.ServerCredentials | None:
    """TLS (cert + key) or mutual TLS (plus a client CA: client certificates required);
    None for plaintext. Raises ValueError for an incomplete set."""
    if not tls_enabled(tls_cert, tls_key, tls_client_ca):
        return None
    try:
        pair = (_read(tls_key), _read(tls_cert))
        client_ca = _read(tls_client_ca) if tls_client_ca else None
    except OSError as exc:
        raise ValueError(f"cannot read TLS file: {exc}") from exc
    return grpc.ssl_server_credentials(
        [pair], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def ssl_context(tls_cert: str | None, tls_key: str | None,
                tls_client_ca: str | None = None) -> ssl.SSLContext | None:
    """The TLS flags as an SSLContext (None for plaintext); ValueError for an incomplete set,
    as server_credentials."""
    if not tls_enabled(tls_cert, tls_key, tls_client_ca):
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(tls_cert, tls_key)
        if tls_client_ca:
            ctx.load_verify_locations(tls_client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot read TLS file: {exc}") from exc
    return ctx


def edge_security(args) -> dict:
    """The flags' TLS files and API keys as start_server's and start_http_server's keyword
    arguments (`args`: the parsed flags, or their JSON copy in an API worker)."""
    return dict(tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
                api_keys=ApiKeys(getattr(args, "api_key", None) or (),
                                 getattr(args, "api_key_file", None)))


# --------------------------------------------------------------------------- gRPC


def _denied(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that ends the call UNAUTHENTICATED."""
    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    async def deny_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        yield  # pragma: no cover - abort raises

    kw = dict(request_deserializer=handler.request_deserializer,
              response_serializer=handler.response_serializer)
    if handler.request_streaming or handler.response_streaming:
        # The Generator service has no client-streaming method: its only stream is Stream's.
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
    return grpc.unary_unary_rpc_method_handler(deny, **kw)


class GrpcKeyCheck(grpc.aio.ServerInterceptor):
    """Refuses a call to a keyed service without a valid `authorization` metadata pair;
    `on_refused()` counts it."""

    def __init__(self, keys: ApiKeys, on_refused) -> None:
        self.keys = keys
        self.on_refused = on_refused

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        service = details.method.lstrip("/").rpartition("/")[0]
        if handler is None or service in OPEN_GRPC_SERVICES:
            return handler
        authorization = None
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                authorization = value if isinstance(value, str) else value.decode("latin-1")
                break
        why = self.keys.check(authorization)
        if why is None:
            return handler
        self.on_refused()
        return _denied(handler, why)


def grpc_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata a client sends for `api_key` (none for None or "")."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def http_headers(api_key: str | None) -> dict[str, str]:
    """The HTTP headers a client sends for `api_key` (none for None or "")."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def client_api_key() -> str | None:
    """The key pagedserve's clients send unless told otherwise: the first of
    $PAGEDSERVE_API_KEY (the server's flag, so one environment serves both), or None."""
    first = os.environ.get(API_KEY_ENV, "").split(",")[0].strip()
    return first or None


def add_client_api_key(parser) -> None:
    """A client's `--api-key` (its default never printed)."""
    parser.add_argument("--api-key", default=client_api_key(),
                        help=f"the server's API key (default: the first of ${API_KEY_ENV})")


# --------------------------------------------------------------------------- HTTP


def http_key_check(keys: ApiKeys, on_refused):
    """aiohttp middleware: a 401 (OpenAI's error object) for a request to a keyed route
    without a valid bearer key; `on_refused()` counts it. Checked before the body is read."""
    from aiohttp import web

    @web.middleware
    async def key_check(request: web.Request, handler):
        if request.method in ("GET", "HEAD") and request.path in OPEN_HTTP_PATHS:
            return await handler(request)
        authorization = request.headers.get("Authorization")
        if authorization is None and "x-api-key" in request.headers:  # Anthropic's SDKs
            authorization = "Bearer " + request.headers["x-api-key"]
        why = keys.check(authorization)
        if why is None:
            return await handler(request)
        on_refused()
        body = {"error": {"message": why, "type": "invalid_request_error", "param": None,
                          "code": "invalid_api_key"}}
        return web.json_response(body, status=401, headers={"WWW-Authenticate": "Bearer"})

    return key_check
