"""Router metrics (DESIGN §5), on a per-router CollectorRegistry, served at /metrics.

Who records what:

* the API edges, through frontend.py (one place for gRPC and HTTP): request success/failure
  (label `api`), time to first token, inter-token latency (when a token is handed to the
  client), time per output token, end-to-end latency;
* the engine: queue time (arrival → first scheduled), prompt/generation token counts, executor
  gauges, prefix-cache counters, preemptions, migrations, healthy executors, step forward time.

Metric names are the contract; do not rename.
"""

from __future__ import annotations

import bisect
import contextlib
from typing import Any, NamedTuple

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import start_http_server

# Latency buckets in seconds: DESIGN §5's list (0.1 ms … 10 s), then a longer tail for
# queue/TTFT/e2e (requests can wait and run for minutes).
LATENCY_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075,
    0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0, 10.0,
)
# The executor's idle time between steps (gap_s): from 0.01 ms, where pipelining lives.
GAP_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
                 0.1, 0.25, 0.5, 1.0)
REQUEST_BUCKETS_S = LATENCY_BUCKETS_S + (20.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# The edge's histogram methods and their histograms (`observe_many` replays them in bulk).
EDGE_HISTOGRAMS = {
    "observe_ttft": "time_to_first_token",
    "observe_inter_token": "inter_token_latency",
    "observe_time_per_output_token": "time_per_output_token",
    "observe_e2e": "e2e_request_latency",
}

FINISH_REASONS = ("length", "stop", "abort")
PREEMPTION_MODES = ("recompute", "swap")
APIS = ("grpc", "http")


class _ExecutorChildren(NamedTuple):
    """One executor's children of the per-step metrics (RouterMetrics._children)."""

    running: Any
    waiting: Any
    swapped: Any
    blocks_total: Any
    blocks_free: Any
    usage: Any
    cpu_blocks_total: Any
    cpu_blocks_free: Any
    blocks_leaked: Any
    step_forward: Any
    gap: Any


class RouterMetrics:
    """Every §5 metric of one router. Thread-safe (prometheus_client is)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        ex = ["executor"]
        self.requests_running = Gauge("pagedserve_requests_running", "Requests running, per executor.", ex, registry=r)
        self.requests_waiting = Gauge("pagedserve_requests_waiting", "Requests waiting, per executor.", ex, registry=r)
        self.requests_swapped = Gauge("pagedserve_requests_swapped", "Requests swapped to CPU, per executor.", ex, registry=r)
        self.kv_blocks_total = Gauge("pagedserve_kv_blocks_total", "Device KV blocks in all.", ex, registry=r)
        self.kv_blocks_free = Gauge("pagedserve_kv_blocks_free", "Device KV blocks held by no request (free or cached and evictable).", ex, registry=r)
        self.kv_cache_usage_ratio = Gauge("pagedserve_kv_cache_usage_ratio", "Fraction of device KV blocks held by requests.", ex, registry=r)
        self.kv_cpu_blocks_total = Gauge("pagedserve_kv_cpu_blocks_total", "CPU swap blocks in all.", ex, registry=r)
        self.kv_cpu_blocks_free = Gauge("pagedserve_kv_cpu_blocks_free", "CPU swap blocks not in use.", ex, registry=r)
        self.kv_blocks_leaked = Gauge("pagedserve_kv_blocks_leaked", "Device blocks held by no live request and not free (should be 0).", ex, registry=r)
        self.prefix_cache_queries = Counter("pagedserve_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", ex, registry=r)
        self.prefix_cache_hits = Counter("pagedserve_prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", ex, registry=r)
        self.prefix_cache_cpu_hits = Counter("pagedserve_prefix_cache_cpu_hits_total", "Of the prefix-cache hits, tokens swapped in from CPU blocks (--kv-offloading-size).", ex, registry=r)
        self.kv_offloaded_blocks = Counter("pagedserve_kv_offloaded_blocks_total", "Device blocks copied to CPU blocks to stay in the prefix cache (--kv-offloading-size).", ex, registry=r)
        self.preemptions = Counter("pagedserve_preemptions_total", "Preemptions, per executor and mode.", ["executor", "mode"], registry=r)
        self.migrations = Counter("pagedserve_migrations_total", "Requests moved to another executor.", registry=r)
        self.handoffs = Counter("pagedserve_handoffs_total", "Prefill/decode disaggregation: requests a prefill executor handed to a decode executor after their prompt (--disaggregation-mode).", ex, registry=r)
        self.kv_blocks_received = Counter("pagedserve_kv_blocks_received_total", "KV blocks an executor received from another (prefill/decode disaggregation, prefix pulls), instead of computing them.", ex, registry=r)
        self.kv_pulls = Counter("pagedserve_kv_pulls_total", "Prefix pulls: requests an executor received blocks of their prompt for from another executor's cache instead of computing them (--kv-pull), by the receiving executor.", ex, registry=r)
        self.spec_drafts = Counter("pagedserve_spec_decode_num_drafts_total", "Speculative decoding: decode rows sent with drafts.", ex, registry=r)
        self.spec_draft_tokens = Counter("pagedserve_spec_decode_num_draft_tokens_total", "Speculative decoding: draft tokens sent.", ex, registry=r)
        self.spec_accepted_tokens = Counter("pagedserve_spec_decode_num_accepted_tokens_total", "Speculative decoding: draft tokens the sampler confirmed.", ex, registry=r)
        self.api_worker_restarts = Counter("pagedserve_api_worker_restarts_total", "API worker processes (--api-workers) that died and were started again.", registry=r)
        self.prompt_tokens = Counter("pagedserve_prompt_tokens_total", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter("pagedserve_generation_tokens_total", "Generated tokens.", registry=r)
        self.request_success = Counter("pagedserve_request_success_total", "Finished samples, by finish reason and API.", ["finish_reason", "api"], registry=r)
        self.request_failure = Counter("pagedserve_request_failure_total", "Requests that ended with a non-OK status, by gRPC status name (HTTP errors too) and API.", ["code", "api"], registry=r)
        self.executors_healthy = Gauge("pagedserve_executors_healthy", "Executors registered and heartbeating.", registry=r)
        self.lora_adapters = Gauge("pagedserve_lora_adapters", "LoRA adapters requests may name (--lora-modules and those loaded while serving).", registry=r)
        self.lora_slots = Gauge("pagedserve_lora_adapter_slots", "LoRA adapter slots of each executor (--max-loras; 0: no loading while serving).", registry=r)
        self.weight_updates = Counter("pagedserve_weight_updates_total", "Weight updates while serving (/update_weights_from_disk), by outcome: loaded, refused (nothing changed), failed (an executor lost or none left).", ["outcome"], registry=r)
        self.responses_stored = Gauge("pagedserve_responses_stored", "Responses kept for previous_response_id, GET /v1/responses/{id} and background runs (--responses-store-mb).", registry=r)
        self.responses_stored_bytes = Gauge("pagedserve_responses_stored_bytes", "Bytes of the stored Responses (records and background streams' events).", registry=r)
        self.responses_dropped = Counter("pagedserve_responses_dropped_total", "Stored Responses dropped to fit --responses-store-mb (least recently used first; a later read is a 404).", registry=r)
        self.generation_held = Gauge("pagedserve_generation_held", "1 while new requests are held (a weight update, or /pause_generation until /continue_generation).", registry=r)
        self.time_to_first_token = Histogram("pagedserve_time_to_first_token_seconds", "Arrival to first token handed out.", buckets=REQUEST_BUCKETS_S, registry=r)
        self.inter_token_latency = Histogram("pagedserve_inter_token_latency_seconds", "Time between tokens handed to a request's client.", buckets=LATENCY_BUCKETS_S, registry=r)
        self.time_per_output_token = Histogram("pagedserve_time_per_output_token_seconds", "Per request: (e2e - TTFT) / (output tokens - 1).", buckets=LATENCY_BUCKETS_S, registry=r)
        self.e2e_request_latency = Histogram("pagedserve_e2e_request_latency_seconds", "Arrival to the request's last output.", buckets=REQUEST_BUCKETS_S, registry=r)
        self.queue_time = Histogram("pagedserve_queue_time_seconds", "Arrival to first scheduled.", buckets=REQUEST_BUCKETS_S, registry=r)
        self.step_forward = Histogram("pagedserve_step_forward_seconds", "Executor model forward time per step (forward_s).", ex, buckets=LATENCY_BUCKETS_S, registry=r)
        self.executor_gap = Histogram("pagedserve_executor_gap_seconds", "Executor idle time before a step's forward (gap_s: waiting for the plan, decoding, preparing inputs).", ex, buckets=GAP_BUCKETS_S, registry=r)
        # executor id -> its children of the per-step metrics above: `labels()` takes a lock
        # and builds a key each call, ~1-2 us, eleven times a step (children are never
        # removed, so they stay valid)
        self._per_executor: dict[str, _ExecutorChildren] = {}
        for reason in FINISH_REASONS:
            for api in APIS:
                self.request_success.labels(finish_reason=reason, api=api)
        self.executors_healthy.set(0)

    # ------------------------------------------------------------------ requests (edge)

    def inc_success(self, finish_reason: str, n: int = 1, *, api: str) -> None:
        """`n` samples finished with `finish_reason` ('length', 'stop', 'abort')."""
        self.request_success.labels(finish_reason=finish_reason, api=api).inc(n)

    def inc_failure(self, code: grpc.StatusCode | str, *, api: str) -> None:
        """A request ended with a non-OK status (`code`: a StatusCode or its name; an HTTP
        error counts under the status its error maps to, e.g. 400 as INVALID_ARGUMENT)."""
        name = code.name if isinstance(code, grpc.StatusCode) else str(code)
        self.request_failure.labels(code=name, api=api).inc()

    def observe_ttft(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.inter_token_latency.observe(seconds)

    def observe_time_per_output_token(self, seconds: float) -> None:
        self.time_per_output_token.observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self.e2e_request_latency.observe(seconds)

    def observe_many(self, method: str, *values: float) -> None:
        """`method` (an edge histogram method, e.g. "observe_inter_token") once per value:
        how an API worker's batch is replayed (a step of 256 streams holds 256 inter-token
        latencies). Counted per bucket, one increment a bucket, where prometheus_client's
        histogram keeps its per-bucket counts as it has for years; else value by value."""
        name = EDGE_HISTOGRAMS.get(method)
        if name is None:
            raise ValueError(f"not an edge histogram method: {method!r}")
        hist = getattr(self, name)
        bounds = getattr(hist, "_upper_bounds", None)
        buckets = getattr(hist, "_buckets", None)
        total = getattr(hist, "_sum", None)
        if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
            for v in values:
                hist.observe(v)
            return
        counts = [0] * len(bounds)
        for v in values:
            counts[bisect.bisect_left(bounds, v)] += 1  # observe(): the first bound >= v
        total.inc(sum(values))
        for bucket, n in zip(buckets, counts, strict=True):
            if n:
                bucket.inc(n)

    # ------------------------------------------------------------------ engine

    def observe_queue_time(self, seconds: float) -> None:
        self.queue_time.observe(seconds)

    def add_prompt_tokens(self, n: int) -> None:
        self.prompt_tokens.inc(n)

    def add_generation_tokens(self, n: int) -> None:
        self.generation_tokens.inc(n)

    def set_executor_gauges(
        self,
        executor_id: str,
        *,
        running: int,
        waiting: int,
        swapped: int,
        num_gpu_blocks: int,
        num_free_gpu_blocks: int,
        num_cpu_blocks: int,
        num_free_cpu_blocks: int,
        num_leaked_blocks: int = 0,
    ) -> None:
        """One executor's scheduler and KV-cache gauges (call after every step)."""
        c = self._children(executor_id)
        c.running.set(running)
        c.waiting.set(waiting)
        c.swapped.set(swapped)
        c.blocks_total.set(num_gpu_blocks)
        c.blocks_free.set(num_free_gpu_blocks)
        c.usage.set(1.0 - num_free_gpu_blocks / num_gpu_blocks if num_gpu_blocks else 0.0)
        c.cpu_blocks_total.set(num_cpu_blocks)
        c.cpu_blocks_free.set(num_free_cpu_blocks)
        c.blocks_leaked.set(num_leaked_blocks)

    def forget_executor(self, executor_id: str) -> None:
        """An executor left: its gauges' series go (a dead executor's last running count and
        free blocks would otherwise stay on every dashboard); its counters and histograms
        stay, as counts of what happened. A later executor of the same id starts them
        again."""
        if self._per_executor.pop(executor_id, None) is None:
            return
        for gauge in (self.requests_running, self.requests_waiting, self.requests_swapped,
                      self.kv_blocks_total, self.kv_blocks_free, self.kv_cache_usage_ratio,
                      self.kv_cpu_blocks_total, self.kv_cpu_blocks_free,
                      self.kv_blocks_leaked):
            with contextlib.suppress(KeyError):  # never set
                gauge.remove(executor_id)

    def _children(self, executor_id: str) -> _ExecutorChildren:
        children = self._per_executor.get(executor_id)
        if children is None:
            children = self._per_executor[executor_id] = _ExecutorChildren(*(
                m.labels(executor=executor_id) for m in (
                    self.requests_running, self.requests_waiting, self.requests_swapped,
                    self.kv_blocks_total, self.kv_blocks_free, self.kv_cache_usage_ratio,
                    self.kv_cpu_blocks_total, self.kv_cpu_blocks_free, self.kv_blocks_leaked,
                    self.step_forward, self.executor_gap)))
        return children

    def add_prefix_cache(self, executor_id: str, queries: int, hits: int,
                         cpu_hits: int = 0, offloaded_blocks: int = 0) -> None:
        """At an admission: `queries` prompt tokens looked up, `hits` found (`cpu_hits` of
        them in CPU blocks); `offloaded_blocks` device blocks copied to CPU blocks."""
        self.prefix_cache_queries.labels(executor=executor_id).inc(queries)
        self.prefix_cache_hits.labels(executor=executor_id).inc(hits)
        if cpu_hits:
            self.prefix_cache_cpu_hits.labels(executor=executor_id).inc(cpu_hits)
        if offloaded_blocks:
            self.kv_offloaded_blocks.labels(executor=executor_id).inc(offloaded_blocks)

    def add_spec_decode(self, executor_id: str, drafts: int, draft_tokens: int,
                        accepted: int) -> None:
        """One plan's rows with drafts: how many, their draft tokens, those confirmed."""
        self.spec_drafts.labels(executor=executor_id).inc(drafts)
        self.spec_draft_tokens.labels(executor=executor_id).inc(draft_tokens)
        self.spec_accepted_tokens.labels(executor=executor_id).inc(accepted)

    def inc_preemption(self, executor_id: str, mode: str, n: int = 1) -> None:
        if mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption mode must be one of {PREEMPTION_MODES}, got {mode!r}")
        self.preemptions.labels(executor=executor_id, mode=mode).inc(n)

    def inc_migration(self, n: int = 1) -> None:
        self.migrations.inc(n)

    def inc_handoff(self, executor_id: str, num_blocks_received: int, target_id: str) -> None:
        """A request moved from prefill executor `executor_id` to `target_id` with
        `num_blocks_received` of its blocks (router/handoff.py)."""
        self.handoffs.labels(executor_id).inc()
        if num_blocks_received:
            self.kv_blocks_received.labels(target_id).inc(num_blocks_received)

    def inc_pull(self, target_id: str, num_blocks_received: int) -> None:
        """A prefix pull brought `num_blocks_received` blocks to a request on `target_id`
        (router/prefix_pull.py; one that brought none is not counted)."""
        self.kv_pulls.labels(target_id).inc()
        if num_blocks_received:
            self.kv_blocks_received.labels(target_id).inc(num_blocks_received)

    def inc_api_worker_restart(self) -> None:
        self.api_worker_restarts.inc()

    def set_executors_healthy(self, n: int) -> None:
        self.executors_healthy.set(n)

    def set_lora_adapters(self, adapters: int, slots: int) -> None:
        self.lora_adapters.set(adapters)
        self.lora_slots.set(slots)

    def inc_weight_update(self, outcome: str) -> None:
        self.weight_updates.labels(outcome=outcome).inc()

    def set_generation_held(self, held: bool) -> None:
        self.generation_held.set(1 if held else 0)

    def observe_step_forward(self, executor_id: str, seconds: float) -> None:
        """The executor's forward_s of one step."""
        self._children(executor_id).step_forward.observe(seconds)

    def observe_executor_gap(self, executor_id: str, seconds: float) -> None:
        """The executor's gap_s before one step."""
        self._children(executor_id).gap.observe(seconds)

    # ------------------------------------------------------------------ exposition

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)

    def serve(self, port: int, host: str = "127.0.0.1") -> int | None:
        """Serve /metrics on `host:port` from a daemon thread; port 0 → any free port, -1 →
        disabled (returns None). Returns the bound port. Stop with `shutdown()`."""
        if port < 0:
            return None
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = (server, thread)
        return server.server_port

    def shutdown(self) -> None:
        http = getattr(self, "_http", None)
        if http is not None:
            server, thread = http
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
            self._http = None
