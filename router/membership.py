"""Executor membership: who is registered, who is alive, and where work goes when one leaves.

    Hello -> on_hello (accept/refuse; a fresh KV manager, scheduler and step loop)
    Heartbeat / result -> last_seen;  monitor_loop: silence past --heartbeat-timeout, or
        the oldest plan unanswered past its deadline (a hung executor), = dead
    Goodbye (SIGTERM, scale-down), process exit, re-registration, failed step
        -> executor_lost -> migrate each request (or fail it after a failed step)

The router holds every token of every request, so losing an executor loses no request:
each one is re-admitted elsewhere with its tokens so far (see `migrate`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..kvmanager import KVCacheManager
from ..protos import wire
from .errors import Unavailable
from .scheduler import Scheduler, SchedulerConfig
from .sequence import RequestGroup

if TYPE_CHECKING:
    from .engine import RouterEngine
    from .prefix_pull import Pull
    from .step_loop import InFlightPlan

log = logging.getLogger("pagedserve.router")

# The most device (or CPU) blocks an executor may bring: the router keeps a KV manager of
# numpy arrays over them (~9 bytes a block, 0.6 GB at this count; 2^26 blocks of 16 tokens
# are a billion tokens, far past any device's cache). A Hello claiming more (a typo, a
# bogus executor) is refused with the count, not left to fail inside the manager's arrays.
MAX_EXECUTOR_BLOCKS = 1 << 26


@dataclass
class ExecutorHandle:
    """One registered executor: its KV manager, scheduler and step loop."""

    hello: wire.Hello
    routing_id: bytes
    kv: KVCacheManager
    scheduler: Scheduler
    healthy: bool = True
    last_seen: float = field(default_factory=time.monotonic)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    in_flight: deque[InFlightPlan] = field(default_factory=deque)  # oldest first
    head_since: float = 0.0  # when the oldest plan in flight became the oldest
    step_id: int = 0  # of the newest plan sent
    task: asyncio.Task | None = None
    # (queries, hits, of which from the host, blocks offloaded) already counted in metrics
    prefix_seen: tuple[int, int, int, int] = (0, 0, 0, 0)
    last_check: float = 0.0  # when the KV accounting was last checked
    next_full_check: float = 0.0  # when the O(blocks) invariant check may run again
    gauges_due: float = 0.0  # when a busy step loop next refreshes the executor's gauges
    num_leaked_blocks: int = 0
    lora_ops: list[wire.LoraOp] = field(default_factory=list)  # for the next plan, in order
    lora_ready: set[str] = field(default_factory=set)  # adapters loaded here since it joined
    weight_ops: list[wire.WeightOp] = field(default_factory=list)  # one per plan, in order
    weights_path: str = ""  # the weights it runs (weight_sync.py; "": its --model's)
    # blocks received from other executors for its next plan: (cpu ids, bytes) (handoff.py,
    # prefix_pull.py)
    imports: list[tuple[list[int], np.ndarray]] = field(default_factory=list)
    # prefix pulls whose blocks its next plan exports (prefix_pull.py), oldest first
    pulls: list[Pull] = field(default_factory=list)

    @property
    def id(self) -> str:
        return self.hello.executor_id


class Membership:
    """Registration, liveness and migration for one engine's executors."""

    def __init__(self, engine: RouterEngine) -> None:
        self.engine = engine
        self.config = engine.config
        self.executors = engine.executors
        # Called with (executor id, why) when an executor is declared dead while its process
        # may still run (silent, or a plan unanswered): `serve` kills such a child.
        self.on_hung: Callable[[str, str], None] | None = None

    def healthy(self) -> list[ExecutorHandle]:
        return [h for h in self.executors.values() if h.healthy]

    # ------------------------------------------------------------------ registration

    def refusal(self, hello: wire.Hello) -> str:
        """Why an executor cannot join (empty: it can)."""
        cfg = self.config
        if hello.protocol_version != wire.PROTOCOL_VERSION:
            return f"protocol version {hello.protocol_version}, router speaks " \
                   f"{wire.PROTOCOL_VERSION}"
        if hello.model_fingerprint != cfg.model_fingerprint:
            return "a different model (config.json fingerprint differs from the router's)"
        if sorted(hello.lora_adapters) != sorted(cfg.lora_adapters):
            return (f"LoRA adapters {', '.join(sorted(hello.lora_adapters)) or 'none'}, the "
                    f"router serves {', '.join(sorted(cfg.lora_adapters)) or 'none'} (start "
                    "both with the same --lora-modules)")
        if hello.max_loras != cfg.max_loras:
            return (f"--max-loras {hello.max_loras}, the router's is {cfg.max_loras} (start "
                    "both with the same --max-loras)")
        if hello.block_size != cfg.block_size:
            return f"block size {hello.block_size}, the router uses {cfg.block_size}"
        if hello.num_gpu_blocks <= 0:
            return "no KV-cache blocks"
        if hello.num_cpu_blocks < 0:
            return f"{hello.num_cpu_blocks} CPU blocks"
        if max(hello.num_gpu_blocks, hello.num_cpu_blocks) > MAX_EXECUTOR_BLOCKS:
            return (f"{hello.num_gpu_blocks} device / {hello.num_cpu_blocks} CPU blocks, more "
                    f"than the {MAX_EXECUTOR_BLOCKS} the router keeps for one executor")
        if hello.disaggregation_mode not in ("null", "prefill", "decode"):
            return f"disaggregation mode {hello.disaggregation_mode!r}"
        if hello.max_model_len < cfg.max_model_len:
            return (f"max_model_len {hello.max_model_len} is below the router's "
                    f"{cfg.max_model_len} (start both with the same --max-model-len)")
        return ""

    def on_hello(self, routing_id: bytes, hello: wire.Hello) -> wire.Welcome:
        reason = self.refusal(hello)
        if reason:
            log.warning("refused executor %s: %s", hello.executor_id, reason)
            return wire.Welcome(executor_id=hello.executor_id, accepted=False, reason=reason)
        engine = self.engine
        old = self.executors.get(hello.executor_id)
        cfg = self.config
        kv = KVCacheManager(
            hello.num_gpu_blocks, hello.num_cpu_blocks, hello.block_size,
            enable_prefix_caching=cfg.enable_prefix_caching, hash_algo=cfg.hash_algo,
            watermark=cfg.watermark, max_pinned_fraction=cfg.max_pinned_fraction,
            enable_offloading=cfg.enable_offloading,
        )
        sched = Scheduler(kv, SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=cfg.max_model_len, preemption_mode=cfg.preemption_mode,
            decode_lane_min_running=cfg.decode_lane_min_running,
            pipeline_depth=cfg.pipeline_depth, speculative=cfg.speculative,
            formats=engine.formats,
        ))
        handle = ExecutorHandle(hello=hello, routing_id=routing_id, kv=kv, scheduler=sched)
        self.executors[hello.executor_id] = handle
        handle.task = asyncio.get_running_loop().create_task(engine.steps.run(handle))
        if old is not None:  # it re-registered with an empty cache (router loss, restart)
            self.executor_lost(old, "re-registered with an empty cache")
        engine.loras.executor_joined(handle)  # the adapters loaded so far go out first
        engine.weights.executor_joined(handle)  # and the cluster's weights if it runs others
        log.info("executor %s joined: device=%s dtype=%s blocks=%d cpu_blocks=%d "
                 "kv_block_bytes=%d%s", hello.executor_id, hello.device, hello.dtype,
                 hello.num_gpu_blocks, hello.num_cpu_blocks, hello.kv_block_bytes,
                 "" if hello.disaggregation_mode == "null"
                 else f" disaggregation={hello.disaggregation_mode}")
        engine.metrics.set_executors_healthy(engine.num_healthy())
        engine.update_gauges(handle)
        engine.registered.set()
        return wire.Welcome(executor_id=hello.executor_id, accepted=True)

    def on_heartbeat(self, executor_id: str) -> bool:
        handle = self.executors.get(executor_id)
        if handle is None or not handle.healthy:
            return False
        handle.last_seen = time.monotonic()
        return True

    # ------------------------------------------------------------------ liveness

    async def monitor_loop(self) -> None:
        timeout = self.config.heartbeat_timeout_s
        while True:
            await asyncio.sleep(min(0.1, timeout / 4))
            now = time.monotonic()
            for handle in list(self.executors.values()):
                if not handle.healthy:
                    continue
                why = self.engine.steps.overdue(handle, now)
                if not why and now - handle.last_seen > timeout:
                    why = f"silent for {now - handle.last_seen:.1f} s"
                if why:
                    try:
                        self.executor_lost(handle, why)
                        if self.on_hung is not None:
                            self.on_hung(handle.id, why)
                    except Exception:  # the monitor must outlive any bug in one loss
                        log.exception("handling the loss of executor %s failed", handle.id)

    def executor_exited(self, executor_id: str, returncode: int | None) -> None:
        """`serve` saw an executor's process exit: it is dead now, not after the timeout."""
        handle = self.executors.get(executor_id)
        if handle is not None:
            self.executor_lost(handle, f"process exited with code {returncode}")

    def on_goodbye(self, executor_id: str, reason: str) -> None:
        """The executor is stopping (SIGTERM, scale-down): move its requests now."""
        handle = self.executors.get(executor_id)
        if handle is not None:
            self.executor_lost(handle, f"stopping ({reason})")

    # ------------------------------------------------------------------ loss and migration

    def executor_lost(self, handle: ExecutorHandle, why: str, migrate: bool = True) -> None:
        """An executor died, stopped or forgot its state. Its requests migrate: the router
        holds every token of every request, so each is re-admitted on a live executor
        (recomputing prompt and output so far, reusing that executor's prefix cache) and
        its stream goes on with no duplicated or missing token (sampling is keyed on the
        output position). Only with no live executor that could fit it does a request end
        with UNAVAILABLE. With `migrate=False` (a failed step: the request may be what
        broke it) the requests fail."""
        if not handle.healthy:
            return
        handle.healthy = False
        log.warning("executor %s left: %s", handle.id, why)
        if handle.task is not None:
            handle.task.cancel()
        self.engine.pulls.source_lost(handle)  # requests pulling from it compute instead
        for plan in handle.in_flight:  # their tokens never come: a migrated request
            if not plan.future.done():  # resumes from the last token the router received
                plan.future.cancel()
        handle.in_flight.clear()
        self.engine.loras.executor_lost(handle)
        self.engine.weights.executor_lost(handle)
        groups = list(handle.scheduler.groups())
        for group in groups:
            handle.scheduler.remove(group)
        delivery = self.engine.delivery
        for group in groups:
            try:
                if migrate:
                    self.migrate(group, why)
                else:
                    delivery.fail(group, Unavailable(f"executor {handle.id} failed: {why}"))
            except Exception:  # one request's trouble must not strand the others
                log.exception("request %s: moving it off executor %s failed", group.request_id,
                              handle.id)
                delivery.fail(group, Unavailable(f"executor {handle.id} is gone ({why})"))
        self.engine.metrics.set_executors_healthy(self.engine.num_healthy())
        self.engine.metrics.forget_executor(handle.id)

    def migrate(self, group: RequestGroup, why: str) -> None:
        """Re-admit a request whose executor is gone on a live one; it keeps its priority
        and arrival order, its tokens so far, and skips the queue cap."""
        engine = self.engine
        need = engine.tokens_needed(group.spec)
        adapter = group.spec.lora_adapter
        fitting = [h for h in self.healthy() if h.kv.can_ever_fit(need)
                   and engine.loras.ready(h, adapter) and engine.weights.ready(h)]
        if group.aborted or group.request_id not in engine.live:
            return
        if not fitting:
            engine.delivery.fail(group, Unavailable(
                f"the executor running the request is gone ({why}) and no live executor "
                "can take it over"))
            return
        group.leave_executor()  # (a prefill executor's mark too: the plan that set it is gone)
        engine.place(group, fitting)
        engine.metrics.inc_migration()
        log.info("request %s migrated to executor %s", group.request_id, group.executor_id)
