"""What feature_soak.py and http_soak.py share: the structured-output formats they ask for
and the check of what came back, the clients' tally, and the verdict on the cluster once
the load has stopped (every device block free, `pagedserve_kv_blocks_leaked`
0, no traceback or ERROR line in any process's whole log, no failed check), printed as one
`summary` JSON line (DESIGN §8)."""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time

# The structured outputs both soaks ask for; a sample that stopped (not cut by max_tokens)
# must be whole: JSON of SCHEMA, a full match of REGEX, one of CHOICES.
SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 5}},
          "required": ["a"], "additionalProperties": False}
REGEX = "[a-z]{2,30}"
CHOICES = ["aa", "bbb", "c d"]


def constrained_error(kind: str, text: str) -> str | None:
    """Why a stopped sample of `kind` ("json", "regex", "choice"; others pass) is wrong."""
    if kind == "json":
        try:
            ok = set(json.loads(text)) == {"a"}
        except ValueError:
            ok = False
    elif kind == "regex":
        ok = re.fullmatch(REGEX, text) is not None
    elif kind == "choice":
        ok = text in CHOICES
    else:
        return None
    return None if ok else f"{kind}: {text!r}"


class Tally:
    """Outcome counts and failed checks, shared by the client threads."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.failures: list[str] = []
        self._lock = threading.Lock()

    def count(self, key: str) -> None:
        with self._lock:
            self.counts[key] = self.counts.get(key, 0) + 1

    def fail(self, message: str) -> None:
        with self._lock:
            self.failures.append(message)


def soak_arguments(doc: str):
    """The options both soaks take (each may add its own)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=90.0)
    ap.add_argument("--executors", type=int, default=2)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--num-gpu-blocks", type=int, default=96)
    ap.add_argument("--api-workers", type=int, default=0)
    ap.add_argument("--router-args", default="",
                    help="more router flags, one string (e.g. \"--pipeline-depth 1 "
                    "--preemption-mode swap\"; --router-args=--flag when it starts with one)")
    ap.add_argument("--prefill-executors", type=int, default=0,
                    help="of --executors, how many run --disaggregation-mode prefill, the "
                    "others decode (0: each does both)")
    ap.add_argument("--kill-at", type=float, default=None,
                    help="SIGKILL the first executor this many seconds into the load (its "
                    "requests move to the others; the checks then count the survivors)")
    ap.add_argument("--weight-updates", type=float, default=0.0,
                    help="every this many seconds, update the weights (a copy of the same "
                    "model) through /update_weights_from_disk: waiting for the running "
                    "requests, by a retract pause, from a freeze in place, in turn (0: never)")
    return ap


