"""`pagedserve.LLM` (pagedserve/offline.py): offline generation from Python over a cluster of
its own. One LLM (2 executors) for the module: greedy outputs equal transformers' (fp32, one
prompt at a time), token-id prompts, n samples, chat through the model's template, many
prompts past the in-flight window in order, a refused request raising GenerateError, and
close() leaving no executor process behind; embeddings; a key given is sent; weights
updated from disk."""

from __future__ import annotations

import os

import pytest
from cluster_harness import HFReference, assert_greedy_match

from pagedserve import LLM, GenerateError, SamplingParams
from pagedserve.tinymodels import build_lora_adapter, build_model

PROMPTS = ["Once upon a time", "The quick brown fox", "In a hole in the ground there lived"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_model(tmp_path_factory.mktemp("offline"), "llama", num_kv_heads=2))


@pytest.fixture(scope="module")
def adapter_dir(model_dir, tmp_path_factory):
    return str(build_lora_adapter(model_dir, tmp_path_factory.mktemp("adapter") / "one",
                                  rank=4, alpha=8, seed=1))


@pytest.fixture(scope="module")
def llm(model_dir, adapter_dir):
    with LLM(model_dir, executors=2, num_gpu_blocks=128, max_queue_len=8,
             lora_modules=f"one={adapter_dir}", max_loras=2, max_lora_rank=4,
             enable_weight_updates=True) as llm:
        yield llm


def test_greedy_equals_transformers(llm, model_dir):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.prompt for o in outs] == PROMPTS
    hf = HFReference(model_dir)
    for out in outs:
        ids = hf.encode(out.prompt)
        expected, gaps = hf.greedy(ids, 12)
        (sample,) = out.outputs
        assert out.prompt_tokens == len(ids) and sample.finish_reason == "length"
        assert_greedy_match(sample.token_ids, expected, gaps)
    # token ids in, and the same prompt again from the prefix cache
    again = llm.generate([hf.encode(PROMPTS[0])], SamplingParams(max_tokens=12, temperature=0,
                                                                 ignore_eos=True))
    assert again[0].prompt is None
    assert again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_a_lora_adapter_equals_transformers_and_peft(llm, model_dir, adapter_dir):
    from test_lora import peft_reference
    hf = HFReference(model_dir)
    ids = hf.encode(PROMPTS[1])
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    (tuned,) = llm.generate([ids], params, lora_adapter="one")
    (base,) = llm.generate([ids], params)
    expected, logits = peft_reference(model_dir, adapter_dir, ids, 8)
    gaps = [float(x.topk(2).values[0] - x.topk(2).values[1]) for x in logits]
    assert_greedy_match(tuned.outputs[0].token_ids, expected, gaps)
    assert tuned.outputs[0].token_ids != base.outputs[0].token_ids
    with pytest.raises(GenerateError, match="unknown LoRA adapter 'two'"):
        llm.generate("Hi", params, lora_adapter="two")
    # loaded while the cluster runs (both executors), the same weights under another name
    llm.load_lora_adapter("two", adapter_dir)
    (again,) = llm.generate([ids], params, lora_adapter="two")
    assert again.outputs[0].token_ids == tuned.outputs[0].token_ids
    llm.unload_lora_adapter("two")
    with pytest.raises(GenerateError, match="unknown LoRA adapter 'two'"):
        llm.generate("Hi", params, lora_adapter="two")
    with pytest.raises(GenerateError, match="could not be loaded: executor .*: LoRA "
                                            "adapter three: /nowhere is not a directory"):
        llm.load_lora_adapter("three", "/nowhere")


