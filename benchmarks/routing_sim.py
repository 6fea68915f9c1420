"""Routing simulator (issue 14): the router's own routing, KV managers and schedulers against
simulated executors in virtual time, so a routing rule is judged on many workloads in minutes.

What is real and what is simulated. One `RouterEngine` per run, with its real
`Membership.on_hello` (a `KVCacheManager` and a `Scheduler` per executor), `submit` ->
`place` -> `routing.choose`, `StepLoop.send_next_plan` (`Scheduler.schedule` ->
`build_plan` -> `end_step`), `StepLoop.apply_result` (`plan_answered`, pending counts,
tokens, cheap stops) and `Delivery.text_stage` (a request ends and leaves its scheduler), in
the order the real step loop calls them (result -> apply -> refill -> text). The link to the
executors is a stand-in: a plan "sent" goes to a simulated executor (`fake_executor.
PipelinedFake`: it feeds marked decodes its own samples and samples a token that depends only
on the request and output position, so every policy sees the same prompts and outputs). The
executor runs its plans one after another; a plan takes

    step_s = STEP_S + prefill tokens x PREFILL_S_PER_TOKEN + decode rows x DECODE_S_PER_ROW

of virtual time (a row computing one token counts as a decode), and its result comes back
then with `forward_s = step_s` (the scheduler's cost model learns from it as from a real
executor). Pipeline depth 2, as `serve`: a second plan is sent while the first runs.
`time.monotonic` inside the router's modules reads the virtual clock during a run (arrival,
first token and queue times are virtual). The router's CPU time is not simulated (zero).

Policies: `prefix`, `round-robin`, `least-loaded`: the real `choose` (`--routing`);
`approx-tree`: SGLang's cache-aware router (sgl-router `policies/cache_aware.rs`, defaults of
its launcher), written here: one approximate tree of the prompts routed to each worker
(inserted at routing time, never told about evictions: SGLang trims it only past 2^26
characters); the worker holding the longest match of the prompt takes it when the match
covers more than CACHE_THRESHOLD of it, else the worker with the smallest tree; but when the
load (requests routed there and not finished) is imbalanced, max - min > BALANCE_ABS and
max > BALANCE_REL x min, the least loaded takes it. SGLang matches characters; here the match
is in whole blocks of tokens (at most one block short of a token match). The chosen executor
is then given to the real `place` as the only candidate (so its cached prefix is pinned as for
any request). `infinite`: no run, the bound: each distinct block (of prompts, and of earlier
requests' outputs, which a cache keeps too) misses once in the whole cluster, and a prompt
always computes at least its last token (as `KVCacheManager.lookup`).

Figures per workload and policy: `hit_ratio` = prompt tokens served from cache at admission
(Usage's cached_prompt_tokens) / prompt tokens; `kv_hit_ratio` = the router's prefix-cache
counters (they count a recompute-preempted request's re-admission again); TTFT p50/p99
(virtual ms, arrival to the first token handed to the stream); output tok/s over the run
(first arrival to last finish); `busy_ratio` = executor busy time / (executors x run);
preemptions; `left_cache_ratio`: requests routed to an executor that held less of the
prompt in its cache than another did at that moment (`left_cache_tokens_ratio`: the cached
tokens given up that way / prompt tokens: why a policy's hit ratio falls short);
`executors_per_tenant`: distinct executors a tenant's requests (a chat's turns) went to, mean
over tenants (chats). One JSON line
per (workload, policy), one `targets` line per workload (issue 14's
simulator targets), then one table on stderr.

Calibration (CPU_TINY, the only executor measured here): `executor_bench.py --cpu-only`
(tiny random Llama, fp32, 1 thread, context 128) at commit a180bc2 on this 2-core VM: decode
steps of 1 / 32 / 128 rows took 3.19 / 14.15 / 39.91 ms; the least-squares line through them
gives STEP_S 3.8 ms + 0.284 ms per decode row. executor_bench has no prefill case: a 512-token
prefill through the same `ModelRunner.execute` took 31.0 ms (61 us/token; 128 tokens: 48
us/token). Other executors: `--prefill-us-per-token`, `--decode-us-per-row`, `--step-us`.

    .venv/bin/python benchmarks/routing_sim.py [--quick] [--workloads a,b] [--policies ...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import pagedserve  # noqa: E402

# The router code simulated is this tree's, also when it is a snapshot (git archive) and
# another tree is installed in editable mode: pagedserve.router, .kvmanager, ... resolve to
# ROOT/router, ROOT/kvmanager, ... before the editable install's mapping is consulted.
pagedserve.__path__.append(str(ROOT))

from fake_executor import PipelinedFake  # noqa: E402
from pagedserve.protos import wire  # noqa: E402
from pagedserve.router import step_loop as step_loop_module  # noqa: E402
from pagedserve.router.engine import EngineConfig, RouterEngine  # noqa: E402
from pagedserve.router.routing import RoutingPolicy  # noqa: E402
from pagedserve.router.scheduler import PreemptionMode  # noqa: E402
from pagedserve.router.types import ModelInfoData, RequestSpec, SamplingSpec  # noqa: E402
from routing_workloads import (  # noqa: E402
    BLOCK_SIZE,
    EOS,
    QUICK_WORKLOADS,
    VOCAB,
    WORKLOADS,
    Turn,
    Workload,
    build_arrivals,
)

BENCH = "routing_sim"
POLICIES = ("prefix", "round-robin", "least-loaded", "approx-tree")

# SGLang cache-aware router defaults (sglang_router launcher: cache_threshold 0.3,
# balance_abs_threshold 64, balance_rel_threshold 1.5).
CACHE_THRESHOLD = 0.3
BALANCE_ABS = 64
BALANCE_REL = 1.5


@dataclass(frozen=True)
class Calibration:
    prefill_s_per_token: float
    decode_s_per_row: float
    step_s: float

    def step_time(self, prefill_tokens: int, decode_rows: int) -> float:
        return self.step_s + prefill_tokens * self.prefill_s_per_token \
            + decode_rows * self.decode_s_per_row


CPU_TINY = Calibration(prefill_s_per_token=61e-6, decode_s_per_row=284e-6, step_s=3.8e-3)


# ====================================================================== the simulated cluster


class VirtualClock:
    """Stands in for the `time` module inside the router's modules during a run."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic

    def __getattr__(self, name):
        return getattr(time, name)


