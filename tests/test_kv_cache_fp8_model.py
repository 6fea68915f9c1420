"""The executor with an fp8 KV cache (``--kv-cache-dtype``) against transformers whose cache
keeps each key and value rounded the same way (an fp8 round trip in its cache update):
greedy tokens equal, tie-tolerant; four times the blocks of a float32 cache in the same
space; swap and copy-on-write move the bytes; and the flag on a real cluster."""

from __future__ import annotations

import inspect

import pytest
import torch
from pagedserve.executor.runner_setup import build_runner
from pagedserve.kernels.kv_dtypes import to_cache_dtype
from test_executor_support import Driver, assert_greedy_equal, hf_reference
from test_models import NUM_TOKENS, PROMPTS

from pagedserve.tinymodels import build_model

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("fp8") / "qwen2", "qwen2")


def hf_fp8_reference(model_dir, prompt, num_tokens, kv_dtype):
    """transformers' greedy generate (fp32) with every new key and value rounded to
    ``kv_dtype`` as it enters the cache: what an fp8 paged cache holds (keys after the
    rotary, as here)."""
    from transformers import AutoModelForCausalLM, DynamicCache

    class RoundTripCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            def rounded(x):
                return to_cache_dtype(x, kv_dtype).to(x.dtype)

            return super().update(rounded(key_states), rounded(value_states), layer_idx,
                                  *args, **kwargs)

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    # transformers renamed generate's ``past_key_values`` to ``cache`` (5.24 takes both, 5.17,
    # the GPU machines', only the old name): the name the model's forward takes.
    cache_arg = ("cache" if "cache" in inspect.signature(model.forward).parameters
                 else "past_key_values")
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=num_tokens, do_sample=False, output_logits=True,
            return_dict_in_generate=True, **{cache_arg: RoundTripCache(config=model.config)})
    return out.sequences[0, len(prompt):].tolist(), [x[0] for x in out.logits]


def _greedy_against_a_rounding_reference(runner, model_dir, kv_dtype) -> None:
    """All prompts in one batch (the long one in two prefill chunks, then decodes), each
    equal to transformers alone with its cache rounded to ``kv_dtype``."""
    driver = Driver(runner)
    rids = [f"r{i}" for i in range(len(PROMPTS))]
    for rid, prompt in zip(rids, PROMPTS, strict=True):
        driver.add(rid, prompt)
    driver.step({"r0": None, "r1": 20, "r2": None})
    driver.generate(rids, NUM_TOKENS)
    for rid, prompt in zip(rids, PROMPTS, strict=True):
        ref, logits = hf_fp8_reference(model_dir, prompt, NUM_TOKENS, kv_dtype)
        assert_greedy_equal(driver.seqs[rid].outputs, ref, logits)


@pytest.mark.parametrize("name", list(FP8))
def test_greedy_matches_transformers_with_a_rounding_cache(model_dir, name):
    runner = build_runner(str(model_dir), num_gpu_blocks=64, num_cpu_blocks=0, block_size=8,
                          progress=False, kv_cache_dtype=name)
    assert runner.cache.kv_cache.dtype == FP8[name]
    _greedy_against_a_rounding_reference(runner, model_dir, FP8[name])


def test_an_fp8_cache_holds_four_times_the_float32_blocks(model_dir):
    from pagedserve.executor.cache_engine import block_bytes

    blocks = {}
    for name in ("auto", "fp8", "fp8_e5m2"):
        runner = build_runner(str(model_dir), kv_cache_space=0.002, swap_space=0.001,
                              progress=False, kv_cache_dtype=name)
        blocks[name] = (runner.cache.num_gpu_blocks, runner.cache.num_cpu_blocks,
                        runner.cache.cpu_cache.dtype)
    cfg = runner.model.config
    wide, narrow = block_bytes(cfg, 16, torch.float32), block_bytes(cfg, 16, FP8["fp8_e4m3"])
    assert wide == 4 * narrow
    assert blocks["auto"] == (int(0.002 * 2**30) // wide, int(0.001 * 2**30) // wide,
                              torch.float32)
    assert blocks["fp8"] == (int(0.002 * 2**30) // narrow, int(0.001 * 2**30) // narrow,
                             torch.float8_e4m3fn)
    assert blocks["fp8_e5m2"] == (*blocks["fp8"][:2], torch.float8_e5m2)


