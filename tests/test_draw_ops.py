"""The keyed inverse-CDF draw (kernels/draw_ops.py) against its twin (reference.keyed_draw_),
under TRITON_INTERPRET=1 on CPU (natively on a GPU): the same token on seeded rows — flat and
peaked, ties, -inf from top-k / top-p, one token left, min_p, several chunks a row and one —
at keys from the smallest to the largest the sampler makes (u * total rounded up to the
total: the last token with mass); never a token of probability 0; and the frequencies of a
known distribution."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedserve.kernels import draw_ops, ops, reference

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
U_SMALLEST, U_LARGEST = 0.5 * 2.0 ** -53, 1.0 - 2.0 ** -54  # keyed_uniform's range


def _rows(num_rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.05, 0.5, 2.0, 6.0, 30.0])[torch.arange(num_rows) % 5].unsqueeze(1)
    x = torch.randn(num_rows, vocab, generator=gen) * scale
    x[1::6] = x[1::6].round()  # ties
    x[2::6, : vocab // 3] = float("-inf")  # what top-k leaves
    x[3::6, 1:] = float("-inf")  # one token left (at index 0)
    x[4::6, : vocab - 1] = float("-inf")  # one token left (the last)
    return x


def _draw(x, min_p, u, device, backend, chunk=None, floor=None):
    x, u = x.to(device), u.to(device)
    min_p = None if min_p is None else min_p.to(device)
    floor = None if floor is None else floor.to(device)
    if backend == "twin":
        return ops.keyed_draw_(x.clone(), min_p, u, floor=floor, backend="torch").cpu()
    if chunk is None:
        return ops.keyed_draw_(x, min_p, u, floor=floor, backend="triton").cpu()
    return draw_ops.keyed_draw_triton(x, min_p, u, floor=floor, chunk=chunk).cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab, chunk", [(1000, 64), (600, 1024), (2051, 128)])
@pytest.mark.parametrize("with_min_p", [False, True])
@pytest.mark.parametrize("with_floor", [False, True])
def test_draw_matches_twin(device, vocab, chunk, with_min_p, with_floor):
    """``floor`` (a top-p threshold a row, -inf for rows without): the values below it
    excluded as the twin's fill excludes them."""
    rows = 12
    x = _rows(rows, vocab, seed=vocab + with_min_p)
    gen = torch.Generator().manual_seed(7)
    u = torch.rand(rows, generator=gen, dtype=torch.float64)
    u[0], u[5], u[6], u[11] = U_SMALLEST, U_LARGEST, U_LARGEST, U_SMALLEST
    min_p = None
    if with_min_p:
        min_p = torch.tensor([0.0, 0.05, 0.3, 0.0] * 3, dtype=torch.float32)
    floor = None
    if with_floor:  # the row's 90th percentile of its finite values, or none
        floor = torch.tensor([torch.quantile(r[torch.isfinite(r)], 0.9).item() if i % 3
                              else float("-inf") for i, r in enumerate(x)])
    got = _draw(x, min_p, u, device, "triton", chunk, floor)
    want = _draw(x, min_p, u, device, "twin", floor=floor)
    assert got.tolist() == want.tolist()
    assert torch.isfinite(x[torch.arange(rows), got]).all()  # never an excluded token
    if floor is not None:
        assert (x[torch.arange(rows), got] >= floor).all()
    assert got[3] == 0 and got[4] == vocab - 1  # the one token left


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # -inf - -inf, on purpose
@pytest.mark.parametrize("device", DEVICES)
def test_draw_at_the_ends_of_the_key_range(device):
    """The smallest key takes the first token with mass; the largest (u * total rounded up
    to the total) the last token with mass, whichever chunk holds it."""
    vocab = 700
    x = torch.full((4, vocab), float("-inf"))
    x[:, [3, 130, 131, 500]] = torch.tensor([0.0, 1.0, -1.0, 2.0])
    x[2:, 500] = float("-inf")  # the last token with mass is 131, in a middle chunk
    u = torch.tensor([U_SMALLEST, U_LARGEST, U_SMALLEST, U_LARGEST], dtype=torch.float64)
    got = _draw(x, None, u, device, "triton", chunk=64)
    assert got.tolist() == [3, 500, 3, 131]
    assert got.tolist() == _draw(x, None, u, device, "twin").tolist()
    # a row with nothing left (every logit -inf): token 0 from both, never an unset one
    x[1] = float("-inf")
    assert _draw(x, None, u, device, "triton", chunk=64).tolist()[1] == 0
    assert _draw(x, None, u, device, "twin").tolist()[1] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_draw_frequencies_follow_the_probabilities(device):
    """Keys evenly spread over (0, 1) draw each token in proportion to its probability."""
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
    n = 128
    x = torch.full((n, 64), float("-inf"))
    x[:, [0, 17, 40, 41, 63]] = probs.log()
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    got = _draw(x, None, u, device, "triton", chunk=16)
    counts = torch.bincount(got, minlength=64)[[0, 17, 40, 41, 63]]
    assert counts.tolist() == (probs * n).round().long().tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pick_rows", [False, True])
