"""The executor's step execution, driven in-process with StepPlans (no router): chunked
prefill, prefix-cache hits, swap out/in, copy-on-write forks, seeded sampling across batch
compositions, and plans that must fail without taking the executor down."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pagedserve.executor.runner_setup import build_runner
from pagedserve.protos.wire import NewRequest, SamplingParams, StepPlan, int32, int64_pairs
from test_executor_support import Driver

from pagedserve.tinymodels import build_model

PROMPT = [0, 17, 250, 33, 9, 480, 77, 5, 61, 300, 12, 13, 14, 15, 16, 99, 98, 97, 96, 95]
OTHER = [0, 400, 3, 3, 3, 91, 200, 201, 202]
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # Low-temperature-ish random model: sampling at T=1 still varies between draws.
    return build_model(tmp_path_factory.mktemp("exec") / "llama", "llama",
                       initializer_range=0.05)


@pytest.fixture
def driver(model_dir):
    runner = build_runner(str(model_dir), num_gpu_blocks=48, num_cpu_blocks=16,
                          block_size=8, progress=False)
    return Driver(runner)


def _alone(driver_factory, prompt, num_tokens, sampling=None, **kw):
    d = driver_factory()
    d.add("x", prompt, **({"sampling": sampling} if sampling else {}), **kw)
    d.generate(["x"], num_tokens)
    return d.seqs["x"].outputs


@pytest.fixture
def fresh(model_dir):
    def make():
        return Driver(build_runner(str(model_dir), num_gpu_blocks=48, num_cpu_blocks=16,
                                   block_size=8, progress=False))
    return make


def test_chunked_prefill_equals_whole_prefill(driver, fresh):
    driver.add("a", PROMPT)
    for chunk in (3, 8, 5):  # 16 of 20 prompt tokens, no sampling yet
        result = driver.step({"a": chunk})
        assert result.request_ids == [] and not result.errors
    driver.generate(["a"], 6)
    assert driver.seqs["a"].outputs == _alone(fresh, PROMPT, 6)


def test_prefix_cache_hit_reuses_blocks(driver, fresh):
    """A second request sharing the first's two full blocks computes only its tail."""
    driver.add("a", PROMPT)
    driver.generate(["a"], 2)
    shared = driver.seqs["a"].table[:2]
    prompt_b = PROMPT[:16] + [7, 7, 8]
    driver.add("b", prompt_b, shared_blocks=shared, num_cached=16)
    plan = driver.plan({"b": None, "a": 1})
    assert plan.num_new_tokens.tolist() == [3, 1]
    driver.accept(driver.runner.execute(plan))
    driver.generate(["a", "b"], 5)
    assert driver.seqs["b"].outputs == _alone(fresh, prompt_b, 5)
    assert driver.seqs["a"].outputs == _alone(fresh, PROMPT, 5)


def test_swap_out_and_in_mid_generation(driver, fresh):
    driver.add("a", PROMPT, sampling=SEEDED)
    driver.add("b", OTHER)
    driver.generate(["a", "b"], 3)
    out = driver.swap_out("a")
    driver.step({"b": None}, swap_out=out)
    # Overwrite the blocks "a" had: another request takes them.
    driver.add("c", OTHER[::-1] + PROMPT)
    driver.step({"c": None, "b": None})
    inn = driver.swap_in("a")
    result = driver.step({"a": None, "b": None}, swap_in=inn)
    assert result.swap_s > 0
    driver.generate(["a"], 8)
    assert driver.seqs["a"].outputs == _alone(fresh, PROMPT, 8, SEEDED)


def test_fork_copy_on_write_then_divergent_samples(driver, fresh):
    """n=2 style: the child shares the parent's blocks, copies the partial last one before
    writing, and samples its own tokens; each sample equals what an executor that took the
    request over (state rebuilt from prompt + outputs so far) produces."""
    driver.add("p", PROMPT[:12], sampling=SEEDED, sample_index=0)
    driver.step({"p": None})  # prefill + first token (position 12 lies in block 1)
    driver.fork("p", "c", sample_index=1)
    cow = driver.cow_last_block("c")
    driver.step({"p": None, "c": None}, copy=cow)
    driver.generate(["p", "c"], 8)
    parent, child = driver.seqs["p"].outputs, driver.seqs["c"].outputs
    assert parent[0] == child[0] and parent != child
    first = [parent[0]]
    for rid, index, tokens in (("p", 0, parent), ("c", 1, child)):
        assert _alone(fresh, PROMPT[:12], 8, SEEDED, sample_index=index, outputs=first) \
            == tokens, rid


def test_seeded_sampling_independent_of_batch(fresh):
    alone = _alone(fresh, PROMPT, 10, SEEDED)
    d = fresh()
    d.add("b", OTHER, sampling=SamplingParams(temperature=0.7, seed=5))
    d.add("x", PROMPT, sampling=SEEDED)
    d.add("c", PROMPT[3:], sampling=SamplingParams(temperature=0.0))
    d.step({"b": None, "c": 4})
    d.generate(["c", "x", "b"], 10)
    assert d.seqs["x"].outputs == alone
    other_seed = _alone(fresh, PROMPT, 10, SamplingParams(temperature=1.0, top_p=0.9, seed=9))
    assert other_seed != alone


def test_logprobs_reported(driver):
    driver.add("a", PROMPT, sampling=SamplingParams(temperature=0.0, logprobs=3))
    result = driver.step({"a": None})
    assert result.top_counts.tolist() == [3]
    assert result.top_token_ids[0] == result.token_ids[0]
    assert result.logprobs[0] == pytest.approx(result.top_logprobs[0])


def _plan(**kw) -> StepPlan:
    plan = StepPlan(**kw)
    plan.validate()
    return plan


