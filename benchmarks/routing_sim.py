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
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
# With ROOT first, `pagedserve` and so its router (pagedserve/__init__.py) are this tree's,
# also in a snapshot (git archive) while another tree is installed in editable mode.

# Record, infinite_bound and BLOCK_SIZE are re-exported: tests/test_routing_sim.py and
# routing_bench.py import them from here.
from routing_cluster import CPU_TINY, Calibration  # noqa: E402
from routing_report import print_table, targets  # noqa: E402
from routing_runner import Record, Simulation, infinite_bound  # noqa: E402, F401
from routing_workloads import BLOCK_SIZE, QUICK_WORKLOADS, WORKLOADS  # noqa: E402, F401

BENCH = "routing_sim"
POLICIES = ("prefix", "round-robin", "least-loaded", "approx-tree")


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




if __name__ == "__main__":
    sys.exit(main())
