"""Making a ModelRunner from the executor's flags: load the model, size the device KV cache
and the CPU swap space (memory profiling on CUDA, ``--kv-cache-space`` on CPU), and on CUDA
capture the decode graphs and the graph pieces of steps with prompt tokens, whose memory is
set aside before the cache is sized."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from pagedserve.executor.cache_engine import CacheEngine
from pagedserve.executor.cuda_graphs import DecodeGraphs
from pagedserve.executor.grammar import GrammarCompiler
from pagedserve.executor.kernel_checks import (
    check_fused_decode_rope,
    check_fused_ops,
    check_graph_feed,
    check_sampler_kernels,
)
from pagedserve.executor.mixed_graphs import MixedGraphs, mixed_graph_memory_bytes
from pagedserve.executor.model_runner import ModelRunner
from pagedserve.executor.models import LlamaForCausalLM
from pagedserve.executor.models.lora import LoraSet, read_adapter

log = logging.getLogger(__name__)


def build_runner(
    model_dir: str, *, device: str | torch.device = "cpu", dtype: str = "auto",
    block_size: int = 16, num_gpu_blocks: int | None = None, num_cpu_blocks: int | None = None,
    kv_cache_space: float = 1.0, swap_space: float | None = None,
    kv_offloading_size: float = 0.0, gpu_memory_utilization: float = 0.9,
    max_model_len: int | None = None, max_num_batched_tokens: int = 8192, executor_id: str = "",
    progress: bool = True,
    max_num_seqs: int = 256, enforce_eager: bool = False, kv_cache_dtype: str = "auto",
    lora_modules: tuple[tuple[str, str], ...] = (), max_loras: int = 0, max_lora_rank: int = 16,
    max_cpu_loras: int | None = None,
) -> ModelRunner:
    """Load the model, size the caches (DESIGN §4 flags; ``kv_cache_dtype``: the model's
    dtype, or an fp8 one, kernels/kv_dtypes.py) and, on CUDA unless
    ``enforce_eager``, capture the decode graphs for up to ``max_num_seqs`` sequences (their
    memory is set aside before the KV cache is sized); install the LoRA adapters
    ``lora_modules`` ((name, directory) pairs, models/lora.py), in ``max_loras`` slots of
    rank ``max_lora_rank`` loaded and unloaded while serving when ``max_loras`` > 0 (every
    slot allocated now, before the KV cache is sized; ``max_cpu_loras`` adapters read kept
    in host memory, default ``max_loras``: models/lora.AdapterCache). Raises ModelNotSupported,
    FileNotFoundError or ValueError (LoraError) with a one-line message."""
    from pagedserve.executor.cache_engine import (
        block_bytes,
        blocks_for_space,
        memory_accounting,
        memory_baseline,
        profile_num_gpu_blocks,
    )
    from pagedserve.executor.cuda_graphs import graph_memory_bytes, graphs_supported
    from pagedserve.executor.models import load_config, load_model, resolve_dtype
    from pagedserve.executor.packed_weights import pack_if_supported
    from pagedserve.kernels.kv_dtypes import kv_dtype_name, resolve_kv_cache_dtype

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    config = load_config(model_dir)
    torch_dtype = resolve_dtype(dtype, config, device)
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, torch_dtype)
    _check_kv_dtype_on(device, kv_dtype)
    if block_size not in (8, 16, 32, 64, 128):
        raise ValueError(f"--block-size {block_size}: must be one of 8, 16, 32, 64, 128")
    if max_model_len is not None and max_model_len > config.max_model_len:
        raise ValueError(f"--max-model-len {max_model_len} exceeds the model's "
                         f"{config.max_model_len}")
    adapters = [read_adapter(name, path, config) for name, path in lora_modules]
    model = load_model(model_dir, torch_dtype, device, config, progress=progress)
    if device.type == "cpu":
        log.info("%s", pack_if_supported(model))  # (executor/packed_weights.py)
    loras = LoraSet(adapters, model, max_loras, max_lora_rank,
                    max_loras if max_cpu_loras is None else max_cpu_loras) \
        if adapters or max_loras else None
    if loras is not None:
        log.info("LoRA adapters: %s (%s rank %d as batched; the graphs hold them)",
                 ", ".join(loras.static_names) or "none yet",
                 f"{max_loras} slots of" if max_loras else "", loras.rank)
    # Taken after the load (which allocates through torch alone, so nothing outside torch is
    # missed): where NVML cannot name this process, outside-torch memory is the device's
    # growth since this baseline, and a neighbour executor filling its cache while this one
    # loads would be counted as ours. The window is now the kernel checks and the profile.
    baseline = memory_baseline(device) if device.type == "cuda" else None
    if device.type == "cuda":
        check_fused_ops(model)
        check_fused_decode_rope(model, kv_dtype=kv_dtype)
    max_len = max_model_len or config.max_model_len
    why_eager = "--enforce-eager" if enforce_eager else graphs_supported(device)
    mixed_tokens = 0 if why_eager or not _mixed_graphs_wanted() else max_num_batched_tokens
    if num_gpu_blocks is None:
        if device.type == "cuda":
            reserve = 0 if why_eager else graph_memory_bytes(
                model, block_size, max_len, max_num_seqs, device, loras)
            reserve += mixed_graph_memory_bytes(model, block_size, mixed_tokens, device, loras)
            plan = profile_num_gpu_blocks(
                model, block_size, min(max_num_batched_tokens, 8 * max_len),
                gpu_memory_utilization, device, reserve_bytes=reserve, baseline=baseline,
                kv_dtype=kv_dtype, sample_rows=max_num_seqs)
            num_gpu_blocks = plan.blocks
            log.info("KV cache: %d blocks at --gpu-memory-utilization %.2f (memory outside "
                     "torch counted by %s): %s", num_gpu_blocks, gpu_memory_utilization,
                     memory_accounting(device), plan.describe())
            why_none = (f"{plan.describe()}. Free the device, or raise "
                        "--gpu-memory-utilization, or lower --max-num-batched-tokens or "
                        "--max-num-seqs")
        else:
            num_gpu_blocks = blocks_for_space(kv_cache_space, config, block_size, kv_dtype)
            why_none = (f"--kv-cache-space {kv_cache_space:g} GiB holds no block of "
                        f"{block_bytes(config, block_size, kv_dtype):,} bytes")
    else:
        why_none = "--num-gpu-blocks 0"
    if num_cpu_blocks is None:
        if swap_space is None:
            swap_space = 4.0 if device.type == "cuda" else 0.5
        num_cpu_blocks = blocks_for_space(swap_space + kv_offloading_size, config,
                                          block_size, kv_dtype)
    if num_gpu_blocks <= 0:
        raise ValueError(f"no memory left for the KV cache (num_gpu_blocks = 0): {why_none}")
    cache = CacheEngine(config, block_size, num_gpu_blocks, num_cpu_blocks, kv_dtype, device)
    if kv_dtype != torch_dtype:
        log.info("KV cache in %s (--kv-cache-dtype %s): %s bytes a block, the model in %s",
                 kv_dtype_name(kv_dtype), kv_cache_dtype,
                 f"{block_bytes(config, block_size, kv_dtype):,}", kv_dtype_name(torch_dtype))
    graphs = None if why_eager else _capture_graphs(model, cache, max_len, max_num_seqs,
                                                    loras)
    mixed = _capture_mixed_graphs(model, cache, mixed_tokens, loras) if mixed_tokens else None
    # Structured output: llguidance's mask threads take the CPU executor's thread budget.
    grammars = GrammarCompiler(Path(model_dir) / "tokenizer.json", config.vocab_size,
                               num_threads=torch.get_num_threads() if device.type == "cpu"
                               else None)
    runner = ModelRunner(model, cache, executor_id=executor_id, max_model_len=max_len,
                         graphs=graphs, grammars=grammars, mixed_graphs=mixed, loras=loras)
    runner.weights.model_dir = str(model_dir)
    runner.sample_chunk_rows = max_num_seqs  # what the memory profile sampled
    if device.type == "cuda":
        check_sampler_kernels(runner, config.vocab_size, torch_dtype)
    return runner


def _check_kv_dtype_on(device: torch.device, kv_dtype: torch.dtype) -> None:
    """ValueError (one line) where the device's kernels cannot convert the cache's fp8
    format: Triton has e4m3 (``fp8e4nv``) from compute capability 8.9 (Ada, Hopper) on."""
    if device.type != "cuda" or kv_dtype != torch.float8_e4m3fn:
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ValueError(f"--kv-cache-dtype fp8_e4m3 needs compute capability 8.9 or newer "
                         f"(this GPU: {capability[0]}.{capability[1]}); use fp8_e5m2")


def _mixed_graphs_wanted() -> bool:
    """`PAGEDSERVE_MIXED_GRAPHS=0` in an executor's environment keeps steps with prompt
    tokens eager (the decode graphs stay): an operator's way back."""
    return os.environ.get("PAGEDSERVE_MIXED_GRAPHS", "1") != "0"


