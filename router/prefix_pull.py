"""Prefix pulls (`--kv-pull auto`): a request placed on an executor that lacks part of its
prompt's prefix, which another executor holds on its device, receives those KV blocks from
there instead of computing them.

Why: routing keeps a tenant's requests where its prefix is cached, and moves them to
another executor only when the queue there is long enough to pay for computing the prefix
again (routing.py's spill rule); a new or restarted executor, or round-robin routing, starts
with nothing cached. Under prefill/decode disaggregation (handoff.py) a conversation's last
answer was decoded on a decode executor, which takes no request, while its next turn is
computed on a prefill executor: decode executors are sources too (`routing.choose`'s
`sources`). Computing a 1,024-token prefix takes seconds on a CPU core and tens of
milliseconds on a GPU; moving its blocks through the router costs their bytes' copies. The
router owns every executor's block table, so it knows exactly which blocks another executor
holds and can ask for them in the plans it sends anyway (the same export and import as
prefill/decode disaggregation, router/handoff.py). Routing prices the pull against
computing (routing.py `_offer_pull`: the source's plans in flight and its next step, the
bytes, the swap-in) and takes it only when it is quicker.

How (the one-way flow unchanged: plans out, results back):

1. Place time (`start`, from `RouterEngine.place`): the request is queued on its executor
   (the target) and marked (`RequestGroup.pull`): admission passes it over, as a request
   waiting for a prefix another computes (admission.py). The source's blocks, the device
   blocks past what the target holds, get an export hold (kvmanager/transfer.py: a
   reference nothing evicts until the plan reading them is answered).
2. The source's next plan exports them (`plan_exports`): a plan with no rows, sent as
   soon as the pipeline has room, so the bytes come back once the plans in flight are
   done, not after another forward (at most MAX_PLAN_KV_BYTES a plan; the rest go in
   the next). The source's pipeline loses a step's overlap for it.
3. Its result (`complete`): the hold ends; the bytes become host-tier entries of the
   target's KV manager chained after what it holds (`import_blocks`) and go out with the
   target's next plan (`handle.imports`, written before that plan's swaps); the mark is
   cleared and the target woken. Admission finds the blocks as a prefix-cache hit and
   swaps them in.

Every shortfall costs recomputation only, never a token: the source lost or its step
failed (`source_lost`: the mark cleared), the target lost (the request migrates: the mark
cleared with everything else, `leave_executor`), the request aborted or ended, weights
changed on either side, no CPU block free or the chain broken on the target (fewer or no
blocks taken). A hold always ends with its plan's result, or with the source's KV manager.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..protos import wire
from .handoff import MAX_PLAN_KV_BYTES, import_into, queued_import_bytes
from .sequence import RequestGroup

if TYPE_CHECKING:
    from .engine import RouterEngine
    from .membership import ExecutorHandle
    from .routing import Candidate, RouteDecision

log = logging.getLogger("pagedserve.router")

# What a byte of KV takes from the source's device to the target's CPU block, before the
# source's plans in flight and the target's swap-in are counted: gathered and copied out on
# the source, sent to the router, sent on with the target's next plan, written into the CPU
# cache. Measured on the 2-core VM with the built-in model in bfloat16 (benchmarks/README.md
# "kv_pull_bench.py"): 9.9 ns a byte end to end (the 23.6 MB of a 1,024-token prefix in
# ~230 ms more than a local hit; of it the source's gather and copy ~22 ms, the import's
# write ~4 ms, the rest the two messages' encoding, sockets and decoding). Routing compares
# it with computing the tokens: there 2 ms a token, 32 ms a block against 3.7 ms moved.
TRANSFER_S_PER_BYTE = 1e-8


@dataclass(eq=False)
class Pull:
    """Device blocks `block_ids` of executor `source` (held there for export), blocks
    `first` ... of the request's prompt chain, on their way to executor `target`; `offset`:
    where their bytes start in the export of the plan carrying them."""

    group: RequestGroup
    source: str
    target: str
    first: int
    weights_path: str  # both executors' weights when it started
    block_ids: tuple[int, ...] = ()
    offset: int = 0


class Pulls:
    """The engine's prefix pulls (see the module docstring)."""

    def __init__(self, engine: RouterEngine, enabled: bool) -> None:
        self.engine = engine
        self.enabled = enabled
        # pulls started and not ended (an ordered set): what `source_lost` looks through,
        # wherever they are (queued on the source, in a plan in flight, or in the plan
        # whose result was being applied when the source was lost)
        self.active: dict[Pull, None] = {}

    def describe(self, c: Candidate, handle: ExecutorHandle) -> Candidate:
        """`c` (routing.candidate of `handle`) with what routing needs to price pulls to
        and from it; unchanged when pulls are off or its cache cannot take part."""
        hello = handle.hello
        kv = handle.kv
        block_bytes = hello.kv_block_bytes
        if not self.enabled or not hello.kv_format or block_bytes <= 0 \
                or not kv.enable_prefix_caching:
            return c
        c.pull_key = (hello.kv_format, handle.weights_path)
        c.max_pull_blocks = max(0, min(
            kv.num_free_cpu_blocks,
            (MAX_PLAN_KV_BYTES - queued_import_bytes(handle)) // block_bytes))
        c.transfer_s_per_block = block_bytes * TRANSFER_S_PER_BYTE
        c.num_in_flight = len(handle.in_flight)
        c.in_flight_prefill_tokens = sum(p.num_prefill_tokens for p in handle.in_flight)
        return c

    def start(self, group: RequestGroup, source: ExecutorHandle, target: ExecutorHandle,
              decision: RouteDecision) -> None:
        """Step 1: `group` was queued on `target`; hold the source's blocks and mark it."""
        pull = Pull(group, source.id, target.id, len(decision.hit), target.weights_path)
        pull.block_ids = source.kv.hold_export(pull, decision.pull_hit, pull.first)
        if not pull.block_ids:  # (evicted since the lookup: nothing to pull)
            return
        group.pull = pull
        source.pulls.append(pull)
        self.active[pull] = None
        source.wakeup.set()

    def _given_up(self, pull: Pull) -> bool:
        group = pull.group
        return group.pull is not pull or group.aborted \
            or self.engine.live.get(group.request_id) is not group

    def prune(self, handle: ExecutorHandle) -> bool:
        """Drop the pulls queued on `handle` that were given up (their holds end); True
        when some are left (its next plan exports their blocks)."""
        kept = []
        for pull in handle.pulls:
            if self._given_up(pull):
                handle.kv.release_export(pull)
                self.active.pop(pull, None)
            else:
                kept.append(pull)
        handle.pulls = kept
        return bool(kept)

    def plan_exports(self, handle: ExecutorHandle, num_ids: int) -> tuple[list[int], list[Pull]]:
        """Step 2: the blocks the plan of `handle` being built exports for pulls, after the
        `num_ids` it exports already (handoffs), and those pulls. A pull that does not fit
        the plan's bytes waits for the next plan."""
        block_bytes = handle.hello.kv_block_bytes
        bytes_left = MAX_PLAN_KV_BYTES - num_ids * block_bytes
        ids: list[int] = []
        taken: list[Pull] = []
        kept: list[Pull] = []
        for pull in handle.pulls:
            size = len(pull.block_ids) * block_bytes
            if size > bytes_left:
                kept.append(pull)
                continue
            pull.offset = (num_ids + len(ids)) * block_bytes
            ids.extend(pull.block_ids)
            bytes_left -= size
            taken.append(pull)
        handle.pulls = kept
        return ids, taken

    def complete(self, handle: ExecutorHandle, pulls: list[Pull],
                 result: wire.StepResult) -> None:
        """Step 3: the plan of source `handle` that exported `pulls` was answered."""
        engine = self.engine
        data = result.kv_export_data
        block_bytes = handle.hello.kv_block_bytes
        for pull in pulls:
            handle.kv.release_export(pull)
            self.active.pop(pull, None)
            if self._given_up(pull):
                continue
            group = pull.group
            group.pull = None  # (admitted from now on, with or without the blocks)
            target = engine.executors.get(pull.target)
            if target is None or not target.healthy or group.executor_id != target.id:
                continue
            target.wakeup.set()
            if not handle.weights_path == target.weights_path == pull.weights_path:
                continue  # (computed with other weights than the target runs now)
            count = min(len(pull.block_ids),
                        (MAX_PLAN_KV_BYTES - queued_import_bytes(target)) // block_bytes)
            received = import_into(target, handle, group, pull.first, count, pull.offset,
                                   data)
            if received:
                engine.metrics.inc_pull(target.id, received)

    def source_lost(self, handle: ExecutorHandle) -> None:
        """`handle` left (or failed a step) with pulls queued or in flight: their requests
        compute what they lack (their targets woken). Its KV manager goes with it, holds
        included."""
        handle.pulls = []
        for pull in [p for p in self.active if p.source == handle.id]:
            del self.active[pull]
            if pull.group.pull is pull:
                pull.group.pull = None
                target = self.engine.executors.get(pull.target)
                if target is not None:
                    target.wakeup.set()
