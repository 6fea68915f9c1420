"""Step overhead (issue 11): what a steady decode costs around the executor's forward, at
--pipeline-depth 1 and 2 side by side. JSON lines on stdout (DESIGN §8), a table on stderr.

Real cases (`--models`, default `tiny`; `default` = the built-in SmolLM2-135M, skipped with a
line when it is not on disk: this script never downloads): one `pagedserve serve --executors
1` per (model, depth, running), `running` streams of greedy, ignore_eos requests (16-token
random prompts, max_tokens up to the model's context) started together. Once every stream
has its first tokens (ramp-up done) a window of `--window-s` seconds is measured; it ends
early before any stream could finish (ramp-down), then every stream is cancelled.

Fake cases (`--fake`, item 7 of the issue): `pagedserve router` and 1 or 4 wire fake
executors (tests/wire_fake_executor.py, `--fake-step-delay-ms` per step, no model work)
with 32 and 256 streams per executor: the router process's CPU per step, and how much of it
is text work.

Figures (per case, over the window; raw per-step values, never histogram buckets):
  itl_ms_p50/p99        client-side gaps between a stream's tokens (a chunk of k tokens
                        counts k gaps of gap/k), as `pagedserve bench` measures ITL;
  forward_ms_p50, sample_ms_p50, gap_ms_p50/p99   the executors' StepResult figures;
  step_period_ms_p50    time between an executor's consecutive results at the router;
  idle_ms_p50/p99       step period - forward - sample - swap: the executor not computing
                        (gap_s plus what the executor does not time; the figure to use while
                        the executor reports no gap_s);
  output_tok_per_s      tokens the clients received in the window / window;
  router_cpu_ms_per_step  router process CPU time (all threads) / results received;
  {plan,apply,text}_cpu_ms_per_step  main-thread CPU inside the router's plan path
                        (schedule, build, send), token application, and text stage
                        (detokenize, stop strings, stream deltas); other = the rest (ZeroMQ
                        and codec, gRPC stream writes, event loop, metrics).

Where the raw figures come from: the router's step trace, `PAGEDSERVE_STEP_TRACE=<path>`
(router/step_loop.py `StepTrace`): one JSON line per StepResult applied, {executor, step_id,
forward_s, sample_s, swap_s, gap_s, num_tokens (computed), num_sampled, t_sent, t_recv}
(times: the router's time.monotonic(), one clock for every process of the machine). The
router runs in a launcher (this script, `--launch TRACE -- <pagedserve args>`) that adds
the CPU probes: thread CPU time around StepLoop.send_next_plan, StepLoop.apply_tokens and
Delivery.text_stage (where they exist), and the process's CPU time, read at the window's
edges through SIGUSR1.

    .venv/bin/python benchmarks/step_overhead.py [--quick] [--models tiny,default]
        [--running 1,32,256] [--depths 1,2] [--window-s 8] [--fake] [--fake-only]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import inspect
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve.affinity import format_cores, pin_current_thread, plan_serve
from pagedserve.subprocs import stop_process, stop_processes

ROOT = Path(__file__).resolve().parent.parent
BENCH = "step_overhead"
READY = re.compile(r"pagedserve ready grpc=(\S+) metrics=(\S+) executors=(\d+)")
TRACE_ENV = "PAGEDSERVE_STEP_TRACE"
PROMPT_LEN = 16
WARMUP_TOKENS = 4  # every stream has this many tokens: ramp-up is over
END_MARGIN_TOKENS = 8  # the window ends this many tokens before a stream could finish
SETTLE_S = 0.3  # after ramp-up, before the window opens
SNAPSHOT_TIMEOUT_S = 5.0
RAMP_TIMEOUT_S = 180.0


class RampError(RuntimeError):
    """The streams never all ran at once (admission slower than the streams' length)."""


# ======================================================================== the launcher
# Runs inside the router process (`step_overhead.py --launch TRACE -- <pagedserve args>`).

class _Phases:
    """Main-thread CPU seconds and calls inside the wrapped router functions."""

    def __init__(self) -> None:
        self.cpu_s: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, owner, attr: str, name: str) -> bool:
        """A plain function: CPU time of each call."""
        fn = getattr(owner, attr, None)
        if fn is None or asyncio.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
            return False
        cpu, calls, clock = self.cpu_s, self.calls, time.thread_time
        cpu[name], calls[name] = 0.0, 0

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                cpu[name] += clock() - t0
                calls[name] += 1

        setattr(owner, attr, timed)
        return True

    def wrap_agen(self, owner, attr: str, name: str) -> bool:
        """An async generator (a gRPC streaming handler): CPU time of its own steps only,
        not of whatever runs on the loop while it waits (each step of the inner awaitable
        is driven here, as an asyncio Task drives a coroutine)."""
        fn = getattr(owner, attr, None)
        if fn is None or not inspect.isasyncgenfunction(fn):
            return False
        cpu, calls, clock = self.cpu_s, self.calls, time.thread_time
        cpu[name], calls[name] = 0.0, 0

        class Step:
            __slots__ = ("aw",)

            def __init__(self, aw) -> None:
                self.aw = aw

            def __await__(self):
                aw, value, exc = self.aw, None, None
                while True:
                    t0 = clock()
                    try:
                        y = aw.throw(exc) if exc is not None else aw.send(value)
                    except StopIteration as stop:
                        cpu[name] += clock() - t0
                        return stop.value
                    except BaseException:
                        cpu[name] += clock() - t0
                        raise
                    cpu[name] += clock() - t0
                    try:
                        value, exc = (yield y), None
                    except BaseException as e:  # noqa: BLE001 - passed on to the handler
                        value, exc = None, e

        @functools.wraps(fn)
        async def timed(*args, **kwargs):
            agen = fn(*args, **kwargs)
            try:
                while True:
                    try:
                        item = await Step(agen.__anext__())
                    except StopAsyncIteration:
                        return
                    calls[name] += 1
                    yield item
            finally:
                await agen.aclose()

        setattr(owner, attr, timed)
        return True


