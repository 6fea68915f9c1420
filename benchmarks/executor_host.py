"""The executor's host ceiling: how fast its host side (main thread, I/O thread, flight watch)
turns steady decode plans into results when the device's work costs no host time, and
whether it keeps a device of a given speed busy. One JSON line per case (DESIGN §8).

Why: at 32 streams on an H200 (sixth GPU run, depth 4) a step took 1.93 ms for a 1.26 ms
forward; the device idled while the executor's host prepared, launched and answered steps.
That host work is Python, numpy, ZeroMQ and MessagePack, which a CPU machine runs the same
way, so it can be measured and cut here, apart from the GPU's driver calls.

How: the real executor process (`pagedserve executor`, every thread as `serve` runs it)
with the tiny model on the CPU, started through this script (``--launch``), which swaps the
device for a *virtual device*: the decode graphs are captured on the CPU (their twins,
fed through the staging ring as on a GPU) but a replay computes nothing; it only queues
``--device-ms`` of device time on a clock that runs a step after the later of its launch
and the previous step's end, and steps stay in flight as on a GPU (`overlap_steps`): the
sampler's read-back, the flight watch and the ring wait (sleeping, the GIL released) until
the clock says the step is done. The prompts' step (step 0) runs for real. This process is
the router: a ROUTER socket that registers the executor, answers its heartbeats and keeps
``depth`` plans in flight (all encoded before the clock starts), as the real router
pipelines steady greedy decodes (`pipelined_decode_plans`: every row fed its own sample).

Figures, over the steps after ``--warmup`` (one case per rows x depth x device time):
  step_us_p50, step_us_mean    between consecutive results at this router;
  device_idle_us_p50/mean      the virtual device's idle time before each step (the GPU
                               check's gap): 0 when the host had the step queued in time;
  busy_ratio                   device time / window (1.0: the host kept it busy);
  host_cpu_us_per_step         the executor process's CPU time (all threads) a step, of it
  host_sys_us_per_step         in the kernel (futex hand-overs of the GIL, sockets), and
  main_cpu_us_per_step, io_cpu_us_per_step, watch_cpu_us_per_step   by thread (the
                               virtual device's waits count: they yield in a loop for their
                               last 0.2 ms, as a GPU's event wait spins);
  switches_per_step, {main,io,watch}_switches_per_step   context switches a step (each
                               thread hand-over is one or two);
  fed_steps                    decode steps run as fed graphs by where their ids came from
                               (the stage, the previous step's tokens on the device, copied);
  wake_late_us_p50             how late a sleeping wait woke after the clock's end (the
                               OS's timer slack, a cost a GPU's spinning event wait does not
                               have: subtract it when reading the idle time).
With ``--device-ms 0`` the device is infinitely fast: the step time is the host ceiling.
``--device cuda [--model-dir DIR]``: no virtual device; the executor on the GPU as `serve`
runs it (real graphs, events, copies), the router being this script as above; then
``result_gap_us_*`` (the StepResults' own gap: the device's idle before each step, read
from CUDA events) is the figure, the executor without the router and the API edges
around it (on the CPU it is host time).
``--phases``: also ``phases_cpu_wall_calls_per_step``, the executor's main and I/O threads'
time by phase (executor_host_phases.py has the list), a plan's worth.

    .venv/bin/python benchmarks/executor_host.py [--rows 32,256] [--depths 2,4]
        [--device-ms 0,auto] [--steps 1000] [--warmup 100] [--phases]
        [--device cuda --model-dir DIR]

``auto`` device times are the sixth GPU run's forward + sampling at that many streams
(H200, 2026-11-27, `step_overhead_workers_depth4`): 1.28 ms at 32 rows, 1.98 at 256.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

AUTO_DEVICE_MS = {32: 1.28, 256: 1.98}  # H200 sixth run: forward + sampling p50
PROMPT_LEN, BLOCK_SIZE, MAX_MODEL_LEN = 16, 16, 1024
PHASES_ENV = "EXECUTOR_HOST_PHASES"  # 1: the executor times its phases (--phases)
# A wait sleeps until this long before its end, then yields in a loop: a sleep alone woke
# ~120 us late on the 2-core VM (timer slack), where a GPU's event wait spins.
SPIN_S = 200e-6


# ----------------------------------------------------------------- the executor's side


class VirtualDevice:
    """A device clock: a launched step starts at the later of its launch and the previous
    step's end and takes ``step_s``. Waits sleep until a step's end (GIL released)."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.free_at = 0.0  # monotonic end of the last launched step (0: none yet)
        self.launches: list[tuple[float, float]] = []  # (launch time, idle before it)
        self.late: list[float] = []  # how late each sleeping wait woke

    def launch(self) -> None:
        now = time.monotonic()
        idle = max(0.0, now - self.free_at) if self.free_at else 0.0
        self.launches.append((now, idle))
        self.free_at = max(now, self.free_at) + self.step_s

    def wait_until(self, end: float) -> None:
        ahead = end - time.monotonic()
        if ahead <= 0:
            return
        if ahead > SPIN_S:  # asleep until just before the end, then yielding the GIL
            time.sleep(ahead - SPIN_S)
        while time.monotonic() < end:
            time.sleep(0)
        self.late.append(time.monotonic() - end)


