"""The OpenAI-compatible HTTP edge: /v1/models, /v1/completions, /v1/chat/completions, /health.

It runs in the router process on the event loop that runs the engine and the gRPC server (an
aiohttp AppRunner: no extra hop, no extra process, and no signal handlers of its own — draining
stays the router's, see app.py). A request's way is the gRPC edge's:

    JSON body → openai_protocol (types) → GenerateRequest(s) → validation.request_from_pb
      → Frontend.request (draining, queue place, submit; metrics with api="http")
      → RequestOutputs → one JSON response, or server-sent events: `data: {chunk}\\n\\n` …
        `data: [DONE]\\n\\n`

Errors before the response starts get their HTTP status and OpenAI's error object
({"error": {"message", "type", "param", "code"}}): 400 bad input, 404 unknown model or route,
429 queue full, 503 no executor or draining, 500 only for a bug. Once a stream has started, a
failure is an SSE `data: {"error": …}` event when no token was sent yet; a stream with tokens
ends its unfinished choices with finish_reason `abort` instead (as a drain or a lost executor
with nowhere to migrate does through the engine). A client that disconnects cancels its
handler (handler_cancellation): the session aborts the request and its blocks are freed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from contextlib import AsyncExitStack

from aiohttp import web

from pagedserve import __version__

from .batch_api import BatchApi
from .batch_store import BatchStore
from .edge_security import ApiKeys, http_key_check, ssl_context
from .errors import InvalidRequest, PagedServeError, Unavailable
from .fill_in_middle import FillInMiddle
from .frontend import Frontend, RequestSession
from .generation_defaults import with_defaults
from .http_conversations import ConversationRoutes
from .http_cors import Cors
from .http_errors import (
    UNAUTHENTICATED,
    ModelNotFound,
    encode_json,
    error_for,
    error_json,
    error_response,
    read_json,
)
from .http_generation_routes import ROUTES
from .http_lora_routes import add_lora_routes
from .http_request_ids import answer_id, echo_request_id, request_base
from .http_rerank import add_rerank_routes
from .http_responses import ResponsesRoutes
from .http_streams import merge_sessions, send_events
from .http_tokenizer_routes import add_tokenizer_routes
from .http_weight_routes import add_weight_routes
from .openai_embeddings import (
    as_embedding,
    embedding_call,
    embedding_response,
    embedding_vector,
    input_field,
)
from .openai_fields import optional_str, served_names
from .openai_logprobs import TokenIdText, TokenText
from .openai_protocol import chat_request, completion_request
from .openai_responses import ChoiceWriter
from .response_persistence import ResponseFile
from .response_store import ResponseStore
from .types import RequestOutput
from .validation import prompt_from_pb, request_from_pb

log = logging.getLogger(__name__)

API = "http"  # the api label of this edge's request metrics
MAX_BODY_BYTES = 64 * 1024 * 1024  # as the gRPC edge's message limit
THREADED_TOKENIZE_CHARS = 16_384
# The status of a request whose client left before the answer (nginx's 499; no one reads
# it, the access log does).
CLIENT_CLOSED_REQUEST = 499
SHUTDOWN_GRACE_S = 1.0
RESPONSES_STORE_MB = 128.0  # --responses-store-mb's default
# --------------------------------------------------------------------------- app


class OpenAIApp:
    """The routes, over a Frontend shared with the gRPC edge."""

    def __init__(self, frontend: Frontend, served_model_name: str, max_model_len: int,
                 tool_call_parser: str = "none", reasoning_parser: str = "none",
                 api_keys: ApiKeys | None = None, allowed_origins: tuple[str, ...] = (),
                 sampling_defaults: dict | None = None, responses: ResponsesRoutes | None = None):
        self.frontend = frontend
        self.responses = responses if responses is not None else ResponsesRoutes(ResponseStore(0))
        self.sampling_defaults = sampling_defaults or {}  # generation_defaults.py
        self.cors = Cors(allowed_origins) if allowed_origins else None
        self.api_keys = api_keys or ApiKeys()
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self.served_names = served_names(served_model_name) or (served_model_name,)
        self.model_name = self.served_names[0]  # the others: aliases (--served-model-name)
        self.max_model_len = max_model_len
        self.created = int(time.time())
        self.token_text = TokenText(frontend.tokenizer)
        self.fim = FillInMiddle.of(frontend.tokenizer)  # `suffix` (None: the model has none)
        self._token_ids_text = TokenIdText(frontend.tokenizer)

    def make_app(self, batches: BatchApi | None = None) -> web.Application:
        # The key check outermost: a request without a key learns nothing, not even a 404.
        refused = functools.partial(self.frontend.count_failure, UNAUTHENTICATED, API)
        keyed = [http_key_check(self.api_keys, refused)] if self.api_keys else []
        # CORS preflights before the key check (a browser sends no key on them)
        cors = [self.cors.preflight] if self.cors else []
        app = web.Application(client_max_size=MAX_BODY_BYTES,
                              middlewares=[*cors, *keyed, _json_errors])
        app.on_response_prepare.append(echo_request_id)
        if self.cors:
            app.on_response_prepare.append(self.cors.on_prepare)
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model:.+}", self.get_model)
        app.router.add_post("/v1/completions",
                            functools.partial(self.generate, kind="completions"))
        app.router.add_post("/v1/chat/completions", functools.partial(self.generate, kind="chat"))
        app.router.add_post("/v1/responses", functools.partial(self.generate, kind="responses"))
        app.router.add_post("/v1/messages", functools.partial(self.generate, kind="messages"))
        app.router.add_post("/v1/embeddings", self.embeddings)
        add_tokenizer_routes(app, self)
        add_rerank_routes(app, self)
        add_lora_routes(app, self.frontend, self.served_names)
        add_weight_routes(app, self.frontend)
        self.responses.add_routes(app)
        ConversationRoutes(self.responses.store).add_routes(app)
        if batches is not None:
            batches.add_routes(app)
        return app

    # ------------------------------------------------------------------ small routes

    async def health(self, request: web.Request) -> web.Response:
        fe = self.frontend
        try:
            serving = bool(fe.engine.is_serving()) and not fe.draining
        except Exception:  # noqa: BLE001 - a failing engine is not serving
            log.exception("engine.is_serving() failed")
            serving = False
        if serving:
            return web.json_response({"status": "ok"})
        why = "the router is draining" if fe.draining else "no executor is up"
        return web.json_response(error_json(503, why, code="unavailable"), status=503)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    def _model_card(self, name: str) -> dict:
        """The served model's card, or a LoRA adapter's (its `parent` the model, as vLLM
        lists them)."""
        card = {"id": name, "object": "model", "created": self.created,
                "owned_by": "pagedserve", "max_model_len": self.max_model_len}
        if name not in self.served_names:
            card["parent"] = self.model_name
        return card

    @property
    def model_names(self) -> tuple[str, ...]:
        """What a body's `model` may name: the served model (its aliases), its LoRA adapters."""
        return (*self.served_names, *self.frontend.limits.lora_adapters)

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list",
                                  "data": [self._model_card(n) for n in self.model_names]})

    async def get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name not in self.model_names:
            return error_response(ModelNotFound(f"the model {name!r} does not exist"))
        return web.json_response(self._model_card(name))

    def adapter_named(self, body: dict) -> str:
        """The LoRA adapter the body's `model` names ("": the served model, or no `model`);
        ModelNotFound for any other name."""
        model = optional_str(body, "model")
        if model is None or model in self.served_names:
            return ""
        if self.frontend.limits.serves_adapter(model):
            return model
        raise ModelNotFound(f"the model {model!r} does not exist; this server serves "
                            f"{', '.join(repr(n) for n in self.model_names)}")

    def served_as(self, body: dict) -> str:
        """The served model's name as the body's `model` gave it (an alias stays an alias)."""
        model = body.get("model")
        return model if model in self.served_names else self.model_name

    # ------------------------------------------------------------------ generation

    async def generate(self, request: web.Request, *, kind: str) -> web.StreamResponse:
        """POST /v1/completions, /v1/chat/completions, /v1/responses and /v1/messages
        (`kind`, ROUTES): the last two run as the chat request they mean
        (responses_api.py, anthropic_messages.py), their errors naming their own fields."""
        arrival = time.monotonic()
        fe = self.frontend
        route = ROUTES[kind]
        turn = None  # a Responses request's turn of its stored conversation
        try:
            try:
                base = request_base(request)
                body = await read_json(request)
                if kind == "responses":
                    turn = await self.responses.turn(body, self._prompt_fits)
                    body = turn.body
                chat_body = turn.chat if turn else body
                # a suffix's frame is token ids: a large file's text is tokenized off the loop
                api = await asyncio.to_thread(self._api_request, kind, chat_body) \
                    if kind == "completions" and body.get("suffix") is not None \
                    else self._api_request(kind, chat_body)
                adapter = self.adapter_named(body)
                for pb_request in api.requests:
                    pb_request.lora_adapter = adapter
            except InvalidRequest as exc:
                raise route.renamed(exc) from None
        except PagedServeError as exc:
            fe.refused(exc, API, arrival)
            return route.error_response(exc)
        except ConnectionError:  # gone while sending its body
            return web.Response(status=CLIENT_CLOSED_REQUEST)
        response_id = route.prefix + base
        answer_id(request, response_id)
        if turn is not None and base == request.headers.get("X-Request-Id"):
            try:
                await self.responses.check_new_id(turn, response_id)
            except PagedServeError as exc:
                fe.refused(exc, API, arrival)
                return route.error_response(exc)
        created = int(time.time())
        model = adapter or self.served_as(body)  # what the reply says served it
        writer = ChoiceWriter(api, response_id, created, model,
                              self._token_ids_text if api.tokens_as_ids else self.token_text)
        if route.writer is not None:  # the route's API over the chat path
            writer = route.writer(body, writer, response_id, created, model)
        request_ids = [f"{response_id}-{i}" for i in range(len(api.requests))]

        async def open_sessions(stack: AsyncExitStack) -> list[RequestSession]:
            return [await stack.enter_async_context(self._session(pb, rid, arrival))
                    for pb, rid in zip(api.requests, request_ids, strict=True)]
        if turn is not None and turn.background:  # runs on without this connection
            return await self.responses.start_background(
                request, turn, writer, response_id, request_ids, open_sessions, api.stream)
        stream: web.StreamResponse | None = None
        try:
            try:
                # Every session is entered (submitted) before the response starts, so a
                # refused request gets its status; leaving the stack aborts and counts what
                # did not finish.
                async with AsyncExitStack() as stack:
                    sessions = await open_sessions(stack)
                    writer.prompts = [s.spec.prompt_token_ids for s in sessions]
                    if not api.stream:
                        async for i, out in merge_sessions(sessions):
                            writer.add(i, out)
                        reply = writer.response()
                        if turn is not None:
                            await self.responses.save(turn, response_id, writer.final)
                        return web.Response(body=encode_json(reply),
                                            content_type="application/json")
                    stream = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                         "Cache-Control": "no-cache"})
                    await stream.prepare(request)
                    await send_events(stream, writer.first_chunks(), writer)
                    async for i, out in merge_sessions(sessions):
                        await send_events(stream, writer.chunks(i, out), writer)
            except PagedServeError as exc:  # counted by the session it ended
                if isinstance(exc, InvalidRequest):
                    exc = route.renamed(exc)
                if stream is None:
                    return route.error_response(exc)
                # the stream had started: the error as its last event
                await send_events(stream, writer.failure_chunks(error_for(exc)[1]), writer)
            closing = writer.closing_chunks()
            if turn is not None:
                await self.responses.save(turn, response_id, writer.final)
            await send_events(stream, closing, writer, done=writer.sse_done)
            await stream.write_eof()
        except ConnectionError:
            # The client closed the connection and a write found it closing before aiohttp
            # cancelled this handler (a race of every disconnect mid-stream): the sessions
            # have aborted the requests and counted them; there is no one to answer.
            log.debug("the client of %s went away mid-response", response_id)
            if stream is None:
                return web.Response(status=CLIENT_CLOSED_REQUEST)
        return stream

    def _api_request(self, kind: str, body: dict):
        """A generation body (a Responses or Messages body: the chat body it means) as the
        requests it asks for, the sampling defaults applied (raises InvalidRequest)."""
        route = ROUTES[kind]
        spec_body = with_defaults(route.to_chat(body) if route.to_chat else body,
                                  self.sampling_defaults)
        return (completion_request(spec_body, self.fim) if kind == "completions" else
                chat_request(spec_body, self.tool_call_parser, self.reasoning_parser))

    async def prompt_ids(self, pb_request) -> tuple[int, ...]:
        """A request's prompt token ids as generation would see them (InvalidRequest)."""
        fe = self.frontend
        ids, _ = await asyncio.to_thread(prompt_from_pb, pb_request, tokenizer=fe.tokenizer,
                                         limits=fe.limits)
        return ids

    async def _prompt_fits(self, responses_body: dict) -> bool:
        """Whether a Responses body's prompt and token limit fit the context (what its
        `truncation: "auto"` drops input items for)."""
        [pb_request] = self._api_request("responses", responses_body).requests
        limit = pb_request.params.max_tokens if pb_request.params.HasField("max_tokens") else 1
        return len(await self.prompt_ids(pb_request)) + limit <= self.max_model_len

    async def embeddings(self, request: web.Request) -> web.Response:
        """POST /v1/embeddings (router/openai_embeddings.py): every input submitted before
        any is awaited (a refused one gets its status); the reply when all are in."""
        arrival = time.monotonic()
        fe = self.frontend
        try:
            base = request_base(request)
            body = await read_json(request)
            call = embedding_call(body)
            adapter = self.adapter_named(body)
        except PagedServeError as exc:
            fe.refused(exc, API, arrival)
            return error_response(exc)
        except ConnectionError:
            return web.Response(status=CLIENT_CLOSED_REQUEST)
        response_id = "embd-" + base
        answer_id(request, response_id)
        try:
            outputs, vectors = await self.embed(call, adapter, response_id, arrival)
        except PagedServeError as exc:  # counted by the session it ended
            return error_response(exc)
        except ConnectionError:
            return web.Response(status=CLIENT_CLOSED_REQUEST)
        reply = embedding_response(vectors, [out.usage for out in outputs],
                                   adapter or self.served_as(body), call.encoding_format)
        return web.Response(body=encode_json(reply), content_type="application/json")

    async def embed(self, call, adapter: str, response_id: str, arrival: float,
                    field_of=None) -> tuple[list[RequestOutput], list]:
        """Every input of an embeddings call submitted before any is awaited (a refused one
        gets its status), then their outputs and vectors in input order; `field_of(exc, i)`
        renames an input's validation error (default: `input[i]`)."""
        of = len(call.requests)
        field_of = field_of or functools.partial(input_field, of=of)
        outputs: list[RequestOutput | None] = [None] * of
        async with AsyncExitStack() as stack:
            sessions = []
            for i, pb_request in enumerate(call.requests):
                pb_request.lora_adapter = adapter
                sessions.append(await stack.enter_async_context(self._session(
                    pb_request, f"{response_id}-{i}", arrival, as_embedding,
                    functools.partial(field_of, index=i))))
            async for i, out in merge_sessions(sessions):
                if out.finished:
                    outputs[i] = out
        if any(out is None or out.embedding is None for out in outputs):
            raise Unavailable("an input ended without its embedding")
        return outputs, [embedding_vector(out, call) for out in outputs]

    def _session(self, pb_request, request_id: str, arrival: float, made=None,
                 refused=None) -> RequestSession:
        """The request's session; ``made`` turns the spec built into another (an
        embedding's), ``refused`` renames a validation error's field."""
        fe = self.frontend
        build = functools.partial(
            request_from_pb, pb_request, tokenizer=fe.tokenizer, limits=fe.limits,
            request_id=request_id, arrival_time=arrival,
            default_max_tokens=None)  # omitted: the rest of the context
        if made is not None:
            build = functools.partial(_built, build, made, refused)
        threaded = (len(pb_request.prompt) > THREADED_TOKENIZE_CHARS
                    or pb_request.WhichOneof("input") == "messages")
        return fe.request(request_id, build, api=API, arrival=arrival, threaded=threaded)


