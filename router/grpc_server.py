"""The gRPC edge: pagedserve.v1.Generator over an `Engine`, plus health and reflection.

Requests are turned into `RequestSpec`s by validation.py (from_pb) and engine outputs into
responses here (to_pb); the request's way through the engine, its metrics and the counting of
every non-OK ending (pagedserve_request_failure_total{code, api="grpc"}) are frontend.py's,
shared with the HTTP edge. Every error path goes through errors.py's mapping.

Ending of a request, by cause:
  * finished normally / aborted by the Abort RPC / drained → status OK (finish_reason says);
  * client cancelled or its deadline passed → engine.abort(id), status follows the client
    (CANCELLED / DEADLINE_EXCEEDED), the request's blocks are freed by the engine;
  * a domain error (errors.py) → its code; anything else → INTERNAL (logged, a bug).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2_grpc as pb_grpc

from .edge_security import ApiKeys, GrpcKeyCheck, server_credentials
from .errors import PagedServeError, grpc_code, grpc_details
from .frontend import CLIENT_GONE, Frontend
from .types import ClusterStatusData, CompletionDelta, ModelInfoData, TokenLogprob, Usage
from .validation import request_from_pb

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generator"].full_name  # "pagedserve.v1.Generator"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
HEALTH_POLL_S = 0.25
THREADED_TOKENIZE_CHARS = 16_384
API = "grpc"  # the api label of this edge's request metrics

_FINISH_TO_PB = {None: pb.FINISH_REASON_UNSPECIFIED, "length": pb.LENGTH, "stop": pb.STOP, "abort": pb.ABORT}


# --------------------------------------------------------------------------- to_pb


def logprobs_to_pb(logprobs: Sequence[TokenLogprob]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
            rank=lp.rank,  # None: unset
        )
        for lp in logprobs
    ]


def usage_to_pb(usage: Usage) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_prompt_tokens=usage.cached_prompt_tokens,
        accepted_prediction_tokens=usage.accepted_prediction_tokens,
        rejected_prediction_tokens=usage.rejected_prediction_tokens,
    )


def chunk_to_pb(request_id: str, delta: CompletionDelta) -> pb.GenerateStreamResponse:
    if delta.finish_reason is None and not delta.logprobs and not delta.stop_string \
            and delta.stop_token_id is None:
        # The steady token (most chunks): the other fields at their defaults are not set at
        # all, the same message for half the cost (no empty-list conversion, no enum map).
        return pb.GenerateStreamResponse(request_id=request_id, index=delta.index,
                                         text=delta.text, token_ids=delta.token_ids)
    chunk = pb.GenerateStreamResponse(
        request_id=request_id,
        index=delta.index,
        text=delta.text,
        token_ids=delta.token_ids,
        finish_reason=_FINISH_TO_PB[delta.finish_reason],
        stop_string=delta.stop_string or "",
        logprobs=logprobs_to_pb(delta.logprobs),
    )
    if delta.stop_token_id is not None:
        chunk.stop_token_id = delta.stop_token_id
    return chunk


def model_info_to_pb(info: ModelInfoData) -> pb.ModelInfo:
    return pb.ModelInfo(
        model=info.model,
        architecture=info.architecture,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        block_size=info.block_size,
        dtype=info.dtype,
        eos_token_ids=info.eos_token_ids,
        lora_adapters=info.lora_adapters,
    )


def cluster_status_to_pb(status: ClusterStatusData) -> pb.ClusterStatus:
    return pb.ClusterStatus(
        executors=[
            pb.ExecutorStatus(
                id=e.id,
                device=e.device,
                healthy=e.healthy,
                num_gpu_blocks=e.num_gpu_blocks,
                num_free_gpu_blocks=e.num_free_gpu_blocks,
                num_cpu_blocks=e.num_cpu_blocks,
                num_free_cpu_blocks=e.num_free_cpu_blocks,
                running=e.running,
                waiting=e.waiting,
                swapped=e.swapped,
            )
            for e in status.executors
        ],
        prefix_cache_queries=status.prefix_cache_queries,
        prefix_cache_hits=status.prefix_cache_hits,
    )


@dataclass
class _SampleAcc:
    """One sample's completion, accumulated from its deltas (unary Generate)."""

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_string: str | None = None
    stop_token_id: int | None = None

    def add(self, delta: CompletionDelta) -> None:
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_string = delta.stop_string
            self.stop_token_id = delta.stop_token_id

    def to_pb(self) -> pb.Completion:
        completion = pb.Completion(
            index=self.index,
            text="".join(self.text),
            token_ids=self.token_ids,
            finish_reason=_FINISH_TO_PB[self.finish_reason],
            stop_string=self.stop_string or "",
            logprobs=logprobs_to_pb(self.logprobs),
        )
        if self.stop_token_id is not None:
            completion.stop_token_id = self.stop_token_id
        return completion


