"""The executor's side of embeddings (SamplingParams.embed): the step that computes a
prompt's last token returns its final hidden state, equal to transformers' last
hidden_states row (fp32), for a whole prompt, one prefilled in chunks, one after cached
blocks and one beside decodes of a generation request; nothing for the steps before; and
on a GPU (`gpu`), the same with the decode graphs and the mixed steps' graph pieces
captured, as `serve` runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pagedserve.executor.runner_setup import build_runner
from pagedserve.protos.wire import SamplingParams
from test_executor_support import Driver

from pagedserve.tinymodels import build_model

EMBED = SamplingParams(temperature=0.0, embed=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("embed-exec") / "qwen2", "qwen2")


def last_hidden(model_dir, ids: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[-1][0, -1].numpy()


def _run(runner, model_dir) -> None:
    rng = np.random.default_rng(3)
    prompts = {r: rng.integers(3, 200, n).tolist() for r, n in
               (("whole", 11), ("chunked", 40), ("gen", 9), ("one", 1))}
    driver = Driver(runner)
    driver.add("gen", prompts["gen"])  # a generation request beside them
    driver.step({"gen": None})
    for rid in ("whole", "chunked", "one"):
        driver.add(rid, prompts[rid], sampling=EMBED)
    first = driver.step({"gen": None, "whole": None, "chunked": 16, "one": None})
    assert sorted(first.embed_ids) == ["one", "whole"]  # chunked: 16 of 40 so far
    second = driver.step({"gen": None, "chunked": None})
    assert second.embed_ids == ["chunked"]
    third = driver.step({"gen": None})
    assert third.embed_ids == [] and third.embeddings is None
    got = {r: first.embeddings[i] for i, r in enumerate(first.embed_ids)}
    got["chunked"] = second.embeddings[0]
    for rid, vector in got.items():
        assert vector.dtype == np.float32
        np.testing.assert_allclose(vector, last_hidden(model_dir, prompts[rid]), atol=2e-5,
                                   rtol=1e-4, err_msg=rid)
    # after the cached blocks of "chunked" (two full blocks of 16): only its rest computed
    blocks = driver.seqs["chunked"].table[:2]
    driver.add("again", prompts["chunked"], sampling=EMBED, shared_blocks=blocks,
               num_cached=32)
    again = driver.step({"again": None})
    assert again.embed_ids == ["again"]
    np.testing.assert_allclose(again.embeddings[0], got["chunked"], atol=2e-5, rtol=1e-4)


def test_the_step_computing_the_last_token_returns_its_hidden_state(model_dir):
    runner = build_runner(str(model_dir), num_gpu_blocks=64, num_cpu_blocks=0, block_size=16,
                          progress=False)
    _run(runner, model_dir)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_same_on_a_gpu_with_graphs(model_dir):
    runner = build_runner(str(model_dir), device="cuda", dtype="float32", num_gpu_blocks=64,
                          num_cpu_blocks=0, block_size=16, progress=False, max_num_seqs=8,
                          max_num_batched_tokens=64)
    assert runner.graphs is not None
    _run(runner, model_dir)