def update_weights(cluster, model_dir, tally: Tally, every_s: float, until: float) -> None:
    """--weight-updates: the router's weight routes under the load, every ``every_s``
    seconds until ``until``, in turn: an update that waits for the running requests; a
    retract pause, an update and a continue; a freeze in place (vLLM's /pause?mode=keep),
    an update (it retracts the frozen requests) and /resume. The weights are a copy of the
    model's: every request's output stays checkable. Each call's status is counted, a
    non-200 is a failed check."""
    import shutil
    import tempfile
    import urllib.error
    import urllib.request
    from pathlib import Path

    copy = Path(tempfile.mkdtemp(prefix="soak-ckpt-")) / "ckpt"
    shutil.copytree(model_dir, copy)

    def post(path: str, body: dict) -> None:
        req = urllib.request.Request(f"http://{cluster.http_address}{path}",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as reply:
                tally.count(f"weights{path}/{reply.status}")
        except urllib.error.HTTPError as exc:
            tally.fail(f"weights{path}: {exc.code} {exc.read()[:300]!r}")

    turn = 0
    while time.monotonic() + every_s < until:
        time.sleep(every_s)
        pause = ("", "/pause_generation", "/pause?mode=keep")[turn % 3]
        if pause:  # a retract pause, or vLLM's freeze in place (the update retracts them)
            post(pause, {"mode": "retract"})
        post("/update_weights_from_disk", {"model_path": str(copy)})
        if pause:
            post("/continue_generation" if turn % 3 == 1 else "/resume", {})
        turn += 1


def run_soak(bench: str, args, make_load, router_args: tuple = ()) -> int:
    """Build the tiny model, run a cluster (router + `args.executors` CPU executors) under
    `make_load(cluster, model_dir)`'s clients for `args.duration` seconds, then the verdict."""
    import tempfile
    from pathlib import Path

    from cluster_harness import Cluster

    from pagedserve.tinymodels import build_model

    model_dir = build_model(tempfile.mkdtemp(prefix=f"{bench.replace('_', '-')}-"), "llama")
    started = time.monotonic()
    flags = list(router_args) + args.router_args.split()
    if args.api_workers:
        flags += ["--api-workers", str(args.api_workers)]
    if args.weight_updates:
        flags.append("--enable-weight-updates")
    modes = {f"exec{i}": {"PAGEDSERVE_DISAGGREGATION_MODE":
                          "prefill" if i < args.prefill_executors else "decode"}
             for i in range(args.executors)} if args.prefill_executors else None
    with Cluster(model_dir, num_executors=args.executors, router_args=flags,
                 executor_args=["--num-gpu-blocks", str(args.num_gpu_blocks)],
                 executor_env=modes).running() as c:
        load = make_load(c, Path(model_dir))
        if args.kill_at is not None:
            victim = next(iter(c.executors.values()))
            threading.Timer(args.kill_at, victim.kill).start()
        updater = threading.Thread(target=update_weights, daemon=True, args=(
            c, model_dir, load, args.weight_updates, time.monotonic() + args.duration))
        if args.weight_updates:
            updater.start()
        drive(load.client, args.clients, args.duration)
        if args.weight_updates:
            updater.join(120)
        status = c.wait_blocks_free(timeout_s=30)
        metrics, logs = c.metrics(), c.logs(None)
    queries = metric_total(metrics, "pagedserve_prefix_cache_queries_total")
    hits = metric_total(metrics, "pagedserve_prefix_cache_hits_total")
    return verdict(bench, load, status, metrics, logs, started=started,
                   log_dir=os.path.dirname(model_dir), healthy_only=args.kill_at is not None,
                   api_workers=args.api_workers,
                   executors_healthy=sum(e.healthy for e in status.executors),
                   prefix_hit_rate=round(hits / queries, 3) if queries else 0.0,
                   kv_pulls=int(metric_total(metrics, "pagedserve_kv_pulls_total")),
                   kv_blocks_received=int(metric_total(
                       metrics, "pagedserve_kv_blocks_received_total")))


def drive(client, clients: int, duration_s: float) -> None:
    """`client(index, until)` on `clients` threads until `duration_s` from now; joins them."""
    until = time.monotonic() + duration_s
    threads = [threading.Thread(target=client, args=(i, until)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def metric_total(metrics: str, name: str) -> float:
    """The sum of a Prometheus metric's labelled samples in an exposition text."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith(name + "{"))


def verdict(bench: str, tally: Tally, status, metrics: str, logs: str, *, started: float,
            log_dir: str, healthy_only: bool = False, **extra) -> int:
    """Print the summary line (and on stderr the first failures, and where the whole log
    was kept when a line was bad); the exit code. `healthy_only`: the block check counts the
    healthy executors (one was killed on purpose)."""
    free = all(e.num_free_gpu_blocks == e.num_gpu_blocks for e in status.executors
               if e.healthy or not healthy_only)
    leaked = metric_total(metrics, "pagedserve_kv_blocks_leaked")
    bad_lines = [line for line in logs.splitlines() if "Traceback" in line or " ERROR " in line]
    ok = free and leaked == 0 and not bad_lines and not tally.failures
    print(json.dumps({
        "bench": bench, "case": "summary", "ok": ok, **extra,
        "requests": sum(tally.counts.values()), "wall_s": round(time.monotonic() - started, 1),
        "all_blocks_free": free, "blocks_leaked": leaked, "log_errors": len(bad_lines),
        "failed_checks": len(tally.failures), "counts": dict(sorted(tally.counts.items())),
    }), flush=True)
    for line in (tally.failures + bad_lines)[:20]:
        print(line, file=sys.stderr)
    if bad_lines:  # the whole tracebacks are in the logs: keep them
        log_path = os.path.join(log_dir, f"{bench.replace('_', '-')}-cluster.log")
        with open(log_path, "w") as f:
            f.write(logs)
        print(f"cluster logs: {log_path}", file=sys.stderr)
    return 0 if ok else 1
