"""The API workers' test rig (tests/test_api_workers.py): finding a router's worker
processes and which worker holds a connection, channels and streams on a chosen worker,
the metrics reader, a router started alone."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from cluster_harness import free_port, request
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2_grpc as pb_grpc

WORKER_MARK = "pagedserve.router.api_worker"


def worker_pids(router_pid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == router_pid and WORKER_MARK.encode() in cmdline:
            pids.append(int(entry))
    return sorted(pids)


def new_stub(cluster) -> tuple[grpc.Channel, pb_grpc.GeneratorStub]:
    """A channel of its own (a new TCP connection: the kernel picks a worker for it)."""
    channel = grpc.insecure_channel(cluster.address,
                                    options=[("grpc.use_local_subchannel_pool", 1)])
    return channel, pb_grpc.GeneratorStub(channel)


def metric(text: str, prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix))


def open_stream(stub, request_id: str, chunks: list, ended: threading.Event):
    """A long greedy stream in a thread: chunks (or the RpcError that ended it) go to
    `chunks`; `ended` is set when it is over."""
    req = request("Abort me", max_tokens=4000, ignore_eos=True, temperature=0)
    req.request_id = request_id

    def run():
        try:
            for chunk in stub.Stream(req, timeout=120):
                chunks.append(chunk)
        except grpc.RpcError as exc:
            chunks.append(exc)
        ended.set()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def wait_for_tokens(chunks: list, n: int = 2, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while len(chunks) < n and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(chunks) >= n, chunks


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(int(link[len("socket:["):-1]))
    return inodes


def connections_by_worker(cluster) -> dict[int, int]:
    """Established gRPC connections each worker holds (server side: local port = gRPC's)."""
    port = int(cluster.address.rsplit(":", 1)[1])
    established = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if f[3] == "01" and int(f[1].rsplit(":", 1)[1], 16) == port:
                    established.add(int(f[9]))
    return {pid: len(_socket_inodes(pid) & established)
            for pid in worker_pids(cluster.router.pid)}


def _new_owner(before: dict[int, int], after: dict[int, int]) -> int | None:
    grown = [pid for pid, n in after.items() if n > before.get(pid, 0)]
    return grown[0] if len(grown) == 1 else None


def stub_on(cluster, want_other_than: int | None, want: int | None = None):
    """A fresh channel with one call made on it, and the worker that got its connection;
    retried until it is on a worker other than `want_other_than` (or on `want`)."""
    for _ in range(24):
        before = connections_by_worker(cluster)
        channel, stub = new_stub(cluster)
        stub.GetModelInfo(pb.ModelInfoRequest(), timeout=10)
        owner = _new_owner(before, connections_by_worker(cluster))
        if owner is not None and owner != want_other_than and want in (None, owner):
            return channel, stub, owner
        channel.close()
    raise AssertionError("no connection landed where wanted in 24 tries")


def with_id(req: pb.GenerateRequest, request_id: str) -> pb.GenerateRequest:
    req.request_id = request_id
    return req


def start_router(model_dir, port: int, http_port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.cli", "router", "--model", str(model_dir),
         "--api-workers", "2", "--port", str(port), "--http-port", str(http_port),
         "--metrics-port", "-1", "--executor-bind", f"tcp://127.0.0.1:{free_port()}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    seen: list[str] = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        seen.append(line)
        if "pagedserve ready" in line or not line:
            assert "pagedserve ready" in line, \
                f"router exited ({proc.wait(10)}): {''.join(seen[-10:])}"
            return proc
    raise AssertionError("router not ready")
