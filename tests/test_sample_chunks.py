"""Sampling a step's rows in chunks (executor/sample_chunks.py): exactly the tokens,
logprobs and top logprobs of one call, whatever the chunk size, with every kind of row
(plain greedy, greedy with logprobs, seeded top-k / top-p / min-p, penalties, a bias, an
allowed list, bad words, constrained rows whose masks are sliced per chunk); the logits are
computed a chunk at a time; the memory profile's sampling pass samples its rows in one
chunk and falls back to the torch forms when a kernel fails. The runner's drafted steps in
chunks: tests/test_speculative_executor.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pagedserve.executor import sample_chunks
from pagedserve.executor.sample_chunks import (
    HiddenRows,
    SampledChunks,
    launch_sampling,
    profile_sampling,
    step_logits,
)
from pagedserve.executor.sampler import Sampler
from pagedserve.executor.sampling_state import SamplingState
from pagedserve.protos.wire import SamplingParams

torch.set_num_threads(1)
VOCAB, HIDDEN = 300, 16


class Spy:
    """A vocabulary projection that records how many rows each call projects."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.weight = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64)
        self.calls: list[int] = []

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls.append(hidden.shape[0])
        # float64 then float32: a row's logits do not depend on the rows beside it
        return (hidden.double() @ self.weight.T).float()


def _states() -> list[SamplingState]:
    def st(i, output=(), **params):
        return SamplingState(SamplingParams(**params), i, np.asarray(output, np.int64),
                             np.asarray([5, 6, 7], np.int64))
    return [
        st(0),  # plain greedy
        st(0, logprobs=3),
        st(0, temperature=0.9, seed=1, top_k=20),
        st(1, temperature=1.1, seed=2, top_p=0.8, logprobs=0),
        st(0, temperature=0.7, seed=3, min_p=0.1, repetition_penalty=1.3,
           frequency_penalty=0.5, output=[4, 4, 9]),
        st(0, logit_bias_ids=(11,), logit_bias_values=(50.0,)),
        st(0, temperature=0.8, seed=4, allowed_token_ids=(3, 8, 13, 21), logprobs=2),
        st(0, bad_words_token_ids=((9,),), output=[9]),
        st(2, temperature=1.0, seed=5, logprobs=5),
        st(0, min_tokens=4, eos_token_ids=(1, 2)),
        st(0),
    ]


def _outputs(out) -> list[np.ndarray]:
    return [out.token_ids, out.logprobs, out.top_counts, out.top_token_ids, out.top_logprobs]


