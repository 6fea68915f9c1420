"""The executor process over real ZeroMQ: a fake router (ROUTER socket + Codec) in the test,
the executor as ``python -m pagedserve.executor.process``."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from pagedserve.protos.codec import Codec
from pagedserve.protos.wire import (
    ErrorReport,
    Heartbeat,
    Hello,
    NewRequest,
    SamplingParams,
    Shutdown,
    StepPlan,
    StepResult,
    WeightOp,
    Welcome,
    int32,
)

from pagedserve.tinymodels import build_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("proc") / "qwen2", "qwen2")


class FakeRouter:
    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.codec = Codec()
        self.echo = True  # answer every Heartbeat (what the router must do)
        self.heartbeats: list[tuple[bytes, Heartbeat]] = []

    def recv(self, timeout_s: float = 60.0, want=None):
        """(routing id, message) of the next message (of type ``want``, others skipped)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                ident, *frames = self.sock.recv_multipart(copy=False)
                msg = self.codec.decode(frames)
                if isinstance(msg, Heartbeat):
                    self.heartbeats.append((ident.bytes, msg))
                    if self.echo:
                        self.send(ident.bytes, msg)
                if want is None or isinstance(msg, want):
                    return ident.bytes, msg
        raise TimeoutError(f"no {want} within {timeout_s} s")

    def send(self, ident: bytes, msg) -> None:
        self.sock.send_multipart([ident, *self.codec.encode(msg)], copy=False)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _start(model_dir, address, *extra):
    cmd = [sys.executable, "-m", "pagedserve.executor.process", "--model", str(model_dir),
           "--router", address, "--device", "cpu", "--num-gpu-blocks", "32",
           "--swap-space", "0", "--heartbeat-timeout", "0.4", *extra]
    env = {**os.environ, "PAGEDSERVE_PARENT_PID": str(os.getpid())}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            text=True)


