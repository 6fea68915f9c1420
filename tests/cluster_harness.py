"""Start a real cluster for a test module: `pagedserve router` plus executor processes.

Processes talk over loopback only. Each executor process imports torch (~2-3 s, ~250 MB),
so start one cluster per module and share it. HF reference generation is here too.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2_grpc as pb_grpc

from pagedserve.subprocs import stop_processes

READY = re.compile(r"pagedserve ready grpc=(\S+) metrics=(\S+) executors=(\d+) http=(\S+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def router_alone(model_dir: str, *flags: str, env: dict | None = None):
    """`pagedserve router` with no executor, gRPC and HTTP on free ports, metrics off, and
    `flags`; yields (its ready line's match, the output lines up to it, the process).
    Terminated on the way out."""
    env = env if env is not None else {k: v for k, v in os.environ.items()
                                       if not k.startswith("PAGEDSERVE_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.cli", "router", "--model", str(model_dir),
         "--port", "0", "--http-port", "0", "--metrics-port", "-1",
         "--executor-bind", f"tcp://127.0.0.1:{free_port()}", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines, ready = [], None
        for line in proc.stdout:
            lines.append(line)
            if ready := READY.search(line):
                break
        assert ready, "the router did not start:\n" + "".join(lines)
        yield ready, lines, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=30)


def post_json(cluster, path: str, body: dict) -> tuple[int, dict]:
    """POST ``body`` to the cluster's OpenAI API at ``path``: (status, JSON reply), errors
    included."""
    req = urllib.request.Request(f"http://{cluster.http_address}{path}",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


class _Reader(threading.Thread):
    """Collects a process's output lines (for the ready line and for failure reports)."""

    def __init__(self, proc: subprocess.Popen, name: str) -> None:
        super().__init__(daemon=True)
        self.proc, self.name = proc, name
        self.lines: list[str] = []

    def run(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def tail(self, n: int | None = 30) -> str:
        """The last `n` lines (every line when None), each marked with the process."""
        return "\n".join(f"[{self.name}] {x}" for x in self.lines[-n if n else 0:])


class Cluster:
    def __init__(self, model_dir: str | Path, num_executors: int = 2,
                 router_args: list[str] | None = None,
                 executor_args: list[str] | None = None,
                 executor_env: dict[str, dict] | None = None) -> None:
        self.model_dir = str(model_dir)
        self.num_executors = num_executors
        self.router_args = router_args or []
        self.executor_args = executor_args or []
        self.executor_env = executor_env or {}  # executor id -> extra environment
        self.zmq = f"tcp://127.0.0.1:{free_port()}"
        self.router: subprocess.Popen | None = None
        self.executors: dict[str, subprocess.Popen] = {}
        self.readers: list[_Reader] = []
        self.address = ""
        self.metrics_address = ""
        self.http_address = ""  # host:port of the OpenAI API ("" when off)
        self.channel: grpc.Channel | None = None
        self.stub: pb_grpc.GeneratorStub | None = None

    def _env(self) -> dict:
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env["TRITON_INTERPRET"] = "1"
        return env

    def _spawn(self, args: list[str], name: str, env: dict | None = None) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagedserve.cli", *args], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env={**self._env(), **(env or {})},
        )
        reader = _Reader(proc, name)
        reader.start()
        self.readers.append(reader)
        return proc

    def start_executor(self, executor_id: str, env: dict | None = None) -> subprocess.Popen:
        """`env`: extra environment for this executor only (e.g. a fault-injection hook)."""
        proc = self._spawn(["executor", "--model", self.model_dir, "--router", self.zmq,
                            "--executor-id", executor_id, "--heartbeat-timeout", "1",
                            *self.executor_args], executor_id, env)
        self.executors[executor_id] = proc
        return proc

    def start(self, timeout_s: float = 90.0) -> Cluster:
        self.router = self._spawn(
            ["router", "--model", self.model_dir, "--port", "0", "--metrics-port", "0",
             "--http-port", "0",
             "--executor-bind", self.zmq, "--heartbeat-timeout", "1", "--debug-checks",
             *self.router_args], "router")
        for i in range(self.num_executors):
            self.start_executor(f"exec{i}", self.executor_env.get(f"exec{i}"))
        reader = self.readers[0]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in reader.lines:
                m = READY.search(line)
                if m:
                    self.address, self.metrics_address = m.group(1), m.group(2)
                    self.http_address = "" if m.group(4) == "off" else m.group(4)
                    break
            if self.address:
                break
            if self.router.poll() is not None:
                raise RuntimeError("router exited:\n" + self.logs())
            time.sleep(0.1)
        else:
            raise RuntimeError("router not ready:\n" + self.logs())
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.GeneratorStub(self.channel)
        self.wait_executors(self.num_executors, timeout_s=deadline - time.monotonic())
        return self

    @contextlib.contextmanager
    def running(self, timeout_s: float = 90.0):
        """`with cluster.running():` started (stopped again if the start fails) and stopped
        at the end: a test module's cluster fixture."""
        try:
            self.start(timeout_s)
        except Exception:
            self.stop()
            raise
        try:
            yield self
        finally:
            self.stop()

    def status(self) -> pb.ClusterStatus:
        return self.stub.GetClusterStatus(pb.ClusterStatusRequest(), timeout=10)

    def wait_executors(self, n: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sum(e.healthy for e in self.status().executors) >= n:
                return
            time.sleep(0.2)
        raise RuntimeError(f"{n} executors did not register:\n" + self.logs())

    def wait_blocks_free(self, timeout_s: float = 10.0) -> pb.ClusterStatus:
        """Wait until every healthy executor has all its device blocks free."""
        deadline = time.monotonic() + timeout_s
        status = self.status()
        while time.monotonic() < deadline:
            status = self.status()
            if all(e.num_free_gpu_blocks == e.num_gpu_blocks
                   for e in status.executors if e.healthy):
                return status
            time.sleep(0.1)
        return status

    def metrics(self) -> str:
        import urllib.request
        with urllib.request.urlopen(f"http://{self.metrics_address}/metrics", timeout=10) as r:
            return r.read().decode()

    def logs(self, n: int | None = 30) -> str:
        """Each process's last `n` lines (every line when None)."""
        return "\n".join(r.tail(n) for r in self.readers)

    def stop(self) -> None:
        """Executors first, so that each one's goodbye reaches a live router (an executor
        whose router is gone waits out its socket's 1 s linger before exiting), then the
        router."""
        if self.channel is not None:
            self.channel.close()
        stop_processes(self.executors.values(), timeout_s=15)
        if self.router is not None:
            stop_processes([self.router], timeout_s=15)


def request(prompt: str | None = None, token_ids=None, **params) -> pb.GenerateRequest:
    req = pb.GenerateRequest(params=pb.SamplingParams(**params))
    if token_ids is not None:
        req.prompt_token_ids.ids.extend(token_ids)
    if prompt is not None:
        req.prompt = prompt
    return req


def concurrently(fn, items) -> list:
    """``fn(item)`` for every item, each in its own thread at once; the results in order (a
    gRPC error in its item's place)."""
    results = [None] * len(items)

    def run(i):
        try:
            results[i] = fn(items[i])
        except grpc.RpcError as exc:
            results[i] = exc
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return results


class HFReference:
    """Greedy reference outputs from transformers, one prompt at a time, fp32, 1 thread."""

    def __init__(self, model_dir: str | Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        torch.set_num_threads(1)
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model.eval()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text).input_ids

    def greedy(self, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        """Greedy continuation ignoring EOS, with the top-2 logit gap at every position."""
        torch = self.torch
        ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                do_sample=False, output_logits=True, return_dict_in_generate=True,
                eos_token_id=None, pad_token_id=self.tokenizer.pad_token_id,
                min_new_tokens=max_tokens)
        tokens = out.sequences[0, len(prompt_ids):].tolist()
        gaps = []
        for logits in out.logits:
            top2 = logits[0].float().topk(2).values
            gaps.append(float(top2[0] - top2[1]))
        return tokens, gaps


def assert_greedy_match(got: list[int], expected: list[int], gaps: list[float],
                        tie: float = 1e-3) -> None:
    """Token-for-token equality, except that a first mismatch is accepted where the
    reference's top two logits were within `tie` of each other."""
    for j, (a, b) in enumerate(zip(got, expected, strict=False)):
        if a != b:
            assert gaps[j] < tie, (
                f"first mismatch at output position {j}: got {a}, HF {b} "
                f"(HF top-2 gap {gaps[j]:.4g})\n got: {got}\n  HF: {expected}")
            return
    assert len(got) == len(expected), (got, expected)
