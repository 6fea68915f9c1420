"""Router hop (DESIGN §8): StepPlan out and StepResult back over real ZeroMQ between two
processes. JSON lines on stdout, a table on stderr.

The plan is a decode step of 256 requests (one new token each, block tables as changes: one
request in 16 appends a block). An echo process (this script with `--echo ADDR`) holds a
DEALER socket, decodes each plan with the real Codec (validation included) and answers with
a StepResult of 256 sampled tokens, encoded with the real Codec. Round trip = encode plan ->
send -> executor decode/answer/encode -> receive -> decode result. Target: p50 <= 200 us.

Cases:
1. codec: the four Codec calls in one process (plan encode/decode, result encode/decode).
1b. frames: a plan's frames (routing id first, as the router sends them) sent and received
   over a tcp loopback pair in this process, with pyzmq's send/recv_multipart (enum flags,
   as the link did before 2026-11-27) and with protos/zmq_io.py's send_frames/recv_frames
   (the link's and the hub's now): CPU a message on each side, no round trip.
2. zmq_sync_ping: a Heartbeat echoed (the transport floor on this machine).
3. zmq_sync: a plain blocking zmq ROUTER in this process, frames received as zmq.Frame
   (copy=False) on both sides, as the router and the executor do today.
4. zmq_sync_copy (not in --quick): the same, frames received as bytes (copy=True) on both sides.
5. zmq_sync_ipc (not in --quick): as zmq_sync_copy over ipc:// instead of tcp loopback.
6. router_link: the router's own `ExecutorLink` (a ROUTER socket whose FD the asyncio event
   loop watches, since 2026-11-23; zmq.asyncio before; dispatch to `on_result`, future
   resolved), as the engine uses it.
7. router_link_ipc (not in --quick): router_link over ipc://.
8. asyncio_reader (not in --quick): the receive path the link adopted, stripped down: a plain zmq
   socket whose FD is watched with `loop.add_reader`, drained with recv_multipart(NOBLOCK,
   copy=True), same dispatch.

Usage: .venv/bin/python benchmarks/hop_bench.py [--iters 3000] [--warmup 300]
       [--rounds 3] [--num-requests 256] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import zmq
from pagedserve.protos import wire
from pagedserve.protos.codec import Codec
from pagedserve.protos.zmq_io import NOBLOCK, recv_frames, send_frames

BENCH = "hop_bench"
BLOCK_SIZE = 16


def make_decode_plan(step_id: int, num_requests: int) -> wire.StepPlan:
    rng = np.random.default_rng(step_id)
    ctx = rng.integers(200, 1800, num_requests).astype(np.int32)
    lens = (np.arange(num_requests) % 16 == step_id % 16).astype(np.int32)  # 1 in 16 appends
    starts = (ctx // BLOCK_SIZE + 1 - lens).astype(np.int32)
    table_ids = rng.integers(0, 40000, int(lens.sum())).astype(np.int32)
    blocks = rng.integers(0, 40000, num_requests).astype(np.int64)
    return wire.StepPlan(
        step_id=step_id,
        request_ids=[f"req-{i:06d}#0" for i in range(num_requests)],
        num_computed_tokens=ctx,
        num_new_tokens=np.ones(num_requests, dtype=np.int32),
        do_sample=np.ones(num_requests, dtype=np.uint8),
        token_ids=rng.integers(3, 32000, num_requests).astype(np.int32),
        positions=ctx.copy(),
        slot_mapping=blocks * BLOCK_SIZE + ctx % BLOCK_SIZE,
        block_table_starts=starts,
        block_table_lens=lens,
        block_table_ids=table_ids,
        swap_out=np.empty((0, 2), dtype=np.int64),
        swap_in=np.empty((0, 2), dtype=np.int64),
        copy=np.empty((0, 2), dtype=np.int64),
    )


def answer(plan: wire.StepPlan, executor_id: str) -> wire.StepResult:
    """What an executor sends back: one token per sampled request."""
    sampled = np.flatnonzero(plan.do_sample)
    ids = [plan.request_ids[i] for i in sampled.tolist()]
    return wire.StepResult(
        step_id=plan.step_id, executor_id=executor_id, request_ids=ids,
        token_ids=((sampled * 7919 + plan.step_id) % 32000).astype(np.int32),
        forward_s=0.0,
    )


# ----------------------------------------------------------------------------- echo side


def echo(address: str, copy: bool = False) -> int:
    """The executor stand-in: Hello, then answer plans and echo heartbeats until Shutdown."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    codec = Codec()
    executor_id = f"echo-{os.getpid()}"
    sock.send_multipart(codec.encode(wire.Hello(
        executor_id=executor_id, model_fingerprint="bench", device="cpu", dtype="float32",
        block_size=BLOCK_SIZE, num_gpu_blocks=40000, num_cpu_blocks=0, max_model_len=2048,
    )), copy=False)
    while True:
        msg = codec.decode(sock.recv_multipart(copy=copy))
        if isinstance(msg, wire.StepPlan):
            sock.send_multipart(codec.encode(answer(msg, executor_id)), copy=False)
        elif isinstance(msg, wire.Heartbeat):  # the ping case: echo it
            sock.send_multipart(codec.encode(msg), copy=False)
        elif isinstance(msg, wire.Shutdown):
            break
    sock.close(0)
    ctx.term()
    return 0


