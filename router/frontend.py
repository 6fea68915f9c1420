"""What the two public edges share: one request's way through the engine, and its metrics.

    edge (grpc_server.py, http_server.py): its protocol → a RequestSpec builder (validation.py,
                                           one set of rules for both)
    Frontend.request(...)   draining? → a queue place → build the spec (tokenizing, in a thread
                            for long prompts) → engine.submit                  (__aenter__)
    RequestSession          yields the engine's RequestOutputs; records TTFT, inter-token
                            latency, time per output token, e2e and each finished sample
    leaving the block       an unfinished request is aborted in the engine (its blocks freed)
                            and its ending counted: a domain error under its status, a client
                            that went away as CANCELLED / DEADLINE_EXCEEDED, a bug as INTERNAL

Every non-OK ending of a request is counted here, once, as
pagedserve_request_failure_total{code=<gRPC status name>, api=<grpc|http>}; the edges only
turn the exception into their protocol's error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc

from .errors import PagedServeError, Unavailable, grpc_code
from .metrics import RouterMetrics
from .tokenizer import Tokenizer
from .types import Engine, RequestOutput, RequestSpec, Usage
from .validation import Limits

log = logging.getLogger(__name__)
REQUEST_LOG = logging.getLogger("pagedserve.requests")

# Ways a client goes away: its task is cancelled (gRPC cancel/deadline, an HTTP disconnect
# with handler cancellation), the consumer of a stream is closed, or a write finds the
# connection gone.
CLIENT_GONE = (asyncio.CancelledError, GeneratorExit, ConnectionError)

# A client whose own deadline fires cancels the call; that cancel can reach us before our copy
# of the deadline (the grpc-timeout header, counted from when the server read it) has passed.
# A client that goes away this close to its deadline is counted as DEADLINE_EXCEEDED.
DEADLINE_SLACK_S = 0.1


class RequestClock:
    """Latency metrics of one request, measured when outputs are handed to the client (and
    kept for its line in the request log)."""

    __slots__ = ("_metrics", "_api", "arrival", "first", "_last", "_tokens", "finish_reasons")

    def __init__(self, metrics: RouterMetrics | None, api: str, arrival: float):
        self._metrics = metrics
        self._api = api
        self.arrival = arrival
        self.first: float | None = None  # when the first token went out
        self._last: float | None = None
        self._tokens: dict[int, int] = {}
        self.finish_reasons: list[str] = []  # each finished sample's, in finishing order

    @property
    def tokens(self) -> int:
        """Tokens handed out so far, every sample's."""
        return sum(self._tokens.values())

    def on_output(self, out: RequestOutput) -> None:
        new_tokens = False
        for delta in out.deltas:
            if delta.token_ids:
                new_tokens = True
                self._tokens[delta.index] = self._tokens.get(delta.index, 0) + len(delta.token_ids)
            if delta.finish_reason is not None:
                self.finish_reasons.append(delta.finish_reason)
                if self._metrics is not None:
                    self._metrics.inc_success(delta.finish_reason, api=self._api)
        now = time.monotonic()
        first = new_tokens and self.first is None
        if first:
            self.first = now
        if self._metrics is None:
            return
        if new_tokens:
            if first:
                self._metrics.observe_ttft(now - self.arrival)
            else:
                self._metrics.observe_inter_token(now - self._last)
            self._last = now
        if out.finished:
            self._metrics.observe_e2e(now - self.arrival)
            most = max(self._tokens.values(), default=0)
            if self.first is not None and most > 1:
                self._metrics.observe_time_per_output_token((now - self.first) / (most - 1))


