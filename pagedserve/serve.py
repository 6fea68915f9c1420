"""`pagedserve serve`: the router in this process plus N executor child processes.

Each child gets `--router` (the bound ZeroMQ endpoint), its own `--executor-id` and
`--parent-pid` (it exits when this process dies). Its output is relayed to stderr, each line
prefixed with its name. When a child exits the router counts its executor dead at once;
with --restart-executors a new one is started. A child the router declares dead while its
process still runs (it stopped heartbeating, or left a plan unanswered past its deadline: a
hung kernel looks like this) is killed, so it is restarted (with --restart-executors) rather
than left holding its device. On SIGINT/SIGTERM the router drains, asks
the executors to shut down, and every child is waited for (then terminated, then killed).

A child that exits while the cluster is still starting (before the ready line: serve waits
for all N to register) ends serve with exit code 1, --restart-executors or not: what stops
an executor at start (no memory left for its KV cache, a model it cannot load) would stop
the next one alike, and serve would otherwise wait for it forever.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable

from . import event_loop
from .affinity import format_cores, pin_current_thread, plan_serve
from .flags import env_name
from .router.app import ModelDirError, ServerBindError, ServerConfigError, serve_router
from .router.executor_link import ExecutorLinkError

log = logging.getLogger("pagedserve.serve")


@functools.cache  # (asked for the plan and for the children: nvidia-smi runs once)
def _num_gpus() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def _relay_to_stderr(name: str, line: str) -> None:
    sys.stderr.write(f"[{name}] {line}")


API_KEY_ENV = env_name("api-key")


def without_api_keys(argv: list[str]) -> list[str]:
    """`argv` less `--api-key K` / `--api-key=K` (or argparse's abbreviations of it, from
    `--api-k`): executors never need the API keys, so they are not copied into their
    command lines (visible to every user of the machine) or environments."""
    out, skip = [], False
    for arg in argv:
        name, eq, _ = arg.partition("=")
        if skip:
            skip = False
        elif len(name) >= len("--api-k") and "--api-key".startswith(name):
            skip = not eq
        else:
            out.append(arg)
    return out


class ExecutorChildren:
    """`relay(name, line)` receives each output line of a child (default: stderr with a
    `[executor-i]` prefix; `pagedserve demo` keeps them for a failure report instead)."""

    def __init__(self, args, argv: list[str],
                 relay: Callable[[str, str], None] = _relay_to_stderr,
                 compute_cores: list[list[int]] | None = None) -> None:
        """`compute_cores`: executor i's compute cores (pagedserve.affinity), or None."""
        self.args = args
        self.compute_cores = compute_cores
        self.argv = argv
        self.relay = relay
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.tasks: list[asyncio.Task] = []
        self.stopping = False
        self.num_gpus = _num_gpus() if not args.device else 0
        # Until `started()`: an exit is a failed start, `startup_failure` says which child
        # and `stop_event` (the router's, set by its owner) is set.
        self.starting = True
        self.startup_failure: str | None = None
        self.stop_event: asyncio.Event | None = None

    def _command(self, index: int, endpoint: str, executor_id: str) -> list[str]:
        cmd = [sys.executable, "-m", "pagedserve.cli", "executor", *without_api_keys(self.argv),
               "--model", self.args.model, "--router", endpoint,
               "--executor-id", executor_id, "--parent-pid", str(os.getpid())]
        prefill = getattr(self.args, "prefill_executors", 0)
        if prefill:  # the first ones prefill, the others decode (router/handoff.py)
            cmd += ["--disaggregation-mode", "prefill" if index < prefill else "decode"]
        if self.num_gpus:
            cmd += ["--device", f"cuda:{index % self.num_gpus}"]
        elif self.compute_cores:
            cmd += ["--cpu-affinity", format_cores(self.compute_cores[index])]
        return cmd

    async def start_all(self, endpoint: str, engine) -> None:
        engine.membership.on_hung = self.kill_hung
        host = socket.gethostname()
        for i in range(self.args.executors):
            executor_id = f"{host}-serve{i}-{os.getpid()}"
            await self._spawn(i, endpoint, executor_id, engine)

    async def started(self, engine=None, ready=None) -> None:
        """The cluster is ready: from now on a child's exit is a dead executor."""
        self.starting = False

    def kill_hung(self, executor_id: str, why: str) -> None:
        proc = self.procs.get(executor_id)
        if proc is None or proc.returncode is not None or self.stopping:
            return
        log.warning("killing executor %s (pid %d): %s", executor_id, proc.pid, why)
        proc.kill()

    async def _spawn(self, index: int, endpoint: str, executor_id: str, engine) -> None:
        proc = await asyncio.create_subprocess_exec(
            *self._command(index, endpoint, executor_id),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            env={k: v for k, v in os.environ.items() if k != API_KEY_ENV},
        )
        self.procs[executor_id] = proc
        log.info("started executor %s (pid %d)", executor_id, proc.pid)
        self.tasks.append(asyncio.ensure_future(
            self._watch(index, endpoint, executor_id, proc, engine)))

    async def _watch(self, index, endpoint, executor_id, proc, engine) -> None:
        name = f"executor-{index}"
        assert proc.stdout is not None
        async for raw in proc.stdout:
            self.relay(name, raw.decode(errors="replace"))
        rc = await proc.wait()
        if self.stopping:
            return
        if engine.stopping:  # the router told it to: not a loss
            (log.info if rc == 0 else log.warning)(
                "executor %s exited with code %s (router stopping)", executor_id, rc)
            return
        log.warning("executor %s exited with code %s", executor_id, rc)
        engine.executor_exited(executor_id, rc)
        if self.starting:
            self.startup_failure = (f"executor {executor_id} exited with code {rc} before "
                                    "the cluster was ready (see its output)")
            if self.stop_event is not None:
                self.stop_event.set()
            return
        if self.args.restart_executors:
            await asyncio.sleep(1.0)
            await self._spawn(index, endpoint, executor_id, engine)

    async def stop(self, timeout_s: float = 10.0) -> None:
        self.stopping = True
        procs = [p for p in self.procs.values() if p.returncode is None]
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), timeout_s)
        except asyncio.TimeoutError:
            for p in procs:
                if p.returncode is None:
                    p.terminate()
            try:
                await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), 5)
            except asyncio.TimeoutError:
                for p in procs:
                    if p.returncode is None:
                        p.kill()
                await asyncio.gather(*(p.wait() for p in procs))
        for task in self.tasks:
            task.cancel()


