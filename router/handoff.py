"""Prefill/decode disaggregation: a request's prompt on a prefill executor, its decoding on
a decode executor, its KV blocks moved between them through the router.

Why: a step that computes a long prompt chunk makes every decode in it wait as long (on
the executors' own step, time per output token jumps while prompts arrive). With
executors started as `--disaggregation-mode prefill` and `decode`, new requests go to the
prefill executors only (`placeable`), whose steps are prompts; each request moves to a
decode executor right after its first token, whose steps are decodes only, so its time per
output token no longer depends on the prompts arriving meanwhile.

How a request moves (the one-way flow unchanged: plans out, results back):

1. Plan time on the prefill executor (`plan_exports`, from the step loop). A row that
   ends its sample's prompt and samples (its first token) belongs to a request that may
   move (no beam search, no embedding, more than one token to go): the decode executor
   is chosen then (the fewest requests; then the most of its prompt already cached
   there, device or host), and the plan asks for the bytes of the prompt's full blocks
   that executor lacks (`StepPlan.kv_export`, read after the forward). The group is
   marked (`RequestGroup.handoff`): the prefill executor's scheduler plans no decode for
   it any more (`Scheduler._demand`). n > 1: the samples fork from sample 0 before the
   prompt's last token (scheduler.py), so their first tokens are sampled in one plan; the
   first of their rows marks the group, and the prompt's blocks, which they share, go
   once.
2. Result time (`complete`, once the result's first token is applied): the request leaves
   the prefill executor (its blocks freed there, still cached there), the received blocks
   enter the decode executor's host tier (`KVCacheManager.import_blocks`, transfer.py) and
   the request is queued there as a migrated one (each sample's prompt and first token
   as its tokens so far; a sample that ended with its first token stays ended). The
   bytes go out with that executor's next plan (`take_imports`), written before its
   swaps; admission finds the blocks as a prefix-cache hit and swaps them in, and only
   the tail (the last partial block and the first token) is computed.

Nothing depends on the bytes arriving: an executor that received nothing (its CPU pool
full, the chain broken, the step failed) computes what it lacks, as a migration does. A
request that ended with its first token, was aborted, or whose decode executor left
meanwhile stays where it is (the mark cleared: it decodes on the prefill executor). A
decode executor takes new requests only while no prefill (or mixed) executor is up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..protos import wire
from .sequence import RequestGroup

if TYPE_CHECKING:
    from .engine import RouterEngine
    from .membership import ExecutorHandle
    from .scheduler import SchedulerOutput

log = logging.getLogger("pagedserve.router")

PREFILL, DECODE = "prefill", "decode"
# At most this many bytes of KV blocks in one plan or result (the sockets' MAXMSGSIZE is
# 256 MiB): a request whose blocks would pass it moves with fewer (the rest computed).
MAX_PLAN_KV_BYTES = 64 << 20


@dataclass
class Handoff:
    """A request whose prompt a plan in flight ends, and where it goes after: `count`
    blocks from block `first` on are in that plan's result, from byte `offset`."""

    group: RequestGroup
    target: str  # the decode executor's id
    first: int
    count: int
    offset: int


def placeable(handles: list[ExecutorHandle]
              ) -> tuple[list[ExecutorHandle], list[ExecutorHandle]]:
    """(where a new or migrated request may start, the others of `handles`): executors
    that compute prompts and the decode executors, when one of the first is among
    `handles`; else all of them and none (decode executors serve alone)."""
    prompts = [h for h in handles if h.hello.disaggregation_mode != DECODE]
    if not prompts:
        return handles, []
    return prompts, [h for h in handles if h.hello.disaggregation_mode == DECODE]


def _may_move(group: RequestGroup) -> bool:
    """A group that may move once its prompt is done: no beam search, no embedding, not
    marked already (for n > 1, its first sample's row marks it), its samples forked."""
    return (group.beam is None and not group.spec.sampling.embed and group.handoff is None
            and group.forked)


def queued_import_bytes(handle: ExecutorHandle) -> int:
    """Bytes of received blocks waiting for `handle`'s next plan (at most
    MAX_PLAN_KV_BYTES: every block imported goes out with that one plan)."""
    return sum(d.shape[0] for _, d in handle.imports)


def import_into(target: ExecutorHandle, source: ExecutorHandle, group: RequestGroup,
                first: int, count: int, offset: int, data: np.ndarray | None) -> int:
    """Blocks `first` ... `first + count - 1` of `group`'s prompt chain, whose bytes start
    at `offset` of `data` (a result of `source`), into `target`'s host tier, their bytes
    queued for its next plan (handoffs and prefix pulls alike). Returns the blocks taken:
    0 when there is nothing to take, the bytes fall short, or the cache formats differ;
    fewer when the target holds some already or has no room or chain for them."""
    block_bytes = source.hello.kv_block_bytes
    if count <= 0 or target.hello.kv_format != source.hello.kv_format:
        return 0
    if data is None or data.shape[0] < offset + count * block_bytes:
        log.warning("executor %s sent no KV bytes for %d blocks (its export failed); "
                    "executor %s computes them", source.id, count, target.id)
        return 0
    seq = group.seqs[0]
    skip, cpu_ids = target.kv.import_blocks(seq.token_ids, seq.block_hashes,
                                            group.spec.cache_salt or None, first, count)
    if cpu_ids:
        lo = offset + skip * block_bytes
        target.imports.append((cpu_ids, data[lo:lo + len(cpu_ids) * block_bytes]))
    return len(cpu_ids)


