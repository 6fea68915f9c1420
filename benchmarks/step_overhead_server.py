"""Step overhead's servers (benchmarks/step_overhead.py): the models its cases run
(`model_dir`, the fake cases' `fake_model_dir`), and `Server`, a router started through
step_overhead.py's launcher with its output, step trace and CPU snapshots in files."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from pagedserve.subprocs import stop_process

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().with_name("step_overhead.py")  # holds the launcher's entry
READY = re.compile(r"pagedserve ready grpc=(\S+) metrics=(\S+) executors=(\d+)")
TRACE_ENV = "PAGEDSERVE_STEP_TRACE"
SNAPSHOT_TIMEOUT_S = 5.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
            [sys.executable, str(SCRIPT), "--launch", str(self.trace), "--",
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