def _thread_cpu_s() -> dict[str, float]:
    """CPU seconds of this process's threads by name (/proc; Linux only)."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc/self/task").glob("*/stat"):
        with contextlib.suppress(OSError):
            text = stat.read_text()
            name = text[text.index("(") + 1:text.rindex(")")]
            fields = text[text.rindex(")") + 2:].split()
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def launch(trace_path: str, argv: list[str]) -> int:
    """Start `pagedserve <argv>` in this process with the CPU probes (the router writes the
    step trace itself, PAGEDSERVE_STEP_TRACE set by the caller)."""
    from pagedserve.router import delivery, grpc_server, step_loop

    phases = _Phases()
    patched = [name for owner, attr, name in (
        (step_loop.StepLoop, "send_next_plan", "plan"),
        (step_loop.StepLoop, "apply_tokens", "apply"),
        (delivery.Delivery, "text_stage", "text"),
    ) if phases.wrap(owner, attr, name)]
    if phases.wrap_agen(grpc_server.GeneratorServicer, "Stream", "edge"):
        patched.append("edge")
    snap_path = trace_path + ".snap"
    seq = [0]

    def snapshot(*_):  # a Python signal handler: runs in the main thread, the loop's
        seq[0] += 1
        data = {"seq": seq[0], "t": time.monotonic(), "cpu_s": time.process_time(),
                "main_cpu_s": time.thread_time(), "threads_cpu_s": _thread_cpu_s(),
                "phase_cpu_s": dict(phases.cpu_s), "phase_calls": dict(phases.calls),
                "patched": patched}
        tmp = snap_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, snap_path)

    signal.signal(signal.SIGUSR1, snapshot)
    from pagedserve.cli import main
    return main(argv)


# ======================================================================== the benchmark

def emit(case: str, **figures) -> dict:
    line = {"bench": BENCH, "case": case, **figures}
    print(json.dumps(line), flush=True)
    return line


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def ms(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x * 1e3, nd)


def model_dir(name: str, work: Path) -> Path | None:
    """`tiny`: the random-weight demo Llama (built locally once, no download); `test`: the
    test suite's default tiny Llama; `default`: the built-in SmolLM2-135M when on disk."""
    if name == "tiny":
        try:
            from pagedserve.models import ensure_tiny_model
        except ImportError:
            from pagedserve.tinymodels import ensure_demo_model as ensure_tiny_model
        return Path(ensure_tiny_model())
    if name == "test":
        path = work / "test-llama"
        if not (path / "config.json").is_file():
            from pagedserve.tinymodels import build_model
            build_model(path, "llama")
        return path
    if name == "default":
        try:
            from pagedserve.models import builtin_model_dir
            path = builtin_model_dir()
        except ImportError:
            return None
        return path if (path / "config.json").is_file() else None
    path = Path(name)
    return path if (path / "config.json").is_file() else None


