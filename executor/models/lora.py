"""LoRA adapters in PEFT's format, served beside the base model: every loaded adapter in
every step, each token computed with its own request's adapter (or none).

An adapter is a directory as PEFT's ``save_pretrained`` writes it: ``adapter_config.json``
(``r``, ``lora_alpha``, ``use_rslora``, ...) and ``adapter_model.safetensors``
(``...layers.{i}.self_attn.q_proj.lora_A.weight`` [r, in] and ``...lora_B.weight``
[out, r]). A module's update of its output is ``scaling * B (A x)``, ``scaling =
lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA), r the module's own rank (its tensors' shape, so
PEFT's ``rank_pattern`` holds). What cannot be computed as PEFT computes it is refused at
start (or at a load while serving), one line naming it: DoRA, trained biases,
``modules_to_save`` (whole modules, such as an lm_head), ``alpha_pattern``, adapters of the
embedding or the head, pickled weights, weights that are not all finite.

The batched update, per projection (qkv, o, gate_up, down): with n adapters, each padded to
the largest rank R, ``A`` stacks every adapter's A rows, shard by shard [S, n*R, in] (S: the
shards of a fused projection some adapter targets, e.g. q, k, v), and ``Bt_s`` stacks shard
s's B^T of all adapters [n*R, out_s], scaling folded in. A step uses the k adapters its
tokens name: their rows of A and Bt (``cols``, k*R of the n*R, gathered; all n, no gather,
when k > n/2, and in captured graphs). For a batch x [T, in] whose tokens run adapters
``ids`` (1..k among those, 0: none)::

    h = (x @ A[:, cols]^T).view(T, S, k*R) * mask[:, None, :]   # mask[t, c] = ids[t] == owner[c]
    y[:, shard s] += h[:, s] @ Bt_s[cols]

A token keeps only its own adapter's R columns, so this is PEFT's ``scaling * B_a (A_a x)``
for each token, and a token without an adapter adds exact zeros. It is two matmuls and a
multiply a projection whatever the mix of adapters in the step (plus the gathers of the k
adapters' rows when not all are in use): no loop over adapters, the mask and columns built
once a step (``LoraSet.step``). The cost grows with k*R, as k*R more output rows of each
projection would: adapters loaded but not used in a step cost nothing
(benchmarks/lora_bench.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from pagedserve.executor.device_copy import to_device, to_device_many
from pagedserve.executor.models.config import ModelConfig
from safetensors import safe_open

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# checkpoint module -> (submodule, our fused projection), the shards of one in order
MODULES = {
    "q_proj": ("self_attn", "qkv_proj"), "k_proj": ("self_attn", "qkv_proj"),
    "v_proj": ("self_attn", "qkv_proj"), "o_proj": ("self_attn", "o_proj"),
    "gate_proj": ("mlp", "gate_up_proj"), "up_proj": ("mlp", "gate_up_proj"),
    "down_proj": ("mlp", "down_proj"),
}
# ...layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}[.{adapter name}].weight
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
                  r"(?:\.[\w-]+)?\.weight$")


RUNTIME_OFF = "runtime LoRA loading is off on this executor (start it with --max-loras N)"


class LoraError(ValueError):
    """An adapter this executor cannot serve as PEFT would (one-line message)."""


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    path: str
    rank: int  # its largest module rank
    # (layer, checkpoint module) -> (A [r, in], B [out, r] times the scaling), float32
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a checkpoint module of the base model."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}[module]


def _read_config(name: str, path: Path) -> dict:
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise LoraError(f"LoRA adapter {name}: {path} has no {CONFIG_FILE}") from None
    except (OSError, ValueError) as exc:
        raise LoraError(f"LoRA adapter {name}: {path / CONFIG_FILE}: {exc}") from None
    if not isinstance(config, dict):
        raise LoraError(f"LoRA adapter {name}: {CONFIG_FILE} is not a JSON object")
    refusals = [
        (config.get("peft_type", "LORA") != "LORA",
         f"peft_type {config.get('peft_type')!r} (only LORA)"),
        (bool(config.get("use_dora")), "DoRA (use_dora)"),
        (config.get("bias", "none") != "none", f"trained biases (bias={config.get('bias')!r})"),
        (bool(config.get("lora_bias")), "trained biases (lora_bias)"),
        (bool(config.get("modules_to_save")),
         f"modules_to_save {config.get('modules_to_save')!r} (whole modules)"),
        (bool(config.get("alpha_pattern")), "alpha_pattern"),
        (bool(config.get("fan_in_fan_out")), "fan_in_fan_out (Conv1D layers)"),
    ]
    for refused, what in refusals:
        if refused:
            raise LoraError(f"LoRA adapter {name}: {what} is not supported")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise LoraError(f"LoRA adapter {name}: lora_alpha must be a positive number")
    return config


def read_adapter(name: str, path: str | Path, cfg: ModelConfig) -> LoraAdapter:
    """The adapter at ``path`` for the base model ``cfg``; LoraError (one line) when it is
    not one this executor serves exactly."""
    path = Path(path)
    if not path.is_dir():
        raise LoraError(f"LoRA adapter {name}: {path} is not a directory")
    config = _read_config(name, path)
    file = path / WEIGHTS_FILE
    if not file.is_file():
        pickled = " (adapter_model.bin is pickled: save it as safetensors)" \
            if (path / "adapter_model.bin").exists() else ""
        raise LoraError(f"LoRA adapter {name}: {path} has no {WEIGHTS_FILE}{pickled}")
    halves: dict[tuple[int, str, str], torch.Tensor] = {}
    with safe_open(str(file), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            match = _KEY.search(key)
            if match is None or match.group(2) not in MODULES:
                raise LoraError(f"LoRA adapter {name}: tensor {key!r} is not a LoRA A or B of "
                                f"a projection ({', '.join(MODULES)})")
            layer = int(match.group(1))
            if layer >= cfg.num_layers:
                raise LoraError(f"LoRA adapter {name}: {key!r} names layer {layer}; the "
                                f"model has {cfg.num_layers}")
            halves[(layer, match.group(2), match.group(3))] = f.get_tensor(key).float()
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    alpha = float(config.get("lora_alpha", 8))
    for (layer, module, half) in sorted(halves):
        if half != "A":
            continue
        a, b = halves[(layer, module, "A")], halves.get((layer, module, "B"))
        where = f"LoRA adapter {name}: layer {layer} {module}"
        if b is None:
            raise LoraError(f"{where}: lora_A without lora_B")
        fan_in, fan_out = module_shape(cfg, module)
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or rank == 0 or tuple(a.shape) != (rank, fan_in) \
                or tuple(b.shape) != (fan_out, rank):
            raise LoraError(f"{where}: A {tuple(a.shape)} and B {tuple(b.shape)}, where "
                            f"[r, {fan_in}] and [{fan_out}, r] expected")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            # a NaN or infinity would reach every token of a step through the mask's zeros
            raise LoraError(f"{where}: the weights are not all finite")
        scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        weights[(layer, module)] = (a.contiguous(), (b * scaling).contiguous())
    if any(half == "B" and (layer, module) not in weights
           for layer, module, half in halves):
        raise LoraError(f"LoRA adapter {name}: lora_B without lora_A")
    if not weights:
        raise LoraError(f"LoRA adapter {name}: {WEIGHTS_FILE} holds no LoRA weights")
    return LoraAdapter(name=name, path=str(path),
                       rank=max(a.shape[0] for a, _ in weights.values()), weights=weights)


class AdapterCache:
    """Adapters read from their directories kept in host memory, the ``size`` used most
    recently (vLLM's ``--max-cpu-loras``; ``LoraSet.cache``): a reload (an adapter unloaded for another and
    asked for again, `--lora-dir`) copies into its slot without reading its files (~25 of a
    ~33 ms load for a rank-16 adapter of a 0.5B model). An entry is used only while its
    files are the ones it was read from (their size, mtime and inode); under another name
    it is the same weights renamed."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: OrderedDict[str, tuple[tuple, LoraAdapter]] = OrderedDict()

    def read(self, name: str, path: str, config) -> LoraAdapter:
        key = os.path.realpath(path)
        stamp = _stamp(key)
        hit = self.entries.get(key)
        if hit is not None and stamp is not None and hit[0] == stamp:
            self.entries.move_to_end(key)
            adapter = hit[1]
            return adapter if adapter.name == name else dataclasses.replace(adapter, name=name)
        adapter = read_adapter(name, path, config)
        if self.size > 0 and stamp is not None:
            self.entries[key] = (stamp, adapter)
            self.entries.move_to_end(key)
            while len(self.entries) > self.size:
                self.entries.popitem(last=False)
        return adapter


