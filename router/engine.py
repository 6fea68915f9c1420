"""The router core: admission and routing, and the parts that run each request after it.

    submit(spec) -> admit -> route (routing.choose) -> Scheduler.add        (this file)
    per executor:  schedule -> build_plan -> StepPlan ... StepResult -> tokens (step_loop.py)
    tokens -> text, stop strings -> stream; endings                          (delivery.py)
    executors joining, dying, leaving; migration of their requests         (membership.py)

`RouterEngine` implements the `Engine` interface the gRPC edge calls and owns the shared
state: the executors (`executors`, by id) and the live requests (`live`, by request id).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..grammar_vocab import GrammarVocab
from ..protos import wire
from .beam_search import BeamSearch
from .delivery import Delivery
from .detokenizer import TextAssembler
from .errors import AlreadyExists, InvalidRequest, QueueFull, Unavailable
from .executor_link import ExecutorLink
from .grammar_drafts import FormatDrafts
from .handoff import Handoffs, placeable
from .lora_registry import LoraRegistry
from .membership import ExecutorHandle, Membership
from .metrics import RouterMetrics
from .prefix_pull import Pulls
from .routing import RoutingPolicy, candidate, choose
from .scheduler import PreemptionMode, SchedulerConfig
from .sequence import OutputChannel, OutputSink, RequestGroup
from .speculative import SpeculativeConfig
from .step_loop import StepLoop
from .tokenizer import Tokenizer
from .types import (
    ClusterStatusData,
    ExecutorStatusData,
    ModelInfoData,
    RequestOutput,
    RequestSpec,
)
from .weight_sync import WeightSync

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
    enable_offloading: bool = False  # --kv-offloading-size > 0 (kvmanager/offload.py)
    preemption_mode: PreemptionMode = PreemptionMode.AUTO
    routing: RoutingPolicy = RoutingPolicy.PREFIX
    heartbeat_timeout_s: float = 2.0
    pipeline_depth: int = 2  # plans in flight per executor (1: one at a time; at most 4)
    step_timeout_s: float = 30.0  # a plan unanswered this long (plus its work) = dead
    hash_algo: str = "sha256"
    watermark: float = 0.01
    max_pinned_fraction: float = 0.25
    kv_pull: bool = False  # prefix pulls between executors (--kv-pull auto: prefix_pull.py)
    debug_checks: bool = False  # check KV invariants after every step (tests)
    # steady decodes planned as columns from this many running groups on (0: never; env
    # PAGEDSERVE_DECODE_LANE_MIN_RUNNING)
    decode_lane_min_running: int = SchedulerConfig.decode_lane_min_running
    invariant_check_interval_s: float = 5.0  # otherwise this often, per executor
    lora_adapters: tuple[str, ...] = ()  # every executor must serve these (--lora-modules)
    max_loras: int = 0  # adapter slots of every executor (--max-loras; lora_registry.py)
    lora_dir: str | None = None  # adapters loaded on demand from here (--lora-dir)
    speculative: SpeculativeConfig | None = None  # --speculative-config (None: off)
    tokenizer_json: str | None = None  # the model's (structured output's drafts)
    enable_weight_updates: bool = False  # weight updates and pauses (weight_sync.py)
    weight_version: str = "default"  # --weight-version: what /get_weight_version says first


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
        self.stopping = False  # stop() began: executors exiting now were told to
        self._arrivals = 0
        self._turn = 0
        self._reserved = 0  # queue places held by requests being tokenized
        self.link: ExecutorLink | None = None
        self._monitor: asyncio.Task | None = None
        self.registered = asyncio.Event()
        self.delivery = Delivery(self)
        self.membership = Membership(self)
        self.steps = StepLoop(self)
        self.loras = LoraRegistry(self, config.lora_adapters, config.max_loras,
                                  lora_dir=config.lora_dir)
        self.weights = WeightSync(self, config.enable_weight_updates, config.weight_version)
        self.handoffs = Handoffs(self)  # prefill/decode disaggregation (handoff.py)
        self.pulls = Pulls(self, config.kv_pull)  # prefix pulls (prefix_pull.py)
        # speculative decoding's drafts of the tokens structured output forces
        # (grammar_drafts.py): the vocabulary index is built in a thread from the start
        self.formats = FormatDrafts(GrammarVocab(config.tokenizer_json, model_info.vocab_size),
                                    self.eos_token_ids) \
            if config.speculative is not None and config.tokenizer_json else None
        if self.formats is not None:
            self.formats.ready()

    # ================================================================== lifecycle

    async def start(self, bind: str, allow_insecure: bool = False,
                    curve_keys: str | None = None) -> str:
        """Bind the executor socket (CURVE + ZAP with `curve_keys`, a keygen folder);
        raises ExecutorLinkError for a refused bind or unusable keys."""
        m = self.membership
        self.link = ExecutorLink(
            bind, on_hello=m.on_hello, on_heartbeat=m.on_heartbeat,
            on_result=self.steps.on_result, on_error=self.steps.on_error,
            on_goodbye=m.on_goodbye,
            allow_insecure=allow_insecure, curve_keys=curve_keys,
        )
        self.link.start()
        self._monitor = asyncio.get_running_loop().create_task(m.monitor_loop())
        return self.link.endpoint

    async def wait_for_executors(self, n: int, timeout_s: float | None = None) -> bool:
        async def _wait():
            while self.num_healthy() < n:
                self.registered.clear()
                await self.registered.wait()
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
        self.stopping = True
        if self._monitor is not None:
            self._monitor.cancel()
        for handle in self.executors.values():
            if handle.task is not None:
                handle.task.cancel()
            if shutdown_executors and handle.healthy and self.link is not None:
                self.link.send(handle.routing_id, wire.Shutdown(reason="router stopping"))
        await asyncio.sleep(0.05)
        if self.link is not None:
            await self.link.close()
        self.steps.close()
        if self.formats is not None:
            self.formats.close()

    # ================================================================== Engine protocol

    def _num_waiting(self) -> int:
        return sum(len(h.scheduler.waiting) for h in self.executors.values() if h.healthy)

    @property
    def num_admitted(self) -> int:
        """Requests admitted so far (the newest group's `arrival_seq`)."""
        return self._arrivals

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
        channel = OutputChannel()
        if spec.lora_adapter and spec.lora_adapter not in self.loras.names:
            try:  # --lora-dir: loaded on demand (lora_registry.py)
                await self.loras.resolve(spec.lora_adapter)
            except BaseException:
                if reserved:  # (the place is this request's whatever it raises)
                    self.release_slot()
                raise
        self.admit(spec, reserved, channel)
        return channel.open_stream(spec.request_id)

    def admit(self, spec: RequestSpec, reserved: bool = False,
              channel: OutputSink | None = None, text: bool = True) -> RequestGroup:
        """`submit` without the stream: the request is live and queued on return (raises as
        `submit` does). `channel` replaces the group's OutputChannel (an API worker's
        forwarding channel, edge_hub.py). `text=False`: deltas carry tokens and the token
        stops only; the API worker assembles text and finds stop strings
        (`finish_sample`)."""
        if reserved:  # the reserved place becomes this request's (or is given back)
            self.release_slot()
        if self.draining:
            raise Unavailable("the router is draining")
        if spec.request_id in self.live:
            raise AlreadyExists(f"request {spec.request_id!r} is already running")
        if not reserved and self._num_waiting() + self._reserved >= self.config.max_queue_len:
            raise QueueFull(f"the waiting queue is full ({self.config.max_queue_len} requests)")
        spec = self.loras.admitted(spec)
        healthy = [h for h in self.executors.values()
                   if h.healthy and self.weights.ready(h)]
        if not healthy:
            raise Unavailable("no executor is up")
        if spec.lora_adapter:  # an executor that joined since the load may not have it yet
            healthy = [h for h in healthy if self.loras.ready(h, spec.lora_adapter)]
            if not healthy:
                raise Unavailable(f"no executor has LoRA adapter {spec.lora_adapter!r} "
                                  "loaded")
        need = self.tokens_needed(spec)
        fitting = [h for h in healthy if h.kv.can_ever_fit(need)]
        if not fitting:
            raise InvalidRequest(
                f"the request needs about {need} tokens of KV cache (prompt, max_tokens and "
                f"n={spec.sampling.n}); no executor's cache could ever hold that"
            )
        assemblers = [
            TextAssembler(self.tokenizer, spec.sampling, spec.prompt_token_ids,
                          eos_token_ids=self.eos_token_ids,
                          max_model_len=self.config.max_model_len, text=text)
            for _ in range(spec.sampling.n)
        ]
        self._arrivals += 1
        group = RequestGroup(spec, assemblers, self._arrivals)
        if spec.sampling.beam is not None:
            group.beam = BeamSearch.start(group, self.info.vocab_size)
        if channel is not None:
            group.channel = channel
        self.place(group, fitting)
        self.live[spec.request_id] = group
        self.metrics.add_prompt_tokens(len(spec.prompt_token_ids))
        return group

    def abort_stream(self, request_id: str, stream) -> bool:
        """`abort`, only if `stream` (what `submit` returned) is the live request's: an edge
        leaving a request that already ended (aborted through the Abort RPC, say) must not
        abort a new request that took its id since."""
        group = self.live.get(request_id)
        if group is None or getattr(group.channel, "reader", None) is not stream:
            return False
        return self.abort(request_id)

    def abort(self, request_id: str) -> bool:
        group = self.live.get(request_id)
        if group is None:
            return False
        group.aborted = True
        handle = self.executors.get(group.executor_id or "")
        if handle is not None:
            handle.scheduler.remove(group)
            # The gauges follow in the step loop, which this wakes: computing them here, once
            # per abort, made a mass cancellation quadratic (each count walks every block
            # freed and not yet requeued): 256 streams at 1.9k tokens all free again after
            # 0.21-0.39 s, now 0.05-0.07 s (benchmarks/cancel_bench.py).
            handle.wakeup.set()
        for seq in group.seqs:
            seq.finished = True
            if not seq.assembler.finished:
                self.delivery.deliver(seq, seq.assembler.finish("abort"), (), (), "abort")
        self.delivery.complete(group)
        return True

    def finish_sample(self, request_id: str, index: int) -> bool:
        """An API worker found a stop string in sample `index`: the sample ends (its blocks
        freed; tokens sampled for it meanwhile are dropped) and, when it was the last, the
        request completes. False if the request or sample is not live."""
        group = self.live.get(request_id)
        if group is None or not 0 <= index < len(group.seqs) or group.aborted:
            return False
        handle = self.executors.get(group.executor_id or "")
        return self.delivery.finish_by_edge(handle, group.seqs[index])

    def model_info(self) -> ModelInfoData:
        """ModelInfo; its dtype is what the live executors compute in (each registers
        its own: `--dtype auto` may run float32 on a CPU without native bfloat16), joined
        with "," if they differ; the router's reading of config.json before any joins. Its
        LoRA adapters are those requests may name now."""
        info = self.info
        if info.lora_adapters != self.loras.names:
            info = dataclasses.replace(info, lora_adapters=self.loras.names)
        dtypes = sorted({h.hello.dtype for h in self.executors.values() if h.healthy})
        if not dtypes or dtypes == [info.dtype]:
            return info
        return dataclasses.replace(info, dtype=",".join(dtypes))

    @property
    def lora_adapters(self) -> tuple[str, ...]:
        """The LoRA adapters a request may name now (--lora-modules, then those loaded)."""
        return self.loras.names

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Load a LoRA adapter on every executor (lora_registry.py); raises as it does."""
        await self.loras.load(name, path)

    async def resolve_lora_adapter(self, name: str) -> bool:
        """--lora-dir: load adapter ``name`` on demand if it is one of the folder's."""
        return await self.loras.resolve(name)

    async def unload_lora_adapter(self, name: str) -> int:
        """Stop serving a loaded LoRA adapter; its live requests finish with it."""
        return self.loras.unload(name)

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

    def tokens_needed(self, spec: RequestSpec) -> int:
        """KV tokens a request may need at its peak: the prompt once, and each sample's
        output in blocks of its own (plus the partly shared last prompt block)."""
        bs = self.config.block_size
        n = spec.sampling.n
        prompt_blocks = -(-len(spec.prompt_token_ids) // bs)
        out_blocks = -(-spec.sampling.max_tokens // bs) + (1 if n > 1 else 0)
        return (prompt_blocks + n * out_blocks) * bs

    def place(self, group: RequestGroup, handles: list[ExecutorHandle]) -> None:
        """Route a group to an executor (the cost rule above `routing.choose`), pin its
        cached prefix there and queue it (the scheduler intends its prompt there); start
        the prefix pull routing chose, if any (prefix_pull.py). With prefill executors
        up, decode executors take none (handoff.py), but may be a pull's source: the
        last answer of a conversation was decoded there."""
        handles, others = placeable(handles)
        sources = others if self.pulls.enabled else []
        seq0 = group.seqs[0]
        salt = group.spec.cache_salt or None
        kv0 = handles[0].kv
        kv0.hash_blocks(seq0.token_ids, salt, seq0.block_hashes)
        describe = self.pulls.describe
        candidates, source_candidates = (
            [describe(candidate(h.id, h.kv, h.scheduler), h) for h in hs]
            for hs in (handles, sources))
        decision = choose(self.config.routing, candidates, seq0.token_ids, seq0.block_hashes,
                          salt, self._turn, source_candidates)
        self._turn += 1
        handle = handles[decision.index]
        if decision.hit.block_ids:
            group.pinned_tokens = handle.kv.pin(seq0.seq_id, decision.hit).num_tokens
        group.executor_id = handle.id
        log.debug("request %s -> executor %s (cached prefix %d tokens)", group.request_id,
                  handle.id, group.pinned_tokens)
        handle.scheduler.add(group)
        if decision.pull_source is not None:
            self.pulls.start(group, [*handles, *sources][decision.pull_source], handle,
                             decision)
        handle.wakeup.set()

    # ================================================================== metrics

    def update_gauges(self, handle: ExecutorHandle) -> None:
        """Executor gauges from its KV manager: once per applied result and when its step loop
        wakes idle (after aborts and edge stops), never once per request (see abort). A
        lost executor has none (metrics.forget_executor)."""
        if not handle.healthy:
            return
        st = handle.kv.stats()
        s = handle.scheduler
        self.metrics.set_executor_gauges(
            handle.id, running=len(s.running), waiting=len(s.waiting), swapped=len(s.swapped),
            num_gpu_blocks=st.gpu.num_total_blocks, num_free_gpu_blocks=st.gpu.num_free_blocks,
            num_cpu_blocks=st.cpu.num_total_blocks, num_free_cpu_blocks=st.cpu.num_free_blocks,
            num_leaked_blocks=handle.num_leaked_blocks,
        )


    # ================================================================== executors

    def executor_exited(self, executor_id: str, returncode: int | None) -> None:
        """`serve` saw an executor's process exit: it is dead now, not after the timeout."""
        self.membership.executor_exited(executor_id, returncode)