def _capture_mixed_graphs(model: LlamaForCausalLM, cache: CacheEngine, max_tokens: int,
                          loras: LoraSet | None = None) -> MixedGraphs | None:
    """The graph pieces of steps with prompt tokens (holding the LoRA adapters' update when
    there are adapters), or None (logged) when capturing fails: those steps run eagerly."""
    graphs = MixedGraphs(model, cache.kv_cache, max_tokens, loras)
    return _captured(graphs, cache.device,
                     "graphs of steps with prompt tokens off, those steps eager",
                     f"steps with prompt tokens in {len(graphs.layers) + 1} pieces for "
                     f"{len(graphs.sizes)} token counts up to {graphs.max_tokens}")


def _capture_graphs(model: LlamaForCausalLM, cache: CacheEngine, max_model_len: int,
                    max_num_seqs: int, loras: LoraSet | None = None) -> DecodeGraphs | None:
    """The decode graphs (holding the LoRA adapters' update when there are adapters), or
    None (logged) when capturing fails: the executor runs eager."""
    graphs = DecodeGraphs(model, cache.kv_cache, cache.block_size, max_model_len, max_num_seqs,
                          loras)
    graphs = _captured(graphs, cache.device, "CUDA graphs off, every step eager",
                       f"{len(graphs.sizes)} decode batch sizes up to {graphs.max_batch}")
    if graphs is not None:
        check_graph_feed(graphs)
    return graphs


def _captured(graphs, device: torch.device, off: str, what: str):
    """``graphs`` captured (its memory logged), or None when it has no size or a capture
    fails (logged as ``off``): a kernel that cannot be captured costs speed, not service."""
    if not graphs.sizes:
        return None
    before = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    try:
        graphs.capture()
    except Exception as exc:  # noqa: BLE001 - any capture failure leaves the steps eager
        log.warning("%s: capture failed: %s: %s", off, type(exc).__name__, exc)
        return None
    held = torch.cuda.memory_reserved(device) - before if device.type == "cuda" else 0
    log.info("CUDA graphs: %s captured in %.1f s (%.0f MiB)", what, graphs.capture_s,
             held / 2**20)
    return graphs
