"""`pagedserve serve`: the router in this process plus N executor child processes.

Each child gets `--router` (the bound ZeroMQ endpoint), its own `--executor-id` and
`--parent-pid` (it exits when this process dies). Its output is relayed to stderr, each line
prefixed with its name. When a child exits the router counts its executor dead at once;
with --restart-executors a new one is started. A child the router declares dead while its
process still runs (it stopped heartbeating, or left a plan unanswered past its deadline: a
hung kernel looks like this) is killed, so it is restarted (with --restart-executors) rather
than left holding its device. On SIGINT/SIGTERM the router drains, asks
the executors to shut down, and every child is waited for (then terminated, then killed).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable

from .router.app import ModelDirError, serve_router
from .router.executor_link import ExecutorLinkError

log = logging.getLogger("pagedserve.serve")


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


class ExecutorChildren:
    """`relay(name, line)` receives each output line of a child (default: stderr with a
    `[executor-i]` prefix; `pagedserve demo` keeps them for a failure report instead)."""

    def __init__(self, args, argv: list[str],
                 relay: Callable[[str, str], None] = _relay_to_stderr) -> None:
        self.args = args
        self.argv = argv
        self.relay = relay
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.tasks: list[asyncio.Task] = []
        self.stopping = False
        self.num_gpus = _num_gpus() if not args.device else 0

    def _command(self, index: int, endpoint: str, executor_id: str) -> list[str]:
        cmd = [sys.executable, "-m", "pagedserve.cli", "executor", *self.argv,
               "--model", self.args.model, "--router", endpoint,
               "--executor-id", executor_id, "--parent-pid", str(os.getpid())]
        if self.num_gpus:
            cmd += ["--device", f"cuda:{index % self.num_gpus}"]
        return cmd

    async def start_all(self, endpoint: str, engine) -> None:
        engine.membership.on_hung = self.kill_hung
        host = socket.gethostname()
        for i in range(self.args.executors):
            executor_id = f"{host}-serve{i}-{os.getpid()}"
            await self._spawn(i, endpoint, executor_id, engine)

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
        log.warning("executor %s exited with code %s", executor_id, rc)
        engine.executor_exited(executor_id, rc)
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


async def _serve(args, argv: list[str]) -> int:
    children = ExecutorChildren(args, argv)
    try:
        return await serve_router(args, wait_for_executors=args.executors,
                                  on_bound=children.start_all)
    finally:
        await children.stop()


def run_serve(args, argv: list[str]) -> int:
    try:
        return asyncio.run(_serve(args, argv))
    except (ModelDirError, ExecutorLinkError) as exc:
        print(f"pagedserve serve: {exc}", file=sys.stderr)
        return 2
