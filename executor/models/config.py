"""Reading a Hugging Face ``config.json`` into the one config the Llama family needs.

Everything we cannot run exactly is refused here, at start, with a one-line
``ModelNotSupported`` (DESIGN §6): another architecture, a sliding window, a RoPE type other
than default/linear/llama3, mixture of experts, an activation other than SiLU.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedserve.cpu_dtypes import auto_dtype

log = logging.getLogger(__name__)

# architecture -> (q/k/v bias always on, per-head q/k RMSNorm)
ARCHITECTURES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}
ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelNotSupported(ValueError):
    """The model directory holds something this executor refuses to run (one-line message)."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_model_len: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope_theta: float
    rope_type: str = "default"
    rope_params: dict = field(default_factory=dict)
    torch_dtype: str = "float32"  # what the checkpoint says (for --dtype auto)
    fingerprint: str = ""  # sha256 of config.json bytes

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies, computed exactly as transformers does (float32)."""
        dim = self.head_dim
        inv = 1.0 / (
            self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        )
        p = self.rope_params
        if self.rope_type == "linear":
            inv = inv / p["factor"]
        elif self.rope_type == "llama3":
            factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
            old_len = p["original_max_position_embeddings"]
            low_wavelen, high_wavelen = old_len / low, old_len / high
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
            smooth = (old_len / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
            inv = torch.where(medium, smoothed, scaled)
        return inv


def _rope(cfg: dict) -> tuple[float, str, dict]:
    """(theta, type, params) from transformers-5 ``rope_parameters`` or legacy
    ``rope_theta`` + ``rope_scaling``."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    if not params or (legacy and "rope_type" not in params and "type" not in params):
        params = {**params, **legacy}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ModelNotSupported(
            f"RoPE type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
        )
    needed = {"linear": ("factor",), "llama3": (
        "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    missing = [k for k in needed.get(rope_type, ()) if k not in params]
    if missing:
        raise ModelNotSupported(f"RoPE type {rope_type!r} is missing {', '.join(missing)}")
    return theta, rope_type, params


def load_config(model_dir: str | Path) -> ModelConfig:
    """Parse and check ``model_dir/config.json``; raises ModelNotSupported or
    FileNotFoundError with a one-line message."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json (not a model directory)")
    raw = path.read_bytes()
    try:
        cfg = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ModelNotSupported(f"{path}: invalid JSON ({exc})") from None
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else "?"
    if arch not in ARCHITECTURES:
        raise ModelNotSupported(
            f"architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    if any(cfg.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise ModelNotSupported(f"{arch}: mixture of experts is not supported")
    window = cfg.get("sliding_window")
    uses_window = cfg.get("use_sliding_window", arch == "MistralForCausalLM")
    layer_types = cfg.get("layer_types") or []
    if (window and uses_window) or any(t != "full_attention" for t in layer_types):
        raise ModelNotSupported(f"{arch}: sliding-window attention is not supported")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelNotSupported(f"{arch}: activation {act!r} is not supported (only silu)")
    theta, rope_type, rope_params = _rope(cfg)
    qkv_bias, qk_norm = ARCHITECTURES[arch]
    attention_bias = bool(cfg.get("attention_bias", False))
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_model_len=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias or attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=qk_norm,
        rope_theta=theta,
        rope_type=rope_type,
        rope_params=rope_params,
        torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        fingerprint=hashlib.sha256(raw).hexdigest(),
    )


def resolve_dtype(name: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    """``auto`` -> the checkpoint's dtype (as transformers' ``dtype="auto"``; float32 when
    config.json names none we run), except float32 for a 16-bit checkpoint on a CPU without
    native arithmetic for it (pagedserve/cpu_dtypes.py). The executor registers what it runs
    and the router's ModelInfo reports that."""
    if name == "auto":
        stored = config.torch_dtype if config.torch_dtype in DTYPES else "float32"
        name, why = auto_dtype(stored, on_cpu=torch.device(device).type == "cpu")
        if why:
            log.info("--dtype auto runs float32, not the checkpoint's %s: %s", stored, why)
    if name not in DTYPES:
        raise ModelNotSupported(f"dtype {name!r} is not supported (auto, {', '.join(DTYPES)})")
    return DTYPES[name]