def test_register_execute_heartbeat_reregister_shutdown(model_dir, tmp_path):
    router = FakeRouter()
    proc = _start(model_dir, router.address, "--executor-id", "ex-1")
    try:
        ident, hello = router.recv(want=Hello)
        fingerprint = hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()
        assert (hello.executor_id, hello.model_fingerprint) == ("ex-1", fingerprint)
        assert (hello.device, hello.dtype, hello.block_size) == ("cpu", "float32", 16)
        assert (hello.num_gpu_blocks, hello.num_cpu_blocks) == (32, 0)
        assert hello.max_model_len == 1024 and hello.pid == proc.pid
        assert hello.weights_path == ""  # its --model's
        router.send(ident, Welcome(executor_id="ex-1", accepted=True))

        # Heartbeats arrive on their own socket (another routing id); recv echoes them.
        hb_ident, beat = router.recv(timeout_s=5, want=Heartbeat)
        assert beat.executor_id == "ex-1" and hb_ident != ident
        # Its threads carry their names where the OS shows them (top -H, /proc).
        names = {(task / "comm").read_text().strip()
                 for task in Path(f"/proc/{proc.pid}/task").iterdir()}
        assert {"heartbeat", "executor-io"} <= names, names

        # A malformed message is answered with an ErrorReport, never executed.
        router.sock.send_multipart([ident, b"\xc1garbage"])
        _, report = router.recv(timeout_s=10, want=ErrorReport)
        assert "rejected" in report.message

        prompt = [0, 17, 250, 33, 9]
        plan = StepPlan(
            step_id=7,
            new_requests=[NewRequest(request_id="r", prompt_token_ids=int32(prompt),
                                     output_token_ids=int32([]),
                                     sampling=SamplingParams(temperature=0.0))],
            request_ids=["r"], num_computed_tokens=int32([0]), num_new_tokens=int32([5]),
            do_sample=np.array([1], np.uint8), token_ids=int32(prompt),
            positions=int32(range(5)), slot_mapping=np.arange(16, 21, dtype=np.int64),
            block_table_starts=int32([0]), block_table_lens=int32([1]),
            block_table_ids=int32([1]))
        router.send(ident, plan)
        _, result = router.recv(timeout_s=20, want=StepResult)
        assert (result.step_id, result.request_ids, result.errors) == (7, ["r"], [])
        assert result.executor_id == "ex-1" and result.forward_s > 0
        assert 0 <= int(result.token_ids[0]) < 512

        # New weights (a checkpoint: here a copy of the model's) with a plan of nothing else
        ckpt = shutil.copytree(model_dir, tmp_path / "ckpt")
        router.send(ident, StepPlan(step_id=8, weight_op=WeightOp(path=str(ckpt), load=True)))
        _, result = router.recv(timeout_s=20, want=StepResult)
        assert (result.step_id, result.weight_failed, result.errors) == (8, "", [])

        # The router forgot us: the executor registers again, with an empty state, saying
        # which weights it runs (a restarted router has it load --model's back).
        router.send(hb_ident, Shutdown(reason="unknown executor", exit=False))
        ident, hello2 = router.recv(timeout_s=10, want=Hello)
        assert (hello2.executor_id, hello2.weights_path) == ("ex-1", str(ckpt))
        router.send(ident, Welcome(executor_id="ex-1", accepted=True))
        router.send(ident, StepPlan(
            step_id=8, request_ids=["r"], num_computed_tokens=int32([5]),
            num_new_tokens=int32([1]), do_sample=np.array([1], np.uint8),
            token_ids=int32([3]), positions=int32([5]), slot_mapping=np.array([21], np.int64),
            block_table_starts=int32([1]), block_table_lens=int32([0]),
            block_table_ids=int32([])))
        _, result = router.recv(timeout_s=20, want=StepResult)
        assert [e.request_id for e in result.errors] == ["r"]  # state was dropped

        # The router goes silent (no echo, no plan): the executor says Hello again.
        router.echo = False
        t0 = time.monotonic()
        ident, _ = router.recv(timeout_s=10, want=Hello)
        assert 0.5 < time.monotonic() - t0 < 5
        router.echo = True
        router.send(ident, Welcome(executor_id="ex-1", accepted=True))
        router.recv(timeout_s=5, want=Heartbeat)

        router.send(ident, Shutdown(reason="test over", exit=True))
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        router.close()


def test_refused_and_bad_model_exit_nonzero(model_dir, tmp_path):
    router = FakeRouter()
    proc = _start(model_dir, router.address)
    try:
        ident, hello = router.recv(want=Hello)
        router.send(ident, Welcome(executor_id=hello.executor_id, accepted=False,
                                   reason="model differs"))
        assert proc.wait(timeout=20) == 3
        assert "model differs" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        router.close()
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    bad = _start(tmp_path, "tcp://127.0.0.1:1")
    assert bad.wait(timeout=30) == 2
    err = bad.stderr.read().strip().splitlines()
    assert len(err) == 1 and "GPT2LMHeadModel" in err[0]


def test_exits_when_parent_dies(model_dir, tmp_path):
    """Started by a parent (as ``serve`` does), the executor exits when the parent dies,
    even while it is still waiting for a router that never answers."""
    log = tmp_path / "executor.log"
    code = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-m', 'pagedserve.executor.process', "
        f"'--model', {str(model_dir)!r}, '--router', 'tcp://127.0.0.1:1', '--device', 'cpu', "
        "'--num-gpu-blocks', '8', '--swap-space', '0'], "
        f"stderr=open({str(log)!r}, 'w'), "
        "env={**__import__('os').environ, 'PAGEDSERVE_PARENT_PID': str(__import__('os').getpid())})\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    deadline = time.monotonic() + 60  # until it has loaded the model and is registering
    while "registering with" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "registering with" in log.read_text(), log.read_text()
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{child_pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return  # exited, not yet reaped by its new parent
        except FileNotFoundError:
            return
        time.sleep(0.2)
    os.kill(child_pid, 9)
    pytest.fail("executor outlived its parent")
