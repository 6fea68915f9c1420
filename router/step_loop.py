"""The per-executor step loop: schedule -> StepPlan -> executor ... StepResult -> tokens.

Each executor has its own asyncio task running `StepLoop.run`, so a slow executor never
stalls another. The loop is ordered so the executor waits least: when a StepResult arrives
the sampled tokens are appended and the cheap stops (EOS, stop ids, max_tokens,
max_model_len) applied, the next plan is built and sent, and only then is the text work done
(detokenization, stop strings, deltas to the streams). A stop string found then has cost at
most one wasted token, which is dropped.

HOT PATH: `send_next_plan` and `apply_tokens` run once per step per executor. No logging per
request, no per-token Python beyond appending the sampled token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from ..protos import wire
from .errors import Unavailable
from .plan_builder import build_plan
from .sequence import Sequence
from .types import TokenLogprob

if TYPE_CHECKING:
    from .engine import RouterEngine
    from .membership import ExecutorHandle

log = logging.getLogger("pagedserve.router")


class StepLoop:
    """Runs every executor's steps and applies their results (one per engine)."""

    def __init__(self, engine: RouterEngine) -> None:
        self.engine = engine
        self.config = engine.config
        self.metrics = engine.metrics

    # ------------------------------------------------------------------ the loop

    async def run(self, handle: ExecutorHandle) -> None:
        """schedule -> plan -> send; result -> tokens/cheap stops -> next plan -> text."""
        engine = self.engine
        result: wire.StepResult | None = None
        try:
            while handle.healthy:
                touched: list[Sequence] = []
                if result is not None:
                    touched = self.apply_tokens(handle, result)
                future = self.send_next_plan(handle)
                if result is not None:
                    engine.delivery.text_stage(handle.scheduler, touched)
                    engine.update_gauges(handle)
                result = None
                if future is None:
                    engine.update_gauges(handle)  # aborts may have freed blocks since
                    handle.wakeup.clear()
                    if not self._has_work(handle):
                        await handle.wakeup.wait()
                    else:  # work that cannot be scheduled now (no blocks): retry soon
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(handle.wakeup.wait(), 0.05)
                    continue
                try:
                    result = await future
                except RuntimeError as exc:  # the executor reported the whole step failed
                    self.step_failed(handle, str(exc))
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("step loop of executor %s failed", handle.id)
            engine.membership.executor_lost(handle, "router-side step loop error",
                                            migrate=False)

    @staticmethod
    def _has_work(handle: ExecutorHandle) -> bool:
        s = handle.scheduler
        return bool(s.running or s.waiting or s.swapped)

    def send_next_plan(self, handle: ExecutorHandle) -> asyncio.Future | None:
        sched = handle.scheduler
        out = sched.schedule()
        for group, mode in out.preempted:
            self.metrics.inc_preemption(handle.id, mode.value)
            log.debug("request %s preempted (%s) on %s", group.request_id, mode.value, handle.id)
        try:
            if out.empty:
                return None
            handle.step_id += 1
            plan = build_plan(handle.step_id, out, handle.kv, self.engine.eos_token_ids)
        finally:
            handle.kv.end_step()
        self.check_accounting(handle)
        future = asyncio.get_running_loop().create_future()
        handle.pending, handle.pending_step = future, handle.step_id
        link = self.engine.link
        assert link is not None
        link.send(handle.routing_id, plan)
        handle.blocks_moved_in_flight = int(plan.swap_out.shape[0] + plan.swap_in.shape[0])
        handle.tokens_in_flight = out.num_tokens
        self.prefix_metrics(handle)
        return future

    # ------------------------------------------------------------------ results

    def on_result(self, executor_id: str, result: wire.StepResult) -> bool:
        handle = self.engine.executors.get(executor_id)
        if handle is None or not handle.healthy:
            return False
        handle.last_seen = time.monotonic()
        if handle.pending is not None and result.step_id == handle.pending_step:
            if not handle.pending.done():
                handle.pending.set_result(result)
        else:
            log.warning("executor %s sent a result for step %d (expected %d); dropped",
                        executor_id, result.step_id, handle.pending_step)
        return True

    def on_error(self, executor_id: str, report: wire.ErrorReport) -> bool:
        handle = self.engine.executors.get(executor_id)
        if handle is None or not handle.healthy:
            return False
        log.error("executor %s reported: %s", executor_id, report.message)
        pending = handle.pending is not None and not handle.pending.done()
        # A report naming no step while a plan is out is that plan being rejected (the
        # executor could not decode it, so it cannot name it): fail the step rather than
        # wait for a result that will never come.
        if pending and report.step_id in (None, handle.pending_step):
            handle.pending.set_exception(RuntimeError(report.message))
        return True

    def apply_tokens(self, handle: ExecutorHandle, result: wire.StepResult) -> list[Sequence]:
        """Append sampled tokens and apply the cheap stops; returns the sequences that got a
        token (for the text stage). A sequence that stopped is freed at once."""
        sched = handle.scheduler
        self.metrics.observe_step_forward(handle.id, result.forward_s)
        if result.swap_s > 0:
            sched.cost.observe_swap(handle.blocks_moved_in_flight, result.swap_s)
        if result.forward_s > 0:  # steps of >= 32 tokens teach the recompute rate
            sched.cost.observe_prefill(handle.tokens_in_flight, result.forward_s)
        for err in result.errors:
            self.request_error(handle, err)
        touched: list[Sequence] = []
        if not result.request_ids:
            return touched
        live = self.engine.live
        eos_token_ids = self.engine.eos_token_ids
        tokens = result.token_ids.tolist()
        lps = result.logprobs
        top_counts = result.top_counts
        top_ofs = 0
        max_len = self.config.max_model_len
        for i, seq_id in enumerate(result.request_ids):
            k = int(top_counts[i]) if top_counts is not None else 0
            request_id, _, index = seq_id.rpartition("#")
            group = live.get(request_id)
            seq = None
            if group is not None and int(index) < len(group.seqs):
                seq = group.seqs[int(index)]
            if seq is None or seq.finished or group.executor_id != handle.id:
                top_ofs += k
                continue
            tok = tokens[i]
            seq.token_ids.append(tok)
            if group.spec.sampling.logprobs is not None and lps is not None:
                top = ()
                if k:
                    ids = result.top_token_ids[top_ofs:top_ofs + k].tolist()
                    vals = result.top_logprobs[top_ofs:top_ofs + k].tolist()
                    top = tuple(zip(ids, vals, strict=False))
                seq.logprobs.append(TokenLogprob(tok, float(lps[i]), top))
            top_ofs += k
            touched.append(seq)
            sp = group.spec.sampling
            n_out = seq.num_output_tokens
            stop = (n_out >= sp.min_tokens and (
                tok in sp.stop_token_ids or (not sp.ignore_eos and tok in eos_token_ids)))
            if stop or n_out >= sp.max_tokens or len(seq.token_ids) >= max_len:
                sched.finish_seq(seq)
        return touched

    def request_error(self, handle: ExecutorHandle, err: wire.RequestError) -> None:
        if not err.request_id:
            log.error("executor %s failed a step: %s", handle.id, err.message)
            self.step_failed(handle, err.message)
            return
        group = self.engine.live.get(err.request_id.rsplit("#", 1)[0])
        log.error("executor %s: request %s failed: %s", handle.id, err.request_id, err.message)
        if group is not None:
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
        """Verify the KV manager's invariants and count leaked blocks: after every step with
        `debug_checks`, otherwise every `invariant_check_interval_s` (O(blocks), a few ms
        for tens of thousands of blocks). A violation is logged with the requests involved
        and never stops serving."""
        now = time.monotonic()
        if not self.config.debug_checks and \
                now - handle.last_check < self.config.invariant_check_interval_s:
            return
        handle.last_check = now
        try:
            handle.kv.check_invariants()
        except AssertionError as exc:
            ids = getattr(exc, "request_ids", ())
            log.error("executor %s: KV accounting broken: %s (requests: %s)", handle.id, exc,
                      ", ".join(ids) or "none named")
        leaked, orphans = handle.scheduler.num_leaked_blocks()
        if leaked != handle.num_leaked_blocks:
            if leaked:
                log.error("executor %s: %d KV blocks leaked (held by no live request; KV "
                          "manager requests without an owner: %s)", handle.id, leaked,
                          ", ".join(orphans[:10]) or "none")
            handle.num_leaked_blocks = leaked

    def prefix_metrics(self, handle: ExecutorHandle) -> None:
        kv = handle.kv
        q, h = kv.prefix_query_tokens, kv.prefix_hit_tokens
        dq, dh = q - handle.prefix_seen[0], h - handle.prefix_seen[1]
        if dq or dh:
            self.metrics.add_prefix_cache(handle.id, dq, dh)
            handle.prefix_seen = (q, h)
