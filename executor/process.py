"""The executor process: registers with the router over ZeroMQ and serves StepPlans.

Sockets. The main DEALER (this thread) carries Hello -> Welcome, StepPlan -> StepResult,
Shutdown and ErrorReport. A second DEALER, owned by the heartbeat thread (zmq sockets are
not thread-safe), sends ``Heartbeat(executor_id)`` every ``--heartbeat-timeout / 4`` seconds
while registered. Neither socket sets a routing id: the router keys executors by the
``executor_id`` inside the messages and answers on the routing id a message came from.

Router loss and return (what the router does):
* it echoes every Heartbeat of a registered executor back on the heartbeat socket (any
  message will do; an echoed Heartbeat is simplest);
* to a Heartbeat, StepResult or ErrorReport from an executor it does not know (it restarted,
  or declared the executor dead), it answers ``Shutdown(exit=False)`` on that socket.
The executor:
* treats ``Shutdown(exit=False)`` (on either socket) as "register again": it forgets every
  request, closes its main socket and sends a new Hello (its cache is empty from then on);
* once it has seen one heartbeat echo (ever), declares the router lost after
  ``2.5 * --heartbeat-timeout`` seconds without hearing anything from it (echo or message),
  and re-registers the same way. (A router that never echoes is tolerated: no loss detection.)
* registering: Hello, then up to 5 s for Welcome; otherwise the socket is dropped and Hello
  is sent again on a fresh one after a backoff of 0.5, 1, 2, 4, 8, 8, ... s, forever.
  ``Welcome(accepted=False)`` exits with code 3 and the reason on stderr.
* with ``--parent-pid`` (or ``PAGEDSERVE_PARENT_PID``, set by ``serve``) it exits (code 1)
  within about a second of its parent's death, whatever it is doing between steps.
* ``Shutdown(exit=True)`` exits with code 0.
A message that does not decode (unknown type/version, malformed) is logged and answered with
``ErrorReport``; it is never executed.

Exit codes: 0 shutdown, 1 parent died, 2 bad flags or model directory, 3 refused by router.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import random
import signal
import socket
import sys
import threading
import time

import zmq
from pagedserve.protos.wire import (
    Codec,
    ErrorReport,
    Heartbeat,
    Hello,
    Shutdown,
    StepPlan,
    Welcome,
    WireError,
)

log = logging.getLogger("pagedserve.executor")

WELCOME_TIMEOUT_S = 5.0
MAX_MESSAGE_BYTES = 256 << 20
MAX_BACKOFF_S = 8.0
POLL_MS = 200


def _setup_logging(fmt: str) -> None:
    from pagedserve.logs import setup_logging
    setup_logging(fmt)


# --------------------------------------------------------------------------------- parent


class ParentWatch:
    """Is the process that started us alive? Reparenting (our parent pid changed) or a
    failed signal-0 probe means no."""

    def __init__(self, parent_pid: int | None) -> None:
        self.pid = parent_pid
        self.direct = parent_pid is not None and parent_pid == os.getppid()

    def alive(self) -> bool:
        if not self.pid:
            return True
        if self.direct and os.getppid() != self.pid:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


# --------------------------------------------------------------------------------- heartbeat


class HeartbeatThread(threading.Thread):
    """Sends Heartbeats on its own DEALER while ``registered`` is set; records when the
    router last answered and whether it asked us to register again."""

    def __init__(self, ctx: zmq.Context, address: str, executor_id: str, interval_s: float,
                 configure) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.ctx, self.address, self.executor_id = ctx, address, executor_id
        self.interval_s = interval_s
        self.configure = configure
        self.registered = threading.Event()
        self.stop = threading.Event()
        self.reregister = threading.Event()
        self.last_reply = 0.0  # monotonic; 0 = never
        self.steps_done = 0

    def run(self) -> None:
        codec = Codec()
        sock = self.ctx.socket(zmq.DEALER)
        self.configure(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.connect(self.address)
        next_beat = 0.0
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                if self.registered.is_set() and now >= next_beat:
                    beat = Heartbeat(executor_id=self.executor_id, time_s=time.time(),
                                     steps_done=self.steps_done)
                    with contextlib.suppress(zmq.Again):
                        sock.send_multipart(codec.encode(beat), flags=zmq.NOBLOCK, copy=False)
                    next_beat = now + self.interval_s
                if sock.poll(min(POLL_MS, int(self.interval_s * 1000))):
                    frames = sock.recv_multipart(copy=False)
                    try:
                        msg = codec.decode(frames)
                    except WireError as exc:
                        log.warning("heartbeat socket: rejected message: %s", exc)
                        continue
                    self.last_reply = time.monotonic()
                    if isinstance(msg, Shutdown) and not msg.exit:
                        self.reregister.set()
        finally:
            sock.close(0)


# --------------------------------------------------------------------------------- process


class ExecutorProcess:
    def __init__(self, runner, args: argparse.Namespace, hello: Hello,
                 curve: tuple[bytes, bytes, bytes] | None = None) -> None:
        """`curve`: (public, secret, router public) as `load_curve_keys` returns; loaded
        from ``args.curve_keys`` when not given."""
        self.curve = curve if curve is not None else load_curve_keys(args)
        self.runner = runner
        self.args = args
        self.hello = hello
        self.executor_id = hello.executor_id
        self.codec = Codec()
        self.ctx = zmq.Context()
        self.parent = ParentWatch(args.parent_pid)
        self.loss_timeout_s = 2.5 * args.heartbeat_timeout
        self.sock: zmq.Socket | None = None
        self.last_heard = 0.0
        self.heartbeat = HeartbeatThread(self.ctx, args.router, self.executor_id,
                                         args.heartbeat_timeout / 4, self._configure)

    def _configure(self, sock: zmq.Socket) -> None:
        """Both DEALERs (main and heartbeat): a CURVE client with --curve-keys (our pair and
        the router's public key from the keygen folder, see pagedserve.keygen); the router's
        ZAP handler admits only authorized keys, so an unauthorized executor never hears a
        Welcome and keeps retrying (logged). Messages over MAX_MESSAGE_BYTES are dropped by
        ZeroMQ before they are read (a plan for 256 running requests is ~12 KB)."""
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if self.curve is None:
            return
        public, secret, server_public = self.curve
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_serverkey = server_public

    # ---------------------------------------------------------------------------- sockets
    def _send(self, msg) -> None:
        self.sock.send_multipart(self.codec.encode(msg), copy=False)

    def _new_socket(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
        self.sock = self.ctx.socket(zmq.DEALER)
        self._configure(self.sock)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.args.router)

    def _check_parent(self) -> None:
        if getattr(self, "stopping", False) and not self.heartbeat.registered.is_set():
            raise SystemExit(0)  # SIGTERM while (re-)registering: nothing to hand over
        if not self.parent.alive():
            log.error("parent process %s died; exiting", self.parent.pid)
            raise SystemExit(1)

    def register(self) -> None:
        """Hello until Welcome, with backoff; starts from an empty cache state."""
        self.heartbeat.registered.clear()
        self.runner.reset()
        attempt = 0
        while True:
            self._check_parent()
            self._new_socket()
            log.info("registering with %s as %s", self.args.router, self.executor_id)
            self._send(self.hello)
            deadline = time.monotonic() + WELCOME_TIMEOUT_S
            while time.monotonic() < deadline:
                self._check_parent()
                if not self.sock.poll(POLL_MS):
                    continue
                msg = self._recv()
                if isinstance(msg, Welcome):
                    if not msg.accepted:
                        print(f"pagedserve executor: refused by the router: {msg.reason}",
                              file=sys.stderr)
                        raise SystemExit(3)
                    log.info("registered with %s", self.args.router)
                    self.last_heard = time.monotonic()
                    self.heartbeat.reregister.clear()
                    self.heartbeat.registered.set()
                    return
                if isinstance(msg, Shutdown) and msg.exit:
                    raise SystemExit(0)
            backoff = min(MAX_BACKOFF_S, 0.5 * 2 ** attempt)
            attempt += 1
            log.warning("no Welcome from %s%s; retrying in %.1f s", self.args.router,
                        " (is this executor's CURVE key authorized there?)"
                        if self.curve else "", backoff)
            end = time.monotonic() + backoff
            while time.monotonic() < end:
                self._check_parent()
                time.sleep(min(0.2, max(0.0, end - time.monotonic())))

    def _recv(self):
        """One message from the main socket, or None when it does not decode."""
        frames = self.sock.recv_multipart(copy=False)
        self.last_heard = time.monotonic()
        try:
            return self.codec.decode(frames)
        except WireError as exc:
            log.error("rejected a message from the router: %s", exc)
            self._send(ErrorReport(message=f"rejected: {exc}", executor_id=self.executor_id))
            return None

    def _router_lost(self) -> bool:
        hb = self.heartbeat
        if hb.reregister.is_set():
            log.warning("router asked us to register again")
            return True
        if hb.last_reply == 0.0:
            return False  # this router never echoed a heartbeat: loss detection off
        silent = time.monotonic() - max(self.last_heard, hb.last_reply)
        if silent > self.loss_timeout_s:
            log.warning("router silent for %.1f s; registering again", silent)
            return True
        return False

    def _install_signal_handlers(self) -> None:
        """SIGTERM (and SIGINT, unless `serve` is the parent: Ctrl-C reaches the whole
        process group, and the parent drains) ends serving between two steps: the executor
        tells the router it is stopping, so its requests move to other executors at once."""
        def stop(signum, frame):
            self.stopping = True
        signal.signal(signal.SIGTERM, stop)
        if self.args.parent_pid is None:
            signal.signal(signal.SIGINT, stop)
        else:
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    def _say_goodbye(self) -> None:
        log.info("stopping: handing my requests back to the router")
        if self.sock is not None:
            self.sock.setsockopt(zmq.LINGER, 1000)  # let the goodbye leave before close
            self._send(Shutdown(reason="executor stopping", executor_id=self.executor_id))

    def serve(self) -> int:
        """Register, then execute plans in order until Shutdown(exit=True) or SIGTERM."""
        self.stopping = False
        with contextlib.suppress(ValueError):  # not the main thread (in-process tests)
            self._install_signal_handlers()
        self.heartbeat.start()
        try:
            self.register()
            while True:
                if self.stopping:
                    self._say_goodbye()
                    return 0
                self._check_parent()
                if self._router_lost():
                    self.register()
                    continue
                if not self.sock.poll(POLL_MS):
                    continue
                msg = self._recv()
                if isinstance(msg, StepPlan):
                    result = self.runner.execute(msg)
                    self.heartbeat.steps_done = self.runner.steps_done
                    self._send(result)
                elif isinstance(msg, Shutdown):
                    if msg.exit:
                        log.info("shutdown: %s", msg.reason or "asked by the router")
                        return 0
                    log.info("router asked us to forget all state: %s", msg.reason)
                    self.register()
                elif msg is not None and not isinstance(msg, Welcome):
                    log.warning("ignoring %s on the main socket", type(msg).__name__)
        finally:
            self.heartbeat.stop.set()
            self.heartbeat.join(timeout=2)
            if self.sock is not None:
                self.sock.close(0)
            self.ctx.term()


def load_curve_keys(args: argparse.Namespace) -> tuple[bytes, bytes, bytes] | None:
    """(own public, own secret, router public) from ``--curve-keys``; None without it.
    Raises pagedserve.keygen.KeyFolderError."""
    if not getattr(args, "curve_keys", None):
        return None
    from pagedserve.keygen import KeyFolderError, executor_keys
    if not zmq.has("curve"):
        raise KeyFolderError("this libzmq was built without CURVE")
    return executor_keys(args.curve_keys)


def default_executor_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{random.randbytes(3).hex()}"


def run_executor(args: argparse.Namespace) -> int:
    """Entry point for ``pagedserve executor`` (args from ``pagedserve.flags``)."""
    import torch
    from pagedserve.executor.model_runner import build_runner
    from pagedserve.executor.models import ModelNotSupported

    from pagedserve.logs import progress_bars_enabled

    _setup_logging(args.log_format)
    if args.parent_pid is None and os.environ.get("PAGEDSERVE_PARENT_PID"):
        args.parent_pid = int(os.environ["PAGEDSERVE_PARENT_PID"])
    from pagedserve.keygen import KeyFolderError
    try:
        curve = load_curve_keys(args)  # before the model loads: a bad folder fails fast
    except KeyFolderError as exc:
        print(f"pagedserve executor: --curve-keys: {exc}", file=sys.stderr)
        return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cpu"):
        torch.set_num_threads(max(1, args.cpu_threads))
    torch.manual_seed(args.seed)
    executor_id = args.executor_id or default_executor_id()
    try:
        runner = build_runner(
            args.model, device=device, dtype=args.dtype, block_size=args.block_size,
            num_gpu_blocks=args.num_gpu_blocks, num_cpu_blocks=args.num_cpu_blocks,
            kv_cache_space=args.kv_cache_space, swap_space=args.swap_space,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens, executor_id=executor_id,
            progress=progress_bars_enabled(args.log_format),
        )
    except (ModelNotSupported, FileNotFoundError, ValueError) as exc:
        print(f"pagedserve executor: {exc}", file=sys.stderr)
        return 2
    cache = runner.cache
    hello = Hello(
        executor_id=executor_id, model_fingerprint=runner.model.config.fingerprint,
        device=str(cache.device), dtype=str(cache.kv_cache.dtype).removeprefix("torch."),
        block_size=cache.block_size, num_gpu_blocks=cache.num_gpu_blocks,
        num_cpu_blocks=cache.num_cpu_blocks, max_model_len=runner.max_model_len,
        pid=os.getpid(), hostname=socket.gethostname(),
    )
    log.info("executor %s: %s on %s (%s), %d device blocks, %d cpu blocks of %d tokens",
             executor_id, runner.model.config.architecture, hello.device, hello.dtype,
             hello.num_gpu_blocks, hello.num_cpu_blocks, hello.block_size)
    try:
        return ExecutorProcess(runner, args, hello, curve=curve).serve()
    except SystemExit as exc:
        return int(exc.code or 0)
    except KeyboardInterrupt:
        return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m pagedserve.executor.process ...` is `pagedserve executor ...`: one flag table
    (pagedserve/flags.py, DESIGN §4) for every way of starting an executor."""
    from pagedserve.cli import main as cli_main

    return cli_main(["executor", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