@contextlib.contextmanager
def virtual_time(clock: VirtualClock):
    patched = []
    for name, mod in list(sys.modules.items()):
        if name.startswith(("pagedserve.router", "pagedserve.kvmanager")) \
                and getattr(mod, "time", None) is time:
            mod.time = clock
            patched.append(mod)
    try:
        yield
    finally:
        for mod in patched:
            mod.time = time


class NullTokenizer:
    """Text is one character per token: the text stage runs, cheaply."""

    special_token_ids = frozenset({EOS})
    eos_token_ids = (EOS,)

    def is_special(self, t: int) -> bool:
        return t == EOS

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "x" * len(ids)


@dataclass
class SimExecutor:
    handle: object
    fake: PipelinedFake = field(default_factory=PipelinedFake)
    free_at: float = 0.0
    busy_s: float = 0.0
    retry_pending: bool = False


class SimLink:
    """The router's ExecutorLink: a plan sent starts on its simulated executor when the plans
    before it are done and its result is due `step_time` later."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    def send(self, routing_id: bytes, msg) -> None:
        if isinstance(msg, wire.StepPlan):
            self.sim.plan_sent(routing_id, msg)

    async def close(self) -> None:
        pass


class ApproxTree:
    """SGLang's approximate tree (see the module docstring), in blocks: `owners[h]` lists the
    workers whose routed prompts passed through the block chain ending in `h`, first inserter
    first; `size[w]` counts the distinct blocks in worker w's tree."""

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


# ====================================================================== report


def targets(w: Workload, rows: dict[str, dict]) -> dict:
    """Issue 14's simulator targets for one workload (None where a policy did not run)."""
    p = rows.get("prefix")
    if p is None:
        return {}
    others = [r for k, r in rows.items() if k != "prefix"]
    out = dict(
        best_hit=all(p["hit_ratio"] >= r["hit_ratio"] for r in others),
        best_ttft_p50=all(p["ttft_ms_p50"] <= r["ttft_ms_p50"] for r in others),
        hit_minus_best_other=round(p["hit_ratio"] - max(r["hit_ratio"] for r in others), 4)
        if others else None,
        ttft_p50_over_best_other_ratio=round(
            p["ttft_ms_p50"] / min(r["ttft_ms_p50"] for r in others), 3) if others else None,
        hit_of_bound_ratio=round(p["hit_ratio"] / max(p["bound_hit_ratio"], 1e-9), 3),
        fits_cluster=w.fits_cluster,
    )
    out["hit_ge_90pct_bound"] = (out["hit_of_bound_ratio"] >= 0.9) if w.fits_cluster else None
    ll = rows.get("least-loaded")
    if ll is not None:
        out["p99_over_least_loaded_ratio"] = round(p["ttft_ms_p99"] / ll["ttft_ms_p99"], 3)
        out["p99_within_10pct"] = out["p99_over_least_loaded_ratio"] <= 1.10
    out["met"] = all(v for k, v in out.items()
                     if k in ("best_hit", "best_ttft_p50", "hit_ge_90pct_bound",
                              "p99_within_10pct") and v is not None)
    return out


