"""The per-executor step loop: schedule -> StepPlan -> executor ... StepResult -> tokens.

Each executor has its own asyncio task running `StepLoop.run`, so a slow executor never
stalls another.

Pipelining (`--pipeline-depth`, default 2). The loop keeps up to `depth` plans in flight:
plan N+1 is built and sent right after plan N, before N's result is back, so the executor
finds its next plan waiting when it finishes a step. A decode in N+1 whose input is the
token being sampled in N is marked, and the executor feeds it its own sample; the router
counts that token as pending (`Sequence.num_pending`) until the result brings it. When the
result of the oldest plan arrives:

    result N -> KV: blocks held for plan N are free -> tokens appended, cheap stops
                (an API worker's token that ends nothing goes to its worker here)
             -> next plan(s) built and sent (the executor is busy with N+1 meanwhile)
             -> text stage (detokenization, stop strings, deltas to the streams)

A request that ended in step N (EOS, stop id, stop string, abort, deadline) may be in every
plan sent before the router knew: the tokens those plans sample for it are dropped (never
streamed, counted or cached), and the blocks freed for it are handed out again only when the
last plan naming them has been answered (the KV manager's fences). At depth 1 it is the
one-plan-at-a-time loop.

Speculative decoding (router/speculative.py): a plan with a sample that may decode with
drafts is the only one in flight (`fill`): how many tokens its rows emit is known only from
its result, and the next plan drafts from them.

A plan's deadline: `--step-timeout` plus its tokens x the learned seconds per token x
`DEADLINE_SAFETY`, and `WARMUP_FACTOR` x the timeout for the first `WARMUP_PLANS` plans of a
registration (compilation, caches warming). It is sent with the plan (an executor still
inside the step after it stops heartbeating) and checked here by `overdue`: a plan that has
been the oldest unanswered one for longer than its deadline means the executor is hung.

HOT PATH: `send_next_plan` and `apply_result` run once per step per executor. No logging per
request, no per-token Python beyond appending the sampled token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from ..protos import wire
from . import result_checks as checks
from . import token_apply
from .errors import Unavailable
from .handoff import Handoff
from .plan_builder import build_plan
from .prefix_pull import Pull
from .sequence import RequestGroup, Sequence

if TYPE_CHECKING:
    from .engine import RouterEngine
    from .membership import ExecutorHandle

log = logging.getLogger("pagedserve.router")

DEADLINE_SAFETY = 8.0  # x the learned prefill seconds per token, on top of --step-timeout
WARMUP_PLANS = 4  # the first plans of a registration get WARMUP_FACTOR x --step-timeout
WARMUP_FACTOR = 4.0
RETRY_S = 0.05  # work that cannot be scheduled now (no blocks): look again this soon
INVARIANT_CPU_SHARE = 0.002  # of wall time the periodic KV invariant check may take
# A busy executor's gauges (running, waiting, blocks free...) are refreshed at most this
# often (they cost ~20-30 us a step: two pools' stats and nine gauge sets; a scrape comes
# every few seconds); an executor going idle refreshes them at once, so a quiet router's
# gauges are exact.
GAUGE_INTERVAL_S = 0.05


@dataclass
class InFlightPlan:
    """A plan sent and not answered yet; results are matched to plans by step id."""

    step_id: int
    future: asyncio.Future
    sampled: list[Sequence]  # samples this plan samples for (each counts it as pending)
    num_tokens: int  # tokens it computes (the cost model pairs them with its forward_s)
    # swapped out + in, and received from other executors (written into CPU blocks: the
    # executor's swap_s times them too): the cost model pairs them with its swap_s
    num_blocks_moved: int
    deadline_s: float
    sent_at: float = field(default_factory=time.monotonic)
    num_prefill_tokens: int = 0  # of num_tokens, in chunks of more than one token
    num_decode_seqs: int = 0  # sequences computing one token
    num_admitted: int = 0  # requests admitted when it was sent: a newer one is not in it
    # Speculative decoding: its rows with drafts (how many each), and whether a sample of
    # it speculates (no plan is sent after it before its result: router/speculative.py)
    drafts: dict[Sequence, list[int]] = field(default_factory=dict)
    speculating: bool = False
    lora_ops: list[wire.LoraOp] = field(default_factory=list)  # adapter ops it carried
    weight_op: wire.WeightOp | None = None  # the weight check or load it carried
    handoffs: list[Handoff] = field(default_factory=list)  # requests it ends the prompt of
    pulls: list[Pull] = field(default_factory=list)  # prefix pulls it exports blocks for


def _blocks_moved(plan: wire.StepPlan) -> int:
    """Blocks a plan moves within the executor's swap_s: swapped out and in, and received
    (an import's write is timed with the swaps: left out, a step that receives blocks and
    swaps them in would teach the cost model a slower swap than it has)."""
    received = 0 if plan.kv_import is None else plan.kv_import.shape[0]
    return int(plan.swap_out.shape[0] + plan.swap_in.shape[0] + received)


class StepTrace:
    """`PAGEDSERVE_STEP_TRACE=<path>`: one JSON line per StepResult with the executor's raw
    timings (benchmarks compute percentiles from these, not from histogram buckets)."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1 << 16)  # noqa: SIM115 (lives with the engine)

    def write(self, executor_id: str, plan: InFlightPlan, result: wire.StepResult) -> None:
        self._file.write(json.dumps({
            "executor": executor_id, "step_id": result.step_id, "forward_s": result.forward_s,
            "sample_s": result.sample_s, "swap_s": result.swap_s, "gap_s": result.gap_s,
            "num_tokens": plan.num_tokens, "num_sampled": len(result.request_ids),
            "t_sent": plan.sent_at, "t_recv": time.monotonic(),
        }) + "\n")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()


