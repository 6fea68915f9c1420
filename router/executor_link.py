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
* a StepResult, ErrorReport or goodbye naming an executor whose accepted Hello came from
  another routing id (two processes with one --executor-id; a stale one after the other
  re-registered) -> dropped and logged once an executor: it would have been taken as the
  registered process's (its step ids are those of another step sequence).
* a frame that does not decode -> logged and dropped, never executed.

Security (DESIGN §2). With `curve_keys` (a folder from `pagedserve keygen`) the socket is a
CURVE server: traffic is encrypted and a ZAP handler (`_ZapAuthenticator`, pyzmq's
AsyncioAuthenticator on this socket's context) admits only clients whose public key is one
of the folder's executor keys. A client with another key is refused by ZAP; a NULL
(plaintext) client fails the handshake before ZAP. Both are logged at WARNING from the
socket monitor (`_monitor_loop`), the unknown key by the ZAP handler too. Without keys,
binding beyond loopback is refused unless `allow_insecure`, and logged with what it exposes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import time
import urllib.parse
from collections.abc import Callable

import zmq
import zmq.asyncio
import zmq.auth.asyncio
from zmq.utils.monitor import parse_monitor_message

from ..protos import wire
from ..protos.codec import Codec
from ..protos.zmq_io import NOBLOCK, send_frames
from .zmq_reader import SocketReader

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


class ExecutorLinkError(ValueError):
    """The executor socket cannot be set up as asked (insecure bind, unusable keys)."""


_PROTOCOL_ERRORS = {getattr(zmq, name): name.removeprefix("PROTOCOL_ERROR_").lower()
                    for name in dir(zmq) if name.startswith("PROTOCOL_ERROR_")}
_HINTS = {"zmtp_mechanism_mismatch": "a client without CURVE",
          "zmtp_cryptographic": "a client with a wrong router key"}
_MAX_REFUSAL_LOGS_PER_MIN = 30
ZAP_DOMAIN = "pagedserve"  # set on the socket and configured in the handler: they must match


class _ZapAuthenticator(zmq.auth.asyncio.AsyncioAuthenticator):
    """ZAP handler admitting exactly the executor public keys of a keygen folder."""

    def __init__(self, ctx: zmq.asyncio.Context, allowed: dict[bytes, str]) -> None:
        super().__init__(ctx, log=logging.getLogger("pagedserve.router.zap"))
        self.allowed = allowed  # z85 public key -> key file name
        self._peer = ""

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # ZAP request frames: version, request id, domain, address, identity, mechanism, ...
        self._peer = msg[3].decode(errors="replace") if len(msg) > 3 else "?"
        await super().handle_zap_message(msg)

    def callback(self, domain: str, z85_key: bytes) -> bool:
        """configure_curve_callback's credentials provider."""
        name = self.allowed.get(z85_key)
        if name is None:
            log.warning("refused an executor connection from %s: CURVE key %s is not "
                        "authorized", self._peer, z85_key.decode(errors="replace"))
            return False
        log.debug("admitted an executor connection from %s (%s)", self._peer, name)
        return True


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
        curve_keys: str | None = None,
    ) -> None:
        """Must be called with the event loop running when `curve_keys` is given (the ZAP
        handler is a task on it)."""
        loopback = is_loopback_endpoint(bind)
        if not loopback and not allow_insecure and not curve_keys:
            raise ExecutorLinkError(
                f"refusing to bind the executor socket to {bind}: beyond loopback it accepts "
                "any executor; use --curve-keys, or --allow-insecure on a private network"
            )
        keys = None
        if curve_keys:
            from pagedserve.keygen import KeyFolderError, router_keys
            if not zmq.has("curve"):
                raise ExecutorLinkError("--curve-keys: this libzmq was built without CURVE")
            try:
                keys = router_keys(curve_keys)
            except KeyFolderError as exc:
                raise ExecutorLinkError(f"--curve-keys: {exc}") from None
        elif not loopback:
            log.warning("executor socket bound to %s WITHOUT authentication or encryption "
                        "(--allow-insecure): any host that reaches it can register as an "
                        "executor and receive prompts (token ids) and send back outputs; "
                        "use --curve-keys beyond a private network", bind)
        self._ctx = zmq.asyncio.Context()  # the ZAP handler and the monitor run on it
        self._auth: _ZapAuthenticator | None = None
        # A plain (not zmq.asyncio) socket read from the event loop (zmq_reader.py).
        self._sock = zmq.Socket(self._ctx, zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._monitor: zmq.asyncio.Socket | None = None
        if keys is not None:
            public, secret, allowed = keys
            # The ZAP handler must be bound before the first handshake: without one, libzmq
            # admits every CURVE client that knows the server key.
            self._auth = _ZapAuthenticator(self._ctx, allowed)
            self._auth.start()
            self._auth.configure_curve_callback(domain=ZAP_DOMAIN,
                                                credentials_provider=self._auth)
            self._sock.curve_server = True
            self._sock.curve_publickey = public
            self._sock.curve_secretkey = secret
            self._sock.zap_domain = ZAP_DOMAIN.encode()
            # handshake failures only: a NULL client fails here, before ZAP is asked
            self._monitor = self._sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
            log.info("executor socket %s: CURVE with %d authorized executor key(s) from %s",
                     bind, len(allowed), curve_keys)
        self._sock.bind(bind)
        self.endpoint = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._codec_in = Codec()
        self._codec_out = Codec()
        self._on_hello = on_hello
        self._on_heartbeat = on_heartbeat
        self._on_result = on_result
        self._on_error = on_error
        self._on_goodbye = on_goodbye
        # executor id -> the routing id its accepted Hello came from (its main socket; its
        # heartbeats come from a socket of their own)
        self._main: dict[str, bytes] = {}
        self._impostors_logged: set[str] = set()
        self._reader = SocketReader(self._sock, self._receive, log)
        self._monitor_task: asyncio.Task | None = None

    def start(self) -> None:
        self._reader.start()
        if self._monitor is not None:
            self._monitor_task = asyncio.get_running_loop().create_task(self._monitor_loop())

    async def close(self) -> None:
        self._reader.stop()
        if self._monitor_task is not None:
            self._monitor_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor_task
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(0)
        if self._auth is not None:
            self._auth.stop()
        self._sock.close(0)
        self._ctx.term()

    async def _monitor_loop(self) -> None:
        """Log refused handshakes (NULL clients, unknown keys); at most
        _MAX_REFUSAL_LOGS_PER_MIN lines a minute, so a scanner cannot flood the log."""
        window_start, logged, suppressed = time.monotonic(), 0, 0
        while True:
            try:
                event = parse_monitor_message(await self._monitor.recv_multipart())
            except asyncio.CancelledError:
                raise
            except (zmq.ZMQError, ValueError) as exc:
                log.debug("executor socket monitor: %s", exc)
                await asyncio.sleep(0.1)
                continue
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                log.debug("ZAP refused a CURVE client (%s)", event["value"])
                continue  # the ZAP handler logged it, with the peer and the key
            now = time.monotonic()
            if now - window_start > 60:
                if suppressed:
                    log.warning("%d more refused executor connections in the last minute",
                                suppressed)
                window_start, logged, suppressed = now, 0, 0
            if logged >= _MAX_REFUSAL_LOGS_PER_MIN:
                suppressed += 1
                continue
            logged += 1
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                error = _PROTOCOL_ERRORS.get(event["value"], hex(event["value"]))
                hint = _HINTS.get(error)
            else:  # NO_DETAIL: the peer hung up first (a NULL client that saw CURVE does)
                error = f"connection dropped ({os.strerror(event['value'])})"
                hint = "a client without CURVE, or a port probe"
            log.warning("refused an executor connection on %s: handshake failed, %s%s",
                        event["endpoint"].decode(errors="replace"), error,
                        f" ({hint})" if hint else "")

    def send(self, routing_id: bytes, msg) -> None:
        """Queue a message to one executor socket; never blocks the event loop."""
        frames = self._codec_out.encode(msg)
        try:
            send_frames(self._sock, [routing_id, *frames], NOBLOCK)
        except zmq.Again:
            log.warning("send queue to an executor is full; message dropped")
        self._reader.poke()  # a send can take the signal of messages that arrived

    def _receive(self, frames: list) -> None:
        routing_id = frames[0].bytes
        try:
            msg = self._codec_in.decode(frames[1:])
        except wire.WireError as exc:
            log.warning("rejected a malformed message from an executor socket: %s", exc)
            return
        try:
            self._dispatch(routing_id, msg)
        except Exception:  # a bug in a handler must not stop the link
            log.exception("error while handling %s", type(msg).__name__)

    def _dispatch(self, routing_id: bytes, msg) -> None:
        if isinstance(msg, wire.Hello):
            welcome = self._on_hello(routing_id, msg)
            if welcome.accepted:
                self._main[msg.executor_id] = routing_id
            self.send(routing_id, welcome)
        elif isinstance(msg, (wire.StepResult, wire.ErrorReport, wire.Shutdown)) \
                and self._main.get(msg.executor_id, routing_id) != routing_id:
            if msg.executor_id not in self._impostors_logged:
                self._impostors_logged.add(msg.executor_id)
                log.error("a %s for executor %s came from a connection other than the one "
                          "it registered on; dropped (two executors started with one "
                          "--executor-id?) (logged once an executor)",
                          type(msg).__name__, msg.executor_id)
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
