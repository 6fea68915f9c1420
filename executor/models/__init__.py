"""Model definitions: the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) on a paged KV cache."""

from pagedserve.executor.models.config import (
    ModelConfig,
    ModelNotSupported,
    load_config,
    resolve_dtype,
)
from pagedserve.executor.models.llama import AttentionMetadata, LlamaForCausalLM
from pagedserve.executor.models.loader import load_model

__all__ = [
    "AttentionMetadata", "LlamaForCausalLM", "ModelConfig", "ModelNotSupported",
    "load_config", "load_model", "resolve_dtype",
]
