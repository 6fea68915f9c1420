"""Step overhead's clients and figures (benchmarks/step_overhead.py): `drive` starts the
streams against a router, waits for ramp-up, measures one window (with the router's CPU
snapshots at its edges) and cancels them; `summarise` turns that window and the router's
step trace into the figures of one case."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from step_overhead_server import Server

PROMPT_LEN = 16
WARMUP_TOKENS = 4  # every stream has this many tokens: ramp-up is over
END_MARGIN_TOKENS = 8  # the window ends this many tokens before a stream could finish
SETTLE_S = 0.3  # after ramp-up, before the window opens
RAMP_TIMEOUT_S = 180.0


class RampError(RuntimeError):
    """The streams never all ran at once (admission slower than the streams' length)."""


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def ms(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x * 1e3, nd)


@dataclass
class Stream:
    times: list[float] = field(default_factory=list)  # monotonic time of each chunk
    counts: list[int] = field(default_factory=list)  # tokens in that chunk
    num_tokens: int = 0
    error: str = ""


async def run_stream(stub, st: Stream, rng, max_tokens: int, vocab: int, stop: list[str],
                     on_tokens, on_error) -> None:
    """One greedy, ignore_eos stream of a random PROMPT_LEN-token prompt: each chunk's time
    and token count into `st`, then `on_tokens(st, tokens before the chunk)`; an RPC error
    is recorded in `st.error` and `on_error()` called (drive and the client processes)."""
    import grpc
    from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb

    req = pb.GenerateRequest(params=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop=stop))
    req.prompt_token_ids.ids.extend(rng.integers(3, vocab, PROMPT_LEN).tolist())
    call = stub.Stream(req)
    try:
        async for chunk in call:
            n = len(chunk.token_ids)
            if not n:
                continue
            st.times.append(time.monotonic())
            st.counts.append(n)
            before = st.num_tokens
            st.num_tokens += n
            on_tokens(st, before)
    except asyncio.CancelledError:
        call.cancel()
        raise
    except grpc.aio.AioRpcError as exc:
        st.error = f"{exc.code().name}: {exc.details()}"
        on_error()


def token_watch(num_streams: int, max_tokens: int, on_all_warm, on_near_end):
    """`run_stream`'s `on_tokens` for `num_streams` streams: `on_all_warm()` once every one
    has WARMUP_TOKENS tokens (ramp-up is over), `on_near_end()` when one could end within
    END_MARGIN_TOKENS (the window must close before ramp-down)."""
    num_warm = [0]

    def on_tokens(st: Stream, before: int) -> None:
        if before < WARMUP_TOKENS <= st.num_tokens:
            num_warm[0] += 1
            if num_warm[0] == num_streams:
                on_all_warm()
        if st.num_tokens >= max_tokens - END_MARGIN_TOKENS:
            on_near_end()

    return on_tokens


def start_streams(address: str, streams: list[Stream], rng, max_tokens: int, vocab: int,
                  stop: list[str], channels: int, on_tokens, on_error) -> tuple[list, list]:
    """Open `channels` gRPC channels (connections) and start one `run_stream` task per
    stream, round robin over them; returns (channels, tasks): the caller cancels the tasks
    and closes the channels."""
    import grpc
    from pagedserve.protos.generated.pagedserve.v1 import generate_pb2_grpc as pb_grpc

    # A local subchannel pool per channel: otherwise channels to one address share a
    # connection (the default of 1 channel is the client as it always was).
    options = [("grpc.use_local_subchannel_pool", 1)] if channels > 1 else []
    opened = [grpc.aio.insecure_channel(address, options=options)
              for _ in range(max(1, channels))]
    stubs = [pb_grpc.GeneratorStub(ch) for ch in opened]
    tasks = [asyncio.ensure_future(run_stream(stubs[k % len(stubs)], st, rng, max_tokens,
                                              vocab, stop, on_tokens, on_error))
             for k, st in enumerate(streams)]
    return opened, tasks


async def stop_streams(opened: list, tasks: list) -> None:
    """Cancel what `start_streams` started and close its channels."""
    try:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for ch in opened:
            await ch.close()