class StepLoop:
    """Runs every executor's steps and applies their results (one per engine)."""

    def __init__(self, engine: RouterEngine) -> None:
        self.engine = engine
        self.config = engine.config
        self.metrics = engine.metrics
        self.depth = max(1, engine.config.pipeline_depth)
        self.vocab_size = engine.info.vocab_size  # a result's tokens are checked against it
        path = os.environ.get("PAGEDSERVE_STEP_TRACE")
        self.trace = StepTrace(path) if path else None

    def close(self) -> None:
        """At the engine's stop: the step trace's last lines written out (the router's
        start-up objects are frozen out of the collector, so nothing would finalize it)."""
        if self.trace is not None:
            self.trace.close()
            self.trace = None

    # ------------------------------------------------------------------ the loop

    async def run(self, handle: ExecutorHandle) -> None:
        """Fill the pipeline; result of the oldest plan -> tokens/cheap stops -> refill ->
        text. Waits for new work when nothing is in flight."""
        engine = self.engine
        in_flight = handle.in_flight
        try:
            while handle.healthy:
                if not in_flight:  # (after a result the pipeline was refilled already)
                    self.fill(handle)
                if not in_flight:
                    engine.update_gauges(handle)  # aborts may have freed blocks since
                    handle.wakeup.clear()
                    if not self._has_work(handle):
                        await handle.wakeup.wait()
                    else:
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(handle.wakeup.wait(), RETRY_S)
                    continue
                head = in_flight[0]
                if len(in_flight) < self.depth and self._has_work(handle) \
                        and not head.future.done():
                    # Room in the pipeline: new work (a request, an abort) may go out before
                    # the oldest plan is answered.
                    handle.wakeup.clear()
                    woken = asyncio.ensure_future(handle.wakeup.wait())
                    try:
                        await asyncio.wait((head.future, woken),
                                           return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        woken.cancel()
                    if not head.future.done():
                        self.fill(handle)
                        continue
                try:
                    result = await head.future
                except RuntimeError as exc:  # the executor reported the whole step failed
                    self.step_failed(handle, str(exc))
                    return
                in_flight.popleft()
                handle.head_since = time.monotonic()
                touched = self.apply_result(handle, head, result)
                if not handle.healthy:
                    return
                self.fill(handle)
                engine.delivery.text_stage(handle.scheduler, touched)
                if head.handoffs:  # to decode executors (router/handoff.py)
                    engine.handoffs.complete(handle, head.handoffs, result)
                if head.pulls:  # to other executors' requests (router/prefix_pull.py)
                    engine.pulls.complete(handle, head.pulls, result)
                now = time.monotonic()
                if now >= handle.gauges_due:
                    handle.gauges_due = now + GAUGE_INTERVAL_S
                    engine.update_gauges(handle)
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("step loop of executor %s failed", handle.id)
            engine.membership.executor_lost(handle, "router-side step loop error",
                                            migrate=False)

    def fill(self, handle: ExecutorHandle) -> None:
        """Send plans until `depth` are in flight or there is nothing to schedule."""
        while handle.healthy and len(handle.in_flight) < self.depth:
            if handle.in_flight and handle.in_flight[-1].speculating:
                return  # what it samples is what the next plan drafts from
            if not self.send_next_plan(handle):
                return

    def _has_work(self, handle: ExecutorHandle) -> bool:
        s = handle.scheduler  # (held: no waiting group is admitted; frozen: none runs)
        busy = s.hold != "freeze" and (s.running or s.swapped or (s.waiting and not s.hold))
        return bool(busy or handle.lora_ops or handle.pulls
                    or self.engine.weights.has_work(handle))

    def _deadline(self, handle: ExecutorHandle, num_tokens: int) -> float:
        timeout = self.config.step_timeout_s
        if handle.step_id <= WARMUP_PLANS:
            timeout *= WARMUP_FACTOR
        return timeout + num_tokens * handle.scheduler.cost.s_per_token * DEADLINE_SAFETY

    def send_next_plan(self, handle: ExecutorHandle) -> bool:
        """Schedule one step and send its plan; False when there was nothing to send."""
        sched = handle.scheduler
        kv = handle.kv
        # Blocks other executors' requests pull from here go out at once, in a plan of
        # their own: its result comes back after the plans in flight, not after another
        # forward (router/prefix_pull.py).
        out = sched.rowless_step() if handle.pulls and self.engine.pulls.prune(handle) \
            else sched.schedule()
        for group, mode in out.preempted:
            self.metrics.inc_preemption(handle.id, mode.value)
            log.debug("request %s preempted (%s) on %s", group.request_id, mode.value, handle.id)
        ops = handle.lora_ops
        weight_op = handle.weight_ops[0] if handle.weight_ops else None
        if out.empty and not ops and weight_op is None and not handle.pulls:
            kv.end_step()
            return False
        try:
            step_id = handle.step_id + 1
            deadline_s = self._deadline(handle, out.num_tokens)
            plan = build_plan(step_id, out, kv, self.engine.eos_token_ids, deadline_s)
            if ops or weight_op:  # new weights, adapter loads and unloads: applied first
                plan = msgspec.structs.replace(plan, lora_ops=ops, weight_op=weight_op)
                handle.lora_ops = []
                if weight_op is not None:
                    del handle.weight_ops[0]
            plan, handoffs, pulls = self._kv_moves(handle, out, plan)
        except BaseException:
            kv.end_step()
            raise
        handle.step_id = step_id
        kv.end_step(step_id)
        self.check_accounting(handle)
        if not handle.in_flight:
            handle.head_since = time.monotonic()
        handle.in_flight.append(InFlightPlan(
            step_id, asyncio.get_running_loop().create_future(), out.sampled, out.num_tokens,
            _blocks_moved(plan), deadline_s,
            num_prefill_tokens=out.num_prefill_tokens, num_decode_seqs=out.num_decode_seqs,
            num_admitted=self.engine.num_admitted, drafts=out.rows.drafts,
            speculating=out.rows.speculating, lora_ops=ops, weight_op=weight_op,
            handoffs=handoffs, pulls=pulls))
        link = self.engine.link
        assert link is not None
        link.send(handle.routing_id, plan)
        self.prefix_metrics(handle)
        return True

    def _kv_moves(self, handle: ExecutorHandle, out, plan: wire.StepPlan
                  ) -> tuple[wire.StepPlan, list[Handoff], list[Pull]]:
        """KV blocks between executors (router/handoff.py, router/prefix_pull.py): the
        blocks received for this executor since its last plan go out with this one; the
        blocks of the prompts it ends that move to a decode executor, and those other
        executors' requests pull from it, are asked back."""
        engine = self.engine
        handoffs = engine.handoffs
        imports = handoffs.take_imports(handle) if handle.imports else None
        exports, moves = handoffs.plan_exports(handle, out) \
            if handle.hello.disaggregation_mode == "prefill" else (None, [])
        pulls: list[Pull] = []
        if handle.pulls:
            num_ids = 0 if exports is None else exports.shape[0]
            ids, pulls = engine.pulls.plan_exports(handle, num_ids)
            if pulls:
                pulled = np.asarray(ids, dtype=np.int64)
                exports = pulled if exports is None else np.concatenate([exports, pulled])
        if imports is None and exports is None:
            return plan, moves, pulls
        fields = {}
        if imports is not None:
            fields.update(kv_import=imports[0], kv_import_data=imports[1])
        if exports is not None:
            fields.update(kv_export=exports)
        return msgspec.structs.replace(plan, **fields), moves, pulls

    def overdue(self, handle: ExecutorHandle, now: float) -> str:
        """Why the executor counts as hung (its oldest plan unanswered past its deadline),
        or ''."""
        if not handle.in_flight:
            return ""
        head = handle.in_flight[0]
        waited = now - max(handle.head_since, head.sent_at)
        if waited <= head.deadline_s:
            return ""
        return f"step {head.step_id} unanswered for {waited:.1f} s (deadline {head.deadline_s:.1f} s)"

    # ------------------------------------------------------------------ results

    def on_result(self, executor_id: str, result: wire.StepResult) -> bool:
        handle = self.engine.executors.get(executor_id)
        if handle is None or not handle.healthy:
            return False
        handle.last_seen = time.monotonic()
        for plan in handle.in_flight:
            if plan.step_id == result.step_id:
                if not plan.future.done():
                    plan.future.set_result(result)
                return True
        log.warning("executor %s sent a result for step %d (in flight: %s); dropped",
                    executor_id, result.step_id,
                    [p.step_id for p in handle.in_flight] or "none")
        return True

    def on_error(self, executor_id: str, report: wire.ErrorReport) -> bool:
        handle = self.engine.executors.get(executor_id)
        if handle is None or not handle.healthy:
            return False
        log.error("executor %s reported: %s", executor_id, report.message)
        # A report naming a plan in flight fails that step; one naming no step while plans
        # are out is a plan being rejected (the executor could not decode it, so it cannot
        # name it): fail the oldest rather than wait for a result that will never come.
        for plan in handle.in_flight:
            if report.step_id in (None, plan.step_id) and not plan.future.done():
                plan.future.set_exception(RuntimeError(report.message))
                break
        return True

    def apply_result(self, handle: ExecutorHandle, plan: InFlightPlan,
                     result: wire.StepResult) -> list[Sequence]:
        """The result of the oldest plan: its held blocks are free, its pending samples are
        no longer pending, timings teach the cost model; then the tokens (`apply_tokens`)."""
        sched = handle.scheduler
        result = checks.sane_timings(result)
        handle.kv.plan_answered(plan.step_id)
        if plan.weight_op is not None:
            self.engine.weights.answered(handle, plan.weight_op, result.weight_failed)
            if not handle.healthy:  # a load that failed there: out of service
                return []
        if plan.lora_ops:
            self.engine.loras.answered(handle, plan.lora_ops, result.lora_failed)
        for seq in plan.sampled:
            seq.num_pending -= 1
        self.metrics.observe_step_forward(handle.id, result.forward_s)
        self.metrics.observe_executor_gap(handle.id, result.gap_s)
        if self.trace is not None:
            self.trace.write(handle.id, plan, result)
        if result.swap_s > 0:
            sched.cost.observe_swap(plan.num_blocks_moved, result.swap_s)
        if result.forward_s > 0:  # the prefill and decode rates (routing's too)
            sched.cost.observe_step(plan.num_prefill_tokens, plan.num_decode_seqs,
                                    result.forward_s)
        errors = result.errors
        bad = checks.bad_token_rows(result, self.vocab_size)
        if bad is not None:  # an executor's bug (result_checks.py): those requests fail
            errors = [*errors, *checks.out_of_vocab_errors(result, bad, self.vocab_size)]
            result = checks.without_rows(result, bad)
        for err in errors:
            self.request_error(handle, plan, err)
            if not handle.healthy:
                return []
        if result.prompt_ids:
            self.apply_prompt_scores(handle, plan, result)
        if result.embed_ids:
            self.apply_embeddings(handle, plan, result)
        return self.apply_tokens(handle, result, plan.sampled, plan.drafts)

    def _plan_group(self, plan: InFlightPlan, seq_id: str) -> RequestGroup | None:
        """The live request that sample id `seq_id` of `plan` belongs to, or None: a
        request admitted after the plan was sent (one that took an aborted request's id) is
        not the one the plan computed for."""
        group = self.engine.live.get(seq_id.rpartition("#")[0])
        if group is None or group.arrival_seq > plan.num_admitted:
            return None
        return group

    # ------------------------------------------------------------------ token_apply.py
    apply_prompt_scores = token_apply.apply_prompt_scores
    apply_embeddings = token_apply.apply_embeddings
    apply_tokens = token_apply.apply_tokens

    def request_error(self, handle: ExecutorHandle, plan: InFlightPlan,
                      err: wire.RequestError) -> None:
        if not err.request_id:
            log.error("executor %s failed a step: %s", handle.id, err.message)
            self.step_failed(handle, err.message)
            return
        group = self._plan_group(plan, err.request_id)
        log.error("executor %s: request %s failed: %s", handle.id, err.request_id, err.message)
        if group is not None and group.executor_id == handle.id:  # not another's request
            self.engine.delivery.fail(
                group, Unavailable(f"the executor failed the request: {err.message}"))

    def step_failed(self, handle: ExecutorHandle, message: str) -> None:
        """A whole step failed on the executor: what its cache holds is unknown now, so its
        requests end (UNAVAILABLE) and it is told to forget everything and register again
        (with an empty cache and a fresh KV manager here)."""
        link = self.engine.link
        if link is not None:
            link.send(handle.routing_id,
                      wire.Shutdown(reason=f"step failed: {message}", exit=False))
        self.engine.membership.executor_lost(handle, f"failed a step: {message}",
                                             migrate=False)

    # ------------------------------------------------------------------ accounting

    def check_accounting(self, handle: ExecutorHandle) -> None:
        """Count leaked blocks (O(requests)) every `invariant_check_interval_s`, and verify
        the KV manager's invariants: after every step with `debug_checks`, otherwise at most
        INVARIANT_CPU_SHARE of the time. The invariant check is O(blocks) on the event loop
        (~1 µs a block: 20 ms at 17k blocks, 80–130 ms at 100k, a GPU's cache can hold
        several 100k), so its interval grows with what it cost last time rather than
        stalling every stream for that long every few seconds. A violation is logged with
        the requests involved and never stops serving."""
        now = time.monotonic()
        debug = self.config.debug_checks
        if not debug and now - handle.last_check < self.config.invariant_check_interval_s:
            return
        handle.last_check = now
        if debug or now >= handle.next_full_check:
            started = time.perf_counter()
            try:
                handle.kv.check_invariants()
            except AssertionError as exc:
                ids = getattr(exc, "request_ids", ())
                log.error("executor %s: KV accounting broken: %s (requests: %s)", handle.id,
                          exc, ", ".join(ids) or "none named")
            cost = time.perf_counter() - started
            handle.next_full_check = now + max(self.config.invariant_check_interval_s,
                                               cost / INVARIANT_CPU_SHARE)
        leaked, orphans = handle.scheduler.num_leaked_blocks()
        if leaked != handle.num_leaked_blocks:
            if leaked:
                log.error("executor %s: %d KV blocks leaked (held by no live request; KV "
                          "manager requests without an owner: %s)", handle.id, leaked,
                          ", ".join(orphans[:10]) or "none")
            handle.num_leaked_blocks = leaked

    def prefix_metrics(self, handle: ExecutorHandle) -> None:
        kv = handle.kv
        now = (kv.prefix_query_tokens, kv.prefix_hit_tokens, kv.host_hit_tokens,
               kv.num_offloaded_blocks)
        if now != handle.prefix_seen:
            self.metrics.add_prefix_cache(handle.id, *(
                a - b for a, b in zip(now, handle.prefix_seen, strict=True)))
            handle.prefix_seen = now
