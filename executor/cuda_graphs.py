"""Decode steps replayed as CUDA graphs.

Why: a decode step of a small model on a large GPU is bound by kernel launches, not by the
GPU: the Qwen2.5-0.5B shape launches ~15 kernels per layer x 24 layers, each a few
microseconds of Python and driver work, while its math at batch 64 takes well under a
millisecond. Captured once, the whole forward replays with one call.

What is captured: ``model.forward`` (embedding to the final norm) of a decode-only batch
(one new token per sequence), for each batch size of ``graph_batch_sizes``: 1, 2, 4, 8, then
multiples of 8 up to the limit. A batch of ``n`` sequences runs in the graph of the smallest
size ``B >= n``; rows ``n..B`` are padding, made harmless by their inputs: slot -1 (the cache
write skips it), context length 0 (attention reads nothing and returns 0), token and
position 0. Their hidden states are computed and dropped. The logits of every row are
computed in the graph too (``logits``, valid until the next replay): in a decode step
every row samples (a sequence's one new token), and eagerly the vocabulary matmul and the
gather of the sampling rows before it cost ~0.1 ms of host time a step on an H200 (the
padding rows' few extra logits are negligible next to it). So is every row's greedy token
(``tokens``, the argmax of its logits, ``ops.argmax_rows``): a step whose rows are all
plain greedy (the usual serving step) then launches no sampling kernel, only the tokens'
copy to the host, which takes the sampler's two Triton launches and their Python work off
the host's critical path between forwards; a step that samples otherwise ignores them (the
argmax's ~26 us of device time at 256 rows spent for nothing there). Other sampling stays
eager.

Static inputs: one set of buffers sized for the largest graph, ``input_ids``, ``positions``,
``slot_mapping``, ``seq_lens`` [B_max] and ``block_tables`` [B_max, W] with
W = ceil(max_model_len / block_size); the graph of size B reads the first B rows (views of
the same storage). A block-table row is read only up to its context length, so what earlier
steps left beyond it needs no clearing. The decode kernel picks its split-K partition count
from shapes (the table width, the batch size), so each graph's count is fixed at capture,
with the full width W: at small batches a short context leaves most splits empty (they
write no partials and are not read back: kernels/decode_attention.py).

Feeding them (graph_feed.py): each graph's first node (``ops.graph_inputs_``) writes the
static inputs from ``stage``, one int32 buffer the host fills for the step (its rows' values
and tables, packed) and copies in with one copy (``run_feed``); padding rows are written
there too, and a steady decode's token ids are read straight from ``last_tokens``, where
every graph leaves its rows' greedy tokens. ``run`` (inputs already on the device) copies
them in buffer by buffer instead and tells the graph's first node to leave them.
``PAGEDSERVE_GRAPH_FEED=0``, or a cache with 2^31 slots or more (the stage is int32), keeps
the graphs without that node: every step then goes through ``run``.

Memory: graphs are captured largest first into one private memory pool, which smaller
graphs reuse; ``graph_memory_bytes`` measures a capture against a scratch cache before the
KV cache is sized, so profiling leaves room for it (``cache_engine.profile_num_gpu_blocks``).

Not used for: a step with a prefill token (those replay graph pieces cut at the attention
calls: mixed_graphs.py), more sequences than the largest graph, a block
table wider than W, a non-CUDA device, ``--enforce-eager``, or the torch kernel twins on
CUDA (``PAGEDSERVE_KERNEL_BACKEND=torch``: they read lengths back to the host, which a
capture cannot do). A capture that fails is logged and leaves the runner eager.

On a CPU (tests only), ``DecodeGraphs`` works the same way except that "capture" keeps the
forward as a function of the static buffers and "replay" calls it: the padding, the buffer
copies and the choice of size are then tested where there is no CUDA.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging
import os
import time
from collections.abc import Callable

import numpy as np
import torch
from pagedserve.executor.graph_feed import GraphFeed, StagingRing, feeds_wanted, pack
from pagedserve.executor.models import AttentionMetadata, LlamaForCausalLM
from pagedserve.executor.models.lora import LoraSet, StaticLoraSlots
from pagedserve.kernels import ops
from pagedserve.kernels.graph_input_ops import (
    ALL_IN_PLACE,
    IDS_FROM_LAST_TOKENS,
    IDS_FROM_STAGE,
    IDS_IN_PLACE,
    stage_words,
)

log = logging.getLogger(__name__)

# Above this many sequences a decode step is long enough that launches no longer dominate,
# and each captured size costs start-up time and a little memory.
MAX_GRAPH_BATCH = 256


def graph_batch_sizes(limit: int) -> list[int]:
    """Captured batch sizes up to ``limit`` (ascending): 1, 2, 4, 8, 16, 24, ... and
    ``limit`` itself, so every batch of at most ``limit`` sequences has a graph and pads at
    most 7 rows (or doubles, below 8)."""
    limit = min(limit, MAX_GRAPH_BATCH)
    if limit < 1:
        return []
    sizes = [s for s in (1, 2, 4) if s < limit] + list(range(8, limit, 8))
    return sorted(set(sizes) | {limit})


def graphs_supported(device: torch.device) -> str:
    """Why CUDA graphs cannot be used here ("" when they can)."""
    if device.type != "cuda":
        return f"device {device.type} (graphs are CUDA only)"
    backend = os.environ.get("PAGEDSERVE_KERNEL_BACKEND", "auto")
    if backend == "torch":
        return "PAGEDSERVE_KERNEL_BACKEND=torch (the twins synchronise with the host)"
    return ""


@contextlib.contextmanager
def no_collection_while_capturing():
    """Collect garbage now and keep the cyclic collector off until the captures end.

    A CUDA graph left in a reference cycle (an earlier runner's graphs, a scratch capture
    of the memory profile) is destroyed whenever the collector runs; if that happens while
    a stream is capturing, the destruction is an illegal call during capture and
    invalidates the capture in flight (seen on an H200: `cudaErrorStreamCaptureInvalidated`
    from a piece's GEMM after CUDAGraph.reset warned "operation not permitted when stream
    is capturing"). torch's capture context no longer collects on entry by default."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_MAX_VIEW_SHAPES = 1024  # DecodeGraphs._views: step shapes whose input views are kept


class _Replay:
    """One captured size: ``replay()`` reruns it; ``hidden``, ``logits`` and ``tokens``
    (every row's argmax) are its output buffers."""

    def __init__(self, replay: Callable[[], object], hidden: torch.Tensor,
                 logits: torch.Tensor, tokens: torch.Tensor, graph: object = None) -> None:
        self.replay = replay
        self.hidden = hidden
        self.logits = logits
        self.tokens = tokens
        self.graph = graph  # the torch.cuda.CUDAGraph, kept alive with its pool


class DecodeGraphs:
    """Static decode buffers and one replay per batch size (see the module docstring)."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, block_size: int,
                 max_model_len: int, max_batch: int, loras: LoraSet | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = self.sizes[-1] if self.sizes else 0
        self.width = -(-max_model_len // block_size)
        n, dev = self.max_batch, self.device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros((n, self.width), dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        # LoRA adapters (models/lora.py): every graph applies every adapter's update, each
        # row's from its slot in ``lora_slots`` (0: none, padding rows too), so decode
        # steps with adapter rows replay too; a step of base rows pays the dense update.
        self.loras = loras
        self.lora_slots = StaticLoraSlots(n, dev) if loras is not None else None
        # Every graph's greedy tokens land here, row for row (a steady decode's next input
        # ids); the staged inputs the graphs' first node reads (None: not fed, see above).
        self.last_tokens = torch.zeros(n, dtype=torch.long, device=dev)
        num_slots = kv_cache.shape[2] * kv_cache.shape[3] if kv_cache.dim() == 6 else 0
        # The graphs scatter the stage (their first node); `feeds`: steps are fed (off
        # when the start-up check finds the scatter wrong: `run` then tells it to leave
        # the buffers as copied).
        self.scatters = feeds_wanted() and n > 0 and num_slots < 2 ** 31
        self.feeds = self.scatters
        self.stage: torch.Tensor | None = None
        self.fed = [0, 0, 0]  # fed steps by where their ids came from (ids_from 0, 1, 2)
        self._ring: StagingRing | None = None  # made at the first fed step
        if self.scatters:
            self.stage = torch.zeros(stage_words(n, self.width), dtype=torch.int32, device=dev)
            self._in_place = torch.tensor([n, 0, ALL_IN_PLACE, 0], dtype=torch.int32,
                                          device=dev)
        self._replays: dict[int, _Replay] = {}
        self._captured: list[int] = []  # sorted(self._replays), kept for the per-step lookup
        self._pool = None  # the private memory pool every graph shares
        # (rows, table width) -> the static inputs' views a step of that shape copies into:
        # made once (slicing five buffers cost ~20 us of host time a step on a GPU's host).
        self._views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self.capture_s = 0.0
        # The last replay's logits, every row's [n, V], and their argmax [n] (valid until
        # the next replay).
        self.logits: torch.Tensor | None = None
        self.tokens: torch.Tensor | None = None

    # ------------------------------------------------------------------------- capture
    def _forward(self, size: int) -> torch.Tensor:
        attn = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            max_query_len=1, lora=None if self.loras is None
            else self.loras.graph_step(self.lora_slots.buffer[:size]))
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_cache, attn)

    @torch.inference_mode()
    def capture(self, sizes: list[int] | None = None) -> None:
        """Capture the given sizes (default: all), largest first, into the shared pool.
        The buffers hold padding throughout (slot -1), so the warm-up runs write nothing
        into the cache."""
        t0 = time.perf_counter()
        self._pad(0, self.max_batch)
        with no_collection_while_capturing():
            for size in sorted(self.sizes if sizes is None else sizes, reverse=True):
                if self.device.type != "cuda":
                    self._replays[size] = self._capture_twin(size)
                    continue
                self._replays[size] = replay = self._capture_cuda(size, self._pool)
                self._pool = replay.graph.pool()
        self._captured = sorted(self._replays)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.capture_s += time.perf_counter() - t0

    def _outputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(hidden, logits, greedy tokens) of the static inputs' first ``size`` rows (fed
        graphs: written from the stage first)."""
        if self.scatters:
            ops.graph_inputs_(self.stage, self.input_ids[:size], self.positions[:size],
                              self.slot_mapping[:size], self.seq_lens[:size],
                              self.block_tables[:size], self.last_tokens)
        hidden = self._forward(size)
        logits = self.model.compute_logits(hidden)
        return hidden, logits, ops.argmax_rows(logits, out=self.last_tokens[:size])

    def _capture_twin(self, size: int) -> _Replay:
        holder = _Replay(lambda: None, *self._outputs(size))

        def replay() -> None:
            for out, value in zip((holder.hidden, holder.logits, holder.tokens),
                                  self._outputs(size), strict=True):
                out.copy_(value)

        holder.replay = replay
        return holder

    def _capture_cuda(self, size: int, pool) -> _Replay:
        # Warm up on a side stream (Triton compiles this size's kernels, cuBLAS picks its
        # algorithms and workspace) so the capture records launches only.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._outputs(size)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs = self._outputs(size)
        return _Replay(graph.replay, *outputs, graph)

    @property
    def feed_rows(self) -> int:
        """The most rows a fed step can have (0: the graphs are not fed)."""
        return self._captured[-1] if self.feeds and self._captured else 0

    # -------------------------------------------------------------------------- replay
    def size_for(self, num_seqs: int) -> int | None:
        """The smallest captured size that holds ``num_seqs`` sequences."""
        i = bisect.bisect_left(self._captured, num_seqs)
        return self._captured[i] if i < len(self._captured) else None

    def can_run(self, input_ids: torch.Tensor, attn: AttentionMetadata) -> bool:
        captured = self._captured
        return (attn.max_query_len == 1 and attn.block_tables.shape[1] <= self.width
                and bool(captured) and 0 < input_ids.shape[0] <= captured[-1])

    def can_feed(self, num_seqs: int, width: int) -> bool:
        """Can a decode step of ``num_seqs`` rows, tables ``width`` wide, run fed
        (`run_feed`)?"""
        return 0 < num_seqs <= self.feed_rows and width <= self.width

    def run_feed(self, feed: GraphFeed, input_ids: torch.Tensor | None,
                 lora_slots: np.ndarray | None = None) -> torch.Tensor:
        """`run` from host arrays (``can_feed`` true): the token ids are ``feed``'s or
        ``input_ids`` on the device (read from ``last_tokens`` by the graph when they are
        its rows there, else copied in first); the rest packed into a staging buffer and
        copied to ``stage`` in one copy; the rows' LoRA slots (None: none) copied in;
        replay."""
        n = feed.num_rows
        if self.lora_slots is not None:
            self.lora_slots.set(lora_slots)
        if input_ids is None:
            ids_from = IDS_FROM_STAGE
        elif (input_ids.data_ptr() == self.last_tokens.data_ptr()
              and input_ids.shape == (n,) and input_ids.dtype == torch.long):
            ids_from = IDS_FROM_LAST_TOKENS
        else:
            ids_from = IDS_IN_PLACE
            self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.fed[ids_from] += 1
        ring = self._ring
        if ring is None:
            ring = self._ring = StagingRing(self.stage.shape[0], self.device)
        i = ring.take()
        ring.copy_out(i, pack(ring.arrays[i], feed, ids_from), self.stage)
        return self._replay(n)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            attn: AttentionMetadata, lora_slots: np.ndarray | None = None) -> torch.Tensor:
        """The hidden states of a decode batch (``can_run`` true): copy its rows in (their
        LoRA slots too: None, none), pad the rest of the graph's rows, replay; a view of
        the graph's output, valid until the next replay (and every row's logits and greedy
        token in ``self.logits`` and ``self.tokens``, likewise)."""
        n = input_ids.shape[0]
        if self.lora_slots is not None:
            self.lora_slots.set(lora_slots)
        shape = (n, attn.block_tables.shape[1])
        views = self._views.get(shape)
        if views is None:
            if len(self._views) >= _MAX_VIEW_SHAPES:  # widths vary: keep the set bounded
                self._views.clear()
            views = self._views[shape] = (
                self.input_ids[:n], self.positions[:n], self.slot_mapping[:n],
                self.seq_lens[:n], self.block_tables[:n, :shape[1]])
        for static, value in zip(views, (input_ids, positions, attn.slot_mapping,
                                         attn.seq_lens, attn.block_tables), strict=True):
            static.copy_(value, non_blocking=True)
        if self.scatters:
            self.stage[:4].copy_(self._in_place)
        size = self.size_for(n)
        if size > n:
            self._pad(n, size)
        return self._replay(n)

    @torch.inference_mode()
    def check_feed(self) -> str:
        """After capture: "" when a fed replay writes the static inputs the host packed
        (rows, padding, ids from the stage and then from the last tokens), else what it
        got wrong (the executor then turns feeding off and copies buffer by buffer). Two
        replays of at most 3 rows, slots -1 (no cache write), reading block 0 only; the
        next step overwrites everything they leave."""
        if not self.feed_rows:
            return ""
        n = min(3, self._captured[-1])
        size, w = self.size_for(n), min(2, self.width)
        feed = GraphFeed(positions=np.arange(5, 5 + n), slots=np.full(n, -1),
                         seq_lens=np.arange(1, 1 + n), tables=np.zeros((n, w), np.int32),
                         token_ids=np.arange(1, 1 + n))
        expected = {"positions": [*range(5, 5 + n)] + [0] * (size - n),
                    "slot_mapping": [-1] * size,
                    "seq_lens": [*range(1, 1 + n)] + [0] * (size - n)}
        try:
            for ids in (None, self.last_tokens[:n]):
                want_ids = ([*range(1, 1 + n)] if ids is None else ids.tolist()) \
                    + [0] * (size - n)
                self.block_tables[:n, :w].fill_(7)
                self.run_feed(feed, ids)
                got = {"input_ids": self.input_ids[:size].tolist(),
                       **{k: getattr(self, k)[:size].tolist() for k in expected}}
                wrong = [k for k, v in {"input_ids": want_ids, **expected}.items()
                         if got[k] != v]
                if self.block_tables[:n, :w].any():
                    wrong.append("block_tables")
                if wrong:
                    return (f"a fed replay of {n} rows (ids from "
                            f"{'the stage' if ids is None else 'the last tokens'}) wrote "
                            f"{', '.join(wrong)} wrong")
            return ""
        finally:
            self.fed = [0, 0, 0]  # the steps' count

    def _replay(self, n: int) -> torch.Tensor:
        replay = self._replays[self.size_for(n)]
        replay.replay()
        self.logits = replay.logits[:n]
        self.tokens = replay.tokens[:n]
        return replay.hidden[:n]

    def _pad(self, start: int, stop: int) -> None:
        self.input_ids[start:stop].zero_()
        self.positions[start:stop].zero_()
        self.slot_mapping[start:stop].fill_(-1)
        self.seq_lens[start:stop].zero_()


