"""Sampler: exact expectations for greedy, filters, keyed randomness, min_tokens, logprobs
and forks, a hypothesis property on the support and a chi-square on the distribution
(penalties: tests/test_penalties.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedserve.executor.sampler import Sampler, keyed_uniform
from pagedserve.executor.sampling_state import SamplingState
from pagedserve.kernels.reference import sample_from_probs_
from pagedserve.protos.wire import NewRequest, SamplingParams

torch.set_num_threads(1)
NEG_INF = float("-inf")


def state(output=(), sample_index=0, prompt=(), **params) -> SamplingState:
    return SamplingState(SamplingParams(**params), sample_index, np.asarray(output, np.int64),
                         np.asarray(prompt, np.int64))


def sample(logits, states):
    return Sampler()(torch.as_tensor(logits, dtype=torch.float32), states)


def drawn_tokens(logits_row, num_draws, **params) -> np.ndarray:
    """One row of logits repeated over ``num_draws`` seeds."""
    logits = torch.as_tensor(logits_row, dtype=torch.float32).repeat(num_draws, 1)
    return sample(logits, [state(seed=s, **params) for s in range(num_draws)]).token_ids


# --------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    logits = (torch.randn(37, 1001, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    out = Sampler()(logits, [state(temperature=0.0) for _ in range(37)])
    assert out.token_ids.dtype == np.int32
    np.testing.assert_array_equal(out.token_ids, logits.float().argmax(-1).numpy())
    assert np.isnan(out.logprobs).all() and (out.top_counts == 0).all()
    assert out.top_token_ids.shape == (0,) and out.top_logprobs.shape == (0,)


def test_plain_rows_take_a_precomputed_argmax():
    """``argmax=`` (a decode graph's greedy tokens): rows all plain greedy take them as the
    tokens, as given and copied (the graph's buffer is overwritten by its next replay);
    one row that samples otherwise (seeded, or with logprobs) and they are ignored; a
    wrong length is an error."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    given = torch.tensor([7, 3, 3, 9])  # not the logits' argmax: shows which was used
    sampler = Sampler()
    plain = [state(temperature=0.0) for _ in range(4)]
    sampled = sampler.launch(logits, plain, argmax=given)
    given[0] = 0
    np.testing.assert_array_equal(sampled.result().token_ids, [7, 3, 3, 9])
    for other in (state(temperature=1.0, seed=3), state(temperature=0.0, logprobs=1)):
        out = sampler.launch(logits, [*plain[:3], other], argmax=given).result()
        np.testing.assert_array_equal(out.token_ids[:3], logits.argmax(-1)[:3].numpy())
    with pytest.raises(ValueError, match="argmax of"):
        sampler.launch(logits, plain, argmax=given[:3])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_greedy_on_cuda_takes_the_16_bit_argmax_with_first_index_ties(dtype):
    """On a GPU the all-greedy step argmaxes the 16-bit logits without a float32 copy: the
    same tokens as float32's argmax, ties (many in 16 bits) to the first index, as on CPU."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(256, 151936, generator=gen) * 4).to(dtype)
    logits[:8, 100] = logits[:8, 7] = 60.0  # exact ties: index 7 wins
    states = [state(temperature=0.0) for _ in range(256)]
    on_gpu = Sampler()(logits.cuda(), states)
    np.testing.assert_array_equal(on_gpu.token_ids, logits.float().argmax(-1).numpy())
    assert (on_gpu.token_ids[:8] == 7).all()
    np.testing.assert_array_equal(on_gpu.token_ids, Sampler()(logits, states).token_ids)


def test_top_k_1_is_greedy_and_mixed_batches_keep_greedy_rows_exact():
    logits = torch.randn(64, 500, generator=torch.Generator().manual_seed(1)) * 3
    states = [state(temperature=1.5, top_k=1, seed=i) if i % 3 == 0 else
              state(temperature=0.0) if i % 3 == 1 else state(temperature=1.0, seed=i)
              for i in range(64)]
    out = Sampler()(logits, states)
    greedy = [i for i in range(64) if i % 3 != 2]
    np.testing.assert_array_equal(out.token_ids[greedy], logits.argmax(-1).numpy()[greedy])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_logits_read_as_they_are_sample_what_the_widened_copy_does(dtype):
    """``widen_logits=False`` (a GPU's default where no row asks for logprobs or a grammar:
    no float32 copy of the 16-bit logits): every kind of row — greedy, temperature alone
    (the draw divides), top-k, top-p, min-p, penalties, logit bias, a greedy and random mix
    (a subset of rows through the draw) — gets the token the widened copy gives."""
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(8, 700, generator=gen) * 3).to(dtype)
    batches = [
        [state(temperature=0.9, seed=i) for i in range(8)],
        [state(temperature=0.7, seed=i, top_k=20) for i in range(8)],
        [state(temperature=1.1, seed=i, top_p=0.8, min_p=0.05) for i in range(8)],
        [state(temperature=0.0 if i % 3 == 0 else 1.0, seed=i, output=[5, 6, 5],
               repetition_penalty=1.3 if i % 2 else 1.0, logit_bias_ids=(7,),
               logit_bias_values=(2.0,))
         for i in range(8)],
        [state(temperature=0.0 if i % 2 else 0.8, seed=i) for i in range(8)],
    ]
    for states in batches:
        tokens = {}
        for widen in (True, False):
            sampler = Sampler()
            sampler.widen_logits = widen
            tokens[widen] = sampler(logits, states).token_ids.tolist()
        assert tokens[False] == tokens[True]


def test_empty_batch():
    out = Sampler()(torch.zeros(0, 10), [])
    assert out.token_ids.shape == (0,) and out.logprobs.shape == (0,)


# --------------------------------------------------------------------------- filters


LOGITS = [4.0, 3.5, 3.0, 2.0, 1.0, 0.0, -1.0, NEG_INF]


def test_temperature_samples_every_finite_token_and_never_a_masked_one():
    seen = set(drawn_tokens(LOGITS, 4000, temperature=2.0).tolist())
    assert seen == set(range(7))


def test_top_k_support():
    assert set(drawn_tokens(LOGITS, 2000, top_k=3).tolist()) == {0, 1, 2}


def test_top_p_support():
    probs = torch.softmax(torch.tensor(LOGITS), -1)  # 0.44, 0.27, 0.16, 0.06, ...
    assert probs[:2].sum() < 0.75 < probs[:3].sum()
    assert set(drawn_tokens(LOGITS, 2000, top_p=0.75).tolist()) == {0, 1, 2}
    assert set(drawn_tokens(LOGITS, 500, top_p=0.3).tolist()) == {0}


def test_top_p_applies_after_top_k_and_temperature():
    # top_k=2 renormalises to (0.62, 0.38): top_p=0.6 keeps only token 0, 0.7 keeps both.
    assert set(drawn_tokens(LOGITS, 500, top_k=2, top_p=0.6).tolist()) == {0}
    assert set(drawn_tokens(LOGITS, 500, top_k=2, top_p=0.7).tolist()) == {0, 1}
    # temperature 10 flattens it: probs 0.176, 0.167, 0.159, 0.144, ... so 0.55 needs 4 tokens
    assert set(drawn_tokens(LOGITS, 3000, temperature=10.0, top_p=0.55).tolist()) == {0, 1, 2, 3}


def test_top_p_past_the_first_candidates_sorts_the_whole_row():
    logits = torch.zeros(4000)
    logits[:10] = 1.0  # a flat row: the 0.9-nucleus has ~3,600 tokens, beyond the first 256
    tokens = drawn_tokens(logits, 3000, top_p=0.9)
    probs = torch.softmax(logits, -1).sort(descending=True).values
    nucleus = int((probs.cumsum(0) - probs < 0.9).sum())
    assert 256 < nucleus < 4000
    # every zero logit is tied, so the threshold keeps them all (ties are kept together)
    assert tokens.max() > 256


def test_masked_tokens_stay_impossible_when_the_spread_underflows_exp():
    logits = [NEG_INF, 100.0, -100.0, 99.9, NEG_INF]
    assert set(drawn_tokens(logits, 500, temperature=0.05).tolist()) == {1, 3}
    assert set(drawn_tokens(logits, 500, temperature=0.001).tolist()) == {1}


def test_min_p_support():
    # probs relative to the max: 1, 0.61, 0.37, 0.14, 0.05, ...
    assert set(drawn_tokens(LOGITS, 2000, min_p=0.3).tolist()) == {0, 1, 2}
    assert set(drawn_tokens(LOGITS, 2000, min_p=0.1).tolist()) == {0, 1, 2, 3}


def test_zero_probability_tokens_are_never_drawn_even_when_u_is_almost_one():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0], [0.0, 0.0, 1e-30, 0.0, 0.0, 0.0]])
    u = torch.tensor([1.0 - 2.0 ** -53, 1.0 - 2.0 ** -53], dtype=torch.float64)
    assert sample_from_probs_(probs.clone(), u).tolist() == [3, 2]
    u = torch.tensor([2.0 ** -54, 2.0 ** -54], dtype=torch.float64)
    assert sample_from_probs_(probs.clone(), u).tolist() == [1, 2]


# --------------------------------------------------------------------------- keyed randomness


def test_a_row_with_nothing_allowed_gets_token_0_not_one_past_the_vocabulary():
    """Every logit -inf (nothing allowed): the draw's search would run past the row; the
    sampler answers token 0 (in range) for it and samples the other rows as usual (the
    device's draw does the same: tests/test_draw_ops.py)."""
    logits = torch.full((3, 40), NEG_INF)
    logits[0, 7] = logits[2, 30] = 1.0
    out = sample(logits, [state(temperature=1.0, seed=s) for s in range(3)])
    assert out.token_ids.tolist() == [7, 0, 30]


def test_same_key_same_token_whatever_the_batch():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(16, 300, generator=gen)
    states = [state(output=[5] * (i % 4), sample_index=i % 3, seed=100 + i,
                    temperature=0.9, top_k=0 if i % 2 else 50, top_p=1.0 if i % 5 else 0.8)
              for i in range(16)]
    alone = np.array([sample(logits[i:i + 1], [states[i]]).token_ids[0] for i in range(16)])
    together = sample(logits, states).token_ids
    perm = np.random.default_rng(0).permutation(16)
    shuffled = sample(logits[perm], [states[i] for i in perm]).token_ids
    others = torch.randn(8, 300, generator=gen)
    padded = sample(torch.cat([others, logits]),
                    [state(temperature=0.0)] * 4 + [state(seed=7)] * 4 + states).token_ids
    np.testing.assert_array_equal(alone, together)
    np.testing.assert_array_equal(together[perm], shuffled)
    np.testing.assert_array_equal(together, padded[8:])


def run(states, logits, steps):
    """Sample ``steps`` tokens for every state, appending each; returns [steps, R]."""
    sampler, tokens = Sampler(), []
    for _ in range(steps):
        out = sampler(logits, states)
        for s, t in zip(states, out.token_ids, strict=True):
            s.append(int(t))
        tokens.append(out.token_ids)
    return np.stack(tokens)


def test_different_sample_index_gives_different_streams_and_same_index_repeats():
    logits = torch.zeros(4, 1000)
    streams = run([state(sample_index=i % 2, seed=9) for i in range(4)], logits, 30)
    np.testing.assert_array_equal(streams[:, 0], streams[:, 2])
    assert (streams[:, 0] != streams[:, 1]).sum() > 25
    other_seed = run([state(seed=10)], logits[:1], 30)[:, 0]
    assert (other_seed != streams[:, 0]).sum() > 25


def test_preempted_request_rebuilt_from_the_plan_samples_the_same_tokens():
    logits = torch.randn(1, 200, generator=torch.Generator().manual_seed(3))
    params = dict(seed=42, temperature=1.3, repetition_penalty=1.2, presence_penalty=0.3,
                  frequency_penalty=0.1)
    prompt = np.arange(5, dtype=np.int32)
    full = run([state(sample_index=1, prompt=prompt, **params)], logits, 20)[:, 0]
    first = run([state(sample_index=1, prompt=prompt, **params)], logits, 8)[:, 0]
    req = NewRequest(request_id="r", prompt_token_ids=prompt,
                     output_token_ids=first.astype(np.int32),
                     sampling=SamplingParams(**params), sample_index=1)
    rebuilt = SamplingState.from_new_request(req)
    assert rebuilt.num_output_tokens == 8
    assert rebuilt.prompt_token_ids.tolist() == prompt.tolist()
    rest = run([rebuilt], logits, 12)[:, 0]
    np.testing.assert_array_equal(full, np.concatenate([first, rest]))


def test_keyed_uniform_is_uniform_over_positions_and_seeds():
    n = 200_000
    for u in (keyed_uniform([7] * n, [0] * n, range(n)),
              keyed_uniform(range(n), [3] * n, [0] * n),
              keyed_uniform([7] * n, range(n), [5] * n)):
        assert ((u > 0) & (u < 1)).all()
        counts = np.bincount((u * 100).astype(int), minlength=100)
        chi2 = ((counts - n / 100) ** 2 / (n / 100)).sum()
        assert chi2 < 160  # df=99: p ~ 1e-4
        assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.01
    assert keyed_uniform([2 ** 64 - 1], [0], [0])[0] == keyed_uniform([-1], [0], [0])[0]


def test_keyed_uniform_takes_each_values_low_64_bits_in_one_conversion_or_the_slow_way():
    """Values in [0, 2^64) convert at once; any other int (negative, wider) is taken mod
    2^64 as before, and a pinned value keeps the draw every executor made for it."""
    from pagedserve.executor.sampler import _low_64_bits
    wide = [0, 1, -1, -2 ** 63, 2 ** 63, 2 ** 64 - 1, 2 ** 64, 2 ** 70 + 5, -2 ** 70]
    assert _low_64_bits(wide).tolist() == [v % 2 ** 64 for v in wide]
    assert _low_64_bits(np.array([-1, 5], np.int64)).tolist() == [2 ** 64 - 1, 5]
    assert _low_64_bits(range(3)).tolist() == [0, 1, 2]
    u = keyed_uniform([1234, 2 ** 64 + 1234], [0, 0], [7, 7])
    assert u[0] == u[1] and u[0] == pytest.approx(float(keyed_uniform([1234], [0], [7])[0]))


@pytest.mark.parametrize("params, logits", [
    (dict(temperature=1.0), [2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 1.5]),
    (dict(temperature=0.7, top_k=5), [2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 1.5]),
    (dict(temperature=1.0, min_p=0.2, top_p=0.95), [2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 1.5]),
])
def test_keyed_sampling_matches_the_filtered_softmax(params, logits):
    n = 20_000
    x = torch.tensor(logits) / params["temperature"]
    probs = torch.softmax(x, -1)
    if params.get("top_k"):
        probs[probs < probs.topk(params["top_k"]).values[-1]] = 0
    probs /= probs.sum()
    if params.get("top_p"):
        desc, order = probs.sort(descending=True)
        drop = order[desc.cumsum(0) - desc >= params["top_p"]]
        probs[drop] = 0
    if params.get("min_p"):
        probs[probs < params["min_p"] * probs.max()] = 0
    expected = (probs / probs.sum()).numpy() * n
    counts = np.bincount(drawn_tokens(logits, n, **params), minlength=len(logits))
    assert (counts[expected == 0] == 0).all()
    keep = expected > 0
    chi2 = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    assert chi2 < 30  # df <= 7: p ~ 1e-4


# --------------------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]] * 5)
    common = dict(temperature=0.0, min_tokens=2, eos_token_ids=(0,), stop_token_ids=(1,))
    states = [state(output=[], **common), state(output=[3], **common),
              state(output=[3, 3], **common), state(output=[], ignore_eos=True, **common),
              state(output=[], temperature=0.0, ignore_eos=True, eos_token_ids=(0,))]
    assert sample(logits, states).token_ids.tolist() == [2, 2, 0, 0, 0]


def test_min_tokens_masking_holds_for_random_rows():
    tokens = drawn_tokens([5.0, 5.0, 0.0, 0.0], 500, min_tokens=1, eos_token_ids=(0,),
                          stop_token_ids=(1, 99))
    assert set(tokens.tolist()) == {2, 3}


# --------------------------------------------------------------------------- logprobs


def test_logprobs_are_the_raw_log_softmax_with_top_k_in_order():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 50, generator=gen) * 2
    states = [state(logprobs=3, temperature=0.5, output=[1, 2], repetition_penalty=1.5),
              state(temperature=0.0),
              state(logprobs=0, seed=3),
              state(logprobs=5, temperature=0.0, presence_penalty=2.0, output=[7]),
              state(logprobs=1, top_k=3, seed=1)]
    out = Sampler()(logits, states)
    raw = torch.log_softmax(logits, -1)
    assert out.top_counts.tolist() == [3, 0, 0, 5, 1]
    assert out.logprobs.dtype == np.float32 and np.isnan(out.logprobs[1])
    for i in (0, 2, 3, 4):
        assert out.logprobs[i] == pytest.approx(raw[i, out.token_ids[i]].item(), abs=1e-6)
    start = 0
    for i, k in enumerate(out.top_counts):
        top = raw[i].topk(int(k)) if k else None
        if k:
            np.testing.assert_array_equal(out.top_token_ids[start:start + k], top.indices)
            np.testing.assert_allclose(out.top_logprobs[start:start + k], top.values, atol=1e-6)
            assert (np.diff(out.top_logprobs[start:start + k]) <= 0).all()
        start += k
    assert out.top_token_ids.dtype == np.int32 and out.top_logprobs.dtype == np.float32
    assert start == out.top_token_ids.shape[0] == out.top_logprobs.shape[0]


# --------------------------------------------------------------------------- state


def test_state_append_grows_and_fork_copies():
    parent = state(output=[1, 2, 3], sample_index=0, seed=5)
    for t in range(40):
        parent.append(t)
    assert parent.num_output_tokens == 43
    assert parent.output_token_ids.tolist() == [1, 2, 3] + list(range(40))
    child = parent.fork(sample_index=2)
    assert child.sample_index == 2 and child.params is parent.params
    assert child.output_token_ids.tolist() == parent.output_token_ids.tolist()
    child.append(99)
    assert parent.num_output_tokens == 43 and child.num_output_tokens == 44
    with pytest.raises(ValueError):
        parent.output_token_ids[0] = 7
    logits = torch.zeros(1, 1000)
    assert sample(logits, [parent]).token_ids[0] != sample(logits, [parent.fork(1)]).token_ids[0]


# --------------------------------------------------------------------------- property


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    vocab=st.integers(2, 40),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.5]),
    top_k=st.sampled_from([-1, 0, 1, 2, 5, 100]),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1]),
    min_p=st.sampled_from([0.0, 0.05, 0.5]),
    repetition=st.sampled_from([1.0, 1.3, 0.8]),
    presence=st.sampled_from([0.0, 1.0, -0.5]),
    frequency=st.sampled_from([0.0, 0.4]),
    min_tokens=st.integers(0, 3),
    seed=st.integers(0, 2 ** 64 - 1),
)
def test_sampled_token_is_always_in_the_allowed_support(
        data, vocab, temperature, top_k, top_p, min_p, repetition, presence, frequency,
        min_tokens, seed):
    logits = torch.tensor(data.draw(st.lists(
        st.floats(-20, 20, allow_nan=False, width=32), min_size=vocab, max_size=vocab)))
    output = data.draw(st.lists(st.integers(0, vocab - 1), max_size=5))
    prompt = data.draw(st.lists(st.integers(0, vocab - 1), max_size=5))
    eos = (0,)
    stop = (vocab - 1,) if vocab > 2 else ()
    s = state(output=output, prompt=prompt, seed=seed, temperature=temperature, top_k=top_k, top_p=top_p,
              min_p=min_p, repetition_penalty=repetition, presence_penalty=presence,
              frequency_penalty=frequency, min_tokens=min_tokens, eos_token_ids=eos,
              stop_token_ids=stop, logprobs=2)
    token = int(sample(logits.unsqueeze(0), [s]).token_ids[0])

    # reference in float64: penalties (repetition over prompt and output, once per token;
    # frequency and presence over the output), min_tokens mask, then the filters' conditions
    x = logits.double().clone()
    for t in set(prompt) | set(output):
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    counts = np.bincount(output, minlength=vocab)
    for t in np.nonzero(counts)[0]:
        x[t] -= frequency * counts[t] + presence
    if len(output) < min_tokens:
        x[list(eos + stop)] = NEG_INF
    assert math.isfinite(x[token])
    tol = 1e-4
    if temperature == 0.0 or top_k == 1:
        assert x[token] >= x.max() - tol
        return
    x = x / temperature
    if 0 < top_k < vocab:
        assert (x > x[token] + tol).sum() < top_k
        x[x < x.topk(top_k).values[-1] - tol] = NEG_INF
    probs = torch.softmax(x, -1)
    assert probs[probs > probs[token] + tol].sum() < top_p + tol
    assert probs[token] >= min_p * probs.max() - tol


