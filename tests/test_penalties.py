"""Penalties (executor/penalties.py): exact expectations, the prompt counted for repetition
once, HF's repetition processor over a greedy run, the dense (GPU) form bit for bit the
sparse one, and the sampler applying them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedserve.executor.penalties import (
    apply_penalties_,
    apply_penalties_dense_,
    flatten_output_tokens,
    flatten_prompt_tokens,
)
from pagedserve.executor.sampler import Sampler
from pagedserve.executor.sampling_state import SamplingState
from pagedserve.protos.wire import NewRequest, SamplingParams

torch.set_num_threads(1)


def state(output=(), sample_index=0, prompt=(), **params) -> SamplingState:
    return SamplingState(SamplingParams(**params), sample_index, np.asarray(output, np.int64),
                         np.asarray(prompt, np.int64))


def sample(logits, states):
    return Sampler()(torch.as_tensor(logits, dtype=torch.float32), states)


# --------------------------------------------------------------------------- penalties


def test_penalties_change_exactly_the_seen_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    rows, tokens = flatten_output_tokens([state(output=[0, 1, 1, 4]), state(output=[2, 2, 2])])
    assert rows.tolist() == [0, 0, 0, 0, 1, 1, 1] and tokens.tolist() == [0, 1, 1, 4, 2, 2, 2]
    out = apply_penalties_(logits.clone(), rows, tokens, torch.tensor([2.0, 1.0]),
                           torch.tensor([0.5, 0.25]), torch.tensor([0.1, 0.5]))
    expected = torch.tensor([
        [2.0 / 2 - 0.5 - 0.1, -1.0 * 2 - 0.5 - 0.2, 0.5, 3.0, -2.0 * 2 - 0.5 - 0.1],
        [1.0, 1.0, 1.0 - 0.25 - 1.5, 1.0, 1.0],
    ])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_dense_penalties_equal_the_sparse_ones_bit_for_bit(data):
    """The GPU form (dense counts, no device-to-host read, rows in chunks) gives exactly the
    logits of the sparse form: any rows, repeated and out-of-range ids, prompt tokens, every
    penalty, chunk boundaries anywhere."""
    num_rows, vocab = data.draw(st.integers(1, 6)), data.draw(st.integers(2, 12))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    logits = torch.randn(num_rows, vocab, generator=gen) * 3
    logits[0, 0] = 0.0  # neither > 0 nor < 0
    ids = st.integers(-1, vocab)  # -1 and vocab: not tokens, ignored
    out = data.draw(st.lists(st.tuples(st.integers(0, num_rows - 1), ids), max_size=20))
    prompt = data.draw(st.lists(st.tuples(st.integers(0, num_rows - 1), ids), max_size=20))
    penalty = st.floats(0.25, 4.0)
    rep = torch.tensor(data.draw(st.lists(penalty, min_size=num_rows, max_size=num_rows)))
    pres = torch.tensor(data.draw(st.lists(st.floats(-2, 2), min_size=num_rows,
                                           max_size=num_rows)))
    freq = torch.tensor(data.draw(st.lists(st.floats(-2, 2), min_size=num_rows,
                                           max_size=num_rows)))

    def pairs(items):
        return (torch.tensor([r for r, _ in items], dtype=torch.int64),
                torch.tensor([t for _, t in items], dtype=torch.int64))

    args = (*pairs(out), rep, pres, freq, *pairs(prompt))
    want = apply_penalties_(logits.clone(), *args)
    got = apply_penalties_dense_(logits.clone(), *args, chunk_rows=data.draw(st.integers(1, 4)))
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_penalised_and_sampled_rows_on_cuda_equal_cpu():
    """On a GPU the sampler takes the dense penalties and its no-read paths (pinned inputs,
    top-k width from the host): the same tokens as on the CPU for greedy and seeded rows."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 500, generator=gen) * 3
    params = [dict(temperature=0.0, repetition_penalty=1.5),
              dict(seed=3, presence_penalty=0.7, frequency_penalty=0.3, top_k=20),
              dict(seed=4, min_p=0.05), dict(temperature=0.0),
              dict(seed=8, repetition_penalty=0.8, top_k=5), dict(seed=9)]
    states = [state(output=[1, 2, 2, 7], prompt=[2, 9, 9], sample_index=i, **p)
              for i, p in enumerate(params)]
    on_gpu = Sampler()(logits.cuda(), states)
    on_cpu = Sampler()(logits, states)
    np.testing.assert_array_equal(on_gpu.token_ids, on_cpu.token_ids)


