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
  output_tok_per_s      tokens the clients received in the window / window (trace_tok_per_s:
                        the tokens the executors sampled; below it, the clients or the
                        edges fell behind);
  tokens_per_chunk      tokens a stream message carried on average: above 1, the edges
                        merged tokens that waited (they fell behind), so a faster edge can
                        show more messages and more CPU a token;
  client_cpu_util_ratio, client_loop_cpu_util_ratio   this process's CPU in the window /
                        window (all threads; the event loop's thread, which runs every
                        stream's Python): near 1.0 for the loop, the client limits output
                        (with --client-procs N: all N processes' CPU, and the busiest
                        one's main thread);
  workers_cpu_util_ratio  with `--api-workers N`: the workers' CPU / window (N = N cores);
  router_cpu_ms_per_step  router process CPU time (all threads) / results received;
  worker_cpu_ms_per_step, total_cpu_ms_per_step   with `--api-workers N`: the API worker
                        processes' CPU time (all threads) / results received, and router +
                        workers (router_cpu_ms_per_step is then the engine process alone,
                        and its `edge` probe reads nothing: the gRPC handlers run in the
                        workers);
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
        [--api-workers N] [--client-channels N] [--client-procs N]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagedserve.affinity import format_cores, pin_current_thread, plan_serve
from pagedserve.subprocs import stop_processes

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules below
from step_overhead_clients import drive_procs  # noqa: E402
from step_overhead_drive import PROMPT_LEN, drive, summarise  # noqa: E402
from step_overhead_launcher import launch  # noqa: E402
from step_overhead_server import (  # noqa: E402
    ROOT,
    Server,
    fake_model_dir,
    free_port,
    model_dir,
    model_max_len,
)

BENCH = "step_overhead"


def emit(case: str, **figures) -> dict:
    line = {"bench": BENCH, "case": case, **figures}
    print(json.dumps(line), flush=True)
    return line


def workers_suffix(args) -> str:
    return (f"_w{args.api_workers}" if args.api_workers else "") + \
        (f"_c{args.client_channels}" if args.client_channels != 1 else "") + \
        (f"_p{args.client_procs}" if args.client_procs > 1 else "")


def run_clients(args, address: str, running: int, max_tokens: int, vocab: int, server,
                stop: list[str]) -> dict:
    """The streams from this process (`drive`) or from --client-procs processes."""
    if args.client_procs > 1:
        return drive_procs(address, running, max_tokens, vocab, args.window_s, server, stop,
                           channels=args.client_channels, procs=args.client_procs)
    return asyncio.run(drive(address, running, max_tokens, vocab, args.window_s, server,
                             stop, channels=args.client_channels))


def run_real(model: str, path: Path, running: int, depth: int, args, work: Path) -> dict:
    max_len = min(model_max_len(path), args.max_model_len)
    max_tokens = max_len - PROMPT_LEN - 1
    name = f"{model}_r{running}_d{depth}{workers_suffix(args)}"
    argv = ["serve", "--model", str(path), "--executors", "1", "--port", "0",
            "--metrics-port", "0", "--http-port", "-1", "--executor-bind", f"tcp://127.0.0.1:{free_port()}",
            "--cpu-threads", str(args.cpu_threads), "--pipeline-depth", str(depth),
            "--max-model-len", str(max_len), "--max-num-seqs", str(max(running, 1)),
            "--swap-space", "0", "--shutdown-timeout", "5", "--api-workers", str(args.api_workers)]
    server = Server(argv, work, name)
    try:
        server.wait_ready()
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        run = run_clients(args, server.address, running, max_tokens, vocab, server, [])
    finally:
        server.stop()
    res = summarise(run, server.trace_lines())
    return {"mode": "real", "model": model, "depth": depth, "running": running,
            "executors": 1, "api_workers": args.api_workers,
            "client_channels": args.client_channels, "client_procs": args.client_procs, **res}


def run_fake(path: Path, executors: int, running: int, depth: int, args,
             work: Path, stop: list[str]) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from wire_fake_executor import fake_command

    per_executor = -(-running // executors)
    name = fake_case(executors, running, depth, stop) + workers_suffix(args)
    zmq_addr = f"tcp://127.0.0.1:{free_port()}"
    max_len = args.fake_max_model_len
    blocks = per_executor * (max_len // 16 + 2) + 64
    argv = ["router", "--model", str(path), "--port", "0", "--metrics-port", "0", "--http-port", "-1",
            "--executor-bind", zmq_addr, "--pipeline-depth", str(depth),
            "--max-model-len", str(max_len), "--max-num-seqs", str(per_executor),
            "--routing", "round-robin", "--shutdown-timeout", "5",
            "--max-queue-len", str(max(1024, running)), "--api-workers", str(args.api_workers)]
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
        run = run_clients(args, server.address, running, max_len - PROMPT_LEN - 1, vocab,
                          server, stop)
    finally:
        server.stop()
        stop_processes(fakes, timeout_s=10)
    res = summarise(run, server.trace_lines())
    return {"mode": "fake", "model": "fake", "depth": depth, "running": running,
            "executors": executors, "api_workers": args.api_workers,
            "client_channels": args.client_channels, "client_procs": args.client_procs,
            "step_delay_ms": args.fake_step_delay_ms,
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
            ("wrk/step", "worker_cpu_ms_per_step", 8),
            ("text/stp", "text_cpu_ms_per_step", 8), ("gc/step", "gc_cpu_ms_per_step", 8),
            ("gc max", "gc_pause_ms_max", 8), ("util", "router_cpu_util_ratio", 6),
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
    ap.add_argument("--api-workers", type=int, default=0,
                    help="the router's --api-workers (0: gRPC served by the router process)")
    ap.add_argument("--client-channels", type=int, default=1,
                    help="gRPC channels (connections) the streams are spread over; API "
                         "workers share connections, not streams")
    ap.add_argument("--client-procs", type=int, default=1,
                    help="client processes the streams (and channels) are spread over: at "
                         "tens of thousands of tokens a second one process's event loop can "
                         "be the limit (step_overhead_clients.py)")
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
                    pair[depth] = record(f"{model}_r{running}_d{depth}{workers_suffix(args)}",
                                         functools.partial(
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
                        record(fake_case(executors, running, depth, stop)
                               + workers_suffix(args), functools.partial(
                            run_fake, path, executors, running, depth, args, work, stop))
    table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