# --------------------------------------------------------------------------- servicer


class GeneratorServicer(pb_grpc.GeneratorServicer):
    """pagedserve.v1.Generator over an Engine (see types.Engine for the contract)."""

    def __init__(self, frontend: Frontend):
        self._frontend = frontend
        self._engine = frontend.engine

    # ------------------------------------------------------------------ RPCs

    async def Generate(self, request: pb.GenerateRequest, context) -> pb.GenerateResponse:
        samples: dict[int, _SampleAcc] = {}
        usage: Usage | None = None
        prompt_logprobs: tuple[TokenLogprob, ...] = ()
        request_id = ""
        async with aclosing(self._run(request, context)) as outputs:
            async for rid, out in outputs:
                request_id = rid
                for delta in out.deltas:
                    acc = samples.get(delta.index)
                    if acc is None:
                        acc = samples[delta.index] = _SampleAcc(delta.index)
                    acc.add(delta)
                usage = out.usage or usage
                prompt_logprobs = out.prompt_logprobs or prompt_logprobs
        return pb.GenerateResponse(
            request_id=request_id,
            completions=[samples[i].to_pb() for i in sorted(samples)],
            usage=usage_to_pb(usage) if usage is not None else None,
            prompt_logprobs=logprobs_to_pb(prompt_logprobs),
        )

    async def Stream(
        self, request: pb.GenerateRequest, context
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        async with aclosing(self._run(request, context)) as outputs:
            async for request_id, out in outputs:
                chunks = [
                    chunk_to_pb(request_id, d)
                    for d in out.deltas
                    if d.text or d.token_ids or d.logprobs or d.finish_reason is not None
                ]
                if out.usage is not None:
                    if not chunks:
                        chunks.append(pb.GenerateStreamResponse(request_id=request_id))
                    chunks[-1].usage.CopyFrom(usage_to_pb(out.usage))
                    chunks[-1].prompt_logprobs.extend(logprobs_to_pb(out.prompt_logprobs))
                for chunk in chunks:
                    yield chunk

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        try:
            # With API workers the request may run on another worker: ask the core.
            abort_anywhere = getattr(self._engine, "abort_anywhere", None)
            found = await abort_anywhere(request.request_id) if abort_anywhere is not None \
                else self._engine.abort(request.request_id)
        except Exception as exc:  # noqa: BLE001 - mapped in one place
            await self._fail(context, exc)
        if not found:
            await self._fail_code(
                context, grpc.StatusCode.NOT_FOUND, f"no live request with id {request.request_id!r}"
            )
        return pb.AbortResponse()

    async def GetModelInfo(self, request: pb.ModelInfoRequest, context) -> pb.ModelInfo:
        try:
            return model_info_to_pb(self._engine.model_info())
        except Exception as exc:  # noqa: BLE001 - mapped in one place
            await self._fail(context, exc)

    async def GetClusterStatus(self, request: pb.ClusterStatusRequest, context) -> pb.ClusterStatus:
        try:
            status = self._engine.cluster_status()  # a round trip to the core in a worker
            if inspect.isawaitable(status):
                status = await status
            return cluster_status_to_pb(status)
        except Exception as exc:  # noqa: BLE001 - mapped in one place
            await self._fail(context, exc)

    # ------------------------------------------------------------------ one request

    async def _run(self, request: pb.GenerateRequest, context):
        """Validate, submit and yield (request_id, RequestOutput) until the final output.
        Maps every failure to a status; the session aborts the engine request and counts the
        ending when the client goes (frontend.py)."""
        arrival = time.monotonic()
        remaining = context.time_remaining()
        deadline = arrival + remaining if remaining is not None else None
        request_id = request.request_id or uuid.uuid4().hex
        fe = self._frontend
        build = functools.partial(
            request_from_pb, request, tokenizer=fe.tokenizer, limits=fe.limits,
            request_id=request_id, arrival_time=arrival, deadline=deadline,
        )
        threaded = (len(request.prompt) > THREADED_TOKENIZE_CHARS
                    or request.WhichOneof("input") == "messages")
        try:
            async with fe.request(request_id, build, api=API, arrival=arrival,
                                  deadline=deadline, threaded=threaded) as session:
                async for out in session:
                    yield request_id, out
        except PagedServeError as exc:  # counted by the session
            await context.abort(exc.code, exc.message)
        except CLIENT_GONE:
            raise
        except Exception as exc:  # noqa: BLE001 - a bug: INTERNAL, logged and counted there
            await context.abort(grpc_code(exc), grpc_details(exc))

    # ------------------------------------------------------------------ errors

    async def _fail(self, context, exc: BaseException, request_id: str = "") -> None:
        """End the RPC with the status errors.py maps `exc` to (raises grpc's AbortError)."""
        code = grpc_code(exc)
        if not isinstance(exc, PagedServeError):
            log.error("request %s failed with an internal error", request_id, exc_info=exc)
        await self._fail_code(context, code, grpc_details(exc))

    async def _fail_code(self, context, code: grpc.StatusCode, details: str) -> None:
        self._frontend.count_failure(code, API)
        await context.abort(code, details)


# --------------------------------------------------------------------------- server


class GrpcServer:
    """A started router gRPC server: Generator + health + reflection.

    Health: service "" is SERVING while the process is up; "pagedserve.v1.Generator" follows
    engine.is_serving() (polled). `drain()` turns both NOT_SERVING and makes new requests
    UNAVAILABLE; running ones continue.
    """

    def __init__(
        self,
        server: grpc.aio.Server,
        port: int,
        servicer: GeneratorServicer,
        health_servicer: health.aio.HealthServicer,
        frontend: Frontend,
        poll_s: float,
    ):
        self.server = server
        self.port = port
        self.servicer = servicer
        self.health = health_servicer
        self._frontend = frontend
        self._engine = frontend.engine
        self._poll_s = poll_s
        self._serving: bool | None = None
        self._poller: asyncio.Task | None = None

    async def _start(self) -> None:
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self._refresh()
        self._poller = asyncio.create_task(self._poll(), name="pagedserve-health-poll")

    async def _refresh(self) -> None:
        try:
            serving = bool(self._engine.is_serving()) and not self._frontend.draining
        except Exception:  # noqa: BLE001 - a failing engine is not serving
            log.exception("engine.is_serving() failed")
            serving = False
        if serving != self._serving:
            self._serving = serving
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if serving
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            await self.health.set(SERVICE_NAME, status)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            await self._refresh()

    async def drain(self) -> None:
        """Start draining: health NOT_SERVING everywhere, new requests UNAVAILABLE (on every
        API: the draining flag is the frontend's)."""
        self._frontend.draining = True
        self._serving = False
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace: float | None = None) -> None:
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None
        await self.server.stop(grace)

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        return await self.server.wait_for_termination(timeout)