def fake_model_dir(work: Path) -> Path:
    """What the router needs of a model for the fake cases (no weights: the fake executors
    do no model work): config.json and the tiny models' byte-level BPE tokenizer (the
    demo model's, so detokenization costs the same)."""
    path = work / "fake-model"
    if not (path / "config.json").is_file():
        from pagedserve.tinymodels import build_tokenizer
        tok = build_tokenizer(path)
        (path / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "vocab_size": len(tok),
            "max_position_embeddings": 4096, "eos_token_id": tok.eos_token_id,
            "bos_token_id": tok.bos_token_id}))
    return path


def model_max_len(path: Path) -> int:
    cfg = json.loads((path / "config.json").read_text())
    return int(cfg.get("max_position_embeddings") or 2048)


class Server:
    """A router (`serve` with real executors, or `router` alone) started through the
    launcher, its output kept in a file."""

    def __init__(self, argv: list[str], work: Path, name: str) -> None:
        self.trace = work / f"{name}.trace.jsonl"
        self.log_path = work / f"{name}.log"
        for p in (self.trace, Path(str(self.trace) + ".snap")):
            p.unlink(missing_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1", **{TRACE_ENV: str(self.trace)})
        self.log = open(self.log_path, "w+")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--launch", str(self.trace), "--",
             *argv], stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
        self.address = self.metrics = ""
        self.snap_seq = 0

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            m = READY.search(self.log_path.read_text())
            if m:
                self.address, self.metrics = m.group(1), m.group(2)
                return
            time.sleep(0.1)
        raise RuntimeError(f"router did not start:\n{self.tail()}")

    def tail(self, n: int = 3000) -> str:
        return self.log_path.read_text()[-n:]

    def snapshot(self) -> dict:
        """The router's CPU time and phase counters, now (SIGUSR1 to the launcher)."""
        snap = Path(str(self.trace) + ".snap")
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + SNAPSHOT_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                data = json.loads(snap.read_text())
                if data["seq"] > self.snap_seq:
                    self.snap_seq = data["seq"]
                    return data
            except (FileNotFoundError, json.JSONDecodeError):
                pass
            time.sleep(0.002)
        raise RuntimeError("the router did not answer SIGUSR1 with a snapshot")

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()

    def trace_lines(self) -> list[dict]:
        if not self.trace.is_file():
            return []
        lines = []
        for raw in self.trace.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a line cut by a kill
                lines.append(json.loads(raw))
        return lines


@dataclass
class Stream:
    times: list[float] = field(default_factory=list)  # monotonic time of each chunk
    counts: list[int] = field(default_factory=list)  # tokens in that chunk
    num_tokens: int = 0
    error: str = ""