def test_repetition_penalty_below_one_boosts_and_counts_the_prompt():
    logits = torch.tensor([[1.0, -1.0, 0.9]])
    out = apply_penalties_(logits.clone(), torch.tensor([0, 0]), torch.tensor([0, 1]),
                           torch.tensor([0.5]), torch.tensor([0.0]), torch.tensor([0.0]))
    torch.testing.assert_close(out, torch.tensor([[2.0, -0.5, 0.9]]))
    # A prompt token counts for repetition (vLLM and HF do), not for presence/frequency.
    req = NewRequest(request_id="r", prompt_token_ids=np.array([0, 0, 0], np.int32),
                     output_token_ids=np.zeros(0, np.int32),
                     sampling=SamplingParams(temperature=0.0, repetition_penalty=100.0))
    assert sample(logits, [SamplingState.from_new_request(req)]).token_ids[0] == 2
    assert sample(logits, [state(prompt=[0, 0, 0], temperature=0.0, presence_penalty=2.0,
                                 frequency_penalty=2.0)]).token_ids[0] == 0


def test_repetition_counts_a_token_once_across_prompt_and_output():
    """Token 0 is in the prompt twice and the output twice: divided by the penalty once;
    frequency and presence see only its two output occurrences."""
    logits = torch.tensor([[4.0, -2.0, 3.0, 1.0], [4.0, -2.0, 3.0, 1.0]])
    states = [state(prompt=[0, 1, 0], output=[0, 0], repetition_penalty=2.0,
                    presence_penalty=0.5, frequency_penalty=0.25),
              state(prompt=[3, 3])]  # repetition 1: its prompt is not even listed
    prompt_rows, prompt_ids = flatten_prompt_tokens(states[:1])
    assert prompt_rows.tolist() == [0, 0] and prompt_ids.tolist() == [0, 1]
    rows, ids = flatten_output_tokens(states)
    out = apply_penalties_(logits.clone(), rows, ids, torch.tensor([2.0, 1.0]),
                           torch.tensor([0.5, 0.0]), torch.tensor([0.25, 0.0]),
                           prompt_rows, prompt_ids)
    expected = torch.tensor([[4.0 / 2 - 0.5 - 0.5, -2.0 * 2, 3.0, 1.0],
                             [4.0, -2.0, 3.0, 1.0]])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    fork = states[0].fork(1)
    assert fork.prompt_token_ids.tolist() == [0, 1, 0]
    assert fork.output_token_ids.tolist() == [0, 0]


def test_repetition_penalty_matches_hf_processor_over_a_greedy_run():
    """Greedy decoding over 12 steps of fixed random logits (a model that keeps proposing
    the same few tokens): our sampler and transformers' RepetitionPenaltyLogitsProcessor on
    input_ids = prompt + output pick the same tokens and penalise the same logits."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(11)
    vocab, prompt = 64, [3, 9, 9, 17, 40]
    step_logits = torch.randn(12, vocab, generator=gen) * 2
    step_logits[:, prompt] += 3.0  # prompt tokens tempting: only the prompt rule stops them
    for penalty in (1.8, 0.7):
        hf = RepetitionPenaltyLogitsProcessor(penalty)
        ours = state(prompt=prompt, temperature=0.0, repetition_penalty=penalty, logprobs=1)
        hf_ids, sampler = list(prompt), Sampler()
        for logits in step_logits:
            ref = hf(torch.tensor([hf_ids]), logits.unsqueeze(0).clone())
            out = sampler(logits.unsqueeze(0), [ours])
            assert int(out.token_ids[0]) == int(ref.argmax(-1))
            rows, ids = flatten_output_tokens([ours])
            p_rows, p_ids = flatten_prompt_tokens([ours])
            mine = apply_penalties_(logits.unsqueeze(0).clone(), rows, ids,
                                    torch.tensor([penalty]), torch.tensor([0.0]),
                                    torch.tensor([0.0]), p_rows, p_ids)
            torch.testing.assert_close(mine, ref, rtol=0, atol=0)
            ours.append(int(out.token_ids[0]))
            hf_ids.append(int(out.token_ids[0]))
        unpenalised = step_logits.argmax(-1).tolist()
        assert ours.output_token_ids.tolist() != unpenalised  # the penalty mattered


def test_sampler_applies_penalties_on_output_tokens_before_greedy_argmax():
    logits = torch.tensor([[3.0, 2.9, 2.0, 1.0]] * 4)
    states = [state(temperature=0.0),
              state(output=[0], temperature=0.0, repetition_penalty=1.1),
              state(output=[0, 1], temperature=0.0, presence_penalty=1.5),
              state(output=[0, 0, 0, 1], temperature=0.0, frequency_penalty=0.2)]
    assert sample(logits, states).token_ids.tolist() == [0, 1, 2, 1]
    assert logits[0, 0] == 3.0  # the caller's logits are left alone
