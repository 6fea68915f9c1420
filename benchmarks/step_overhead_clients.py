"""Step overhead's clients spread over processes (`step_overhead.py --client-procs N`): one
client process runs every stream's Python on one event loop, and at tens of thousands of
tokens a second (a GPU host at 256 streams) that loop, not the server, can be what limits
`output_tok_per_s`. Here N spawned processes each run every N-th stream over their share of
the gRPC channels; this process coordinates them (ramp-up, the measured window, the end),
reads their CPU time from /proc at the window's edges, and collects every stream's chunk
times, which it summarises as `drive` does (the clocks are the machine's one monotonic
clock). Same figures as one process, with `client_cpu_util_ratio` the processes' sum and
`client_loop_cpu_util_ratio` the busiest one's main thread (near 1.0: that process limits).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import queue
import time

from step_overhead_drive import (
    RAMP_TIMEOUT_S,
    SETTLE_S,
    WARMUP_TOKENS,
    RampError,
    Stream,
    start_streams,
    stop_streams,
    token_watch,
)

RESULT_TIMEOUT_S = 60.0  # for each process's streams after the window


def _cpu_s(pid: int, tid: int | None = None) -> float:
    """CPU seconds (user + system) of process `pid`, or of its thread `tid`."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    with open(path) as f:
        text = f.read()
    fields = text[text.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _client(address: str, indices: list[int], max_tokens: int, vocab: int, stop: list[str],
            channels: int, seed: int, warm, near_end, done, out) -> None:
    """One client process: run the streams `indices`, set `warm` once each has its first
    tokens, `near_end` if one could end, stop when `done` is set, then put
    {index: (times, counts, num_tokens, error)} on `out`."""

    async def main() -> dict:
        import numpy as np

        rng = np.random.default_rng(seed)
        streams = {i: Stream() for i in indices}
        on_tokens = token_watch(len(indices), max_tokens, warm.set, near_end.set)
        opened, tasks = start_streams(address, list(streams.values()), rng, max_tokens, vocab,
                                      stop, channels, on_tokens, near_end.set)
        try:
            while not done.is_set():
                await asyncio.sleep(0.01)
        finally:
            await stop_streams(opened, tasks)
        return {i: (st.times, st.counts, st.num_tokens, st.error) for i, st in streams.items()}

    out.put(asyncio.run(main()))


def drive_procs(address: str, num_streams: int, max_tokens: int, vocab: int,
                window_s: float, server, stop: list[str], seed: int = 0, channels: int = 1,
                procs: int = 2) -> dict:
    """`drive` with the streams spread over `procs` client processes (stream i in process
    i % procs, each with channels // procs connections, at least one)."""
    ctx = mp.get_context("spawn")  # never fork a process that may hold gRPC state
    near_end, done = ctx.Event(), ctx.Event()
    out = ctx.Queue()
    warm = [ctx.Event() for _ in range(procs)]
    per_proc = max(1, channels // procs)
    children = []
    for k in range(procs):
        indices = list(range(k, num_streams, procs))
        p = ctx.Process(target=_client, daemon=True, args=(
            address, indices, max_tokens, vocab, stop, per_proc, seed + k, warm[k], near_end,
            done, out))
        p.start()
        children.append(p)
    results: dict[int, tuple] = {}
    try:
        deadline = time.monotonic() + RAMP_TIMEOUT_S
        while not all(w.is_set() for w in warm) and not near_end.is_set():
            if time.monotonic() > deadline or any(not p.is_alive() for p in children):
                break
            time.sleep(0.01)
        if not all(w.is_set() for w in warm):
            raise RampError(f"only {sum(w.is_set() for w in warm)} of {procs} client "
                            f"processes had all their streams at {WARMUP_TOKENS} tokens "
                            f"before {'one could end' if near_end.is_set() else 'the ramp-up timeout'}")
        time.sleep(SETTLE_S)
        snap0 = server.snapshot()
        t0 = time.monotonic()
        cpu0 = [(_cpu_s(p.pid), _cpu_s(p.pid, p.pid)) for p in children]
        near_end.wait(window_s)
        cpu1 = [(_cpu_s(p.pid), _cpu_s(p.pid, p.pid)) for p in children]
        snap1 = server.snapshot()
        t1 = time.monotonic()
    finally:
        done.set()
        try:
            for _ in children:
                results.update(out.get(timeout=RESULT_TIMEOUT_S))
        except queue.Empty:
            pass
        for p in children:
            p.join(10)
            if p.is_alive():
                p.kill()
    if len(results) != num_streams:
        raise RuntimeError(f"client processes returned {len(results)} of {num_streams} streams")
    streams = []
    for i in range(num_streams):
        times, counts, num_tokens, error = results[i]
        streams.append(Stream(times, counts, num_tokens, error))
    return {"streams": streams, "t0": t0, "t1": t1, "snap0": snap0, "snap1": snap1,
            "errors": [s.error for s in streams if s.error],
            "client_cpu_s": sum(b[0] - a[0] for a, b in zip(cpu0, cpu1, strict=True)),
            "client_loop_cpu_s": max(b[1] - a[1] for a, b in zip(cpu0, cpu1, strict=True)),
            "client_procs": procs}
