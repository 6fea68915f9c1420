"""An API worker's view of the engine: the `Engine` interface (router/types.py) over the
worker's DEALER socket to the router core (edge_hub.py is the other end).

    submit(spec)   a local OutputChannel first, then Submit -> Reply (the core's admission
                   error re-raised here as the same PagedServeError) -> the channel's stream
    Outputs        the token columns (one token of a sample a row), then each item to its
                   request's channel: deltas, then finish(usage) or fail(error); the core
                   sends one Outputs per step for all of them.
                   The core sends token ids and the token stops only; each sample's text is
                   assembled here (`TextAssembler`, the same rules as in the router process),
                   and a stop string found here ends the sample in the core (StopSample);
                   tokens the core sampled for it meanwhile are dropped here, and the usage's
                   completion_tokens is what this side handed out
    abort(id)      a request of this worker: Forget (no answer; the stream is dropped here)
    abort_anywhere(id), cluster_status()   round trips (the Abort RPC may name a request
                   another worker runs; the status is the core's)
    model_info(), is_serving()   from the core's EdgeStatus pushes

`MetricsRelay` stands in for RouterMetrics in the worker's Frontend: the request metrics
the edges record are sent to the core in batches and counted there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import AsyncIterator

import grpc
import msgspec
import numpy as np
import zmq

from ..protos.zmq_io import NOBLOCK
from .detokenizer import TextAssembler
from .edge_wire import (
    AbortCall,
    EdgeCodec,
    EdgeHello,
    EdgeStatus,
    EdgeStop,
    Forget,
    LoraCall,
    MetricsBatch,
    Outputs,
    Reply,
    ResponseCall,
    StatusCall,
    StopSample,
    Submit,
    TokenDelta,
    WeightCall,
)
from .errors import AlreadyExists, InvalidRequest, NotFound, PagedServeError, QueueFull, Unavailable
from .sequence import OutputChannel
from .tokenizer import Tokenizer
from .types import (
    ClusterStatusData,
    CompletionDelta,
    ModelInfoData,
    RequestOutput,
    RequestSpec,
)
from .zmq_reader import SocketReader

log = logging.getLogger("pagedserve.router.worker")

ERRORS = {cls.__name__: cls for cls in (InvalidRequest, AlreadyExists, NotFound, QueueFull,
                                        Unavailable, PagedServeError)}
METRICS_FLUSH_S = 0.05


def error_from(name: str, message: str, field: str = "") -> Exception:
    """The core's error, rebuilt: a PagedServeError by class name (its field too), else an
    internal error."""
    cls = ERRORS.get(name)
    if cls is None:
        return RuntimeError(f"router core: {message}")
    return cls(message, field=field or None) if cls in (InvalidRequest, NotFound) else \
        cls(message)


class RemoteRequest:
    """One request of this worker: its output channel and each sample's text assembly."""

    __slots__ = ("channel", "assemblers")

    def __init__(self, channel: OutputChannel, assemblers: list[TextAssembler]) -> None:
        self.channel = channel
        self.assemblers = assemblers