async def drive(address: str, num_streams: int, max_tokens: int, vocab: int,
                window_s: float, server: Server, stop: list[str], seed: int = 0) -> dict:
    """Start the streams, wait for ramp-up, measure a window, cancel everything."""
    import grpc
    import numpy as np
    from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
    from pagedserve.protos.generated.pagedserve.v1 import generate_pb2_grpc as pb_grpc

    rng = np.random.default_rng(seed)
    streams = [Stream() for _ in range(num_streams)]
    warm = asyncio.Event()
    near_end = asyncio.Event()
    num_warm = [0]
    limit = max_tokens - END_MARGIN_TOKENS

    async def one(i: int, stub) -> None:
        st = streams[i]
        req = pb.GenerateRequest(params=pb.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop=stop))
        req.prompt_token_ids.ids.extend(rng.integers(3, vocab, PROMPT_LEN).tolist())
        call = stub.Stream(req)
        try:
            async for chunk in call:
                n = len(chunk.token_ids)
                if not n:
                    continue
                now = time.monotonic()
                st.times.append(now)
                st.counts.append(n)
                before = st.num_tokens
                st.num_tokens += n
                if before < WARMUP_TOKENS <= st.num_tokens:
                    num_warm[0] += 1
                    if num_warm[0] == num_streams:
                        warm.set()
                if st.num_tokens >= limit:
                    near_end.set()
        except asyncio.CancelledError:
            call.cancel()
            raise
        except grpc.aio.AioRpcError as exc:
            st.error = f"{exc.code().name}: {exc.details()}"
            near_end.set()

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        tasks = [asyncio.ensure_future(one(i, stub)) for i in range(num_streams)]
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
            with_end = asyncio.ensure_future(near_end.wait())
            await asyncio.wait({with_end}, timeout=window_s)
            with_end.cancel()
            snap1 = await asyncio.to_thread(server.snapshot)
            t1 = time.monotonic()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    errors = [s.error for s in streams if s.error]
    return {"streams": streams, "t0": t0, "t1": t1, "snap0": snap0, "snap1": snap1,
            "errors": errors}


def summarise(run: dict, trace: list[dict]) -> dict:
    t0, t1 = run["t0"], run["t1"]
    window = t1 - t0
    itl: list[float] = []
    tokens = 0
    for st in run["streams"]:
        prev = None
        for t, n in zip(st.times, st.counts, strict=True):
            if t0 <= t <= t1:
                tokens += n
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
        "trace_tok_per_s": round(sum(x["num_sampled"] for x in steps) / window, 1)
        if window > 0 else None,
        "router_cpu_ms_per_step": round(cpu / n_steps * 1e3, 4),
        "router_cpu_util_ratio": round(cpu / window, 3) if window > 0 else None,
    }
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
    if run["errors"]:
        res["stream_errors"] = run["errors"][:3]
    return res


def run_real(model: str, path: Path, running: int, depth: int, args, work: Path) -> dict:
    max_len = min(model_max_len(path), args.max_model_len)
    max_tokens = max_len - PROMPT_LEN - 1
    name = f"{model}_r{running}_d{depth}"
    argv = ["serve", "--model", str(path), "--executors", "1", "--port", "0",
            "--metrics-port", "0", "--http-port", "-1", "--executor-bind", f"tcp://127.0.0.1:{free_port()}",
            "--cpu-threads", str(args.cpu_threads), "--pipeline-depth", str(depth),
            "--max-model-len", str(max_len), "--max-num-seqs", str(max(running, 1)),
            "--swap-space", "0", "--shutdown-timeout", "5"]
    server = Server(argv, work, name)
    try:
        server.wait_ready()
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        run = asyncio.run(drive(server.address, running, max_tokens, vocab, args.window_s,
                                server, []))
    finally:
        server.stop()
    res = summarise(run, server.trace_lines())
    return {"mode": "real", "model": model, "depth": depth, "running": running,
            "executors": 1, **res}