class LateEndFilter(logging.Filter):
    """grpc's asyncio server logs an ERROR with a traceback ("ExecuteBatchError raised in
    core by servicer method ...") when a handler's final message cannot be sent because the
    call already ended: the client's deadline expired or it cancelled at the moment the
    server answered, before grpc noticed the close (it ignores the error once it has). No
    server fault and nothing to recover: one INFO line instead (seen in feature_soak.py
    about once in 15,000 requests with 10-300 ms deadlines)."""

    PREFIX = "ExecuteBatchError raised in core by servicer method"

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        message = record.getMessage()
        if message.startswith(self.PREFIX):
            method = message[len(self.PREFIX):].strip(" []") or "?"
            record.msg = "%s: the call ended (client deadline or cancel) before its " \
                         "final message was sent"
            record.args = (method,)
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info = record.exc_text = None
        return True


LATE_END_FILTER = LateEndFilter()


async def start_server(
    frontend: Frontend,
    host: str = "127.0.0.1",
    port: int = 50051,
    *,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls_client_ca: str | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    health_poll_s: float = HEALTH_POLL_S,
    reuse_port: bool = False,
    api_keys: ApiKeys | None = None,
) -> tuple[GrpcServer, int]:
    """Start the router's gRPC server on host:port (0 → any free port); return it and the
    bound port. Call from the event loop that runs the engine. `reuse_port`: SO_REUSEPORT,
    for API workers sharing the port (off otherwise, so a port in use is an error);
    `api_keys`: the keys Generator calls must carry (api_keys.py; none: no key needed)."""
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 1 if reuse_port else 0),
    ]
    grpc_log = logging.getLogger("grpc._cython.cygrpc")
    if LATE_END_FILTER not in grpc_log.filters:
        grpc_log.addFilter(LATE_END_FILTER)
    interceptors = []
    if api_keys:
        interceptors.append(GrpcKeyCheck(api_keys, lambda: frontend.count_failure(
            grpc.StatusCode.UNAUTHENTICATED, API)))
    server = grpc.aio.server(options=options, interceptors=interceptors)
    servicer = GeneratorServicer(frontend)
    pb_grpc.add_GeneratorServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    creds = server_credentials(tls_cert, tls_key, tls_client_ca)
    bound = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind the gRPC server to {address}")
    await server.start()
    handle = GrpcServer(server, bound, servicer, health_servicer, frontend, health_poll_s)
    await handle._start()
    return handle, bound
