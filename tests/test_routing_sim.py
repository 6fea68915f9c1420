"""Smoke test of the routing simulator (benchmarks/routing_sim.py): its tiny workloads run
under every policy through the real router code, every request finishes, the figures are
sane, the infinite-cache bound misses no more than any policy, runs are deterministic, and
the script prints the promised JSON lines. No routing quality is asserted here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import routing_sim  # noqa: E402


@pytest.mark.parametrize("name", sorted(routing_sim.QUICK_WORKLOADS))
def test_every_policy_runs_and_the_bound_holds(name):
    w = routing_sim.QUICK_WORKLOADS[name]
    for policy in routing_sim.POLICIES:
        f = routing_sim.Simulation(w, policy, routing_sim.CPU_TINY, seed=0).run()
        assert f["requests"] > 0 and f["completed"] == f["requests"], (policy, f)
        assert 0.0 <= f["hit_ratio"] <= f["bound_hit_ratio"] <= 1.0, (policy, f)
        misses = f["prompt_tokens"] - f["cached_tokens"]
        assert f["prompt_tokens"] - f["bound_cached_tokens"] <= misses, (policy, f)
        assert 0.0 < f["ttft_ms_p50"] <= f["ttft_ms_p99"], (policy, f)
        assert f["output_tok_per_s"] > 0 and 0.0 < f["busy_ratio"] <= 1.0, (policy, f)
        assert sum(f["requests_per_executor"]) == f["requests"]
        assert len(f["requests_per_executor"]) == w.num_executors


def test_runs_are_deterministic_and_prompts_do_not_depend_on_policy():
    w = routing_sim.QUICK_WORKLOADS["quick-chat-e2"]
    a = routing_sim.Simulation(w, "prefix", routing_sim.CPU_TINY, seed=0).run()
    b = routing_sim.Simulation(w, "prefix", routing_sim.CPU_TINY, seed=0).run()
    c = routing_sim.Simulation(w, "round-robin", routing_sim.CPU_TINY, seed=0).run()
    assert a == b
    # Chat turns carry the previous answers: the same tokens whatever the routing.
    assert a["prompt_tokens"] == c["prompt_tokens"]
    assert a["bound_cached_tokens"] == c["bound_cached_tokens"]


def test_infinite_bound_counts_each_block_once():
    bs = routing_sim.BLOCK_SIZE
    shared = list(range(1, 4 * bs + 1))  # 4 blocks
    recs = [routing_sim.Record("a", 0.0, shared + [900] * 3),
            routing_sim.Record("b", 1.0, shared + [901] * 3),
            routing_sim.Record("c", 2.0, list(shared))]  # whole prompt cached: last block not
    assert routing_sim.infinite_bound(recs) == 0 + 4 * bs + 3 * bs
    # Outputs of an earlier request are cached too (all but the last token).
    first = routing_sim.Record("t0", 0.0, shared[:bs], output=list(range(500, 500 + bs + 1)))
    turn = routing_sim.Record("t1", 1.0, shared[:bs] + list(range(500, 500 + bs + 1)) + [7])
    assert routing_sim.infinite_bound([first, turn]) == 2 * bs


def test_script_prints_json_lines_and_a_table(capsys):
    assert routing_sim.main(["--quick", "--workloads", "quick-chat-e2"]) == 0
    captured = capsys.readouterr()
    lines = [json.loads(x) for x in captured.out.splitlines() if x.strip()]
    assert all(x["bench"] == "routing_sim" and x["case"] for x in lines)
    cases = {x["case"] for x in lines}
    for policy in (*routing_sim.POLICIES, "infinite", "targets"):
        assert f"quick-chat-e2/{policy}" in cases
    assert "summary" in cases
    assert "TTFT p50" in captured.err and "approx-tree" in captured.err