def test_draw_divides_by_the_temperature_itself(device, dtype, pick_rows):
    """``temperature=`` (and ``rows=``): the logits as the model left them (16-bit too),
    each row divided by its temperature inside the draw, no tempered copy written; the
    twin's tokens (which divide into a buffer as the sampler did)."""
    logits = _rows(10, 900, seed=3).to(dtype)
    gen = torch.Generator().manual_seed(5)
    rows = torch.tensor([9, 0, 4, 7, 3, 2]) if pick_rows else None
    n = 6 if pick_rows else 10
    temperature = torch.rand(n, generator=gen) * 1.5 + 0.05
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    u[0] = U_LARGEST
    min_p = torch.tensor([0.0, 0.2] * (n // 2))
    draws = {}
    for backend in ("triton", "torch"):
        draws[backend] = ops.keyed_draw_(
            logits.to(device), min_p.to(device), u.to(device),
            temperature=temperature.to(device),
            rows=None if rows is None else rows.to(device), backend=backend).cpu()
    assert draws["triton"].tolist() == draws["torch"].tolist()
    picked = logits if rows is None else logits[rows]
    assert torch.isfinite(picked.float()[torch.arange(n), draws["triton"]]).all()


def test_draw_rejects_bad_inputs():
    x = torch.zeros(2, 8)
    u = torch.full((2,), 0.5, dtype=torch.float64)
    with pytest.raises(ValueError, match="float32"):
        draw_ops.keyed_draw_triton(x.double(), None, u)
    with pytest.raises(ValueError, match="float tensor"):
        draw_ops.keyed_draw_triton(x.double(), None, u, temperature=torch.ones(2))
    with pytest.raises(ValueError, match="u must be float64"):
        draw_ops.keyed_draw_triton(x, None, u.float())
    with pytest.raises(ValueError, match="min_p"):
        draw_ops.keyed_draw_triton(x, torch.zeros(3), u)
    with pytest.raises(ValueError, match="rows= only with temperature="):
        draw_ops.keyed_draw_triton(x, None, u, rows=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="temperature must be float32"):
        draw_ops.keyed_draw_triton(x, None, u, temperature=torch.ones(3))
    with pytest.raises(ValueError, match="u must be float64 \\[3\\]"):
        draw_ops.keyed_draw_triton(x, None, u, temperature=torch.ones(3),
                                   rows=torch.tensor([0, 1, 1]))
    with pytest.raises(ValueError, match="floor must be float32"):
        draw_ops.keyed_draw_triton(x, None, u, floor=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="power of two"):
        draw_ops.keyed_draw_triton(x, None, u, chunk=100)
    assert draw_ops.keyed_draw_triton(torch.zeros(0, 8), None,
                                      torch.zeros(0, dtype=torch.float64)).shape == (0,)


@settings(max_examples=25, deadline=None)
@given(data=st.data(), vocab=st.integers(1, 200), chunk=st.sampled_from([16, 64]),
       with_min_p=st.booleans())
def test_any_row_draws_a_token_whose_cdf_step_holds_the_key(data, vocab, chunk, with_min_p):
    """On any rows (values from a few levels, so ties and equal masses are common; tokens
    excluded at random), the kernel's token has probability > 0 and its step of the
    cumulative distribution, in float64, holds u * total up to float32 rounding: a valid
    inverse-CDF answer, whichever order the sums were taken in."""
    rows = data.draw(st.integers(1, 3))
    levels = st.sampled_from([float("-inf"), -3.0, 0.0, 0.5, 2.0])
    values = data.draw(st.lists(levels, min_size=rows * vocab, max_size=rows * vocab))
    x = torch.tensor(values, dtype=torch.float32).view(rows, vocab)
    x[:, data.draw(st.integers(0, vocab - 1))] = 1.0  # at least one token allowed a row
    u = torch.tensor(data.draw(st.lists(st.floats(U_SMALLEST, U_LARGEST), min_size=rows,
                                        max_size=rows)), dtype=torch.float64)
    min_p = torch.full((rows,), 0.3) if with_min_p else None
    got = draw_ops.keyed_draw_triton(x, min_p, u, chunk=chunk)
    probs = reference.exp_relative_to_max_(x.clone())
    if min_p is not None:
        probs[probs < 0.3] = 0.0
    cdf = probs.double().cumsum(-1)
    for r, token in enumerate(got.tolist()):
        assert probs[r, token] > 0
        total = cdf[r, -1].item()
        target, slack = u[r].item() * total, 4e-7 * total
        below = cdf[r, token - 1].item() if token else 0.0
        assert below - slack <= target <= cdf[r, token].item() + slack