class Handoffs:
    """The engine's handoffs: which plan moves which request (see the module docstring)."""

    def __init__(self, engine: RouterEngine) -> None:
        self.engine = engine

    def targets(self, handle: ExecutorHandle) -> list[ExecutorHandle]:
        """Decode executors that can take requests from prefill executor `handle`."""
        if handle.hello.disaggregation_mode != PREFILL:
            return []
        weights = self.engine.weights
        return [h for h in self.engine.executors.values()
                if h.healthy and h.hello.disaggregation_mode == DECODE
                and weights.ready(h)]

    def plan_exports(self, handle: ExecutorHandle,
                     out: SchedulerOutput) -> tuple[np.ndarray | None, list[Handoff]]:
        """The blocks a plan of prefill executor `handle` exports, and its handoffs (step 1
        of the module docstring). Runs between the scheduler's decisions and the plan."""
        targets = self.targets(handle)
        if not targets:
            return None, []
        engine = self.engine
        kv = handle.kv
        bs = kv.block_size
        bytes_left = MAX_PLAN_KV_BYTES
        block_bytes = handle.hello.kv_block_bytes
        ids: list[int] = []
        moves: list[Handoff] = []
        for row in out.rows.rows:
            seq, start, num_new, samples = row[0], row[2], row[3], row[4]
            group = seq.group
            # A row that ends the tokens its sample has (a prompt, or a recompute) and
            # samples: a chunk, or the prompt's last token; not a decode.
            if not samples or (num_new == 1 and start >= seq.num_prompt_tokens) \
                    or not _may_move(group):
                continue
            sp = group.spec.sampling
            if len(seq.token_ids) - seq.num_prompt_tokens + 1 >= sp.max_tokens:
                continue  # its first token ends it here
            adapter = group.spec.lora_adapter
            need = engine.tokens_needed(group.spec)
            fit = [h for h in targets if h.kv.can_ever_fit(need)
                   and engine.loras.ready(h, adapter)]
            if not fit:
                continue
            salt = group.spec.cache_salt or None
            best, best_key, held = None, None, 0
            for h in fit:
                hit = h.kv.lookup(seq.token_ids, seq.block_hashes, salt)
                s = h.scheduler
                key = (len(s.running) + len(s.waiting) + len(s.swapped), -len(hit))
                if best_key is None or key < best_key:
                    best, best_key, held = h, key, len(hit)
            assert best is not None
            full = len(seq.token_ids) // bs
            first = min(held, full)
            count = 0
            if best.hello.kv_format and best.hello.kv_format == handle.hello.kv_format \
                    and best.kv.num_free_cpu_blocks and block_bytes > 0:
                count = max(0, min(full - first, bytes_left // block_bytes))
            if count:
                ids.extend(kv.block_table(seq.seq_id)[first:first + count])
                bytes_left -= count * block_bytes
            offset = (len(ids) - count) * block_bytes
            group.handoff = best.id
            moves.append(Handoff(group, best.id, first, count, offset))
        if not moves:
            return None, []
        return np.asarray(ids, dtype=np.int64), moves

    def complete(self, handle: ExecutorHandle, moves: list[Handoff],
                 result: wire.StepResult) -> None:
        """The plan's result is applied (its first tokens appended): move each request
        (step 2 of the module docstring)."""
        engine = self.engine
        data = result.kv_export_data
        block_bytes = handle.hello.kv_block_bytes
        for move in moves:
            group = move.group
            if group.handoff != move.target:
                continue
            group.handoff = None  # (it decodes here if it does not move)
            target = engine.executors.get(move.target)
            if group.aborted or engine.live.get(group.request_id) is not group \
                    or all(s.finished for s in group.seqs) or group.executor_id != handle.id \
                    or group.has_pending or target is None or not target.healthy \
                    or not engine.weights.ready(target) \
                    or not engine.loras.ready(target, group.spec.lora_adapter):
                continue
            fits = queued_import_bytes(target) + move.count * block_bytes <= MAX_PLAN_KV_BYTES
            received = import_into(target, handle, group, move.first,
                                   move.count if fits else 0, move.offset, data)
            handle.scheduler.remove(group)
            group.leave_executor()
            group.executor_id = target.id
            target.scheduler.add(group)
            target.wakeup.set()
            engine.metrics.inc_handoff(handle.id, received, target.id)

    @staticmethod
    def take_imports(handle: ExecutorHandle) -> tuple[np.ndarray, np.ndarray] | None:
        """The blocks received for `handle` since its last plan, for its next plan
        (kv_import and kv_import_data), or None."""
        if not handle.imports:
            return None
        imports, handle.imports = handle.imports, []
        ids = np.asarray([c for cpu_ids, _ in imports for c in cpu_ids], dtype=np.int64)
        data = imports[0][1] if len(imports) == 1 else np.concatenate([d for _, d in imports])
        return ids, data