def test_swap_and_copy_on_write_move_fp8_blocks_exactly(model_dir):
    """A request swapped out to the CPU (its blocks overwritten by another) and back, and a
    fork's copied last block: each samples what it would have alone."""
    def fresh():
        return Driver(build_runner(str(model_dir), num_gpu_blocks=48, num_cpu_blocks=16,
                                   block_size=8, progress=False, kv_cache_dtype="fp8"))

    alone = fresh()
    alone.add("a", PROMPTS[1])
    alone.generate(["a"], 8)
    driver = fresh()
    driver.add("a", PROMPTS[1])
    driver.add("b", PROMPTS[0])
    driver.generate(["a", "b"], 3)
    driver.step({"b": None}, swap_out=driver.swap_out("a"))
    driver.add("c", PROMPTS[0][::-1] + PROMPTS[1])  # takes the blocks "a" had
    driver.step({"c": None, "b": None})
    driver.step({"a": None, "b": None}, swap_in=driver.swap_in("a"))
    driver.generate(["a"], 8)  # until it has 8
    assert driver.seqs["a"].outputs == alone.seqs["a"].outputs
    driver.fork("a", "a2", sample_index=0)  # greedy: the child follows the parent
    driver.step({"a": None, "a2": None}, copy=driver.cow_last_block("a2"))
    driver.generate(["a", "a2"], 11)
    assert driver.seqs["a2"].outputs == driver.seqs["a"].outputs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(FP8))
def test_greedy_matches_transformers_with_a_rounding_cache_gpu(model_dir, name):
    """The same on a GPU (float32, the decode graphs and the fused rotary on, as `serve`
    runs): the kernels' rounding and widening against transformers' rounding cache."""
    runner = build_runner(str(model_dir), device="cuda", dtype="float32", num_gpu_blocks=64,
                          num_cpu_blocks=0, block_size=8, progress=False, kv_cache_dtype=name,
                          max_num_seqs=8)
    _greedy_against_a_rounding_reference(runner, model_dir, FP8[name])


def test_a_cluster_with_an_fp8_executor_beside_a_float32_one(model_dir):
    """`--kv-cache-dtype` reaches an executor from its flags' environment: one executor
    keeps the model's float32 cache, the other holds fp8 in the same `--kv-cache-space`
    (four times the blocks, registered and reported), and both serve, round robin: two
    replies are transformers' greedy tokens, two those of transformers with the rounding
    cache."""
    from cluster_harness import Cluster, request

    space = ["--kv-cache-space", "0.01"]
    cluster = Cluster(model_dir, num_executors=2, executor_args=space,
                      router_args=["--routing", "round-robin"],
                      executor_env={"exec1": {"PAGEDSERVE_KV_CACHE_DTYPE": "fp8"}})
    with cluster.running():
        blocks = {e.id: e.num_gpu_blocks for e in cluster.status().executors}
        assert 4 * blocks["exec0"] <= blocks["exec1"] < 4 * (blocks["exec0"] + 1)
        assert "KV cache fp8_e4m3" in "\n".join(
            line for reader in cluster.readers if reader.name == "exec1"
            for line in reader.lines)
        replies = [cluster.stub.Generate(request(token_ids=PROMPTS[0], max_tokens=8,
                                                 temperature=0.0), timeout=60)
                   for _ in range(4)]  # round-robin: two on each executor
        outputs = sorted(list(r.completions[0].token_ids) for r in replies)
        rounded, _ = hf_fp8_reference(model_dir, PROMPTS[0], 8, torch.float8_e4m3fn)
        plain, _ = hf_reference(model_dir, PROMPTS[0], 8)
        assert rounded != plain  # this prompt tells the two caches apart
        assert outputs == sorted([plain, plain, rounded, rounded])
        cluster.wait_blocks_free()
