"""End to end with the router's KVCacheManager planning the blocks: prefix-cache hits,
copy-on-write forks, swap out and back in, all mixed in the same steps; every request's
tokens equal a run of that request alone."""

from __future__ import annotations

import pytest
from pagedserve.executor.runner_setup import build_runner
from pagedserve.protos.wire import SamplingParams
from test_executor_support import KVDriver

from pagedserve.tinymodels import build_model

SYSTEM = [0, 17, 250, 33, 9, 480, 77, 5, 61, 300, 12, 13, 14, 15, 16, 99, 98]  # 2 blocks + 1
SEEDED = SamplingParams(temperature=1.0, seed=77)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("kv") / "qwen3", "qwen3", head_dim=40,
                       initializer_range=0.05)


def _runner(model_dir):
    return build_runner(str(model_dir), num_gpu_blocks=40, num_cpu_blocks=20, block_size=8,
                        progress=False)


def _alone(model_dir, prompt, num_tokens, sampling, sample_index=0, outputs=()):
    d = KVDriver(_runner(model_dir))
    d.add("x", prompt, sampling, sample_index, outputs)
    d.generate(["x"], num_tokens)
    return d.seqs["x"].outputs


def test_manager_driven_mixed_steps(model_dir):
    d = KVDriver(_runner(model_dir))
    greedy = SamplingParams(temperature=0.0)
    d.add("a", SYSTEM + [3, 4, 5], greedy)
    d.step({"a": 12})  # chunked prefill
    d.generate(["a"], 3)

    # b shares a's first two full blocks through the prefix cache.
    b = d.add("b", SYSTEM + [7, 8], SEEDED)
    assert b.num_computed == 16
    d.step({"b": None, "a": None})
    assert d.seqs["b"].table[:2] == d.seqs["a"].table[:2]

    # b forks (n=2); the child writes into the shared partial block -> copy-on-write.
    d.fork("b", "b1", sample_index=1)
    plan = d.plan({"a": None, "b": None, "b1": None})
    assert plan.copy.shape[0] == 1
    d.accept(d.runner.execute(plan))

    # a is swapped out while the others decode, then swapped back in.
    d.step({"b": None, "b1": None}, swap_out=["a"])
    d.generate(["b", "b1"], 5)
    plan = d.plan({"a": None, "b": None, "b1": None}, swap_in=["a"])
    assert plan.swap_in.shape[0] == 3 and plan.block_table_starts[0] == 0
    d.accept(d.runner.execute(plan))
    d.generate(["a", "b", "b1"], 8)

    assert d.seqs["a"].outputs == _alone(model_dir, SYSTEM + [3, 4, 5], 8, greedy)
    assert d.seqs["b"].outputs == _alone(model_dir, SYSTEM + [7, 8], 8, SEEDED)
    first = d.seqs["b"].outputs[:1]
    assert d.seqs["b1"].outputs == _alone(model_dir, SYSTEM + [7, 8], 8, SEEDED, 1, first)
    assert d.seqs["b1"].outputs != d.seqs["b"].outputs
