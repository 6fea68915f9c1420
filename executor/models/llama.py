"""The Llama family (Llama 2/3, Mistral without sliding window, Qwen2, Qwen3) on a flat,
variable-length token batch with a paged KV cache.

One module with three switches from ModelConfig: ``qkv_bias`` (Qwen2, attention_bias),
``qk_norm`` (Qwen3's per-head RMSNorm on q and k before RoPE) and the RoPE frequencies
(default, linear, llama3). q/k/v and gate/up are fused into one matmul each at load time.

Hot path: no Python loops over sequences or tokens here, no host syncs, no allocation that
depends on the batch beyond the activations themselves. Per-step attention metadata is an
argument (AttentionMetadata), never module state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pagedserve.executor.models.config import ModelConfig
from pagedserve.executor.models.lora import LoraStep
from pagedserve.kernels import ops
from pagedserve.kernels.host_math import fused_rope_from_env, triton_gemm_from_env
from pagedserve.kernels.step_memo import forward_scope
from torch import nn

# PAGEDSERVE_DECODE_TRITON_GEMM (1, or some of qkv, o, gate_up, down): those projections of
# batches of up to 512 tokens through the split-K Triton GEMM (ops.linear), not cuBLAS; none
# until a GPU has measured them. Read at import, leniently (an executor checks the value at
# its start and exits 2 on a bad one).
TRITON_GEMM = triton_gemm_from_env(strict=False)


def project(linear: nn.Linear, x: torch.Tensor, name: str,
            lora: LoraStep | None = None) -> torch.Tensor:
    """The layer's projection ``name`` (qkv, o, gate_up, down: ops.linear, cuBLAS or the
    Triton GEMM), plus the LoRA adapters' update of each token where the step has tokens
    with an adapter (``lora``, models/lora.py)."""
    y = ops.linear(x, linear.weight, linear.bias, triton_gemm=name in TRITON_GEMM,
                   packed=linear.packed)
    if lora is not None and linear.lora is not None:
        linear.lora.add_(y, x, lora)
    return y


def _linear(fan_in: int, fan_out: int, bias: bool) -> nn.Linear:
    """A projection, with no LoRA update until a LoraSet installs one (models/lora.py) and
    its weight in torch's layout until a CPU executor packs it (executor/packed_weights.py)."""
    linear = nn.Linear(fan_in, fan_out, bias)
    linear.lora = None
    linear.packed = None
    return linear


@dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's tokens go in the paged cache and what each sequence attends to."""

    slot_mapping: torch.Tensor  # int64 [T]
    block_tables: torch.Tensor  # int32 [S, max_blocks]
    query_start_loc: torch.Tensor  # int32 [S + 1]
    seq_lens: torch.Tensor  # int32 [S], cached tokens incl. this step's
    max_query_len: int
    # steps with prompt tokens: (d, the rest's query_start_loc from 0) when the first d
    # sequences go to the decode kernel (ops.decode_split_of; off unless switched on)
    decode_split: tuple[int, torch.Tensor] | None = None
    # steps with tokens of LoRA adapters: their adapters' columns and mask (LoraSet.step;
    # None: no token has one). Not attention's, but every projection's per-step input.
    lora: LoraStep | None = None


