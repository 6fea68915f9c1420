"""The routing simulator's policy runner (benchmarks/routing_sim.py): `Simulation` runs one
workload under one policy through the real router code (`RouterEngine`, its KV managers and
schedulers) against the simulated executors of routing_cluster.py in virtual time, and
returns its figures; `ApproxTree` is the `approx-tree` policy (SGLang's cache-aware router);
`infinite_bound` the infinite-cache bound. Imported through routing_sim.py, which points
`pagedserve.router` at this tree first."""

from __future__ import annotations

import asyncio
import heapq
from dataclasses import dataclass, field

import msgspec
import numpy as np
from pagedserve.protos import wire
from pagedserve.router import step_loop as step_loop_module
from pagedserve.router.engine import EngineConfig, RouterEngine
from pagedserve.router.routing import RoutingPolicy
from pagedserve.router.scheduler import PreemptionMode
from pagedserve.router.types import ModelInfoData, RequestSpec, SamplingSpec
from routing_cluster import (
    Calibration,
    NullTokenizer,
    SimExecutor,
    SimLink,
    VirtualClock,
    virtual_time,
)
from routing_workloads import BLOCK_SIZE, EOS, VOCAB, Turn, Workload, build_arrivals

# SGLang cache-aware router defaults (sglang_router launcher: cache_threshold 0.3,
# balance_abs_threshold 64, balance_rel_threshold 1.5).
CACHE_THRESHOLD = 0.3
BALANCE_ABS = 64
BALANCE_REL = 1.5


class ApproxTree:
    """SGLang's approximate tree (see routing_sim.py's docstring), in blocks: `owners[h]` lists
    the workers whose routed prompts passed through the block chain ending in `h`, first
    inserter first; `size[w]` counts the distinct blocks in worker w's tree."""

    def __init__(self, num_workers: int) -> None:
        self.owners: dict[int, list[int]] = {}
        self.size = [0] * num_workers

    def choose(self, hashes: list[int], num_tokens: int, loads: list[int]) -> int:
        hi, lo = max(loads), min(loads)
        if hi - lo > BALANCE_ABS and hi > BALANCE_REL * lo:
            w = loads.index(lo)
        else:
            matched, tenant = 0, -1
            for h in hashes:
                owners = self.owners.get(h)
                if owners is None:
                    break
                matched += 1
                tenant = owners[0]
            if tenant >= 0 and matched * BLOCK_SIZE / num_tokens > CACHE_THRESHOLD:
                w = tenant
            else:
                w = self.size.index(min(self.size))
        for h in hashes:
            owners = self.owners.setdefault(h, [])
            if w not in owners:
                owners.append(w)
                self.size[w] += 1
        return w


def chain_hashes(tokens: list[int], n_blocks: int) -> list[int]:
    out, parent = [], 0
    for i in range(n_blocks):
        parent = hash((parent, tuple(tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])))
        out.append(parent)
    return out


@dataclass
class Record:
    request_id: str
    arrival: float
    prompt: list[int]
    executor: str = ""
    first_token: float | None = None
    finish: float | None = None
    cached: int = 0
    output: list[int] = field(default_factory=list)
    tenant: int = 0


