"""Our Llama-family models against Hugging Face transformers on the same random-weight
directories (greedy, fp32, tie-tolerant), and what the loader refuses."""

from __future__ import annotations

import json

import pytest
import torch
from pagedserve.executor.models import ModelConfig, ModelNotSupported, load_config
from pagedserve.executor.runner_setup import build_runner
from test_executor_support import Driver, assert_greedy_equal, hf_reference

from pagedserve.tinymodels import build_model

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
CONFIGS = {
    # GQA 4:2 with head dim 40 everywhere (not a power of two)
    "llama3-rope-tied": dict(arch="llama", rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True),
    "llama-linear": dict(arch="llama", rope_scaling={"rope_type": "linear", "factor": 2.0},
                         num_heads=4, num_kv_heads=1),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3", head_dim=40),
    "mistral": dict(arch="mistral", tie_word_embeddings=True),
}
PROMPTS = [
    [0, 17, 250, 33, 9, 480, 77, 5, 61, 300, 12, 13],
    [0, 400, 3, 3, 3, 91, 200, 201, 202, 7, 8, 9, 10, 11, 99, 98, 97, 96, 95, 94, 93, 92, 91,
     90, 89, 88, 87, 86, 85, 84, 83, 82, 81, 80, 79, 78, 77, 76, 75, 74, 73],
    [0, 5],
]
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: build_model(root / name, **kw) for name, kw in CONFIGS.items()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_transformers(model_dirs, name):
    """All prompts in one batch (mixed lengths, the long one in two prefill chunks, then
    decodes), each equal to transformers' generate run alone."""
    runner = build_runner(str(model_dirs[name]), num_gpu_blocks=64, num_cpu_blocks=0,
                          block_size=8, progress=False)
    driver = Driver(runner)
    rids = [f"r{i}" for i in range(len(PROMPTS))]
    for rid, prompt in zip(rids, PROMPTS, strict=True):
        driver.add(rid, prompt)
    driver.step({"r0": None, "r1": 20, "r2": None})  # r1: a prefill chunk that does not sample
    driver.generate(rids, NUM_TOKENS)
    for rid, prompt in zip(rids, PROMPTS, strict=True):
        ref, logits = hf_reference(model_dirs[name], prompt, NUM_TOKENS)
        assert_greedy_equal(driver.seqs[rid].outputs, ref, logits)


def test_sharded_weights_and_bf16(model_dirs, tmp_path):
    """A sharded checkpoint loads to the same logits; bfloat16 runs and stays close."""
    from transformers import AutoModelForCausalLM

    src = model_dirs["qwen2"]
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).save_pretrained(
        str(sharded), max_shard_size="100KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1
    outs = {}
    for label, path, dtype in (("one", src, "float32"), ("sharded", sharded, "float32"),
                               ("bf16", src, "bfloat16")):
        runner = build_runner(str(path), dtype=dtype, num_gpu_blocks=16, num_cpu_blocks=0,
                              progress=False)
        driver = Driver(runner)
        driver.add("a", PROMPTS[0])
        driver.generate(["a"], 4)
        outs[label] = driver.seqs["a"].outputs
    assert outs["one"] == outs["sharded"]
    assert runner.cache.kv_cache.dtype == torch.bfloat16
    assert outs["bf16"][0] == outs["one"][0]


def _write_config(tmp_path, **overrides):
    base = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 128, "hidden_act": "silu",
    }
    base.update(overrides)
    (tmp_path / "config.json").write_text(json.dumps(base))
    return tmp_path


@pytest.mark.parametrize("overrides, message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architecture 'GPT2LMHeadModel'"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 4096}, "sliding-window"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
      "sliding_window": 512}, "sliding-window"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "yarn"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"num_local_experts": 8}, "mixture of experts"),
    ({"hidden_act": "gelu"}, "gelu"),
])
def test_unsupported_models_refused(tmp_path, overrides, message):
    with pytest.raises(ModelNotSupported, match=message) as info:
        load_config(_write_config(tmp_path, **overrides))
    assert "\n" not in str(info.value)


def test_rope_config_old_and_new_style_agree(tmp_path):
    old = load_config(_write_config(tmp_path, rope_theta=5e5, rope_scaling={
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}))
    new = load_config(_write_config(tmp_path, rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}))
    assert isinstance(old, ModelConfig)
    assert (old.rope_type, old.rope_theta) == (new.rope_type, new.rope_theta) == ("llama3", 5e5)
    assert torch.equal(old.inv_freq(), new.inv_freq())
    assert old.fingerprint != new.fingerprint and len(old.fingerprint) == 64
    plain = load_config(_write_config(tmp_path, rope_theta=1e6))
    assert (plain.rope_type, plain.rope_theta) == ("default", 1e6)


def test_missing_weights_is_a_clear_error(tmp_path):
    _write_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        build_runner(str(tmp_path), num_gpu_blocks=4, progress=False)


