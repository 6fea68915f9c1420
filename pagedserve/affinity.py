"""CPU affinity for CPU executors: the compute thread(s) of each executor on cores of their
own, everything else (the router, the executors' I/O and heartbeat threads, clients) on the
remaining cores.

Why: with pipelined steps the router plans step N+1 while the executor computes step N. On a
small machine the OS otherwise places the router's threads, and the executor's own I/O thread
(woken by the executor's main thread, so placed next to it), on the core running the forward
pass, which then runs 20-30% slower than with that core to itself (benchmarks/README.md,
step_overhead). Pinning only applies to CPU executors, and only when every executor's
`--cpu-threads` cores still leave at least one core for the rest.

    --cpu-affinity auto   serve: assign cores as above (the default); executor: no pinning
    --cpu-affinity off    no pinning anywhere
    --cpu-affinity 2-3    executor: its compute threads on cores 2 and 3 (a list: 1,3 / 0-1,4)
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


class AffinityError(ValueError):
    """A --cpu-affinity value that is not auto, off or a list of usable cores."""


def available_cores() -> list[int]:
    if not hasattr(os, "sched_getaffinity"):
        return []
    return sorted(os.sched_getaffinity(0))


def cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs' worth of time this process's cgroup may use (a container's or pod's CPU
    limit), from cgroup v2's ``cpu.max`` or v1's CFS quota; None when unlimited or unknown.
    A pod limited to 2 CPUs on a 64-core node sees all 64 in its affinity."""
    base = Path(root)
    try:
        quota, period = (base / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((base / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((base / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def usable_cores() -> float:
    """The cores this process may run on, capped by its cgroup's CPU quota."""
    cores = len(available_cores()) or (os.cpu_count() or 1)
    quota = cpu_quota()
    return cores if quota is None else min(cores, quota)


def parse_cores(text: str) -> list[int]:
    """'1' / '2-3' / '0,2-3' -> sorted core ids; raises AffinityError."""
    cores: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            first, last = int(lo), int(hi or lo)
            if first < 0 or last < first:
                raise ValueError
            cores.update(range(first, last + 1))
    except ValueError:
        raise AffinityError(f"--cpu-affinity {text!r}: expected auto, off or cores like "
                            "1 / 2-3 / 0,2-3") from None
    return sorted(cores)


def format_cores(cores: list[int]) -> str:
    return ",".join(map(str, cores))


def plan_serve(num_executors: int, threads_per_executor: int,
               cores: list[int] | None = None) -> tuple[list[list[int]], list[int]] | None:
    """(compute cores of each executor, cores for everything else), or None when pinning
    would leave no core for the router: executors take cores from the end of the list."""
    cores = available_cores() if cores is None else cores
    need = num_executors * threads_per_executor
    if not cores or len(cores) < need + 1:
        return None
    rest = cores[: len(cores) - need]
    per = [cores[len(cores) - (i + 1) * threads_per_executor: len(cores) - i * threads_per_executor]
           for i in range(num_executors)]
    return per, rest


def pin_current_thread(cores: list[int] | set[int]) -> bool:
    """Pin the calling thread (threads it creates later inherit it). False when the platform
    cannot or the cores are not usable here."""
    if not cores or not hasattr(os, "sched_setaffinity"):
        return False
    try:
        os.sched_setaffinity(0, set(cores))
    except OSError:
        return False
    return True


def name_current_thread(name: str) -> bool:
    """Give the calling thread ``name`` (at most 15 bytes kept) as the OS sees it, so that
    top -H, py-spy and /proc (the step-overhead benchmark's CPU a thread) tell the
    executor's threads apart instead of showing each as the interpreter's name. False where
    the platform has no /proc/self/task (the thread keeps its name)."""
    try:
        comm = Path(f"/proc/self/task/{threading.get_native_id()}/comm")
        comm.write_bytes(name.encode()[:15])
    except OSError:
        return False
    return True
