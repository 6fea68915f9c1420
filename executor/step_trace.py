"""A window of executor steps under torch.profiler: where a step's period goes.

For operators and the GPU check: ``PAGEDSERVE_TORCH_PROFILER_DIR=DIR`` makes an executor
profile the steps from ``first`` on, ``count`` of them
(``PAGEDSERVE_TORCH_PROFILER_STEPS="<first>:<count>"``, default ``100:20``), then write
their Chrome trace (``DIR/<executor id>-steps<first>-<last>.json.gz``, for Perfetto) and a
summary beside it (``.summary.json``). A malformed value stops the executor at start.
Profiling slows the profiled steps (every torch operator is recorded) and writing the trace
stalls the executor once, between two steps, for about a second.

The summary, per profiled step: the host's phases on the main thread (`Phases`: `submit`
as a whole and inside it preparing the batch, launching the forward and the logits, reading
the previous step back (its tokens' wait and its result), appending the tokens to the
sampling states, launching the sampling), the rest of the main loop (``loop_other_us``:
waiting for plans, the socket hand-offs), the I/O thread's plan preparation
(``io_precompute``), and on a GPU the device's busy and idle time from the kernel timeline:
the idle stretches over 10 us, and the host phase the main thread was in when each began
and ended (the device runs out of work while the host is in the first, and gets work again
from the second). The phases are timed by wrapping the runner's methods only while
profiling: nothing is added to a step otherwise.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import shutil
import statistics
import time
from collections import Counter
from pathlib import Path

import torch

log = logging.getLogger(__name__)

PROFILER_DIR_ENV = "PAGEDSERVE_TORCH_PROFILER_DIR"
PROFILER_STEPS_ENV = "PAGEDSERVE_TORCH_PROFILER_STEPS"
DEFAULT_STEPS = (100, 20)
IDLE_MIN_US = 10.0


class Phases:
    """Wraps callables so that each call is timed (perf_counter) and marked in a profile
    (``phase::<name>``); `restore` puts the originals back."""

    def __init__(self, reset_at_step: int = -1) -> None:
        self.reset_at_step = reset_at_step  # forget what came before this step's submit
        self.total_s: Counter = Counter()
        self.calls: Counter = Counter()
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
            with torch.profiler.record_function(f"phase::{phase}"):
                t0 = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    self.total_s[phase] += time.perf_counter() - t0
                    self.calls[phase] += 1

        setattr(owner, attr, timed)
        self._restore.append((owner, attr, original, had_own))

    def wrap_runner(self, runner) -> None:
        """The model runner's phases (model_runner.py)."""
        self.wrap(runner, "submit", "submit")
        self.wrap(runner, "_prepare", "prepare")
        self.wrap(runner, "_forward", "forward_launch")
        self.wrap(runner.model, "compute_logits", "logits_launch")
        self.wrap(runner, "_resolve", "read_back")
        self.wrap(runner._pending, "resolve", "read_back")
        self.wrap(runner._pending, "apply", "append_tokens")
        self.wrap(runner.sampler, "launch", "sampler_launch")

    def restore(self) -> None:
        for owner, attr, original, had_own in reversed(self._restore):
            if had_own:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)
        self._restore.clear()

    def per_step_us(self, steps: int) -> dict[str, float]:
        return {name: round(total / max(1, steps) * 1e6, 1)
                for name, total in self.total_s.items()}


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def _innermost(ranges: list[tuple[float, float, str]], at: float) -> str:
    """The innermost marked phase of the main thread covering time ``at`` (µs)."""
    best, best_len = "loop", float("inf")
    for start, end, name in ranges:
        if start <= at <= end and end - start < best_len:
            best, best_len = name, end - start
    return best


def device_timeline(prof, steps: int, skip_share: float = 0.0) -> dict:
    """The device's busy and idle time per step from a CUDA profile (its kernels, copies
    and memsets), after the first ``skip_share`` of it (warm-up), and the host phase
    (`Phases` ranges of the main thread) where each idle stretch began and ended."""
    from torch.autograd import DeviceType

    events = prof.events()
    busy = _merged([(e.time_range.start, e.time_range.end) for e in events
                    if e.device_type == DeviceType.CUDA
                    and e.time_range.end > e.time_range.start])
    if len(busy) < 2:
        return {}
    busy = busy[int(len(busy) * skip_share):]
    phase_events = [e for e in events if e.name.startswith("phase::")
                    and e.device_type == DeviceType.CPU]
    main = Counter(e.thread for e in phase_events if e.name == "phase::submit")
    main_thread = main.most_common(1)[0][0] if main else None
    ranges = [(e.time_range.start, e.time_range.end, e.name[len("phase::"):])
              for e in phase_events if e.thread == main_thread]
    window = busy[-1][1] - busy[0][0]
    busy_us = sum(b - a for a, b in busy)
    idles = [(busy[i][1], busy[i + 1][0]) for i in range(len(busy) - 1)
             if busy[i + 1][0] - busy[i][1] > IDLE_MIN_US]
    lengths = [b - a for a, b in idles]
    by_end: Counter = Counter()
    for a, b in idles:
        by_end[_innermost(ranges, b - 1.0)] += b - a
    n = max(1, steps)
    return {
        "device_window_us_per_step": round(window / n, 1),
        "device_busy_us": round(busy_us / n, 1),
        "device_idle_us": round((window - busy_us) / n, 1),
        "idle_stretches_per_step": round(len(idles) / n, 2),
        "idle_stretch_us_p50": round(statistics.median(lengths), 1) if lengths else 0.0,
        "idle_stretch_us_max": round(max(lengths), 1) if lengths else 0.0,
        "idle_starts_in": dict(Counter(_innermost(ranges, a) for a, _ in idles)),
        "idle_ends_in": dict(Counter(_innermost(ranges, b - 1.0) for _, b in idles)),
        "idle_us_by_end_phase": {k: round(v / n, 1) for k, v in by_end.items()},
    }


