"""The whole-row top-p threshold (kernels/sampling_ops.py) against its twin, a full sort, under
TRITON_INTERPRET=1 on CPU (natively on a GPU): the same thresholds on seeded rows (flat and
peaked, ties, -inf from top-k, one and several vocabulary tiles); on any rows hypothesis
makes, the nucleus definition itself (the two sum the masses in different orders, so they
may part where a prefix's mass is within rounding of top_p)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedserve.executor.sampler import top_p_thresholds
from pagedserve.kernels import ops, reference, sampling_ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter on CPU; natively on a GPU (the GPU check runs only `gpu`-marked tests).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _rows(num_rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.05, 0.5, 2.0, 6.0])[torch.arange(num_rows) % 4].unsqueeze(1)
    logits = torch.randn(num_rows, vocab, generator=gen) * scale
    logits[1::5] = logits[1::5].round()  # many ties
    logits[2::5, : vocab // 3] = float("-inf")  # what top-k leaves
    return logits


def _thresholds(logits: torch.Tensor, top_p: torch.Tensor, unresolved: torch.Tensor,
                backend: str, radix_bits: int | None = None,
                device: str = DEVICE, chunks: int = 1) -> torch.Tensor:
    logits, top_p, unresolved = logits.to(device), top_p.to(device), unresolved.to(device)
    lse = torch.logsumexp(logits, -1, keepdim=True)
    thresholds = torch.full((logits.shape[0], 1), -7.0, device=device)  # "settled" marker
    if radix_bits is None:
        ops.top_p_thresholds_(logits, lse, top_p, thresholds, unresolved, backend=backend)
    else:
        sampling_ops.top_p_thresholds_triton(logits, lse, top_p, thresholds, unresolved,
                                             reference.EXP_FLOOR, radix_bits=radix_bits,
                                             chunks=chunks)
    return thresholds.cpu()


@pytest.mark.parametrize("radix_bits", [1, 2, 4])
@pytest.mark.parametrize("vocab", [700, 5000])  # one tile; two or five tiles
def test_kernel_equals_a_full_sort(vocab, radix_bits):
    logits = _rows(20, vocab, seed=vocab)
    top_p = torch.linspace(0.02, 0.999, 20)
    unresolved = torch.ones(20, dtype=torch.bool)
    unresolved[[3, 11]] = False
    got = _thresholds(logits, top_p, unresolved, "triton", radix_bits)
    want = _thresholds(logits, top_p, unresolved, "torch")
    assert torch.equal(got, want)
    assert got[3].item() == got[11].item() == -7.0  # settled rows are left as they were


@pytest.mark.parametrize("radix_bits, chunks", [(2, 3), (4, 8)])
@pytest.mark.parametrize("vocab", [700, 5000])
def test_kernel_over_pieces_of_a_row_equals_a_full_sort(vocab, radix_bits, chunks):
    """``chunks``: each row spread over that many programs, one launch a pass, every
    program reducing the previous pass's per-piece masses itself: the same thresholds as
    the sort, settled rows untouched."""
    logits = _rows(8, vocab, seed=vocab + chunks)
    top_p = torch.linspace(0.02, 0.999, 8)
    unresolved = torch.ones(8, dtype=torch.bool)
    unresolved[5] = False
    got = _thresholds(logits, top_p, unresolved, "triton", radix_bits, chunks=chunks)
    assert torch.equal(got, _thresholds(logits, top_p, unresolved, "torch"))
    assert got[5].item() == -7.0


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(st.sampled_from([-3.0, -1.0, -0.5, 0.0, 0.25, 0.5, 2.0, float("-inf")]),
                    min_size=2, max_size=40),
    top_p=st.floats(0.01, 0.999),
    scale=st.sampled_from([0.1, 1.0, 7.0]),
    search=st.sampled_from([(1, 1), (2, 1), (4, 1), (2, 3), (4, 5)]),  # (radix bits, pieces)
)
def test_kernel_threshold_is_the_nucleus(values, top_p, scale, search):
    """t* is a logit of the row, the mass strictly above it is < top_p and the mass from it
    up is >= top_p (float64 masses, to rounding)."""
    logits = torch.tensor(values) * scale
    if torch.isinf(logits).all():
        logits[0] = 0.0
    got = _thresholds(logits.unsqueeze(0), torch.tensor([top_p]),
                      torch.tensor([True]), "triton", search[0], chunks=search[1])[0, 0].item()
    assert got in logits.tolist()
    mass = torch.softmax(logits.double(), 0)
    above, from_it = mass[logits > got].sum().item(), mass[logits >= got].sum().item()
    assert above < top_p + 1e-6 and from_it > top_p - 1e-6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("radix_bits", [1, 2, 4])
@pytest.mark.parametrize("chunks", [1, 3])
def test_kernel_resolves_neighbouring_floats(radix_bits, device, chunks):
    """The search ends on the exact key: logits one float apart are told apart (the next
    float below 1.0 falls outside a nucleus that 1.0 fills alone), and a tie is kept whole."""
    one = torch.tensor(1.0)
    below, above = torch.nextafter(one, one - 1).item(), torch.nextafter(one, one + 1).item()
    logits = torch.tensor([[1.0, below, -4.0, -4.0, -9.0],  # key of 1.0 even,
                           [above, 1.0, -4.0, -4.0, -9.0],  # of the next float odd
                           [1.0, 1.0, below, -4.0, -9.0]])
    top_p, flags = torch.full((3,), 0.3), torch.ones(3, dtype=torch.bool)
    got = _thresholds(logits, top_p, flags, "triton", radix_bits, device, chunks)
    assert got[:, 0].tolist() == [1.0, above, 1.0]
    assert torch.equal(got, _thresholds(logits, top_p, flags, "torch", device=device))


def apply_top_p_(logits: torch.Tensor, top_p: torch.Tensor, backend: str) -> torch.Tensor:
    """In place: the nucleus kept (the sampler's `top_p_thresholds`), every other logit
    -inf (what the sampler's twin fills; a GPU's draw applies the threshold as a floor)."""
    thresholds = top_p_thresholds(logits, top_p, backend=backend)
    return logits.masked_fill_(logits < thresholds, float("-inf"))


def test_sampler_top_p_same_tokens_kept_with_the_kernel():
    """apply_top_p_ with rows whose nucleus reaches past the first 256 tokens (flat rows of a
    512-token vocabulary) and rows it settles (peaked): the kernel's masks equal the sort's."""
    logits = _rows(8, 512, seed=3).to(DEVICE)
    top_p = torch.tensor([0.9, 0.95, 0.5, 0.99, 0.3, 0.9, 0.8, 0.999], device=DEVICE)
    kernel = apply_top_p_(logits.clone(), top_p, backend="triton")
    twin = apply_top_p_(logits.clone(), top_p, backend="torch")
    assert torch.equal(torch.isinf(kernel), torch.isinf(twin))
    kept = (~torch.isinf(kernel)).sum(-1)
    assert kept[0].item() > 256  # a flat row: the whole-row path decided it


def test_launcher_rejects_bad_inputs():
    logits = torch.zeros(2, 10)
    lse, thresholds = torch.zeros(2, 1), torch.zeros(2, 1)
    p, flags = torch.ones(2), torch.ones(2, dtype=torch.bool)
    with pytest.raises(ValueError, match="float32"):
        ops.top_p_thresholds_(logits.half(), lse, p, thresholds, flags, backend="triton")
    with pytest.raises(ValueError, match="one value per row"):
        ops.top_p_thresholds_(logits, torch.zeros(3, 1), p, thresholds, flags, backend="triton")
    with pytest.raises(ValueError, match=r"\[2\]"):
        ops.top_p_thresholds_(logits, lse, torch.ones(3), thresholds, flags, backend="triton")
    with pytest.raises(ValueError, match="radix_bits"):
        sampling_ops.top_p_thresholds_triton(logits, lse, p, thresholds, flags, -87.0,
                                             radix_bits=3)


def test_twin_threshold_of_sorted_rows():
    """The twin's rule on one row by hand: masses 0.5, 0.25, 0.25 (ties of the last two)."""
    desc = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    lse = torch.zeros(1, 1)
    for p, value, kept in ((0.4, 0.5, 1), (0.5, 0.5, 1), (0.6, 0.25, 2), (0.8, 0.25, 3)):
        threshold, n_keep = reference.top_p_threshold(desc, lse, torch.tensor([p]))
        assert threshold.exp().item() == pytest.approx(value) and n_keep.item() == kept


@pytest.mark.gpu
@pytest.mark.parametrize("radix_bits, chunks", [(None, 1), (2, 32), (4, 64)])
def test_kernel_at_a_real_vocabulary_gpu(radix_bits, chunks):
    """151,936 logits a row (Qwen2.5's vocabulary), natively, one program a row and spread
    over pieces: every threshold is a logit of its row and satisfies the nucleus definition
    to float rounding (with ~10^5 tokens a prefix's mass steps by ~10^-5, so the kernel and
    the sort may part on a token at the edge: counted, not required equal); rows marked
    settled are not touched."""
    logits = _rows(64, 151_936, seed=5)
    top_p = torch.linspace(0.05, 0.99, 64)
    unresolved = torch.ones(64, dtype=torch.bool)
    unresolved[::9] = False
    got = _thresholds(logits, top_p, unresolved, "triton", radix_bits, chunks=chunks)
    want = _thresholds(logits, top_p, unresolved, "torch")
    assert (got[~unresolved] == -7.0).all()
    mass = torch.softmax(logits.double(), -1)
    for r in unresolved.nonzero().squeeze(1).tolist():
        t = got[r, 0].item()
        assert (logits[r] == t).any()
        above, from_it = mass[r][logits[r] > t].sum().item(), mass[r][logits[r] >= t].sum().item()
        assert above < top_p[r].item() + 1e-5 and from_it > top_p[r].item() - 1e-5, r
    assert (got != want).sum().item() <= 8


def test_startup_check_keeps_or_drops_the_kernel(monkeypatch):
    """The executor's start-up check (on CUDA; here through the interpreter): the kernel is
    kept when it agrees, and the sampler falls back to the twin when it fails or disagrees."""
    from types import SimpleNamespace

    from pagedserve.executor import kernel_checks
    from pagedserve.executor.sampler import Sampler
    from pagedserve.kernels import draw_ops, sampling_ops

    cache = SimpleNamespace(device=torch.device(DEVICE))
    runner = SimpleNamespace(cache=cache, sampler=Sampler())
    kernel_checks.check_sampler_kernels(runner, 600, torch.bfloat16)
    assert runner.sampler.kernel_backend == "auto"

    def wrong(logits, lse, top_p, thresholds, unresolved, exp_floor):
        thresholds.fill_(float("-inf"))  # keeps every token

    monkeypatch.setattr(sampling_ops, "top_p_thresholds_triton", wrong)
    kernel_checks.check_sampler_kernels(runner, 600, torch.bfloat16)
    assert runner.sampler.kernel_backend == "torch"

    def broken(*args):
        raise RuntimeError("PassManager::run failed")

    runner.sampler.kernel_backend = "auto"
    monkeypatch.setattr(sampling_ops, "top_p_thresholds_triton", broken)
    kernel_checks.check_sampler_kernels(runner, 600, torch.bfloat16)
    assert runner.sampler.kernel_backend == "torch"

    def last_index(logits):  # ties to the last index: not torch's argmax
        return logits.shape[1] - 1 - logits.flip(-1).argmax(-1)

    runner.sampler.kernel_backend = "auto"
    monkeypatch.undo()
    monkeypatch.setattr(sampling_ops, "argmax_rows_triton", last_index)
    kernel_checks.check_sampler_kernels(runner, 600, torch.bfloat16)
    assert runner.sampler.kernel_backend == "torch"

    def first_token(x, min_p, u):  # not the draw
        return torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)

    runner.sampler.kernel_backend = "auto"
    monkeypatch.undo()
    monkeypatch.setattr(draw_ops, "keyed_draw_triton", first_token)
    kernel_checks.check_sampler_kernels(runner, 600, torch.bfloat16)
    assert runner.sampler.kernel_backend == "torch"