@pytest.mark.parametrize("name", ["qwen2", "llama-linear"])
def test_decode_rotary_in_the_attention_kernel_is_bit_identical(model_dirs, name, monkeypatch):
    """Attention.fused_decode_rope (PAGEDSERVE_DECODE_FUSED_ROPE): on the Triton kernels
    (the interpreter here), decode steps rotate q and k and write the new keys and values
    inside the attention's launch; the tokens and every cache entry are the two-launch
    path's to the bit (Qwen2 with its QKV bias and 2 KV heads, a 4:1 Llama)."""
    from pagedserve.executor.models import llama
    from pagedserve.kernels import ops

    monkeypatch.setenv("PAGEDSERVE_KERNEL_BACKEND", "triton")
    fused_calls = []
    decode = ops.paged_decode_attention

    def spy(*args, **kwargs):
        if kwargs.get("rope") is not None:
            fused_calls.append(1)
        return decode(*args, **kwargs)

    monkeypatch.setattr(ops, "paged_decode_attention", spy)
    runs = {}
    for fused in (False, True):
        monkeypatch.setattr(llama.Attention, "fused_decode_rope", fused)
        driver = Driver(build_runner(str(model_dirs[name]), num_gpu_blocks=16,
                                     num_cpu_blocks=0, block_size=8, progress=False))
        driver.add("a", PROMPTS[0][:7])
        driver.add("b", PROMPTS[2])
        driver.generate(["a", "b"], 3)
        runs[fused] = ([driver.seqs[r].outputs for r in "ab"],
                       driver.runner.cache.kv_cache.clone())
        assert len(fused_calls) == (2 * driver.runner.model.config.num_layers if fused else 0)
    assert runs[True][0] == runs[False][0]
    assert torch.equal(runs[True][1], runs[False][1])


def test_triton_gemm_takes_only_the_projections_named(monkeypatch):
    """PAGEDSERVE_DECODE_TRITON_GEMM=qkv,o (llama.TRITON_GEMM): those projections ask
    ops.linear for the Triton GEMM, gate_up and down stay on cuBLAS."""
    from types import SimpleNamespace

    from pagedserve.executor.models import llama

    asked = []
    linear = llama.ops.linear
    monkeypatch.setattr(llama.ops, "linear", lambda *a, triton_gemm=False, **k: (
        asked.append(triton_gemm) or linear(*a, triton_gemm=False, **k)))
    monkeypatch.setattr(llama, "TRITON_GEMM", frozenset({"qkv", "o"}))
    x = torch.randn(3, 32)
    llama.project(llama._linear(32, 64, True), x, "qkv")
    llama.project(llama._linear(32, 32, True), x, "o")
    llama.MLP(SimpleNamespace(hidden_size=32, intermediate_size=48, mlp_bias=False))(x)
    assert asked == [True, True, False, False]  # qkv, o, gate_up, down


@pytest.mark.parametrize("with_fused_rope", [False, True])
def test_projections_through_the_triton_gemm_match_transformers(model_dirs, monkeypatch,
                                                                with_fused_rope):
    """PAGEDSERVE_DECODE_TRITON_GEMM (llama.TRITON_GEMM): every projection of batches up to
    512 tokens through the split-K Triton GEMM, the down projection with SiLU-and-multiply
    in its loads (the interpreter here), alone and with the decode steps' rotary in the
    attention launch (all the device-time switches):
    greedy tokens equal to transformers' (Qwen2: the QKV bias through the kernel's bias)."""
    from pagedserve.executor.models import llama
    from pagedserve.kernels import host_math, linear_ops

    monkeypatch.setenv("PAGEDSERVE_KERNEL_BACKEND", "triton")
    monkeypatch.setattr(llama, "TRITON_GEMM", frozenset(host_math.TRITON_GEMM_PROJECTIONS))
    monkeypatch.setattr(llama.Attention, "fused_decode_rope", with_fused_rope)
    calls = []
    tuned = linear_ops.linear_tuned
    monkeypatch.setattr(linear_ops, "linear_tuned",
                        lambda *a, **k: calls.append(a[2] is not None) or tuned(*a, **k))
    runner = build_runner(str(model_dirs["qwen2"]), num_gpu_blocks=32, num_cpu_blocks=0,
                          block_size=8, progress=False)
    driver = Driver(runner)
    driver.add("r0", PROMPTS[0][:6])
    driver.add("r2", PROMPTS[2])
    driver.generate(["r0", "r2"], 2)  # the prefill, then a decode step (its fused rotary)
    assert calls and any(calls) and not all(calls)  # QKV with its bias, the others without
    for rid, prompt in (("r0", PROMPTS[0][:6]), ("r2", PROMPTS[2])):
        ref, logits = hf_reference(model_dirs["qwen2"], prompt, 2)
        assert_greedy_equal(driver.seqs[rid].outputs, ref, logits)