class Frontend:
    """The engine as both edges see it: admission checks, the spec, the session, the counts.
    `draining` is shared: once set, both APIs refuse new requests with UNAVAILABLE."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, limits: Limits,
                 metrics: RouterMetrics | None = None, log_requests: bool = False):
        self.engine = engine
        self.tokenizer = tokenizer
        self._limits = limits
        self.metrics = metrics
        self.log_requests = log_requests  # --log-requests: a line per request (log_request)
        self.draining = False

    @property
    def limits(self) -> Limits:
        """The request limits, with the LoRA adapters requests may name now (the engine's:
        adapters are loaded and unloaded while serving, router/lora_registry.py)."""
        names = getattr(self.engine, "lora_adapters", None)
        if names is not None and names != self._limits.lora_adapters:
            self._limits = dataclasses.replace(self._limits, lora_adapters=names)
        return self._limits

    @limits.setter
    def limits(self, limits: Limits) -> None:
        self._limits = limits

    def request(self, request_id: str, build_spec: Callable[[], RequestSpec], *, api: str,
                arrival: float, deadline: float | None = None,
                threaded: bool = False) -> RequestSession:
        """A session for one request: `async with frontend.request(...) as session:` submits
        it (raising the domain error that refused it, already counted), `async for out in
        session` runs it. `build_spec` validates and tokenizes (in a thread if `threaded`)."""
        return RequestSession(self, request_id, build_spec, api=api, arrival=arrival,
                              deadline=deadline, threaded=threaded)

    def log_request(self, session: RequestSession, status: str, usage: Usage | None) -> None:
        """The request log's line for a request that ended (`--log-requests`; logger
        pagedserve.requests): its id, API, status (OK or the gRPC status name of its
        error), each sample's finish reason, token counts and latencies, never its prompt
        or output. With --log-format json the fields are the line's own keys."""
        if not self.log_requests:
            return
        clock, spec = session._clock, session.spec
        now = time.monotonic()
        fields = dict(
            request_id=session.request_id, api=session.api, status=status,
            finish=",".join(clock.finish_reasons) or "-",
            prompt_tokens=usage.prompt_tokens if usage is not None
            else len(spec.prompt_token_ids) if spec is not None else 0,
            cached_tokens=usage.cached_prompt_tokens if usage is not None else 0,
            output_tokens=usage.completion_tokens if usage is not None else clock.tokens,
            e2e_ms=round(1000 * (now - clock.arrival), 1))
        if clock.first is not None:
            fields["ttft_ms"] = round(1000 * (clock.first - clock.arrival), 1)
        if spec is not None and spec.lora_adapter:
            fields["adapter"] = spec.lora_adapter
        _log_line(fields)

    def refused(self, exc: BaseException, api: str, arrival: float) -> None:
        """A request an edge refused before it had an id and a session (its body is not a
        request: the HTTP edge's parsing): counted, and logged with request_id "-"."""
        code = grpc_code(exc)
        self.count_failure(code, api)
        if self.log_requests:
            _log_line(dict(request_id="-", api=api, status=code.name, finish="-",
                           prompt_tokens=0, cached_tokens=0, output_tokens=0,
                           e2e_ms=round(1000 * (time.monotonic() - arrival), 1)))

    def count_failure(self, code: grpc.StatusCode, api: str) -> None:
        if self.metrics is not None:
            self.metrics.inc_failure(code, api=api)

    def ending_code(self, exc: BaseException, deadline: float | None) -> grpc.StatusCode:
        """The status a request ended by `exc` counts under."""
        if isinstance(exc, CLIENT_GONE):
            if deadline is not None and time.monotonic() >= deadline - DEADLINE_SLACK_S:
                return grpc.StatusCode.DEADLINE_EXCEEDED
            return grpc.StatusCode.CANCELLED
        return grpc_code(exc)

    def abort_quietly(self, request_id: str, stream=None) -> None:
        """Abort a request an edge is leaving; with `stream` (what `submit` returned) only
        if the request under that id is still that one (engines with `abort_stream`)."""
        try:
            abort_stream = getattr(self.engine, "abort_stream", None)
            if stream is not None and abort_stream is not None:
                abort_stream(request_id, stream)
            else:
                self.engine.abort(request_id)
        except Exception:  # noqa: BLE001 - best effort on the way out
            log.exception("engine.abort(%s) failed", request_id)


def _log_line(fields: dict) -> None:
    REQUEST_LOG.info(" ".join(f"{k}=%s" for k in fields), *fields.values(), extra=fields)


class RequestSession:
    """One submitted request (see Frontend.request)."""

    def __init__(self, frontend: Frontend, request_id: str,
                 build_spec: Callable[[], RequestSpec], *, api: str, arrival: float,
                 deadline: float | None, threaded: bool):
        self.frontend = frontend
        self.request_id = request_id
        self.api = api
        self.spec: RequestSpec | None = None
        self.finished = False
        self._build_spec = build_spec
        self._deadline = deadline
        self._threaded = threaded
        self._clock = RequestClock(frontend.metrics, api, arrival)
        self._outputs: AsyncIterator[RequestOutput] | None = None
        self._error: BaseException | None = None  # what ended the output stream, if any

    async def __aenter__(self) -> RequestSession:
        fe = self.frontend
        engine = fe.engine
        reserve = getattr(engine, "reserve_slot", None)
        reserved = False
        try:
            if fe.draining:
                raise Unavailable("the router is draining")
            if reserve is not None:  # a queue place before any tokenizing work
                reserve()
                reserved = True
            # Tokenizing a long prompt would stall every stream on this loop: use a thread.
            spec = await asyncio.to_thread(self._build_spec) if self._threaded \
                else self._build_spec()
            if reserved:
                reserved = False  # submit consumes the place, whatever it raises
                self._outputs = await engine.submit(spec, reserved=True)
            else:
                self._outputs = await engine.submit(spec)
            self.spec = spec
        except BaseException as exc:
            if reserved:  # failed before submit (bad request, cancelled while tokenizing)
                engine.release_slot()
            self._count(exc)
            raise
        return self

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        assert self._outputs is not None, "iterate inside `async with`"
        try:
            async for out in self._outputs:
                self._clock.on_output(out)
                self.finished = out.finished
                if self.finished:
                    self.frontend.log_request(self, "OK", out.usage)
                yield out
                if self.finished:
                    return
            raise RuntimeError("the engine's output stream ended without a final output")
        except Exception as exc:  # the engine failed it (e.g. its executor lost, no other)
            self._error = exc
            raise

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if self.finished:
            return
        # Leaving early without an exception of the block's own: the stream's error if it
        # failed and the edge handled that, else the client stopped reading.
        ending = exc if exc is not None else self._error or asyncio.CancelledError()
        self._count(ending)
        self.frontend.abort_quietly(self.request_id, self._outputs)
        if self._outputs is not None and hasattr(self._outputs, "aclose"):
            try:
                await self._outputs.aclose()
            except Exception:  # noqa: BLE001 - closing a dead stream must not mask the cause
                log.debug("closing the output stream of %s failed", self.request_id,
                          exc_info=True)

    def _count(self, exc: BaseException) -> None:
        if not isinstance(exc, (PagedServeError, *CLIENT_GONE)):
            log.error("request %s failed with an internal error", self.request_id, exc_info=exc)
        code = self.frontend.ending_code(exc, self._deadline)
        self.frontend.count_failure(code, self.api)
        self.frontend.log_request(self, code.name, None)
