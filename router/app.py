"""The router process: model directory -> engine + gRPC and HTTP servers + metrics, until
drained.

`run_router(args)` is what `pagedserve router` runs; `serve` runs the same coroutine with
its executors as child processes. Without torch: the model is known from config.json.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from .. import event_loop
from ..cpu_dtypes import checkpoint_dtype
from ..gc_tuning import freeze_heap
from .api_workers import resolve_api_workers
from .chat_template import ChatTemplate
from .edge_security import read_key_file
from .edges import EdgeBindError, LocalEdges, WorkerEdges
from .engine import EngineConfig, RouterEngine
from .executor_link import ExecutorLinkError
from .metrics import RouterMetrics
from .openai_fields import served_names
from .routing import RoutingPolicy
from .scheduler import PreemptionMode
from .tokenizer import Tokenizer, read_eos_token_ids
from .types import ModelInfoData
from .validation import Limits


@dataclasses.dataclass(frozen=True)
class ReadyAddresses:
    """Where a started router listens (HOST:PORT; None: off), as its ready line says."""
    grpc: str
    metrics: str | None
    http: str | None


log = logging.getLogger("pagedserve.router")

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
)


class ModelDirError(ValueError):
    """The model directory is missing, unreadable or of an unsupported model."""


class ServerConfigError(ValueError):
    """A router setting that cannot be used as given (an unreadable --api-key-file): one
    line, exit code 2. (Checked by the router, not the flag parser: executors take every
    flag and never read this file.)"""


def check_router_files(args) -> None:
    """ServerConfigError for an --api-key-file or a --chat-template the router cannot use."""
    template = getattr(args, "chat_template", None)
    if template:
        try:
            ChatTemplate.given(template, args.model)
        except ValueError as exc:
            raise ServerConfigError(str(exc)) from None
    path = getattr(args, "api_key_file", None)
    if path:
        try:
            read_key_file(path)
        except OSError as exc:
            raise ServerConfigError(f"--api-key-file {path}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise ServerConfigError(f"--api-key-file {path}: {exc}") from None


class ServerBindError(OSError):
    """A listening address cannot be bound (a port in use): one line, exit code 2."""


def read_model_info(model_dir: str, block_size: int, max_model_len: int | None,
                    dtype: str = "auto") -> tuple[ModelInfoData, str]:
    """(ModelInfo, fingerprint of config.json) for a Hugging Face model directory."""
    path = Path(model_dir)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelDirError(f"{model_dir}: no config.json (not a Hugging Face model directory)")
    raw = config_path.read_bytes()
    try:
        config = json.loads(raw)
    except ValueError as exc:
        raise ModelDirError(f"{config_path}: not valid JSON ({exc})") from None
    archs = config.get("architectures") or []
    arch = archs[0] if archs else ""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelDirError(f"{model_dir}: architecture {arch or '(none)'} is not supported; "
                            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    model_len = int(config.get("max_position_embeddings") or 2048)
    if max_model_len is not None:
        if max_model_len > model_len:
            raise ModelDirError(f"--max-model-len {max_model_len} exceeds the model's "
                                f"{model_len}")
        model_len = max_model_len
    if dtype == "auto":  # the checkpoint's until executors register what they run (engine.py)
        dtype = checkpoint_dtype(config)
    info = ModelInfoData(
        model=str(config.get("_name_or_path") or path.resolve().name),
        architecture=arch,
        max_model_len=model_len,
        vocab_size=int(config["vocab_size"]),
        block_size=block_size,
        dtype=dtype,
        eos_token_ids=read_eos_token_ids(path),
    )
    return info, hashlib.sha256(raw).hexdigest()


def lora_names(args) -> tuple[str, ...]:
    """The names of ``--lora-modules``, in the order given."""
    return tuple(name for name, _ in getattr(args, "lora_modules", None) or ())


def model_info_from_args(args) -> tuple[ModelInfoData, str]:
    """`read_model_info` of ``--model`` with the LoRA adapters served beside it (a name
    that is the served model's own is refused: the OpenAI API's `model` picks either)."""
    info, fingerprint = read_model_info(args.model, args.block_size, args.max_model_len,
                                        args.dtype)
    names = lora_names(args)
    served = served_names(getattr(args, "served_model_name", None) or "")
    for name in names:
        if name in served:
            raise ModelDirError(f"--lora-modules: {name!r} is a served model's name too")
    return dataclasses.replace(info, lora_adapters=names), fingerprint


def limits_from_args(args, info: ModelInfoData) -> Limits:
    return Limits(vocab_size=info.vocab_size, max_model_len=info.max_model_len,
                  max_n=args.max_n, max_logprobs=args.max_logprobs, max_stop=args.max_stop,
                  lora_adapters=lora_names(args), lora_dir=getattr(args, "lora_dir", None) or None)


def engine_config_from_args(args, fingerprint: str, info: ModelInfoData) -> EngineConfig:
    return EngineConfig(
        model_fingerprint=fingerprint,
        block_size=args.block_size,
        max_model_len=info.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_queue_len=args.max_queue_len,
        enable_prefix_caching=not args.no_prefix_caching,
        enable_offloading=args.kv_offloading_size > 0,
        preemption_mode=PreemptionMode(args.preemption_mode),
        routing=RoutingPolicy(args.routing),
        kv_pull=args.kv_pull == "auto",
        heartbeat_timeout_s=args.heartbeat_timeout,
        pipeline_depth=args.pipeline_depth,
        step_timeout_s=args.step_timeout,
        debug_checks=bool(getattr(args, "debug_checks", False)),
        lora_adapters=lora_names(args),
        max_loras=getattr(args, "max_loras", 0),
        lora_dir=getattr(args, "lora_dir", None) or None,
        speculative=getattr(args, "speculative_config", None),
        tokenizer_json=str(Path(args.model) / "tokenizer.json"),
        decode_lane_min_running=decode_lane_min_running(),
        enable_weight_updates=bool(getattr(args, "enable_weight_updates", False)),
        weight_version=getattr(args, "weight_version", None) or "default",
    )


# The running groups from which each scheduler plans steady decodes in its decode lane
# (router/decode_lane.py); 0 turns the lane off (every row through the scheduler's loop).
DECODE_LANE_ENV = "PAGEDSERVE_DECODE_LANE_MIN_RUNNING"


def decode_lane_min_running() -> int:
    value = os.environ.get(DECODE_LANE_ENV, "").strip()
    if not value:
        return EngineConfig.decode_lane_min_running
    if not value.isdigit():
        raise SystemExit(f"{DECODE_LANE_ENV} must be an integer >= 0, got {value!r}")
    return int(value)


async def serve_router(
    args,
    *,
    wait_for_executors: int = 0,
    on_bound: Callable[[str, RouterEngine], Awaitable[None]] | None = None,
    on_started: Callable[[RouterEngine, ReadyAddresses], Awaitable[None]] | None = None,
    stop_event: asyncio.Event | None = None,
    executors_on_gpu: bool | None = None,
) -> int:
    """Run the router until SIGINT/SIGTERM (or `stop_event`), then drain and exit 0.
    (``executors_on_gpu``: what `serve` knows of its executors, for `--api-workers auto`.)

    Prints `pagedserve ready grpc=HOST:PORT metrics=HOST:PORT executors=N http=HOST:PORT`
    once listening
    and, with `wait_for_executors`, once that many executors have registered."""
    check_router_files(args)
    args.api_workers = resolve_api_workers(getattr(args, "api_workers", 0), executors_on_gpu)
    info, fingerprint = model_info_from_args(args)
    tokenizer = Tokenizer.from_dir(args.model, getattr(args, "chat_template", None))
    metrics = RouterMetrics()
    engine = RouterEngine(engine_config_from_args(args, fingerprint, info), tokenizer, info,
                          metrics)
    endpoint = await engine.start(args.executor_bind, allow_insecure=args.allow_insecure,
                                  curve_keys=args.curve_keys)
    try:
        if getattr(args, "api_workers", 0) > 0:
            edges = await WorkerEdges.start(args, engine, metrics)
        else:
            edges = await LocalEdges.start(args, engine, tokenizer, info,
                                           limits_from_args(args, info), metrics)
    except EdgeBindError as exc:  # one line, nothing left running
        await engine.stop()
        raise ServerBindError(str(exc)) from None
    metrics_port = metrics.serve(args.metrics_port, host=args.host) \
        if args.metrics_port >= 0 else None
    port, http_port = edges.grpc_port, edges.http_port
    log.info("router listening: grpc %s:%d, http %s, executors join at %s%s", args.host, port,
             http_port if http_port is not None else "off", endpoint,
             f" ({args.api_workers} API workers)" if isinstance(edges, WorkerEdges) else "")
    if getattr(args, "api_key", None) or getattr(args, "api_key_file", None):
        log.info("gRPC and HTTP calls need an API key (%d from --api-key%s)",
                 len(args.api_key or ()), f", the others from {args.api_key_file}, re-read "
                 "when it changes" if args.api_key_file else "")
    # The imports, tokenizer, servers and metrics live as long as the process: out of the
    # collector's reach, so that a full collection while serving walks only what serving
    # allocates (pagedserve/gc_tuning.py).
    freeze_heap()
    if on_bound is not None:
        await on_bound(endpoint, engine)
    stop = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
            loop.add_signal_handler(sig, stop.set)
    if wait_for_executors:
        waiter = asyncio.ensure_future(engine.wait_for_executors(wait_for_executors))
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if not waiter.done():
            waiter.cancel()
    if not stop.is_set():
        ready = ReadyAddresses(
            f"{args.host}:{port}",
            f"{args.host}:{metrics_port}" if metrics_port is not None else None,
            f"{args.host}:{http_port}" if http_port is not None else None)
        print(f"pagedserve ready grpc={ready.grpc} metrics={ready.metrics or 'off'} "
              f"executors={engine.num_healthy()} http={ready.http or 'off'}", flush=True)
        if on_started is not None:
            await on_started(engine, ready)
        await stop.wait()
    log.info("draining for up to %.0f s", args.shutdown_timeout)
    await edges.drain()  # both APIs: new requests UNAVAILABLE / 503, health not serving
    await engine.drain(args.shutdown_timeout)  # open requests finish or end with abort
    await edges.stop()
    await engine.stop(shutdown_executors=wait_for_executors > 0)
    metrics.shutdown()
    return 0


def run_router(args) -> int:
    try:
        return event_loop.run(serve_router(args))
    except (ModelDirError, ExecutorLinkError, ServerBindError, ServerConfigError) as exc:
        print(f"pagedserve router: {exc}", file=sys.stderr)
        return 2