_PARAM_FIELDS = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 1e-6, 0.7, 1.0]),
    "top_k": st.sampled_from([0, 1, 5]),
    "repetition_penalty": st.sampled_from([1.0, 1.2]),
    "presence_penalty": st.sampled_from([0.0, 0.5]),
    "frequency_penalty": st.sampled_from([0.0, -0.3]),
    "min_tokens": st.sampled_from([0, 2]),
    "logit_bias_ids": st.sampled_from([(), (3,)]),
    "logprobs": st.sampled_from([None, 0, 2]),
    "eos_token_ids": st.sampled_from([(), (1,)]),
    "allowed_token_ids": st.sampled_from([(), (2, 4)]),
    "bad_words_token_ids": st.sampled_from([(), ((5,),), ((3, 6),)]),
})


@given(fields=_PARAM_FIELDS, outputs=st.lists(st.integers(0, 9), max_size=4),
       prompt=st.lists(st.integers(0, 9), max_size=4))
@settings(max_examples=300, deadline=None)
def test_a_plain_state_asks_nothing_of_the_per_row_pass(fields, outputs, prompt):
    """The GPU fast path trusts `SamplingState.plain` (one flag a row) instead of the
    per-row pass (`row_work`): a plain state must be one the pass finds nothing to do for,
    whatever its tokens; and the flag is exactly greedy with no penalty, min_tokens, bias or
    logprobs asked for."""
    from pagedserve.executor.sampler import row_work

    bias = {"logit_bias_values": (1.5,) * len(fields["logit_bias_ids"])}
    params = SamplingParams(**fields, **bias)
    state = SamplingState(params, output_token_ids=outputs, prompt_token_ids=prompt)
    expected = ((fields["temperature"] < 1e-5 or fields["top_k"] == 1)
                and fields["repetition_penalty"] == 1.0 and not fields["presence_penalty"]
                and not fields["frequency_penalty"] and not fields["min_tokens"]
                and not fields["logit_bias_ids"] and fields["logprobs"] is None
                and not fields["allowed_token_ids"] and not fields["bad_words_token_ids"])
    assert state.plain == expected
    if state.plain:
        assert row_work([state], vocab=10).plain_greedy
        state.grammar = object()  # a constrained row is never plain
        assert not state.plain