def _built(build, made, refused):
    try:
        return made(build())
    except InvalidRequest as exc:
        raise refused(exc) from None


@web.middleware
async def _json_errors(request: web.Request, handler):
    """aiohttp's own errors (unknown route, wrong method, body too large) as OpenAI error
    objects."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = {404: f"no route {request.method} {request.path}",
                   405: f"method {request.method} is not allowed on {request.path}",
                   413: f"the body is larger than {MAX_BODY_BYTES} bytes"}.get(exc.status,
                                                                                exc.reason)
        return web.json_response(error_json(exc.status, message, code=exc.reason.lower()
                                            .replace(" ", "_")), status=exc.status)


# --------------------------------------------------------------------------- server


class HttpServer:
    """A started HTTP server (AppRunner: no signal handlers; the router drains)."""

    def __init__(self, runner: web.AppRunner, port: int, batches: BatchApi | None,
                 responses: ResponsesRoutes):
        self.runner = runner
        self.port = port
        self.batches = batches
        self.responses = responses

    async def stop(self) -> None:
        if self.batches is not None:
            await self.batches.stop()
        await self.responses.stop()
        await self.runner.cleanup()
        if isinstance(self.responses.store, ResponseStore):  # this process's own
            self.responses.store.close()


async def start_http_server(
    frontend: Frontend, host: str, port: int, *, served_model_name: str, max_model_len: int,
    tls_cert: str | None = None, tls_key: str | None = None, tls_client_ca: str | None = None,
    reuse_port: bool = False, tool_call_parser: str = "none", reasoning_parser: str = "none",
    api_keys: ApiKeys | None = None, allowed_origins: tuple[str, ...] = (),
    sampling_defaults: dict | None = None, batch_dir: str | None = None, batch_window: int = 256,
    responses_store_mb: float = RESPONSES_STORE_MB, responses_dir: str | None = None,
    response_store=None,
) -> HttpServer:
    """Serve the OpenAI API on host:port (0 → any free port). Raises OSError with a one-line
    message when the address cannot be bound. `reuse_port`: SO_REUSEPORT, for API workers
    sharing the port (the kernel spreads connections over them). `batch_dir`: the Batch API's
    files (batch_api.py), each batch `batch_window` requests at a time. `response_store`:
    the stored Responses (an API worker's RemoteResponses), else a store of this process
    of `responses_store_mb` MiB (kept in `responses_dir` too, when given)."""
    if response_store is None:
        response_store = ResponseStore(
            int(responses_store_mb * 2**20), abort=frontend.engine.abort,
            metrics=frontend.metrics,
            file=ResponseFile(responses_dir) if responses_dir else None)
    responses = ResponsesRoutes(response_store)

    def openai_app(keys, origins) -> OpenAIApp:
        return OpenAIApp(frontend, served_model_name, max_model_len, tool_call_parser,
                         reasoning_parser, keys, tuple(origins), sampling_defaults, responses)
    batches = BatchApi(BatchStore(batch_dir), batch_window) if batch_dir else None
    app = openai_app(api_keys, allowed_origins).make_app(batches)
    runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True,
                           access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None,
                       ssl_context=ssl_context(tls_cert, tls_key, tls_client_ca))
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise OSError(f"cannot bind the HTTP server to {host}:{port}: "
                      f"{exc.strerror or exc}") from None
    bound = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - the port 0 chose
    if batches is not None:
        await batches.start(openai_app(None, ()).make_app())
    return HttpServer(runner, bound, batches, responses)
