"""Steps with prompt tokens through graph pieces cut at the attention calls
(executor/mixed_graphs.py) against the same steps run eagerly: the token buckets, the cut
(every layer's attention eager between pieces), the padding rows (no cache write), which
steps use them. On a CPU the pieces are the module's twin (functions of the static buffers);
the `gpu` tests capture real CUDA graphs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pagedserve.executor.mixed_graphs import (
    MAX_MIXED_TOKENS,
    MixedGraphs,
    mixed_graph_memory_bytes,
    mixed_token_buckets,
)
from pagedserve.protos.wire import SamplingParams
from test_executor_support import Driver, assert_as_eager_and_padding_clean, small_runner

from pagedserve.tinymodels import build_model

PROMPTS = {
    "a": [0, 17, 250, 33, 9, 480, 77, 5, 61, 300, 12],
    "b": [0, 400, 3, 3, 3],
    "c": [0, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
    "d": [0, 99],
    "e": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22],
}
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=7)


def test_mixed_token_buckets():
    assert mixed_token_buckets(1) == []
    assert mixed_token_buckets(16) == [16]
    assert mixed_token_buckets(40) == [16, 32, 40]
    assert mixed_token_buckets(8192) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert mixed_token_buckets(1000) == [16, 32, 64, 128, 256, 512, 1000]
    assert mixed_token_buckets(8192)[-1] == MAX_MIXED_TOKENS
    assert mixed_graph_memory_bytes(None, 16, 64, torch.device("cpu")) == 0


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("mixed") / request.param, request.param,
                       initializer_range=0.2)



def _with_twin_pieces(runner, max_tokens=32):
    runner.mixed_graphs = MixedGraphs(runner.model, runner.cache.kv_cache, max_tokens)
    runner.mixed_graphs.capture()
    return runner


def _drive(runner, sampling=None):
    """Chunked prefill and decodes mixed as a server mixes them: a, b and part of c (27
    tokens: the 32 bucket); the rest of c with a and b decoding (8 tokens: 16); d and e
    join while the others decode (28: 32); then decodes only; f and g join with a decode
    (43 tokens, over the largest bucket: eager); decodes."""
    d = Driver(runner)
    for rid in "abc":
        d.add(rid, PROMPTS[rid], **({"sampling": sampling} if sampling else {}))
    d.step({"a": None, "b": None, "c": 11})
    d.step({"a": None, "b": None, "c": None})
    for rid in "de":
        d.add(rid, PROMPTS[rid], **({"sampling": sampling} if sampling else {}))
    d.step({"a": None, "b": None, "c": None, "d": None, "e": None})
    for _ in range(3):
        d.step({r: None for r in "abcde"})
    for rid, prompt in (("f", PROMPTS["e"] + [1] * 17), ("g", PROMPTS["d"])):
        d.add(rid, prompt, **({"sampling": sampling} if sampling else {}))
    d.step({"f": None, "g": None, "a": None})
    d.step({r: None for r in "abcdefg"})
    return d


@pytest.mark.parametrize("sampling", [None, SEEDED], ids=["greedy", "seeded"])
def test_twin_pieces_equal_eager_and_write_only_real_slots(model_dir, sampling):
    eager = _drive(small_runner(model_dir), sampling)
    pieces = _drive(_with_twin_pieces(small_runner(model_dir)), sampling)
    assert assert_as_eager_and_padding_clean(pieces, eager)  # some block stays unused
    runner = pieces.runner
    # every step but the 43-token one (over the largest bucket): decodes too, with no
    # decode graphs here
    assert runner.mixed_graph_steps == 7 and runner.steps_done == 8
    torch.testing.assert_close(runner.cache.kv_cache, eager.runner.cache.kv_cache,
                               atol=1e-4, rtol=1e-3)


def test_pieces_run_attention_between_them_on_the_real_tokens(model_dir):
    """One attention call per layer, on the step's tokens only (never the padding rows),
    with the step's own metadata; the padding rows of a shorter step go back to slot -1."""
    runner = _with_twin_pieces(small_runner(model_dir))
    graphs = runner.mixed_graphs
    calls = []
    for layer in graphs.layers:
        attend = layer.self_attn.attend

        def spy(q, kv_cache, attn, out=None, attend=attend):
            calls.append((q.shape[0], attn.max_query_len))
            return attend(q, kv_cache, attn, out=out)

        layer.self_attn.attend = spy
    d = Driver(runner)
    d.add("c", PROMPTS["c"])
    d.add("b", PROMPTS["b"])
    d.step({"c": None, "b": None})  # 22 tokens in the 32 bucket
    assert calls == [(22, 17)] * len(graphs.layers)
    assert graphs.slot_mapping[21].item() >= 0 and graphs.slot_mapping[22].item() == -1
    d.add("d", PROMPTS["d"])
    calls.clear()
    d.step({"d": None, "b": None})  # 3 tokens: the 16 bucket
    assert calls == [(3, 2)] * len(graphs.layers)
    assert (graphs.slot_mapping[3:16] == -1).all()  # the bucket's rows; beyond: not read
    assert graphs.size_for(3) == 16 and graphs.size_for(33) is None


