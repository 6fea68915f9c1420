"""Weights updated while an executor serves (the plans' ``weight_op``,
executor/weight_ops.py): a checked then loaded checkpoint of the same model computes what
transformers computes with it, through the graphs captured before it; every checkpoint that
does not fit is refused with its reason and changes no byte of the model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from pagedserve.executor import weight_ops
from pagedserve.executor.cuda_graphs import DecodeGraphs
from pagedserve.executor.runner_setup import build_runner
from pagedserve.protos.wire import WeightOp
from safetensors.torch import load_file, save_file
from test_executor_support import Driver, assert_greedy_equal, hf_reference
from test_models import NUM_TOKENS, PROMPTS

from pagedserve.tinymodels import build_model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    return {"old": build_model(root / "old", seed=0),
            # the same model trained on: other weights, stored in bfloat16
            "new": build_model(root / "new", seed=1, dtype="bfloat16")}


def _runner(dirs):
    return build_runner(str(dirs["old"]), num_gpu_blocks=64, num_cpu_blocks=0, block_size=8,
                        progress=False)


def _op(driver: Driver, path, load: bool) -> str:
    """Run a plan carrying only the weight op; its weight_failed."""
    result = driver.runner.execute(driver.plan({}, weight_op=WeightOp(path=str(path),
                                                                        load=load)))
    assert not result.errors and not result.request_ids
    return result.weight_failed


def _check(driver: Driver, model_dir, rids) -> None:
    for rid, prompt in zip(rids, PROMPTS, strict=False):
        driver.add(rid, prompt)
    driver.generate(rids, NUM_TOKENS)
    for rid, prompt in zip(rids, PROMPTS, strict=False):
        ref, logits = hf_reference(model_dir, prompt, NUM_TOKENS)
        assert_greedy_equal(driver.seqs[rid].outputs, ref, logits)


def _snapshot(runner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in runner.model.named_parameters()}


def test_new_weights_equal_transformers_through_graphs_captured_before(dirs):
    """Old weights serve (through decode graphs, the CPU twin of CUDA graphs); a check
    changes nothing; the load makes the same graphs compute the new checkpoint's tokens
    (cast from bfloat16) and the parameters keep their storage; a load of "" restores
    --model's."""
    runner = _runner(dirs)
    runner.graphs = DecodeGraphs(runner.model, runner.cache.kv_cache, runner.block_size,
                                 runner.max_model_len, 8, runner.loras)
    runner.graphs.capture()
    driver = Driver(runner)
    _check(driver, dirs["old"], ["a", "b"])
    before = _snapshot(runner)
    storage = {n: p.data_ptr() for n, p in runner.model.named_parameters()}
    assert _op(driver, dirs["new"], load=False) == ""
    assert all(torch.equal(p, before[n]) for n, p in runner.model.named_parameters())
    steps = runner.graph_steps
    assert _op(driver, dirs["new"], load=True) == ""
    assert {n: p.data_ptr() for n, p in runner.model.named_parameters()} == storage
    new = load_file(str(dirs["new"] / "model.safetensors"))
    assert torch.equal(runner.model.lm_head.weight, new["lm_head.weight"].float())
    _check(driver, dirs["new"], ["c", "d", "e"])
    assert runner.graph_steps - steps == NUM_TOKENS - 1
    assert runner.weights.path == str(dirs["new"])
    # "" is the executor's own --model (a restarted router's weights): back to the old ones
    assert _op(driver, "", load=True) == "" and runner.weights.path == ""
    assert all(torch.equal(p, before[n]) for n, p in runner.model.named_parameters())