class RMSNorm(nn.Module):
    # "auto": the fused Triton kernel on CUDA, the torch form on CPU; runner_setup sets
    # "torch" on every module when the fused kernels fail their start-up check.
    kernel_backend = "auto"

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with ``residual`` (norm(x + residual), x + residual)."""
        return ops.rms_norm(x, self.weight, self.eps, residual, backend=self.kernel_backend)


class Attention(nn.Module):
    kernel_backend = "auto"  # of the rotary embedding; see RMSNorm
    # Decode steps (one token a sequence): the rotary embedding and the cache write done by
    # the attention kernel in its launch (ops.paged_decode_attention's rope), not a launch
    # before it: one launch a layer fewer (on an H200, 2026-11-27: 0.452 of the bandwidth
    # bound at batch 256 against 0.420). None (the default): wherever the Triton kernels
    # run (a GPU); PAGEDSERVE_DECODE_FUSED_ROPE=0 never, =1 always. An executor on a GPU
    # checks at start that the fused launch gives the two launches' values to the bit at
    # its model's shapes, and turns it off where it does not (kernel_checks.py). Read at
    # import, leniently: this module is imported before an executor checks the value (and
    # exits 2 on a bad one).
    fused_decode_rope: bool | None = fused_rope_from_env(strict=False)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = _linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias)
        self.qkv_proj.shard_sizes = (self.q_size, self.kv_size, self.kv_size)
        self.o_proj = _linear(self.q_size, cfg.hidden_size, cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def fuses_decode_rope(self, attn: AttentionMetadata) -> bool:
        """Does a step of this shape take `decode_rope`? (Qwen3's q/k norms come between
        the projection and the rotary: not fused.)"""
        if attn.max_query_len != 1 or self.qk_norm or self.kernel_backend != "auto":
            return False
        fused = self.fused_decode_rope
        return ops.runs_triton(attn.slot_mapping) if fused is None else fused

    def decode_rope(self, x, cos_sin, kv_cache: torch.Tensor,
                    attn: AttentionMetadata) -> torch.Tensor:
        """`qkv_and_cache` then `attend` for a decode step, the rotary and the cache write
        inside the attention's launch: [T, H, D]."""
        q, k, v = self.qkv(x, attn.lora)
        return ops.paged_decode_attention(q, kv_cache[0], kv_cache[1], attn.block_tables,
                                          attn.seq_lens, self.scale,
                                          rope=(k, v, cos_sin, attn.slot_mapping))

    def qkv(self, x, lora: LoraStep | None = None):
        """(q [T, H, D], k and v [T, Hkv, D]): views of the fused projection, not rotated."""
        q, k, v = project(self.qkv_proj, x, "qkv", lora).split(
            [self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(-1, self.num_heads, self.head_dim),
                k.view(-1, self.num_kv_heads, self.head_dim),
                v.view(-1, self.num_kv_heads, self.head_dim))

    def forward(self, x, cos_sin, kv_cache: torch.Tensor, attn: AttentionMetadata):
        q = self.qkv_and_cache(x, cos_sin, kv_cache, attn.slot_mapping, attn.lora)
        return project(self.o_proj, self.attend(q, kv_cache, attn).reshape(-1, self.q_size),
                       "o", attn.lora)

    def qkv_and_cache(self, x, cos_sin, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      lora: LoraStep | None = None) -> torch.Tensor:
        """q [T, H, D] rotated; the rotated keys and the values written into this layer's
        cache at ``slot_mapping`` (-1: not written)."""
        q, k, v = self.qkv(x, lora)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, _ = ops.rotary_embedding_and_cache(q, k, v, cos_sin, kv_cache[0], kv_cache[1],
                                              slot_mapping, backend=self.kernel_backend)
        return q

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, attn: AttentionMetadata,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Paged attention of q [T, H, D] to each sequence's cached keys and values."""
        return ops.paged_attention(
            q, kv_cache[0], kv_cache[1], attn.block_tables, attn.query_start_loc,
            attn.seq_lens, self.scale, max_query_len=attn.max_query_len, out=out,
            decode_split=attn.decode_split,
        )


class MLP(nn.Module):
    kernel_backend = "auto"  # of SiLU-and-multiply; see RMSNorm

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = _linear(cfg.hidden_size, 2 * size, cfg.mlp_bias)
        self.gate_up_proj.shard_sizes = (size, size)
        self.down_proj = _linear(size, cfg.hidden_size, cfg.mlp_bias)

    def forward(self, x: torch.Tensor, lora: LoraStep | None = None) -> torch.Tensor:
        gate_up = project(self.gate_up_proj, x, "gate_up", lora)
        down = self.down_proj
        if lora is not None and down.lora is not None:  # its input is needed apart
            return project(down, ops.silu_and_mul(gate_up, backend=self.kernel_backend),
                           "down", lora)
        return ops.linear(gate_up, down.weight, down.bias, triton_gemm="down" in TRITON_GEMM,
                          silu_mul=True, backend=self.kernel_backend, packed=down.packed)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, cos_sin, kv_cache, attn):
        """(this layer's MLP output, the residual stream before it): the residual add is
        fused into the next norm (the first layer's input is its own residual)."""
        attention, lora = self.self_attn, attn.lora
        if attention.fuses_decode_rope(attn):
            x, residual = self.input_norm(x, residual)
            return self.post_attention(attention.decode_rope(x, cos_sin, kv_cache, attn),
                                       residual, lora)
        q, residual = self.pre_attention(x, residual, cos_sin, kv_cache, attn.slot_mapping,
                                         lora)
        return self.post_attention(attention.attend(q, kv_cache, attn), residual, lora)

    def input_norm(self, x, residual):
        """(the normed input, the residual stream); the first layer's input is its own
        residual."""
        if residual is None:
            return self.input_layernorm(x), x
        return self.input_layernorm(x, residual)

    def pre_attention(self, x, residual, cos_sin, kv_cache, slot_mapping, lora=None):
        """(q, the residual stream): the input norm, q/k/v, rotary, the cache write. The
        halves either side of the attention call, for graphs captured around it
        (executor/mixed_graphs.py; graphs hold no LoRA update)."""
        x, residual = self.input_norm(x, residual)
        return self.self_attn.qkv_and_cache(x, cos_sin, kv_cache, slot_mapping,
                                            lora), residual

    def post_attention(self, attn_out, residual, lora=None):
        """(this layer's MLP output, the residual stream before it) from the attention's
        output [T, H, D]."""
        x = project(self.self_attn.o_proj, attn_out.reshape(-1, self.self_attn.q_size), "o",
                    lora)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x, lora), residual


