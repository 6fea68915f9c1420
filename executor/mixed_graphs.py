"""Steps that compute prompt tokens, replayed as CUDA graphs in pieces around the attention.

Why: the decode graphs (cuda_graphs.py) replay whole decode-only steps; every other step ran
eagerly, and on an H200 an eager step of the Qwen2.5-0.5B shape took ~12 ms of host time
to launch its ~280 kernels, against ~2.4 ms of device work at 256 decodes (benchmarks/README
"GPU check"). A server whose streams end and start steadily computes a prompt chunk in most
steps, so most steps were eager. Attention cannot be captured with the rest: its launch
depends on the step's sequences (the prefill kernel's grid on the longest chunk).

What is captured, per token-count bucket B (``mixed_token_buckets``: 16, 32, ..., 2048): the
forward cut at
its L attention calls into L + 1 pieces, each a CUDA graph —
  piece 0: the embedding, RoPE's cos/sin, layer 0's input norm, q/k/v, rotary, cache write;
  piece i (1..L-1): layer i-1's output projection, norm and MLP, then piece 0's layer part
  for layer i (norm with the residual add, q/k/v, rotary, cache write);
  piece L: layer L-1's output projection, norm and MLP, and the final norm.
Between pieces, layer i's attention runs eagerly on the step's T real tokens with the
step's metadata, reading q from and writing its output to static buffers. A step of T
tokens runs in the smallest bucket B >= T; rows T..B are padding: token 0, position 0, slot
-1 (their keys and values are not written), and no attention reads them (a query row
outside every sequence; keys only through block tables); the pieces compute them and the
runner drops them. So a step launches L + 1 graphs and L attention kernels, not ~12 kernels
a layer.

Static buffers, sized for the largest bucket: ``input_ids``, ``positions``,
``slot_mapping`` [B_max]; ``cos_sin`` [B_max, 2, D]; ``residual`` and ``hidden``
[B_max, hidden]; ``q`` and ``attn_out`` [B_max, H, D]. Each piece reads and writes only
these (the fused RMSNorm adds into ``residual`` in place; the torch forms return new
tensors, copied back), so a piece's own intermediates are dead when it ends and every
piece and bucket shares one private memory pool, captured largest bucket first and each
bucket's pieces in replay order.

Memory: ``mixed_graph_memory_bytes`` measures a capture of the largest bucket against a
scratch cache before the KV cache is sized, as the decode graphs' is.

LoRA adapters (models/lora.py): with adapters loaded, every piece applies every adapter's
update, each token's from its slot in a static buffer (0: none, padding rows too), the mask
built once a step by piece 0 into ``lora_mask`` and read by the others.

On a CPU (tests only) "capture" keeps each piece as a function of the static buffers and
"replay" calls it: the cut, the padding and the buffer traffic are tested without CUDA.
"""

from __future__ import annotations

import bisect
import gc
import logging
import time

import numpy as np
import torch
from pagedserve.executor.cuda_graphs import no_collection_while_capturing
from pagedserve.executor.models import AttentionMetadata, LlamaForCausalLM
from pagedserve.executor.models.lora import LoraSet, LoraStep, StaticLoraSlots

log = logging.getLogger(__name__)

# Steps above this many tokens keep running eagerly: their device work outgrows the launch
# cost (a 4k-token step of a 0.5B model is ~8 TFLOP, several ms on an H100), and the pool
# holds the largest bucket's activations.
MAX_MIXED_TOKENS = 2048


def mixed_token_buckets(limit: int) -> list[int]:
    """Captured token counts up to ``limit`` (ascending): powers of two from 16 (16, 32, ...,
    2048) and ``limit`` itself when it lies between. Padding is at most the step again,
    computed by matmuls that at these sizes cost far less than the launches they replace;
    each bucket is L + 1 captures at start-up."""
    limit = min(limit, MAX_MIXED_TOKENS)
    if limit < 2:
        return []
    sizes, b = [], 16
    while b < limit:
        sizes.append(b)
        b *= 2
    return sorted(set(sizes) | {limit})


def _keep(buffer: torch.Tensor, value: torch.Tensor) -> None:
    """Make ``buffer`` hold ``value``: nothing when an in-place kernel already wrote it."""
    if value.data_ptr() != buffer.data_ptr():
        buffer.copy_(value)


