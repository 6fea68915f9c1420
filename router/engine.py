"""The router core: admission, routing, one step loop per executor, results to streams.

    submit(spec) -> admit -> route (routing.choose) -> Scheduler.add
    per executor:  schedule -> build_plan -> send StepPlan ... StepResult -> apply -> stream

Each executor has its own asyncio task running its step loop, so a slow executor never
stalls another. The loop is ordered so the executor waits least: when a StepResult
arrives the sampled tokens are appended and the cheap stops (EOS, stop ids, max_tokens,
max_model_len) applied, the next plan is built and sent, and only then is the text work
done (detokenization, stop strings, deltas to the streams). A stop string found then has
cost at most one wasted token, which is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..kvmanager import KVCacheManager
from ..protos import wire
from .detokenizer import TextAssembler
from .errors import AlreadyExists, InvalidRequest, QueueFull, Unavailable
from .executor_link import ExecutorLink
from .metrics import RouterMetrics
from .plan_builder import build_plan
from .routing import Candidate, RoutingPolicy, choose
from .scheduler import PreemptionMode, Scheduler, SchedulerConfig
from .sequence import GroupStatus, RequestGroup, Sequence
from .tokenizer import Tokenizer
from .types import (
    ClusterStatusData,
    CompletionDelta,
    ExecutorStatusData,
    ModelInfoData,
    RequestOutput,
    RequestSpec,
    TokenLogprob,
)

log = logging.getLogger("pagedserve.router")


@dataclass
class EngineConfig:
    model_fingerprint: str
    block_size: int = 16
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_queue_len: int = 1024
    enable_prefix_caching: bool = True
    preemption_mode: PreemptionMode = PreemptionMode.AUTO
    routing: RoutingPolicy = RoutingPolicy.PREFIX
    heartbeat_timeout_s: float = 2.0
    hash_algo: str = "sha256"
    watermark: float = 0.01
    max_pinned_fraction: float = 0.25
    debug_checks: bool = False  # check KV invariants after every step (tests)
    invariant_check_interval_s: float = 5.0  # otherwise this often, per executor


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
    pending: asyncio.Future | None = None
    pending_step: int = -1
    step_id: int = 0
    task: asyncio.Task | None = None
    prefix_seen: tuple[int, int] = (0, 0)  # (queries, hits) already counted in metrics
    last_check: float = 0.0  # when the KV invariants were last verified
    blocks_moved_in_flight: int = 0  # swapped out + in by the plan in flight (cost model)
    tokens_in_flight: int = 0  # tokens computed by the plan in flight (cost model)
    num_leaked_blocks: int = 0

    @property
    def id(self) -> str:
        return self.hello.executor_id


class RouterEngine:
    """Implements `router.types.Engine` over ZeroMQ-connected executors."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, model_info: ModelInfoData,
                 metrics: RouterMetrics | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.info = model_info
        self.eos_token_ids = tuple(model_info.eos_token_ids)
        self.metrics = metrics or RouterMetrics()
        self.executors: dict[str, ExecutorHandle] = {}
        self.live: dict[str, RequestGroup] = {}
        self.draining = False
        self._arrivals = 0
        self._turn = 0
        self._reserved = 0  # queue places held by requests being tokenized
        self._link: ExecutorLink | None = None
        self._monitor: asyncio.Task | None = None
        self._registered = asyncio.Event()

    # ================================================================== lifecycle

    async def start(self, bind: str, allow_insecure: bool = False,
                    curve_keys: str | None = None) -> str:
        """Bind the executor socket (CURVE + ZAP with `curve_keys`, a keygen folder);
        raises ExecutorLinkError for a refused bind or unusable keys."""
        self._link = ExecutorLink(
            bind, on_hello=self._on_hello, on_heartbeat=self._on_heartbeat,
            on_result=self._on_result, on_error=self._on_error, on_goodbye=self._on_goodbye,
            allow_insecure=allow_insecure, curve_keys=curve_keys,
        )
        self._link.start()
        self._monitor = asyncio.get_running_loop().create_task(self._monitor_loop())
        return self._link.endpoint

    async def wait_for_executors(self, n: int, timeout_s: float | None = None) -> bool:
        async def _wait():
            while self.num_healthy() < n:
                self._registered.clear()
                await self._registered.wait()
        try:
            await asyncio.wait_for(_wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    async def drain(self, timeout_s: float) -> None:
        """Stop taking requests, let running ones finish for up to `timeout_s`, abort the
        rest (their streams end with finish_reason ABORT)."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self.live):
            self.abort(request_id)
        await asyncio.sleep(0)

    async def stop(self, shutdown_executors: bool = False) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        for handle in self.executors.values():
            if handle.task is not None:
                handle.task.cancel()
            if shutdown_executors and handle.healthy and self._link is not None:
                self._link.send(handle.routing_id, wire.Shutdown(reason="router stopping"))
        await asyncio.sleep(0.05)
        if self._link is not None:
            await self._link.close()

    # ================================================================== Engine protocol

    def _num_waiting(self) -> int:
        return sum(len(h.scheduler.waiting) for h in self.executors.values() if h.healthy)

    def reserve_slot(self) -> None:
        """Hold a place in the waiting queue before the request is tokenized (the edge calls
        it first, so a burst of long prompts cannot all tokenize and then overflow the
        queue). Raises QueueFull or Unavailable; `submit(..., reserved=True)` consumes the
        place, `release_slot()` gives it back."""
        if self.draining:
            raise Unavailable("the router is draining")
        if self._num_waiting() + self._reserved >= self.config.max_queue_len:
            raise QueueFull(f"the waiting queue is full ({self.config.max_queue_len} requests)")
        self._reserved += 1

    def release_slot(self) -> None:
        self._reserved = max(0, self._reserved - 1)

    async def submit(self, spec: RequestSpec,
                     reserved: bool = False) -> AsyncIterator[RequestOutput]:
        if reserved:  # the reserved place becomes this request's (or is given back)
            self.release_slot()
        if self.draining:
            raise Unavailable("the router is draining")
        if spec.request_id in self.live:
            raise AlreadyExists(f"request {spec.request_id!r} is already running")
        if not reserved and self._num_waiting() + self._reserved >= self.config.max_queue_len:
            raise QueueFull(f"the waiting queue is full ({self.config.max_queue_len} requests)")
        healthy = [h for h in self.executors.values() if h.healthy]
        if not healthy:
            raise Unavailable("no executor is up")
        need = self._tokens_needed(spec)
        fitting = [h for h in healthy if h.kv.can_ever_fit(need)]
        if not fitting:
            raise InvalidRequest(
                f"the request needs about {need} tokens of KV cache (prompt, max_tokens and "
                f"n={spec.sampling.n}); no executor's cache could ever hold that"
            )
        assemblers = [
            TextAssembler(self.tokenizer, spec.sampling, spec.prompt_token_ids,
                          eos_token_ids=self.eos_token_ids,
                          max_model_len=self.config.max_model_len)
            for _ in range(spec.sampling.n)
        ]
        self._arrivals += 1
        group = RequestGroup(spec, assemblers, self._arrivals)
        self._place(group, fitting)
        self.live[spec.request_id] = group
        self.metrics.add_prompt_tokens(len(spec.prompt_token_ids))
        return group.channel.stream(spec.request_id)

    def abort(self, request_id: str) -> bool:
        group = self.live.get(request_id)
        if group is None:
            return False
        group.aborted = True
        handle = self.executors.get(group.executor_id or "")
        if handle is not None:
            handle.scheduler.remove(group)
            self._update_gauges(handle)
            handle.wakeup.set()
        for seq in group.seqs:
            seq.finished = True
            if not seq.assembler.finished:
                self._deliver(seq, seq.assembler.finish("abort"), (), (), "abort")
        self._complete(group)
        return True

    def model_info(self) -> ModelInfoData:
        return self.info

    def cluster_status(self) -> ClusterStatusData:
        rows, queries, hits = [], 0, 0
        for h in self.executors.values():
            st = h.kv.stats()
            queries += st.prefix_query_tokens
            hits += st.prefix_hit_tokens
            rows.append(ExecutorStatusData(
                id=h.id, device=h.hello.device, healthy=h.healthy,
                num_gpu_blocks=st.gpu.num_total_blocks, num_free_gpu_blocks=st.gpu.num_free_blocks,
                num_cpu_blocks=st.cpu.num_total_blocks, num_free_cpu_blocks=st.cpu.num_free_blocks,
                running=len(h.scheduler.running), waiting=len(h.scheduler.waiting),
                swapped=len(h.scheduler.swapped),
            ))
        return ClusterStatusData(tuple(rows), queries, hits)

    def is_serving(self) -> bool:
        return not self.draining and self.num_healthy() > 0

    def num_healthy(self) -> int:
        return sum(1 for h in self.executors.values() if h.healthy)

    # ================================================================== admission/routing

    def _tokens_needed(self, spec: RequestSpec) -> int:
        """KV tokens a request may need at its peak: the prompt once, and each sample's
        output in blocks of its own (plus the partly shared last prompt block)."""
        bs = self.config.block_size
        n = spec.sampling.n
        prompt_blocks = -(-len(spec.prompt_token_ids) // bs)
        out_blocks = -(-spec.sampling.max_tokens // bs) + (1 if n > 1 else 0)
        return (prompt_blocks + n * out_blocks) * bs

    def _place(self, group: RequestGroup, handles: list[ExecutorHandle]) -> None:
        """Route a group to an executor, pin its cached prefix there, queue it."""
        seq0 = group.seqs[0]
        salt = group.spec.cache_salt or None
        kv0 = handles[0].kv
        kv0.hash_blocks(seq0.token_ids, salt, seq0.block_hashes)
        candidates = [
            Candidate(h.id, h.kv, h.scheduler.num_queued_tokens(),
                      len(h.scheduler.running) + len(h.scheduler.waiting)
                      + len(h.scheduler.swapped))
            for h in handles
        ]
        decision = choose(self.config.routing, candidates, seq0.token_ids, seq0.block_hashes,
                          salt, self._turn)
        self._turn += 1
        handle = handles[decision.index]
        if decision.hit.block_ids:
            group.pinned_tokens = handle.kv.pin(seq0.seq_id, decision.hit).num_tokens
        group.executor_id = handle.id
        log.debug("request %s -> executor %s (cached prefix %d tokens)", group.request_id,
                  handle.id, group.pinned_tokens)
        handle.scheduler.add(group)
        handle.wakeup.set()

    # ================================================================== executors

    def _on_hello(self, routing_id: bytes, hello: wire.Hello) -> wire.Welcome:
        reason = ""
        if hello.protocol_version != wire.PROTOCOL_VERSION:
            reason = f"protocol version {hello.protocol_version}, router speaks " \
                     f"{wire.PROTOCOL_VERSION}"
        elif hello.model_fingerprint != self.config.model_fingerprint:
            reason = "a different model (config.json fingerprint differs from the router's)"
        elif hello.block_size != self.config.block_size:
            reason = f"block size {hello.block_size}, the router uses {self.config.block_size}"
        elif hello.num_gpu_blocks <= 0:
            reason = "no KV-cache blocks"
        elif hello.max_model_len < self.config.max_model_len:
            reason = (f"max_model_len {hello.max_model_len} is below the router's "
                      f"{self.config.max_model_len} (start both with the same --max-model-len)")
        if reason:
            log.warning("refused executor %s: %s", hello.executor_id, reason)
            return wire.Welcome(executor_id=hello.executor_id, accepted=False, reason=reason)
        old = self.executors.get(hello.executor_id)
        cfg = self.config
        kv = KVCacheManager(
            hello.num_gpu_blocks, hello.num_cpu_blocks, hello.block_size,
            enable_prefix_caching=cfg.enable_prefix_caching, hash_algo=cfg.hash_algo,
            watermark=cfg.watermark, max_pinned_fraction=cfg.max_pinned_fraction,
        )
        sched = Scheduler(kv, SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=cfg.max_model_len, preemption_mode=cfg.preemption_mode,
        ))
        handle = ExecutorHandle(hello=hello, routing_id=routing_id, kv=kv, scheduler=sched)
        self.executors[hello.executor_id] = handle
        handle.task = asyncio.get_running_loop().create_task(self._step_loop(handle))
        if old is not None:  # it re-registered with an empty cache (router loss, restart)
            self._executor_lost(old, "re-registered with an empty cache")
        log.info("executor %s joined: device=%s dtype=%s blocks=%d cpu_blocks=%d",
                 hello.executor_id, hello.device, hello.dtype, hello.num_gpu_blocks,
                 hello.num_cpu_blocks)
        self.metrics.set_executors_healthy(self.num_healthy())
        self._update_gauges(handle)
        self._registered.set()
        return wire.Welcome(executor_id=hello.executor_id, accepted=True)

    def _on_heartbeat(self, executor_id: str) -> bool:
        handle = self.executors.get(executor_id)
        if handle is None or not handle.healthy:
            return False
        handle.last_seen = time.monotonic()
        return True

    def _on_result(self, executor_id: str, result: wire.StepResult) -> bool:
        handle = self.executors.get(executor_id)
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

    def _on_error(self, executor_id: str, report: wire.ErrorReport) -> bool:
        handle = self.executors.get(executor_id)
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

    async def _monitor_loop(self) -> None:
        timeout = self.config.heartbeat_timeout_s
        while True:
            await asyncio.sleep(min(0.1, timeout / 4))
            now = time.monotonic()
            for handle in list(self.executors.values()):
                if handle.healthy and now - handle.last_seen > timeout:
                    try:
                        self._executor_lost(handle, f"silent for {now - handle.last_seen:.1f} s")
                    except Exception:  # the monitor must outlive any bug in one loss
                        log.exception("handling the loss of executor %s failed", handle.id)

    def executor_exited(self, executor_id: str, returncode: int | None) -> None:
        """`serve` saw an executor's process exit: it is dead now, not after the timeout."""
        handle = self.executors.get(executor_id)
        if handle is not None:
            self._executor_lost(handle, f"process exited with code {returncode}")

    def _on_goodbye(self, executor_id: str, reason: str) -> None:
        """The executor is stopping (SIGTERM, scale-down): move its requests now."""
        handle = self.executors.get(executor_id)
        if handle is not None:
            self._executor_lost(handle, f"stopping ({reason})")

    def _executor_lost(self, handle: ExecutorHandle, why: str, migrate: bool = True) -> None:
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
        if handle.pending is not None and not handle.pending.done():
            handle.pending.cancel()
        groups = list(handle.scheduler.groups())
        for group in groups:
            handle.scheduler.remove(group)
        for group in groups:
            try:
                if migrate:
                    self._migrate(group, why)
                else:
                    self._fail(group, Unavailable(f"executor {handle.id} failed: {why}"))
            except Exception:  # one request's trouble must not strand the others
                log.exception("request %s: moving it off executor %s failed", group.request_id,
                              handle.id)
                self._fail(group, Unavailable(f"executor {handle.id} is gone ({why})"))
        self.metrics.set_executors_healthy(self.num_healthy())

    def _migrate(self, group: RequestGroup, why: str) -> None:
        """Re-admit a request whose executor is gone on a live one; it keeps its priority
        and arrival order, its tokens so far, and skips the queue cap."""
        healthy = [h for h in self.executors.values() if h.healthy]
        need = self._tokens_needed(group.spec)
        fitting = [h for h in healthy if h.kv.can_ever_fit(need)]
        if group.aborted or group.request_id not in self.live:
            return
        if not fitting:
            self._fail(group, Unavailable(f"the executor running the request is gone ({why}) "
                                          "and no live executor can take it over"))
            return
        for seq in group.seqs:
            seq.num_computed_tokens = 0
            seq.on_executor = False
        group.pinned_tokens = 0
        self._place(group, fitting)
        self.metrics.inc_migration()
        log.info("request %s migrated to executor %s", group.request_id, group.executor_id)

    # ================================================================== step loop

    async def _step_loop(self, handle: ExecutorHandle) -> None:
        """schedule -> plan -> send; result -> tokens/cheap stops -> next plan -> text."""
        result: wire.StepResult | None = None
        try:
            while handle.healthy:
                touched: list[Sequence] = []
                if result is not None:
                    touched = self._apply_tokens(handle, result)
                future = self._send_next_plan(handle)
                if result is not None:
                    self._text_stage(handle, touched)
                    self._update_gauges(handle)
                result = None
                if future is None:
                    self._update_gauges(handle)  # aborts may have freed blocks since
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
                    self._step_failed(handle, str(exc))
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("step loop of executor %s failed", handle.id)
            self._executor_lost(handle, "router-side step loop error", migrate=False)

    @staticmethod
    def _has_work(handle: ExecutorHandle) -> bool:
        s = handle.scheduler
        return bool(s.running or s.waiting or s.swapped)

    def _send_next_plan(self, handle: ExecutorHandle) -> asyncio.Future | None:
        sched = handle.scheduler
        out = sched.schedule()
        for group, mode in out.preempted:
            self.metrics.inc_preemption(handle.id, mode.value)
            log.debug("request %s preempted (%s) on %s", group.request_id, mode.value, handle.id)
        try:
            if out.empty:
                return None
            handle.step_id += 1
            plan = build_plan(handle.step_id, out, handle.kv, self.eos_token_ids)
        finally:
            handle.kv.end_step()
        self._check_accounting(handle)
        future = asyncio.get_running_loop().create_future()
        handle.pending, handle.pending_step = future, handle.step_id
        assert self._link is not None
        self._link.send(handle.routing_id, plan)
        handle.blocks_moved_in_flight = int(plan.swap_out.shape[0] + plan.swap_in.shape[0])
        handle.tokens_in_flight = out.num_tokens
        self._prefix_metrics(handle)
        return future

    def _apply_tokens(self, handle: ExecutorHandle, result: wire.StepResult) -> list[Sequence]:
        """Append sampled tokens and apply the cheap stops; returns the sequences that got a
        token (for the text stage). A sequence that stopped is freed at once."""
        sched = handle.scheduler
        self.metrics.observe_step_forward(handle.id, result.forward_s)
        if result.swap_s > 0:
            sched.cost.observe_swap(handle.blocks_moved_in_flight, result.swap_s)
        if result.forward_s > 0:  # steps of >= 32 tokens teach the recompute rate
            sched.cost.observe_prefill(handle.tokens_in_flight, result.forward_s)
        for err in result.errors:
            self._request_error(handle, err)
        touched: list[Sequence] = []
        if not result.request_ids:
            return touched
        tokens = result.token_ids.tolist()
        lps = result.logprobs
        top_counts = result.top_counts
        top_ofs = 0
        max_len = self.config.max_model_len
        for i, seq_id in enumerate(result.request_ids):
            k = int(top_counts[i]) if top_counts is not None else 0
            request_id, _, index = seq_id.rpartition("#")
            group = self.live.get(request_id)
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
                tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.eos_token_ids)))
            if stop or n_out >= sp.max_tokens or len(seq.token_ids) >= max_len:
                sched.finish_seq(seq)
        return touched

    def _text_stage(self, handle: ExecutorHandle, touched: list[Sequence]) -> None:
        """Detokenize, match stop strings, push deltas; finish groups that are done."""
        done_groups: list[RequestGroup] = []
        for seq in touched:
            group = seq.group
            if group.aborted or seq.assembler.finished:
                continue
            start = seq.num_prompt_tokens + seq.num_delivered
            new_ids = seq.token_ids[start:]
            text_parts: list[str] = []
            delivered: list[int] = []
            update = None
            for tok in new_ids:
                update = seq.assembler.append(tok)
                delivered.append(tok)
                text_parts.append(update.text)
                if update.finished:
                    break
            seq.num_delivered += len(delivered)
            lps = tuple(seq.logprobs[: len(delivered)])
            del seq.logprobs[: len(delivered)]
            if update is not None and update.finished:
                if not seq.finished:
                    handle.scheduler.finish_seq(seq)  # a stop string: at most one token wasted
                self._deliver(seq, "".join(text_parts), tuple(delivered), lps,
                              update.finish_reason, update.stop_string, update.stop_token_id)
                if group.all_finished:
                    done_groups.append(group)
            else:
                self._deliver(seq, "".join(text_parts), tuple(delivered), lps, None)
        for group in done_groups:
            if group.request_id in self.live:
                handle.scheduler.remove(group)
                self._complete(group)

    def _deliver(self, seq: Sequence, text: str, token_ids: tuple, logprobs: tuple,
                 finish_reason, stop_string=None, stop_token_id=None) -> None:
        """Hand one sample's new text/tokens to its request's stream. (TTFT, inter-token
        latency and the other client-facing latencies are measured by the gRPC edge when
        the stream hands them to the client.)"""
        group = seq.group
        if token_ids:
            if group.first_token_time is None:
                group.first_token_time = time.monotonic()
            self.metrics.add_generation_tokens(len(token_ids))
        group.channel.put(CompletionDelta(
            index=seq.index, text=text, token_ids=token_ids, logprobs=logprobs,
            finish_reason=finish_reason, stop_string=stop_string, stop_token_id=stop_token_id,
        ))

    def _complete(self, group: RequestGroup) -> None:
        """Every sample finished: the final item with usage; forget the request."""
        if self.live.pop(group.request_id, None) is None:
            return
        group.channel.finish(group.usage())
        if group.first_scheduled_time is not None:
            self.metrics.observe_queue_time(group.first_scheduled_time - group.arrival_time)

    def _fail(self, group: RequestGroup, error: Exception) -> None:
        handle = self.executors.get(group.executor_id or "")
        if handle is not None and group.status is not GroupStatus.FINISHED:
            handle.scheduler.remove(group)
        for seq in group.seqs:
            seq.finished = True
        if self.live.pop(group.request_id, None) is not None:
            group.channel.fail(error)  # the edge maps it to a status and counts the failure

    def _request_error(self, handle: ExecutorHandle, err: wire.RequestError) -> None:
        if not err.request_id:
            log.error("executor %s failed a step: %s", handle.id, err.message)
            self._step_failed(handle, err.message)
            return
        group = self.live.get(err.request_id.rsplit("#", 1)[0])
        log.error("executor %s: request %s failed: %s", handle.id, err.request_id, err.message)
        if group is not None:
            self._fail(group, Unavailable(f"the executor failed the request: {err.message}"))

    def _step_failed(self, handle: ExecutorHandle, message: str) -> None:
        """A whole step failed on the executor: what its cache holds is unknown now, so its
        requests end (UNAVAILABLE) and it is told to forget everything and register again
        (with an empty cache and a fresh KV manager here)."""
        if self._link is not None:
            self._link.send(handle.routing_id,
                            wire.Shutdown(reason=f"step failed: {message}", exit=False))
        self._executor_lost(handle, f"failed a step: {message}", migrate=False)

    # ================================================================== accounting

    def _check_accounting(self, handle: ExecutorHandle) -> None:
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

    # ================================================================== metrics

    def _prefix_metrics(self, handle: ExecutorHandle) -> None:
        kv = handle.kv
        q, h = kv.prefix_query_tokens, kv.prefix_hit_tokens
        dq, dh = q - handle.prefix_seen[0], h - handle.prefix_seen[1]
        if dq or dh:
            self.metrics.add_prefix_cache(handle.id, dq, dh)
            handle.prefix_seen = (q, h)

    def _update_gauges(self, handle: ExecutorHandle) -> None:
        st = handle.kv.stats()
        s = handle.scheduler
        self.metrics.set_executor_gauges(
            handle.id, running=len(s.running), waiting=len(s.waiting), swapped=len(s.swapped),
            num_gpu_blocks=st.gpu.num_total_blocks, num_free_gpu_blocks=st.gpu.num_free_blocks,
            num_cpu_blocks=st.cpu.num_total_blocks, num_free_cpu_blocks=st.cpu.num_free_blocks,
            num_leaked_blocks=handle.num_leaked_blocks,
        )

