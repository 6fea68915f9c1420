"""LoRA adapters loaded and unloaded while an executor serves (``--max-loras``; the plans'
``lora_ops``, executor/lora_ops.py): an adapter loaded into a slot computes what
transformers + PEFT computes with it, a slot freed and loaded again serves the new adapter
(never the old one's rows), captured graphs see a load made after their capture, and every
load that cannot be served fails alone with its reason while the step runs on."""

from __future__ import annotations

import json

import pytest
import torch
from pagedserve.executor.runner_setup import build_runner
from pagedserve.protos.wire import LoraOp
from safetensors.torch import load_file, save_file
from test_executor_support import Driver, assert_greedy_equal
from test_lora import dirs, peft_reference  # noqa: F401 (the module's adapters)
from test_models import NUM_TOKENS, PROMPTS

pytest.importorskip("peft")


def _runner(dirs, static=("qv",), max_loras=3, rank=16):  # noqa: F811
    return build_runner(str(dirs["model"]), num_gpu_blocks=96, num_cpu_blocks=0, block_size=8,
                        progress=False, max_loras=max_loras, max_lora_rank=rank,
                        lora_modules=tuple((n, str(dirs[n])) for n in static))


def _ops(driver: Driver, *ops: LoraOp) -> list[tuple[str, str]]:
    """Run a plan carrying only ``ops``; the failed loads as (name, message)."""
    result = driver.runner.execute(driver.plan({}, lora_ops=list(ops)))
    assert not result.errors and not result.request_ids
    return [(f.name, f.message) for f in result.lora_failed]


def load(name, path) -> LoraOp:
    return LoraOp(name=name, load=True, path=str(path))


def unload(name) -> LoraOp:
    return LoraOp(name=name, load=False)


def _check(driver, dirs, cases):  # noqa: F811
    """Run ``cases`` (id -> (adapter, prompt)) to NUM_TOKENS; each equals PEFT's."""
    for rid, (lora, prompt) in cases.items():
        driver.add(rid, prompt, lora=lora)
    driver.generate(list(cases), NUM_TOKENS)
    for rid, (lora, prompt) in cases.items():
        ref, logits = peft_reference(dirs["model"], dirs[lora] if lora else None, prompt,
                                     NUM_TOKENS)
        assert_greedy_equal(driver.seqs[rid].outputs, ref, logits)


def test_adapters_loaded_while_serving_equal_peft(dirs):  # noqa: F811
    """A static adapter in slot 1, two loaded by a plan into slots 2 and 3: requests of all
    three and of the base model in one batch each run their own adapter."""
    runner = _runner(dirs)
    assert runner.loras.names == ["qv", "", ""]
    driver = Driver(runner)
    assert _ops(driver, load("all", dirs["all"]), load("mlp", dirs["mlp"])) == []
    assert runner.loras.names == ["qv", "all", "mlp"]
    assert runner.limits.lora_names == {"qv", "all", "mlp"}
    _check(driver, dirs, {"a": ("all", PROMPTS[0]), "m": ("mlp", PROMPTS[1]),
                          "q": ("qv", PROMPTS[0]), "b": ("", PROMPTS[1])})


def test_a_slot_unloaded_and_loaded_again_serves_the_new_adapter(dirs):  # noqa: F811
    """'all' decodes in slot 2 (the CPU keeps its gathered rows between steps); unloaded
    and 'mlp' loaded in the same plan takes slot 2: its requests get mlp's tokens, not the
    rows gathered for 'all'; a request still naming 'all' is refused."""
    runner = _runner(dirs)
    driver = Driver(runner)
    _ops(driver, load("all", dirs["all"]))
    _check(driver, dirs, {"a": ("all", PROMPTS[0])})
    assert _ops(driver, unload("all"), load("mlp", dirs["mlp"])) == []
    assert runner.loras.names == ["qv", "mlp", ""]
    _check(driver, dirs, {"m": ("mlp", PROMPTS[0])})
    driver.add("late", PROMPTS[1], lora="all")
    result = runner.execute(driver.plan({"late": None}))
    assert [(e.request_id, e.message) for e in result.errors] == [
        ("late", "unknown LoRA adapter 'all'")]