def _spawn_echo(address: str, copy: bool = False) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--echo", address,
                             *(["--echo-copy"] if copy else [])])


def _endpoint(transport: str) -> str:
    if transport == "ipc":
        return f"ipc://{tempfile.gettempdir()}/pagedserve-hop-{os.getpid()}.sock"
    return "tcp://127.0.0.1:0"


# ----------------------------------------------------------------------------- cases


def _summary(case: str, times_s: list[float], **extra) -> dict:
    s = sorted(times_s)
    return {
        "bench": BENCH,
        "case": case,
        "rtt_us_p50": round(statistics.median(s) * 1e6, 1),
        "rtt_us_p99": round(s[min(len(s) - 1, int(0.99 * len(s)))] * 1e6, 1),
        "rtt_us_mean": round(statistics.fmean(s) * 1e6, 1),
        "iterations": len(s),
        **extra,
    }


def bench_codec(plans: list[wire.StepPlan], iters: int) -> dict:
    c_router, c_exec = Codec(), Codec()
    t_enc, t_dec, t_renc, t_rdec = [], [], [], []
    pc = time.perf_counter
    plan_bytes = result_bytes = 0
    for i in range(iters):
        plan = plans[i % len(plans)]
        t0 = pc()
        frames = c_router.encode(plan)
        t1 = pc()
        frames = [bytes(f) for f in frames]
        t2 = pc()
        got = c_exec.decode(frames)
        t3 = pc()
        rframes = c_exec.encode(answer(got, "x"))
        t4 = pc()
        rframes = [bytes(f) for f in rframes]
        t5 = pc()
        c_router.decode(rframes)
        t6 = pc()
        t_enc.append(t1 - t0)
        t_dec.append(t3 - t2)
        t_renc.append(t4 - t3)  # includes building the StepResult
        t_rdec.append(t6 - t5)
        plan_bytes = sum(len(f) for f in frames)
        result_bytes = sum(len(f) for f in rframes)

    def p50(xs):
        return round(statistics.median(xs) * 1e6, 1)

    return {
        "bench": BENCH, "case": "codec",
        "plan_encode_us_p50": p50(t_enc), "plan_decode_us_p50": p50(t_dec),
        "result_build_encode_us_p50": p50(t_renc), "result_decode_us_p50": p50(t_rdec),
        "plan_bytes": plan_bytes, "result_bytes": result_bytes,
        "num_requests": len(plans[0].request_ids), "iterations": iters,
    }


