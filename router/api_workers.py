"""The router's API worker processes (`--api-workers N`): start, watch, restart, stop.

Start: when a port is fixed, it is checked free first (the workers bind with SO_REUSEPORT,
which would silently share a port another server of this user holds with it). Worker 0 binds
`--port` / `--http-port` (0: any free port) and says which ports it got in its hello; the
others bind the same ones. The router is ready once every worker has said hello.

Watch: a worker that exits while the router is not stopping has taken its clients'
connections with it; its requests are aborted (their blocks freed) and it is started again on
the same ports, after a pause that doubles while it keeps failing (up to 8 s).

Stop: after the router's drain, EdgeStop to every worker (they close their servers and
exit); SIGKILL to any still running 5 s later (workers ignore SIGTERM: api_worker.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
import time

from .edge_hub import EdgeHub

log = logging.getLogger("pagedserve.router.edge")

ARGS_ENV = "PAGEDSERVE_EDGE_ARGS"  # the router's flags, as JSON, for its workers
BIND_ERROR_EXIT = 3  # a worker's exit code for "could not bind"

HELLO_TIMEOUT_S = 120.0  # loading the tokenizer, importing grpc: seconds on a slow machine
RESTART_MIN_S, RESTART_MAX_S = 0.5, 8.0
STABLE_S = 30.0  # a worker up this long resets the restart pause


# `--api-workers auto`: this many workers where `serve` starts its executors on GPUs and the
# router may use AUTO_MIN_CORES cores or more (its affinity, capped by its cgroup's CPU
# quota); else none (a router alone, whose executors join from elsewhere, serves both APIs
# itself unless given a count: what it will serve is not known). Why: at 256 streams on
# one GPU executor the router process
# serving both APIs itself spent more CPU a step than the ~2 ms forward (H200, 2026-11-26:
# 25.0k tok/s, the device idle 4.6 ms between steps; with 2 workers 32.6k and 1.1 ms), and
# the workers used 2.2 cores there: with the engine's one and an executor's, 8 leaves room.
# CPU executors make a few hundred tokens a second, which the router process serves with
# time to spare, and a 2-core machine has no cores for workers (benchmarks/README, "API
# workers"). At one stream the worker's hop is not measurable in the inter-token latency
# (2.62 ms against 2.64 and 2.61 with 0, 1 and 2 workers, 2 ms fake steps, this VM).
AUTO_API_WORKERS = 2
AUTO_MIN_CORES = 8


def resolve_api_workers(value, executors_on_gpu: bool | None) -> int:
    """The count `--api-workers` means: a number as given; `auto` by the rule above
    (``executors_on_gpu``: what `serve` knows of the executors it starts; None for a
    router whose executors join from elsewhere). The router's "listening" log line says
    how many it started."""
    if value != "auto":
        return int(value)
    if not executors_on_gpu:
        return 0
    from pagedserve.affinity import usable_cores

    return AUTO_API_WORKERS if usable_cores() >= AUTO_MIN_CORES else 0


class ApiWorkerError(OSError):
    """An API worker could not start (a port in use, a crash before listening)."""


def check_port_free(host: str, port: int) -> None:
    """Raise ApiWorkerError if host:port cannot be bound by a socket without SO_REUSEPORT
    (SO_REUSEADDR, as the servers set it: a closed connection's TIME_WAIT is no conflict)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ApiWorkerError(f"cannot bind {host}:{port}: {exc.strerror or exc}") from None


class ApiWorkers:
    def __init__(self, hub: EdgeHub, args, count: int) -> None:
        self.hub = hub
        self.args = args
        self.count = count
        self.grpc_port = args.port
        self.http_port = args.http_port if args.http_port >= 0 else -1
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.started_at: dict[int, float] = {}
        self.stopping = False
        self._tasks: list[asyncio.Task] = []
        self._env = {**os.environ, ARGS_ENV: json.dumps(vars(args), default=str)}

    async def start(self) -> None:
        """Every worker listening and connected, or ApiWorkerError (nothing left running)."""
        for port in (self.grpc_port, self.http_port):
            if port > 0:
                check_port_free(self.args.host, port)
        try:
            await self._start_one(0)
            hello = self.hub.worker(0).hello
            assert hello is not None
            self.grpc_port, self.http_port = hello.grpc_port, hello.http_port
            for i in range(1, self.count):
                await self._start_one(i)
        except BaseException:
            await self.stop(timeout_s=2.0)
            raise
        for i in range(self.count):
            self._tasks.append(asyncio.ensure_future(self._watch(i)))

    def _command(self, index: int) -> list[str]:
        return [sys.executable, "-m", "pagedserve.router.api_worker", "--core",
                self.hub.address, "--worker", str(index), "--grpc-port", str(self.grpc_port),
                "--http-port", str(self.http_port), "--parent-pid", str(os.getpid())]

    async def _start_one(self, index: int) -> None:
        conn = self.hub.worker(index)
        conn.hello_event.clear()
        proc = await asyncio.create_subprocess_exec(*self._command(index), env=self._env,
                                                    stdin=asyncio.subprocess.DEVNULL)
        self.procs[index] = proc
        self.started_at[index] = time.monotonic()
        hello = asyncio.ensure_future(conn.hello_event.wait())
        exited = asyncio.ensure_future(proc.wait())
        try:
            done, _ = await asyncio.wait({hello, exited}, timeout=HELLO_TIMEOUT_S,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            hello.cancel()
            exited.cancel()
        if conn.hello_event.is_set():
            return
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
            raise ApiWorkerError(f"API worker {index} did not connect within "
                                 f"{HELLO_TIMEOUT_S:.0f} s")
        why = "could not bind its ports" if proc.returncode == BIND_ERROR_EXIT \
            else f"exited with code {proc.returncode}"
        raise ApiWorkerError(f"API worker {index} {why} before listening")

    async def _watch(self, index: int) -> None:
        pause = RESTART_MIN_S
        while True:
            proc = self.procs[index]
            rc = await proc.wait()
            if self.stopping:
                return
            lost = self.hub.worker_lost(index)
            self.hub.metrics.inc_api_worker_restart()
            log.error("API worker %d (pid %d) exited with code %s; %d of its requests "
                      "aborted; starting it again", index, proc.pid, rc, lost)
            if time.monotonic() - self.started_at[index] > STABLE_S:
                pause = RESTART_MIN_S
            await asyncio.sleep(pause)
            pause = min(RESTART_MAX_S, pause * 2)
            if self.stopping:
                return
            try:
                await self._start_one(index)
            except ApiWorkerError as exc:
                log.error("%s", exc)

    async def stop(self, timeout_s: float = 5.0) -> None:
        self.stopping = True
        for task in self._tasks:
            task.cancel()
        self.hub.stop_workers()
        procs = [p for p in self.procs.values() if p.returncode is None]
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), timeout_s)
            return
        for p in procs:  # workers ignore SIGTERM (api_worker.py)
            if p.returncode is None:
                log.warning("API worker pid %d did not stop; killing it", p.pid)
                p.kill()
        await asyncio.gather(*(p.wait() for p in procs))
