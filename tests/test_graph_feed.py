"""Decode graph steps fed from host arrays (executor/graph_feed.py; the graphs' first node:
kernels/graph_input_ops.py): the stage's words exactly, the staging buffers in turn, and
through the CPU twin of the graphs the same tokens as the buffer-by-buffer copies and as
eager steps, with the ids from the stage, from the graphs' own last tokens (a steady
overlapped decode) and copied in (rows fed out of order); the plans' precompute builds no
tensors for the steps the graphs take, and the batch builds them when it runs otherwise."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pagedserve.executor.graph_feed import GraphFeed, StagingRing, pack
from pagedserve.kernels.graph_input_ops import (
    IDS_FROM_LAST_TOKENS,
    IDS_FROM_STAGE,
)
from test_cuda_graphs import PROMPTS, _drive, _with_twin_graphs
from test_executor_overlap import _run_script_overlapped
from test_executor_pipeline import FEED, _run_script
from test_executor_support import Driver, small_runner

from pagedserve.tinymodels import build_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):  # test_cuda_graphs' model (their tokens are compared)
    return build_model(tmp_path_factory.mktemp("feed") / "llama", "llama",
                       initializer_range=0.2)


def _graphed(model_dir, max_batch=4):
    return _with_twin_graphs(small_runner(model_dir), max_batch)


def test_pack_writes_the_stage_layout():
    feed = GraphFeed(positions=np.array([10, 11], np.int32), slots=np.array([-1, 77]),
                     seq_lens=np.array([11, 12]), tables=np.array([[3, 4, 5], [6, 0, 0]],
                                                                  np.int32),
                     token_ids=np.array([501, 502]))
    words = np.full(40, -9, np.int32)
    assert pack(words, feed, IDS_FROM_STAGE) == 4 + 2 * 4 + 6
    assert words[:18].tolist() == [2, 3, 0, 0, 501, 502, 10, 11, -1, 77, 11, 12,
                                   3, 4, 5, 6, 0, 0]
    assert (words[18:] == -9).all()
    feed.token_ids = None  # ids on the device: their words are left as they were
    words[:] = -9
    assert pack(words, feed, IDS_FROM_LAST_TOKENS) == 18
    assert words[:6].tolist() == [2, 3, 1, 0, -9, -9] and words[6:8].tolist() == [10, 11]


def test_staging_ring_hands_out_its_buffers_in_turn():
    ring = StagingRing(8, torch.device("cpu"), count=3)
    dst = torch.zeros(8, dtype=torch.int32)
    order = []
    for value in range(5):
        i = ring.take()
        order.append(i)
        ring.arrays[i][:] = value
        ring.copy_out(i, 5, dst)
        assert dst.tolist() == [value] * 5 + [0] * 3
    assert order == [0, 1, 2, 0, 1]


def test_fed_steps_give_the_unfed_and_the_eager_tokens(model_dir, monkeypatch):
    """Host ids (steps read back at once, as on a CPU): every graph step is fed from the
    stage; with PAGEDSERVE_GRAPH_FEED=0 none is, through the same graphs; the same tokens
    as eager steps, and the padding rows clean."""
    from test_executor_support import assert_as_eager_and_padding_clean

    eager = _drive(small_runner(model_dir))
    fed = _drive(_graphed(model_dir))
    assert assert_as_eager_and_padding_clean(fed, eager)
    graphs = fed.runner.graphs
    assert fed.runner.graph_steps == 7 and graphs.fed == [7, 0, 0]
    monkeypatch.setenv("PAGEDSERVE_GRAPH_FEED", "0")
    unfed = _drive(_graphed(model_dir))
    assert not unfed.runner.graphs.feeds and unfed.runner.graphs.stage is None
    assert unfed.runner.graph_steps == 7 and unfed.runner.graphs.fed == [0, 0, 0]
    assert unfed.runner.limits.graph_rows == 0
    for rid in PROMPTS:
        assert fed.seqs[rid].outputs == unfed.seqs[rid].outputs == eager.seqs[rid].outputs


STEADY = [
    {"a": None, "b": None, "c": None},  # prefills
    {"a": FEED, "b": FEED, "c": FEED},  # ids: the sampler's tokens (eager step), copied in
    {"a": FEED, "b": FEED, "c": FEED},  # steady: the graph's own tokens, row for row
    {"a": FEED, "b": FEED, "c": FEED},
    {"c": FEED, "a": FEED, "b": FEED},  # rows in another order: picked, copied in
    {"a": FEED, "c": FEED},  # b sits out: a and c picked
    {"b": 1, "a": FEED, "c": FEED},  # b's token known, the others' on the device: patched
    {"b": FEED, "a": FEED, "c": FEED},  # the last step's order again: steady
]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_overlapped_steady_decodes_read_the_graphs_last_tokens(model_dir, device):
    """Steps left in flight (as on a GPU): a steady decode's graph reads its ids from its
    own last tokens; rows fed in another order, or partly known, are copied in: depth 1's
    eager tokens, step for step (on CUDA: float32, real graphs captured at start)."""
    cuda = dict(dtype="float32") if device == "cuda" else {}
    d = Driver(small_runner(model_dir, device, enforce_eager=True, **cuda))
    for rid in "abc":
        d.add(rid, PROMPTS[rid])
    eager = _run_script(d, STEADY, False)
    runner = (small_runner(model_dir, device, max_num_seqs=4, **cuda) if cuda
              else _graphed(model_dir))
    assert runner.graphs.feeds
    d = Driver(runner)
    for rid in "abc":
        d.add(rid, PROMPTS[rid])
    overlapped = _run_script_overlapped(d, STEADY)
    assert [r.step_id for r in overlapped] == [r.step_id for r in eager]
    for a, b in zip(eager, overlapped, strict=True):
        assert a.request_ids == b.request_ids and not b.errors
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
    fed = runner.graphs.fed
    assert runner.graph_steps == 7 and fed == [0, 3, 4]  # steps 2, 3, 7 / 1, 4, 5, 6


def test_precompute_leaves_the_fed_steps_tensors_to_the_stage(model_dir):
    runner = _graphed(model_dir)
    graphs = runner.graphs
    assert (runner.limits.graph_rows, runner.limits.graph_width) == (4, graphs.width)
    d = Driver(runner)
    for rid in "abcde":
        d.add(rid, PROMPTS[rid])
    d.step({r: None for r in "abcde"})
    plan = d.plan({r: None for r in "abcd"})
    four = runner.precompute(plan)
    assert four.feedable and four.positions is None and four.sample_rows is None
    runner.graphs = None  # the graphs went away after the plan was prepared
    assert runner.limits.graph_rows == 0
    result = runner.execute(plan, four)
    d.accept(result)
    assert not result.errors and runner.graph_steps == 0  # eager, its tensors built then
    assert four.seq_lens_t.tolist() == [len(PROMPTS[r]) + 1 for r in "abcd"]
    runner.graphs = graphs
    five = runner.precompute(d.plan({r: None for r in "abcde"}))
    assert five.feedable and five.positions is not None  # 5 rows: over the graphs' 4


def test_start_up_check_turns_a_wrong_scatter_off(model_dir, monkeypatch):
    """The executor's start-up check (runner_setup._capture_graphs: `check_feed`) passes on
    the twin; a scatter that writes a padding row wrong fails it, feeding goes off, and
    the graphs (whose first node is still that scatter) take their inputs buffer by buffer
    with the same tokens as eager steps."""
    from pagedserve.executor import runner_setup
    from pagedserve.kernels import ops

    runner = small_runner(model_dir)
    graphs = runner_setup._capture_graphs(runner.model, runner.cache, runner.max_model_len, 4)
    assert graphs.feeds and graphs.check_feed() == "" and graphs.fed == [0, 0, 0]
    scatter = ops.graph_inputs_

    def wrong(stage, input_ids, positions, slot_mapping, *rest, **kw):
        scatter(stage, input_ids, positions, slot_mapping, *rest, **kw)
        if int(stage[2]) != 3 and slot_mapping.shape[0] > int(stage[0]):
            slot_mapping[-1] = 0  # a padding row that would write block 0

    monkeypatch.setattr(ops, "graph_inputs_", wrong)
    runner = small_runner(model_dir)
    graphs = runner_setup._capture_graphs(runner.model, runner.cache, runner.max_model_len, 4)
    assert graphs.scatters and not graphs.feeds and graphs.feed_rows == 0
    assert "slot_mapping" in _check_message(graphs)
    runner.graphs = graphs
    fed = _drive(runner)
    eager = _drive(small_runner(model_dir))
    assert runner.graph_steps == 7 and graphs.fed == [0, 0, 0]
    for rid in PROMPTS:
        assert fed.seqs[rid].outputs == eager.seqs[rid].outputs, rid


def _check_message(graphs) -> str:
    graphs.feeds = True
    try:
        return graphs.check_feed()
    finally:
        graphs.feeds = False


def test_feed_switch(monkeypatch):
    from pagedserve.executor.graph_feed import feeds_wanted

    monkeypatch.delenv("PAGEDSERVE_GRAPH_FEED", raising=False)
    assert feeds_wanted() and feeds_wanted(strict=True)
    monkeypatch.setenv("PAGEDSERVE_GRAPH_FEED", "0")
    assert not feeds_wanted(strict=True)
    monkeypatch.setenv("PAGEDSERVE_GRAPH_FEED", "off")  # the executor's start refuses it
    assert feeds_wanted()
    with pytest.raises(ValueError, match="expected 0 or 1"):
        feeds_wanted(strict=True)