def export_trace(prof, path: Path) -> Path:
    """The profile's Chrome trace, gzipped, at ``path`` + ``.gz``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    gz = path.with_name(path.name + ".gz")
    with open(path, "rb") as src, gzip.open(gz, "wb") as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()
    return gz


def profiler_from_env(environ=os.environ) -> tuple[Path, int, int] | None:
    """(folder, first step, step count) from the environment; None when the folder is not
    set. Raises ValueError (one line) when a value is malformed."""
    folder = environ.get(PROFILER_DIR_ENV)
    if not folder:
        return None
    value = environ.get(PROFILER_STEPS_ENV, "")
    first, count = DEFAULT_STEPS
    if value:
        try:
            first_s, count_s = value.split(":")
            first, count = int(first_s), int(count_s)
        except ValueError:
            raise ValueError(f"{PROFILER_STEPS_ENV}={value!r}: expected <first step>:<count>"
                             ) from None
        if first < 0 or count < 1:
            raise ValueError(f"{PROFILER_STEPS_ENV}={value!r}: first must be >= 0 and "
                             "count >= 1")
    return Path(folder), first, count


class StepProfiler:
    """Profiles ``count`` steps of an executor from step ``first`` on (the process calls
    `before_step` ahead of every plan; steps are counted as plans run, whatever their ids
    past ``first``), then writes the trace and the summary once the plan after them comes
(or the executor stops: `close`) and stays off."""

    def __init__(self, runner, folder: Path, first: int, count: int, name: str,
                 io_owner=None) -> None:
        self.runner, self.folder, self.first, self.count = runner, folder, first, count
        self.name = name
        self.io_owner = io_owner  # has a `precompute` attribute run on the I/O thread
        self._prof = None
        self._phases: Phases | None = None
        self._steps = 0
        self._t0 = 0.0
        self._first_id = self._last_id = -1
        self.done = False
        self.written: list[Path] = []

    def before_step(self, step_id: int) -> None:
        """Called ahead of every plan. Never raises: a profiler that fails is logged and
        switched off, and serving goes on."""
        if self.done:
            return
        try:
            if self._prof is None:
                if step_id >= self.first:
                    self._start(step_id)
                    self._last_id = step_id
                return
            self._steps += 1
            if self._steps >= self.count:
                self._stop(self._last_id)
            self._last_id = step_id
        except Exception:  # noqa: BLE001 - a diagnostic must not stop serving
            self._abandon()

    def close(self) -> None:
        """The executor stops: write what was profiled, if anything (the last step's
        device work included)."""
        if self._prof is not None and not self.done:
            self._steps += 1
            try:
                self._stop(self._last_id)
            except Exception:  # noqa: BLE001
                self._abandon()

    def _abandon(self) -> None:
        log.exception("profiling steps from %d failed; profiling off", self.first)
        self.done = True
        if self._phases is not None:
            self._phases.restore()
        if self._prof is not None:
            with contextlib.suppress(Exception):
                self._prof.__exit__(None, None, None)
        self._prof = self._phases = None

    def _start(self, step_id: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        cuda = self.runner.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self._phases = Phases()
        self._phases.wrap_runner(self.runner)
        if self.io_owner is not None and getattr(self.io_owner, "precompute", None):
            self._phases.wrap(self.io_owner, "precompute", "io_precompute")
        self._prof = profile(activities=activities)
        self._prof.__enter__()
        self._t0 = time.perf_counter()
        self._first_id = step_id
        log.warning("profiling %d steps from step %d (%s)", self.count, step_id,
                    PROFILER_DIR_ENV)

    def _stop(self, last_id: int) -> None:
        cuda = self.runner.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.runner.device)
        wall_s = time.perf_counter() - self._t0
        prof, phases = self._prof, self._phases
        prof.__exit__(None, None, None)
        phases.restore()
        self.done = True
        n = self._steps
        host = phases.per_step_us(n)
        host["loop_other_us"] = round(wall_s / n * 1e6 - host.get("submit", 0.0), 1)
        summary = {"executor": self.name, "first_step": self._first_id, "last_step": last_id,
                   "steps": n, "step_us_mean": round(wall_s / n * 1e6, 1),
                   "host_us_per_step": host}
        if cuda:
            summary.update(device_timeline(prof, n))
        base = self.folder / f"{self.name}-steps{self._first_id}-{last_id}.json"
        try:
            self.written = [export_trace(prof, base)]
            summary_path = base.with_name(base.stem + ".summary.json")
            summary_path.write_text(json.dumps(summary) + "\n")
            self.written.append(summary_path)
            log.warning("profiled steps %d-%d: %s", self._first_id, last_id,
                        ", ".join(map(str, self.written)))
        except OSError as exc:
            log.error("profiled steps %d-%d: could not write to %s: %s", self._first_id,
                      last_id, self.folder, exc)
        self._prof = self._phases = None