def run_fake(path: Path, executors: int, running: int, depth: int, args,
             work: Path, stop: list[str]) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from wire_fake_executor import fake_command

    per_executor = -(-running // executors)
    name = fake_case(executors, running, depth, stop)
    zmq_addr = f"tcp://127.0.0.1:{free_port()}"
    max_len = args.fake_max_model_len
    blocks = per_executor * (max_len // 16 + 2) + 64
    argv = ["router", "--model", str(path), "--port", "0", "--metrics-port", "0", "--http-port", "-1",
            "--executor-bind", zmq_addr, "--pipeline-depth", str(depth),
            "--max-model-len", str(max_len), "--max-num-seqs", str(per_executor),
            "--routing", "round-robin", "--shutdown-timeout", "5",
            "--max-queue-len", str(max(1024, running))]
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    server = Server(argv, work, name)
    fakes: list[subprocess.Popen] = []
    try:
        server.wait_ready()
        for i in range(executors):
            cmd = fake_command(zmq_addr, f"f{i}", path, num_gpu_blocks=blocks,
                               step_delay_s=args.fake_step_delay_ms / 1e3,
                               extra=["--max-model-len", str(max_len), "--vocab-size",
                                      str(vocab)])
            fakes.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, cwd=ROOT))
        wait_executors(server.address, executors)
        run = asyncio.run(drive(server.address, running, max_len - PROMPT_LEN - 1, vocab,
                                args.window_s, server, stop))
    finally:
        server.stop()
        stop_processes(fakes, timeout_s=10)
    res = summarise(run, server.trace_lines())
    return {"mode": "fake", "model": "fake", "depth": depth, "running": running,
            "executors": executors, "step_delay_ms": args.fake_step_delay_ms,
            "stop_strings": len(stop), **res}


def fake_case(executors: int, running: int, depth: int, stop: list[str]) -> str:
    return f"fake_e{executors}_r{running}_d{depth}" + ("_stop" if stop else "")


def wait_executors(address: str, n: int, timeout_s: float = 30.0) -> None:
    import grpc
    from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
    from pagedserve.protos.generated.pagedserve.v1 import generate_pb2_grpc as pb_grpc
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.GeneratorStub(ch)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            st = stub.GetClusterStatus(pb.ClusterStatusRequest(), timeout=10)
            if sum(e.healthy for e in st.executors) >= n:
                return
            time.sleep(0.1)
    raise RuntimeError(f"{n} fake executors did not register")


def _fmt(v, width: int = 8) -> str:
    if v is None:
        return f"{'-':>{width}}"
    return f"{v:>{width}.3f}" if isinstance(v, float) else f"{v:>{width}}"