def test_the_graphs_see_a_load_made_after_their_capture(dirs):  # noqa: F811
    """Decode graphs captured over three empty slots (the CPU twin of CUDA graphs): an
    adapter loaded afterwards is what their replays compute, beside the base model."""
    from pagedserve.executor.cuda_graphs import DecodeGraphs

    runner = _runner(dirs, static=())
    runner.graphs = DecodeGraphs(runner.model, runner.cache.kv_cache, runner.block_size,
                                 runner.max_model_len, 8, runner.loras)
    runner.graphs.capture()
    driver = Driver(runner)
    _ops(driver, load("all", dirs["all"]))
    _check(driver, dirs, {"a": ("all", PROMPTS[0]), "b": ("", PROMPTS[1])})
    assert runner.graph_steps == NUM_TOKENS - 1


def _copy_with(src, dst, config=None, tensor_edit=None):
    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, **(config or {})}))
    tensors = load_file(str(src / "adapter_model.safetensors"))
    if tensor_edit is not None:
        tensor_edit(tensors)
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    return dst


def test_loads_that_cannot_be_served_fail_alone(dirs, tmp_path):  # noqa: F811
    """Each failing load is named with its reason, changes nothing, and the plan's other
    ops take effect: no directory, DoRA, weights with a NaN, a rank over the slots', a
    name loaded already, no free slot; an unload of a name not held is a no-op; the
    static adapter stays."""
    runner = _runner(dirs, rank=8)  # "mlp" is rank 16

    def nan(tensors):
        key = next(k for k in tensors if "lora_B" in k)
        tensors[key][0, 0] = float("nan")

    dora = _copy_with(dirs["all"], tmp_path / "dora", config={"use_dora": True})
    bad = _copy_with(dirs["all"], tmp_path / "nan", tensor_edit=nan)
    driver = Driver(runner)
    failed = _ops(driver, load("gone", tmp_path / "missing"), load("dora", dora),
                  load("nan", bad), load("mlp", dirs["mlp"]), load("all", dirs["all"]),
                  load("all", dirs["all"]), unload("never"), unload("qv"))
    assert [name for name, _ in failed] == ["gone", "dora", "nan", "mlp", "all"]
    messages = dict(failed[:4])
    assert messages["gone"] == f"LoRA adapter gone: {tmp_path / 'missing'} is not a directory"
    assert messages["dora"] == "LoRA adapter dora: DoRA (use_dora) is not supported"
    assert "the weights are not all finite" in messages["nan"]
    assert messages["mlp"] == "LoRA adapter mlp: rank 16 is over --max-lora-rank 8"
    assert failed[4][1] == "LoRA adapter all is loaded already"
    assert runner.loras.names == ["qv", "all", ""]
    _ops(driver, load("all2", dirs["all"]))
    assert _ops(driver, load("qv2", dirs["qv"])) == [
        ("qv2", "LoRA adapter qv2: all 3 slots (--max-loras) are in use")]
    runner.reset()  # a new registration: the loaded adapters go, --lora-modules stays
    assert runner.loras.names == ["qv", "", ""]
    assert runner.limits.lora_names == {"qv"}


def test_an_executor_without_slots_refuses_loads(dirs):  # noqa: F811
    runner = build_runner(str(dirs["model"]), num_gpu_blocks=32, num_cpu_blocks=0,
                          block_size=8, progress=False, lora_modules=(("qv", str(dirs["qv"])),))
    assert _ops(Driver(runner), load("all", dirs["all"])) == [
        ("all", "runtime LoRA loading is off on this executor (start it with --max-loras N)")]
    runner = build_runner(str(dirs["model"]), num_gpu_blocks=32, num_cpu_blocks=0,
                          block_size=8, progress=False)
    assert runner.loras is None
    assert _ops(Driver(runner), load("all", dirs["all"]))[0][0] == "all"