@pytest.mark.parametrize("chunk", [1, 3, 4, 10])
def test_chunks_sample_exactly_what_one_call_does(chunk):
    spy = Spy()
    hidden = torch.randn(30, HIDDEN, generator=torch.Generator().manual_seed(1))
    rows = torch.tensor([0, 2, 3, 5, 7, 11, 13, 17, 19, 23, 29])
    states = _states()
    whole = Sampler().launch(spy(hidden[rows]), states).result()
    spy.calls.clear()
    logits = step_logits(spy, hidden, rows, chunk)
    assert isinstance(logits, HiddenRows) and not spy.calls  # computed as sampled
    sampled = launch_sampling(Sampler(), logits, states)
    assert isinstance(sampled, SampledChunks)
    assert spy.calls == [chunk] * (11 // chunk) + [11 % chunk] * bool(11 % chunk)
    assert sampled.tokens.tolist() == whole.token_ids.tolist()
    assert sampled.done() and sampled.event is None and sampled.pooled() == [None] * len(
        spy.calls)
    for got, want in zip(_outputs(sampled.result()), _outputs(whole), strict=True):
        np.testing.assert_array_equal(got, want)
    assert whole.top_counts.tolist() == [0, 3, 0, 0, 0, 0, 2, 0, 5, 0, 0]


def test_rows_that_fit_one_chunk_are_logits_sampled_in_one_call():
    spy = Spy()
    hidden = torch.randn(11, HIDDEN)
    logits = step_logits(spy, hidden, torch.arange(11), 11)
    assert isinstance(logits, torch.Tensor) and logits.shape == (11, VOCAB)
    sampled = launch_sampling(Sampler(), logits, _states())
    assert not isinstance(sampled, SampledChunks) and spy.calls == [11]


def _allowing(*token_sets) -> np.ndarray:
    """llguidance's bitmask: row i allows token_sets[i]."""
    bits = np.zeros((len(token_sets), (VOCAB + 31) // 32), np.uint32)
    for i, tokens in enumerate(token_sets):
        for t in tokens:
            bits[i, t >> 5] |= np.uint32(1 << (t & 31))
    return bits.view(np.int32)


def test_each_chunk_gets_its_constrained_rows_masks():
    """Rows 1, 2 and 5 of 6 are constrained (any object stands for the matcher: the masks
    are given); chunks of 2 see masks [row 1], [row 2] and [row 5]."""
    spy = Spy()
    hidden = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(2))
    states = [SamplingState(SamplingParams(temperature=0.9, seed=i, logprobs=1), i)
              for i in range(6)]
    for i in (1, 2, 5):
        states[i].grammar = object()
    bits = _allowing([40, 41], [7], [100, 200, 299])
    whole = Sampler().launch(spy(hidden), states, bits).result()
    chunked = launch_sampling(Sampler(), HiddenRows(hidden, spy, 2), states, bits).result()
    for got, want in zip(_outputs(chunked), _outputs(whole), strict=True):
        np.testing.assert_array_equal(got, want)
    tokens = chunked.token_ids.tolist()
    assert tokens[1] in (40, 41) and tokens[2] == 7 and tokens[5] in (100, 200, 299)


def test_mismatched_rows_are_refused():
    with pytest.raises(ValueError, match="3 rows of hidden states for 2 states"):
        launch_sampling(Sampler(), HiddenRows(torch.zeros(3, HIDDEN), Spy(), 2),
                        _states()[:2])


def test_the_profile_samples_its_rows_in_one_chunk_the_costliest_way():
    spy = Spy()
    profile_sampling(spy, torch.randn(4, HIDDEN), 64)
    assert spy.calls == [64]
    params = sample_chunks._COSTLIEST
    assert params.logprobs and params.top_k and params.top_p < 1 and params.min_p
    assert params.repetition_penalty != 1 and params.logit_bias_ids


def test_the_profile_falls_back_to_the_torch_forms(monkeypatch):
    backends = []
    launch = Sampler.launch

    def failing(self, *args, **kwargs):
        backends.append(self.kernel_backend)
        if self.kernel_backend == "auto":
            raise RuntimeError("no kernel here")
        return launch(self, *args, **kwargs)

    monkeypatch.setattr(Sampler, "launch", failing)
    profile_sampling(Spy(), torch.randn(2, HIDDEN), 8)
    assert backends == ["auto", "torch"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_a_chunked_step_needs_no_more_than_the_profile_measured():
    """Qwen2.5-0.5B's vocabulary projection (bf16): the profile's pass over 256 rows, then
    a step of 4,096 rows (256 sequences x 16 positions) sampled the costliest way in chunks
    of 256 peaks within it (plus the step's own outputs), where sampling it whole would take
    over 8 times as much; the tokens are those of the same logits sampled whole."""
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn(151936, 896, generator=gen, device=device, dtype=torch.bfloat16)

    def compute(hidden):
        return torch.nn.functional.linear(hidden, weight)

    hidden = torch.randn(4096, 896, generator=gen, device=device, dtype=torch.bfloat16)
    states = [SamplingState(sample_chunks._COSTLIEST, i, prompt_token_ids=(2, 3))
              for i in range(4096)]

    def peak_of(fn) -> int:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base, out

    profiled, _ = peak_of(lambda: profile_sampling(compute, hidden, 256))
    rows = torch.arange(4096, device=device)
    chunked, out = peak_of(lambda: launch_sampling(
        Sampler(), step_logits(compute, hidden, rows, 256), states).result())
    # Whole: the same logits (a chunk's matmul need not round as the whole one does)
    whole, want = peak_of(lambda: Sampler().launch(
        torch.cat([compute(hidden[i:i + 256]) for i in range(0, 4096, 256)]), states).result())
    assert chunked <= profiled + (64 << 20), (chunked, profiled)
    assert whole > 8 * profiled, (whole, profiled)
    np.testing.assert_array_equal(out.token_ids, want.token_ids)
