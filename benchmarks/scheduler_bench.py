"""Router scheduler overhead (DESIGN §8): per-step time of schedule + plan build + plan
encode + result application, against a fake executor that returns one token per sampled
request. JSON lines on stdout, a table on stderr.

Per step, timed: `Scheduler.schedule()`, `build_plan()`, `KVCacheManager.end_step()`,
`Codec.encode(plan)` (the frames the router would send), `Codec.decode()` of the executor's
StepResult frames and applying its tokens as `StepLoop.apply_tokens` does (append,
cheap stop by max_tokens, `finish_seq`, `remove`). Not timed: the fake executor (building
and encoding its StepResult). Text detokenization is skipped (the reference skips it too).
Requests, and their prompt block hashes (`kv.hash_blocks`), are built before timing; every
request arrives at t=0.

Workloads (block size 16, max_num_seqs 256, max_num_batched_tokens 8192, prefix caching on,
recompute preemption, no swap space), with the vLLM 0.33 V1 reference per-step p50:
  W1 decode-heavy:  256 requests, 128 random prompt tokens, 256 output     ~5,100 us
  W2 shared-prefix: 512 requests, 1,024-token common prefix + 64 unique,
                    32 output                                              ~4,800 us, hit 0.94
  W3 preemption:    256 requests, prompt 512, 512 output, device blocks for 30% of
                    sum(ceil((512 + 512) / 16))                            ~1,900 us, ~140 preemptions
W1 and W2 get device blocks for every request at once (no preemption).
Case `x4` runs 4 schedulers/KV managers in this one process (4x the requests, spread round
robin), one step of each in turn: per-step and per-round times, aggregate throughput.

Usage: .venv/bin/python benchmarks/scheduler_bench.py [--quick] [--workloads W1,W2,W3]
       [--no-x4] [--profile W3] [--profile-top 25]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import os
import pstats
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_executor import VOCAB, ResultApplier, fake_execute, make_groups  # noqa: E402
from pagedserve.kvmanager import KVCacheManager  # noqa: E402
from pagedserve.protos.codec import Codec  # noqa: E402
from pagedserve.router.plan_builder import build_plan  # noqa: E402
from pagedserve.router.scheduler import (  # noqa: E402
    PreemptionMode,
    Scheduler,
    SchedulerConfig,
)

BENCH = "scheduler_bench"
BLOCK_SIZE = 16
MAX_MODEL_LEN = 2048
EOS = (2,)

# name: (num_requests, prompt builder, max_tokens, fraction of blocks needed, reference)
REFERENCE = {
    "W1": {"step_us_p50": 5100},
    "W2": {"step_us_p50": 4800, "prefix_hit_rate": 0.94},
    "W3": {"step_us_p50": 1900, "preemptions": 140},
}


def make_prompts(workload: str, num_requests: int, seed: int = 0) -> tuple[list, int, float]:
    """(prompts, max_tokens, fraction of the total block need given to the device)."""
    rng = np.random.default_rng(seed)
    if workload == "W1":
        return rng.integers(3, VOCAB, (num_requests, 128)).tolist(), 256, 1.0
    if workload == "W2":
        prefix = rng.integers(3, VOCAB, 1024).tolist()
        unique = rng.integers(3, VOCAB, (num_requests, 64)).tolist()
        return [prefix + u for u in unique], 32, 1.0
    if workload == "W3":
        return rng.integers(3, VOCAB, (num_requests, 512)).tolist(), 512, 0.30
    raise ValueError(f"unknown workload {workload}")


class Router:
    """One executor's share of the router: KV manager, scheduler, codec, result path."""

    def __init__(self, num_gpu_blocks: int) -> None:
        self.kv = KVCacheManager(num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=0,
                                 block_size=BLOCK_SIZE, enable_prefix_caching=True,
                                 hash_algo="sha256", watermark=0.01)
        cfg = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192,
                              max_model_len=MAX_MODEL_LEN,
                              preemption_mode=PreemptionMode.RECOMPUTE)
        self.sched = Scheduler(self.kv, cfg)
        self.applier = ResultApplier(self.sched, MAX_MODEL_LEN)
        self.codec_out = Codec()
        self.codec_in = Codec()
        self.exec_codec = Codec()  # the fake executor's
        self.step_id = 0
        self.step_ns: list[int] = []
        self.phase_ns = {"schedule": 0, "build": 0, "encode": 0, "apply": 0}
        self.plan_bytes = 0
        self.preempt_steps = 0  # steps that preempted at least one group
        self.max_preempt_in_step = 0

    def add(self, groups) -> None:
        for g in groups:
            # Prompt hashes are computed before timing (the edge does it at admission).
            self.kv.hash_blocks(g.seqs[0].token_ids, None, g.seqs[0].block_hashes)
            self.applier.add(g)

    @property
    def busy(self) -> bool:
        s = self.sched
        return bool(s.running or s.waiting or s.swapped)

    def step(self) -> bool:
        """One step; False when nothing could be scheduled."""
        pc = time.perf_counter_ns
        t0 = pc()
        out = self.sched.schedule()
        t1 = pc()
        if out.preempted:
            self.preempt_steps += 1
            self.max_preempt_in_step = max(self.max_preempt_in_step, len(out.preempted))
        if out.empty:
            self.kv.end_step()
            return False
        self.step_id += 1
        try:
            plan = build_plan(self.step_id, out, self.kv, EOS)
        finally:
            self.kv.end_step()
        t2 = pc()
        frames = self.codec_out.encode(plan)
        t3 = pc()
        self.plan_bytes += sum(len(f) for f in frames)
        # ---- the executor's side, not timed
        result_frames = [bytes(f) for f in self.exec_codec.encode(fake_execute(plan, self.step_id))]
        # ----
        t4 = pc()
        self.applier.apply(self.codec_in.decode(result_frames), out.sampled)
        t5 = pc()
        ph = self.phase_ns
        ph["schedule"] += t1 - t0
        ph["build"] += t2 - t1
        ph["encode"] += t3 - t2
        ph["apply"] += t5 - t4
        self.step_ns.append((t3 - t0) + (t5 - t4))
        return True


