"""Small random-weight Hugging Face model directories, made locally with no download.

Used by the tests (HF-equivalence needs decisive logits, so weights are drawn with a large
std and norms/biases are randomised) and by `--model tiny` (the random-weight demo model). Everything is
deterministic for a given seed: the byte-level BPE tokenizer is trained in-process on a fixed
corpus, the weights come from a seeded generator.
"""

from __future__ import annotations

import json
from pathlib import Path

# A fixed corpus: enough English and code-ish text that the BPE learns useful merges.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "The router owns the block tables and plans every step of every batch.",
    "Executors run the model with paged attention kernels and sample tokens.",
    "Prefix caching lets requests that share a system prompt reuse its blocks.",
    "Copy-on-write forks share blocks until a sequence writes a new token.",
    "When memory runs out the scheduler preempts a request by swap or recompute.",
    "def generate(prompt, max_tokens=16):\n    return model(prompt)\n",
    "for i in range(10):\n    print(i * i)\n",
    "Once upon a time there was a small language model that lived on a CPU.",
    "It was not very clever, but it was honest about what it was.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828",
    "Tenant A asks about billing. Tenant B asks about shipping. Tenant C asks about refunds.",
    "Ünïcödé téxt, 日本語のテキスト, emoji 🙂🚀 and symbols ±∞≠≤≥.",
]

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]

# Chat templates for the test models. "chatml": ChatML's layout (its markers are plain text to
# this tokenizer, so the vocabulary and the weights are those of a model without a template);
# no BOS, as the rendered chat is tokenized without special tokens. "llama": Llama 2's layout,
# BOS written by the template itself while the tokenizer also adds BOS by default (so a BOS
# added twice would show), and roles checked with raise_exception.
CHAT_TEMPLATES = {
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "llama": (
        "{{ bos_token }}"
        "{% for message in messages %}\n"
        "{% if message['role'] == 'system' %}\n"
        "<<SYS>>\n{{ message['content'] }}\n<</SYS>>\n\n"
        "{% elif message['role'] == 'user' %}\n"
        "[INST] {{ message['content'] | trim }} [/INST]"
        "{% elif message['role'] == 'assistant' %}\n"
        " {{ message['content'] | trim }} {{ eos_token }}"
        "{% else %}\n"
        "{{ raise_exception('Only system, user and assistant roles are supported!') }}"
        "{% endif %}\n"
        "{% endfor %}\n"
    ),
}


