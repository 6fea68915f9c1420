"""`pagedserve demo --quick --model tiny`: the main job, start to finish, offline.

One subprocess (the router runs inside it, plus two executor children): it must exit 0,
say honestly what the model is, show prefix-cache hits and a preemption, print the summary
and leave no executor process behind. The random-weight `tiny` model keeps this offline;
tests/test_builtin_model.py runs the demo on the built-in model when it can be prepared.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def demo_run():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PAGEDSERVE_") or k == "PAGEDSERVE_CACHE"}
    env["PYTHONUNBUFFERED"] = "1"
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "pagedserve.cli", "demo", "--quick",
                             "--model", "tiny"],
                            capture_output=True, text=True, env=env, timeout=180)
    return result, time.monotonic() - start


def test_demo_quick_exits_0(demo_run):
    result, wall_s = demo_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert wall_s < 120


def test_demo_is_honest_and_shows_the_main_job(demo_run):
    out = demo_run[0].stdout
    assert "RANDOM weights" in out and "gibberish" in out
    assert "stored in float32" in out and "computing in float32\n" in out
    assert re.search(r"pagedserve ready grpc=\S+ metrics=\S+ executors=2", out)
    for heading in ("1. streaming completions", "2. multi-tenant shared prefixes",
                    "3. a burst that cannot fit", "4. beam search: 3 beams", "== summary =="):
        assert heading in out
    beams = out.split("4. beam search")[1].split("== summary ==")[0]
    assert len(re.findall(r"^  [123]\. .*\[8 tokens, LENGTH\]$", beams, re.M)) == 3, beams
    # every tenant's questions found its system prompt in some executor's prefix cache
    rows = re.findall(r"^(\S+)\s+(exec\d)\s+(\d+)\s+(\d+)\s+(\d+)/(\d+)$", out, re.M)
    assert len(rows) == 3, out
    assert all(int(hits) >= 1 for *_, hits, _total in rows), out
    assert re.search(r"TTFT p50 / p90\s+\d+ ms / \d+ ms", out)
    summary = out.split("== summary ==")[1]
    executor_rows = re.findall(r"^exec\d\s+(\d+)% .*?(\d+) \(.*?\)\s+(\d+)/(\d+)\s+(\d+)$",
                               summary, re.M)
    assert len(executor_rows) == 2, summary
    preemptions = sum(int(r[1]) for r in executor_rows)
    swapped = sum(int(r[4]) for r in executor_rows)
    assert preemptions + swapped > 0, summary
    assert any(int(r[2]) == int(r[3]) for r in executor_rows), "KV cache never filled"


def test_demo_leaves_no_process_behind(demo_run):
    out = demo_run[0].stdout
    pids = [int(p) for p in re.findall(r"started executor \S+ \(pid (\d+)\)", out)]
    assert len(pids) == 2
    assert "cluster stopped: 2 executor processes exited" in out
    assert not [p for p in pids if _alive(p)]
    # An orderly stop is not an executor loss: no warning about the exits it asked for.
    err = demo_run[0].stderr
    assert "exited with code 0\n" not in err and "left: process exited" not in err, err[-2000:]