class Simulation:
    def __init__(self, w: Workload, policy: str, calib: Calibration, seed: int,
                 max_virtual_s: float = 3600.0) -> None:
        self.w, self.policy, self.calib, self.seed = w, policy, calib, seed
        self.max_virtual_s = max_virtual_s
        self.clock = VirtualClock()
        self.events: list = []
        self._n = 0
        self.executors: dict[bytes, SimExecutor] = {}
        self.records: dict[str, Record] = {}
        self.open_groups: dict[str, object] = {}  # request id -> group, not finished yet
        self.tree = ApproxTree(w.num_executors) if policy == "approx-tree" else None
        self.num_left_cache = 0  # requests routed where less of the prompt was cached
        self.left_cache_tokens = 0  # cached prompt tokens given up that way

    # ---------------------------------------------------------------- events

    def push(self, t: float, kind: str, data) -> None:
        self._n += 1
        heapq.heappush(self.events, (t, self._n, kind, data))

    def plan_sent(self, routing_id: bytes, plan: wire.StepPlan) -> None:
        ex = self.executors[routing_id]
        ex.fake.receive(plan)
        n_new = plan.num_new_tokens
        decode_rows = int(np.count_nonzero(n_new == 1))
        prefill_tokens = int(n_new.sum()) - decode_rows
        step_s = self.calib.step_time(prefill_tokens, decode_rows)
        start = max(self.clock.now, ex.free_at)
        ex.free_at = start + step_s
        ex.busy_s += step_s
        self.push(ex.free_at, "result", (ex, plan.step_id, step_s))

    # ---------------------------------------------------------------- run

    def run(self) -> dict:
        with virtual_time(self.clock):
            return asyncio.run(self._run())

    async def _run(self) -> dict:
        w = self.w
        routing = {"prefix": RoutingPolicy.PREFIX, "round-robin": RoutingPolicy.ROUND_ROBIN,
                   "least-loaded": RoutingPolicy.LEAST_LOADED,
                   "approx-tree": RoutingPolicy.PREFIX}[self.policy]
        max_len = 8192
        config = EngineConfig(model_fingerprint="sim", block_size=BLOCK_SIZE,
                              max_model_len=max_len, routing=routing,
                              preemption_mode=PreemptionMode.RECOMPUTE,
                              max_queue_len=1 << 30, pipeline_depth=2)
        info = ModelInfoData("sim", "LlamaForCausalLM", max_len, VOCAB, BLOCK_SIZE, "float32",
                             (EOS,))
        engine = RouterEngine(config, NullTokenizer(), info)
        engine.link = SimLink(self)
        self.engine = engine
        for i in range(w.num_executors):
            rid = f"e{i}".encode()
            hello = wire.Hello(executor_id=f"e{i}", model_fingerprint="sim", device="sim",
                               dtype="float32", block_size=BLOCK_SIZE,
                               num_gpu_blocks=w.num_gpu_blocks, num_cpu_blocks=0,
                               max_model_len=max_len)
            assert engine.membership.on_hello(rid, hello).accepted
            handle = engine.executors[f"e{i}"]
            handle.task.cancel()  # the simulation drives the step loop itself
            self.executors[rid] = SimExecutor(handle)
        self.handles = [ex.handle for ex in self.executors.values()]
        turns, chats = build_arrivals(w, self.seed)
        for turn in turns:
            self.push(turn.t, "arrival", turn)
        steps = engine.steps
        while self.events:
            t, _, kind, data = heapq.heappop(self.events)
            if t > self.max_virtual_s:
                break
            self.clock.now = t
            if kind == "arrival":
                await self.arrive(data)
            elif kind == "result":
                ex, step_id, step_s = data
                handle = ex.handle
                result = msgspec.structs.replace(ex.fake.answer(), forward_s=step_s)
                head = handle.in_flight.popleft()
                assert head.step_id == step_id == result.step_id
                touched = steps.apply_result(handle, head, result)
                steps.fill(handle)
                engine.delivery.text_stage(handle.scheduler, touched)
                self.collect(touched)
                self.idle_check(ex)
            elif kind == "retry":
                data.retry_pending = False
                if not data.handle.in_flight:
                    steps.fill(data.handle)
                self.idle_check(data)
        return self.figures(chats)

    def idle_check(self, ex: SimExecutor) -> None:
        """The real loop retries every RETRY_S when it has work but sent nothing."""
        h = ex.handle
        s = h.scheduler
        if not h.in_flight and (s.running or s.waiting or s.swapped) and not ex.retry_pending:
            ex.retry_pending = True
            self.push(self.clock.now + step_loop_module.RETRY_S, "retry", ex)

    async def arrive(self, turn: Turn) -> None:
        now = self.clock.now
        engine = self.engine
        prompt = turn.prompt
        if turn.chat is not None:
            chat = turn.chat
            if not chat.history:
                chat.history = list(chat.system)
            prompt = chat.history + chat.messages[chat.next_turn]
        spec = RequestSpec(request_id=turn.request_id, prompt_token_ids=tuple(prompt),
                           sampling=SamplingSpec(max_tokens=turn.max_tokens, temperature=0.0,
                                                 ignore_eos=True),
                           arrival_time=now)
        # What each executor holds of the prompt now (lookup takes no references).
        hashes = self.handles[0].kv.hash_blocks(prompt)
        held = [h.kv.lookup(prompt, hashes).num_tokens for h in self.handles]
        restore = None
        if self.tree is not None:
            hashes = chain_hashes(prompt, len(prompt) // BLOCK_SIZE)
            loads = [len(h.scheduler.running) + len(h.scheduler.waiting)
                     + len(h.scheduler.swapped) for h in self.handles]
            chosen = self.handles[self.tree.choose(hashes, len(prompt), loads)].id
            place = engine.place

            def place_on_chosen(group, handles):
                return place(group, [h for h in handles if h.id == chosen] or handles)
            engine.place = place_on_chosen
            restore = place
        try:
            await engine.submit(spec)
        finally:
            if restore is not None:
                engine.place = restore
        group = engine.live[turn.request_id]
        self.records[turn.request_id] = Record(turn.request_id, now, prompt, group.executor_id,
                                               tenant=turn.tenant)
        chosen = held[[h.id for h in self.handles].index(group.executor_id)]
        if chosen < max(held):
            self.num_left_cache += 1
            self.left_cache_tokens += max(held) - chosen
        self.open_groups[turn.request_id] = (group, turn)
        handle = engine.executors[group.executor_id]
        if len(handle.in_flight) < engine.steps.depth:
            engine.steps.fill(handle)
            self.idle_check(self.executors[handle.routing_id])

    def collect(self, touched) -> None:
        """Record the requests that ended (and send a chat's next turn after think time)."""
        live = self.engine.live
        for group in {seq.group for seq in touched}:
            rid = group.request_id
            if rid in live or rid not in self.open_groups:
                continue
            _, turn = self.open_groups.pop(rid)
            rec = self.records[rid]
            rec.first_token = group.first_token_time
            rec.finish = self.clock.now
            rec.cached = group.cached_prompt_tokens or 0
            rec.output = group.seqs[0].token_ids[group.num_prompt_tokens:]
            chat = turn.chat
            if chat is not None:
                chat.history = list(rec.prompt) + list(rec.output)
                chat.next_turn += 1
                if chat.next_turn < len(chat.messages):
                    k = chat.next_turn
                    self.push(self.clock.now + chat.think_s[k - 1], "arrival",
                              Turn(0.0, f"c{chat.chat_id}.{k}", [], chat.outputs[k], chat,
                                   chat.chat_id))

    # ---------------------------------------------------------------- figures

    def figures(self, chats) -> dict:
        recs = sorted(self.records.values(), key=lambda r: (r.arrival, r.request_id))
        done = [r for r in recs if r.finish is not None]
        prompt_tokens = sum(len(r.prompt) for r in recs)
        cached = sum(r.cached for r in done)
        ttft = np.array([r.first_token - r.arrival for r in done]) * 1e3
        out_tokens = sum(len(r.output) for r in done)
        t0 = recs[0].arrival if recs else 0.0
        span = max((r.finish for r in done), default=t0) - t0
        kv_q = sum(h.kv.prefix_query_tokens for h in self.handles)
        kv_h = sum(h.kv.prefix_hit_tokens for h in self.handles)
        preemptions = sum(sum(h.scheduler.num_preemptions.values()) for h in self.handles)
        busy = sum(ex.busy_s for ex in self.executors.values())
        bound = infinite_bound(recs)
        per_exec = [sum(1 for r in recs if r.executor == h.id) for h in self.handles]
        spread: dict[int, set] = {}
        for r in recs:
            spread.setdefault(r.tenant, set()).add(r.executor)
        return dict(
            requests=len(recs), completed=len(done), prompt_tokens=prompt_tokens,
            cached_tokens=cached, hit_ratio=round(cached / max(prompt_tokens, 1), 4),
            kv_hit_ratio=round(kv_h / max(kv_q, 1), 4),
            bound_cached_tokens=bound,
            bound_hit_ratio=round(bound / max(prompt_tokens, 1), 4),
            ttft_ms_p50=round(float(np.percentile(ttft, 50)), 2) if len(ttft) else None,
            ttft_ms_p99=round(float(np.percentile(ttft, 99)), 2) if len(ttft) else None,
            ttft_ms_mean=round(float(ttft.mean()), 2) if len(ttft) else None,
            output_tok_per_s=round(out_tokens / span, 1) if span > 0 else None,
            duration_s=round(span, 3),
            busy_ratio=round(busy / (span * len(self.handles)), 3) if span > 0 else None,
            preemptions=preemptions, requests_per_executor=per_exec,
            left_cache_ratio=round(self.num_left_cache / max(len(recs), 1), 4),
            left_cache_tokens_ratio=round(self.left_cache_tokens / max(prompt_tokens, 1), 4),
            executors_per_tenant=round(sum(map(len, spread.values())) / max(len(spread), 1), 3),
        )


def infinite_bound(recs: list[Record]) -> int:
    """Prompt tokens a cache of unbounded size shared by the whole cluster would serve:
    leading whole blocks seen before (in earlier prompts, or computed as earlier requests'
    outputs), at most (len - 1) // block_size blocks (the last token is always computed)."""
    seen: set[int] = set()
    cached = 0
    for r in recs:
        cap = (len(r.prompt) - 1) // BLOCK_SIZE
        prompt_hashes = chain_hashes(r.prompt, len(r.prompt) // BLOCK_SIZE)
        k = 0
        while k < cap and prompt_hashes[k] in seen:
            k += 1
        cached += k * BLOCK_SIZE
        seen.update(prompt_hashes)
        if r.output:  # the last output token is sampled, never computed
            full = r.prompt + r.output[:-1]
            seen.update(chain_hashes(full, len(full) // BLOCK_SIZE))
    return cached
