"""Where the router's public edges (gRPC, OpenAI HTTP) run: in the router process
(`LocalEdges`, the default) or in `--api-workers N` processes of their own (`WorkerEdges`,
edge_hub.py / api_workers.py). Both start listening, drain and stop the same way for app.py.
"""

from __future__ import annotations

from pathlib import Path

from .api_workers import ApiWorkerError, ApiWorkers
from .edge_hub import EdgeHub
from .edge_security import edge_security
from .frontend import Frontend
from .generation_defaults import generation_defaults
from .grpc_server import start_server
from .http_server import start_http_server
from .response_persistence import ResponseFile
from .response_store import ResponseStore
from .validation import Limits


def http_options(args) -> dict:
    """start_http_server's keywords from the flags (the router's edges and an API worker's
    alike; TLS and keys: edge_security)."""
    return dict(served_model_name=args.served_model_name or Path(args.model).name,
                tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                allowed_origins=args.allowed_origins or (),
                sampling_defaults=generation_defaults(args.model, args.generation_config),
                batch_dir=args.batch_dir or None, responses_store_mb=args.responses_store_mb,
                responses_dir=args.responses_dir or None,
                # a batch's requests in flight: the executors' batches full, half the queue
                # left to online requests
                batch_window=max(1, min(args.max_queue_len // 2, 2 * args.max_num_seqs)))


def edge_frontend(args, engine, tokenizer, limits: Limits, metrics) -> Frontend:
    """The Frontend both edges of a process share."""
    return Frontend(engine, tokenizer, limits, metrics, log_requests=bool(args.log_requests))


class EdgeBindError(OSError):
    """A public port cannot be bound, or an API worker could not start."""


class LocalEdges:
    """gRPC and HTTP on the router's own event loop, one Frontend shared by both."""

    def __init__(self, server, http) -> None:
        self.server = server
        self.http = http
        self.grpc_port: int = server.port
        self.http_port: int | None = http.port if http is not None else None

    @classmethod
    async def start(cls, args, engine, tokenizer, info, limits: Limits, metrics) -> LocalEdges:
        frontend = edge_frontend(args, engine, tokenizer, limits, metrics)
        security = edge_security(args)
        server = None
        try:
            server, _ = await start_server(frontend, args.host, args.port, **security)
            http = None
            if args.http_port >= 0:
                http = await start_http_server(
                    frontend, args.host, args.http_port, max_model_len=info.max_model_len,
                    **http_options(args), **security)
        except OSError as exc:  # a port in use: one line, nothing left running
            if server is not None:
                await server.stop(0)
            raise EdgeBindError(str(exc)) from None
        return cls(server, http)

    async def drain(self) -> None:
        await self.server.drain()  # both APIs: new requests UNAVAILABLE, health not serving

    async def stop(self) -> None:
        if self.http is not None:
            await self.http.stop()
        await self.server.stop(grace=1.0)


class WorkerEdges:
    """gRPC and HTTP in API worker processes; the router process keeps the engine."""

    def __init__(self, engine, hub: EdgeHub, workers: ApiWorkers) -> None:
        self.engine = engine
        self.hub = hub
        self.workers = workers
        self.grpc_port: int = workers.grpc_port
        self.http_port: int | None = workers.http_port if workers.http_port >= 0 else None

    @classmethod
    async def start(cls, args, engine, metrics) -> WorkerEdges:
        # the workers' stored Responses, in this process (one store for all of them)
        hub = EdgeHub(engine, metrics, ResponseStore(
            int(args.responses_store_mb * 2**20), abort=engine.abort, metrics=metrics,
            file=ResponseFile(args.responses_dir) if args.responses_dir else None))
        hub.start()
        workers = ApiWorkers(hub, args, args.api_workers)
        try:
            await workers.start()
        except ApiWorkerError as exc:
            await hub.close()
            raise EdgeBindError(str(exc)) from None
        return cls(engine, hub, workers)

    async def drain(self) -> None:
        self.engine.draining = True  # the workers hear it now, not at the next status poll
        self.hub.push_status()

    async def stop(self) -> None:
        await self.workers.stop()
        await self.hub.close()
        self.hub.responses.close()