def bench_frames(plans: list[wire.StepPlan], iters: int) -> dict:
    """Send and receive cost of one plan message, pyzmq's multipart calls against zmq_io's,
    over tcp loopback in this process (batches of 64 sent, then received once they are in:
    the receiver does not wait), each with the flags the router passes (NOBLOCK)."""
    ctx = zmq.Context()
    tx, rx = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    for sock in (tx, rx):
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
    port = rx.bind_to_random_port("tcp://127.0.0.1")
    tx.connect(f"tcp://127.0.0.1:{port}")
    tx.send(b"hi")
    rx.recv()
    codec = Codec()
    messages = [[b"executor-0", *codec.encode(p)] for p in plans]
    ways = {
        "multipart": (lambda m: tx.send_multipart(m, flags=zmq.NOBLOCK, copy=False),
                      lambda: rx.recv_multipart(zmq.NOBLOCK, copy=False)),
        "zmq_io": (lambda m: send_frames(tx, m, NOBLOCK), lambda: recv_frames(rx, NOBLOCK)),
    }
    times: dict[str, tuple[list[float], list[float]]] = {w: ([], []) for w in ways}
    pc, batch = time.perf_counter, 64
    for i in range(max(1, iters // batch)):
        for way, (send, recv) in ways.items():  # interleaved: the machine's noise is shared
            sends, recvs = times[way]
            t0 = pc()
            for j in range(batch):
                send(messages[(i * batch + j) % len(messages)])
            sends.append((pc() - t0) / batch)
            rx.poll(1000)  # the first has arrived; give the rest time to (64 x ~12 KB)
            time.sleep(0.02)
            t0 = pc()
            for _ in range(batch):
                recv()
            recvs.append((pc() - t0) / batch)
    tx.close(0)
    rx.close(0)
    ctx.term()
    out = {"bench": BENCH, "case": "frames", "frames_per_message": len(messages[0]),
           "num_requests": len(plans[0].request_ids), "iterations": iters}
    for way, (sends, recvs) in times.items():
        out[f"{way}_send_us_p50"] = round(statistics.median(sends) * 1e6, 2)
        out[f"{way}_recv_us_p50"] = round(statistics.median(recvs) * 1e6, 2)
    return out


def bench_zmq_sync(plans: list[wire.StepPlan], iters: int, warmup: int,
                   ping: bool = False, copy: bool = False, transport: str = "tcp") -> dict:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(_endpoint(transport))
    address = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    proc = _spawn_echo(address, copy)
    codec = Codec()
    try:
        if not sock.poll(30_000):
            raise RuntimeError("echo process did not say hello")
        frames = sock.recv_multipart()
        rid = frames[0]
        codec.decode(frames[1:])  # Hello
        times = []
        pc = time.perf_counter
        for i in range(warmup + iters):
            msg = wire.Heartbeat(executor_id="bench", time_s=0.0) if ping else \
                plans[i % len(plans)]
            t0 = pc()
            sock.send_multipart([rid, *codec.encode(msg)], copy=False)
            reply = sock.recv_multipart(copy=copy)
            result = codec.decode(reply[1:])
            t1 = pc()
            assert type(result) is (wire.Heartbeat if ping else wire.StepResult)
            if i >= warmup:
                times.append(t1 - t0)
        sock.send_multipart([rid, *codec.encode(wire.Shutdown(reason="bench done"))])
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
        sock.close(0)
        ctx.term()
        if transport == "ipc":
            with contextlib.suppress(OSError):
                os.unlink(address.removeprefix("ipc://"))
    where = "tcp loopback" if transport == "tcp" else "ipc"
    if ping:
        return _summary("zmq_sync_ping", times, transport=where,
                        note="a Heartbeat echoed: the transport floor")
    case = "zmq_sync" + ("_copy" if copy and transport == "tcp" else "") + \
        ("_ipc" if transport == "ipc" else "")
    return _summary(case, times, num_requests=len(plans[0].request_ids), transport=where,
                    recv="bytes (copy=True)" if copy else "zmq.Frame (copy=False)")


async def _bench_link(plans: list[wire.StepPlan], iters: int, warmup: int,
                      transport: str = "tcp") -> dict:
    from pagedserve.router.executor_link import ExecutorLink

    loop = asyncio.get_running_loop()
    hello: asyncio.Future = loop.create_future()
    pending: dict[int, asyncio.Future] = {}

    def on_hello(routing_id: bytes, msg: wire.Hello) -> wire.Welcome:
        if not hello.done():
            hello.set_result(routing_id)
        return wire.Welcome(executor_id=msg.executor_id, accepted=True)

    def on_result(executor_id: str, result: wire.StepResult) -> bool:
        fut = pending.pop(result.step_id, None)
        if fut is not None and not fut.done():
            fut.set_result(result)
        return True

    link = ExecutorLink(_endpoint(transport), on_hello=on_hello,
                        on_heartbeat=lambda _id: True, on_result=on_result,
                        on_error=lambda _id, _r: True)
    link.start()
    proc = _spawn_echo(link.endpoint)
    try:
        rid = await asyncio.wait_for(hello, 30)
        times = []
        pc = time.perf_counter
        for i in range(warmup + iters):
            plan = plans[i % len(plans)]
            fut = loop.create_future()
            t0 = pc()
            pending[plan.step_id] = fut
            link.send(rid, plan)
            await fut
            t1 = pc()
            if i >= warmup:
                times.append(t1 - t0)
        link.send(rid, wire.Shutdown(reason="bench done"))
        await asyncio.sleep(0.05)
        await loop.run_in_executor(None, proc.wait, 10)
    finally:
        if proc.poll() is None:
            proc.kill()
        await link.close()
        if transport == "ipc":
            with contextlib.suppress(OSError):
                os.unlink(link.endpoint.removeprefix("ipc://"))
    if transport == "ipc":
        return _summary("router_link_ipc", times, num_requests=len(plans[0].request_ids),
                        transport="ipc, event-loop reader")
    return _summary("router_link", times, num_requests=len(plans[0].request_ids),
                    transport="tcp loopback, event-loop reader")


async def _bench_reader(plans: list[wire.StepPlan], iters: int, warmup: int) -> dict:
    """Like router_link, but a plain zmq socket watched with loop.add_reader (no zmq.asyncio)
    and drained with NOBLOCK copy=True receives: a candidate for the link's recv loop."""
    loop = asyncio.get_running_loop()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:0")
    codec_in, codec_out = Codec(), Codec()
    hello: asyncio.Future = loop.create_future()
    pending: dict[int, asyncio.Future] = {}

    def drain() -> None:
        # The zmq FD is edge-triggered: read until EVENTS says nothing is left.
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = sock.recv_multipart(zmq.NOBLOCK)
            msg = codec_in.decode(frames[1:])
            if isinstance(msg, wire.Hello):
                if not hello.done():
                    hello.set_result(frames[0])
            elif isinstance(msg, wire.StepResult):
                fut = pending.pop(msg.step_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    fd = sock.getsockopt(zmq.FD)
    loop.add_reader(fd, drain)
    proc = _spawn_echo(sock.getsockopt(zmq.LAST_ENDPOINT).decode(), copy=True)
    try:
        loop.call_soon(drain)
        rid = await asyncio.wait_for(hello, 30)
        times = []
        pc = time.perf_counter
        for i in range(warmup + iters):
            plan = plans[i % len(plans)]
            fut = loop.create_future()
            t0 = pc()
            pending[plan.step_id] = fut
            sock.send_multipart([rid, *codec_out.encode(plan)], copy=False, flags=zmq.NOBLOCK)
            loop.call_soon(drain)  # a send can consume the FD's edge: look once more
            await fut
            t1 = pc()
            if i >= warmup:
                times.append(t1 - t0)
        sock.send_multipart([rid, *codec_out.encode(wire.Shutdown(reason="bench done"))])
        await loop.run_in_executor(None, proc.wait, 10)
    finally:
        loop.remove_reader(fd)
        if proc.poll() is None:
            proc.kill()
        sock.close(0)
        ctx.term()
    return _summary("asyncio_reader", times, num_requests=len(plans[0].request_ids),
                    transport="tcp loopback, loop.add_reader on the zmq FD")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--echo", default="", help=argparse.SUPPRESS)
    ap.add_argument("--echo-copy", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3,
                    help="runs of each transport case, in turn; the median run is kept")
    ap.add_argument("--quick", action="store_true", help="200 iterations, 20 warm-up, 1 round")
    args = ap.parse_args(argv)
    if args.echo:
        return echo(args.echo, args.echo_copy)
    iters, warmup = (200, 20) if args.quick else (args.iters, args.warmup)
    rounds = 1 if args.quick else max(1, args.rounds)
    # Distinct plans (different step ids and block-table changes), reused in turn.
    plans = [make_decode_plan(s, args.num_requests) for s in range(1, 65)]
    # step ids must be unique per round trip for the link's future map: renumber as we go.
    seq = iter(range(1, 10**9))

    class _Plans(list):
        def __getitem__(self, i):
            p = super().__getitem__(i)
            return wire.StepPlan(**{**{f: getattr(p, f) for f in p.__struct_fields__},
                                    "step_id": next(seq)})

    cases = [
        lambda: bench_zmq_sync(_Plans(plans), iters, warmup, ping=True),
        lambda: bench_zmq_sync(_Plans(plans), iters, warmup),
        lambda: asyncio.run(_bench_link(_Plans(plans), iters, warmup)),
    ]
    if not args.quick:  # the alternatives measured for the findings
        cases[2:2] = [
            lambda: bench_zmq_sync(_Plans(plans), iters, warmup, copy=True),
            lambda: bench_zmq_sync(_Plans(plans), iters, warmup, copy=True, transport="ipc"),
        ]
        cases.append(lambda: asyncio.run(_bench_link(_Plans(plans), iters, warmup, "ipc")))
        cases.append(lambda: asyncio.run(_bench_reader(_Plans(plans), iters, warmup)))
    # The machine is shared: run the cases in turn `rounds` times and keep, per case, the
    # round with the median p50 (all rounds' p50s are listed).
    runs: list[list[dict]] = [[] for _ in cases]
    for _ in range(rounds):
        for i, case in enumerate(cases):
            runs[i].append(case())
    results = [bench_codec(plans, iters), bench_frames(plans, iters)]
    for case_runs in runs:
        case_runs.sort(key=lambda r: r["rtt_us_p50"])
        median = dict(case_runs[(len(case_runs) - 1) // 2])
        median["rtt_us_p50_rounds"] = [r["rtt_us_p50"] for r in case_runs]
        results.append(median)
    for r in results:
        if "rtt_us_p50" in r:
            r["target_rtt_us_p50"] = 200
        print(json.dumps(r), flush=True)
    for r in results:
        figures = ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("bench", "case"))
        print(f"{r['case']:<14} {figures}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
