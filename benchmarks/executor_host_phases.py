"""Where the executor's host time goes, phase by phase (`executor_host.py --phases`): inside
the executor process on the virtual device, each phase below is timed where it runs (CPU
time of the calling thread and wall time, which includes waits for the GIL), by thread.
Phases nest (`execute` holds `prepare`, `forward`, ...); the timers cost ~1 µs a call, so
read these figures against a run without them.

    main thread: execute (a plan, whole), prepare (feed and tables), forward (the fed
        replay's host side: pack, ring copy, launch), sample_launch, read_back (the step in
        flight read back, StepResult built), record_samples, queue_result, wake_io
    I/O thread: poll, recv, decode, precompute, encode, send
"""

from __future__ import annotations

import importlib
import threading
import time

# (module, attribute path, label): each wrapped in the executor process.
PHASES = (
    ("pagedserve.executor.process", "ExecutorProcess._execute", "execute"),
    ("pagedserve.executor.model_runner", "ModelRunner._prepare", "prepare"),
    ("pagedserve.executor.model_runner", "ModelRunner._forward", "forward"),
    ("pagedserve.executor.sampler", "Sampler.launch", "sample_launch"),
    ("pagedserve.executor.model_runner", "ModelRunner._resolve", "read_back"),
    ("pagedserve.executor.step_records", "PendingSamples.apply", "record_samples"),
    ("pagedserve.executor.io_threads", "MainSocketIO.send", "queue_result"),
    ("pagedserve.executor.io_threads", "MainSocketIO.flush", "wake_io"),
    ("zmq", "Poller.poll", "poll"),
    ("pagedserve.executor.io_threads", "recv_frames", "recv"),
    ("pagedserve.protos.codec", "Codec.decode", "decode"),
    ("pagedserve.executor.model_runner", "ModelRunner.precompute", "precompute"),
    ("pagedserve.protos.codec", "Codec.encode", "encode"),
    ("pagedserve.executor.io_threads", "send_frames", "send"),
)

THREAD_KEYS = {"MainThread": "main", "executor-io": "io"}  # others are not reported


def install():
    """Wrap every phase; returns ``snapshot()``: {thread: {label: [cpu us, wall us, calls]
    a plan executed]}}."""
    totals: dict[tuple[str, str], list[float]] = {}
    lock = threading.Lock()

    def wrap(owner, attr: str, label: str) -> None:
        inner = getattr(owner, attr)

        def timed(*args, **kwargs):
            cpu0, wall0 = time.thread_time(), time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
                key = (threading.current_thread().name, label)
                with lock:
                    slot = totals.setdefault(key, [0.0, 0.0, 0])
                    slot[0] += cpu
                    slot[1] += wall
                    slot[2] += 1
        setattr(owner, attr, timed)

    for module, path, label in PHASES:
        owner = importlib.import_module(module)
        *parents, attr = path.split(".")
        for name in parents:
            owner = getattr(owner, name)
        wrap(owner, attr, label)

    def snapshot() -> dict:
        with lock:
            plans = totals.get(("MainThread", "execute"), [0, 0, 0])[2] or 1
            out: dict[str, dict] = {}
            for (thread, label), (cpu, wall, calls) in totals.items():
                key = THREAD_KEYS.get(thread)
                if key is not None:
                    out.setdefault(key, {})[label] = [round(cpu / plans * 1e6, 1),
                                                      round(wall / plans * 1e6, 1),
                                                      round(calls / plans, 2)]
            return out

    return snapshot
