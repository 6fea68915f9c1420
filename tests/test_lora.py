"""LoRA adapters on the executor (executor/models/lora.py): PEFT-format adapters read as
PEFT reads them, and each request's tokens computed with its own adapter in mixed batches,
greedy tokens equal to transformers + PEFT (``PeftModel``) running that adapter alone; what
cannot be served exactly is refused at start with one line."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch
from pagedserve.executor.models.config import load_config
from pagedserve.executor.models.lora import LoraError, read_adapter
from pagedserve.executor.request_rows import RequestRows
from pagedserve.executor.runner_setup import build_runner
from safetensors.torch import load_file, save_file
from test_executor_support import Driver, assert_greedy_equal
from test_models import NUM_TOKENS, PROMPTS

from pagedserve.tinymodels import build_lora_adapter, build_model

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A Qwen2-shape model (q/k/v biases) and three adapters: every projection at rank 8;
    attention's q and v only at rank 4 with rsLoRA, in layer 1 only; the MLP only at rank
    16."""
    root = tmp_path_factory.mktemp("lora")
    model = build_model(root / "qwen2", "qwen2")
    return {
        "model": model,
        "all": build_lora_adapter(model, root / "all", rank=8, alpha=16, seed=1),
        "qv": build_lora_adapter(model, root / "qv", rank=4, alpha=8, seed=2, use_rslora=True,
                                 target_modules=("q_proj", "v_proj"), layers=(1,)),
        "mlp": build_lora_adapter(model, root / "mlp", rank=16, alpha=8, seed=3,
                                  target_modules=("gate_proj", "up_proj", "down_proj")),
    }


