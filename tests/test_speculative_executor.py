"""Speculative decoding on the executor (executor/draft_rows.py), driven in-process with
StepPlans: a decode row with drafts computes its input and the drafts and answers with its
samples up to the first that differs from the draft after it. Greedy tokens equal
transformers' whatever the drafts (all right, one wrong, all wrong: the keys and values
written for rejected drafts are overwritten later), beside plain decodes and a prompt chunk;
seeded sampling with penalties, min_tokens and logprobs gives exactly the tokens of
decoding without drafts; overlapped steps feed the next plan's marked decodes after a
drafted step. Each also with its sampling rows in chunks of 2 (executor/sample_chunks.py:
a drafted row's positions split across chunks; the sampler's work buffers stay that
small)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pagedserve.executor.draft_rows import confirmed, sampling_positions
from pagedserve.executor.runner_setup import build_runner
from pagedserve.protos.wire import SamplingParams, StepPlan
from test_executor_support import Driver, assert_greedy_equal, hf_reference

from pagedserve.tinymodels import build_model

PROMPT = [0, 17, 250, 33, 9, 480, 77, 5, 61, 300, 12, 13, 14, 15, 16, 99, 98, 97, 96, 95]
OTHER = [0, 400, 3, 3, 3, 91, 200, 201, 202]
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, seed=11, repetition_penalty=1.2,
                         frequency_penalty=0.3, presence_penalty=0.2, min_tokens=6,
                         eos_token_ids=(2,), logprobs=2)


class DraftDriver(Driver):
    """`Driver` that can plan a decode with drafts: its row is the last token and the
    drafts; after the result its computed tokens are the input and the confirmed drafts."""

    def plan_drafts(self, drafts: dict[str, list[int]], schedule=None) -> StepPlan:
        rows = {}
        for rid, ds in drafts.items():
            seq = self.seqs[rid]
            assert seq.num_computed == len(seq.tokens) - 1, "a drafted row is a decode"
            rows[rid] = (seq.num_computed, list(ds))
            seq.tokens.extend(ds)  # planned as tokens to compute, taken back below
        plan = self.plan({**{r: None for r in drafts}, **(schedule or {})})
        for rid, (start, ds) in rows.items():
            seq = self.seqs[rid]
            del seq.tokens[len(seq.tokens) - len(ds):]
            seq.num_computed = start + 1  # + the confirmed drafts, once answered
        counts = np.array([len(drafts.get(r, ())) for r in plan.request_ids], np.uint8)
        plan = StepPlan(**{f: getattr(plan, f) for f in plan.__struct_fields__
                           if f not in ("num_draft_tokens", "type")},
                        num_draft_tokens=counts)
        plan.validate()
        return plan

    def accept(self, result) -> None:
        emitted: dict[str, int] = {}
        for rid in result.request_ids:
            emitted[rid] = emitted.get(rid, 0) + 1
        super().accept(result)
        for rid, n in emitted.items():
            if n > 1:  # the drafts it confirmed were computed
                self.seqs[rid].num_computed += n - 1

    def step_drafts(self, drafts, schedule=None):
        result = self.runner.execute(self.plan_drafts(drafts, schedule))
        assert not result.errors, result.errors
        self.accept(result)
        return result


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("spec") / "llama", "llama")


@pytest.fixture(scope="module")
def reference(model_dir):
    return hf_reference(model_dir, PROMPT, 30)


DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]


CHUNKS = [8, 2]  # rows sampled at once: --max-num-seqs, and fewer than a drafted row's


def _driver(model_dir, device: str = "cpu", chunk_rows: int = 8) -> DraftDriver:
    """On CUDA: float32, overlapped steps, the decode graphs and graph pieces captured (a
    drafted row runs in the pieces). ``chunk_rows``: sampled at most that many rows at once
    (build_runner makes it --max-num-seqs)."""
    d = DraftDriver(build_runner(str(model_dir), device=device, dtype="float32",
                                 num_gpu_blocks=48, num_cpu_blocks=8, block_size=8,
                                 max_num_seqs=8, max_num_batched_tokens=256,
                                 progress=False))
    assert d.runner.sample_chunk_rows == 8
    d.runner.sample_chunk_rows = chunk_rows
    return d


def _assert_buffers_within(d: DraftDriver, chunk_rows: int) -> None:
    """The sampler's kept work buffers (a CPU's) hold at most one chunk of rows."""
    sizes = [b.numel() for b in d.runner.sampler._buffers.values()]
    assert max(sizes, default=0) <= chunk_rows * d.runner.vocab_size, sizes


def test_sampling_positions_and_confirmed_exactly():
    # rows ending at 3, 7, 12 (exclusive): 0, 2 and 1 drafts
    ends = np.array([3, 7, 12])
    tokens = np.arange(100, 112)
    index, counts, rows = sampling_positions(ends, np.array([0, 2, 1]), tokens)
    assert index.tolist() == [2, 4, 5, 6, 10, 11] and counts.tolist() == [1, 3, 2]
    assert rows.offsets.tolist() == [0, 0, 1, 2, 0, 1]
    assert rows.draft_next.tolist() == [-1, 105, 106, -1, 111, -1]
    # row 2 confirms its first draft then differs; row 3 confirms its draft
    keep = confirmed(np.array([7, 105, 9, 8, 111, 3]), rows)
    assert keep.tolist() == [True, True, True, False, True, True]
    keep = confirmed(np.array([7, 1, 106, 8, 1, 3]), rows)
    assert keep.tolist() == [True, True, False, False, True, False]


@pytest.mark.parametrize("chunk_rows", CHUNKS)
@pytest.mark.parametrize("device", DEVICES)
def test_greedy_with_right_wrong_and_no_drafts_equals_transformers(model_dir, reference,
                                                                  device, chunk_rows):
    ref, logits = reference
    d = _driver(model_dir, device, chunk_rows)
    d.add("a", PROMPT)
    d.add("b", OTHER)
    d.step({"a": None})  # prefill: token 0
    out = d.seqs["a"].outputs
    # all four right: five tokens in one step
    res = d.step_drafts({"a": ref[1:5]}, schedule={"b": 5})
    assert res.request_ids == ["a"] * 5 and d.seqs["a"].outputs == ref[:6]
    # the second draft wrong: the first, then the model's own token
    wrong = [ref[6], (ref[7] + 1) % 500, ref[8]]
    res = d.step_drafts({"a": wrong}, schedule={"b": None})
    assert res.request_ids == ["a", "a", "b"] and d.seqs["a"].outputs == ref[:8]
    # all wrong (their keys and values are overwritten by later steps), across a block
    res = d.step_drafts({"a": [(t + 3) % 500 for t in ref[8:14]]}, schedule={"b": None})
    assert res.request_ids == ["a", "b"] and d.seqs["a"].outputs == ref[:9]
    while len(d.seqs["a"].outputs) < 30:
        n = len(d.seqs["a"].outputs)
        d.step_drafts({"a": ref[n:n + 3]}, schedule={"b": None})
    out = d.seqs["a"].outputs
    assert_greedy_equal(out[:30], ref, logits)
    ref_b, logits_b = hf_reference(model_dir, OTHER, len(d.seqs["b"].outputs))
    assert_greedy_equal(d.seqs["b"].outputs, ref_b, logits_b)
    if device == "cuda":  # the drafted steps replayed the graph pieces
        assert d.runner.mixed_graph_steps >= 3, d.runner.mixed_graph_steps


@pytest.mark.parametrize("chunk_rows", CHUNKS)
@pytest.mark.parametrize("device", DEVICES)
def test_sampled_tokens_and_logprobs_are_those_of_decoding_without_drafts(model_dir, device,
                                                                         chunk_rows):
    plain = _driver(model_dir, device)
    plain.add("a", PROMPT, sampling=SAMPLED)
    logprobs = []
    while len(plain.seqs["a"].outputs) < 24:
        logprobs.append(plain.step({"a": None}).logprobs.tolist()[0])
    want = plain.seqs["a"].outputs

    d = _driver(model_dir, device, chunk_rows)
    d.add("a", PROMPT, sampling=SAMPLED)
    d.add("b", OTHER, sampling=SamplingParams(temperature=0.0))
    d.step({"a": None, "b": 4})
    assert d.seqs["a"].outputs == want[:1]
    steps = 0
    lps = []
    while len(d.seqs["a"].outputs) < 24:
        n = len(d.seqs["a"].outputs)
        # drafts: the true continuation with a wrong one every third step
        drafts = want[n:n + 3]
        if steps % 3 == 2 and len(drafts) > 1:
            drafts[1] = (drafts[1] + 1) % 500
        res = d.step_drafts({"a": drafts}, schedule={"b": None})
        lps += [lp for rid, lp in zip(res.request_ids, res.logprobs.tolist(), strict=True)
                if rid == "a"]
        steps += 1
    assert d.seqs["a"].outputs[:24] == want
    assert steps < 23  # drafts were confirmed
    np.testing.assert_allclose(lps[:23], logprobs[1:24], atol=1e-4)
    if device == "cpu":
        _assert_buffers_within(d, chunk_rows)


@pytest.mark.parametrize("chunk_rows", CHUNKS)
def test_overlapped_steps_feed_marked_decodes_after_a_drafted_step(model_dir, reference,
                                                                   chunk_rows):
    ref, _ = reference
    plain = _driver(model_dir)
    plain.add("b", OTHER)
    plain.generate(["b"], 8)
    want_b = plain.seqs["b"].outputs

    d = _driver(model_dir, chunk_rows=chunk_rows)
    d.runner.overlap_steps = True  # as on a GPU
    d.add("a", PROMPT)
    d.add("b", OTHER)
    d.accept(d.runner.execute(d.plan({"a": None, "b": None})))
    d.runner.submit(d.plan_drafts({"a": ref[1:4]}, schedule={"b": None}))  # in flight
    # the next plan before that result: b fed its sample (a sits it out, as the router
    # plans: where its next input goes is known from the result only)
    nxt = d.plan({"b": None}, feed=("b",))
    ready = d.runner.submit(nxt)
    assert len(ready) == 1 and ready[0].request_ids == ["a"] * 4 + ["b"]
    d.accept(ready[0])
    last = d.runner.collect()
    assert not last.errors, last.errors
    assert last.request_ids == ["b"]
    d.accept(last)
    d.step({"a": None, "b": None})
    assert d.seqs["a"].outputs == ref[:6] and d.seqs["b"].outputs == want_b[:4]


@pytest.mark.parametrize("chunk_rows", CHUNKS)
def test_drafts_under_a_grammar_give_the_tokens_of_decoding_without_them(model_dir,
                                                                       chunk_rows):
    """A constrained sample's drafted positions are masked as the format stands after the
    drafts before them (executor/grammar.py `after_drafts`): sampled with a seed, the
    tokens equal those of one-at-a-time decoding, whether the drafts are right, wrong
    but allowed, or refused by the grammar (the position after a refused draft is never
    kept); the request's own matcher follows the kept tokens only."""
    from pagedserve.router.structured import build_grammar

    grammar = build_grammar("regex", "([a-z]{2}[0-9]{2}){2,12}")  # masks change with state
    params = SamplingParams(temperature=0.8, seed=5, grammar=grammar, eos_token_ids=(2,))
    plain = _driver(model_dir)
    plain.add("a", PROMPT, sampling=params)
    while len(plain.seqs["a"].outputs) < 20 and plain.seqs["a"].outputs[-1:] != [2]:
        plain.step({"a": None})
    want = plain.seqs["a"].outputs
    assert len(want) >= 8, want  # the format leaves room to draft

    from tokenizers import Tokenizer

    refused = Tokenizer.from_file(str(model_dir / "tokenizer.json")).token_to_id("!")
    assert refused is not None  # a byte the format never allows
    d = _driver(model_dir, chunk_rows=chunk_rows)
    d.add("a", PROMPT, sampling=params)
    d.step({"a": None})
    steps = 0
    while len(d.seqs["a"].outputs) < len(want) and d.seqs["a"].outputs[-1] != 2:
        n = len(d.seqs["a"].outputs)
        drafts = list(want[n:n + 4])
        if steps % 3 == 1 and len(drafts) > 2:
            drafts[1] = refused  # refused by the grammar: drafts after it are moot
        elif steps % 3 == 2 and len(drafts) > 1:
            drafts[0] = want[n + 1] if want[n + 1] != want[n] else (want[n] + 1) % 500
        d.step_drafts({"a": drafts})
        steps += 1
    assert d.seqs["a"].outputs[:len(want)] == want
    assert steps < len(want) - 1  # drafts were confirmed
    # its matcher consumed no draft (a refused one would have left it in its error state)
    assert not d.runner.requests["a"]._sampling.grammar.inner.is_error()
    _assert_buffers_within(d, chunk_rows)