def _pct(values: list[int], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] / 1e3


def _build_routers(workload: str, num_requests: int, num_routers: int) -> list[Router]:
    prompts, max_tokens, fraction = make_prompts(workload, num_requests)
    per_router = [prompts[i::num_routers] for i in range(num_routers)]
    routers = []
    for r, ps in enumerate(per_router):
        need = sum(math.ceil((len(p) + max_tokens) / BLOCK_SIZE) for p in ps)
        router = Router(max(1, int(fraction * need)))
        # Global arrival order is round robin; keep ids distinct across routers.
        router.add(make_groups(ps, max_tokens, prefix=f"e{r}-r", start=0))
        routers.append(router)
    return routers


def run_workload(workload: str, num_requests: int, num_routers: int = 1,
                 max_steps: int = 1_000_000) -> dict:
    routers = _build_routers(workload, num_requests, num_routers)
    round_ns: list[int] = []
    stalls = 0
    t_start = time.perf_counter()
    for _ in range(max_steps):
        live = [r for r in routers if r.busy]
        if not live:
            break
        t0 = time.perf_counter_ns()
        for r in live:
            if not r.step():
                stalls += 1
        round_ns.append(time.perf_counter_ns() - t0)
        if stalls > 1000:
            raise RuntimeError(f"{workload}: nothing schedulable for 1000 steps")
    wall_s = time.perf_counter() - t_start
    steps = [ns for r in routers for ns in r.step_ns]
    busy_s = sum(steps) / 1e9
    tokens = sum(r.applier.num_tokens for r in routers)
    finished = sum(r.applier.num_finished for r in routers)
    if finished != num_requests:
        raise RuntimeError(f"{workload}: {finished} of {num_requests} requests finished")
    for r in routers:
        r.kv.check_invariants()
    queries = sum(r.kv.prefix_query_tokens for r in routers)
    hits = sum(r.kv.prefix_hit_tokens for r in routers)
    num_steps = len(steps)
    phases = {k: sum(r.phase_ns[k] for r in routers) for k in routers[0].phase_ns}
    res = {
        "bench": BENCH,
        "case": workload if num_routers == 1 else f"{workload}_x{num_routers}",
        "workload": workload,
        "num_executors": num_routers,
        "num_requests": num_requests,
        "step_us_p50": round(_pct(steps, 0.5), 1),
        "step_us_p90": round(_pct(steps, 0.9), 1),
        "step_us_p99": round(_pct(steps, 0.99), 1),
        "step_us_mean": round(busy_s / max(1, num_steps) * 1e6, 1),
        "wall_s": round(wall_s, 3),
        "router_busy_s": round(busy_s, 3),
        "num_steps": num_steps,
        "preemptions": sum(sum(r.sched.num_preemptions.values()) for r in routers),
        "steps_with_preemption": sum(r.preempt_steps for r in routers),
        "max_preemptions_in_step": max(r.max_preempt_in_step for r in routers),
        "prefix_hit_rate": round(hits / queries, 4) if queries else 0.0,
        "generated_tokens": tokens,
        "router_tok_per_s": round(tokens / busy_s, 1) if busy_s else 0.0,
        "plan_bytes_mean": round(sum(r.plan_bytes for r in routers) / max(1, num_steps)),
        "num_gpu_blocks": routers[0].kv.gpu.num_blocks,
        "phase_us_mean": {k: round(v / max(1, num_steps) / 1e3, 1) for k, v in phases.items()},
    }
    if num_routers > 1:
        res["round_us_p50"] = round(_pct(round_ns, 0.5), 1)
        res["round_us_p90"] = round(_pct(round_ns, 0.9), 1)
        res["aggregate_steps_per_s"] = round(num_steps / busy_s, 1) if busy_s else 0.0
    ref = REFERENCE[workload]
    res["reference_step_us_p50"] = ref["step_us_p50"]
    res["vs_reference_ratio"] = round(res["step_us_p50"] / ref["step_us_p50"], 3)
    return res


