"""A CPU executor's 16-bit projections in oneDNN's packed layout (executor/packed_weights.py):
bit for bit what torch's linear computes -- sampled tokens, logprobs, prompt scores and
embeddings through prefill chunks and decodes, tied and untied heads, with adapters and
after a weight update -- with each projection's plain storage given back; and refused,
with its reason, where it cannot apply."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from pagedserve.executor import packed_weights
from pagedserve.executor.packed_weights import (
    PACKED_WEIGHTS_ENV,
    PADDED_ROWS_MAX,
    ROW_PADDING_ENV,
    choose_row_padding,
    packing_refused,
)
from pagedserve.executor.runner_setup import build_runner
from pagedserve.kernels import ops
from pagedserve.protos.wire import LoraOp, SamplingParams, WeightOp
from test_executor_support import Driver
from test_models import PROMPTS

from pagedserve.tinymodels import build_lora_adapter, build_model

REFUSED = packing_refused(torch.bfloat16, torch.device("cpu"))
needs_packing = pytest.mark.skipif(bool(REFUSED), reason=f"this CPU: {REFUSED}")
SCORED = SamplingParams(temperature=0.0, logprobs=3, prompt_logprobs=2)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, logprobs=2)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed")
    return {"llama-tied": build_model(root / "tied", tie_word_embeddings=True),
            "qwen2": build_model(root / "qwen2", "qwen2", seed=3),  # q/k/v biases, own head
            "qwen2-new": build_model(root / "qwen2-new", "qwen2", seed=4)}


def _runner(model_dir, monkeypatch, packed: bool, **kw):
    monkeypatch.setenv(PACKED_WEIGHTS_ENV, "1" if packed else "0")
    return build_runner(str(model_dir), dtype="bfloat16", num_gpu_blocks=96, num_cpu_blocks=0,
                        block_size=8, progress=False, **kw)


def _serve(runner, lora: str = "", tag: str = "") -> list:
    """Three requests (a scored greedy one, a seeded one, one chunked) to 10 tokens each,
    their ids ``tag`` + r0..r2; every step's results."""
    driver = Driver(runner)
    for i, prompt in enumerate(PROMPTS):
        driver.add(f"{tag}r{i}", prompt, sampling=SCORED if i != 1 else SEEDED, lora=lora)
    results = [driver.step({f"{tag}r0": None, f"{tag}r1": 20,  # r1's prompt in two chunks
                            f"{tag}r2": None})]
    while any(len(s.outputs) < 10 for s in driver.seqs.values()):
        results.append(driver.step({r: None for r, s in driver.seqs.items()
                                    if len(s.outputs) < 10}))
    return results


def _arrays(results) -> list:
    return [([i[-2:] for i in r.request_ids], *(getattr(r, f) for f in (
        "token_ids", "logprobs", "top_token_ids", "top_logprobs", "prompt_logprobs",
        "prompt_top_token_ids", "prompt_top_logprobs"))) for r in results]


def _assert_bitwise_equal(a, b) -> None:
    assert len(a) == len(b)
    for step_a, step_b in zip(_arrays(a), _arrays(b), strict=True):
        for x, y in zip(step_a, step_b, strict=True):
            if isinstance(x, np.ndarray):
                assert np.array_equal(x, y), (x, y)  # float32 logprobs: exact
            else:
                assert x == y


def test_refused_where_it_cannot_apply(monkeypatch):
    assert "16-bit" in packing_refused(torch.float32, torch.device("cpu"))
    assert packing_refused(torch.bfloat16, torch.device("cuda", 0)) == "not a CPU"
    monkeypatch.setenv(PACKED_WEIGHTS_ENV, "0")
    assert packing_refused(torch.bfloat16, torch.device("cpu")) == f"{PACKED_WEIGHTS_ENV}=0"


@needs_packing
@pytest.mark.parametrize("name,padding", [("llama-tied", None), ("qwen2", None),
                                          ("qwen2", "all")])
