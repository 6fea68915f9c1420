"""What a step's read-back objects cost the host (executor/host_pool.py): CUDA timing
events and the pinned host buffer the sampled tokens are copied into, made fresh every step
(as before the pool) against taken from a HostPool and given back. Host time per call, the
mean of ``--calls``; the device only copies a few hundred bytes, so the host's side is the
figure. One JSON line per case (DESIGN §8):

    event_record_fresh / _pooled      a timing event made and recorded / one recorded again
    event_record_pooled_stream        the same given the current stream (record() looks
                                      it up otherwise: a Python Stream object a call)
    tokens_copy_fresh / _pooled       256 int64 tokens to a pinned host buffer (allocated /
                                      the pool's), queued with non_blocking
    read_back_fresh / _pooled         a plain greedy step's whole read-back, as the sampler
                                      and runner do it: the tokens' copy, its event, the
                                      forward's two events, synchronize, result(), three
                                      elapsed times (the pool's objects given back a step later)
    event_query, event_elapsed        one query of a done event; one elapsed_time

On a CPU only the buffer cases run (no pinning, no events: the pool's copy against a clone).

    python benchmarks/host_sync_bench.py [--calls 2000] [--rows 256]
"""

from __future__ import annotations

import argparse
import json
import time


def _timed(calls: int, fn) -> float:
    for _ in range(min(50, calls)):  # warm: the allocators' caches, the driver's
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rows", type=int, default=256)
    args = ap.parse_args(argv)
    import torch
    from pagedserve.executor.host_pool import HostPool
    from pagedserve.executor.sampler import Sampler

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    tokens = torch.arange(args.rows, dtype=torch.int64, device=device)
    cases: dict[str, float] = {}

    def emit(case: str, us: float) -> None:
        cases[case] = us
        print(json.dumps({"bench": "host_sync_bench", "case": case, "device": device.type,
                          "rows": args.rows, "calls": args.calls,
                          "us_per_call": round(us, 2)}), flush=True)

    pool = HostPool(device)
    if cuda:
        def fresh_event():
            torch.cuda.Event(enable_timing=True).record()

        reused = torch.cuda.Event(enable_timing=True)
        emit("event_record_fresh", _timed(args.calls, fresh_event))
        emit("event_record_pooled", _timed(args.calls, reused.record))
        stream = torch.cuda.current_stream()  # record() looks it up when not given
        emit("event_record_pooled_stream", _timed(args.calls, lambda: reused.record(stream)))
        torch.cuda.synchronize()
        emit("event_query", _timed(args.calls, reused.query))
        other = torch.cuda.Event(enable_timing=True)
        other.record()
        torch.cuda.synchronize()
        emit("event_elapsed", _timed(args.calls, lambda: reused.elapsed_time(other)))

    def fresh_copy():
        out = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=cuda)
        out.copy_(tokens, non_blocking=cuda)

    def pooled_copy():
        out, base = pool.buffer(tuple(tokens.shape), tokens.dtype)
        out.copy_(tokens, non_blocking=cuda)
        pool.give([base])

    emit("tokens_copy_fresh", _timed(args.calls, fresh_copy))
    emit("tokens_copy_pooled", _timed(args.calls, pooled_copy))
    if cuda:
        torch.cuda.synchronize()
        for case, use_pool in (("read_back_fresh", False), ("read_back_pooled", True)):
            emit(case, _read_back(args.calls, tokens, HostPool(device) if use_pool else None,
                                  Sampler()))
    return 0


def _read_back(calls: int, tokens, pool, sampler) -> float:
    """A plain greedy graph step's read-back objects, as model_runner and the sampler use
    them: the forward's event pair, the tokens' pooled (or fresh) copy and its event, then
    the result and the three elapsed times; each step's objects given back a step later."""
    import torch

    sampler.pool = pool
    held: list = []

    def step() -> None:
        events = (pool.timing_pair() if pool is not None else
                  (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
        events[0].record()
        events[1].record()
        sampled = sampler._plain_output(tokens)
        sampled.result()
        events[0].elapsed_time(events[1])
        sampled.elapsed_s(events[1])
        if held:
            held[0].elapsed_time(events[0])  # the previous step's end: this step's gap
        if pool is not None and len(held) > 1:
            pool.give(held[1])
        held[:] = [sampled.event, [*events, *sampled.pooled()]]

    return _timed(calls, step)


if __name__ == "__main__":
    raise SystemExit(main())