def build_tokenizer(out_dir: str | Path, vocab_size: int = 512,
                    chat_template: str | None = "chatml"):
    """Train a byte-level BPE on the fixed corpus and save it (tokenizer.json plus
    tokenizer_config.json) so both `tokenizers` and transformers' AutoTokenizer load it.
    BOS ``<s>`` is prepended to every encoded text, as Llama's tokenizer does.
    `chat_template`: a name in CHAT_TEMPLATES, or None for a tokenizer without one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        chat_template=CHAT_TEMPLATES[chat_template] if chat_template else None,
    )
    fast.save_pretrained(str(out_dir))
    return fast


_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def build_model(
    out_dir: str | Path,
    arch: str = "llama",
    *,
    hidden_size: int = 160,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 256,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = False,
    rope_scaling: dict | None = None,
    vocab_size: int = 512,
    initializer_range: float = 0.2,
    dtype: str = "float32",
    seed: int = 0,
    config_overrides: dict | None = None,
    chat_template: str | None = "chatml",
) -> Path:
    """Write a random-weight model directory (config.json, model.safetensors,
    generation_config.json, tokenizer files) and return its path.

    The default head dim is hidden_size / num_heads = 40: not a power of two, on purpose.
    Norm weights and attention biases are randomised too, so greedy decoding is decisive.
    `chat_template` names the tokenizer's (see build_tokenizer); it changes no weight.
    """
    import torch
    import transformers

    if arch not in _ARCHS:
        raise ValueError(f"unknown arch {arch!r}; known: {sorted(_ARCHS)}")
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(out_dir, vocab_size=vocab_size, chat_template=chat_template)
    config_cls = getattr(transformers, _ARCHS[arch][0])
    model_cls = getattr(transformers, _ARCHS[arch][1])
    kwargs = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rms_norm_eps=1e-5,
    )
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    if arch == "mistral":
        kwargs["sliding_window"] = None
    if arch in ("qwen2", "qwen3"):
        kwargs["use_sliding_window"] = False
    if rope_scaling is not None:
        kwargs["rope_parameters"] = {"rope_theta": 10000.0, **rope_scaling}
    kwargs.update(config_overrides or {})
    config = config_cls(**kwargs)

    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(str(out_dir), safe_serialization=True)
    gen_cfg = out_dir / "generation_config.json"
    data = json.loads(gen_cfg.read_text()) if gen_cfg.exists() else {}
    data["eos_token_id"] = tokenizer.eos_token_id
    data["bos_token_id"] = tokenizer.bos_token_id
    gen_cfg.write_text(json.dumps(data, indent=2))
    return out_dir


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_lora_adapter(
    model_dir: str | Path, out_dir: str | Path, *, rank: int = 8, alpha: float = 16.0,
    target_modules: tuple[str, ...] = LORA_TARGETS, std: float = 0.3, seed: int = 0,
    use_rslora: bool = False, layers: tuple[int, ...] | None = None,
) -> Path:
    """Write a random LoRA adapter for the model at ``model_dir`` in PEFT's format
    (adapter_config.json, adapter_model.safetensors with PEFT's tensor names) and return its
    path. Both A and B are drawn (std ``std``; a trained adapter's B is not zero either),
    so the adapter changes greedy outputs; ``layers``: the layers it has (default all)."""
    import torch
    from safetensors.torch import save_file

    from pagedserve.executor.models.config import load_config
    from pagedserve.executor.models.lora import MODULES, module_shape

    config = load_config(model_dir)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in (range(config.num_layers) if layers is None else layers):
        for module in target_modules:
            fan_in, fan_out = module_shape(config, module)
            prefix = f"base_model.model.model.layers.{layer}.{MODULES[module][0]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = std * torch.randn(rank, fan_in, generator=gen)
            tensors[f"{prefix}.lora_B.weight"] = std * torch.randn(fan_out, rank, generator=gen)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path":
        str(model_dir), "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
        "target_modules": list(target_modules), "bias": "none", "use_rslora": use_rslora,
        "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
        "layers_to_transform": list(layers) if layers is not None else None,
        "inference_mode": True}, indent=2))
    return out_dir


DEMO_MODEL_VERSION = "demo-llama-v1"  # = pagedserve.models.TINY_DIR


def build_demo_model(out_dir: str | Path) -> Path:
    """The `tiny` model: a small random-weight Llama with the byte-level BPE tokenizer,
    deterministic. Its text is gibberish; it exists to run the serving path offline. It has no
    chat template: its files stay those that caches of DEMO_MODEL_VERSION hold."""
    return build_model(out_dir, "llama", hidden_size=256, num_layers=4, num_heads=8,
                       num_kv_heads=2, intermediate_size=512, max_position_embeddings=2048,
                       seed=1234, chat_template=None)


def ensure_demo_model(cache_dir: str | Path | None = None) -> Path:
    """The `tiny` model, built once: `cache_dir`/pagedserve/demo-llama-v1 when given (a
    folder to mount into containers), else what `--model tiny` resolves to (in the cache
    root of pagedserve.models, built there in a child process under its lock)."""
    from .models import build_once, ensure_tiny_model

    if cache_dir is None:
        return ensure_tiny_model()
    path = Path(cache_dir) / "pagedserve" / DEMO_MODEL_VERSION
    return build_once(path, build_demo_model, "the tiny model")
