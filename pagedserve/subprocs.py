"""Small helpers for the processes benchmarks, tests and tools start."""

from __future__ import annotations

import signal
import subprocess


def stop_process(proc: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """SIGTERM (a pagedserve server drains and exits), then SIGKILL after `timeout_s`;
    returns the exit code. A process that already exited is only reaped."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()
