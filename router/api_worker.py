"""One API worker process (`--api-workers N`; started by the router, api_workers.py).

    python -m pagedserve.router.api_worker --core ipc://… --worker I --grpc-port P
        --http-port H --parent-pid PID          (the router's flags in PAGEDSERVE_EDGE_ARGS)

It serves the public edges exactly as the router process does without workers (the same
grpc_server.py, http_server.py and frontend.py), with a RemoteEngine in place of the engine:
gRPC and HTTP share their ports with the other workers (SO_REUSEPORT: the kernel spreads
connections over them). It says hello to the core once listening; the core's EdgeStatus
drives health and draining; EdgeStop (after the core's drain) closes it. It exits when the
router process is gone. SIGINT and SIGTERM are ignored: a terminal's Ctrl-C, `timeout` or a
service manager signal the whole process group, and the streams of a draining router must
go on until the router stops its workers (SIGKILL stops one at once).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys

from pagedserve import event_loop
from pagedserve.gc_tuning import freeze_heap
from pagedserve.logs import setup_logging
from pagedserve.subprocs import ParentWatch

from .api_workers import ARGS_ENV, BIND_ERROR_EXIT
from .app import limits_from_args, model_info_from_args
from .edge_security import edge_security
from .edges import edge_frontend, http_options
from .grpc_server import start_server
from .http_server import start_http_server
from .remote_engine import MetricsRelay, RemoteEngine, RemoteResponses
from .tokenizer import Tokenizer

log = logging.getLogger("pagedserve.router.worker")

PARENT_POLL_S = 0.5


async def run_worker(args: argparse.Namespace, core: str, worker: int, grpc_port: int,
                     http_port: int, parent: ParentWatch) -> int:
    info, _ = model_info_from_args(args)
    tokenizer = Tokenizer.from_dir(args.model, getattr(args, "chat_template", None))
    engine = RemoteEngine(core, worker, info, tokenizer)
    relay = MetricsRelay(engine)
    frontend = edge_frontend(args, engine, tokenizer, limits_from_args(args, info), relay)
    security = edge_security(args)
    server = http = None
    try:
        server, port = await start_server(frontend, args.host, grpc_port, reuse_port=True,
                                          **security)
        if http_port >= 0:
            http = await start_http_server(
                frontend, args.host, http_port, max_model_len=info.max_model_len,
                reuse_port=True, **http_options(args), **security,
                response_store=RemoteResponses(engine, args.responses_store_mb > 0))
    except OSError as exc:
        print(f"pagedserve api worker {worker}: {exc}", file=sys.stderr, flush=True)
        if server is not None:
            await server.stop(0)
        engine.close()
        return BIND_ERROR_EXIT
    engine.start(port, http.port if http is not None else -1, os.getpid())
    freeze_heap()  # start-up's objects out of the collector's reach (pagedserve/gc_tuning.py)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # the router decides (module docstring)
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, lambda: None)

    orphaned = False

    async def follow_core() -> None:
        """Draining when the core says so; stop on EdgeStop or when the router is gone."""
        nonlocal orphaned
        drained = False
        while not stop.is_set():
            if engine.status.draining and not drained:
                drained = True
                await server.drain()  # health NOT_SERVING, new requests UNAVAILABLE
            orphaned = not parent.alive()
            if engine.stopped.is_set() or orphaned:
                stop.set()
                return
            engine.status_changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(engine.status_changed.wait(), PARENT_POLL_S)

    follower = loop.create_task(follow_core())
    await stop.wait()
    follower.cancel()
    log.info("API worker %d stopping (%d open streams%s)", worker, engine.num_streams,
             "; the router is gone" if orphaned else "")
    if http is not None:
        await http.stop()
    # Without a router its streams are dead: free the ports at once for the next router.
    await server.stop(grace=0 if orphaned else 1.0)
    relay.flush()
    engine.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pagedserve-api-worker")
    ap.add_argument("--core", required=True, help="the router core's ipc:// address")
    ap.add_argument("--worker", type=int, required=True)
    ap.add_argument("--grpc-port", type=int, required=True)
    ap.add_argument("--http-port", type=int, required=True, help="-1: HTTP off")
    ap.add_argument("--parent-pid", type=int, default=None)
    ns = ap.parse_args(argv)
    try:
        args = argparse.Namespace(**json.loads(os.environ[ARGS_ENV]))
    except (KeyError, ValueError) as exc:
        print(f"pagedserve api worker: {ARGS_ENV} is missing or not JSON ({exc})",
              file=sys.stderr)
        return 2
    setup_logging(args.log_format)
    return event_loop.run(run_worker(args, ns.core, ns.worker, ns.grpc_port, ns.http_port,
                                  ParentWatch(ns.parent_pid)))


if __name__ == "__main__":
    sys.exit(main())
