"""Beam search through the router's engine with a real ModelRunner in process (a random
Llama): on the CPU and, marked `gpu`, on CUDA in float32 with the decode graphs captured
(beams decode in the graphs; their forks copy rows, their shared last blocks are copied
on the device). The beams equal transformers' `generate(num_beams=...)`; a plain request
beside them pipelines; every block comes back."""

from __future__ import annotations

import asyncio

import pytest
import torch
from pagedserve.executor.runner_setup import build_runner
from pagedserve.protos import wire
from pagedserve.router.engine import EngineConfig, RouterEngine
from pagedserve.router.types import BeamSpec, ModelInfoData, RequestSpec, SamplingSpec
from pipeline_rig import CharTokenizer, Collector, FakeLink, run, settle

from pagedserve.tinymodels import build_model

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]
BS, MAX_LEN, BLOCKS = 8, 96, 48
PROMPTS = [[0, 17, 250, 33, 9, 480, 77, 5, 61, 300, 12], [0, 400, 3, 3, 91, 200]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("beam_runner") / "llama", "llama")


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def _hf_beams(model, prompt, width, max_tokens):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width,
                             num_return_sequences=width, max_new_tokens=max_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[:, len(prompt):].tolist()


async def _serve(model_dir, device, requests):
    """The router's engine planning for an in-process runner: each plan executed as it is
    sent (two in flight), until every request is done."""
    runner = build_runner(str(model_dir), device=device, dtype="float32", block_size=BS,
                          num_gpu_blocks=BLOCKS, num_cpu_blocks=8, max_model_len=MAX_LEN,
                          max_num_seqs=16, progress=False)
    config = EngineConfig(model_fingerprint="fp", block_size=BS, max_model_len=MAX_LEN,
                          pipeline_depth=2, debug_checks=True, watermark=0.0)
    info = ModelInfoData("m", "LlamaForCausalLM", MAX_LEN, 512, BS, "float32", (2,))
    engine = RouterEngine(config, CharTokenizer(), info)
    engine.link = FakeLink()
    assert engine.membership.on_hello(b"e0", wire.Hello(
        executor_id="e0", model_fingerprint="fp", device=device, dtype="float32",
        block_size=BS, num_gpu_blocks=BLOCKS, num_cpu_blocks=8,
        max_model_len=MAX_LEN)).accepted
    streams = [Collector(await engine.submit(spec)) for spec in requests]
    answered = 0
    for _ in range(2000):
        plans = [m for m in engine.link.sent if isinstance(m, wire.StepPlan)]
        if answered < len(plans):
            result = runner.execute(plans[answered])
            answered += 1
            assert not result.errors, result.errors
            engine.steps.on_result("e0", result)
            await settle()
        elif all(s.done for s in streams):
            break
        else:
            await asyncio.sleep(0.001)
    kv = engine.executors["e0"].kv
    return streams, kv, engine


@pytest.mark.parametrize("device", DEVICES)
def test_beams_on_a_real_runner_equal_transformers(model_dir, hf_model, device):
    beams = [RequestSpec(f"b{i}", tuple(p), SamplingSpec(
        max_tokens=12, n=w, ignore_eos=True, beam=BeamSpec(), prompt_logprobs=k))
        for i, (p, w, k) in enumerate(zip(PROMPTS, (3, 4), (2, None), strict=True))]
    plain = RequestSpec("plain", (0, 5, 6, 7), SamplingSpec(max_tokens=12, temperature=0.0,
                                                            ignore_eos=True))
    streams, kv, engine = run(_serve(model_dir, device, [*beams, plain]))
    for spec, c in zip(beams, streams[:2], strict=True):
        assert c.error is None
        got = [c.tokens(i) for i in range(spec.sampling.n)]
        assert got == _hf_beams(hf_model, list(spec.prompt_token_ids), spec.sampling.n, 12)
    assert streams[2].tokens() == _hf_beams(hf_model, [0, 5, 6, 7], 1, 12)[0]
    scored = streams[0].outputs[-1].prompt_logprobs  # the prompt scored once, for all beams
    assert [lp.token_id for lp in scored] == PROMPTS[0][1:]
    assert all(len(lp.top) == 2 for lp in scored)
    marked = {rid for p in engine.link.sent if isinstance(p, wire.StepPlan)
              and p.feed_sampled is not None
              for rid, f in zip(p.request_ids, p.feed_sampled, strict=True) if f}
    assert marked == {"plain#0"}  # the plain request pipelined, never a beam
    forks = [f for p in engine.link.sent if isinstance(p, wire.StepPlan) for f in p.forks]
    assert len(forks) >= 3 + 2  # at least the first step's (width - 1) forks of each
    assert kv.num_free_gpu_blocks == BLOCKS and not kv.request_ids()