class RemoteEngine:
    """Implements `router.types.Engine` in an API worker (see the module docstring)."""

    def __init__(self, core_address: str, worker: int, info: ModelInfoData,
                 tokenizer: Tokenizer) -> None:
        self.worker = worker
        self.info = info
        self.tokenizer = tokenizer
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IDENTITY, f"api-worker-{worker}".encode())
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.connect(core_address)
        self._codec_out = EdgeCodec(to_core=True)
        self._codec_in = EdgeCodec(to_core=False)
        self._reader = SocketReader(self._sock, self._receive, log)
        self._streams: dict[str, RemoteRequest] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        self.status = EdgeStatus(serving=False, draining=False, dtype=info.dtype,
                                 lora_adapters=info.lora_adapters)
        self.status_changed = asyncio.Event()
        self.stopped = asyncio.Event()  # the core said EdgeStop
        self.connected = asyncio.Event()  # the core answered the hello
        self.weights = RemoteWeights(self)  # the weight routes' calls, done by the core

    def start(self, grpc_port: int, http_port: int, pid: int) -> None:
        self._reader.start()
        self.send(EdgeHello(worker=self.worker, pid=pid, grpc_port=grpc_port,
                            http_port=http_port))

    def close(self) -> None:
        self._reader.stop()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(Unavailable("the router core is gone"))
        self._sock.close(0)
        self._ctx.term()

    def send(self, msg) -> None:
        self._sock.send(self._codec_out.encode(msg), NOBLOCK)
        self._reader.poke()

    async def _call(self, msg_of_call) -> Reply:
        # The servers listen a moment before the hello is answered: the core ignores
        # messages from a worker it has not met yet.
        await self.connected.wait()
        call = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call] = fut
        try:
            self.send(msg_of_call(call))
            return await fut
        finally:
            self._calls.pop(call, None)

    # ------------------------------------------------------------------ Engine

    async def submit(self, spec: RequestSpec) -> AsyncIterator[RequestOutput]:
        request_id = spec.request_id
        if request_id in self._streams:
            raise AlreadyExists(f"request {request_id!r} is already running")
        name = spec.lora_adapter
        if name and name not in self.status.lora_adapters:  # --lora-dir: loaded first
            reply = await self._call(lambda call: LoraCall(call, name, True))
            if reply.error:
                raise error_from(reply.error, reply.message, reply.field)
        channel = OutputChannel()
        self._streams[request_id] = RemoteRequest(channel, [
            TextAssembler(self.tokenizer, spec.sampling, spec.prompt_token_ids,
                          eos_token_ids=self.info.eos_token_ids,
                          max_model_len=self.info.max_model_len)
            for _ in range(spec.sampling.n)])
        try:
            reply = await self._call(lambda call: Submit(call, spec))
        except BaseException:  # cancelled while waiting: the core may have admitted it
            if self._streams.pop(request_id, None) is not None:
                self.send(Forget(request_id))
            raise
        if reply.error:
            self._streams.pop(request_id, None)
            raise error_from(reply.error, reply.message, reply.field)
        return channel.open_stream(request_id)

    def abort_stream(self, request_id: str, stream) -> bool:
        """`abort`, only if `stream` (what `submit` returned) is this worker's request under
        that id (RouterEngine.abort_stream)."""
        req = self._streams.get(request_id)
        if req is None or req.channel.reader is not stream:
            return False
        return self.abort(request_id)

    def abort(self, request_id: str) -> bool:
        """A request of this worker: the core aborts it; its stream here is dropped (the edge
        that calls this has stopped reading it)."""
        if self._streams.pop(request_id, None) is None:
            return False
        self.send(Forget(request_id))
        return True

    async def abort_anywhere(self, request_id: str) -> bool:
        """The Abort RPC: the request may run on another worker; the core knows. The stream
        of a request of this worker stays: it ends with the abort's final item."""
        reply = await self._call(lambda call: AbortCall(call, request_id))
        return reply.found

    def model_info(self) -> ModelInfoData:
        status = self.status
        if status.dtype == self.info.dtype and status.lora_adapters == self.info.lora_adapters:
            return self.info
        return dataclasses.replace(self.info, dtype=status.dtype,
                                   lora_adapters=status.lora_adapters)

    @property
    def lora_adapters(self) -> tuple[str, ...]:
        """The LoRA adapters requests may name now (the core's, pushed with its status)."""
        return self.status.lora_adapters

    async def load_lora_adapter(self, name: str, path: str) -> None:
        reply = await self._call(lambda call: LoraCall(call, name, True, path))
        if reply.error:
            raise error_from(reply.error, reply.message, reply.field)

    async def unload_lora_adapter(self, name: str) -> None:
        reply = await self._call(lambda call: LoraCall(call, name, False))
        if reply.error:
            raise error_from(reply.error, reply.message, reply.field)

    async def weight_call(self, **fields) -> Reply:
        """A WeightCall round trip; the core's error re-raised here."""
        reply = await self._call(lambda call: WeightCall(call, **fields))
        if reply.error:
            raise error_from(reply.error, reply.message, reply.field)
        return reply

    async def response_call(self, **fields) -> Reply:
        """A ResponseCall round trip; the core's error re-raised here."""
        reply = await self._call(lambda call: ResponseCall(call, **fields))
        if reply.error:
            raise error_from(reply.error, reply.message, reply.field)
        return reply

    async def cluster_status(self) -> ClusterStatusData:
        reply = await self._call(lambda call: StatusCall(call))
        return reply.status or ClusterStatusData()

    def is_serving(self) -> bool:
        return self.status.serving

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------------ from the core

    def _receive(self, frames: list) -> None:
        try:
            msg = self._codec_in.decode(frames[-1].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("rejected a malformed message from the router core: %s", exc)
            return
        try:
            self._dispatch(msg)
        except Exception:  # noqa: BLE001 - a bug here must not stop the worker's socket
            log.exception("error while handling %s from the router core", type(msg).__name__)

    def _dispatch(self, msg) -> None:
        if isinstance(msg, Outputs):
            streams = self._streams
            for request_id, index, token_id in zip(msg.token_request_ids, msg.token_indexes,
                                                   msg.token_ids, strict=True):
                req = streams.get(request_id)
                if req is not None:  # (None: the client went away; the core was told)
                    self._assemble_token(request_id, req, index, token_id)
            for item in msg.items:
                req = streams.get(item.request_id)
                if req is None:  # the client went away: the core was told
                    continue
                for delta in item.deltas:
                    self._assemble(item.request_id, req, delta)
                if item.usage is not None:
                    usage = item.usage
                    req.channel.finish(dataclasses.replace(  # tokens handed out here
                        usage, completion_tokens=sum(a.num_tokens for a in req.assemblers)),
                        tuple(item.prompt_logprobs),
                        np.frombuffer(item.embedding, dtype="<f4") if item.embedding else None)
                    del streams[item.request_id]
                elif item.error:
                    req.channel.fail(error_from(item.error, item.message))
                    del streams[item.request_id]
        elif isinstance(msg, Reply):
            fut = self._calls.get(msg.call)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, EdgeStatus):
            self.status = msg
            self.connected.set()
            self.status_changed.set()
        elif isinstance(msg, EdgeStop):
            self.stopped.set()

    def _assemble_token(self, request_id: str, req: RemoteRequest, index: int,
                        token_id: int) -> None:
        """`_assemble` of a token column row: one token, no logprobs, nothing ended in the
        core (most tokens: no delta to make, no lists to join)."""
        asm = req.assemblers[index]
        if asm.finished:  # ended here by a stop string: the core's later tokens are dropped
            return
        update = asm.append(token_id)
        if update.finished:  # a stop string (the core sends the token stops' rows as items)
            self.send(StopSample(request_id, index))  # the core did not stop it
            req.channel.put(CompletionDelta(index, update.text, (token_id,), (),
                                            update.finish_reason, update.stop_string,
                                            update.stop_token_id))
        else:
            req.channel.put(CompletionDelta(index, update.text, (token_id,)))

    def _assemble(self, request_id: str, req: RemoteRequest, delta: TokenDelta) -> None:
        """A sample's new tokens from the core -> text, stop strings -> its stream (as the
        router process's text stage does, delivery.py)."""
        asm = req.assemblers[delta.index]
        if asm.finished:  # ended here by a stop string: the core's later tokens are dropped
            return
        parts: list[str] = []
        ids: list[int] = []
        update = None
        for tok in delta.token_ids:
            update = asm.append(tok)
            ids.append(tok)
            parts.append(update.text)
            if update.finished:
                break
        if update is not None and update.finished:
            reason, stop_string, stop_id = (update.finish_reason, update.stop_string,
                                            update.stop_token_id)
            if delta.finish_reason is None or len(ids) < len(delta.token_ids):
                self.send(StopSample(request_id, delta.index))  # the core did not stop it
        elif delta.finish_reason is not None:  # abort, drain: decided in the core
            parts.append(asm.finish(delta.finish_reason))
            reason, stop_string, stop_id = delta.finish_reason, None, delta.stop_token_id
        else:
            reason = stop_string = stop_id = None
        req.channel.put(CompletionDelta(
            index=delta.index, text="".join(parts), token_ids=tuple(ids),
            logprobs=delta.logprobs[:len(ids)], finish_reason=reason, stop_string=stop_string,
            stop_token_id=stop_id))


