"""vLLM's `allowed_token_ids` and `bad_words` in the sampler (executor/sampler.py): exact
tokens for greedy rows, the support of random ones, bad words banned only while the
output ends with the rest of the word, masks that would leave no allowed token; and their
validation and tokenizing at the edge (router/validation.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pagedserve.executor.sampler import Sampler, row_work
from pagedserve.executor.sampling_state import SamplingState
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
from pagedserve.protos.wire import SamplingParams

torch.set_num_threads(1)
VOCAB = 40


def state(output=(), **params) -> SamplingState:
    return SamplingState(SamplingParams(**params), 0, np.asarray(output, np.int64))


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_a_greedy_row_takes_the_best_allowed_token_and_others_are_untouched():
    x = logits(3)
    allowed = (3, 17, 30)
    states = [state(temperature=0.0), state(temperature=0.0, allowed_token_ids=allowed),
              state(temperature=0.0, logprobs=2, allowed_token_ids=(5,))]
    out = Sampler()(x, states)
    best_allowed = allowed[int(x[1, list(allowed)].argmax())]
    assert out.token_ids.tolist() == [int(x[0].argmax()), best_allowed, 5]
    # logprobs stay those of the raw logits
    assert out.logprobs[2] == pytest.approx(float(torch.log_softmax(x[2], -1)[5]), abs=1e-5)


def test_random_rows_sample_only_allowed_tokens():
    allowed = (2, 9, 33)
    x = torch.zeros(400, VOCAB)  # flat: every token equally likely before the mask
    states = [state(temperature=1.0, seed=s, allowed_token_ids=allowed) for s in range(400)]
    tokens = Sampler()(x, states).token_ids
    assert set(tokens.tolist()) == set(allowed)


def test_a_one_token_bad_word_is_never_sampled():
    x = logits(1, seed=3)
    best = int(x[0].argmax())
    out = Sampler()(x, [state(temperature=0.0, bad_words_token_ids=((best,),))])
    assert out.token_ids[0] != best
    assert out.token_ids[0] == int(x[0].topk(2).indices[1])


def test_a_longer_bad_word_bans_its_last_token_only_after_the_rest():
    x = logits(1, seed=4)
    best = int(x[0].argmax())
    word = ((7, 8, best),)
    for output, banned in (((), False), ((8,), False), ((7,), False), ((1, 7, 8), True),
                           ((7, 8), True), ((7, 8, 9), False)):
        token = Sampler()(x, [state(output, temperature=0.0, bad_words_token_ids=word)])
        assert (token.token_ids[0] != best) == banned, output


def test_masks_that_would_leave_no_allowed_token_are_not_applied():
    """allowed {5} and a bad word [5]: the allowed tokens win (the sample takes 5); min_tokens
    masking the only allowed EOS likewise."""
    x = logits(2, seed=5)
    states = [state(temperature=0.0, allowed_token_ids=(5,), bad_words_token_ids=((5,),)),
              state(temperature=0.0, allowed_token_ids=(1,), eos_token_ids=(1,),
                    min_tokens=3)]
    assert Sampler()(x, states).token_ids.tolist() == [5, 1]
    work = row_work(states, VOCAB)
    assert work.mask_rows == [] and work.allowed_rows == [0, 1]
    # with another allowed token the ban holds
    s = state(temperature=0.0, allowed_token_ids=(5, 6), bad_words_token_ids=((5,),))
    assert Sampler()(x[:1], [s]).token_ids.tolist() == [6]


def test_restricted_rows_are_not_plain():
    """Neither is a plain row (the GPU's fast path skips the per-row pass); a bad word whose
    other tokens do not end the output masks nothing this step (the argmax is right)."""
    allowed = state(temperature=0.0, allowed_token_ids=(1,))
    assert not allowed.plain and not row_work([allowed], VOCAB).plain_greedy
    bad = state(temperature=0.0, bad_words_token_ids=((4, 2),))
    assert not bad.plain and row_work([bad], VOCAB).mask_rows == []
    bad = state((4,), temperature=0.0, bad_words_token_ids=((4, 2),))
    assert row_work([bad], VOCAB).mask_ids == [2]


# --------------------------------------------------------------------------- the edge


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from pagedserve.router.tokenizer import Tokenizer

    from pagedserve.tinymodels import build_model
    return Tokenizer.from_dir(build_model(tmp_path_factory.mktemp("m") / "llama", "llama"))


def _spec(tok, **params):
    from pagedserve.router.validation import Limits, request_from_pb

    request = pb.GenerateRequest(prompt="Once upon a time",
                                 params=pb.SamplingParams(max_tokens=4, **params))
    limits = Limits(vocab_size=tok.vocab_size, max_model_len=512)
    return request_from_pb(request, tokenizer=tok, limits=limits).sampling


def test_the_edge_tokenizes_bad_words_with_and_without_a_leading_space(tok):
    spec = _spec(tok, bad_words=["time", " time", "upon a"])
    want = []
    for text in ("time", " time", "upon a", " upon a"):
        ids = tuple(tok.encode(text, add_special_tokens=False))
        if ids not in want:
            want.append(ids)
    assert spec.bad_words_token_ids == tuple(want)
    assert _spec(tok, allowed_token_ids=[9, 3, 9]).allowed_token_ids == (3, 9)


def test_the_edge_refuses_bad_restrictions(tok):
    from pagedserve.router.errors import InvalidRequest

    for params, field in (({"allowed_token_ids": [tok.vocab_size]}, "allowed_token_ids"),
                          ({"bad_words": ["x", " "]}, "bad_words"),
                          ({"bad_words": ["w"] * 129}, "bad_words"),
                          ({"bad_words": ["w" * 1001]}, "bad_words")):
        with pytest.raises(InvalidRequest) as err:
            _spec(tok, **params)
        assert err.value.field == field


# --------------------------------------------------------------------------- against HF


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from pagedserve.tinymodels import build_model
    return build_model(tmp_path_factory.mktemp("hf") / "qwen2", "qwen2")


def _hf_greedy(model_dir, prompt, num_tokens, **generate_kw):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=num_tokens,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, output_logits=True,
                             return_dict_in_generate=True, **generate_kw)
    return out.sequences[0, len(prompt):].tolist(), [x[0] for x in out.logits]


def test_the_executor_matches_transformers_with_allowed_and_banned_tokens(model_dir):
    """Greedy through the executor with allowed_token_ids, and with one-token bad words,
    equal to transformers' generate with prefix_allowed_tokens_fn and bad_words_ids (which
    agree with vLLM's for one-token words)."""
    from pagedserve.executor.runner_setup import build_runner
    from test_executor_support import Driver, assert_greedy_equal

    prompt, n = [0, 17, 250, 33, 9, 480, 77, 5, 61], 10
    free, _ = _hf_greedy(model_dir, prompt, n)
    allowed = sorted({*free[1::2], *range(100, 140)})
    banned = sorted(set(free[:3]))
    cases = [
        ({"allowed_token_ids": tuple(allowed)},
         {"prefix_allowed_tokens_fn": lambda batch, ids: allowed}),
        ({"bad_words_token_ids": tuple((t,) for t in banned)},
         {"bad_words_ids": [[t] for t in banned]}),
    ]
    for ours, theirs in cases:
        driver = Driver(build_runner(str(model_dir), num_gpu_blocks=16, num_cpu_blocks=0,
                                     block_size=8, progress=False))
        driver.add("a", prompt, sampling=SamplingParams(temperature=0.0, **ours))
        driver.generate(["a"], n)
        ref, ref_logits = _hf_greedy(model_dir, prompt, n, **theirs)
        assert ref != free  # the restriction changed the text
        assert_greedy_equal(driver.seqs["a"].outputs, ref, ref_logits)