def test_packed_projections_compute_torchs_linear_bit_for_bit(dirs, monkeypatch, name,
                                                              padding):
    """Every result array equal to the unpacked runner's, and no projection keeps its plain
    storage (a tied head is packed beside the embedding, which the lookup reads). "all":
    every row count below PADDED_ROWS_MAX padded to it (the decodes, the head's rows)."""
    plain = _serve(_runner(dirs[name], monkeypatch, packed=False))
    runner = _runner(dirs[name], monkeypatch, packed=True)
    monkeypatch.setattr(ops, "PACKED_ROW_PADDING", {} if padding is None else {
        rows: PADDED_ROWS_MAX for rows in range(1, PADDED_ROWS_MAX)})
    model = runner.model
    projections = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(projections) == 4 * 2 + (name == "qwen2")  # the untied head is one of them
    for linear in projections:
        assert linear.packed.is_mkldnn and linear.weight.stride() == (0, 0)
        assert linear.weight.untyped_storage().nbytes() <= 2
    assert model.packed_head is not None and model.packed_head.is_mkldnn
    assert model.model.embed_tokens.weight.stride() == (model.config.hidden_size, 1)
    packed = _serve(runner)
    _assert_bitwise_equal(plain, packed)
    assert any(r.prompt_logprobs is not None for r in packed)  # prompt scores were compared


@needs_packing
def test_unpacked_matrices_are_the_loaded_ones(dirs, monkeypatch):
    """`unpack_projections` gives back every matrix bit for bit; packing again serves the
    same results."""
    plain = _runner(dirs["qwen2"], monkeypatch, packed=False).model
    runner = _runner(dirs["qwen2"], monkeypatch, packed=True)
    before = _serve(runner)
    packed_weights.unpack_projections(runner.model)
    assert not packed_weights.is_packed(runner.model)
    for (name, p), (_, q) in zip(plain.named_parameters(), runner.model.named_parameters(),
                                 strict=True):
        assert torch.equal(p, q), name
    packed_weights.pack_projections(runner.model)
    _assert_bitwise_equal(before, _serve(runner, tag="again-"))


@needs_packing
def test_a_weight_update_repacks_the_new_weights(dirs, monkeypatch):
    """A check leaves the packed model as it is; a load serves exactly what a runner built
    on the new checkpoint serves, packed again."""
    runner = _runner(dirs["qwen2"], monkeypatch, packed=True)
    driver = Driver(runner)

    def op(load: bool) -> str:
        return runner.execute(driver.plan({}, weight_op=WeightOp(
            path=str(dirs["qwen2-new"]), load=load))).weight_failed

    assert op(load=False) == "" and packed_weights.is_packed(runner.model)
    assert op(load=True) == "" and packed_weights.is_packed(runner.model)
    assert all(m.weight.stride() == (0, 0) for m in runner.model.modules()
               if isinstance(m, torch.nn.Linear))
    fresh = _serve(_runner(dirs["qwen2-new"], monkeypatch, packed=False))
    _assert_bitwise_equal(fresh, _serve(runner))


@needs_packing
def test_adapters_add_onto_the_packed_projections(dirs, tmp_path, monkeypatch):
    """A LoRA adapter's update is added to the packed product exactly as to torch's, its
    rows padded too."""
    adapter = build_lora_adapter(dirs["qwen2"], tmp_path / "adapter", rank=8, seed=1)
    results = []
    for packed in (False, True):
        runner = _runner(dirs["qwen2"], monkeypatch, packed=packed, max_loras=1,
                         max_lora_rank=8)
        if packed:  # every decode's rows padded (the update added to a view of the product)
            monkeypatch.setattr(ops, "PACKED_ROW_PADDING", {
                rows: PADDED_ROWS_MAX for rows in range(1, PADDED_ROWS_MAX)})
        result = runner.execute(Driver(runner).plan({}, lora_ops=[
            LoraOp(name="a", load=True, path=str(adapter))]))
        assert not result.lora_failed
        results.append(_serve(runner, lora="a"))
    _assert_bitwise_equal(*results)


def test_a_refusal_leaves_torchs_linear_and_says_why(dirs, monkeypatch, caplog):
    """oneDNN failing its start-up check (here: the reorder raising) leaves every
    projection plain, named in the log; the runner serves."""
    def refuse(weight):
        raise RuntimeError("mkldnn_reorder_linear_weight: no such support\nmore")

    monkeypatch.setattr(packed_weights, "pack", refuse)
    with caplog.at_level(logging.INFO, logger="pagedserve.executor"):
        runner = _runner(dirs["qwen2"], monkeypatch, packed=True)
    assert "projections run by torch's linear: oneDNN refused: mkldnn_reorder_linear_weight: " \
           "no such support" in caplog.text
    assert not packed_weights.is_packed(runner.model)
    assert all(m.packed is None and m.weight.stride()[1] == 1 for m in runner.model.modules()
               if isinstance(m, torch.nn.Linear))
    assert len(_serve(runner)) > 1


