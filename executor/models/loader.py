"""Loading a Hugging Face directory's ``*.safetensors`` (one file or shards) into our model.

Files are memory-mapped with ``safe_open``. Their headers are checked first
(`plan_weights`: every parameter filled exactly once, every shape right, nothing unknown),
then each tensor is read once, cast to the target dtype and copied into its (possibly
fused) parameter on the target device (`copy_weights`). A checkpoint that does not fit
fails before anything is copied, which is what a weight update while serving relies on
(executor/weight_ops.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from pagedserve.executor.models.config import ModelConfig, load_config
from pagedserve.executor.models.llama import LlamaForCausalLM
from safetensors import safe_open
from tqdm import tqdm

log = logging.getLogger(__name__)


def _target(model: LlamaForCausalLM, name: str) -> tuple[str, int | None] | None:
    """Checkpoint name -> (our parameter name, shard index or None); None = not ours."""
    if "rotary_emb" in name:
        return None
    if name == "lm_head.weight" and model.lm_head is None:
        return None  # tied: the embedding is the head
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in model.packed:
            fused, shard = model.packed[part]
            return ".".join(parts[:i] + [fused] + parts[i + 1:]), shard
    return name, None


class WeightsMismatch(ValueError):
    """A checkpoint that does not fit the model: an unexpected tensor, a shape, a tensor
    missing. Raised before anything is copied."""


def plan_weights(model: LlamaForCausalLM, model_dir: str | Path) -> list[tuple[Path, list]]:
    """Check that the directory's ``*.safetensors`` fill every parameter of ``model``
    exactly, reading only the files' headers: per file, the (checkpoint key, destination
    view) pairs to copy. Raises WeightsMismatch (nothing read, nothing copied) or
    FileNotFoundError."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    remaining = {
        (n, s)
        for n, p in params.items()
        for s in (range(len(getattr(modules[n.rsplit(".", 1)[0]], "shard_sizes", ())))
                  or [None])
    }
    plan = []
    for file in files:
        copies = []
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                target = _target(model, key)
                if target is None:
                    continue
                name, shard = target
                if name not in params:
                    raise WeightsMismatch(f"{file.name}: unexpected tensor {key!r}")
                dst = params[name].data
                if shard is not None:
                    sizes = modules[name.rsplit(".", 1)[0]].shard_sizes
                    dst = dst.narrow(0, sum(sizes[:shard]), sizes[shard])
                shape = tuple(f.get_slice(key).get_shape())
                if shape != tuple(dst.shape):
                    raise WeightsMismatch(
                        f"{key}: shape {shape} where {tuple(dst.shape)} expected")
                copies.append((key, dst))
                remaining.discard((name, shard))
        plan.append((file, copies))
    if remaining:
        names = sorted(n if s is None else f"{n}[{s}]" for n, s in remaining)
        raise WeightsMismatch(f"{model_dir}: weights missing for {', '.join(names[:5])}"
                              + (f" and {len(names) - 5} more" if len(names) > 5 else ""))
    return plan


@torch.no_grad()
def copy_weights(plan: list[tuple[Path, list]], progress: bool = False) -> None:
    """Read each planned tensor once, cast it to its parameter's dtype and copy it in
    place (the parameters keep their storage: captured CUDA graphs stay valid)."""
    bar = tqdm(total=sum(len(c) for _, c in plan), desc="Loading weights",
               disable=not progress, unit="t")
    for file, copies in plan:
        with safe_open(str(file), framework="pt") as f:
            for key, dst in copies:
                dst.copy_(f.get_tensor(key).to(dst.dtype))
                bar.update(1)
    bar.close()


def load_weights(model: LlamaForCausalLM, model_dir: str | Path, progress: bool = True) -> None:
    copy_weights(plan_weights(model, model_dir), progress=progress)


def load_model(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device | str,
    config: ModelConfig | None = None, progress: bool = True,
) -> LlamaForCausalLM:
    """Build the model for ``config.json`` directly on ``device`` in ``dtype`` and load it."""
    config = config or load_config(model_dir)
    device = torch.device(device)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):  # no random init: every parameter is loaded below
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    # model.to_empty(device=device), without torch.empty_like of meta tensors (its Python
    # reference imports sympy: ~0.9 s of every executor's start)
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.cos_sin_cache = LlamaForCausalLM.rope_cache(config).to(device)
    load_weights(model, model_dir, progress=progress)
    return model.eval().requires_grad_(False)
