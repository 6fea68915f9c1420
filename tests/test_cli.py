"""The `pagedserve` console script through subprocesses: serve + generate, configuration from
PAGEDSERVE_* variables, one-line errors for bad flags, SIGTERM draining, JSON logs, and an
executor joining a running router (what `--scale executor=N` relies on).

Process budget: one `serve` (router + 1 executor) for the module, one more for the drain
test, one extra executor for the join test; each executor imports torch (~2-3 s).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
from cluster_harness import READY, free_port
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2_grpc as pb_grpc

CLI = [sys.executable, "-m", "pagedserve.cli"]
STARTED = re.compile(r"started executor (\S+) \(pid (\d+)\)")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from pagedserve.tinymodels import build_model
    return str(build_model(tmp_path_factory.mktemp("cli") / "tiny", hidden_size=64,
                           num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                           max_position_embeddings=4096))


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


class Proc:
    """A `pagedserve` subprocess with its stdout and stderr collected line by line."""

    def __init__(self, args: list[str], env: dict) -> None:
        self.p = subprocess.Popen(CLI + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env)
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, sink in ((self.p.stdout, self.out), (self.p.stderr, self.err)):
            threading.Thread(target=self._read, args=(stream, sink), daemon=True).start()

    @staticmethod
    def _read(stream, sink: list[str]) -> None:
        for line in stream:
            sink.append(line.rstrip("\n"))

    def wait_ready(self, timeout_s: float = 60.0) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.out:
                m = READY.search(line)
                if m:
                    return m
            if self.p.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError("no ready line:\n" + self.logs())

    def child_pids(self) -> list[int]:
        return [int(m.group(2)) for line in self.err for m in [STARTED.search(line)] if m]

    def logs(self) -> str:
        return "\n".join(self.out[-20:] + self.err[-40:])

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not a running child
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def _generate(address: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + ["generate", *args, "--address", address], capture_output=True,
                          text=True, env=env or _env(), timeout=60)


# ------------------------------------------------------------------ one serve for the module


@pytest.fixture(scope="module")
def served(tiny_model):
    port, zmq_port = free_port(), free_port()
    proc = Proc(["serve", "--model", tiny_model, "--executors", "1", "--metrics-port", "0", "--http-port", "-1",
                 "--executor-bind", f"tcp://127.0.0.1:{zmq_port}", "--num-gpu-blocks", "128"],
                _env(PAGEDSERVE_PORT=str(port), PAGEDSERVE_MAX_N="1"))
    try:
        ready = proc.wait_ready()
        yield {"proc": proc, "port": port, "grpc": ready.group(1), "metrics": ready.group(2),
               "zmq": f"tcp://127.0.0.1:{zmq_port}", "model": tiny_model}
    finally:
        proc.stop()


def test_ready_line_and_port_from_environment(served):
    assert served["grpc"] == f"127.0.0.1:{served['port']}"
    assert READY.search(served["proc"].out[0]).group(3) == "1"


def test_generate_unary_stream_and_json_agree(served):
    args = ("Once upon a time", "--max-tokens", "12", "--ignore-eos")
    unary = _generate(served["grpc"], *args)
    assert unary.returncode == 0, unary.stderr
    stream = _generate(served["grpc"], *args, "--stream")
    assert stream.returncode == 0, stream.stderr
    assert stream.stdout == unary.stdout  # greedy by default: the same text either way
    as_json = _generate(served["grpc"], *args, "--json")
    assert as_json.returncode == 0, as_json.stderr
    reply = json.loads(as_json.stdout)
    (completion,) = reply["completions"]
    assert len(completion["tokenIds"]) == 12
    assert completion["finishReason"] == "LENGTH"
    assert completion.get("text", "") + "\n" == unary.stdout
    assert int(reply["usage"]["completionTokens"]) == 12


def test_max_n_from_environment_rejects_n_2(served):
    result = _generate(served["grpc"], "hello", "--n", "2", "--max-tokens", "4")
    assert result.returncode == 1
    assert "INVALID_ARGUMENT" in result.stderr
    assert "Traceback" not in result.stderr


def test_healthcheck(served):
    for service in ("", "pagedserve.v1.Generator"):
        result = subprocess.run(CLI + ["healthcheck", "--address", served["grpc"], "--service",
                                       service], capture_output=True, text=True, env=_env(),
                                timeout=30)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "SERVING"


# ------------------------------------------------------------------ chat clients


def _greedy_chat(address: str, turns: list[tuple[str, str]], max_tokens: int) -> str:
    """The greedy answer to `turns` ((role, content) pairs) by a direct Generate."""
    from pagedserve.chat_client import chat_messages
    with grpc.insecure_channel(address) as channel:
        reply = pb_grpc.GeneratorStub(channel).Generate(pb.GenerateRequest(
            messages=chat_messages(turns), params=pb.SamplingParams(
                max_tokens=max_tokens, temperature=0.0)), timeout=60)
    return reply.completions[0].text


def test_generate_chat_is_one_turn_with_the_template(served):
    result = _generate(served["grpc"], "Hello there", "--chat", "--system", "Be brief.",
                       "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    want = _greedy_chat(served["grpc"], [("system", "Be brief."), ("user", "Hello there")], 8)
    assert result.stdout == want + "\n"
    plain = _generate(served["grpc"], "Hello there", "--max-tokens", "8")  # old form: text
    assert plain.returncode == 0 and plain.stdout != result.stdout


def test_chat_from_piped_stdin_keeps_history_and_resets(served):
    lines = "Hello there\nAnd then?\n/reset\nHello there\n"
    result = subprocess.run(CLI + ["chat", "--address", served["grpc"], "--temperature", "0",
                                   "--max-tokens", "6"], input=lines, capture_output=True,
                            text=True, env=_env(), timeout=60)
    assert result.returncode == 0, result.stderr
    a1 = _greedy_chat(served["grpc"], [("user", "Hello there")], 6)
    a2 = _greedy_chat(served["grpc"], [("user", "Hello there"), ("assistant", a1),
                                       ("user", "And then?")], 6)
    assert result.stdout == f"{a1}\n{a2}\n[history cleared]\n{a1}\n"


def _default_sigint() -> None:
    """A suite started from a shell that ignores SIGINT (a background job) would hand the
    chat an ignored SIGINT, and Python keeps it ignored: give the child the default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_chat_ctrl_c_aborts_the_answer_and_stays_in_the_chat(served):
    proc = subprocess.Popen(CLI + ["chat", "--address", served["grpc"], "--max-tokens", "1500",
                                   "--ignore-eos"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), preexec_fn=_default_sigint)
    channel = grpc.insecure_channel(served["grpc"])
    stub = pb_grpc.GeneratorStub(channel)

    def running_and_held_blocks() -> tuple[int, int]:
        executors = stub.GetClusterStatus(pb.ClusterStatusRequest(), timeout=5).executors
        return (sum(e.running for e in executors),
                sum(e.num_gpu_blocks - e.num_free_gpu_blocks for e in executors))

    try:
        proc.stdin.write("Tell me a long story.\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 30
        while running_and_held_blocks()[0] == 0:
            assert time.monotonic() < deadline and proc.poll() is None, "no answer started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 10
        while running_and_held_blocks() != (0, 0):
            assert time.monotonic() < deadline, "the answer was not aborted on the server"
            time.sleep(0.05)
        out, err = proc.communicate("/reset\n", timeout=20)  # then end of input: leave
        assert proc.returncode == 0, err
        assert out.endswith("\n[stopped]\n[history cleared]\n") and "Traceback" not in err
    finally:
        channel.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------ bad flags: one line


@pytest.mark.parametrize("args, env", [
    (["serve", "--bogus"], {}),
    (["serve", "--block-size", "7"], {}),
    (["serve"], {"PAGEDSERVE_BLOCK_SIZE": "7"}),
    (["serve", "--model", "/nonexistent/model"], {}),
    (["router", "--model", "/nonexistent/model"], {}),
    (["router"], {}),
    (["serve", "--log-format", "xml"], {}),
    (["frobnicate"], {}),
], ids=["unknown-flag", "block-size-7", "env-block-size-7", "serve-missing-model",
        "router-missing-model", "router-no-model", "bad-choice", "unknown-command"])
def test_bad_flags_one_line_no_traceback(args, env):
    result = subprocess.run(CLI + args, capture_output=True, text=True, env=_env(**env),
                            timeout=60)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert lines[0].startswith("pagedserve")


def test_bad_model_dir_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"],
                                                      "vocab_size": 10}))
    result = subprocess.run(CLI + ["router", "--model", str(tmp_path), "--port", "0",
                                   "--metrics-port", "-1", "--http-port", "-1"],
                            capture_output=True, text=True, env=_env(), timeout=60)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith(
        "supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM")


