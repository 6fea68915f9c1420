"""A plan's weight update (router/weight_sync.py decides it): new weights for the running
model from a directory of ``*.safetensors``, copied into the parameters in place.

The router sends it in two plans to every executor, when no request runs: a check
(``load`` false) first, then, once every executor passed it, the load. The check reads the
directory's ``config.json`` if it has one (every field that shapes the computation, the
architecture, sizes, RoPE, norms, must equal the running model's; the stored dtype may
differ: tensors are cast) and the safetensors headers (every parameter filled exactly once,
every shape right, no tensor the model does not have), never the tensors. The load checks
again (the files may have changed in between), then reads each tensor once and copies it
into its parameter: the parameters keep their storage, so the CUDA graphs captured at start
stay valid, and the LoRA adapters loaded stay (they are deltas on top of the weights).

A refusal changes nothing and is named in the plan's StepResult (``weight_failed``); the
step runs on. A load that fails partway (a file cut while it is read) leaves the model
part new, part old: the result says so and the router takes the executor out of service
(it registers again, and the router gives it the current weights before any request).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pagedserve.executor.lora_ops import apply_lora_ops
from pagedserve.executor.models.config import ModelNotSupported, load_config
from pagedserve.executor.models.loader import WeightsMismatch, copy_weights, plan_weights
from pagedserve.executor.packed_weights import is_packed, pack_projections, unpack_projections
from pagedserve.protos.wire import StepPlan, WeightOp

if TYPE_CHECKING:
    from pagedserve.executor.model_runner import ModelRunner

log = logging.getLogger("pagedserve.executor")

# ModelConfig fields a checkpoint may change: the stored dtype (tensors are cast to the
# running one) and the config file's hash
_FREE_FIELDS = ("torch_dtype", "fingerprint")
PARTIAL = "partly loaded"  # in a failed load's message: the model is no longer consistent


@dataclass
class RunningWeights:
    """Which weights a runner's model holds (reported in Hello.weights_path)."""

    model_dir: str  # --model's directory (a WeightOp's "")
    path: str = ""  # the directory loaded since start ("": model_dir's weights)


def check_weights(runner: ModelRunner, path: str) -> list:
    """The copy plan of ``path`` for the running model (models/loader.plan_weights), after
    its config.json (if any) was compared with the running model's; raises with a
    one-line reason."""
    directory = Path(path or runner.weights.model_dir)
    if not directory.is_dir():
        raise FileNotFoundError("not a directory this executor can read")
    running = runner.model.config
    if (directory / "config.json").is_file():
        new = load_config(directory)
        for f in dataclasses.fields(running):
            if f.name not in _FREE_FIELDS and getattr(new, f.name) != getattr(running, f.name):
                raise ModelNotSupported(
                    f"config.json {f.name} is {getattr(new, f.name)!r}, the running "
                    f"model's is {getattr(running, f.name)!r} (weights of another model)")
    return plan_weights(runner.model, directory)


def apply_model_ops(runner: ModelRunner, plan: StepPlan) -> dict:
    """A plan's changes to the model, before anything else of it: new weights, then the
    adapter loads and unloads in order (lora_ops.py); the StepResult fields naming what
    failed."""
    return dict(weight_failed=apply_weight_op(runner, plan.weight_op) if plan.weight_op else "",
                lora_failed=apply_lora_ops(runner, plan.lora_ops) if plan.lora_ops else [])


def apply_weight_op(runner: ModelRunner, op: WeightOp) -> str:
    """Check or load ``op.path`` (module docstring); '' when it took effect, else why not
    (a message holding PARTIAL when the model was left half updated). A CPU executor's
    packed projections (packed_weights.py) are plain matrices while a load copies into
    them, and packed again after it, whatever happened."""
    packed = op.load and is_packed(runner.model)
    if packed:
        unpack_projections(runner.model)
    try:
        return _check_or_load(runner, op)
    finally:
        if packed:
            pack_projections(runner.model)


def _check_or_load(runner: ModelRunner, op: WeightOp) -> str:
    t0 = time.perf_counter()
    shown = op.path or runner.weights.model_dir  # ("": --model's own)
    try:
        plan = check_weights(runner, op.path)
    except (WeightsMismatch, ModelNotSupported, OSError, ValueError) as exc:
        return _failed(shown, str(exc))
    except Exception as exc:  # an unreadable file must never take the executor down
        return _failed(shown, f"{type(exc).__name__}: {exc}")
    if not op.load:
        log.info("weights %s checked (%.0f ms)", shown, 1e3 * (time.perf_counter() - t0))
        return ""
    try:
        copy_weights(plan)
    except Exception as exc:
        runner.weights.path = "?"  # neither: whatever the router says next must be loaded
        return _failed(shown, f"{type(exc).__name__}: {exc}", partial=True)
    runner.weights.path = op.path
    log.info("weights loaded from %s (%.0f ms)", shown, 1e3 * (time.perf_counter() - t0))
    return ""


def _failed(path: str, reason: str, partial: bool = False) -> str:
    reason = reason.removeprefix(f"{path}: ")  # (the loader's messages may name it)
    message = f"weights {path}{' ' + PARTIAL if partial else ''}: {reason}"
    log.error("%s", message)
    return message