def _on_meta_device() -> bool:
    """Is the model being built on the meta device (as the loader builds it, then loads
    every weight)? There, initial values are never used, and computing them costs time:
    ``normal_`` or ``arange`` of a meta tensor imports torch._dynamo, ~2 s of every
    executor's start."""
    return torch.empty(0).device.type == "meta"


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size)
        if not _on_meta_device():  # initialised as nn.Embedding initialises itself
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """``forward`` returns the final hidden states of every token; ``compute_logits`` takes
    the rows that sample (so a prefill chunk costs no vocab matmul)."""

    # checkpoint name -> (our fused parameter, shard index)
    packed = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # the head's weight in oneDNN's layout on a CPU executor (executor/packed_weights.py)
        self.packed_head: torch.Tensor | None = None
        cache = (torch.empty(cfg.max_model_len, 2, cfg.head_dim, dtype=torch.float32)
                 if _on_meta_device() else self.rope_cache(cfg))  # meta: the loader sets it
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    @staticmethod
    def rope_cache(cfg: ModelConfig) -> torch.Tensor:
        """[max_model_len, 2, head_dim] float32: cos and sin of every position."""
        positions = torch.arange(cfg.max_model_len, dtype=torch.float32)
        freqs = positions[:, None] * cfg.inv_freq()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return torch.stack((emb.cos(), emb.sin()), dim=1)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        with forward_scope():  # the twins derive the step's metadata once, not every layer
            x, cos_sin = self.embed(input_ids, positions)
            residual = None
            for i, layer in enumerate(self.model.layers):
                x, residual = layer(x, residual, cos_sin, kv_cache[i], attn)
            return self.final_norm(x, residual)

    def embed(self, input_ids: torch.Tensor,
              positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(token embeddings [T, hidden], RoPE cos/sin of the positions [T, 2, D])."""
        x = self.model.embed_tokens(input_ids)
        return x, self.cos_sin_cache[positions].to(x.dtype)

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if residual is None:  # no layers
            return self.model.norm(x)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [R, V] in the model's dtype: the sampler widens them to float32 where it
        needs to (a plain greedy step on a GPU takes the 16-bit argmax, which picks the same
        token). A float32 copy here cost 113 us a step at 256 rows x 152k vocabulary on an
        H200, every step, greedy or not."""
        if self.packed_head is not None:
            return ops.linear(hidden, None, packed=self.packed_head)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)