async def drive(address: str, num_streams: int, max_tokens: int, vocab: int,
                window_s: float, server: Server, stop: list[str], seed: int = 0,
                channels: int = 1) -> dict:
    """Start the streams, wait for ramp-up, measure a window, cancel everything. The
    streams go round robin over `channels` gRPC channels (each its own connection: with API
    workers the kernel spreads connections, not streams, over them)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    streams = [Stream() for _ in range(num_streams)]
    warm = asyncio.Event()
    near_end = asyncio.Event()
    on_tokens = token_watch(num_streams, max_tokens, warm.set, near_end.set)
    opened, tasks = start_streams(address, streams, rng, max_tokens, vocab, stop, channels,
                                  on_tokens, near_end.set)
    try:
        ramp = [asyncio.ensure_future(e.wait()) for e in (warm, near_end)]
        await asyncio.wait(ramp, timeout=RAMP_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        for f in ramp:
            f.cancel()
        if not warm.is_set():
            have = sum(st.num_tokens >= WARMUP_TOKENS for st in streams)
            raise RampError(f"only {have} of {num_streams} streams had {WARMUP_TOKENS} "
                            f"tokens before {'one could end' if near_end.is_set() else 'the ramp-up timeout'}"
                            f" ({max(s.num_tokens for s in streams)} tokens at most): no "
                            "steady state")
        await asyncio.sleep(SETTLE_S)
        snap0 = await asyncio.to_thread(server.snapshot)
        t0 = time.monotonic()
        client0 = (time.process_time(), time.thread_time())
        with_end = asyncio.ensure_future(near_end.wait())
        await asyncio.wait({with_end}, timeout=window_s)
        with_end.cancel()
        client1 = (time.process_time(), time.thread_time())
        snap1 = await asyncio.to_thread(server.snapshot)
        t1 = time.monotonic()
    finally:
        await stop_streams(opened, tasks)
    errors = [s.error for s in streams if s.error]
    return {"streams": streams, "t0": t0, "t1": t1, "snap0": snap0, "snap1": snap1,
            "errors": errors,
            # this process's CPU in the window: all threads (gRPC's own included), and the
            # event loop's thread, which runs every stream's Python
            "client_cpu_s": client1[0] - client0[0], "client_loop_cpu_s": client1[1] - client0[1]}


def summarise(run: dict, trace: list[dict]) -> dict:
    t0, t1 = run["t0"], run["t1"]
    window = t1 - t0
    itl: list[float] = []
    tokens = chunks = 0
    for st in run["streams"]:
        prev = None
        for t, n in zip(st.times, st.counts, strict=True):
            if t0 <= t <= t1:
                tokens += n
                chunks += 1
                if prev is not None and prev >= t0:
                    itl.extend([(t - prev) / n] * n)
            prev = t
    steps = [x for x in trace if t0 <= x["t_recv"] <= t1]
    fwd = [x["forward_s"] for x in steps]
    sample = [x["sample_s"] for x in steps]
    gap = [x.get("gap_s", 0.0) for x in steps]
    period, idle = [], []
    by_exec: dict[str, list[dict]] = {}
    for x in trace:
        by_exec.setdefault(x["executor"], []).append(x)
    for lines in by_exec.values():
        for a, b in zip(lines, lines[1:], strict=False):
            if t0 <= a["t_recv"] and b["t_recv"] <= t1:
                p = b["t_recv"] - a["t_recv"]
                period.append(p)
                idle.append(p - b["forward_s"] - b["sample_s"] - b["swap_s"])
    s0, s1 = run["snap0"], run["snap1"]
    n_steps = max(1, len(steps))
    cpu = s1["cpu_s"] - s0["cpu_s"]
    phase = {k: (s1["phase_cpu_s"][k] - s0["phase_cpu_s"].get(k, 0.0))
             for k in s1["phase_cpu_s"]}
    itl50, fwd50 = pct(itl, 0.5), pct(fwd, 0.5)
    res = {
        "window_s": round(window, 3), "steps": len(steps),
        "itl_ms_p50": ms(itl50), "itl_ms_p99": ms(pct(itl, 0.99)),
        "forward_ms_p50": ms(fwd50), "sample_ms_p50": ms(pct(sample, 0.5)),
        "gap_ms_p50": ms(pct(gap, 0.5), 4), "gap_ms_p99": ms(pct(gap, 0.99), 4),
        "gap_reported": any(g > 0 for g in gap),
        "step_period_ms_p50": ms(pct(period, 0.5)),
        "idle_ms_p50": ms(pct(idle, 0.5)), "idle_ms_p99": ms(pct(idle, 0.99)),
        "itl_minus_forward_ms": ms(itl50 - fwd50) if itl50 and fwd50 else None,
        "itl_minus_forward_ratio": round((itl50 - fwd50) / itl50, 4) if itl50 and fwd50
        else None,
        "output_tok_per_s": round(tokens / window, 1) if window > 0 else None,
        # above 1: the edges coalesced tokens into fewer messages (they fell behind)
        "tokens_per_chunk": round(tokens / chunks, 3) if chunks else None,
        "trace_tok_per_s": round(sum(x["num_sampled"] for x in steps) / window, 1)
        if window > 0 else None,
        "router_cpu_ms_per_step": round(cpu / n_steps * 1e3, 4),
        "router_cpu_util_ratio": round(cpu / window, 3) if window > 0 else None,
    }
    if window > 0 and "client_cpu_s" in run:
        # Near 1.0 for the loop's thread, the client (not the server) limits
        # output_tok_per_s: read trace_tok_per_s for what the executors produced.
        res["client_cpu_util_ratio"] = round(run["client_cpu_s"] / window, 3)
        res["client_loop_cpu_util_ratio"] = round(run["client_loop_cpu_s"] / window, 3)
    per_step = lambda x: round(x / n_steps * 1e3, 4)  # noqa: E731
    for k, v in phase.items():
        res[f"{k}_cpu_ms_per_step"] = per_step(v)
    main = s1["main_cpu_s"] - s0["main_cpu_s"]
    # The loop's thread outside the probes: gRPC aio writes, the ZeroMQ link and codec,
    # asyncio itself, metrics; then the other threads (gRPC core, ZeroMQ I/O, /metrics).
    res["loop_other_cpu_ms_per_step"] = per_step(main - sum(phase.values()))
    res["threads_cpu_ms_per_step"] = per_step(cpu - main)
    threads = {k: v - s0["threads_cpu_s"].get(k, 0.0) for k, v in s1["threads_cpu_s"].items()}
    res["top_threads_cpu_ms_per_step"] = {
        k: per_step(v) for k, v in sorted(threads.items(), key=lambda kv: -kv[1])[:4]}
    if "api_workers_cpu_s" in s1 and s1["api_workers_cpu_s"]:
        workers = s1["api_workers_cpu_s"] - s0.get("api_workers_cpu_s", 0.0)
        res["worker_cpu_ms_per_step"] = per_step(workers)
        res["total_cpu_ms_per_step"] = per_step(cpu + workers)
        if window > 0:  # all the workers together: N means N cores' worth
            res["workers_cpu_util_ratio"] = round(workers / window, 3)
    if s1.get("executors_cpu_s"):  # the executor processes (1.0: a thread saturated)
        e0, e1 = s0.get("executors_cpu_s", {}), s1["executors_cpu_s"]
        used = {k: v - e0.get(k, 0.0) for k, v in e1.items()}
        res["executor_cpu_ms_per_step"] = per_step(sum(used.values()))
        res["executor_main_cpu_ms_per_step"] = per_step(used.get("main", 0.0))
        if window > 0:
            res["executor_main_cpu_util_ratio"] = round(used.get("main", 0.0) / window, 3)
        res["executor_threads_cpu_ms_per_step"] = {
            k: per_step(v) for k, v in sorted(used.items(), key=lambda kv: -kv[1])[:4]}
    res["router_event_loop"] = s1.get("event_loop")  # "uvloop" or "asyncio.*"
    if "gc" in s1:  # the router process's cyclic collector in the window
        g0, g1 = s0["gc"], s1["gc"]
        res["gc_cpu_ms_per_step"] = per_step(sum(g1["cpu_seconds"]) - sum(g0["cpu_seconds"]))
        res["gc_wall_ms_per_step"] = per_step(sum(g1["seconds"]) - sum(g0["seconds"]))
        res["gc_collections"] = [b - a for a, b in zip(g0["count"], g1["count"], strict=True)]
        res["gc_pause_ms_max"] = round(max(g1["max_s"]) * 1e3, 3)
        res["gc_tracked_objects"] = g1["tracked"]
    if run["errors"]:
        res["stream_errors"] = run["errors"][:3]
    return res


