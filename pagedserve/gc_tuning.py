"""The cyclic garbage collector in the long-running processes (router, API workers,
executors).

CPython frees most objects by reference counting; the cyclic collector only finds cycles.
It runs in generations: a young collection every 700 net allocations of container objects,
a full (generation 2) one when the objects promoted since the last full one exceed a quarter
of the old generation. A full collection walks every tracked container object in the
process while the thread holding the GIL waits: with torch imported that is ~200k objects
(30-45 ms on the CPU machine), in a router tens of thousands more per executor's KV blocks
in use. In a serving process that is a stalled event loop: every executor's next plan, every
stream's next token waits for it.

`freeze_heap` (after start-up) moves everything allocated so far -- the imports, the
tokenizer, the model -- into the permanent generation, which collections skip: a full
collection then walks only what serving allocated. Objects that live for the whole process
and are created later (the KV manager's blocks) are kept out of the collector's reach by
their type (kvmanager/block_pool.py). It also raises the young generation's threshold from
700 to `YOUNG_THRESHOLD`: one router step at 256 streams allocates more than 700 short-lived
containers (deltas, scheduled entries, lists), so a young collection ran ~90 times a second,
each walking that step's live objects and promoting them to be walked again; the containers
a step leaves alive are ~2,500 a second, so at 10,000 a young collection runs every few
seconds (step_overhead, fake executor, 256 streams, 2 API workers: the router's collector
0.10-0.13 -> 0.006 ms of CPU a step, one collection ~2.4 ms). Cyclic garbage waits for a
collection that much longer; the serving paths make little (none in a 2-second sample).
`GCPauses` records what collections cost (benchmarks).
"""

from __future__ import annotations

import gc
import time

YOUNG_THRESHOLD = 10_000  # net container allocations between young collections (CPython: 700)


def freeze_heap() -> None:
    """Collect once, then exempt every object that exists now from later collections and
    collect the young generation less often (module docstring). Call it once start-up is
    done; objects made afterwards are collected as usual."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)


class GCPauses:
    """Per generation: collections, seconds inside them (wall clock, and the thread's CPU
    time: on a loaded machine the wall time also counts the thread being descheduled) and the
    longest one, from the collector's own callbacks (`install` / `remove`).
    `snapshot(reset_max=True)` returns the counters and starts a new maximum, so two
    snapshots bound a window's longest pause."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.cpu_seconds = [0.0, 0.0, 0.0]
        self.max_s = [0.0, 0.0, 0.0]
        self._t0 = self._c0 = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            self._c0 = time.thread_time()
            return
        dt = time.perf_counter() - self._t0
        g = info["generation"]
        self.count[g] += 1
        self.seconds[g] += dt
        self.cpu_seconds[g] += time.thread_time() - self._c0
        if dt > self.max_s[g]:
            self.max_s[g] = dt

    def install(self) -> GCPauses:
        gc.callbacks.append(self._callback)
        return self

    def remove(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def snapshot(self, reset_max: bool = False) -> dict:
        """Counters so far, and the number of objects a full collection would walk now
        (`tracked`: every generation, the frozen ones not counted)."""
        snap = {"count": list(self.count), "seconds": list(self.seconds),
                "cpu_seconds": list(self.cpu_seconds), "max_s": list(self.max_s),
                "tracked": len(gc.get_objects()), "frozen": gc.get_freeze_count()}
        if reset_max:
            self.max_s = [0.0, 0.0, 0.0]
        return snap