def test_row_padding_goes_to_the_fewest_rows_near_the_fastest_larger_count():
    """A count is padded where the fastest larger count takes at most 90% of its time, to
    the fewest rows within 3% of that fastest, if the rows come out alike; the largest
    count is never padded. (Times: one pass over the built-in model's projections on this
    VM, ms.)"""
    times = {1: 16.3, 2: 18.4, 3: 15.0, 4: 14.0, 5: 15.2, 6: 14.3, 7: 16.7, 8: 18.0}
    assert choose_row_padding(times, lambda rows, to: True) == {1: 4, 2: 4}
    assert choose_row_padding(times, lambda rows, to: (rows, to) != (2, 4)) == {1: 4}
    assert choose_row_padding({1: 10.0, 2: 9.6, 3: 9.0}, lambda rows, to: True) == {1: 3}
    assert choose_row_padding({1: 10.0, 2: 8.8, 3: 8.6}, lambda rows, to: True) == {1: 2}
    assert choose_row_padding({1: 10.0, 2: 9.2}, lambda rows, to: True) == {}
    assert choose_row_padding({1: 10.0, 2: 12.0}, lambda rows, to: True) == {}
    assert choose_row_padding({}, lambda rows, to: True) == {}


@needs_packing
def test_padded_rows_are_torchs_linear_bit_for_bit(monkeypatch):
    """`ops.linear` on a packed weight at every padded row count: the first rows of the
    padded product, torch's linear's values (with a bias), contiguous, whatever the
    padding rows hold."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(67, 45, generator=gen).bfloat16()
    bias = torch.randn(67, generator=gen).bfloat16()
    packed = packed_weights.pack(weight)
    x = torch.randn(PADDED_ROWS_MAX, 45, generator=gen).bfloat16()
    monkeypatch.setattr(ops, "PACKED_ROW_PADDING", {1: 4, 3: 4, 2: 8, 5: 8, 6: 7})
    with torch.inference_mode():  # (the executor's mode) the scratch made there serves
        ops.linear(x[:1], weight, bias, packed=packed)  # calls outside it too
    # down and up: counts padded to one size share its scratch rows, which then hold an
    # earlier call's rows where the padding goes
    for rows in [*range(PADDED_ROWS_MAX, 0, -1), *range(1, PADDED_ROWS_MAX + 1)]:
        y = ops.linear(x[:rows], weight, bias, packed=packed)
        assert y.shape == (rows, 67) and y.is_contiguous()
        assert torch.equal(y, torch.nn.functional.linear(x[:rows], weight, bias)), rows


@needs_packing
def test_row_padding_is_timed_at_start_and_can_be_turned_off(dirs, monkeypatch, caplog):
    """At start the packed runner times its projections and pads row counts to larger ones
    (whatever this VM's timings chose: a table of counts up to PADDED_ROWS_MAX, named in the
    log); PAGEDSERVE_CPU_ROW_PADDING=0 pads nothing."""
    monkeypatch.setattr(ops, "PACKED_ROW_PADDING", {7: 8})
    with caplog.at_level(logging.INFO, logger="pagedserve.executor"):
        _runner(dirs["qwen2"], monkeypatch, packed=True)
    table = dict(ops.PACKED_ROW_PADDING)
    assert all(1 <= rows < to <= PADDED_ROWS_MAX for rows, to in table.items())
    named = ", ".join(f"{rows} -> {to}" for rows, to in table.items()) or "none faster"
    assert f"; rows padded: {named}" in caplog.text
    caplog.clear()
    monkeypatch.setenv(ROW_PADDING_ENV, "0")
    with caplog.at_level(logging.INFO, logger="pagedserve.executor"):
        _runner(dirs["qwen2"], monkeypatch, packed=True)
    assert ops.PACKED_ROW_PADDING == {}
    assert "; rows padded: off" in caplog.text
