"""The router core's side of its API workers (`--api-workers N`, router/api_worker.py).

With API workers the public edges (gRPC, HTTP: parsing, validation, tokenizing, chat
templates, detokenizing, stop strings, one stream write per token) run in N processes of
their own, and the router process keeps the engine: admission, routing, scheduling,
StepPlans, applying results and the token stops (EOS, stop ids, lengths). Per step, every
output of a worker's requests leaves the core as one message, so the core's cost per step no
longer grows with a gRPC write and a detokenization per stream.

    worker: Submit(spec) -> hub: engine.admit(spec, channel=ForwardChannel, text=False)
    step:   apply_tokens / text stage (token stops only) -> ForwardChannel.push_token (a
            token that ends nothing: a row of the worker's token columns) or
            deliver/finish/fail (the request's OutputItem) -> one Outputs per worker, sent
            when the loop turn ends (call_soon)
    worker: StopSample(id, index) -> engine.finish_sample: a stop string ended that sample
            (the tokens sampled for it meanwhile are dropped there, as the worker drops them)
    worker: Forget(id) / AbortCall(id) -> engine.abort(id);  StatusCall -> cluster_status
    worker: MetricsBatch -> replayed on the core's RouterMetrics (one /metrics for all)
    worker: WeightCall -> engine.weights (weight_sync.py; a task, as a LoraCall)
    worker: ResponseCall -> the stored Responses (response_store.py; a task: `events` waits)
    worker: LoraCall -> engine.load_lora_adapter / unload_lora_adapter (a task: it waits
            for the executors), then EdgeStatus to every worker, then the Reply
    hub:    EdgeStatus to every worker on hello and whenever serving/draining/dtype change

The socket is an ipc:// path in a private (0700) temporary folder. A worker whose process
exits loses its clients' connections; the hub aborts its requests (`worker_lost`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field

import msgspec
import zmq

from ..protos.zmq_io import NOBLOCK, send_frames
from .edge_wire import (
    EDGE_PROTOCOL_VERSION,
    AbortCall,
    EdgeCodec,
    EdgeHello,
    EdgeStatus,
    EdgeStop,
    Forget,
    LoraCall,
    MetricsBatch,
    OutputItem,
    Outputs,
    Reply,
    ResponseCall,
    StatusCall,
    StopSample,
    Submit,
    TokenDelta,
    WeightCall,
)
from .errors import InvalidRequest, PagedServeError
from .response_store import ResponseStore
from .zmq_reader import SocketReader

log = logging.getLogger("pagedserve.router.edge")

STATUS_POLL_S = 0.05
# RouterMetrics methods a worker may have replayed here (the request metrics of the edges).
RELAYED_METRICS = frozenset({"inc_success", "inc_failure", "observe_ttft",
                             "observe_inter_token", "observe_e2e",
                             "observe_time_per_output_token", "observe_many"})


@dataclass
class WorkerConn:
    """One API worker as the hub sees it."""

    index: int
    routing_id: bytes = b""
    hello: EdgeHello | None = None
    hello_event: asyncio.Event = field(default_factory=asyncio.Event)
    outbox: dict[str, OutputItem] = field(default_factory=dict)  # request id -> outputs
    # the steady decode's tokens since the last flush, as Outputs' token columns
    token_request_ids: list[str] = field(default_factory=list)
    token_indexes: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    requests: set[str] = field(default_factory=set)  # live requests submitted through it


class ForwardChannel:
    """A request's output sink in the core when its client is on an API worker: what the text
    stage puts goes to the worker's outbox (merged per request until the flush)."""

    __slots__ = ("_hub", "_worker", "request_id", "closed")

    def __init__(self, hub: EdgeHub, worker: WorkerConn, request_id: str) -> None:
        self._hub = hub
        self._worker = worker
        self.request_id = request_id
        self.closed = False

    def put(self, delta) -> None:
        self.deliver(delta.index, delta.text, delta.token_ids, delta.logprobs,
                     delta.finish_reason, delta.stop_string, delta.stop_token_id)

    def deliver(self, index: int, text: str, token_ids: tuple, logprobs: tuple,
                finish_reason, stop_string, stop_token_id) -> None:
        """The engine runs text=False assemblers for these requests: no text, no stop
        strings (the worker's); a TokenDelta, not a CompletionDelta (8x cheaper to make and
        to encode)."""
        if not self.closed:
            self._hub.item(self._worker, self.request_id).deltas.append(
                TokenDelta(index, token_ids, logprobs, finish_reason, stop_token_id))

    def push_token(self, index: int, token_id: int) -> None:
        """One token of a sample, no finish, no logprobs (the steady decode): a row of the
        worker's token columns, or a delta of the request's item when it has one in this
        turn already (its outputs stay in order: the worker applies columns first)."""
        if self.closed:
            return
        worker = self._worker
        item = worker.outbox.get(self.request_id)
        if item is not None:
            item.deltas.append(TokenDelta(index, (token_id,)))
            return
        worker.token_request_ids.append(self.request_id)
        worker.token_indexes.append(index)
        worker.token_ids.append(token_id)
        hub = self._hub
        if not hub._flush_scheduled:
            hub.schedule_flush()

    def finish(self, usage, prompt_logprobs: tuple = (), embedding=None) -> None:
        if not self.closed:
            item = self._hub.item(self._worker, self.request_id)
            item.usage = usage
            item.prompt_logprobs = list(prompt_logprobs)
            if embedding is not None:
                item.embedding = embedding.astype("<f4").tobytes()
            self._close()

    def fail(self, error: BaseException) -> None:
        if not self.closed:
            item = self._hub.item(self._worker, self.request_id)
            item.error = type(error).__name__ if isinstance(error, PagedServeError) else "Internal"
            item.message = getattr(error, "message", None) or str(error)
            self._close()

    def _close(self) -> None:
        self.closed = True
        self._worker.requests.discard(self.request_id)


