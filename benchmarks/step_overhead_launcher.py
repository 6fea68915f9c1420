"""Step overhead's launcher (benchmarks/step_overhead.py): runs inside the router process
(`step_overhead.py --launch TRACE -- <pagedserve args>`), starts `pagedserve` there with
CPU probes around the router's plan, apply and text functions and its gRPC stream handler,
and answers SIGUSR1 with a snapshot of the process's CPU time and the probes' counters, of
its garbage collections (count, time, longest pause per generation) and of its API worker
children's CPU time (`--api-workers`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import os
import signal
import time
from pathlib import Path


class _Phases:
    """Main-thread CPU seconds and calls inside the wrapped router functions."""

    def __init__(self) -> None:
        self.cpu_s: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, owner, attr: str, name: str) -> bool:
        """A plain function: CPU time of each call."""
        fn = getattr(owner, attr, None)
        if fn is None or asyncio.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
            return False
        cpu, calls, clock = self.cpu_s, self.calls, time.thread_time
        cpu[name], calls[name] = 0.0, 0

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                cpu[name] += clock() - t0
                calls[name] += 1

        setattr(owner, attr, timed)
        return True

    def wrap_agen(self, owner, attr: str, name: str) -> bool:
        """An async generator (a gRPC streaming handler): CPU time of its own steps only,
        not of whatever runs on the loop while it waits (each step of the inner awaitable
        is driven here, as an asyncio Task drives a coroutine)."""
        fn = getattr(owner, attr, None)
        if fn is None or not inspect.isasyncgenfunction(fn):
            return False
        cpu, calls, clock = self.cpu_s, self.calls, time.thread_time
        cpu[name], calls[name] = 0.0, 0

        class Step:
            __slots__ = ("aw",)

            def __init__(self, aw) -> None:
                self.aw = aw

            def __await__(self):
                aw, value, exc = self.aw, None, None
                while True:
                    t0 = clock()
                    try:
                        y = aw.throw(exc) if exc is not None else aw.send(value)
                    except StopIteration as stop:
                        cpu[name] += clock() - t0
                        return stop.value
                    except BaseException:
                        cpu[name] += clock() - t0
                        raise
                    cpu[name] += clock() - t0
                    try:
                        value, exc = (yield y), None
                    except BaseException as e:  # noqa: BLE001 - passed on to the handler
                        value, exc = None, e

        @functools.wraps(fn)
        async def timed(*args, **kwargs):
            agen = fn(*args, **kwargs)
            try:
                while True:
                    try:
                        item = await Step(agen.__anext__())
                    except StopAsyncIteration:
                        return
                    calls[name] += 1
                    yield item
            finally:
                await agen.aclose()

        setattr(owner, attr, timed)
        return True


def _thread_cpu_s() -> dict[str, float]:
    """CPU seconds of this process's threads by name (/proc; Linux only)."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc/self/task").glob("*/stat"):
        with contextlib.suppress(OSError):
            text = stat.read_text()
            name = text[text.index("(") + 1:text.rindex(")")]
            fields = text[text.rindex(")") + 2:].split()
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _children(marker: bytes):
    """/proc folders of this process's children whose command line holds ``marker``."""
    me = os.getpid()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError):
            text = (proc / "stat").read_text()
            if int(text[text.rindex(")") + 2:].split()[1]) == me and \
                    marker in (proc / "cmdline").read_bytes():
                yield proc


def _stat_cpu_s(stat: Path) -> tuple[str, float]:
    """(name, user + system CPU seconds) of a /proc stat file."""
    text = stat.read_text()
    fields = text[text.rindex(")") + 2:].split()
    return (text[text.index("(") + 1:text.rindex(")")],
            (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))


def _api_workers_cpu_s() -> float:
    """CPU seconds (all threads) of this process's API worker children (`--api-workers`)."""
    total = 0.0
    for proc in _children(b"pagedserve.router.api_worker"):
        with contextlib.suppress(OSError, ValueError):
            total += _stat_cpu_s(proc / "stat")[1]
    return total


def _executors_cpu_s() -> dict[str, float]:
    """CPU seconds of the executor children's threads, by name, all executors summed; the
    main thread (the one that launches steps and reads their tokens) as "main"."""
    out: dict[str, float] = {}
    for proc in _children(b"pagedserve.cli\x00executor"):
        for stat in proc.glob("task/*/stat"):
            with contextlib.suppress(OSError, ValueError):
                name, cpu = _stat_cpu_s(stat)
                name = "main" if stat.parent.name == proc.name else name
                out[name] = out.get(name, 0.0) + cpu
    return out


def launch(trace_path: str, argv: list[str]) -> int:
    """Start `pagedserve <argv>` in this process with the CPU probes (the router writes the
    step trace itself, PAGEDSERVE_STEP_TRACE set by the caller)."""
    from pagedserve.router import delivery, grpc_server, step_loop

    from pagedserve.gc_tuning import GCPauses

    phases = _Phases()
    gc_pauses = GCPauses().install()
    patched = [name for owner, attr, name in (
        (step_loop.StepLoop, "send_next_plan", "plan"),
        (step_loop.StepLoop, "apply_tokens", "apply"),
        (delivery.Delivery, "text_stage", "text"),
    ) if phases.wrap(owner, attr, name)]
    if phases.wrap_agen(grpc_server.GeneratorServicer, "Stream", "edge"):
        patched.append("edge")
    snap_path = trace_path + ".snap"
    seq = [0]

    def snapshot(*_):  # a Python signal handler: runs in the main thread, the loop's
        seq[0] += 1
        data = {"seq": seq[0], "t": time.monotonic(), "cpu_s": time.process_time(),
                "main_cpu_s": time.thread_time(), "threads_cpu_s": _thread_cpu_s(),
                "api_workers_cpu_s": _api_workers_cpu_s(),
                "executors_cpu_s": _executors_cpu_s(),
                "phase_cpu_s": dict(phases.cpu_s), "phase_calls": dict(phases.calls),
                "patched": patched, "gc": gc_pauses.snapshot(reset_max=True),
                "event_loop": type(asyncio._get_running_loop()).__module__}
        tmp = snap_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, snap_path)

    signal.signal(signal.SIGUSR1, snapshot)
    from pagedserve.cli import main
    return main(argv)