def _variant(dirs, tmp_path, name, config=None, edit=None, keep_config=True):
    """A copy of the new checkpoint with ``config`` merged into config.json and ``edit``
    applied to its tensors."""
    dst = tmp_path / name
    dst.mkdir()
    if keep_config:
        cfg = json.loads((dirs["new"] / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, **(config or {})}))
    tensors = load_file(str(dirs["new"] / "model.safetensors"))
    if edit is not None:
        edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_checkpoints_that_do_not_fit_are_refused_and_change_nothing(dirs, tmp_path):
    runner = _runner(dirs)
    driver = Driver(runner)
    before = _snapshot(runner)

    def drop(t):
        del t["model.layers.1.mlp.up_proj.weight"]

    def widen(t):
        t["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(160, 161)

    def extra(t):
        t["model.layers.0.adapter.weight"] = torch.zeros(2)

    cases = {
        tmp_path / "absent": "not a directory this executor can read",
        _variant(dirs, tmp_path, "layers", config={"num_hidden_layers": 3}):
            "config.json num_layers is 3, the running model's is 2 (weights of another model)",
        _variant(dirs, tmp_path, "eps", config={"rms_norm_eps": 0.5}):
            "config.json rms_norm_eps is 0.5, the running model's is 1e-05",
        _variant(dirs, tmp_path, "missing", edit=drop):
            "weights missing for model.layers.1.mlp.gate_up_proj.weight[1]",
        _variant(dirs, tmp_path, "shape", edit=widen, keep_config=False):
            "model.layers.0.self_attn.o_proj.weight: shape (160, 161) where (160, 160) expected",
        _variant(dirs, tmp_path, "extra", edit=extra):
            "model.safetensors: unexpected tensor 'model.layers.0.adapter.weight'",
    }
    empty = tmp_path / "empty"
    empty.mkdir()
    cases[empty] = "no *.safetensors weights"
    torn = _variant(dirs, tmp_path, "torn")
    (torn / "model.safetensors").write_bytes((torn / "model.safetensors").read_bytes()[:999])
    cases[torn] = "weights "
    for path, message in cases.items():
        for load in (False, True):
            failed = _op(driver, path, load)
            assert failed.startswith(f"weights {path}: ") and message in failed, failed
            assert str(path) not in failed[len(f"weights {path}: "):]
            assert weight_ops.PARTIAL not in failed
    assert all(torch.equal(p, before[n]) for n, p in runner.model.named_parameters())
    _check(driver, dirs["old"], ["a"])


def test_a_load_cut_partway_says_so(dirs, tmp_path, monkeypatch):
    """The headers check out, then reading fails: the message says the model is partly
    loaded (the router takes such an executor out of service)."""
    runner = _runner(dirs)
    driver = Driver(runner)
    path = tmp_path / "cut"
    shutil.copytree(dirs["new"], path)

    def copy_then_fail(plan, progress=False):
        (file, copies), = plan
        copies[0][1].zero_()
        raise OSError("Input/output error")

    monkeypatch.setattr(weight_ops, "copy_weights", copy_then_fail)
    assert _op(driver, path, load=False) == ""
    assert _op(driver, path, load=True) == (
        f"weights {path} {weight_ops.PARTIAL}: OSError: Input/output error")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_new_weights_on_a_gpu_through_the_graphs_captured_at_start(dirs):
    """On a GPU (float32; decode graphs and graph pieces captured at start): a step in
    flight when the load comes (the executor leaves sampling steps in flight there), then
    the load, then the replays compute the new checkpoint's tokens."""
    runner = build_runner(str(dirs["old"]), device="cuda", dtype="float32",
                          num_gpu_blocks=64, num_cpu_blocks=0, block_size=8, progress=False,
                          max_num_seqs=8)
    assert runner.graphs is not None and runner.overlap_steps
    driver = Driver(runner)
    _check(driver, dirs["old"], ["a", "b"])
    assert _op(driver, dirs["new"], load=False) == ""
    assert _op(driver, dirs["new"], load=True) == ""
    steps = runner.graph_steps
    _check(driver, dirs["new"], ["c", "d", "e"])
    assert runner.graph_steps > steps


def test_adapters_stay_loaded_on_top_of_the_new_weights(tmp_path):
    """A LoRA adapter (a --lora-modules one, and one loaded while serving) is a delta on the
    weights: after an update each computes what transformers + PEFT compute with the same
    adapter on the new checkpoint."""
    pytest.importorskip("peft")
    from pagedserve.protos.wire import LoraOp
    from test_lora import peft_reference

    from pagedserve.tinymodels import build_lora_adapter
    old = build_model(tmp_path / "old", "qwen2", seed=0)
    new = build_model(tmp_path / "new", "qwen2", seed=1)
    static = build_lora_adapter(old, tmp_path / "static", rank=8, alpha=16, seed=1)
    loaded = build_lora_adapter(old, tmp_path / "loaded", rank=4, alpha=8, seed=2,
                                target_modules=("q_proj", "v_proj", "down_proj"))
    runner = build_runner(str(old), num_gpu_blocks=96, num_cpu_blocks=0, block_size=8,
                          progress=False, max_loras=2, max_lora_rank=8,
                          lora_modules=(("static", str(static)),))
    driver = Driver(runner)
    result = runner.execute(driver.plan({}, lora_ops=[
        LoraOp(name="loaded", load=True, path=str(loaded))]))
    assert not result.lora_failed
    assert _op(driver, new, load=False) == "" and _op(driver, new, load=True) == ""
    cases = {"s": ("static", static, PROMPTS[0]), "l": ("loaded", loaded, PROMPTS[1]),
             "b": ("", None, PROMPTS[0])}
    for rid, (lora, _, prompt) in cases.items():
        driver.add(rid, prompt, lora=lora)
    driver.generate(list(cases), NUM_TOKENS)
    for rid, (_, adapter, prompt) in cases.items():
        ref, logits = peft_reference(new, adapter, prompt, NUM_TOKENS)
        assert_greedy_equal(driver.seqs[rid].outputs, ref, logits)