def launch(stats_path: str, step_s: float, argv: list[str]) -> int:
    """Run `pagedserve executor argv` on the virtual device; write its figures to
    ``stats_path`` when it stops serving."""
    from pagedserve.executor import (
        cuda_graphs,
        graph_feed,
        model_runner,
        process,
        runner_setup,
        sampler,
    )

    device = VirtualDevice(step_s)
    graphs: list = []  # the executor's DecodeGraphs, once captured
    phases = None
    if os.environ.get(PHASES_ENV) == "1":
        from executor_host_phases import install

        phases = install()

    def dump() -> None:
        Path(stats_path).write_text(json.dumps(
            {"launches": device.launches, "late": device.late,
             "fed": graphs[0].fed if graphs else [0, 0, 0],
             "phases": phases() if phases is not None else None}))

    serve = process.ExecutorProcess.serve  # the process ends in os._exit: no atexit

    def serve_then_dump(self):
        try:
            return serve(self)
        finally:
            dump()
    process.ExecutorProcess.serve = serve_then_dump

    capture = cuda_graphs.DecodeGraphs.capture  # the executor's graphs, for their counts

    def capture_and_keep(self, *a, **kw):
        if not graphs:
            graphs.append(self)
        return capture(self, *a, **kw)
    cuda_graphs.DecodeGraphs.capture = capture_and_keep
    from pagedserve.cli import main as cli_main

    if "cuda" in argv[argv.index("--device") + 1]:  # the real device, as `serve` runs it
        return cli_main(["executor", *argv])

    # Graphs on the CPU (their twins), whose replay only queues device time.
    cuda_graphs.graphs_supported = lambda dev: ""
    runner_setup.check_graph_feed = lambda graphs: None  # a null replay writes nothing
    capture_twin = cuda_graphs.DecodeGraphs._capture_twin

    def null_twin(self, size):
        holder = capture_twin(self, size)  # outputs computed once, kept as they are
        holder.replay = device.launch
        return holder
    cuda_graphs.DecodeGraphs._capture_twin = null_twin

    # Steps stay in flight as on a GPU; the read-back waits for the clock.
    init = model_runner.ModelRunner.__init__

    def runner_init(self, *a, **kw):
        init(self, *a, **kw)
        self.overlap_steps = True
    model_runner.ModelRunner.__init__ = runner_init

    class Sampled(sampler.SampledOnDevice):  # the tokens are read back at the step's end
        __slots__ = ("done_at",)

        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            self.done_at = device.free_at

        def wait(self) -> None:
            device.wait_until(self.done_at)

        def done(self) -> bool:
            return time.monotonic() >= self.done_at

        def result(self):
            device.wait_until(self.done_at)
            return super().result()
    sampler.SampledOnDevice = Sampled

    take = graph_feed.StagingRing.take  # a buffer is free once its step has started

    def ring_take(self):
        i = take(self)
        device.wait_until(getattr(self, "_starts", {}).get(i, 0.0))
        return i

    copy_out = graph_feed.StagingRing.copy_out

    def ring_copy_out(self, i, words, dst):
        copy_out(self, i, words, dst)
        self.__dict__.setdefault("_starts", {})[i] = max(time.monotonic(), device.free_at)
    graph_feed.StagingRing.take = ring_take
    graph_feed.StagingRing.copy_out = ring_copy_out
    return cli_main(["executor", *argv])


# ----------------------------------------------------------------- the router's side


# The executor's threads by their OS names (executor/io_threads.py names them).
THREAD_KEYS = {"executor-io": "io", "flight-watch": "watch", "heartbeat": "heartbeat"}


