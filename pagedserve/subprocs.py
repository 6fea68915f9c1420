"""Small helpers for the processes benchmarks, tests and tools start."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterable


def stop_processes(procs: Iterable[subprocess.Popen], timeout_s: float = 30.0) -> None:
    """SIGTERM to every process still running (a pagedserve server drains and exits), then
    SIGKILL to any still running `timeout_s` later; every one is reaped."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def stop_process(proc: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """`stop_processes` for one process; returns its exit code."""
    stop_processes([proc], timeout_s)
    return proc.wait()
