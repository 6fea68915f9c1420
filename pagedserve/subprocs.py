"""Small helpers for the processes benchmarks, tests and tools start."""

from __future__ import annotations

import os
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


class ParentWatch:
    """Is the process that started us alive? Reparenting (our parent pid changed) or a
    failed signal-0 probe means no."""

    def __init__(self, parent_pid: int | None) -> None:
        self.pid = parent_pid
        self.direct = parent_pid is not None and parent_pid == os.getppid()

    def alive(self) -> bool:
        if not self.pid:
            return True
        if self.direct and os.getppid() != self.pid:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
