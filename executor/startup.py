"""Starting one executor: `pagedserve executor` flags -> pinned compute thread -> model and
KV cache (build_runner) -> Hello -> ExecutorProcess.serve (process.py) -> a fast exit.

Everything that can refuse to start (a bad --curve-keys folder, the testing hook, a core
list this machine lacks, a model we cannot run) is checked here, each as one line on stderr
and exit code 2, before the executor ever talks to the router.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import socket
import sys

from pagedserve.executor.env_switches import fault_sleep_from_env, plan_prep_from_env
from pagedserve.executor.graph_feed import feeds_wanted
from pagedserve.executor.process import ExecutorProcess, _setup_logging, load_curve_keys
from pagedserve.kernels.host_math import (
    fused_rope_from_env,
    mixed_decode_split_from_env,
    switch_from_env,
    triton_gemm_from_env,
)
from pagedserve.protos.wire import Hello

from pagedserve.affinity import (
    AffinityError,
    available_cores,
    format_cores,
    parse_cores,
    pin_current_thread,
)
from pagedserve.gc_tuning import freeze_heap

log = logging.getLogger("pagedserve.executor")


def _pin_compute(spec: str | None) -> list[int]:
    """`--cpu-affinity CORES`: pin this (the compute) thread, and the torch threads it
    creates, to CORES; returns the other cores, for the I/O and heartbeat threads. `auto`
    and `off` pin nothing here (`serve` assigns cores to its executors)."""
    if not spec or spec in ("auto", "off"):
        return []
    cores = parse_cores(spec)
    online = os.cpu_count() or 0
    if any(c >= online for c in cores):
        raise AffinityError(f"--cpu-affinity {spec}: this machine has cores 0-{online - 1}")
    # The cores this process was started on (serve starts its executors from the router's
    # cores), less the compute cores: where the I/O and heartbeat threads go.
    inherited = available_cores()
    others = [c for c in inherited if c not in cores] or inherited
    if pin_current_thread(cores):
        log.info("compute pinned to cores %s; I/O threads on %s", format_cores(cores),
                 format_cores(others) or "the same cores")
    return others


def default_executor_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{random.randbytes(3).hex()}"


def run_executor(args: argparse.Namespace) -> int:
    """Entry point for ``pagedserve executor`` (args from ``pagedserve.flags``)."""
    import torch
    from pagedserve.executor.host_malloc import HOST_MALLOC_ENV, tune_host_malloc
    from pagedserve.executor.models import ModelNotSupported
    from pagedserve.executor.packed_weights import PACKED_WEIGHTS_ENV, ROW_PADDING_ENV
    from pagedserve.executor.runner_setup import build_runner
    from pagedserve.executor.step_trace import profiler_from_env
    from pagedserve.kernels.kv_dtypes import kv_dtype_name

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
    try:
        fault_sleep = fault_sleep_from_env()  # the testing hook, read once
        profile_window = profiler_from_env()  # PAGEDSERVE_TORCH_PROFILER_DIR (step_trace.py)
        plan_prep = plan_prep_from_env()  # PAGEDSERVE_PLAN_PREP: io / main
        # The decode step's switches, read leniently where they apply (llama.py).
        fused_rope_from_env()  # PAGEDSERVE_DECODE_FUSED_ROPE: 0, 1 or unset
        triton_gemm_from_env()  # PAGEDSERVE_DECODE_TRITON_GEMM: which projections
        feeds_wanted(strict=True)  # PAGEDSERVE_GRAPH_FEED: 0, 1 or unset (graph_feed.py)
        mixed_decode_split_from_env()  # PAGEDSERVE_MIXED_DECODE_SPLIT: 0, 1 or unset
        switch_from_env(HOST_MALLOC_ENV)  # PAGEDSERVE_HOST_MALLOC: 0, 1 or unset
        switch_from_env(PACKED_WEIGHTS_ENV)  # PAGEDSERVE_CPU_PACKED_WEIGHTS: 0, 1 or unset
        switch_from_env(ROW_PADDING_ENV)  # PAGEDSERVE_CPU_ROW_PADDING: 0, 1 or unset
    except ValueError as exc:
        print(f"pagedserve executor: {exc}", file=sys.stderr)
        return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    io_cores: list[int] = []
    if device.startswith("cpu"):
        try:
            io_cores = _pin_compute(args.cpu_affinity)
        except AffinityError as exc:
            print(f"pagedserve executor: {exc}", file=sys.stderr)
            return 2
        torch.set_num_threads(max(1, args.cpu_threads))
    torch.manual_seed(args.seed)
    executor_id = args.executor_id or default_executor_id()
    try:
        runner = build_runner(
            args.model, device=device, dtype=args.dtype, block_size=args.block_size,
            num_gpu_blocks=args.num_gpu_blocks, num_cpu_blocks=args.num_cpu_blocks,
            kv_cache_space=args.kv_cache_space, swap_space=args.swap_space,
            kv_offloading_size=args.kv_offloading_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens, executor_id=executor_id,
            progress=progress_bars_enabled(args.log_format),
            max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager,
            kv_cache_dtype=args.kv_cache_dtype, lora_modules=args.lora_modules,
            max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
            max_cpu_loras=args.max_cpu_loras,
        )
    except (ModelNotSupported, FileNotFoundError, ValueError) as exc:
        print(f"pagedserve executor: {exc}", file=sys.stderr)
        return 2
    cache = runner.cache
    if device.startswith("cpu"):  # the steps' allocations from here on (host_malloc.py)
        log.info("host memory: %s", tune_host_malloc())
    hello = Hello(
        executor_id=executor_id, model_fingerprint=runner.model.config.fingerprint,
        device=str(cache.device),
        dtype=str(runner.model.model.embed_tokens.weight.dtype).removeprefix("torch."),
        block_size=cache.block_size, num_gpu_blocks=cache.num_gpu_blocks,
        num_cpu_blocks=cache.num_cpu_blocks, max_model_len=runner.max_model_len,
        pid=os.getpid(), hostname=socket.gethostname(),
        lora_adapters=runner.loras.static_names if runner.loras is not None else (),
        max_loras=args.max_loras, disaggregation_mode=args.disaggregation_mode,
        kv_format=cache.kv_format, kv_block_bytes=cache.block_bytes,
    )
    log.info("executor %s: %s on %s (%s, KV cache %s), %d device blocks, %d cpu blocks of "
             "%d tokens", executor_id, runner.model.config.architecture, hello.device,
             hello.dtype, kv_dtype_name(cache.kv_cache.dtype), hello.num_gpu_blocks,
             hello.num_cpu_blocks, hello.block_size)
    # Everything allocated so far (the model, torch, the imports: ~170k objects) lives as
    # long as the process: moved out of the collector's reach, so that a full collection
    # while serving scans only what serving allocates (it took ~110 ms, a stalled step).
    freeze_heap()
    try:
        # Inference mode for the whole loop: ModelRunner.execute then skips entering it,
        # a few microseconds of the gap between two steps.
        with torch.inference_mode():
            rc = ExecutorProcess(runner, args, hello, curve=curve, io_cores=io_cores,
                                 fault_sleep=fault_sleep,
                                 profile_window=profile_window,
                                 plan_prep=plan_prep).serve()
    except SystemExit as exc:
        rc = int(exc.code or 0)
    except KeyboardInterrupt:
        rc = 0
    # Served and handed back: the sockets are closed and the context terminated. The
    # interpreter's teardown of torch and the model would add ~270 ms to every stop (a
    # rolling restart waits for it), with nothing left to write but the logs.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