def _stamp(path: str) -> tuple | None:
    """What identifies an adapter directory's files as read (None: one is missing)."""
    try:
        return tuple((st.st_size, st.st_mtime_ns, st.st_ino)
                     for st in (os.stat(os.path.join(path, CONFIG_FILE)),
                                os.stat(os.path.join(path, WEIGHTS_FILE))))
    except OSError:
        return None


@dataclass(frozen=True)
class LoraStep:
    """One step's view of the adapters (``LoraSet.step``): the columns (rows of A and Bt)
    of the k adapters its tokens use, and each token's mask over them."""

    mask: torch.Tensor  # [T, k*R] in the model's dtype
    cols: torch.Tensor | None  # int64 [k*R] of the n*R; None: all n adapters, in order
    active: tuple[int, ...] = ()  # the k slots (with cols: the gathers' cache key)


class ProjectionLora:
    """The adapters' update of one projection (a plain object on the projection's
    ``lora`` attribute, so never a parameter of the model)."""

    def __init__(self, a: torch.Tensor, shards: list[tuple[int, int, torch.Tensor]]) -> None:
        self.a = a  # [S, n * R, in]
        self.shards = shards  # (output offset, output size, Bt [n * R, size]) a shard
        # The last step's gathered rows (active slots, A, each shard's Bt): steps of the
        # same adapters (a steady decode) gather nothing again. On a CPU only: on a GPU the
        # copies would hold device memory the KV cache's sizing did not count (there the
        # decode steps replay graphs, which take every adapter and gather nothing).
        self._keep_gathered = a.device.type == "cpu"
        self._gathered: tuple[tuple[int, ...], torch.Tensor, list[torch.Tensor]] | None = None

    def forget_gathered(self) -> None:
        """The weights changed (a slot loaded or unloaded): gather again next step."""
        self._gathered = None

    def add_(self, y: torch.Tensor, x: torch.Tensor, step: LoraStep) -> torch.Tensor:
        """y [T, out] += each token's own adapter's update of x [T, in]; y returned."""
        a, bts = self._weights(step)
        h = (x @ a.reshape(-1, a.shape[-1]).t()).view(x.shape[0], a.shape[0], a.shape[1])
        h = h * step.mask[:, None, :]
        for s, ((offset, size, _), bt) in enumerate(zip(self.shards, bts, strict=True)):
            y[:, offset:offset + size].addmm_(h[:, s], bt)
        return y

    def _weights(self, step: LoraStep) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(A, each shard's Bt) of the step's adapters: all of them, or their gathered rows."""
        if step.cols is None:
            return self.a, [bt for _, _, bt in self.shards]
        gathered = self._gathered
        if gathered is None or gathered[0] != step.active:
            gathered = (step.active, self.a.index_select(1, step.cols),
                        [bt.index_select(0, step.cols) for _, _, bt in self.shards])
            if self._keep_gathered:
                self._gathered = gathered
        return gathered[1], gathered[2]


class LoraSet:
    """The adapters an executor serves, installed on its model's projections; slot i + 1
    is ``names[i]`` ("" when free), slot 0 no adapter.

    Fixed (``capacity`` 0): exactly ``adapters``, padded to their largest rank, on the
    projections some adapter targets. With ``capacity`` N (``--max-loras``) and ``rank`` R
    (``--max-lora-rank``): N slots of rank R on every projection, ``adapters`` in the first
    ones, and `load` / `unload` change a slot in place while serving (executor/lora_ops.py):
    the tensors never move, so captured graphs stay valid. A free slot's rows are zero.
    ``cache_size``: adapters read for loads kept in host memory (`AdapterCache`)."""

    def __init__(self, adapters: list[LoraAdapter], model: torch.nn.Module,
                 capacity: int = 0, rank: int = 0, cache_size: int = 0) -> None:
        if not adapters and capacity <= 0:
            raise ValueError("a LoraSet needs at least one adapter or slot")
        self.capacity_fixed = capacity > 0  # slots loaded and unloaded while serving
        self.cache = AdapterCache(cache_size)  # what loads read, kept (--max-cpu-loras)
        if capacity and len(adapters) > capacity:
            raise LoraError(f"--lora-modules gives {len(adapters)} adapters, more than the "
                            f"{capacity} slots of --max-loras")
        self.rank = rank if capacity else max(a.rank for a in adapters)
        for adapter in adapters:
            if adapter.rank > self.rank:
                raise LoraError(f"LoRA adapter {adapter.name}: rank {adapter.rank} is over "
                                f"--max-lora-rank {self.rank}")
        n = capacity or len(adapters)
        self.static_names = tuple(a.name for a in adapters)  # --lora-modules, never unloaded
        self.names = [*self.static_names, *[""] * (n - len(adapters))]
        self.slots = {name: i + 1 for i, name in enumerate(self.static_names)}
        self.cfg = model.config
        weight = model.model.embed_tokens.weight
        self.dtype, self.device = weight.dtype, weight.device
        # owner[c]: the slot whose rank-R block column c is
        self.owner = torch.arange(1, n + 1, device=self.device).repeat_interleave(self.rank)
        # (layer, the projection's update, its checkpoint modules in shard order)
        self._installed: list[tuple[int, ProjectionLora, list[str]]] = []
        for layer_index, layer in enumerate(model.model.layers):
            for part, projection, modules in _projections():
                linear = getattr(getattr(layer, part), projection)
                linear.lora = self._projection(adapters, layer_index, modules, n)

    def _projection(self, adapters: list[LoraAdapter], layer: int, modules: list[str],
                    n: int) -> ProjectionLora | None:
        """The update of one fused projection made of checkpoint ``modules`` (in shard
        order) over ``n`` slots, or None when no adapter may target any of them."""
        rank = self.rank
        a_blocks, shards, targeted, offset = [], [], [], 0
        for module in modules:
            fan_in, fan_out = module_shape(self.cfg, module)
            if self.capacity_fixed or any((layer, module) in ad.weights for ad in adapters):
                a = torch.zeros(n * rank, fan_in)
                bt = torch.zeros(n * rank, fan_out)
                for i, ad in enumerate(adapters):
                    if (layer, module) in ad.weights:
                        a_i, b_i = ad.weights[(layer, module)]
                        r = a_i.shape[0]
                        a[i * rank:i * rank + r] = a_i
                        bt[i * rank:i * rank + r] = b_i.t()
                a_blocks.append(a)
                shards.append((offset, fan_out, bt.to(self.device, self.dtype)))
                targeted.append(module)
            offset += fan_out
        if not shards:
            return None
        update = ProjectionLora(torch.stack(a_blocks).to(self.device, self.dtype), shards)
        self._installed.append((layer, update, targeted))
        return update

    def load(self, adapter: LoraAdapter) -> int:
        """Copy ``adapter`` into a free slot (in place; the slot's other rows zeroed);
        its slot. LoraError when the slots are fixed, taken or too small for it."""
        if not self.capacity_fixed:
            raise LoraError(RUNTIME_OFF)
        if adapter.name in self.slots:
            raise LoraError(f"LoRA adapter {adapter.name} is loaded already")
        if adapter.rank > self.rank:
            raise LoraError(f"LoRA adapter {adapter.name}: rank {adapter.rank} is over "
                            f"--max-lora-rank {self.rank}")
        if "" not in self.names:
            raise LoraError(f"LoRA adapter {adapter.name}: all {len(self.names)} slots "
                            "(--max-loras) are in use")
        slot = self.names.index("") + 1
        self._write(slot, adapter.weights)
        self.names[slot - 1] = adapter.name
        self.slots[adapter.name] = slot
        return slot

    def unload(self, name: str) -> bool:
        """Free the slot of adapter ``name`` (its rows zeroed); False when it holds none.
        A ``--lora-modules`` adapter stays."""
        slot = self.slots.get(name)
        if slot is None or name in self.static_names:
            return False
        self._write(slot, {})
        self.names[slot - 1] = ""
        del self.slots[name]
        return True

    def unload_all(self) -> LoraSet:
        """Every slot loaded while serving freed (a new registration); this set."""
        for name in [n for n in self.slots if n not in self.static_names]:
            self.unload(name)
        return self

    def _write(self, slot: int, weights: dict) -> None:
        """Slot ``slot``'s rows of every projection: ``weights``' (zero elsewhere)."""
        start = (slot - 1) * self.rank
        rows = slice(start, start + self.rank)
        for layer, update, modules in self._installed:
            for s, module in enumerate(modules):
                bt = update.shards[s][2]
                update.a[s, rows].zero_()
                bt[rows].zero_()
                if (layer, module) in weights:
                    a_i, b_i = weights[(layer, module)]
                    r = a_i.shape[0]
                    update.a[s, start:start + r].copy_(a_i)
                    bt[start:start + r].copy_(b_i.t())
            update.forget_gathered()

    def step(self, slots: np.ndarray) -> LoraStep:
        """The step whose tokens run adapter ``slots`` [T] (host integers; 0: none): the k
        adapters among them renumbered 1..k in slot order, their columns, and the mask.
        Where they are more than half the n slots, all n are taken (no gather: the rows it
        would skip cost less than gathering the rest)."""
        n, rank = len(self.names), self.rank
        active = np.unique(slots)
        active = active[active > 0]
        if 2 * active.shape[0] > n:
            active = np.arange(1, n + 1)
            (ids_t,), cols = to_device_many(((slots, torch.int64),), self.device), None
        else:
            renumber = np.zeros(n + 1, np.int64)
            renumber[active] = np.arange(1, active.shape[0] + 1)
            columns = ((active - 1)[:, None] * rank + np.arange(rank)).reshape(-1)
            ids_t, cols = to_device_many(((renumber[slots], torch.int64),
                                          (columns, torch.int64)), self.device)
        owner = self.owner[:active.shape[0] * rank]  # slots 1..k, R columns each
        return LoraStep(mask=(ids_t[:, None] == owner).to(self.dtype), cols=cols,
                        active=tuple(active.tolist()))

    def graph_step(self, slots: torch.Tensor) -> LoraStep:
        """Every adapter's view for a captured graph, from its static buffer of the tokens'
        ``slots`` (0: none): no host work, so a replay recomputes the mask from what the
        buffer holds (a token without an adapter adds exact zeros)."""
        return LoraStep(mask=(slots[:, None] == self.owner).to(self.dtype), cols=None)


class StaticLoraSlots:
    """A captured graph's static buffer of its tokens' adapter slots (``buffer``, zero
    where no adapter: padding rows too), set before each replay."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.buffer = torch.zeros(size, dtype=torch.long, device=device)
        self._dirty = 0  # leading entries the last step may have left nonzero

    def set(self, slots: np.ndarray | None) -> None:
        """The next replay's slots: ``slots`` (host, one a token) then zeros, or zeros
        throughout (None: nothing to copy when the buffer is zero already)."""
        n = 0 if slots is None else slots.shape[0]
        if n:
            self.buffer[:n].copy_(to_device(slots, self.buffer.device, torch.long))
        if self._dirty > n:
            self.buffer[n:self._dirty].zero_()
        self._dirty = n


def _projections() -> list[tuple[str, str, list[str]]]:
    """(submodule, fused projection, its checkpoint modules in shard order) of a layer."""
    fused: dict[tuple[str, str], list[str]] = {}
    for module, (part, projection) in MODULES.items():
        fused.setdefault((part, projection), []).append(module)
    return [(part, projection, modules) for (part, projection), modules in fused.items()]