def _threads(pid: int) -> dict[int, tuple[str, float, float, int]]:
    """{thread id: (its key here, user s, system s, context switches)} of a process."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended
            text = (task / "stat").read_text()
            name = text[text.index("(") + 1:text.rindex(")")]
            fields = text[text.rindex(")") + 2:].split()
            switches = sum(int(line.split()[1])
                           for line in (task / "status").read_text().splitlines()
                           if "ctxt_switches:" in line)
            key = "main" if int(task.name) == pid else THREAD_KEYS.get(name, "other")
            out[int(task.name)] = (key, int(fields[11]) / tick, int(fields[12]) / tick,
                                   switches)
    return out


def run_case(model_dir: str, rows: int, depth: int, device_ms: float, steps: int,
             warmup: int, phases: bool = False, device: str = "cpu") -> dict:
    """One case. ``device`` "cuda": the executor on the GPU as `serve` runs it (no virtual
    device: ``device_ms`` unused), the model's own context length."""
    import numpy as np
    import zmq
    from executor_steps import pipelined_decode_plans
    from pagedserve.protos.codec import Codec
    from pagedserve.protos.wire import Heartbeat, Hello, Shutdown, StepResult, Welcome

    codec = Codec()
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    plans = [codec.encode(p) for p in pipelined_decode_plans(rows, PROMPT_LEN, BLOCK_SIZE,
                                                             steps, vocab)]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    blocks = rows * ((PROMPT_LEN + steps) // BLOCK_SIZE + 3)
    fd, stats = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [sys.executable, __file__, "--launch", stats, str(device_ms / 1e3), "--",
           "--model", model_dir, "--router", f"tcp://127.0.0.1:{port}", "--device", device,
           "--num-gpu-blocks", str(blocks), "--swap-space", "0", "--max-num-seqs",
           str(max(rows, 8)), "--executor-id", "host", "--heartbeat-timeout", "30",
           *(["--max-model-len", str(MAX_MODEL_LEN)] if device == "cpu" else [])]
    env = {**os.environ, "PAGEDSERVE_PARENT_PID": str(os.getpid()),
           PHASES_ENV: "1" if phases else "0"}
    # The executor's log (a pipe could fill and block it); closed in the finally below.
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)

    def why() -> str:
        log.seek(0)
        return log.read()[-3000:]
    arrivals: list[float] = []
    gaps: list[float] = []  # the results' gap_s (GPU: the device idle before the step)
    forwards: list[float] = []
    try:
        ident = None
        deadline = time.monotonic() + 300
        while ident is None:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the executor did not register: {why()}")
            if sock.poll(200):
                who, *frames = sock.recv_multipart(copy=False)
                msg = codec.decode(frames)
                if isinstance(msg, Hello):
                    ident = who.bytes
                    sock.send_multipart([ident, *codec.encode(
                        Welcome(executor_id="host", accepted=True))])
        sent = 0
        cpu0 = None
        while len(arrivals) < steps:
            while sent < steps and sent - len(arrivals) < depth:
                sock.send_multipart([ident, *plans[sent]], copy=False)
                sent += 1
            if not sock.poll(60_000):
                raise RuntimeError(f"no result in 60 s: {why()}")
            who, *frames = sock.recv_multipart(copy=False)
            msg = codec.decode(frames)
            if isinstance(msg, Heartbeat):
                sock.send_multipart([who.bytes, *frames], copy=False)
            elif isinstance(msg, StepResult):
                if msg.errors:
                    raise RuntimeError(f"step {msg.step_id}: {msg.errors}")
                arrivals.append(time.monotonic())
                gaps.append(msg.gap_s)
                forwards.append(msg.forward_s)
                if len(arrivals) == warmup:
                    cpu0 = _threads(proc.pid)
        cpu1 = _threads(proc.pid)
        sock.send_multipart([ident, *codec.encode(Shutdown(reason="done", exit=True))])
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sock.close(0)
        ctx.term()
        log.close()
    figures = json.loads(Path(stats).read_text())
    os.unlink(stats)
    t0, t1 = arrivals[warmup - 1], arrivals[-1]
    n = len(arrivals) - warmup
    periods = np.diff(arrivals[warmup - 1:]) * 1e6
    idle = [i for t, i in figures["launches"] if t0 < t <= t1]
    per_thread: dict[str, list[float]] = {}  # key -> [user s, system s, switches]
    for tid, (key, user, system, switches) in cpu1.items():
        before = cpu0.get(tid, (key, 0.0, 0.0, 0))
        into = per_thread.setdefault(key, [0.0, 0.0, 0])
        into[0] += user - before[1]
        into[1] += system - before[2]
        into[2] += switches - before[3]
    total = [sum(v[i] for v in per_thread.values()) for i in range(3)]
    window_gaps = sorted(gaps[warmup:])
    return {
        "bench": "executor_host",
        "case": (f"b{rows}_d{depth}_dev{device_ms:g}ms" if device == "cpu" else
                 f"{device}_{Path(model_dir).name}_b{rows}_d{depth}"),
        "rows": rows, "depth": depth, "device": device,
        "device_ms": device_ms if device == "cpu" else None, "steps": n,
        # The results' own figures: on a GPU the device's idle before each step (events)
        # and its forward; on the CPU host time (the virtual device's idle is below).
        "result_gap_us_p50": round(window_gaps[len(window_gaps) // 2] * 1e6, 1),
        "result_gap_us_mean": round(statistics.fmean(window_gaps) * 1e6, 1),
        "result_forward_us_p50": round(statistics.median(forwards[warmup:]) * 1e6, 1),
        # Graph steps fed by where their ids came from: the stage, the last tokens, copied in.
        "fed_steps": figures["fed"],
        "step_us_p50": round(float(np.median(periods)), 1),
        "step_us_mean": round((t1 - t0) / n * 1e6, 1),
        "step_us_p90": round(float(np.percentile(periods, 90)), 1),
        "device_idle_us_p50": round(statistics.median(idle) * 1e6, 1) if idle else None,
        "device_idle_us_mean": round(statistics.fmean(idle) * 1e6, 1) if idle else None,
        "busy_ratio": round(min(1.0, len(idle) * device_ms / 1e3 / (t1 - t0)), 3)
        if device_ms and device == "cpu" else None,
        "host_cpu_us_per_step": round((total[0] + total[1]) / n * 1e6, 1),
        "host_sys_us_per_step": round(total[1] / n * 1e6, 1),
        "switches_per_step": round(total[2] / n, 1),
        **{f"{k}_cpu_us_per_step": round((v[0] + v[1]) / n * 1e6, 1)
           for k, v in sorted(per_thread.items()) if k != "heartbeat"},
        **{f"{k}_switches_per_step": round(v[2] / n, 1)
           for k, v in sorted(per_thread.items()) if k in ("main", "io", "watch")},
        "wake_late_us_p50": round(statistics.median(figures["late"]) * 1e6, 1)
        if figures["late"] else None,
        **({"phases_cpu_wall_calls_per_step": figures["phases"]} if phases else {}),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--launch"]:
        stats, step_s, rest = argv[1], float(argv[2]), argv[4:]
        return launch(stats, step_s, rest)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="32,256")
    ap.add_argument("--depths", default="2,4")
    ap.add_argument("--device-ms", default="0,auto",
                    help="comma-separated device ms a step (0: none; auto: the H200's at "
                         "that many rows)")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cuda: the executor on the GPU as `serve` runs it (no virtual "
                         "device; --device-ms unused)")
    ap.add_argument("--model-dir", default=None,
                    help="the model (default: the tiny one, `--model tiny`)")
    ap.add_argument("--phases", action="store_true",
                    help="also time the executor's phases by thread (executor_host_phases.py; "
                         "the timers slow the steps a little)")
    args = ap.parse_args(argv)
    if args.steps + PROMPT_LEN > MAX_MODEL_LEN or args.warmup < 2 or args.steps <= args.warmup:
        ap.error(f"need 2 <= --warmup < --steps <= {MAX_MODEL_LEN - PROMPT_LEN}")
    from pagedserve.models import ensure_tiny_model

    model_dir = args.model_dir or str(ensure_tiny_model())
    for rows in [int(r) for r in args.rows.split(",")]:
        times = ([0.0] if args.device == "cuda" else
                 [AUTO_DEVICE_MS.get(rows, 1.28) if x == "auto" else float(x)
                  for x in args.device_ms.split(",")])
        for device_ms in times:
            for depth in [int(d) for d in args.depths.split(",")]:
                print(json.dumps(run_case(model_dir, rows, depth, device_ms, args.steps,
                                          args.warmup, args.phases, args.device)),
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