class MetricsRelay:
    """The request metrics of RouterMetrics (the methods frontend.py calls), batched to the
    core every METRICS_FLUSH_S."""

    def __init__(self, engine: RemoteEngine) -> None:
        self._engine = engine
        self._calls: list[tuple[str, list, str]] = []
        # histogram method -> values since the last batch: one call each in the batch
        # (`observe_many`), not one per value (256 streams: 256 inter-token latencies a step)
        self._values: dict[str, list[float]] = {}
        self._handle: asyncio.TimerHandle | None = None

    def _record(self, name: str, args: list, api: str = "") -> None:
        self._calls.append((name, args, api))
        self._flush_soon()

    def _observe(self, name: str, seconds: float) -> None:
        values = self._values.get(name)
        if values is None:
            self._values[name] = [seconds]
        else:
            values.append(seconds)
        self._flush_soon()

    def _flush_soon(self) -> None:
        if self._handle is None:
            self._handle = asyncio.get_running_loop().call_later(METRICS_FLUSH_S, self.flush)

    def flush(self) -> None:
        self._handle = None
        if (self._calls or self._values) and not self._engine.connected.is_set():
            # see RemoteEngine._call
            self._handle = asyncio.get_running_loop().call_later(METRICS_FLUSH_S, self.flush)
            return
        for name, values in self._values.items():
            self._calls.append(("observe_many", [name, *values], ""))
        self._values = {}
        if self._calls:
            calls, self._calls = self._calls, []
            self._engine.send(MetricsBatch(calls))

    def inc_success(self, finish_reason: str, n: int = 1, *, api: str) -> None:
        self._record("inc_success", [finish_reason, n], api)

    def inc_failure(self, code: grpc.StatusCode | str, *, api: str) -> None:
        self._record("inc_failure", [code.name if isinstance(code, grpc.StatusCode) else code],
                     api)

    def observe_ttft(self, seconds: float) -> None:
        self._observe("observe_ttft", seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self._observe("observe_inter_token", seconds)

    def observe_time_per_output_token(self, seconds: float) -> None:
        self._observe("observe_time_per_output_token", seconds)

    def observe_e2e(self, seconds: float) -> None:
        self._observe("observe_e2e", seconds)


class RemoteWeights:
    """router/weight_sync.WeightSync's coroutines for the weight routes of an API worker:
    each is a WeightCall the core's WeightSync answers."""

    def __init__(self, engine: RemoteEngine) -> None:
        self.engine = engine

    async def update_from_disk(self, path: str, *, abort_all_requests: bool = False,
                               weight_version: str | None = None) -> int:
        reply = await self.engine.weight_call(action="update", path=path,
                                              abort_all=abort_all_requests,
                                              version=weight_version)
        return reply.count

    async def pause(self, mode: str) -> None:
        await self.engine.weight_call(action="pause", mode=mode)

    async def resume(self) -> None:
        await self.engine.weight_call(action="resume")

    async def current_version(self) -> str:
        return (await self.engine.weight_call(action="version")).message

    async def is_paused(self) -> bool:
        return bool((await self.engine.weight_call(action="is_paused")).count)

    async def flush(self, idle_only: bool) -> int:
        return (await self.engine.weight_call(action="flush", idle_only=idle_only)).count


class RemoteResponses:
    """router/response_store.ResponseStore's coroutines in an API worker: each is a
    ResponseCall the core's store answers (so every worker reads the same responses)."""

    def __init__(self, engine: RemoteEngine, enabled: bool) -> None:
        self.engine = engine
        self.enabled = enabled  # --responses-store-mb > 0, as in the core

    async def put(self, response_id: str, record: bytes, *, background: bool = False,
                  request_ids: tuple[str, ...] = (), update: bool = False) -> bool:
        return (await self.engine.response_call(
            action="put", response_id=response_id, record=record, background=background,
            request_ids=tuple(request_ids), update=update)).found

    async def get(self, response_id: str, kind: str = "response") -> bytes | None:
        reply = await self.engine.response_call(action="get", response_id=response_id,
                                                kind=kind)
        return reply.data if reply.found else None

    async def delete(self, response_id: str, kind: str = "response") -> bool:
        return (await self.engine.response_call(action="delete", response_id=response_id,
                                                kind=kind)).found

    async def put_conversation(self, conversation_id: str, record: bytes) -> bool:
        return (await self.engine.response_call(action="put_conversation",
                                                response_id=conversation_id,
                                                record=record)).found

    async def edit_conversation(self, conversation_id: str, append: list[dict] | None = None,
                                drop_item: str = "", metadata: dict | None = None) -> bytes:
        return (await self.engine.response_call(
            action="edit_conversation", response_id=conversation_id,
            items=msgspec.json.encode(append) if append else b"", item_id=drop_item,
            metadata=msgspec.json.encode(metadata) if metadata is not None else b"")).data

    async def cancel(self, response_id: str) -> bytes:
        return (await self.engine.response_call(action="cancel",
                                                response_id=response_id)).data

    async def add_events(self, response_id: str, events: list[bytes]) -> None:
        await self.engine.response_call(action="add_events", response_id=response_id,
                                        frames=list(events))

    async def events(self, response_id: str, after: int,
                     wait_s: float) -> tuple[list[bytes], bool]:
        reply = await self.engine.response_call(action="events", response_id=response_id,
                                                after=after, wait_s=wait_s)
        return list(reply.frames), reply.found