class MixedGraphs:
    """Static buffers and L + 1 captured pieces per token bucket (module docstring)."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor,
                 max_tokens: int, loras: LoraSet | None = None) -> None:
        cfg = model.config
        self.model = model
        self.layers = list(model.model.layers)
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.sizes = mixed_token_buckets(max_tokens)
        self.max_tokens = self.sizes[-1] if self.sizes else 0
        n, dev = self.max_tokens, self.device
        dtype = model.model.embed_tokens.weight.dtype
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.cos_sin = torch.zeros(n, 2, cfg.head_dim, dtype=dtype, device=dev)
        self.residual = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=dev)
        self.hidden = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=dev)
        self.q = torch.zeros(n, cfg.num_heads, cfg.head_dim, dtype=dtype, device=dev)
        self.attn_out = torch.zeros_like(self.q)
        self.loras = loras
        self.lora_slots = StaticLoraSlots(n, dev) if loras is not None else None
        self.lora_mask = torch.zeros(n, loras.owner.shape[0], dtype=dtype, device=dev) \
            if loras is not None else None
        self._pieces: dict[int, list] = {}  # bucket -> L + 1 replays
        self._captured: list[int] = []
        self._graphs: list = []  # the torch.cuda.CUDAGraph objects, kept alive
        self._pool = None
        self.capture_s = 0.0

    # -------------------------------------------------------------------------- pieces
    def _piece(self, index: int, size: int) -> None:
        """Piece ``index`` of the forward over the first ``size`` rows of the buffers."""
        residual = self.residual[:size]
        lora = self._lora(size, index == 0)
        if index == 0:
            x, cos_sin = self.model.embed(self.input_ids[:size], self.positions[:size])
            self.cos_sin[:size].copy_(cos_sin)
            q, res = self.layers[0].pre_attention(x, None, self.cos_sin[:size],
                                                  self.kv_cache[0], self.slot_mapping[:size],
                                                  lora)
            _keep(residual, res)
            self.q[:size].copy_(q)
            return
        x, res = self.layers[index - 1].post_attention(self.attn_out[:size], residual, lora)
        _keep(residual, res)
        if index == len(self.layers):
            self.hidden[:size].copy_(self.model.final_norm(x, residual))
            return
        q, res = self.layers[index].pre_attention(x, residual, self.cos_sin[:size],
                                                  self.kv_cache[index],
                                                  self.slot_mapping[:size], lora)
        _keep(residual, res)
        self.q[:size].copy_(q)

    def _lora(self, size: int, first: bool) -> LoraStep | None:
        """The pieces' LoRA view over the first ``size`` tokens (None: no adapters); the
        first piece builds the mask from the static slots."""
        if self.loras is None:
            return None
        if first:
            self.lora_mask[:size].copy_(
                self.loras.graph_step(self.lora_slots.buffer[:size]).mask)
        return LoraStep(mask=self.lora_mask[:size], cols=None)

    # ------------------------------------------------------------------------- capture
    @torch.inference_mode()
    def capture(self, sizes: list[int] | None = None) -> None:
        """Capture the given buckets (default: all), largest first, each bucket's pieces in
        replay order, into one pool. The buffers hold padding (slot -1): the warm-up runs
        write no cache block."""
        t0 = time.perf_counter()
        self._pad(0, self.max_tokens)
        with no_collection_while_capturing():
            for size in sorted(self.sizes if sizes is None else sizes, reverse=True):
                pieces = []
                for index in range(len(self.layers) + 1):
                    if self.device.type != "cuda":
                        pieces.append(lambda index=index, size=size: self._piece(index, size))
                        continue
                    pieces.append(self._capture_cuda(index, size))
                self._pieces[size] = pieces
        self._captured = sorted(self._pieces)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.capture_s += time.perf_counter() - t0

    def _capture_cuda(self, index: int, size: int):
        # Warm-up on a side stream (Triton compiles for this size, cuBLAS picks its
        # algorithms), then the capture records launches only.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._piece(index, size)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._piece(index, size)
        self._pool = graph.pool()
        self._graphs.append(graph)
        return graph.replay

    # -------------------------------------------------------------------------- replay
    def size_for(self, num_tokens: int) -> int | None:
        i = bisect.bisect_left(self._captured, num_tokens)
        return self._captured[i] if i < len(self._captured) else None

    def can_run(self, input_ids: torch.Tensor, attn: AttentionMetadata) -> bool:
        """A step of at most the largest bucket's tokens (the runner asks the decode graphs
        first: here come the steps with prompt tokens, and decode steps of more sequences
        than the decode graphs hold)."""
        captured = self._captured
        return bool(captured) and 0 < input_ids.shape[0] <= captured[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            attn: AttentionMetadata, lora_slots: np.ndarray | None = None) -> torch.Tensor:
        """The hidden states of the step's tokens (``can_run`` true; ``lora_slots``: each
        token's adapter slot, None: none): a view of the static output, valid until the next
        step."""
        n = input_ids.shape[0]
        if self.lora_slots is not None:
            self.lora_slots.set(lora_slots)
        size = self.size_for(n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(attn.slot_mapping, non_blocking=True)
        if size > n:
            self._pad(n, size)
        pieces = self._pieces[size]
        pieces[0]()
        q, attn_out = self.q[:n], self.attn_out[:n]
        for i, layer in enumerate(self.layers):
            _keep(attn_out, layer.self_attn.attend(q, self.kv_cache[i], attn, out=attn_out))
            pieces[i + 1]()
        return self.hidden[:n]

    def _pad(self, start: int, stop: int) -> None:
        self.input_ids[start:stop].zero_()
        self.positions[start:stop].zero_()
        self.slot_mapping[start:stop].fill_(-1)


@torch.inference_mode()
def mixed_graph_memory_bytes(model: LlamaForCausalLM, block_size: int, max_tokens: int,
                             device: torch.device, loras: LoraSet | None = None) -> int:
    """Device memory the mixed-step graphs for up to ``max_tokens`` tokens will hold,
    measured before the KV cache exists: the static buffers and the pool of the largest
    bucket (which the smaller ones reuse), captured against a one-block scratch cache,
    plus the smallest bucket's increase once per further bucket. Freed on return."""
    sizes = mixed_token_buckets(max_tokens)
    if not sizes or device.type != "cuda":
        return 0
    cfg = model.config
    dtype = model.model.embed_tokens.weight.dtype
    scratch = torch.zeros(cfg.num_layers, 2, 1, block_size, cfg.num_kv_heads, cfg.head_dim,
                          dtype=dtype, device=device)

    def reserved() -> int:
        # Collected first: garbage the collector would otherwise free during a capture (a
        # dropped runner's cache, say) gives its segments back at the next empty_cache and
        # takes them off the capture's growth (an H100 run measured 0 bytes that way).
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(device)

    before = reserved()
    graphs = MixedGraphs(model, scratch, max_tokens, loras)
    graphs.capture([sizes[-1]])
    largest = reserved() - before
    extra_each = 0
    if len(sizes) > 1:
        graphs.capture([sizes[0]])
        extra_each = max(0, reserved() - before - largest)
    del graphs
    torch.cuda.empty_cache()
    return max(0, largest) + extra_each * (len(sizes) - 1)