def test_samples_chat_and_many_prompts_in_order(llm):
    (out,) = llm.generate("Hello", SamplingParams(max_tokens=4, n=3, temperature=1.0, seed=7))
    assert [s.index for s in out.outputs] == [0, 1, 2]
    assert all(len(s.token_ids) <= 4 for s in out.outputs)
    answers = llm.chat([[{"role": "user", "content": "Hi"}],
                        [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Hello"}]],
                       SamplingParams(max_tokens=3, temperature=0))
    assert len(answers) == 2 and all(a.prompt_tokens > 2 for a in answers)
    one = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=3,
                                                                     temperature=0))
    assert one[0].outputs[0].token_ids == answers[0].outputs[0].token_ids
    prompts = [f"Story number {i}" for i in range(30)]  # past max_queue_len 8 in flight
    outs = llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0))
    assert [o.prompt for o in outs] == prompts
    single = llm.generate(prompts[17], SamplingParams(max_tokens=2, temperature=0))
    assert single[0].outputs[0].token_ids == outs[17].outputs[0].token_ids


def test_embed_vectors_in_order(llm):
    vectors = llm.embed(["hello world", "a second text", "hello world"])
    assert len(vectors) == 3 and len(vectors[0]) == 160  # the tiny model's hidden size
    assert sum(x * x for x in vectors[0]) == pytest.approx(1.0, abs=1e-4)
    assert vectors[2] == pytest.approx(vectors[0], abs=1e-5)  # the same text again
    short = llm.embed("hello world", dimensions=8)
    assert len(short[0]) == 8 and sum(x * x for x in short[0]) == pytest.approx(1.0, abs=1e-4)
    many = llm.embed([f"text {i}" for i in range(5)], batch=2)  # three calls, in order
    assert many[3] == pytest.approx(llm.embed("text 3")[0], abs=1e-5)
    with pytest.raises(GenerateError, match="input"):
        llm.embed([""])


def test_refusals_raise(llm, model_dir):
    with pytest.raises(GenerateError) as info:
        llm.generate(["x"], SamplingParams(max_tokens=0))
    assert info.value.code == "INVALID_ARGUMENT" and "max_tokens" in str(info.value)
    with pytest.raises(ValueError, match="pagedserve.LLM"):
        LLM(model_dir, no_such_flag=1)


def test_weights_updated_from_disk_and_refused(llm, model_dir, tmp_path):
    """A trainer's checkpoint (here a copy of the same weights: the other tests' tokens
    stay) loads on both executors; another model's is refused with the executors' reason."""
    import shutil

    from pagedserve.tinymodels import build_model
    ckpt = shutil.copytree(model_dir, tmp_path / "step-1")
    assert llm.update_weights_from_disk(ckpt, weight_version="step-1") == 0
    other = build_model(tmp_path / "other", "llama", num_kv_heads=2, intermediate_size=128)
    with pytest.raises(GenerateError, match="config.json intermediate_size is 128, the "
                                            "running model's is 256"):
        llm.update_weights_from_disk(other)
    with pytest.raises(GenerateError, match="mode: 'later' is not one of abort"):
        llm.pause_generation("later")
    llm.pause_generation("wait")  # nothing runs: at once; a generate now would wait
    llm.continue_generation()
    (out,) = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=12, temperature=0,
                                                      ignore_eos=True))
    hf = HFReference(model_dir)
    assert_greedy_match(out.outputs[0].token_ids, *hf.greedy(hf.encode(PROMPTS[0]), 12))


def test_a_key_given_is_sent_and_close_stops_every_executor(model_dir, monkeypatch):
    """An `api_key=` is the private cluster's key and the LLM sends it ($PAGEDSERVE_API_KEY
    is not applied); close() stops every executor, twice is fine, a closed LLM refuses."""
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "sk-from-the-environment")  # not the LLM's
    llm = LLM(model_dir, executors=1, num_gpu_blocks=32, api_key="sk-mine")
    assert llm.generate("Hi", SamplingParams(max_tokens=2))[0].outputs
    assert len(llm.embed("Hi")[0]) == 160
    pids = [p.pid for p in llm.children.procs.values()]
    assert len(pids) == 1
    llm.close()
    llm.close()  # idempotent
    assert not llm._thread.is_alive()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("Hi")
