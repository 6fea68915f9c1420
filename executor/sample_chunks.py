"""A step's sampling rows in chunks of at most ``chunk_rows`` (the executor's
``--max-num-seqs``), so one step's logits and the sampler's work copies of them never take
more memory than the KV cache was sized around.

Why: a step's logits are [rows that sample, vocabulary]. Without drafts a step samples at
most one row a sequence; with drafts (speculative decoding, predicted outputs) a decode row
samples at each of its 1 + d positions, up to 16: 256 sequences x 16 positions x a 152k
vocabulary is 1.2 GB of bf16 logits, and each float32 work copy the sampler makes (the
widened logits, the masked copy, the tempered copy, the log-softmax of logprobs) 2.5 GB
more. The memory profile (cache_engine.py) samples one chunk the costliest way
(`profile_sampling`), and on a CPU the sampler keeps its work buffers between steps, so
they stay one chunk large.

How: a step whose rows fit one chunk (every step without drafts, when the router's
--max-num-seqs is the executor's) is sampled as before, in one call. A larger one is
sampled a chunk at a time: the chunk's logits computed from its rows' hidden states,
sampled, its tokens' copies to the host queued; the previous chunk's logits are free by
then (a GPU's caching allocator gives their memory to the next chunk, in stream order).
`SampledChunks` joins the chunks: their tokens concatenated on the device (the next step's
fed inputs read them), their host arrays concatenated when read. The sampler works row by
row (the randomness is keyed by the row's request, not its place in the batch), so the
tokens and logprobs are those of one call."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch
from pagedserve.executor.sampled import SampledOnDevice, SamplerOutput
from pagedserve.executor.sampler import Sampler
from pagedserve.executor.sampling_state import SamplingState
from pagedserve.protos.wire import SamplingParams

log = logging.getLogger(__name__)


class HiddenRows(NamedTuple):
    """A step's sampling rows too many for one chunk: their hidden states, whose logits are
    computed a chunk at a time (`step_logits`)."""

    hidden: torch.Tensor  # [R, H], R > chunk_rows
    compute_logits: Callable[[torch.Tensor], torch.Tensor]
    chunk_rows: int


def step_logits(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                sample_rows: torch.Tensor | None, chunk_rows: int) -> torch.Tensor | HiddenRows:
    """The logits of the rows that sample (``hidden[sample_rows]``), or, when they are more
    than ``chunk_rows``, their hidden states, for `launch_sampling` to compute by chunks."""
    rows = hidden[sample_rows]
    if rows.shape[0] <= chunk_rows:
        return compute_logits(rows)
    return HiddenRows(rows, compute_logits, chunk_rows)


def launch_sampling(sampler: Sampler, logits: torch.Tensor | HiddenRows,
                    states: Sequence[SamplingState], grammar_bits: np.ndarray | None = None,
                    argmax: torch.Tensor | None = None,
                    plain: bool | None = None) -> SampledOnDevice | SampledChunks:
    """`Sampler.launch` over ``logits``, or over `HiddenRows` a chunk at a time (``argmax``,
    a decode graph's, comes with logits only). ``grammar_bits``: the constrained rows'
    masks in order (`Sampler.grammar_masks`), sliced to each chunk's constrained rows."""
    if not isinstance(logits, HiddenRows):
        return sampler.launch(logits, states, grammar_bits, argmax=argmax, plain=plain)
    hidden, compute, size = logits
    num_rows = hidden.shape[0]
    if num_rows != len(states):
        raise ValueError(f"{num_rows} rows of hidden states for {len(states)} states")
    constrained_before = None
    if grammar_bits is not None:  # constrained rows before each row, and in all
        constrained_before = np.cumsum([0] + [s.grammar is not None for s in states])
    chunks = []
    for start in range(0, num_rows, size):
        stop = min(start + size, num_rows)
        bits = None if grammar_bits is None else \
            grammar_bits[constrained_before[start]:constrained_before[stop]]
        chunks.append(sampler.launch(compute(hidden[start:stop]), states[start:stop], bits,
                                     plain=plain))
    return SampledChunks(chunks)


class SampledChunks:
    """`SampledOnDevice`'s interface over the chunks of one step's sampling, in row order
    (one stream: the last chunk's event follows every chunk's copies)."""

    __slots__ = ("tokens", "_chunks")

    def __init__(self, chunks: list[SampledOnDevice]) -> None:
        self._chunks = chunks
        self.tokens = torch.cat([c.tokens for c in chunks])

    @property
    def event(self):
        return self._chunks[-1].event

    def pooled(self) -> list:
        return [item for c in self._chunks for item in c.pooled()]

    def wait(self) -> None:
        self._chunks[-1].wait()

    def done(self) -> bool:
        return self._chunks[-1].done()

    def elapsed_s(self, since) -> float:
        return self._chunks[-1].elapsed_s(since)

    def result(self) -> SamplerOutput:
        outs = [c.result() for c in self._chunks]
        return SamplerOutput(*(np.concatenate([getattr(o, f) for o in outs])
                               for f in SamplerOutput.__dataclass_fields__))


# The costliest way to sample a row (every work copy the sampler makes, and the logprobs):
# the memory profile's. The bias is on a few token ids any vocabulary has.
_COSTLIEST = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, logprobs=20,
                            repetition_penalty=1.1, frequency_penalty=0.1,
                            logit_bias_ids=(0, 1), logit_bias_values=(1.0, -1.0))


def profile_sampling(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                     hidden: torch.Tensor, rows: int) -> None:
    """Sample ``rows`` rows the costliest way (`_COSTLIEST`) from copies of ``hidden``'s
    first row, and read them back: the memory profile's sampling pass (one chunk's logits
    and every work copy of them). The sampler's kernels are checked only once the runner
    exists (kernel_checks.py): where they fail here, the torch forms are profiled."""
    index = torch.zeros(rows, dtype=torch.int64, device=hidden.device)
    states = [SamplingState(_COSTLIEST, i, prompt_token_ids=(2, 3)) for i in range(rows)]
    sampler = Sampler()
    try:
        launch_sampling(sampler, step_logits(compute_logits, hidden, index, rows),
                        states).result()
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - a kernel that fails is the checks' to report
        log.warning("memory profile: the sampler's kernels failed (%s: %s); profiling the "
                    "torch forms", type(exc).__name__, exc)
        sampler.kernel_backend = "torch"
        launch_sampling(sampler, step_logits(compute_logits, hidden, index, rows),
                        states).result()
