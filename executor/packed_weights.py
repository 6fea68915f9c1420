"""A CPU executor's projection weights kept in oneDNN's blocked layout (16-bit models).

torch's linear on a CPU hands oneDNN a bfloat16 weight as a plain [out, in] matrix, and
oneDNN reorders it into the blocked layout its AMX / AVX-512 kernels read on every call:
at a decode step's few rows the reorder costs about as much as the product itself
(SmolLM2-135M's 576 x 1536 on one thread: 85 us a call, 44 without the reorder). So each
projection (q/k/v, o, gate/up, down, and the vocabulary head) is reordered once, at start
(`torch.ops.mkldnn._reorder_linear_weight`, what inductor's freezing pass does), and
`ops.linear` calls oneDNN's linear on the packed matrix (its ``packed``): the same kernel on the
same layout, so the outputs are bit for bit torch's linear (checked at start). A decode step
of the built-in model on one thread: 55 -> 39 ms at 1 sequence, 65 -> 45 at 8, 114 -> 96 at
32 (benchmarks/README.md, "packed projection weights").

The packed matrix takes the plain one's place rather than doubling it: each parameter keeps
its shape and dtype (a zero-stride view of one element, so what reads shapes -- the
loader's checks, the LoRA set-up -- reads them as before) and gives back its storage. A
tied vocabulary head is the embedding, which the lookup still needs: it is packed beside it
(one [vocab, hidden] matrix more). A weight update unpacks (`unpack_projections`: the plain
matrices back), copies the new tensors in, and packs again.

Where it applies: a CPU, a 16-bit model (oneDNN has bfloat16 with AVX512-BF16 or AMX,
float16 with AVX512-FP16 or AVX-NE-CONVERT) whose packed product equals torch's linear bit
for bit on a test matrix at start; elsewhere torch's linear runs, as before (logged).
``PAGEDSERVE_CPU_PACKED_WEIGHTS=0`` turns it off.

Row padding: oneDNN picks its kernel by the row count, and at a few rows some counts run
slower than a few more (the built-in model's 120 projections streamed on one thread of this
VM's AMD EPYC: 16.3 ms at 1 row, 18.4 at 2, 15.0 at 3, 14.0 at 4, 18.0 at 8). A row's
values do not depend on the count (each row is its own dot products), so padding x with
rows changes no value, only the kernel. At start, `calibrate_row_padding` times one
pass over the model's own packed projections (as a decode step streams them from memory,
at most `_CALIBRATION_BYTES` of them) at each count up to `PADDED_ROWS_MAX`, and pads a
count to a larger one where that is `_PADDING_GAIN` faster and gives the same rows to the
bit (`choose_row_padding`); `pack_if_supported` sets the table ``ops.linear`` reads
(``ops.PACKED_ROW_PADDING``).
Timed, not fixed: another CPU's oneDNN kernels (AMX) rank the counts otherwise. In a
decode step the gain is smaller than in the timed passes (the step's other work between
the products): one sequence -5%, two -12% on this VM (benchmarks/row_padding_bench.py).
``PAGEDSERVE_CPU_ROW_PADDING=0`` turns it off."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from pagedserve.kernels import ops
from pagedserve.kernels.host_math import switch_from_env
from torch import nn

PACKED_WEIGHTS_ENV = "PAGEDSERVE_CPU_PACKED_WEIGHTS"
ROW_PADDING_ENV = "PAGEDSERVE_CPU_ROW_PADDING"
PADDED_ROWS_MAX = 8  # row counts timed and padded to (a decode step of a few sequences)
_CALIBRATION_BYTES = 256 << 20  # the projections one timed pass streams, at most
_CALIBRATION_ROUNDS = 3  # passes at each row count (interleaved; the fastest counts: what
# else runs meanwhile only adds time)
_PADDING_GAIN = 0.10  # a count is padded where a larger one runs this much faster ...
_PADDING_TIE = 0.03  # ... to the fewest rows within this of the fastest
# oneDNN's reorder takes the expected row count as a hint; 1 to 256 rows ran alike with
# every hint from 1 to 256 (576 x 1536, bfloat16, one thread)
_ROWS_HINT = 1


def packing_refused(dtype: torch.dtype, device: torch.device) -> str:
    """'' when this process can run ``dtype`` projections packed, else why not (one line)."""
    if torch.device(device).type != "cpu":
        return "not a CPU"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"{str(dtype).removeprefix('torch.')} (oneDNN's packed layout is for 16-bit weights)"
    if switch_from_env(PACKED_WEIGHTS_ENV, strict=False) is False:
        return f"{PACKED_WEIGHTS_ENV}=0"
    if not torch.backends.mkldnn.is_available():
        return "torch built without oneDNN"
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(67, 45, generator=gen).to(dtype)  # odd sizes, a bias, 1 and 5 rows
    bias = torch.randn(67, generator=gen).to(dtype)
    try:
        packed = pack(weight)
        for rows in (1, 5):
            x = torch.randn(rows, 45, generator=gen).to(dtype)
            if not torch.equal(ops.linear(x, weight, bias, packed=packed),
                               F.linear(x, weight, bias)):
                return "oneDNN's packed product differs from torch's linear on this CPU"
    except RuntimeError as exc:  # e.g. "fp16 path needs the cpu support avx512_fp16"
        return f"oneDNN refused: {str(exc).splitlines()[0][:200]}"
    return ""


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] reordered into oneDNN's blocked layout (an mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, _ROWS_HINT)


def _projections(model: nn.Module) -> list[nn.Linear]:
    """Every projection of the decoder layers, and an untied vocabulary head."""
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def pack_projections(model: nn.Module) -> int:
    """Pack every projection (`linear.packed`) and the vocabulary head (`model.packed_head`),
    giving back each projection's plain storage; the bytes held beyond the plain weights
    (the tied head's packed copy). The plain matrices must be there (`unpack_projections`)."""
    for module in _projections(model):
        weight = module.weight
        module.packed = pack(weight.data)
        weight.data = weight.data.new_empty(()).expand(weight.shape)  # its storage goes
    if model.lm_head is not None:
        model.packed_head = model.lm_head.packed
        return 0
    embedding = model.model.embed_tokens.weight
    model.packed_head = pack(embedding.data)
    return embedding.numel() * embedding.element_size()


def unpack_projections(model: nn.Module) -> None:
    """The plain matrices back in every packed projection (their values, bit for bit),
    nothing packed: what a weight update copies into."""
    for module in _projections(model):
        if getattr(module, "packed", None) is not None:
            module.weight.data = module.packed.to_dense()
            module.packed = None
    model.packed_head = None


def is_packed(model: nn.Module) -> bool:
    return model.packed_head is not None


def pack_if_supported(model: nn.Module) -> str:
    """Pack ``model``'s projections where `packing_refused` allows, then time the row
    padding (`calibrate_row_padding`, unless PAGEDSERVE_CPU_ROW_PADDING=0) into
    ``ops.PACKED_ROW_PADDING``; what was done, for the executor's log."""
    ops.PACKED_ROW_PADDING.clear()
    weight = model.model.embed_tokens.weight
    refused = packing_refused(weight.dtype, weight.device)
    if refused:
        return f"projections run by torch's linear: {refused}"
    extra = pack_projections(model)
    count = len(_projections(model)) + (extra > 0)
    padding = "off"
    if switch_from_env(ROW_PADDING_ENV, strict=False) is not False:
        ops.PACKED_ROW_PADDING.update(calibrate_row_padding(model))
        padding = ", ".join(f"{rows} -> {to}" for rows, to in ops.PACKED_ROW_PADDING.items()) \
            or "none faster"
    return (f"{count} projection matrices packed for oneDNN"
            + (f" (the tied vocabulary head's copy: {extra / 2**20:.0f} MiB)" if extra else "")
            + f"; rows padded: {padding}")


def calibrate_row_padding(model: nn.Module) -> dict[int, int]:
    """rows -> padded rows for ``model``'s packed projections (see the module's
    docstring): the fastest of `_CALIBRATION_ROUNDS` timed passes at each count."""
    mats = timed_matrices(model)
    if not mats:
        return {}
    times = time_passes(mats, _CALIBRATION_ROUNDS)
    return choose_row_padding({rows: min(t) for rows, t in times.items()},
                              lambda rows, to: _rows_alike(mats, rows, to))


def timed_matrices(model: nn.Module) -> list[torch.Tensor]:
    """The packed matrices a timed pass streams: the projections in the forward's order,
    then a tied head's packed copy, up to `_CALIBRATION_BYTES`."""
    mats = [m.packed for m in _projections(model) if m.packed is not None]
    if model.packed_head is not None and model.lm_head is None:
        mats.append(model.packed_head)
    streamed, total = [], 0
    for packed in mats:
        if total >= _CALIBRATION_BYTES:
            break
        streamed.append(packed)
        total += packed.shape[0] * packed.shape[1] * packed.dtype.itemsize
    return streamed


def time_passes(mats: list[torch.Tensor], rounds: int) -> dict[int, list[float]]:
    """Seconds of one pass of oneDNN's linear over ``mats`` (unpadded) at each row count
    1 .. PADDED_ROWS_MAX, ``rounds`` times, the counts interleaved within a round."""
    gen = torch.Generator().manual_seed(0)
    inputs = {rows: {k: torch.randn(rows, k, generator=gen).to(mats[0].dtype)
                     for k in {p.shape[1] for p in mats}}
              for rows in range(1, PADDED_ROWS_MAX + 1)}
    times: dict[int, list[float]] = {rows: [] for rows in inputs}
    for _ in range(rounds):
        for rows, xs in inputs.items():
            start = time.perf_counter()
            for packed in mats:
                torch.ops.mkldnn._linear_pointwise(xs[packed.shape[1]], packed, None, "none",
                                                   [], "")
            times[rows].append(time.perf_counter() - start)
    return times


def choose_row_padding(times: dict[int, float], alike) -> dict[int, int]:
    """rows -> the row count to pad to, where the fastest count above ``rows`` (up to the
    largest timed) takes at most (1 - _PADDING_GAIN) of ``rows``' time: the smallest count
    within _PADDING_TIE of that fastest (counts a few percent apart swap places from one
    timing to the next; fewer rows is less work), if ``alike(rows, to)`` (the rows' values
    the same at both counts)."""
    table = {}
    counts = sorted(times)
    for rows in counts:
        larger = [to for to in counts if to > rows]
        if not larger:
            continue
        best = min(times[to] for to in larger)
        to = next(to for to in larger if times[to] <= (1 + _PADDING_TIE) * best)
        if best <= (1 - _PADDING_GAIN) * times[rows] and alike(rows, to):
            table[rows] = to
    return table


def _rows_alike(mats: list[torch.Tensor], rows: int, to: int) -> bool:
    """Do ``rows`` rows through the first and the last of ``mats`` come out bit for bit as
    the same rows among ``to``?"""
    gen = torch.Generator().manual_seed(rows * 131 + to)
    for packed in (mats[0], mats[-1]):
        x = torch.randn(to, packed.shape[1], generator=gen).to(packed.dtype)
        alone = torch.ops.mkldnn._linear_pointwise(x[:rows], packed, None, "none", [], "")
        among = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        if not torch.equal(alone, among[:rows]):
            return False
    return True
