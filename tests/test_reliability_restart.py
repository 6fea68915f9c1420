"""Router restart: with a real executor and a fake one registered, the router is SIGKILLed
and a new one started on the same addresses. While it is away the executors neither exit
nor spin (their CPU time over a few seconds stays low); when it is back they register again
with empty caches and serve requests. With `--responses-dir` its stored responses and
conversations are there again (a background one it was running: failed), and a chain goes
on from them."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

from cluster_harness import READY, post_json, request
from wire_fake_executor import fake_command

from pagedserve.tinymodels import build_model


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _get(cluster, path: str) -> dict:
    with urllib.request.urlopen(f"http://{cluster.http_address}{path}", timeout=30) as resp:
        return json.loads(resp.read())


def test_router_sigkill_and_restart(tmp_path):
    import subprocess

    from cluster_harness import Cluster, _Reader, free_port

    model_dir = build_model(tmp_path / "llama", "llama", num_kv_heads=2)
    port, http_port = free_port(), free_port()
    kept = ["--responses-dir", str(tmp_path / "responses"), "--http-port", str(http_port)]
    c = Cluster(model_dir, num_executors=1, router_args=["--port", str(port), *kept],
                executor_args=["--num-gpu-blocks", "64", "--swap-space", "0"])
    try:
        c.start(timeout_s=90)
        fake = subprocess.Popen(fake_command(c.zmq, "fake0", model_dir, num_gpu_blocks=32),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        reader = _Reader(fake, "fake0")
        reader.start()
        c.readers.append(reader)
        c.executors["fake0"] = fake
        c.wait_executors(2)
        before = c.stub.Generate(request("restart me", max_tokens=4, temperature=0.0),
                                 timeout=30)
        assert len(before.completions[0].token_ids) == 4
        status, stored = post_json(c, "/v1/responses", {"input": "Keep me", "temperature": 0,
                                                         "max_output_tokens": 4})
        status, conv = post_json(c, "/v1/conversations", {"items": [
            {"role": "user", "content": "Remember me"}]})
        status, running = post_json(c, "/v1/responses", {
            "input": "A long one", "background": True, "max_output_tokens": 900,
            "ignore_eos": True})
        assert status == 200 and running["status"] == "queued"
        while _get(c, f"/v1/responses/{running['id']}")["status"] == "queued":
            time.sleep(0.05)
        assert _get(c, f"/v1/responses/{running['id']}")["status"] == "in_progress"

        c.router.send_signal(signal.SIGKILL)
        c.router.wait(timeout=10)
        time.sleep(4)  # every executor notices the silence (2.5 x heartbeat timeout)
        pids = {name: p.pid for name, p in c.executors.items()}
        cpu0 = {name: _cpu_s(pid) for name, pid in pids.items()}
        time.sleep(4)
        cpu = {name: _cpu_s(pid) - cpu0[name] for name, pid in pids.items()}
        for name, p in c.executors.items():
            assert p.poll() is None, f"{name} exited while the router was away:\n{c.logs()}"
        assert all(v < 0.4 for v in cpu.values()), f"executors spin without a router: {cpu}"

        # A new router on the same gRPC port and ZeroMQ address.
        c.readers = [r for r in c.readers if r.name != "router"]
        c.router = c._spawn(
            ["router", "--model", str(model_dir), "--port", str(port), "--metrics-port", "0",
             "--executor-bind", c.zmq, "--heartbeat-timeout", "1", "--debug-checks", *kept],
            "router")
        router_reader = c.readers[-1]
        c.readers.insert(0, c.readers.pop())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(READY.search(x)
                                                      for x in router_reader.lines):
            time.sleep(0.1)
        c.wait_executors(2, timeout_s=30)  # backoff is at most 8 s
        status = c.status()
        assert {e.id for e in status.executors} == {"exec0", "fake0"}
        assert all(e.num_free_gpu_blocks == e.num_gpu_blocks for e in status.executors)
        outs = [c.stub.Generate(request(f"after restart {i}", max_tokens=4, temperature=0.0),
                                timeout=30) for i in range(4)]
        assert all(len(o.completions[0].token_ids) == 4 for o in outs)
        # the stored response, the conversation and the background one that died with it
        assert _get(c, f"/v1/responses/{stored['id']}") == stored
        assert _get(c, f"/v1/conversations/{conv['id']}") == conv
        died = _get(c, f"/v1/responses/{running['id']}")
        assert died["status"] == "failed" and "restarted" in died["error"]["message"]
        status, turn = post_json(c, "/v1/responses", {
            "input": "Go on", "previous_response_id": stored["id"], "max_output_tokens": 2})
        assert status == 200 and turn["previous_response_id"] == stored["id"]
        print(f"\nrestart: executor CPU while the router was away over 4 s: {cpu}")
    finally:
        c.stop()