def _clear_columns(conn: WorkerConn) -> None:
    """New token column lists (the old ones went into a message, or are dropped)."""
    conn.token_request_ids, conn.token_indexes, conn.token_ids = [], [], []


class EdgeHub:
    """The ROUTER socket API workers connect to, and what the core does for them."""

    def __init__(self, engine, metrics, responses: ResponseStore | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        # the workers' stored Responses (an empty store is falsy: `is None`, not `or`)
        self.responses = responses if responses is not None else ResponseStore(0)
        self._dir = tempfile.mkdtemp(prefix="pagedserve-edge-")  # 0700: this user only
        self.address = f"ipc://{os.path.join(self._dir, 'core.sock')}"
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker takes its id over
        self._sock.setsockopt(zmq.SNDHWM, 0)  # outputs are never dropped for a live worker
        self._sock.bind(self.address)
        self._codec_in = EdgeCodec(to_core=True)
        self._codec_out = EdgeCodec(to_core=False)
        self._reader = SocketReader(self._sock, self._receive, log)
        self.workers: dict[int, WorkerConn] = {}
        self._by_routing_id: dict[bytes, WorkerConn] = {}
        self._flush_scheduled = False
        self._status: EdgeStatus | None = None
        self._status_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()  # Lora/WeightCalls waiting for the executors
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._reader.start()
        self._status_task = self._loop.create_task(self._status_loop())

    def worker(self, index: int) -> WorkerConn:
        conn = self.workers.get(index)
        if conn is None:
            conn = self.workers[index] = WorkerConn(index)
        return conn

    def stop_workers(self) -> None:
        """Tell every worker to close its servers and exit (after the drain)."""
        self._flush()
        for conn in self.workers.values():
            if conn.routing_id:
                self._send(conn, EdgeStop())

    async def close(self) -> None:
        if self._status_task is not None:
            self._status_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._status_task
        self._reader.stop()
        self._sock.close(0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def worker_lost(self, index: int) -> int:
        """The worker's process is gone, and with it its clients' connections: abort their
        requests (blocks freed). Returns how many."""
        conn = self.workers.get(index)
        if conn is None:
            return 0
        lost = list(conn.requests)
        for request_id in lost:
            self.engine.abort(request_id)
        conn.requests.clear()
        self.responses.worker_lost(index)  # its background responses failed
        conn.outbox.clear()
        _clear_columns(conn)
        conn.hello = None
        conn.hello_event.clear()
        if conn.routing_id:
            self._by_routing_id.pop(conn.routing_id, None)
            conn.routing_id = b""
        return len(lost)

    # ------------------------------------------------------------------ status

    def current_status(self) -> EdgeStatus:
        engine = self.engine
        info = engine.model_info()
        return EdgeStatus(serving=bool(engine.is_serving()), draining=bool(engine.draining),
                          dtype=info.dtype, lora_adapters=info.lora_adapters)

    def push_status(self) -> None:
        """Send the status to every worker if it changed (the drain calls it at once)."""
        status = self.current_status()
        if status == self._status:
            return
        self._status = status
        for conn in self.workers.values():
            if conn.routing_id:
                self._send(conn, status)

    async def _status_loop(self) -> None:
        while True:
            try:
                self.push_status()
            except Exception:  # noqa: BLE001 - keep pushing
                log.exception("API worker status push failed")
            await asyncio.sleep(STATUS_POLL_S)

    # ------------------------------------------------------------------ outputs

    def item(self, conn: WorkerConn, request_id: str) -> OutputItem:
        """The outbox entry of a request (created on first use in this loop turn)."""
        item = conn.outbox.get(request_id)
        if item is None:
            item = conn.outbox[request_id] = OutputItem(request_id, [])
            if not self._flush_scheduled:
                self.schedule_flush()
        return item

    def schedule_flush(self) -> None:
        """Send the outboxes when this loop turn ends."""
        if self._loop is not None:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Every worker's outbox and token columns as one Outputs message each."""
        self._flush_scheduled = False
        sent = False
        for conn in self.workers.values():
            if conn.outbox or conn.token_ids:
                msg = Outputs(list(conn.outbox.values()), conn.token_request_ids,
                              conn.token_indexes, conn.token_ids)
                conn.outbox.clear()
                _clear_columns(conn)
                if conn.routing_id:
                    self._send(conn, msg, poke=False)
                    sent = True
        if sent:
            self._reader.poke()  # once after the turn's sends, not once per worker

    def _send(self, conn: WorkerConn, msg, poke: bool = True) -> None:
        try:
            send_frames(self._sock, (conn.routing_id, self._codec_out.encode(msg)), NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("API worker %d: %s not sent (%s)", conn.index, type(msg).__name__, exc)
        if poke:  # a send can take the signal of messages that arrived (zmq_reader.py)
            self._reader.poke()

    # ------------------------------------------------------------------ calls

    def _receive(self, frames: list) -> None:
        if len(frames) != 2:
            log.warning("rejected a message of %d frames on the API worker socket", len(frames))
            return
        routing_id = frames[0].bytes
        try:
            msg = self._codec_in.decode(frames[1].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("rejected a malformed message on the API worker socket: %s", exc)
            return
        try:
            self._dispatch(routing_id, msg)
        except Exception:  # a bug in a handler must not stop the hub
            log.exception("error while handling %s from an API worker", type(msg).__name__)

    def _dispatch(self, routing_id: bytes, msg) -> None:
        if isinstance(msg, EdgeHello):
            self._on_hello(routing_id, msg)
            return
        conn = self._by_routing_id.get(routing_id)
        if conn is None:
            log.warning("%s from an API worker that did not say hello; ignored",
                        type(msg).__name__)
            return
        engine = self.engine
        if isinstance(msg, Submit):
            self._send(conn, self._submit(conn, msg))
        # A worker's Forget and StopSample name requests it submitted: by the time one
        # arrives, that request may have ended (an Abort through another worker) and a new
        # request on another worker taken its id, which they must not touch.
        elif isinstance(msg, Forget):
            if msg.request_id in conn.requests:
                engine.abort(msg.request_id)
        elif isinstance(msg, StopSample):
            if msg.request_id in conn.requests:
                engine.finish_sample(msg.request_id, msg.index)
        elif isinstance(msg, AbortCall):
            self._send(conn, Reply(msg.call, found=engine.abort(msg.request_id)))
        elif isinstance(msg, StatusCall):
            self._send(conn, Reply(msg.call, status=engine.cluster_status()))
        elif isinstance(msg, (LoraCall, WeightCall, ResponseCall)):
            call = (self._lora_call if isinstance(msg, LoraCall) else
                    self._weight_call if isinstance(msg, WeightCall) else self._response_call)
            task = asyncio.ensure_future(call(conn, msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif isinstance(msg, MetricsBatch):
            self._replay_metrics(conn, msg)

    def _on_hello(self, routing_id: bytes, hello: EdgeHello) -> None:
        if hello.version != EDGE_PROTOCOL_VERSION:
            log.error("API worker %d speaks edge protocol %d, not %d; ignored", hello.worker,
                      hello.version, EDGE_PROTOCOL_VERSION)
            return
        conn = self.worker(hello.worker)
        if conn.routing_id and conn.routing_id != routing_id:
            self._by_routing_id.pop(conn.routing_id, None)
        conn.routing_id = routing_id
        conn.hello = hello
        self._by_routing_id[routing_id] = conn
        self._status = self._status or self.current_status()
        self._send(conn, self._status)
        conn.hello_event.set()
        log.info("API worker %d (pid %d) connected: grpc port %d, http port %s", hello.worker,
                 hello.pid, hello.grpc_port, hello.http_port if hello.http_port >= 0 else "off")

    async def _lora_call(self, conn: WorkerConn, msg: LoraCall) -> None:
        """A worker's load or unload (it waits for the executors): every worker learns the
        new adapter names before the caller's answer, so a request of the caller's client
        naming the adapter finds it wherever it lands."""
        engine = self.engine

        async def work() -> None:
            if msg.load and not msg.path:  # a request's adapter (--lora-dir)
                await engine.resolve_lora_adapter(msg.name)
            elif msg.load:
                await engine.load_lora_adapter(msg.name, msg.path)
            else:
                await engine.unload_lora_adapter(msg.name)
        reply = await self._reply(conn, msg.call, "LoRA", work())
        self.push_status()
        if conn.routing_id:
            self._send(conn, reply)

    async def _weight_call(self, conn: WorkerConn, msg: WeightCall) -> None:
        """A worker's weight route, done by the core's WeightSync (it may wait for the
        running requests and the executors)."""
        weights = self.engine.weights

        async def work() -> dict:
            if msg.action == "update":
                return {"count": await weights.update_from_disk(
                    msg.path, abort_all_requests=msg.abort_all, weight_version=msg.version)}
            if msg.action == "pause":
                await weights.pause(msg.mode)
            elif msg.action == "resume":
                await weights.resume()
            elif msg.action == "version":
                return {"message": await weights.current_version()}
            elif msg.action == "is_paused":
                return {"count": int(await weights.is_paused())}
            elif msg.action == "flush":
                return {"count": await weights.flush(msg.idle_only)}
            else:
                raise InvalidRequest(f"unknown weight call {msg.action!r}")
            return {}
        reply = await self._reply(conn, msg.call, "weight", work())
        if conn.routing_id:
            self._send(conn, reply)

    async def _response_call(self, conn: WorkerConn, msg: ResponseCall) -> None:
        """A worker's call on the stored Responses (an `events` call may wait for them)."""
        store, rid = self.responses, msg.response_id

        async def work() -> dict:
            if msg.action == "put":
                return {"found": await store.put(rid, msg.record, background=msg.background,
                                                 request_ids=msg.request_ids,
                                                 owner=conn.index, update=msg.update)}
            if msg.action == "get":
                record = await store.get(rid, msg.kind)
                return {"found": record is not None, "data": record or b""}
            if msg.action == "delete":
                return {"found": await store.delete(rid, msg.kind)}
            if msg.action == "put_conversation":
                return {"found": await store.put_conversation(rid, msg.record)}
            if msg.action == "edit_conversation":
                return {"data": await store.edit_conversation(
                    rid, msgspec.json.decode(msg.items) if msg.items else None, msg.item_id,
                    msgspec.json.decode(msg.metadata) if msg.metadata else None)}
            if msg.action == "cancel":
                return {"data": await store.cancel(rid)}
            if msg.action == "add_events":
                await store.add_events(rid, msg.frames)
                return {}
            if msg.action == "events":
                frames, over = await store.events(rid, msg.after, msg.wait_s)
                return {"frames": frames, "found": over}
            raise InvalidRequest(f"unknown response call {msg.action!r}")
        reply = await self._reply(conn, msg.call, "response", work())
        if conn.routing_id:
            self._send(conn, reply)

    @staticmethod
    async def _reply(conn: WorkerConn, call: int, what: str, work) -> Reply:
        """The Reply to a worker's call once ``work`` (a coroutine; its result: the Reply's
        fields, or None) has run: the domain error it raised, or Internal for a bug (logged):
        answered, never left hanging."""
        try:
            fields = await work
        except PagedServeError as exc:
            return Reply(call, error=type(exc).__name__, message=exc.message,
                         field=getattr(exc, "field", None) or "")
        except Exception as exc:  # noqa: BLE001
            log.exception("API worker %d: %s call failed", conn.index, what)
            return Reply(call, error="Internal", message=str(exc) or type(exc).__name__)
        return Reply(call, **(fields or {}))

    def _submit(self, conn: WorkerConn, msg: Submit) -> Reply:
        request_id = msg.spec.request_id
        try:
            self.engine.admit(msg.spec, channel=ForwardChannel(self, conn, request_id),
                              text=False)
        except PagedServeError as exc:
            return Reply(msg.call, error=type(exc).__name__, message=exc.message,
                         field=getattr(exc, "field", None) or "")
        except Exception as exc:  # noqa: BLE001 - a bug: INTERNAL for this request only
            log.exception("admitting request %s failed", request_id)
            return Reply(msg.call, error="Internal", message=str(exc) or type(exc).__name__)
        conn.requests.add(request_id)
        return Reply(msg.call)

    def _replay_metrics(self, conn: WorkerConn, batch: MetricsBatch) -> None:
        for name, args, api in batch.calls:
            if name not in RELAYED_METRICS:
                log.warning("API worker %d sent an unknown metric call %r; ignored",
                            conn.index, name)
                continue
            method = getattr(self.metrics, name)
            try:
                method(*args, api=api) if api else method(*args)
            except (TypeError, ValueError) as exc:
                log.warning("API worker %d: metric call %s%r failed: %s", conn.index, name,
                            tuple(args), exc)
