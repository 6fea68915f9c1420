"""A plan's LoRA adapter loads and unloads (router/lora_registry.py decides them), applied
by the main thread before the plan's new requests, in the order the router queued them.

A load reads the PEFT directory here (the executor's own view of the path: in a cluster of
containers, a volume every executor mounts) and copies the adapter into a free slot of the
LoraSet in place (models/lora.py, ``--max-loras`` slots of ``--max-lora-rank``): the
captured graphs read the same tensors, so they stay valid. A load that fails for any reason
(a missing or unreadable directory, a format this executor cannot serve as PEFT would, a
rank over the slots', no free slot) changes nothing and is named in the plan's StepResult
(``lora_failed``); the step runs on. An unload of a name this executor does not hold is a
no-op (a load that failed here, then undone by the router everywhere).

Reading an adapter holds the step for the read (a rank-16 adapter of a 0.5B model is ~9 MB:
milliseconds from a page cache); loads are rare, and a plan carrying one is answered when
it has been applied, which is what the router waits for.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pagedserve.executor.models.lora import RUNTIME_OFF, LoraError
from pagedserve.protos.wire import LoraFailure, LoraOp

if TYPE_CHECKING:
    from pagedserve.executor.model_runner import ModelRunner

log = logging.getLogger("pagedserve.executor")


def apply_lora_ops(runner: ModelRunner, ops: list[LoraOp]) -> list[LoraFailure]:
    """Apply ``ops`` in order on ``runner``'s adapters; the loads that failed, each with
    its one-line reason."""
    failures: list[LoraFailure] = []
    loras = runner.loras
    for op in ops:
        if not op.load:
            if loras is not None and loras.unload(op.name):
                log.info("LoRA adapter %s unloaded", op.name)
            continue
        try:
            if loras is None or not loras.capacity_fixed:
                raise LoraError(RUNTIME_OFF)
            adapter = loras.cache.read(op.name, op.path, runner.model.config)
            slot = loras.load(adapter)
        except LoraError as exc:
            failures.append(LoraFailure(name=op.name, message=str(exc)))
        except Exception as exc:  # an unreadable file must never take the executor down
            failures.append(LoraFailure(
                name=op.name, message=f"LoRA adapter {op.name}: {type(exc).__name__}: {exc}"))
        else:
            log.info("LoRA adapter %s loaded from %s into slot %d (rank %d)", op.name,
                     op.path, slot, adapter.rank)
            continue
        log.error("%s", failures[-1].message)
    runner.loras = loras  # the plans' precompute learns the names now served
    return failures