def table(rows: list[dict]) -> None:
    cols = [("case", "case", 22), ("itl p50", "itl_ms_p50", 8), ("fwd p50", "forward_ms_p50", 8),
            ("gap p50", "gap_ms_p50", 8), ("gap p99", "gap_ms_p99", 8),
            ("idle p50", "idle_ms_p50", 8), ("idle p99", "idle_ms_p99", 8),
            ("tok/s", "output_tok_per_s", 9), ("cpu/step", "router_cpu_ms_per_step", 8),
            ("text/stp", "text_cpu_ms_per_step", 8), ("util", "router_cpu_util_ratio", 6),
            ("steps", "steps", 6)]
    print("  ".join(f"{h:>{w}}" if i else f"{h:<{w}}" for i, (h, _, w) in enumerate(cols))
          + "   (ms unless noted)", file=sys.stderr)
    for r in rows:
        cells = []
        for i, (_, key, w) in enumerate(cols):
            v = r.get(key)
            cells.append(f"{v:<{w}}" if i == 0 else _fmt(v, w))
        print("  ".join(cells), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--launch"]:
        sep = argv.index("--")
        return launch(argv[1], argv[sep + 1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="smoke setting: tiny model at 4 running (depths as given), fake 1x8 "
                         "at the last depth only, 1 s windows")
    ap.add_argument("--models", default="tiny", help="tiny, test, default, or a directory")
    ap.add_argument("--running", default="1,32,256")
    ap.add_argument("--depths", default="1,2")
    ap.add_argument("--window-s", type=float, default=8.0)
    ap.add_argument("--max-model-len", type=int, default=1024,
                    help="context of the real cases (caps max_tokens; the model's if lower)")
    ap.add_argument("--cpu-threads", type=int, default=1)
    ap.add_argument("--fake", action="store_true", help="also the fake-executor cases")
    ap.add_argument("--fake-only", action="store_true")
    ap.add_argument("--fake-executors", default="1,4")
    ap.add_argument("--fake-running", default="32,256",
                    help="streams in all (spread evenly over the executors)")
    ap.add_argument("--fake-step-delay-ms", type=float, default=20.0)
    ap.add_argument("--fake-max-model-len", type=int, default=1024)
    ap.add_argument("--fake-stop-strings", type=int, default=0,
                    help="also run each fake case with this many never-matching stop strings")
    ap.add_argument("--work-dir", default="",
                    help="keep logs and step traces here (default: a temporary folder)")
    args = ap.parse_args(argv)
    # The clients run on the router's cores, as `serve` leaves the executor's core to the
    # executor (--cpu-affinity auto, pagedserve.affinity): a load generator sharing the
    # core that computes the forward would measure this host, not the server.
    plan = plan_serve(1, args.cpu_threads)
    if plan is not None and pin_current_thread(plan[1]):
        print(f"clients pinned to cores {format_cores(plan[1])} (the router's)", file=sys.stderr)
    if args.quick:
        args.running, args.window_s = "4", 1.0
        args.fake, args.fake_executors, args.fake_running = True, "1", "8"
        args.max_model_len = args.fake_max_model_len = 256
    if args.work_dir:
        Path(args.work_dir).mkdir(parents=True, exist_ok=True)
        return run_all(args, Path(args.work_dir))
    with tempfile.TemporaryDirectory(prefix="step_overhead-") as work:
        return run_all(args, Path(work))


def run_all(args, work: Path) -> int:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    depths = ints(args.depths)
    rows: list[dict] = []

    def record(case: str, run) -> dict | None:
        """One case; a case that fails is a line saying why, and the others still run."""
        try:
            res = run()
        except (RuntimeError, OSError) as exc:
            emit(case, error=str(exc)[-2000:])
            print(f"{case}: FAILED: {str(exc)[-300:]}", file=sys.stderr)
            return None
        rows.append(emit(case, **res))
        return res

    if not args.fake_only:
        for model in [m for m in args.models.split(",") if m]:
            path = model_dir(model, work)
            if path is None:
                emit(f"{model}_skipped", skipped=f"model {model!r} is not on disk (this "
                     "script does not download; `pagedserve serve --model default` does)")
                print(f"{model}: skipped (not on disk)", file=sys.stderr)
                continue
            for running in ints(args.running):
                pair = {}
                for depth in depths:
                    pair[depth] = record(f"{model}_r{running}_d{depth}", functools.partial(
                        run_real, model, path, running, depth, args, work))
                if pair.get(1) and pair.get(2) and pair[1]["output_tok_per_s"]:
                    emit(f"{model}_r{running}_d2_vs_d1", model=model, running=running,
                         tok_per_s_ratio=round(pair[2]["output_tok_per_s"]
                                               / pair[1]["output_tok_per_s"], 3))
    if args.fake or args.fake_only:
        path = fake_model_dir(work)
        stops = [[]] + ([[f"§never{i}§" for i in range(args.fake_stop_strings)]]
                        if args.fake_stop_strings else [])
        for executors in ints(args.fake_executors):
            for running in ints(args.fake_running):
                for stop in stops:
                    for depth in depths[-1:] if args.quick else depths:
                        record(fake_case(executors, running, depth, stop), functools.partial(
                            run_fake, path, executors, running, depth, args, work, stop))
    table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