def test_freed_slots_are_zero(dirs):  # noqa: F811
    """An unloaded slot's rows are zero on every projection (a replay multiplies them by a
    zero mask: a NaN left there would reach every token)."""
    runner = _runner(dirs, static=())
    driver = Driver(runner)
    _ops(driver, load("all", dirs["all"]), unload("all"))
    for _, update, _ in runner.loras._installed:
        assert not update.a.any() and not any(bt.any() for _, _, bt in update.shards)
    with pytest.raises(ValueError, match="at least one adapter or slot"):
        type(runner.loras)([], runner.model)
    assert torch.equal(runner.loras.owner, torch.arange(1, 4).repeat_interleave(16))


def test_a_reload_copies_from_host_memory_until_the_files_change(dirs, tmp_path,  # noqa: F811
                                                                 monkeypatch):
    """--max-cpu-loras (default --max-loras): an adapter loaded again, under its name or
    another, is copied from what was read before (its output still PEFT's); once its files
    change it is read again; the cache keeps the most recently used."""
    import shutil

    import pagedserve.executor.models.lora as lora
    reads = []
    real = lora.read_adapter
    monkeypatch.setattr(lora, "read_adapter", lambda *a: reads.append(a[0]) or real(*a))
    runner = _runner(dirs, static=(), max_loras=2)
    copy = shutil.copytree(dirs["all"], tmp_path / "all")
    driver = Driver(runner)
    assert _ops(driver, load("a", copy), unload("a"), load("b", copy)) == []
    assert reads == ["a"]
    driver.add("r", PROMPTS[0], lora="b")
    driver.generate(["r"], NUM_TOKENS)
    ref, logits = peft_reference(dirs["model"], dirs["all"], PROMPTS[0], NUM_TOKENS)
    assert_greedy_equal(driver.seqs["r"].outputs, ref, logits)
    config = copy / "adapter_config.json"
    config.write_text(config.read_text() + "\n")  # the files changed: read again
    assert _ops(driver, unload("b"), load("c", copy)) == [] and reads == ["a", "c"]
    for name in ("mlp", "qv"):  # two more directories: the first one leaves the cache
        _ops(driver, unload("c"), load(name, dirs[name]), unload(name))
    assert list(runner.loras.cache.entries) == [str(dirs["mlp"]), str(dirs["qv"])]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_slots_loaded_after_capture_on_a_gpu(dirs):  # noqa: F811
    """On a GPU (float32, decode graphs and graph pieces captured at start over three
    slots, one holding a --lora-modules adapter): adapters loaded afterwards, and a slot
    rewritten with other weights under the same name, are what the replays compute."""
    runner = build_runner(str(dirs["model"]), device="cuda", dtype="float32",
                          num_gpu_blocks=96, num_cpu_blocks=0, block_size=8, progress=False,
                          max_num_seqs=8, max_loras=3, max_lora_rank=16,
                          lora_modules=(("qv", str(dirs["qv"])),))
    assert runner.graphs.loras is runner.loras is runner.mixed_graphs.loras
    driver = Driver(runner)
    assert _ops(driver, load("all", dirs["all"]), load("mlp", dirs["mlp"])) == []
    _check(driver, dirs, {"a": ("all", PROMPTS[0]), "m": ("mlp", PROMPTS[1]),
                          "q": ("qv", PROMPTS[0]), "b": ("", PROMPTS[1])})
    assert runner.graph_steps > 0
    assert _ops(driver, unload("mlp"), load("mlp", dirs["all"])) == []  # other weights
    driver.add("again", PROMPTS[1], lora="mlp")
    driver.generate(["again"], NUM_TOKENS)
    ref, logits = peft_reference(dirs["model"], dirs["all"], PROMPTS[1], NUM_TOKENS)
    assert_greedy_equal(driver.seqs["again"].outputs, ref, logits)
