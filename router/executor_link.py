"""The router's ZeroMQ side: one ROUTER socket that every executor connects to.

Executors key themselves by the `executor_id` inside each message (an executor has two
DEALER sockets: main and heartbeat); the link answers on the routing id a message came from.
What the link does with each message (the executor's side is in executor/process.py):

* Hello            -> `on_hello(hello)` decides; Welcome(accepted/refused) goes back on that
                      routing id, which becomes the executor's main address.
* Shutdown(executor_id) -> `on_goodbye(id, reason)`: the executor is stopping.
* Heartbeat        -> echoed back (the executor's router-loss detector), `on_heartbeat(id)`.
* StepResult       -> `on_result(id, result)`.
* ErrorReport      -> `on_error(id, report)`.
* anything from an executor the router does not know (it restarted, or the executor was
  declared dead) -> Shutdown(exit=False): "register again".
* a frame that does not decode -> logged and dropped, never executed.

Security: binding beyond loopback is refused unless `allow_insecure` (or CURVE keys, once
the security issue lands) — DESIGN §2.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import urllib.parse
from collections.abc import Callable

import zmq
import zmq.asyncio

from ..protos import wire

log = logging.getLogger("pagedserve.router.link")

MAX_MESSAGE_BYTES = 256 << 20


def is_loopback_endpoint(endpoint: str) -> bool:
    """tcp://127.0.0.1:5557 / tcp://localhost:… / ipc:// / inproc:// are local."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = urllib.parse.urlsplit(endpoint).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ExecutorLink:
    def __init__(
        self,
        bind: str,
        *,
        on_hello: Callable[[bytes, wire.Hello], wire.Welcome],
        on_heartbeat: Callable[[str], bool],
        on_result: Callable[[str, wire.StepResult], bool],
        on_error: Callable[[str, wire.ErrorReport], bool],
        on_goodbye: Callable[[str, str], None] | None = None,
        allow_insecure: bool = False,
    ) -> None:
        if not is_loopback_endpoint(bind) and not allow_insecure:
            raise ValueError(
                f"refusing to bind the executor socket to {bind}: beyond loopback it accepts "
                "any executor; use --curve-keys, or --allow-insecure on a private network"
            )
        if not is_loopback_endpoint(bind):
            log.warning("executor socket bound to %s without authentication: any host that "
                        "reaches it can register as an executor and see prompts", bind)
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._sock.bind(bind)
        self.endpoint = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._codec_in = wire.Codec()
        self._codec_out = wire.Codec()
        self._on_hello = on_hello
        self._on_heartbeat = on_heartbeat
        self._on_result = on_result
        self._on_error = on_error
        self._on_goodbye = on_goodbye
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._recv_loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._sock.close(0)
        self._ctx.term()

    def send(self, routing_id: bytes, msg) -> None:
        """Queue a message to one executor socket; never blocks the event loop."""
        frames = self._codec_out.encode(msg)
        try:
            self._sock.send_multipart([routing_id, *frames], copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("send queue to an executor is full; message dropped")

    async def _recv_loop(self) -> None:
        while True:
            try:
                frames = await self._sock.recv_multipart(copy=False)
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as exc:
                log.error("executor socket error: %s", exc)
                await asyncio.sleep(0.1)
                continue
            routing_id = frames[0].bytes
            try:
                msg = self._codec_in.decode(frames[1:])
            except wire.WireError as exc:
                log.warning("rejected a malformed message from an executor socket: %s", exc)
                continue
            try:
                self._dispatch(routing_id, msg)
            except Exception:  # a bug in a handler must not stop the link
                log.exception("error while handling %s", type(msg).__name__)

    def _dispatch(self, routing_id: bytes, msg) -> None:
        if isinstance(msg, wire.Hello):
            self.send(routing_id, self._on_hello(routing_id, msg))
        elif isinstance(msg, wire.Heartbeat):
            if self._on_heartbeat(msg.executor_id):
                self.send(routing_id, msg)
            else:
                self.send(routing_id, wire.Shutdown(reason="unknown executor", exit=False))
        elif isinstance(msg, wire.StepResult):
            if not self._on_result(msg.executor_id, msg):
                self.send(routing_id, wire.Shutdown(reason="unknown executor", exit=False))
        elif isinstance(msg, wire.ErrorReport):
            if not self._on_error(msg.executor_id, msg):
                self.send(routing_id, wire.Shutdown(reason="unknown executor", exit=False))
        elif isinstance(msg, wire.Shutdown) and msg.executor_id:
            if self._on_goodbye is not None:
                self._on_goodbye(msg.executor_id, msg.reason)
        else:
            log.warning("unexpected %s on the executor socket; ignored", type(msg).__name__)
