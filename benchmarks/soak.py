"""Soak: steady load with aborts for N seconds against `pagedserve router` and fake executor
processes (tests/wire_fake_executor.py: the real wire protocol, no model work), then check
that nothing accumulated: every block back, nothing leaked, and the RSS of the router and of
each executor in the second half within 10% (+ 20 MB) of the first half, warm-up excluded.

    .venv/bin/python benchmarks/soak.py --duration 180 [--executors 2] [--concurrency 16]
        [--api-workers N]

Load: `concurrency` client threads, each looping: a streaming request (random prompt of
8-200 token ids, max_tokens 4-64, n 1-2 sometimes), ended in one of four ways, in turn:
run to the end, client cancel after a few chunks, a short deadline, or the Abort RPC after a
few chunks. RSS is sampled from /proc every second. Prints JSON lines (DESIGN §8):
``{"bench": "soak", "case": "rss", ...}`` per process and ``{"bench": "soak", "case":
"summary", ...}``; exit code 1 when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import grpc  # noqa: E402
from cluster_harness import request  # noqa: E402
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb  # noqa: E402
from wire_fake_executor import fake_cluster  # noqa: E402

from pagedserve.tinymodels import build_model  # noqa: E402


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except FileNotFoundError:
        pass
    return float("nan")


def metric(text: str, name: str) -> float:
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines()
               if x.startswith(name + "{") or x.startswith(name + " "))


class Load:
    def __init__(self, cluster, seed: int) -> None:
        self.cluster = cluster
        self.rng = random.Random(seed)
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def count(self, key: str) -> None:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + 1

    def worker(self, wid: int) -> None:
        rng = random.Random(wid)
        stub = self.cluster.stub
        i = 0
        while not self.stop.is_set():
            i += 1
            rid = f"w{wid}-{i}"
            mode = ("finish", "cancel", "deadline", "abort")[i % 4]
            req = request(token_ids=[rng.randrange(3, 500) for _ in range(rng.randint(8, 200))],
                          max_tokens=rng.randint(4, 64), temperature=rng.choice([0.0, 1.0]),
                          n=rng.choice([1, 1, 1, 2]), seed=rng.randrange(1 << 30))
            req.request_id = rid
            timeout = rng.uniform(0.05, 0.5) if mode == "deadline" else 30
            try:
                call = stub.Stream(req, timeout=timeout)
                for k, _chunk in enumerate(call):
                    if k == 2 and mode == "cancel":
                        call.cancel()
                        break
                    if k == 2 and mode == "abort":
                        # (it may have finished meanwhile: NOT_FOUND)
                        with contextlib.suppress(grpc.RpcError):
                            stub.Abort(pb.AbortRequest(request_id=rid), timeout=10)
                self.count(f"{mode}:OK")
            except grpc.RpcError as exc:
                self.count(f"{mode}:{exc.code().name}")


API_WORKER_MARK = b"pagedserve.router.api_worker"


def child_pids(parent: int, mark: bytes) -> list[int]:
    """Children of `parent` whose command line contains `mark` (the router's API workers)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (proc / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent \
                    and mark in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
    return sorted(pids)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=180.0, help="seconds of load")
    ap.add_argument("--warmup", type=float, default=None, help="default: 15%% of duration")
    ap.add_argument("--executors", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--num-gpu-blocks", type=int, default=160)
    ap.add_argument("--step-delay-s", type=float, default=0.002)
    ap.add_argument("--rss-ratio", type=float, default=0.10)
    ap.add_argument("--rss-slack-mb", type=float, default=20.0)
    ap.add_argument("--pipeline-depth", type=int, default=2,
                    help="the router's --pipeline-depth (plans in flight per executor)")
    ap.add_argument("--api-workers", type=int, default=0,
                    help="the router's --api-workers (their RSS is checked too)")
    args = ap.parse_args(argv)
    warmup = args.duration * 0.15 if args.warmup is None else args.warmup

    work = Path(tempfile.mkdtemp(prefix="soak-"))
    model = build_model(work / "llama", "llama", num_kv_heads=2)
    cluster, controls = fake_cluster(
        model, work, args.executors,
        router_args=["--max-num-batched-tokens", "256", "--preemption-mode", "swap",
                     "--api-workers", str(args.api_workers),
                     "--pipeline-depth", str(args.pipeline_depth)],
        num_gpu_blocks=args.num_gpu_blocks, num_cpu_blocks=256, step_delay_s=args.step_delay_s)
    cluster.start()
    procs = {"router": cluster.router.pid,
             **{name: p.pid for name, p in cluster.executors.items()},
             **{f"api-worker-{i}": pid
                for i, pid in enumerate(child_pids(cluster.router.pid, API_WORKER_MARK))}}
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in procs}
    load = Load(cluster, 0)
    threads = [threading.Thread(target=load.worker, args=(w,), daemon=True)
               for w in range(args.concurrency)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    try:
        while time.monotonic() - t0 < args.duration:
            time.sleep(1.0)
            now = time.monotonic() - t0
            for name, pid in procs.items():
                samples[name].append((now, rss_mb(pid)))
    finally:
        load.stop.set()
        for t in threads:
            t.join(timeout=40)
    ok = True
    try:
        status = cluster.wait_blocks_free(timeout_s=30)
        text = cluster.metrics()
        free_ok = all(e.healthy and e.num_free_gpu_blocks == e.num_gpu_blocks
                      and e.num_free_cpu_blocks == e.num_cpu_blocks for e in status.executors)
        leaked = metric(text, "pagedserve_kv_blocks_leaked")
        logs = cluster.logs() + "\n".join("\n".join(r.lines) for r in cluster.readers)
        broken = "KV accounting broken" in logs
        violations = sum(c.state().get("num_violations", 0) for c in controls.values())
        after = cluster.stub.Generate(request(token_ids=[5, 6, 7], max_tokens=3), timeout=30)
        served = len(after.completions[0].token_ids) == 3
        mid = warmup + (args.duration - warmup) / 2
        for name, rows in samples.items():
            first = [r for t, r in rows if warmup <= t < mid]
            second = [r for t, r in rows if t >= mid]
            a = sum(first) / max(1, len(first))
            b = sum(second) / max(1, len(second))
            within = b <= a * (1 + args.rss_ratio) + args.rss_slack_mb
            ok &= within
            print(json.dumps({"bench": "soak", "case": "rss", "process": name,
                              "rss_first_half_mb": round(a, 1),
                              "rss_second_half_mb": round(b, 1),
                              "rss_max_mb": round(max(r for _, r in rows), 1),
                              "rss_growth_ratio": round(b / a - 1, 4) if a else None,
                              "within_limit": within}), flush=True)
        total = sum(load.counts.values())
        ok &= free_ok and leaked == 0 and not broken and violations == 0 and served
        print(json.dumps({
            "bench": "soak", "case": "summary", "duration_s": args.duration,
            "warmup_s": warmup, "executors": args.executors, "concurrency": args.concurrency,
            "api_workers": args.api_workers,
            "requests": total, "requests_per_s": round(total / args.duration, 2),
            "outcomes": dict(sorted(load.counts.items())), "blocks_all_free": free_ok,
            "kv_blocks_leaked": leaked, "accounting_broken_logged": broken,
            "fake_executor_violations": violations, "served_after": served, "ok": ok,
        }), flush=True)
    finally:
        cluster.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
