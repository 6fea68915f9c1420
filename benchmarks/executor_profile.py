"""executor_bench.py's profiles (``--profile``): a step's device kernels (torch.profiler), its
host side (cProfile), and the mixed steps' both plus their period in the executor's own loop.
Each prints one JSON line (executor_bench's ``emit``)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from executor_steps import randomise_cache, serve_loop_steps
from pagedserve.executor.model_runner import ModelRunner

BENCH = "executor_bench"


def emit(case: str, **figures) -> None:
    print(json.dumps({"bench": BENCH, "case": case, **figures}), flush=True)


def fresh_runner(model, cache, graphs, mixed_graphs) -> ModelRunner:
    """A runner over ``cache`` refilled with random keys and values (GPU cases)."""
    randomise_cache(cache.kv_cache)
    return ModelRunner(model, cache, graphs=graphs, mixed_graphs=mixed_graphs)


def profile_steps(runner: ModelRunner, plans, case: str, top: int = 12) -> None:
    """The plans' steps under torch.profiler (the first three as warm-up, outside it): per
    measured step, device kernels (CUDA) or aten operators (CPU) by total time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    plans = list(plans)
    warm, measured = plans[:3], plans[3:]
    cuda = runner.device.type == "cuda"
    for plan in warm:
        runner.execute(plan)
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for plan in measured:
            runner.execute(plan)
        if cuda:
            torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / len(measured)
    rows = []
    for evt in prof.key_averages():
        if cuda:
            if evt.device_type != DeviceType.CUDA:
                continue
            total = getattr(evt, "self_device_time_total", None)
            if total is None:
                total = evt.self_cuda_time_total
        else:
            if not evt.key.startswith("aten::"):
                continue
            total = evt.self_cpu_time_total
        rows.append((total, evt.count, evt.key))
    rows.sort(reverse=True)
    n = len(measured)
    emit(case, steps=n, wall_us_per_step=round(wall * 1e6, 1),
         kernels_per_step=round(sum(c for _, c, _ in rows) / n, 1),
         kernel_us_per_step=round(sum(t for t, _, _ in rows) / n, 1),
         unit="device kernels" if cuda else "aten operators (self CPU time)",
         top=[{"name": name[:90], "per_step": round(count / n, 1),
               "us_per_step": round(total / n, 1)} for total, count, name in rows[:top]])


def host_profile_steps(runner: ModelRunner, plans, case: str, top: int = 15) -> None:
    """The plans' steps under cProfile (the first three as warm-up, outside it): the host's
    side of a step, the functions by their own time per measured step. Where an eager step's
    host time goes (Triton's launcher, torch's operators, pagedserve's own Python); cProfile
    adds its own cost to each call, so read the shares, not the microseconds."""
    import cProfile
    import pstats

    plans = list(plans)
    for plan in plans[:3]:
        runner.execute(plan)
    measured = plans[3:]
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    results = [runner.execute(plan) for plan in measured]
    prof.disable()
    assert not any(r.errors for r in results), [r.errors for r in results if r.errors][0]
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / len(measured)
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, _, own s, cumulative s, _)
    n = len(measured)
    rows = sorted(((own, calls, f"{Path(f).name}:{line}({name})")
                   for (f, line, name), (calls, _, own, _, _) in stats.items()), reverse=True)
    emit(case, steps=n, wall_us_per_step=round(wall * 1e6, 1),
         profiled_us_per_step=round(sum(r[0] for r in rows) / n * 1e6, 1),
         calls_per_step=round(sum(r[1] for r in rows) / n, 1), unit="cProfile own time",
         top=[{"name": name[:90], "calls_per_step": round(calls / n, 1),
               "us_per_step": round(own / n * 1e6, 1)} for own, calls, name in rows[:top]])


def profile_mixed(new_runner, plans, serve_plans, case: str, decode_step_s: float,
                  **figures) -> None:
    """Where a mixed step's time goes (prompt tokens beside the decodes): its kernels
    (``profile_<case>``; on a GPU the prefill kernel runs the decode rows too, one program
    a sequence and KV head) and its host side (``host_profile_<case>``), then the same
    steps in the executor's own loop (``serve_loop_<case>``: step period, gap and forward
    p50), where the host's part overlaps the step before; the synchronous p50 adds the two.
    ``new_runner()`` makes a fresh runner, ``plans()`` / ``serve_plans()`` fresh plans."""
    profile_steps(new_runner(), plans(), f"profile_{case}", top=15)
    host_profile_steps(new_runner(), plans(), f"host_profile_{case}")
    runner = new_runner()
    run = serve_loop_steps(runner, serve_plans(), warmup=3)
    period = statistics.fmean(run["periods"])
    emit(f"serve_loop_{case}", **figures, step_us_mean=round(period * 1e6, 1),
         vs_decode_step_ratio=round(period / decode_step_s, 3),
         gap_us_p50=round(statistics.median(run["gaps"]) * 1e6, 1),
         forward_us_p50=round(statistics.median(run["forwards"]) * 1e6, 1),
         mixed_graph_steps=runner.mixed_graph_steps, steps=len(run["periods"]))