def _on_cpu(args, num_gpus: int) -> bool:
    """Do serve's executors run on CPUs (`--device cpu`, or no device given and no GPU)?"""
    return (args.device or "").startswith("cpu") or (not args.device and not num_gpus)


def plan_cpu_affinity(args, num_gpus: int) -> list[list[int]] | None:
    """CPU executors get cores of their own (`--cpu-affinity auto`, the default) when each
    one's --cpu-threads cores still leave one for the router; this process (the router and
    everything it starts besides executors) moves to the remaining cores. None: no pinning."""
    if args.cpu_affinity != "auto" or not _on_cpu(args, num_gpus):
        return None
    plan = plan_serve(args.executors, max(1, args.cpu_threads))
    if plan is None:
        return None
    per_executor, rest = plan
    if not pin_current_thread(rest):
        return None
    log.info("CPU affinity: router on cores %s, executors on %s", format_cores(rest),
             " | ".join(format_cores(c) for c in per_executor))
    return per_executor


def serve_children(args, argv: list[str]) -> tuple[ExecutorChildren, bool]:
    """The executor processes `serve` starts (their cores planned, the router pinned to the
    rest: plan_cpu_affinity) and whether they run on GPUs."""
    num_gpus = _num_gpus() if not args.device else 0
    compute = plan_cpu_affinity(args, num_gpus)
    return ExecutorChildren(args, argv, compute_cores=compute), not _on_cpu(args, num_gpus)


async def _serve(args, argv: list[str]) -> int:
    children, on_gpu = serve_children(args, argv)
    children.stop_event = asyncio.Event()
    try:
        rc = await serve_router(args, wait_for_executors=args.executors,
                                on_bound=children.start_all, on_started=children.started,
                                stop_event=children.stop_event, executors_on_gpu=on_gpu)
    finally:
        await children.stop()
    if children.startup_failure is not None:
        print(f"pagedserve serve: {children.startup_failure}", file=sys.stderr)
        return 1
    return rc


# Where a cluster of a command's own listens (run-batch, pagedserve.LLM): loopback, free
# ports for gRPC, HTTP and the executor socket, no metrics; a running `serve` undisturbed.
PRIVATE_CLUSTER = dict(host="127.0.0.1", port=0, http_port=0, metrics_port=-1,
                       executor_bind="tcp://127.0.0.1:*")
INTERRUPTED = 130  # a job's exit code when SIGINT/SIGTERM stopped the cluster under it


async def run_cluster_job(args, children: ExecutorChildren, job, *, on_bound=None,
                          executors_on_gpu: bool | None = None) -> int:
    """Start the router and `children`'s executors, run `job(engine, ready)` (a coroutine
    function returning an exit code; `ready`: router/app.ReadyAddresses) once every executor
    has registered, then drain and stop the cluster. Returns the job's code; INTERRUPTED
    when SIGINT/SIGTERM came first (the job is cancelled), 1 when an executor failed to
    start (`children.startup_failure` says which). `on_bound`: instead of
    `children.start_all` (e.g. to also print each child)."""
    stop = children.stop_event = asyncio.Event()  # an executor failing at start sets it too
    result = {"rc": 1}

    async def on_started(engine, ready) -> None:
        await children.started()
        work = asyncio.ensure_future(job(engine, ready))
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({work, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if work.done():
            result["rc"] = work.result()
        else:
            work.cancel()
            result["rc"] = INTERRUPTED
        stop.set()

    try:
        await serve_router(args, wait_for_executors=args.executors,
                           on_bound=on_bound or children.start_all, on_started=on_started,
                           stop_event=stop, executors_on_gpu=executors_on_gpu)
    finally:
        await children.stop()
    return 1 if children.startup_failure is not None else result["rc"]


def run_serve(args, argv: list[str]) -> int:
    try:
        return event_loop.run(_serve(args, argv))
    except (ModelDirError, ExecutorLinkError, ServerBindError, ServerConfigError) as exc:
        print(f"pagedserve serve: {exc}", file=sys.stderr)
        return 2
