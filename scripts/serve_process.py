"""`pagedserve serve` as a child process for the GPU check and its benchmarks: started in a
process group of its own with its output in a log file, ready once it prints its ready line
(DESIGN §4), its executors' pids read from its log, stopped with SIGTERM then SIGKILL. On
Linux it is killed when the process that started it dies (a GPU check step killed at its
time limit otherwise left its server, in a session of its own, holding the GPU's memory:
the next step's executors found no memory for a KV cache); its executors follow it (they
watch their parent).

The HTTP API is switched off (`--http-port -1`), so several servers (and the router's default
port 8000) never collide.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

READY = re.compile(r"pagedserve ready grpc=(\S+) metrics=(\S+) executors=(\d+) http=(\S+)")
STARTED = re.compile(r"started executor (\S+) \(pid (\d+)\)")


# Looked up here, not in the forked child (a library loaded there could wait on a lock
# another thread of the parent held).
_PRCTL = ctypes.CDLL(None).prctl if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """In the child before exec: SIGKILL when the parent dies (Linux prctl
    PR_SET_PDEATHSIG; nothing elsewhere), and now if it already has."""
    if _PRCTL is None:
        return
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_argv(model_dir: str | Path, *extra: str) -> list[str]:
    """`serve` on loopback with every port chosen free, plus `extra` flags."""
    return ["serve", "--model", str(model_dir), "--port", "0", "--metrics-port", "0",
            "--http-port", "-1", "--executor-bind", f"tcp://127.0.0.1:{free_port()}", *extra]


class ServeProcess:
    def __init__(self, argv: list[str], log_path: str | Path, env: dict | None = None) -> None:
        self.argv = argv
        self.log_path = Path(log_path)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.metrics_address = ""
        self.http_address = ""  # the OpenAI API's host:port, "off" (serve_argv's default)

    def start(self, timeout_s: float = 300.0) -> ServeProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pagedserve.cli", *self.argv], stdout=log,
                stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
                preexec_fn=functools.partial(_die_with_parent, os.getpid()))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = READY.search(self.log())
            if m:
                self.address, self.metrics_address, self.http_address = \
                    m.group(1), m.group(2), m.group(4)
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"pagedserve serve did not get ready:\n{self.log()[-4000:]}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def executor_pids(self) -> dict[str, int]:
        """Executor id -> pid of each child `serve` started (from its log)."""
        return {m.group(1): int(m.group(2)) for m in STARTED.finditer(self.log())}

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://{self.metrics_address}/metrics", timeout=10) as r:
            return r.read().decode()

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (the server drains), then SIGKILL to the whole group."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # stray executors too
        return self.proc.wait()

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def bench_on_server(model_dir: str | Path, log_path: str | Path, requests: list, warmup: list,
                    *, dtype: str, max_num_seqs: int, small: bool, extra: tuple = (),
                    env: dict | None = None, max_concurrency: int | None = None) -> dict:
    """`serve` with one executor (`--small`: on the CPU, a small cache), `warmup` requests
    then `requests` through `pagedserve.bench` (greedy, EOS ignored), the server stopped
    after: run_bench's summary of `requests` (the GPU check's serving benchmarks)."""
    import asyncio

    from pagedserve.bench import BenchConfig, run_bench

    device = ["--device", "cpu", "--cpu-threads", "1", "--kv-cache-space", "0.1"] if small \
        else []
    argv = serve_argv(model_dir, "--executors", "1", "--dtype", dtype, "--max-num-seqs",
                      str(max_num_seqs), "--swap-space", "0", *extra, *device)
    with ServeProcess(argv, log_path, env=env) as server:
        cfg = BenchConfig(address=server.address, metrics_address=server.metrics_address,
                          temperature=0.0, ignore_eos=True, progress=False, timeout_s=600.0,
                          max_concurrency=max_concurrency)
        asyncio.run(run_bench(cfg, warmup))
        return asyncio.run(run_bench(cfg, requests))