def test_bad_plans_are_reported_and_survived(driver, fresh):
    driver.add("a", PROMPT)
    driver.step({"a": None})
    runner = driver.runner

    # An unknown request: an error for it, the other request still runs.
    good = driver.plan({"a": None})
    bad = StepPlan(
        step_id=good.step_id, request_ids=["ghost", "a"],
        num_computed_tokens=int32([0, *good.num_computed_tokens]),
        num_new_tokens=int32([1, *good.num_new_tokens]),
        do_sample=np.array([1, 1], np.uint8), token_ids=int32([5, *good.token_ids]),
        positions=int32([0, *good.positions]),
        slot_mapping=np.array([0, *good.slot_mapping], np.int64),
        block_table_starts=int32([0, *good.block_table_starts]),
        block_table_lens=int32([1, *good.block_table_lens]),
        block_table_ids=int32([0, *good.block_table_ids]))
    result = runner.execute(bad)
    assert [e.request_id for e in result.errors] == ["ghost"]
    assert result.request_ids == ["a"]
    driver.seqs["a"].tokens.append(int(result.token_ids[0]))

    # A block id out of range in a new request's table: error for it, state dropped.
    new = NewRequest(request_id="z", prompt_token_ids=int32([1, 2]),
                     output_token_ids=int32([]), sampling=SamplingParams(temperature=0))
    result = runner.execute(_plan(
        step_id=100, new_requests=[new], request_ids=["z"], num_computed_tokens=int32([0]),
        num_new_tokens=int32([2]), do_sample=np.array([1], np.uint8), token_ids=int32([1, 2]),
        positions=int32([0, 1]), slot_mapping=np.array([0, 1], np.int64),
        block_table_starts=int32([0]), block_table_lens=int32([1]),
        block_table_ids=int32([10_000])))
    assert result.errors[0].request_id == "z" and "out of range" in result.errors[0].message
    assert "z" not in runner.requests

    # A swap naming a block out of range: the whole step fails, nothing runs.
    result = runner.execute(_plan(step_id=101, swap_out=int64_pairs([(0, 999)])))
    assert result.errors[0].request_id == "" and "swap_out" in result.errors[0].message

    # An exception in the forward pass is reported as a step error.
    original = runner.model.forward
    runner.model.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
    try:
        result = runner.execute(driver.plan({"a": None}))
    finally:
        runner.model.forward = original
    assert result.errors[0].request_id == "" and "boom" in result.errors[0].message
    driver.seqs["a"].num_computed -= 1  # re-plan the token that failed

    # And the executor keeps serving.
    driver.generate(["a"], 6)
    assert driver.seqs["a"].outputs == _alone(fresh, PROMPT, 6)


def test_finished_requests_dropped(driver):
    driver.add("a", PROMPT)
    driver.add("b", OTHER)
    driver.step({"a": None, "b": None})
    assert set(driver.runner.requests) == {"a", "b"}
    driver.runner.execute(_plan(step_id=50, finished_ids=["a", "never-seen"]))
    assert set(driver.runner.requests) == {"b"}


def test_kv_cache_sizes_from_space(model_dir):
    runner = build_runner(str(model_dir), kv_cache_space=0.001, swap_space=0.0005,
                          progress=False)
    # 2 layers * 2 * 16 tokens * 2 kv heads * 40 dims * 4 bytes = 20480 bytes per block
    assert runner.cache.num_gpu_blocks == (1 << 30) // 1000 // 20480
    assert runner.cache.num_cpu_blocks == (1 << 30) // 2000 // 20480
    assert runner.cache.kv_cache.dtype == torch.float32


def test_each_bad_row_is_reported_and_the_good_rows_run(driver, fresh):
    """The vectorised checks: a row with no new tokens, one whose tokens do not fit its
    blocks, one whose table change starts beyond its table and one with an out-of-range
    slot each get their own error (state dropped); the good row samples as it would alone."""
    for rid in ("a", "zero", "long", "gap", "slot"):
        driver.add(rid, PROMPT if rid == "a" else OTHER)
    driver.step({rid: None for rid in driver.seqs})
    good = driver.plan({"a": None, "zero": None, "long": None, "gap": None, "slot": None})
    num_new = good.num_new_tokens.copy()
    num_new[1] = 0
    positions, slots = good.positions.copy(), good.slot_mapping.copy()
    starts = good.block_table_starts.copy()
    starts[3] = 5  # "gap" has 2 blocks
    computed = good.num_computed_tokens.copy()
    computed[2] = 16  # "long": 17 tokens in 2 blocks of 8
    slots[4] = 10_000  # "slot" (its one token), beyond the 48 blocks
    keep = np.ones(good.num_tokens, bool)
    keep[1] = False  # the token "zero" no longer computes
    bad = _plan(
        step_id=good.step_id, request_ids=good.request_ids, num_computed_tokens=computed,
        num_new_tokens=num_new, do_sample=good.do_sample, token_ids=good.token_ids[keep],
        positions=positions[keep], slot_mapping=slots[keep], block_table_starts=starts,
        block_table_lens=good.block_table_lens, block_table_ids=good.block_table_ids)
    result = driver.runner.execute(bad)
    errors = {e.request_id: e.message for e in result.errors}
    assert errors == {
        "zero": "scheduled with no new tokens",
        "long": "its tokens do not fit its blocks or max_model_len",
        "gap": "block table change at 5 beyond its 2",
        "slot": "a slot, position or token id out of range",
    }
    assert result.request_ids == ["a"] and set(driver.runner.requests) == {"a"}
    driver.accept(result)
    driver.generate(["a"], 3)
    assert driver.seqs["a"].outputs == _alone(fresh, PROMPT, 3)
