"""The executor's KV cache: one device tensor and one CPU swap tensor of the same layout,
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (kernels/__init__.py).

How many device blocks: ``--num-gpu-blocks`` when given; on CUDA otherwise a profiling run
(``profile_num_gpu_blocks``: one forward at the largest batch, then what
``--gpu-memory-utilization`` of the device leaves after the peak, like vLLM's
determine_num_available_blocks); on CPU ``--kv-cache-space`` GiB. CPU swap blocks:
``--num-cpu-blocks`` or ``--swap-space`` GiB (pinned memory only when CUDA exists).
"""

from __future__ import annotations

import mmap
import os
import time
from typing import NamedTuple

import numpy as np
import torch
from pagedserve.executor.device_copy import to_device
from pagedserve.executor.models import AttentionMetadata, LlamaForCausalLM, ModelConfig
from pagedserve.executor.sample_chunks import profile_sampling
from pagedserve.kernels import ops
from pagedserve.kernels.block_copy import copy_blocks_by_runs

GiB = 1 << 30


def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block over all layers, keys and values."""
    elem = torch.empty((), dtype=dtype).element_size()
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def blocks_for_space(space_gib: float, cfg: ModelConfig, block_size: int, dtype) -> int:
    return int(space_gib * GiB) // block_bytes(cfg, block_size, dtype)


class KvMemoryPlan(NamedTuple):
    """What ``profile_num_gpu_blocks`` measured (bytes), and the blocks it leaves the KV
    cache: the smaller of the two limits, ``budget`` and ``room``, in whole blocks."""

    total: int  # the device's memory
    utilization: float  # --gpu-memory-utilization
    peak: int  # the weights and the largest step's activations (torch's peak)
    outside_torch: int  # this process's memory outside torch's allocator
    reserve: int  # CUDA graphs
    free: int  # free on the device after the profile
    activations: int  # the peak less what stays allocated (the weights)
    block_bytes: int

    @property
    def budget(self) -> float:
        """This executor's share less what it holds besides the cache."""
        return self.total * self.utilization - self.peak - self.outside_torch - self.reserve

    @property
    def room(self) -> float:
        """What is free on the device now less what a step and the graphs will take."""
        return self.free - self.activations - self.reserve

    @property
    def blocks(self) -> int:
        return max(0, int(min(self.budget, self.room)) // self.block_bytes)

    def describe(self) -> str:
        """One line: the two limits on the cache and what each is made of."""
        def gib(n: float) -> str:
            return f"{n / GiB:.2f} GiB"

        return (f"this executor's share {gib(self.total * self.utilization)} "
                f"(--gpu-memory-utilization {self.utilization:.2f} of {gib(self.total)}) "
                f"less the weights and the largest step's activations {gib(self.peak)}, "
                f"CUDA graphs {gib(self.reserve)} and memory outside torch "
                f"{gib(self.outside_torch)} leaves {gib(self.budget)}; free on the device "
                f"{gib(self.free)} (other processes hold the rest) less the activations and "
                f"graphs leaves {gib(self.room)}; a block takes {self.block_bytes:,} bytes")


@torch.inference_mode()
def profile_num_gpu_blocks(
    model: LlamaForCausalLM, block_size: int, max_num_batched_tokens: int,
    gpu_memory_utilization: float, device: torch.device, reserve_bytes: int = 0,
    baseline: tuple[int, int] | None = None, kv_dtype: torch.dtype | None = None,
    sample_rows: int = 256,
) -> KvMemoryPlan:
    """Run one forward of ``max_num_batched_tokens`` prompt tokens (one sequence per
    max_model_len, so attention scratch is the largest the router may plan) with a scratch
    cache and sample ``sample_rows`` rows after it the costliest way (the most the executor
    samples at once: sample_chunks.py), then give the KV cache what is left of this
    executor's budget.

    The budget is ``gpu_memory_utilization`` x the device's memory for this process alone
    (as in vLLM): two executors at 0.4 share one GPU. It pays for the weights and the
    largest step's activations (torch's peak), ``reserve_bytes`` (the decode graphs,
    cuda_graphs.graph_memory_bytes) and what the process holds outside torch's allocator
    (``outside_torch_bytes``: NVML's figure for this process, else the device's growth
    since ``baseline`` = (device memory in use, torch reserved) taken once the model is
    loaded). The cache also never exceeds what is free on the device now less
    the activation peak and the graphs, whoever holds the rest. Returns the blocks with
    the figures they came from (``KvMemoryPlan.describe``: the executor's log, and its
    error when nothing is left)."""
    cfg = model.config
    dtype = kv_dtype or model.model.embed_tokens.weight.dtype  # the cache's
    num_tokens = max(1, max_num_batched_tokens)
    seq_len = min(cfg.max_model_len, num_tokens)
    lens = [seq_len] * (num_tokens // seq_len) + [num_tokens % seq_len] * bool(
        num_tokens % seq_len)
    blocks_per_seq = (seq_len + block_size - 1) // block_size
    num_blocks = len(lens) * blocks_per_seq
    scratch = torch.zeros(
        cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
        dtype=dtype, device=device,
    )
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    tables = torch.arange(num_blocks, dtype=torch.int32).view(len(lens), blocks_per_seq)
    slots = torch.cat([i * blocks_per_seq * block_size + torch.arange(n)
                       for i, n in enumerate(lens)])
    attn = AttentionMetadata(
        slot_mapping=slots.long().to(device),
        block_tables=tables.to(device),
        query_start_loc=torch.tensor(np.cumsum([0] + lens), dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        max_query_len=seq_len,
    )
    hidden = model(torch.zeros(num_tokens, dtype=torch.long, device=device), positions,
                   scratch, attn)
    # A chunk's logits and every work copy the sampler makes of them (sample_chunks.py)
    profile_sampling(model.compute_logits, hidden, max(sample_rows, len(lens)))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - scratch.numel() * scratch.element_size()
    del scratch, hidden
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    outside_torch = outside_torch_bytes(device, free, total, reserved, baseline)
    activations = max(0, peak - torch.cuda.memory_allocated(device))
    return KvMemoryPlan(total, gpu_memory_utilization, peak, outside_torch, reserve_bytes,
                        free, activations, block_bytes(cfg, block_size, dtype))


def outside_torch_bytes(device: torch.device, free: int, total: int, reserved: int,
                        baseline: tuple[int, int] | None) -> int:
    """Device memory this process holds outside torch's allocator (the CUDA context, cuBLAS
    and Triton workspaces and modules). From NVML's per-process figure where NVML lists this
    process; else the growth of the whole device's use since ``baseline`` less torch's, which
    also counts what other processes allocated meanwhile: on a GPU shared by executors that
    start together, one executor would pay for the other's cache (seen on an H100: 2,546 vs
    147,421 blocks at 0.4 each)."""
    process = process_device_bytes(device)
    if process is not None:
        return max(0, process - reserved)
    used_then, reserved_then = baseline if baseline else (total - free, reserved)
    return max(0, (total - free - used_then) - (reserved - reserved_then))


def process_device_bytes(device: torch.device) -> int | None:
    """Device memory in use by this process (every allocator and the context), from NVML;
    None where NVML (the nvidia-ml-py package) is missing, fails, or does not list this
    process's pid (a container's own PID namespace)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            handle = pynvml.nvmlDeviceGetHandleByUUID(
                uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == os.getpid() and isinstance(proc.usedGpuMemory, int):
                    return proc.usedGpuMemory
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # pynvml.NVMLError and its many subclasses, an old driver
        return None
    return None


def memory_accounting(device: torch.device) -> str:
    """Which way ``outside_torch_bytes`` counts on this device (logged, and in the GPU check's
    memory figures): "nvml-process" or "device-delta"."""
    return "nvml-process" if process_device_bytes(device) is not None else "device-delta"


def memory_baseline(device: torch.device) -> tuple[int, int]:
    """(device memory in use, torch reserved) now: ``profile_num_gpu_blocks``'s baseline,
    taken once the model is loaded (runner_setup)."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free, torch.cuda.memory_reserved(device)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """torch.zeros(shape), but in CPU memory as anonymous pages that the kernel zeroes when
    first touched: torch.zeros writes every byte at once (the default 1 GiB cache and 0.5 GiB
    of swap took 1-3 s of an executor's start, and as much resident memory, unused)."""
    device = torch.device(device)
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # the tensor holds the mapping; it is unmapped when the tensor is freed
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


class CacheEngine:
    """Owns ``kv_cache`` (device) and ``cpu_cache`` (swap space); applies a plan's block
    moves. Block ids are checked by the caller (ModelRunner) before anything runs."""

    def __init__(
        self, cfg: ModelConfig, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.device = device
        shape = (cfg.num_layers, 2)
        tail = (block_size, cfg.num_kv_heads, cfg.head_dim)
        # zeros, not empty: the attention twins multiply padding slots by probability 0,
        # and 0 * NaN from uninitialised memory would poison a row.
        self.kv_cache = _zeros((*shape, num_gpu_blocks, *tail), dtype, device)
        pinned = torch.cuda.is_available() and device.type == "cuda"
        self.cpu_cache = (
            torch.zeros(*shape, num_cpu_blocks, *tail, dtype=dtype, device="cpu", pin_memory=True)
            if pinned else _zeros((*shape, num_cpu_blocks, *tail), dtype, "cpu"))
        self.block_bytes = block_bytes(cfg, block_size, dtype)
        # What a block is, byte for byte (Hello.kv_format): blocks move between executors
        # only when this is equal (the same model, block size and cache dtype).
        self.kv_format = (f"{str(dtype).removeprefix('torch.')}:{cfg.num_layers}x2x"
                          f"{block_size}x{cfg.num_kv_heads}x{cfg.head_dim}")

    def apply_moves(self, moves: list[tuple[str, np.ndarray]], kv_import: np.ndarray | None,
                    kv_import_data: np.ndarray | None) -> float:
        """A plan's block moves in DESIGN §2's order, blocks received from another executor
        first (``import_blocks``); returns the seconds they took (the device synchronized)."""
        if not moves and kv_import is None:
            return 0.0
        t0 = time.perf_counter()
        if kv_import is not None and kv_import.shape[0]:
            self.import_blocks(kv_import, kv_import_data)
        for name, pairs in moves:
            getattr(self, name)(torch.from_numpy(pairs.astype(np.int64)))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def export_blocks(self, block_ids: np.ndarray) -> np.ndarray:
        """Device blocks ``block_ids`` as bytes, block after block (each block's layers,
        keys then values, in the cache's layout): what another executor's
        ``import_blocks`` takes (router/handoff.py moves them)."""
        ids = block_ids.astype(np.int64)
        if self.device.type != "cpu":  # one gather on the device, one copy to the host
            idx = torch.from_numpy(ids).to(self.device)
            blocks = self.kv_cache.index_select(2, idx).movedim(2, 0).contiguous()
            return blocks.cpu().view(-1).view(torch.uint8).numpy()
        out = np.empty(len(ids) * self.block_bytes, dtype=np.uint8)
        if len(ids):
            copy_blocks_by_runs(self.kv_cache, self._block_major(out, len(ids)), ids,
                                np.arange(len(ids)))
        return out

    def import_blocks(self, cpu_ids: np.ndarray, data: np.ndarray) -> None:
        """Write blocks exported by another executor (``export_blocks``) into CPU blocks
        ``cpu_ids``; a swap-in brings them to the device."""
        n = cpu_ids.shape[0]
        if n:
            copy_blocks_by_runs(self._block_major(data, n), self.cpu_cache, np.arange(n),
                                cpu_ids.astype(np.int64))

    def _block_major(self, data: np.ndarray, n: int) -> torch.Tensor:
        """`n` blocks' bytes, block after block (the wire's order), as a view in the
        cache's layout [L, 2, n, ...]."""
        blocks = torch.from_numpy(data).view(self.cpu_cache.dtype)
        return blocks.view(n, *self.cpu_cache.shape[:2], *self.cpu_cache.shape[3:]).movedim(0, 2)

    def swap_out(self, pairs: torch.Tensor) -> None:
        """(device block, cpu block) rows."""
        ops.swap_blocks(self.kv_cache, self.cpu_cache, pairs)

    def swap_in(self, pairs: torch.Tensor) -> None:
        """(cpu block, device block) rows."""
        ops.swap_blocks(self.cpu_cache, self.kv_cache, pairs)

    def copy(self, pairs: torch.Tensor) -> None:
        """(src device block, dst device block) rows: copy-on-write."""
        ops.copy_blocks(self.kv_cache, to_device(pairs, self.device))