def test_decode_steps_go_to_the_decode_graphs_first(model_dir):
    """A decode-only step replays a decode graph where one holds it, else the pieces."""
    from pagedserve.executor.cuda_graphs import DecodeGraphs

    runner = _with_twin_pieces(small_runner(model_dir))
    d = Driver(runner)
    for rid in "abd":
        d.add(rid, PROMPTS[rid])
    d.step({r: None for r in "abd"})  # 18 prompt tokens
    d.step({r: None for r in "abd"})
    assert runner.mixed_graph_steps == 2 and runner.graph_steps == 0
    runner.graphs = DecodeGraphs(runner.model, runner.cache.kv_cache, runner.block_size,
                                 runner.max_model_len, 2)
    runner.graphs.capture()
    d.step({r: None for r in "abd"})  # 3 rows: more than the decode graphs hold
    d.step({r: None for r in "ab"})
    assert runner.mixed_graph_steps == 3 and runner.graph_steps == 1


# ------------------------------------------------------------------------------ CUDA
@pytest.mark.gpu
def test_cuda_pieces_equal_eager(model_dir):
    """fp32 on the GPU: the same greedy tokens with the pieces captured by build_runner as
    with --enforce-eager; the mixed steps replayed pieces; padding wrote no block."""
    eager = _drive(small_runner(model_dir, "cuda", dtype="float32", enforce_eager=True))
    assert eager.runner.mixed_graphs is None
    runner = small_runner(model_dir, "cuda", dtype="float32", max_num_seqs=8,
                          max_num_batched_tokens=32)
    assert runner.mixed_graphs is not None and runner.mixed_graphs.sizes == [16, 32]
    graphed = _drive(runner)
    assert_as_eager_and_padding_clean(graphed, eager)
    assert runner.mixed_graph_steps == 3


@pytest.mark.gpu
def test_cuda_pieces_memory_is_reserved_before_the_cache(model_dir, gpu_memory_alone):
    model = small_runner(model_dir, "cuda", dtype="float32", enforce_eager=True).model
    assert mixed_graph_memory_bytes(model, 8, 64, torch.device("cuda", 0)) > 0
    profiled = small_runner(model_dir, "cuda", dtype="float32", num_gpu_blocks=None,
                            gpu_memory_utilization=0.25)
    assert profiled.mixed_graphs is not None and profiled.cache.num_gpu_blocks > 0


def test_capture_failure_leaves_those_steps_eager(model_dir, monkeypatch, caplog):
    """runner_setup's capture: the pieces when it works, None (logged) when it fails."""
    from pagedserve.executor import runner_setup

    runner = small_runner(model_dir)
    graphs = runner_setup._capture_mixed_graphs(runner.model, runner.cache, 32)
    assert graphs is not None and graphs.sizes == [16, 32] and graphs.size_for(20) == 32

    def broken(self, sizes=None):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(MixedGraphs, "capture", broken)
    assert runner_setup._capture_mixed_graphs(runner.model, runner.cache, 32) is None
    assert "those steps eager: capture failed: RuntimeError" in caplog.text
    monkeypatch.setenv("PAGEDSERVE_MIXED_GRAPHS", "0")
    assert not runner_setup._mixed_graphs_wanted()


def test_overlapped_steps_through_the_pieces_give_the_depth_1_results(tmp_path):
    """The executor's overlapped loop (a step left in flight, the next plan's marked decodes
    fed from its tokens on the device, then launched) with every step in the pieces —
    prompt chunks among fed decodes — gives the eager depth-1 results, penalties, seeded
    sampling and logprobs included."""
    from test_executor_overlap import _run_script_overlapped
    from test_executor_pipeline import (
        GREEDY_PEN,
        OTHER,
        PROMPT,
        SCRIPT,
        SEEDED_PEN,
        THIRD,
        _driver,
        _run_script,
    )

    model = build_model(tmp_path / "llama", "llama", initializer_range=0.05)
    runs = []
    for pieces in (False, True):
        d = _driver(model)
        if pieces:
            _with_twin_pieces(d.runner, max_tokens=64)
        d.add("a", PROMPT, sampling=GREEDY_PEN)
        d.add("b", OTHER, sampling=SEEDED_PEN, sample_index=1)
        d.add("c", THIRD, sampling=SEEDED_PEN)
        runs.append((d, _run_script_overlapped(d, SCRIPT) if pieces
                     else _run_script(d, SCRIPT, False)))
    (d1, eager), (d2, overlapped) = runs
    assert d2.runner.mixed_graph_steps == len(SCRIPT)
    for a, b in zip(eager, overlapped, strict=True):  # logprobs: to the padded matmuls' rounding
        assert (a.step_id, a.request_ids, a.errors) == (b.step_id, b.request_ids, b.errors)
        for name in ("token_ids", "top_counts", "top_token_ids"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
        for name in ("logprobs", "top_logprobs"):
            np.testing.assert_allclose(getattr(a, name), getattr(b, name), atol=1e-4,
                                       err_msg=name)
    for rid in "abc":
        assert d2.seqs[rid].outputs == d1.seqs[rid].outputs