# ------------------------------------------------------------------ SIGTERM drain


def _stream(stub, prompt: str, max_tokens: int, first: threading.Event, out: dict) -> None:
    req = pb.GenerateRequest(prompt=prompt, params=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    tokens, reason = 0, None
    try:
        for chunk in stub.Stream(req, timeout=60):
            tokens += len(chunk.token_ids)
            if tokens:
                first.set()
            if chunk.finish_reason:
                reason = pb.FinishReason.Name(chunk.finish_reason)
    except grpc.RpcError as exc:
        reason = exc.code().name
    out.update(tokens=tokens, reason=reason)


def test_sigterm_drains_finishes_short_aborts_long_and_reaps_children(tiny_model):
    zmq_port = free_port()
    proc = Proc(["serve", "--model", tiny_model, "--port", "0", "--metrics-port", "-1", "--http-port", "-1",
                 "--executor-bind", f"tcp://127.0.0.1:{zmq_port}", "--shutdown-timeout", "3",
                 "--num-gpu-blocks", "512", "--log-format", "json"], _env())
    try:
        address = proc.wait_ready().group(1)
        (child,) = proc.child_pids()
        channel = grpc.insecure_channel(address)
        stub = pb_grpc.GeneratorStub(channel)
        short, long_ = {}, {}
        started_short, started_long = threading.Event(), threading.Event()
        threads = [
            threading.Thread(target=_stream, args=(stub, "short", 100, started_short, short)),
            threading.Thread(target=_stream, args=(stub, "long", 4000, started_long, long_)),
        ]
        for t in threads:
            t.start()
        assert started_short.wait(30) and started_long.wait(30), proc.logs()
        proc.p.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(grpc.RpcError) as refused:  # draining: new requests refused
            stub.Generate(pb.GenerateRequest(prompt="late"), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        for t in threads:
            t.join(30)
        channel.close()
        assert proc.p.wait(timeout=30) == 0, proc.logs()
        assert short == {"tokens": 100, "reason": "LENGTH"}, proc.logs()
        assert long_["reason"] == "ABORT" and 0 < long_["tokens"] < 4000, (long_, proc.logs())
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), f"executor pid {child} outlived serve"
        # --log-format json: the router's and the executor's log lines are JSON objects
        router_lines = [x for x in proc.err if x.startswith("{")]
        executor_lines = [x.split("] ", 1)[1] for x in proc.err
                          if x.startswith("[executor-0] {")]
        for line in router_lines + executor_lines:
            record = json.loads(line)
            assert {"time", "level", "logger", "message"} <= set(record)
        assert any("joined" in json.loads(x)["message"] for x in router_lines)
        assert any("registered" in json.loads(x)["message"] for x in executor_lines)
    finally:
        proc.stop()


# ------------------------------------------------------------------ scaling: a late executor


def _metric(metrics_address: str, name: str, executor: str) -> float:
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    m = re.search(rf'^{name}{{executor="{re.escape(executor)}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_executor_joins_running_router_and_gets_work(served):
    """What `docker compose up --scale executor=N` does: a new executor process connects to
    the running router's ZeroMQ address and is routed requests."""
    joined = Proc(["executor", "--model", served["model"], "--router", served["zmq"],
                   "--executor-id", "late-joiner", "--num-gpu-blocks", "128"], _env())
    channel = grpc.insecure_channel(served["grpc"])
    stub = pb_grpc.GeneratorStub(channel)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status = stub.GetClusterStatus(pb.ClusterStatusRequest(), timeout=10)
            if any(e.id == "late-joiner" and e.healthy for e in status.executors):
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the executor did not join:\n" + "\n".join(joined.err))
        assert sum(e.healthy for e in status.executors) == 2
        futures = [stub.Generate.future(pb.GenerateRequest(
            prompt=f"request number {i} about something else entirely",
            params=pb.SamplingParams(max_tokens=8, temperature=0.0)), timeout=60)
            for i in range(6)]
        for f in futures:
            assert f.result().completions[0].token_ids
        queries = _metric(served["metrics"], "pagedserve_prefix_cache_queries_total",
                          "late-joiner")
        assert queries > 0, "the joined executor was never routed a request"
    finally:
        channel.close()
        joined.stop()


# ------------------------------------------------------------------ README's flag table


def test_readme_flag_table_matches_flags():
    import argparse
    from pathlib import Path

    from pagedserve.flags import FLAGS, env_name
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    rows = dict(re.findall(r"^\| `--([a-z-]+)` \| ([^|]+) \| `PAGEDSERVE_", readme, re.M))
    public = [(f, d) for f, _t, d, h in FLAGS if h is not argparse.SUPPRESS]
    assert sorted(rows) == sorted(f for f, _ in public)
    for flag, default in public:
        shown = rows[flag].strip()
        assert shown == ("—" if default is None else f"`{default}`"), flag
        assert f"`{env_name(flag)}`" in readme
    assert readme.splitlines()[2:6] == ["```", "make demo   # sets up .venv and runs the main "
                                        "job on the built-in model (fetched once)",
                                        "make test   # sets up .venv and runs the test suite",
                                        "```"]


# ------------------------------------------------------------------ a hung executor


def test_serve_kills_a_hung_executor_and_restarts_it(tiny_model):
    """The only executor sleeps inside its third step (the testing hook): past the plan's
    deadline the router counts it dead (the request ends UNAVAILABLE: no other executor),
    serve kills the child and, with --restart-executors, starts a new one that serves."""
    zmq_port = free_port()
    proc = Proc(["serve", "--model", tiny_model, "--port", "0", "--metrics-port", "-1", "--http-port", "-1",
                 "--executor-bind", f"tcp://127.0.0.1:{zmq_port}", "--num-gpu-blocks", "128",
                 "--restart-executors", "--step-timeout", "0.5"],
                _env(PAGEDSERVE_FAULT_SLEEP_IN_STEP="3:120"))
    try:
        address = proc.wait_ready().group(1)
        (child,) = proc.child_pids()
        channel = grpc.insecure_channel(address)
        stub = pb_grpc.GeneratorStub(channel)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(pb.GenerateRequest(prompt="hang", params=pb.SamplingParams(
                max_tokens=20, ignore_eos=True)), timeout=60)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, proc.logs()
        assert time.monotonic() - t0 < 30
        deadline = time.monotonic() + 30
        while (_alive(child) or len(proc.child_pids()) < 2) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child) and len(proc.child_pids()) == 2, proc.logs()
        assert any("killing executor" in line for line in proc.err), proc.logs()
        deadline = time.monotonic() + 60
        while True:  # the restarted executor registers and serves (one step: no hang)
            try:
                reply = stub.Generate(pb.GenerateRequest(prompt="again", params=pb.SamplingParams(
                    max_tokens=1)), timeout=30)
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, proc.logs()
                assert time.monotonic() < deadline, proc.logs()
                time.sleep(0.3)
        assert len(reply.completions[0].token_ids) == 1
        channel.close()
    finally:
        proc.stop()


# ------------------------------------------------------------------ a failed start


def test_serve_exits_when_an_executor_fails_at_start(tiny_model):
    """An executor that cannot start (here: a KV cache of no blocks, as one beside another
    process's GPU memory finds) ends serve with exit code 1 and the reason, instead of serve
    waiting for it forever; --restart-executors does not restart what would fail alike."""
    proc = Proc(["serve", "--model", tiny_model, "--port", "0", "--metrics-port", "-1",
                 "--http-port", "-1", "--executor-bind", f"tcp://127.0.0.1:{free_port()}",
                 "--device", "cpu", "--kv-cache-space", "0.0000001", "--restart-executors"],
                _env())
    try:
        rc = proc.p.wait(timeout=60)
    finally:
        proc.stop()
    time.sleep(0.2)  # the reader threads take the last lines
    assert rc == 1, proc.logs()
    assert not any(READY.search(line) for line in proc.out), proc.logs()
    assert any("no memory left for the KV cache" in line for line in proc.err), proc.logs()
    (failure,) = [line for line in proc.err if line.startswith("pagedserve serve: ")]
    assert "exited with code 2 before the cluster was ready" in failure, proc.logs()
    assert len(proc.child_pids()) == 1 and not _alive(proc.child_pids()[0]), proc.logs()