@pytest.mark.gpu
def test_sampler_launch_reads_nothing_back_on_cuda():
    """The sampler's launch on a GPU — top-p rows past the first 256 tokens (the kernel),
    top-k, min-p, penalties, seeded and greedy rows together — makes no device-to-host
    read (torch's sync debug mode raises on one), so an overlapped step never waits for its
    forward before the next is launched; its tokens then equal the CPU's (the thresholds
    are computed another way there: equal here, where no prefix mass sits at top_p)."""
    import numpy as np
    from pagedserve.executor.sampler import Sampler
    from pagedserve.executor.sampling_state import SamplingState
    from pagedserve.protos.wire import SamplingParams

    logits = _rows(6, 4000, seed=8) * 0.2  # flat: the 0.9-nucleus holds thousands
    params = [dict(seed=1, top_p=0.9), dict(seed=2, top_p=0.95, top_k=3000),
              dict(seed=3, min_p=0.2, top_p=0.5), dict(temperature=0.0),
              dict(seed=4, repetition_penalty=1.3, presence_penalty=0.5, top_p=0.8),
              dict(seed=5, temperature=0.7)]
    states = [SamplingState(SamplingParams(**p), i, np.asarray([1, 2, 2], np.int64),
                            np.asarray([5, 9], np.int64)) for i, p in enumerate(params)]
    sampler, on_gpu = Sampler(), logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        launched = sampler.launch(on_gpu, states)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    launched.wait()
    np.testing.assert_array_equal(launched.result().token_ids,
                                  Sampler()(logits, states).token_ids)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("vocab", [1, 100, 8192, 8193, 20_000, 151_936])  # chunk edges
def test_argmax_rows_is_torchs_argmax(dtype, vocab, device):
    """First index on ties (within a chunk and across chunks), rows of -inf, any dtype."""
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(6, vocab, generator=gen) * 3).round().to(dtype)  # many ties
    logits[1] = float("-inf")
    logits[2, vocab // 2:] = 100.0
    logits[3, -1] = 200.0
    if vocab > 8192:
        logits[4, [8191, 8192]] = 300.0  # tied across a chunk boundary
    logits = logits.to(device)
    got = ops.argmax_rows(logits, backend="triton")
    assert got.dtype == torch.int64
    assert torch.equal(got, logits.argmax(-1))
    if vocab > 1:
        with pytest.raises(ValueError, match="contiguous"):
            ops.argmax_rows(logits.t(), backend="triton")