def emit(case: str, **figures) -> None:
    print(json.dumps({"bench": BENCH, "case": case, **figures}), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="two tiny workloads (smoke run)")
    p.add_argument("--workloads", default="", help="comma-separated names (default: all)")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill-us-per-token", type=float, default=CPU_TINY.prefill_s_per_token * 1e6)
    p.add_argument("--decode-us-per-row", type=float, default=CPU_TINY.decode_s_per_row * 1e6)
    p.add_argument("--step-us", type=float, default=CPU_TINY.step_s * 1e6)
    p.add_argument("--list", action="store_true", help="print the workloads and exit")
    args = p.parse_args(argv)
    table = QUICK_WORKLOADS if args.quick else WORKLOADS
    if args.list:
        for w in table.values():
            print(w)
        return 0
    names = [n for n in args.workloads.split(",") if n] or list(table)
    unknown = [n for n in names if n not in {**WORKLOADS, **QUICK_WORKLOADS}]
    if unknown:
        p.error(f"unknown workloads {unknown}; known: {', '.join(WORKLOADS)}")
    policies = [x for x in args.policies.split(",") if x]
    calib = Calibration(args.prefill_us_per_token * 1e-6, args.decode_us_per_row * 1e-6,
                        args.step_us * 1e-6)
    lines: list[tuple[str, str, dict]] = []
    target_rows: list[tuple[str, dict]] = []
    t_start = time.monotonic()
    for name in names:
        w = {**WORKLOADS, **QUICK_WORKLOADS}[name]
        rows: dict[str, dict] = {}
        for policy in policies:
            t0 = time.monotonic()
            fig = Simulation(w, policy, calib, args.seed).run()
            fig["wall_s"] = round(time.monotonic() - t0, 2)
            rows[policy] = fig
            emit(f"{name}/{policy}", workload=name, policy=policy,
                 executors=w.num_executors, tenants=w.tenants, cap_factor=w.cap_factor,
                 num_gpu_blocks=w.num_gpu_blocks, working_set_blocks=w.working_set_blocks,
                 fits_cluster=w.fits_cluster, **fig)
            lines.append((name, policy, fig))
        bound = next(iter(rows.values()))
        emit(f"{name}/infinite", workload=name, policy="infinite",
             bound_hit_ratio=bound["bound_hit_ratio"], prompt_tokens=bound["prompt_tokens"])
        lines.append((name, "infinite", {"hit_ratio": bound["bound_hit_ratio"]}))
        tg = targets(w, rows)
        if tg and len(rows) > 1:
            emit(f"{name}/targets", workload=name, **tg)
            target_rows.append((name, tg))
    wall = time.monotonic() - t_start
    emit("summary", wall_s=round(wall, 1), workloads=len(names), policies=policies,
         calibration_us=dict(prefill_per_token=args.prefill_us_per_token,
                             decode_per_row=args.decode_us_per_row, step=args.step_us))
    print_table(lines, target_rows)
    return 0


def print_table(lines, target_rows) -> None:
    """One table: every workload and policy; then the targets per workload."""
    head = (f"{'workload':<16} {'policy':<13} {'hit':>6} {'of bound':>8} {'TTFT p50':>9} "
            f"{'TTFT p99':>9} {'out tok/s':>9} {'busy':>5} {'preempt':>7} {'left':>5} "
            f"{'spread':>6}")
    out = [head, "-" * len(head)]
    last = None
    bound = 1.0
    for name, policy, f in lines:
        label = name if name != last else ""
        if name != last:
            bound = f.get("bound_hit_ratio", 1.0)
        last = name
        if policy == "infinite":
            out.append(f"{label:<16} {policy:<13} {f['hit_ratio']:>6.3f} {1:>8.2f}")
            continue
        out.append(f"{label:<16} {policy:<13} {f['hit_ratio']:>6.3f} "
                   f"{f['hit_ratio'] / max(bound, 1e-9):>8.2f} {f['ttft_ms_p50']:>9.1f} "
                   f"{f['ttft_ms_p99']:>9.1f} {f['output_tok_per_s']:>9.0f} "
                   f"{f['busy_ratio']:>5.2f} {f['preemptions']:>7} "
                   f"{f['left_cache_ratio']:>5.2f} {f['executors_per_tenant']:>6.2f}")
    if target_rows:
        out += ["", f"{'prefix routing':<16} {'best hit':>8} {'best p50':>8} {'p50/best':>8} "
                    f"{'fits':>5} {'>=0.9 bound':>11} {'p99/LL':>7} {'met':>4}"]
        for name, t in target_rows:
            ge = {None: "-", True: "yes", False: "NO"}[t["hit_ge_90pct_bound"]]
            out.append(
                f"{name:<16} {'yes' if t['best_hit'] else 'NO':>8} "
                f"{'yes' if t['best_ttft_p50'] else 'NO':>8} "
                f"{t['ttft_p50_over_best_other_ratio']:>8.2f} {str(t['fits_cluster']):>5} "
                f"{ge:>11} {t.get('p99_over_least_loaded_ratio', float('nan')):>7.2f} "
                f"{'yes' if t['met'] else 'NO':>4}")
    print("\n".join(out), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
