"""Router restart: with a real executor and a fake one registered, the router is SIGKILLed
and a new one started on the same addresses. While it is away the executors neither exit
nor spin (their CPU time over a few seconds stays low); when it is back they register again
with empty caches and serve requests."""

from __future__ import annotations

import os
import signal
import time

from cluster_harness import READY, request
from wire_fake_executor import fake_command

from pagedserve.tinymodels import build_model


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_router_sigkill_and_restart(tmp_path):
    import subprocess

    from cluster_harness import Cluster, _Reader, free_port

    model_dir = build_model(tmp_path / "llama", "llama", num_kv_heads=2)
    port = free_port()
    c = Cluster(model_dir, num_executors=1, router_args=["--port", str(port)],
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
            ["router", "--model", str(model_dir), "--port", str(port), "--metrics-port", "0", "--http-port", "-1",
             "--executor-bind", c.zmq, "--heartbeat-timeout", "1", "--debug-checks"],
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
        print(f"\nrestart: executor CPU while the router was away over 4 s: {cpu}")
    finally:
        c.stop()
