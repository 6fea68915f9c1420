"""Where a pipelined step's period goes: the executor's pipelined loop (executor_steps.
`pipelined_steps`, as `serve` runs it without the router) under torch.profiler, with the
model runner's phases timed on the host and marked in the trace (executor_bench.py
``--profile``: ``trace_gpu_b256_pipelined``).

Figures per measured step: the host's phases on the main thread (``host_us_per_step``:
`submit` as a whole and inside it preparing the batch, launching the forward and the
logits, reading the previous step back (`_resolve`: the wait for its tokens and building
its result), appending its tokens to the sampling states, launching the sampling), the
rest of the loop (``loop_other_us``: waiting for the next plan, handing results over);
on a GPU the device's side from the kernel timeline (``device_busy_us``, ``device_idle_us``
and the idle stretches over 10 us), and which host phase the main thread was in when each
such stretch began and ended (``idle_starts_in`` / ``idle_ends_in``): the device runs out
of work while the host is still in that phase, and gets work again from that one.
With ``trace_dir`` the Chrome trace is written there too (gzip), to read in Perfetto.
"""

from __future__ import annotations

import gzip
import shutil
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
from executor_steps import pipelined_steps
from pagedserve.executor.model_runner import ModelRunner

IDLE_MIN_US = 10.0


class _Phases:
    """Wraps callables so each call is timed (perf_counter) and marked in the profile."""

    def __init__(self, reset_at_step: int) -> None:
        self.reset_at_step = reset_at_step  # forget what came before this step's submit
        self.total_s: Counter = Counter()
        self.calls: Counter = Counter()
        self.ranges: list[tuple[float, float, str]] = []  # perf_counter (start, end, phase)
        self._restore: list[tuple[object, str, object, bool]] = []

    def wrap(self, owner: object, attr: str, phase: str) -> None:
        """Time ``owner.attr``: on the instance, or on its class where slots forbid that
        (every instance then, until `restore`)."""
        if not hasattr(owner, "__dict__") and attr not in getattr(type(owner), "__slots__", ()):
            owner = type(owner)  # a method of a class with __slots__
        original = getattr(owner, attr)
        had_own = attr in getattr(owner, "__dict__", {}) or isinstance(owner, type)

        def timed(*args, **kwargs):
            if phase == "submit" and getattr(args[0], "step_id", -1) == self.reset_at_step:
                self.total_s.clear()
                self.calls.clear()
                self.ranges.clear()
            with torch.profiler.record_function(f"phase::{phase}"):
                t0 = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    t1 = time.perf_counter()
                    self.total_s[phase] += t1 - t0
                    self.calls[phase] += 1
                    self.ranges.append((t0, t1, phase))

        setattr(owner, attr, timed)
        self._restore.append((owner, attr, original, had_own))

    def restore(self) -> None:
        for owner, attr, original, had_own in reversed(self._restore):
            if had_own:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)
        self._restore.clear()


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def _innermost(ranges: list[tuple[float, float, str]], at: float) -> str:
    """The innermost marked phase (of the profile's ranges, µs) covering time ``at``."""
    best, best_len = "loop", float("inf")
    for start, end, name in ranges:
        if start <= at <= end and end - start < best_len:
            best, best_len = name, end - start
    return best


def trace_pipelined(runner: ModelRunner, plans, warmup: int = 3,
                    trace_dir: str | None = None, case: str = "trace",
                    loop=pipelined_steps) -> dict:
    """Run ``plans`` through a pipelined loop (executor_steps: `pipelined_steps` or
    `serve_loop_steps`) under the profiler; the figures above."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = runner.device.type == "cuda"
    phases = _Phases(reset_at_step=warmup)
    phases.wrap(runner, "submit", "submit")
    phases.wrap(runner, "_prepare", "prepare")
    phases.wrap(runner, "_forward", "forward_launch")
    phases.wrap(runner.model, "compute_logits", "logits_launch")
    phases.wrap(runner, "_resolve", "read_back")
    phases.wrap(runner._pending, "resolve", "read_back")
    phases.wrap(runner._pending, "apply", "append_tokens")
    phases.wrap(runner.sampler, "launch", "sampler_launch")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        with profile(activities=activities) as prof:
            run = loop(runner, plans, warmup=warmup)
            if cuda:
                torch.cuda.synchronize()
    finally:
        phases.restore()
    measured = len(run["periods"])
    steps = measured + warmup
    period_s = statistics.fmean(run["periods"])
    host = {name: round(total / measured * 1e6, 1) for name, total in phases.total_s.items()}
    host["loop_other_us"] = round(period_s * 1e6 - host.get("submit", 0.0), 1)
    figures = {"steps": measured, "step_us_mean": round(period_s * 1e6, 1),
               "host_us_per_step": host,
               "gap_us_p50": round(statistics.median(run["gaps"]) * 1e6, 1)}
    events = prof.events()
    if cuda:
        kernels = [(e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start]
        busy = _merged(kernels)
        ranges = [(e.time_range.start, e.time_range.end, e.name[len("phase::"):])
                  for e in events if e.name.startswith("phase::")
                  and e.device_type == DeviceType.CPU]
        busy = busy[len(busy) * warmup // steps:]  # about the warm-up steps' share
        window = busy[-1][1] - busy[0][0]
        busy_us = sum(b - a for a, b in busy)
        idles = [(busy[i][1], busy[i + 1][0]) for i in range(len(busy) - 1)
                 if busy[i + 1][0] - busy[i][1] > IDLE_MIN_US]
        lengths = [b - a for a, b in idles]
        figures.update(
            device_window_us_per_step=round(window / measured, 1),
            device_busy_us=round(busy_us / measured, 1),
            device_idle_us=round((window - busy_us) / measured, 1),
            idle_stretches_per_step=round(len(idles) / measured, 2),
            idle_stretch_us_p50=round(statistics.median(lengths), 1) if lengths else 0.0,
            idle_stretch_us_max=round(max(lengths), 1) if lengths else 0.0,
            idle_starts_in=dict(Counter(_innermost(ranges, a) for a, _ in idles)),
            idle_ends_in=dict(Counter(_innermost(ranges, b - 1.0) for _, b in idles)),
            idle_us_by_end_phase={k: round(v / measured, 1) for k, v in sum(
                (Counter({_innermost(ranges, b - 1.0): b - a}) for a, b in idles),
                Counter()).items()})
    if trace_dir:
        out = Path(trace_dir)
        out.mkdir(parents=True, exist_ok=True)
        raw = out / f"{case}.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
        figures["trace"] = f"{raw}.gz"
    return figures