@torch.inference_mode()
def graph_memory_bytes(model: LlamaForCausalLM, block_size: int, max_model_len: int,
                       max_batch: int, device: torch.device,
                       loras: LoraSet | None = None) -> int:
    """Device memory the graphs of ``graph_batch_sizes(max_batch)`` will hold, measured
    before the KV cache exists: capture the largest size, then the smallest, against a
    one-block scratch cache (padding rows read and write no block). The largest capture
    holds the shared pool (the activations of the largest batch); the smallest's increase
    is what each further graph adds, counted once per remaining size. Counted from this
    process's allocator (the driver's own few bytes per graph node are not). Freed on
    return."""
    sizes = graph_batch_sizes(max_batch)
    if not sizes or graphs_supported(device):
        return 0
    cfg = model.config
    dtype = model.model.embed_tokens.weight.dtype
    scratch = torch.zeros(cfg.num_layers, 2, 1, block_size, cfg.num_kv_heads, cfg.head_dim,
                          dtype=dtype, device=device)

    def reserved() -> int:  # this process's allocator, once the warm-ups' cached blocks
        torch.cuda.synchronize(device)  # that nothing holds are released (another process
        torch.cuda.empty_cache()  # on the same GPU does not disturb the figure)
        return torch.cuda.memory_reserved(device)

    reserved_before = reserved()  # the static buffers count: the real graphs have them too
    graphs = DecodeGraphs(model, scratch, block_size, max_model_len, sizes[-1], loras)

    def held() -> int:
        return reserved() - reserved_before

    graphs.capture([sizes[-1]])
    largest = held()
    extra_each = 0
    if len(sizes) > 1:
        graphs.capture([sizes[0]])
        extra_each = max(0, held() - largest)
    del graphs
    torch.cuda.empty_cache()
    return max(0, largest) + extra_each * (len(sizes) - 1)
