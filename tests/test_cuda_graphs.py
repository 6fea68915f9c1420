"""Decode steps through captured graphs (executor/cuda_graphs.py) against the same steps run
eagerly: the batch sizes captured, the padding rows (no cache write, nothing read), the
choice of graph, and when a step stays eager. On a CPU the graphs are the module's twin
(the forward re-run on the static buffers); the `gpu` tests capture real CUDA graphs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pagedserve.executor.cuda_graphs import (
    DecodeGraphs,
    graph_batch_sizes,
    graph_memory_bytes,
    graphs_supported,
)
from pagedserve.protos.wire import SamplingParams
from test_executor_support import Driver, assert_as_eager_and_padding_clean, small_runner

from pagedserve.tinymodels import build_model

PROMPTS = {  # five lengths: tables of 1-3 blocks of 8
    "a": [0, 17, 250, 33, 9, 480, 77, 5, 61, 300, 12],
    "b": [0, 400, 3, 3, 3],
    "c": [0, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
    "d": [0, 99],
    "e": [0, 1, 2, 3, 4, 5, 6, 7],
}
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=7)


def test_graph_batch_sizes():
    assert graph_batch_sizes(0) == []
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    full = graph_batch_sizes(256)
    assert full[:5] == [1, 2, 4, 8, 16] and full[-2:] == [248, 256] and len(full) == 35
    assert graph_batch_sizes(10_000) == full  # capped at MAX_GRAPH_BATCH


def test_graphs_supported(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_KERNEL_BACKEND", raising=False)
    assert "CUDA only" in graphs_supported(torch.device("cpu"))
    assert graphs_supported(torch.device("cuda", 0)) == ""
    monkeypatch.setenv("PAGEDSERVE_KERNEL_BACKEND", "torch")
    assert "PAGEDSERVE_KERNEL_BACKEND=torch" in graphs_supported(torch.device("cuda", 0))
    assert graph_memory_bytes(None, 16, 64, 8, torch.device("cpu")) == 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("graphs") / "llama", "llama",
                       initializer_range=0.2)



def _with_twin_graphs(runner, max_batch):
    graphs = DecodeGraphs(runner.model, runner.cache.kv_cache, runner.block_size,
                          runner.max_model_len, max_batch)
    graphs.capture()
    runner.graphs = graphs
    return runner


def _drive(runner, sampling=None):
    """Prefill all five, then 8 decode steps of 5, 4, 3, 3, 2, 2, 1, 1 rows as requests
    finish (with a limit of 4: the 5-row step eager, the others in graphs of 4, 4, 4, 2,
    2, 1, 1)."""
    d = Driver(runner)
    for rid, prompt in PROMPTS.items():
        d.add(rid, prompt, **({"sampling": sampling} if sampling else {}))
    lengths = {"a": 9, "b": 3, "c": 5, "d": 7, "e": 2}
    d.step({r: None for r in PROMPTS})  # prefill: always eager
    while live := [r for r in PROMPTS if len(d.seqs[r].outputs) < lengths[r]]:
        d.step({r: None for r in live})
    return d


def test_twin_graphs_equal_eager_and_write_only_real_slots(model_dir):
    eager = _drive(small_runner(model_dir))
    graphed = _drive(_with_twin_graphs(small_runner(model_dir), max_batch=4))
    assert assert_as_eager_and_padding_clean(graphed, eager)  # some block stays unused
    runner = graphed.runner
    assert runner.graph_steps == 7 and runner.steps_done == 9
    assert graphed.runner.graphs.sizes == [1, 2, 4]
    # the same keys and values, up to the padded matmuls' summation order
    torch.testing.assert_close(runner.cache.kv_cache, eager.runner.cache.kv_cache,
                               atol=1e-4, rtol=1e-3)


def test_plain_greedy_graph_steps_sample_nothing_but_the_graphs_tokens(model_dir):
    """A decode graph computes every row's greedy token too; a step whose rows are all
    plain greedy hands them to the sampler (its only launch then the tokens' copy): every
    graph step here, the same tokens as eagerly."""
    runner = _with_twin_graphs(small_runner(model_dir), max_batch=4)
    given = []
    launch = runner.sampler.launch

    def spy(logits, states, grammar_bits=None, argmax=None, plain=None):
        given.append(argmax is not None)
        return launch(logits, states, grammar_bits, argmax=argmax, plain=plain)

    runner.sampler.launch = spy
    graphed = _drive(runner)
    eager = _drive(small_runner(model_dir))
    for rid in PROMPTS:
        assert graphed.seqs[rid].outputs == eager.seqs[rid].outputs, rid
    assert given.count(True) == runner.graph_steps == 7 and len(given) == 9


def test_overlapped_plain_greedy_steps_feed_on_the_graphs_tokens(model_dir):
    """Steps left in flight (as on a GPU): a steady decode's input ids ARE the previous
    step's device tokens, here the graph's own token buffer, which the next replay
    overwrites only after they were read (and their host copy is a copy): plain greedy
    through twin graphs gives depth 1's eager tokens, step for step."""
    from test_executor_overlap import _run_script_overlapped
    from test_executor_pipeline import OTHER, PROMPT, SCRIPT, THIRD, _run_script

    runs = []
    for graphed in (False, True):
        runner = small_runner(model_dir)
        if graphed:
            _with_twin_graphs(runner, max_batch=4)
        d = Driver(runner)
        for rid, prompt in (("a", PROMPT), ("b", OTHER), ("c", THIRD)):
            d.add(rid, prompt)
        runs.append((runner, _run_script_overlapped(d, SCRIPT) if graphed
                     else _run_script(d, SCRIPT, False)))
    (_, eager), (graphed_runner, graphed) = runs
    assert [r.step_id for r in graphed] == [r.step_id for r in eager]
    for a, b in zip(eager, graphed, strict=True):
        assert a.request_ids == b.request_ids and not b.errors
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
    assert graphed_runner.graph_steps >= 3


def test_graph_logits_serve_a_step_where_some_rows_do_not_sample(model_dir):
    """A decode graph computes every row's logits; a one-token step whose rows do not all
    sample (a prompt's last-but-one token beside decodes) takes the sampling rows' logits
    from them: the same tokens as eagerly, and those steps ran in the graph."""
    def drive(runner):
        d = Driver(runner)
        for rid in "abc":
            d.add(rid, PROMPTS[rid])
        d.step({"a": None, "b": None, "c": 14})  # prefills; c stops 3 tokens short
        for c_tokens in (1, 1, 1, 0, 0):  # c's last prompt tokens one at a time, then decodes
            d.step({"a": None, "b": None, **({"c": c_tokens} if c_tokens else {"c": None})})
        return d

    eager = drive(small_runner(model_dir))
    graphed = drive(_with_twin_graphs(small_runner(model_dir), max_batch=4))
    assert graphed.runner.graph_steps == 5  # c's two non-sampling steps among them
    for rid in "abc":
        assert graphed.seqs[rid].outputs == eager.seqs[rid].outputs, rid
    assert len(graphed.seqs["c"].outputs) == 3


def test_twin_graphs_keep_seeded_sampling(model_dir):
    eager = _drive(small_runner(model_dir), SEEDED)
    graphed = _drive(_with_twin_graphs(small_runner(model_dir), max_batch=8), SEEDED)
    assert graphed.runner.graph_steps == 8  # every decode step, the 5-row one in the 8
    for rid in PROMPTS:
        assert graphed.seqs[rid].outputs == eager.seqs[rid].outputs, rid


def test_padding_rows_are_reset_between_replays(model_dir):
    """A 3-row step after a 4-row one pads row 3 again: its slot goes back to -1."""
    runner = _with_twin_graphs(small_runner(model_dir), max_batch=4)
    graphs = runner.graphs
    d = Driver(runner)
    for rid in "abcd":
        d.add(rid, PROMPTS[rid])
    d.step({r: None for r in "abcd"})
    d.step({r: None for r in "abcd"})
    assert graphs.slot_mapping[3].item() >= 0 and graphs.seq_lens[3].item() > 0
    d.step({r: None for r in "abc"})
    assert graphs.slot_mapping[3].item() == -1 and graphs.seq_lens[3].item() == 0
    assert graphs.size_for(3) == 4 and graphs.size_for(5) is None


def test_twin_graphs_with_pipelined_marked_decodes(model_dir):
    """Depth 2 (marked decodes fed the previous step's tokens, plan-only inputs prepared
    ahead) with graphs gives depth 1's tokens without them, penalties and logprobs
    included (logprobs up to the padded matmuls' rounding); the decode-only steps of the
    script (2, 5, 6 and 7) replay graphs."""
    from test_executor_pipeline import (
        GREEDY_PEN,
        OTHER,
        PROMPT,
        SCRIPT,
        SEEDED_PEN,
        THIRD,
        _run_script,
    )

    runs = []
    for pipelined, graphed in ((False, False), (True, True)):
        runner = small_runner(model_dir)
        if graphed:
            _with_twin_graphs(runner, max_batch=4)
        d = Driver(runner)
        d.add("a", PROMPT, sampling=GREEDY_PEN)
        d.add("b", OTHER, sampling=SEEDED_PEN, sample_index=1)
        d.add("c", THIRD, sampling=SEEDED_PEN)
        runs.append((runner, _run_script(d, SCRIPT, pipelined)))
    (_, eager), (graphed_runner, graphed) = runs
    for a, b in zip(eager, graphed, strict=True):
        assert (a.step_id, a.request_ids, a.errors) == (b.step_id, b.request_ids, b.errors)
        for name in ("token_ids", "top_counts", "top_token_ids"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
        for name in ("logprobs", "top_logprobs"):
            np.testing.assert_allclose(getattr(a, name), getattr(b, name), atol=1e-4,
                                       err_msg=name)
        assert not b.errors
    assert graphed_runner.graph_steps == 4


# ------------------------------------------------------------------------------ CUDA
@pytest.mark.gpu
def test_cuda_graphs_equal_eager(model_dir):
    """fp32 on the GPU: the same greedy tokens with and without graphs; the graphs were
    captured (a capture failure would leave runner.graphs None) and their memory counted."""
    eager = _drive(small_runner(model_dir, "cuda", dtype="float32", enforce_eager=True))
    assert eager.runner.graphs is None
    graphed_runner = small_runner(model_dir, "cuda", dtype="float32", max_num_seqs=4)
    assert graphed_runner.graphs is not None and graphed_runner.graphs.sizes == [1, 2, 4]
    graphed = _drive(graphed_runner)
    assert_as_eager_and_padding_clean(graphed, eager)
    assert graphed_runner.graph_steps == 7


@pytest.mark.gpu
def test_cuda_graph_memory_is_reserved_before_the_cache(model_dir, gpu_memory_alone):
    model = small_runner(model_dir, "cuda", dtype="float32", enforce_eager=True).model
    held = graph_memory_bytes(model, 8, 64, 256, torch.device("cuda", 0))
    assert held > 0
    profiled = small_runner(model_dir, "cuda", dtype="float32", num_gpu_blocks=None,
                            gpu_memory_utilization=0.25)
    assert profiled.graphs is not None and profiled.cache.num_gpu_blocks > 0


@pytest.mark.gpu
def test_cuda_step_timings_from_events(model_dir):
    """On CUDA the forward is timed by events (no sync before sampling): every step reports
    a positive forward and a non-negative sampling time that fit in the step's wall time."""
    import time

    d = Driver(small_runner(model_dir, "cuda", dtype="float32", max_num_seqs=4))
    for rid, prompt in PROMPTS.items():
        d.add(rid, prompt)
    for _ in range(4):
        t0 = time.perf_counter()
        result = d.step({r: None for r in PROMPTS})
        wall = time.perf_counter() - t0
        assert not result.errors
        assert result.forward_s > 0 and result.sample_s >= 0
        assert result.forward_s + result.sample_s <= wall


def test_the_collector_stays_off_while_graphs_capture_and_comes_back_after():
    # A graph destroyed by the cyclic collector during a capture invalidates the capture
    # (H200, 2026-11-27): captures run with the collector off, garbage collected before.
    import gc

    from pagedserve.executor.cuda_graphs import no_collection_while_capturing

    assert gc.isenabled()
    with no_collection_while_capturing():
        assert not gc.isenabled()
    assert gc.isenabled()
    try:
        with no_collection_while_capturing():
            raise RuntimeError("capture failed")
    except RuntimeError:
        pass
    assert gc.isenabled()
    gc.disable()
    try:
        with no_collection_while_capturing():
            pass
        assert not gc.isenabled()  # left as it was found
    finally:
        gc.enable()