def profile_workload(workload: str, num_requests: int, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    run_workload(workload, num_requests)
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return buf.getvalue()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="request counts / 8")
    ap.add_argument("--workloads", default="W1,W2,W3")
    ap.add_argument("--no-x4", action="store_true", help="skip the 4-executor runs")
    ap.add_argument("--x4-workloads", default="W1,W2,W3")
    ap.add_argument("--profile", default="", help="cProfile this workload (stderr)")
    ap.add_argument("--profile-top", type=int, default=25)
    args = ap.parse_args(argv)
    counts = {"W1": 256, "W2": 512, "W3": 256}
    div = 8 if args.quick else 1
    results = []
    for w in [w for w in args.workloads.split(",") if w]:
        res = run_workload(w, counts[w] // div)
        print(json.dumps(res), flush=True)
        results.append(res)
    if not args.no_x4:
        for w in [w for w in args.x4_workloads.split(",") if w]:
            res = run_workload(w, 4 * counts[w] // div, num_routers=4)
            print(json.dumps(res), flush=True)
            results.append(res)
    for r in results:
        print(f"{r['case']:<7} p50={r['step_us_p50']:>8}us p90={r['step_us_p90']:>8}us "
              f"steps={r['num_steps']:>5} preempt={r['preemptions']:>4} "
              f"hit={r['prefix_hit_rate']:.3f} ref_ratio={r['vs_reference_ratio']} "
              f"phases={r['phase_us_mean']}", file=sys.stderr)
    if args.profile:
        print(profile_workload(args.profile, counts[args.profile] // div, args.profile_top),
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