def peft_reference(model_dir, adapter_dir, prompt, num_tokens, _cache={}):  # noqa: B006
    """Greedy ids and logits of transformers + PEFT with ``adapter_dir`` (fp32, one
    prompt, EOS ignored); None: the base model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    key = (str(model_dir), str(adapter_dir))
    if key not in _cache:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        if adapter_dir is not None:
            model = PeftModel.from_pretrained(model, str(adapter_dir))
        _cache[key] = model.eval()
    with torch.no_grad():
        out = _cache[key].generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=num_tokens, min_new_tokens=num_tokens, eos_token_id=None,
            do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [x[0] for x in out.logits]


def _runner(dirs, names=("all", "qv", "mlp")):
    return build_runner(str(dirs["model"]), num_gpu_blocks=96, num_cpu_blocks=0, block_size=8,
                        progress=False, lora_modules=tuple((n, str(dirs[n])) for n in names))


def test_each_request_runs_its_own_adapter_in_one_batch(dirs):
    """Four requests in every step (a chunked prefill among them), one per adapter and one
    on the base model: each equals transformers + PEFT running its adapter alone, and each
    adapter changes what the base model would say."""
    runner = _runner(dirs)
    driver = Driver(runner)
    cases = {"r0": ("all", PROMPTS[0]), "r1": ("qv", PROMPTS[1]), "r2": ("mlp", PROMPTS[0]),
             "r3": ("", PROMPTS[1])}
    for rid, (lora, prompt) in cases.items():
        driver.add(rid, prompt, lora=lora)
    driver.step({"r0": None, "r1": 20, "r2": None, "r3": 9})
    driver.generate(list(cases), NUM_TOKENS)
    for rid, (lora, prompt) in cases.items():
        ref, logits = peft_reference(dirs["model"], dirs[lora] if lora else None, prompt,
                                     NUM_TOKENS)
        assert_greedy_equal(driver.seqs[rid].outputs, ref, logits)
        if lora:
            base, _ = peft_reference(dirs["model"], None, prompt, NUM_TOKENS)
            assert ref != base, f"adapter {lora} does not change this prompt's output"


def _drive_mixed(runner):
    """Four requests (three adapters, one base) prefilled together, then decode steps of
    4, 3, 2, 1 rows as they finish (base last: its steps follow steps with adapter rows);
    a fifth (an adapter's) arrives at the third step, its prompt beside the decodes."""
    driver = Driver(runner)
    cases = {"a": ("all", PROMPTS[0], 4), "q": ("qv", PROMPTS[1], 6), "m": ("mlp", PROMPTS[2], 8),
             "b": ("", PROMPTS[0], NUM_TOKENS), "late": ("qv", PROMPTS[0], 5)}
    for rid, (lora, prompt, _) in cases.items():
        if rid != "late":
            driver.add(rid, prompt, lora=lora)
    while live := [r for r, c in cases.items()
                   if r in driver.seqs and len(driver.seqs[r].outputs) < c[2]]:
        driver.step({r: None for r in live})
        if driver.step_id == 2:
            driver.add("late", cases["late"][1], lora=cases["late"][0])
    return driver, cases


def test_the_graphs_hold_the_adapters(dirs):
    """Decode graphs and graph pieces captured with the adapters (the CPU twins of CUDA
    graphs): every step replays one or the other (decode steps fed), adapter and base
    tokens together, padding rows and the steps after adapter rows included; token for
    token the eager runner's and PEFT's."""
    from pagedserve.executor.cuda_graphs import DecodeGraphs
    from pagedserve.executor.mixed_graphs import MixedGraphs

    eager, cases = _drive_mixed(_runner(dirs))
    runner = _runner(dirs)
    runner.graphs = DecodeGraphs(runner.model, runner.cache.kv_cache, runner.block_size,
                                 runner.max_model_len, 8, runner.loras)
    runner.graphs.capture()
    runner.mixed_graphs = MixedGraphs(runner.model, runner.cache.kv_cache, 128, runner.loras)
    runner.mixed_graphs.capture()
    graphed, _ = _drive_mixed(runner)
    assert runner.mixed_graph_steps == 2  # the first step's prompts, the late one's
    assert runner.graph_steps == runner.steps_done - 2 == sum(runner.graphs.fed)
    assert not runner.graphs.lora_slots.buffer.any()  # the base row's steps came last
    for rid, (lora, prompt, num_tokens) in cases.items():
        assert graphed.seqs[rid].outputs == eager.seqs[rid].outputs, rid
        ref, logits = peft_reference(dirs["model"], dirs[lora] if lora else None, prompt,
                                     num_tokens)
        assert_greedy_equal(graphed.seqs[rid].outputs, ref, logits)


def test_a_forked_sample_keeps_its_parents_adapter(dirs):
    runner = _runner(dirs, ("all",))
    driver = Driver(runner)
    driver.add("p", PROMPTS[0], lora="all")
    driver.step({"p": None})
    driver.fork("p", "c", sample_index=1)
    driver.generate(["p", "c"], NUM_TOKENS)
    ref, logits = peft_reference(dirs["model"], dirs["all"], PROMPTS[0], NUM_TOKENS)
    assert_greedy_equal(driver.seqs["c"].outputs, ref, logits)
    assert driver.seqs["c"].outputs == driver.seqs["p"].outputs


def test_an_adapter_saved_by_peft_itself(dirs, tmp_path):
    """What PEFT's own save_pretrained writes (its tensor names, a rank_pattern giving
    q_proj another rank, rsLoRA) reads back to PEFT's outputs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_pretrained(str(dirs["model"]), dtype=torch.float32)
    config = LoraConfig(r=6, lora_alpha=12, target_modules=["q_proj", "k_proj", "o_proj",
                                                            "up_proj"],
                        rank_pattern={"q_proj": 3}, use_rslora=True, init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # B drawn as large as A: a decisive change of the outputs
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.3)
    peft_model.save_pretrained(str(tmp_path / "saved"))
    adapter = read_adapter("saved", tmp_path / "saved", load_config(dirs["model"]))
    assert adapter.weights[(0, "q_proj")][0].shape[0] == 3
    assert adapter.weights[(0, "k_proj")][0].shape[0] == 6 and adapter.rank == 6
    runner = build_runner(str(dirs["model"]), num_gpu_blocks=64, num_cpu_blocks=0,
                          block_size=8, progress=False,
                          lora_modules=(("saved", str(tmp_path / "saved")),))
    driver = Driver(runner)
    driver.add("r", PROMPTS[1], lora="saved")
    driver.generate(["r"], NUM_TOKENS)
    ref, logits = peft_reference(dirs["model"], tmp_path / "saved", PROMPTS[1], NUM_TOKENS)
    assert_greedy_equal(driver.seqs["r"].outputs, ref, logits)


def test_a_request_naming_an_adapter_not_served_gets_an_error(dirs):
    runner = _runner(dirs, ("all",))
    driver = Driver(runner)
    driver.add("ok", PROMPTS[0], lora="all")
    driver.add("bad", PROMPTS[0], lora="nope")
    result = runner.execute(driver.plan({"ok": None, "bad": None}))
    assert [(e.request_id, e.message) for e in result.errors] == [
        ("bad", "unknown LoRA adapter 'nope'")]
    assert result.request_ids == ["ok"]


def test_rows_carry_the_adapter_slot():
    rows = RequestRows(capacity=1)
    a, b = rows.add(), rows.add()  # the second grows the columns
    rows.lora[a], rows.lora[b] = 2, 1
    child = rows.fork(b)
    assert rows.lora[[a, b, child]].tolist() == [2, 1, 1]
    rows.release(a)
    assert rows.lora[a] == 0 and rows.lora[rows.add()] == 0
    rows.clear()
    assert not rows.lora.any()


@pytest.mark.parametrize("slots", [[1, 0, 2, 3, 2], [0, 3, 3, 0, 1], [2, 0, 0, 0, 2]])
def test_the_batched_update_is_each_tokens_own(dirs, slots):
    """ProjectionLora.add_ against a per-token loop of scaling * B (A x): every adapter in
    the step, two of the three (a gather of their columns), one."""
    runner = _runner(dirs)
    loras = runner.loras
    qkv = runner.model.model.layers[1].self_attn.qkv_proj
    cfg = runner.model.config
    adapters = {name: read_adapter(name, dirs[name], cfg) for name in ("all", "qv", "mlp")}
    x = torch.randn(5, qkv.in_features)
    step = loras.step(np.array(slots))
    assert (step.cols is None) == (2 * len(set(slots) - {0}) > 3)
    got = qkv.lora.add_(torch.zeros(5, qkv.out_features), x, step)
    sizes = {"q_proj": cfg.num_heads * cfg.head_dim, "k_proj": cfg.num_kv_heads * cfg.head_dim,
             "v_proj": cfg.num_kv_heads * cfg.head_dim}
    for t, slot in enumerate(slots):
        want = torch.zeros(qkv.out_features)
        if slot:
            weights, offset = adapters[loras.names[slot - 1]].weights, 0
            for module, size in sizes.items():
                if (1, module) in weights:
                    a, b = weights[(1, module)]
                    want[offset:offset + size] = b @ (a @ x[t])
                offset += size
        torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-5)
    assert runner.model.model.layers[0].self_attn.qkv_proj.lora is not None  # "all"
    assert runner.model.model.layers[0].mlp.down_proj.lora is not None  # "all", "mlp"


def test_a_step_takes_only_its_adapters_columns(dirs):
    runner = _runner(dirs)
    loras = runner.loras
    r = loras.rank
    step = loras.step(np.array([0, 3, 0, 3]))  # adapter 3 of 3: renumbered 1
    assert step.cols.tolist() == [*range(2 * r, 3 * r)] and step.active == (3,)
    assert step.mask.shape == (4, r) and step.mask.sum(1).tolist() == [0, r, 0, r]
    # more than half of them in use: all taken, no gather
    every = loras.step(np.array([2, 1, 0]))
    assert every.cols is None and every.mask.shape == (3, 3 * r)
    assert every.mask[0, r:2 * r].all() and every.mask[1, :r].all()
    assert every.mask.sum().item() == 2 * r
    # a projection gathers a set's rows once while the set stays (a steady decode)
    lora = runner.model.model.layers[0].mlp.down_proj.lora
    x = torch.randn(4, lora.a.shape[-1])
    y = torch.zeros(4, runner.model.config.hidden_size)
    lora.add_(y, x, step)
    first = lora._gathered
    lora.add_(y, x, loras.step(np.array([3, 3, 0, 0])))
    assert lora._gathered is first and first[0] == (3,)
    lora.add_(y, x, loras.step(np.array([2, 0, 0, 0])))
    assert lora._gathered[0] == (2,) and lora._gathered[1].shape[1] == r


# ------------------------------------------------------------------------------- refused

def _edited_copy(src, dst, config_edit=None, tensors_edit=None):
    shutil.copytree(src, dst)
    if config_edit:
        config = json.loads((dst / "adapter_config.json").read_text())
        config.update(config_edit)
        (dst / "adapter_config.json").write_text(json.dumps(config))
    if tensors_edit:
        tensors = load_file(str(dst / "adapter_model.safetensors"))
        tensors_edit(tensors)
        save_file(tensors, str(dst / "adapter_model.safetensors"))
    return dst


_PREFIX = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("config_edit, tensors_edit, message", [
    ({"use_dora": True}, None, "DoRA (use_dora) is not supported"),
    ({"bias": "all"}, None, "trained biases (bias='all')"),
    ({"modules_to_save": ["lm_head"]}, None, "modules_to_save ['lm_head'] (whole modules)"),
    ({"alpha_pattern": {"q_proj": 4}}, None, "alpha_pattern is not supported"),
    ({"fan_in_fan_out": True}, None, "fan_in_fan_out"),
    ({"peft_type": "IA3"}, None, "peft_type 'IA3' (only LORA)"),
    ({"lora_alpha": 0}, None, "lora_alpha must be a positive number"),
    (None, lambda t: t.update({"base_model.model.model.embed_tokens.lora_embedding_A":
                               torch.zeros(8, 4)}), "is not a LoRA A or B of a projection"),
    (None, lambda t: t.update({f"{_PREFIX}.lora_A.weight": torch.zeros(8, 7)}),
     "layer 0 q_proj: A (8, 7) and B (160, 8), where [r, 160] and [160, r] expected"),
    (None, lambda t: t.pop(f"{_PREFIX}.lora_B.weight"), "lora_A without lora_B"),
    (None, lambda t: t.pop(f"{_PREFIX}.lora_A.weight"), "lora_B without lora_A"),
    (None, lambda t: t.update({"base_model.model.model.layers.9.mlp.up_proj.lora_A.weight":
                               torch.zeros(8, 160)}), "names layer 9; the model has 2"),
])
def test_what_cannot_be_served_exactly_is_refused(dirs, tmp_path, config_edit, tensors_edit,
                                                 message):
    path = _edited_copy(dirs["all"], tmp_path / "edited", config_edit, tensors_edit)
    with pytest.raises(LoraError, match="^LoRA adapter x: .*" + re.escape(message)):
        read_adapter("x", path, load_config(dirs["model"]))


def test_missing_or_pickled_weights_are_refused(dirs, tmp_path):
    cfg = load_config(dirs["model"])
    with pytest.raises(LoraError, match="is not a directory"):
        read_adapter("x", tmp_path / "nowhere", cfg)
    path = _edited_copy(dirs["all"], tmp_path / "bin")
    (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
    with pytest.raises(LoraError, match="adapter_model.bin is pickled"):
        read_adapter("x", path, cfg)
    (path / "adapter_config.json").unlink()
    with pytest.raises(LoraError, match="has no adapter_config.json"):
        read_adapter("x", path, cfg)


def test_the_executor_refuses_a_bad_adapter_in_one_line(dirs, tmp_path):
    import subprocess
    import sys

    bad = _edited_copy(dirs["all"], tmp_path / "dora", {"use_dora": True})
    proc = subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", "executor", "--model", str(dirs["model"]),
         "--router", "tcp://127.0.0.1:1", "--lora-modules", f"ok={dirs['all']}", f"d={bad}"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "pagedserve executor: LoRA adapter d: DoRA (use_dora) is not supported")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_adapters_on_a_gpu_in_the_decode_graphs(dirs):
    """On a GPU (float32, decode graphs and graph pieces captured as `serve` runs them,
    with the adapters): every step of adapter and base tokens a replay of one or the
    other, the base row's steps after the adapters' too; each request's tokens are
    transformers + PEFT's."""
    runner = build_runner(str(dirs["model"]), device="cuda", dtype="float32",
                          num_gpu_blocks=96, num_cpu_blocks=0, block_size=8, progress=False,
                          max_num_seqs=8,
                          lora_modules=tuple((n, str(dirs[n])) for n in ("all", "qv", "mlp")))
    assert runner.graphs.loras is runner.loras is runner.mixed_graphs.loras
    graphed, cases = _drive_mixed(runner)
    assert runner.graph_steps + runner.mixed_graph_steps == runner.steps_done
    for rid, (lora, prompt, num_tokens) in cases.items():
        ref, logits = peft_reference(dirs["model"], dirs[lora] if lora else None, prompt,
                                     num_tokens)
        assert_greedy_equal(graphed.seqs[rid].outputs, ref, logits)
