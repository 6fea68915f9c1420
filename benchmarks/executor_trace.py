"""Where a pipelined step's period goes: a pipelined loop of executor_steps
(`pipelined_steps`, or `serve_loop_steps` as `serve` waits) under torch.profiler, with the
model runner's phases timed on the host and marked in the trace (executor_bench.py
``--profile``: ``trace_gpu_b256_{pipelined,serve_loop}``). The phases and the device
timeline's figures are executor/step_trace.py's (the executor's own profiling window,
``PAGEDSERVE_TORCH_PROFILER_DIR``): per measured step, the host's phases on the main
thread, the rest of the loop (``loop_other_us``), and on a GPU the device's busy and idle
time and the host phase each idle stretch began and ended in. With ``trace_dir`` the
Chrome trace is written there too (gzip), to read in Perfetto.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch
from executor_steps import pipelined_steps
from pagedserve.executor.model_runner import ModelRunner
from pagedserve.executor.step_trace import Phases, device_timeline, export_trace


def trace_pipelined(runner: ModelRunner, plans, warmup: int = 3,
                    trace_dir: str | None = None, case: str = "trace",
                    loop=pipelined_steps) -> dict:
    """Run ``plans`` through ``loop`` under the profiler; the figures above."""
    from torch.profiler import ProfilerActivity, profile

    cuda = runner.device.type == "cuda"
    phases = Phases(reset_at_step=warmup)
    phases.wrap_runner(runner)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        with profile(activities=activities) as prof:
            run = loop(runner, plans, warmup=warmup)
            if cuda:
                torch.cuda.synchronize()
    finally:
        phases.restore()
    measured = len(run["periods"])
    period_s = statistics.fmean(run["periods"])
    host = phases.per_step_us(measured)
    host["loop_other_us"] = round(period_s * 1e6 - host.get("submit", 0.0), 1)
    figures = {"steps": measured, "step_us_mean": round(period_s * 1e6, 1),
               "host_us_per_step": host,
               "gap_us_p50": round(statistics.median(run["gaps"]) * 1e6, 1)}
    if cuda:
        figures.update(device_timeline(prof, measured, skip_share=warmup / (measured + warmup)))
    if trace_dir:
        figures["trace"] = str(export_trace(prof, Path(trace_dir) / f"{case}.json"))
    return figures
