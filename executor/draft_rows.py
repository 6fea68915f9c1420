"""Speculative decoding on the executor: rows with draft tokens (router/speculative.py).

A plan row with d drafts (``StepPlan.num_draft_tokens``) computes its input and the d
drafts, 1 + d positions, as a prompt chunk does. Each position samples: position i with
the row's request state as it would be had the drafts before it been output (the
randomness key's output position, penalties, min_tokens and bad words all see them;
`SamplingState.with_drafts`). Once the tokens are read back, the row keeps its sampled
tokens up to and including the first that differs from the draft after its position
(`confirmed`): each kept token is the one the request samples at that position anyway, so
outputs are the same as without drafts, in fewer steps. The result has one entry per kept
token, consecutive (StepResult).

All of it is a few numpy calls over the step's sampling positions; a step without drafts
pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pagedserve.executor.sampled import SamplerOutput
from pagedserve.executor.sampling_state import SamplingState


@dataclass(frozen=True, slots=True)
class DraftRows:
    """Per sampling position of a step with drafts (the rows of its logits, in order)."""

    offsets: np.ndarray  # int64 [P]: the position's place in its row (0: the input's)
    draft_next: np.ndarray  # int64 [P]: the draft after the position (-1: its row's last)


def sampling_positions(ends: np.ndarray, drafts: np.ndarray,
                       token_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, DraftRows]:
    """The token indices that sample, for rows that sample ending at ``ends`` (exclusive
    token indices) with ``drafts`` drafts each: the last 1 + d tokens of each row. Also
    how many positions each row has, and their `DraftRows` (``token_ids``: the step's
    input ids, drafts included)."""
    counts = drafts + 1
    firsts = np.cumsum(counts) - counts
    offsets = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(firsts, counts)
    index = np.repeat(ends - counts, counts) + offsets
    last = offsets == np.repeat(drafts, counts)
    after = np.minimum(index + 1, token_ids.shape[0] - 1)
    draft_next = np.where(last, -1, token_ids[after]).astype(np.int64)
    return index, counts, DraftRows(offsets, draft_next)


def per_position(ids: list[str], counts) -> list[str]:
    """Each sampling row's request id once for each of its ``counts`` positions."""
    return [r for r, c in zip(ids, counts, strict=True) for _ in range(c)]


def confirmed(tokens: np.ndarray, rows: DraftRows) -> np.ndarray:
    """Which sampled positions are kept (bool [P]): in each row, those up to and including
    the first whose token differs from the draft after it (a row's last always does)."""
    miss = (tokens != rows.draft_next).astype(np.int64)
    misses_before = np.cumsum(miss) - miss
    row_first = np.flatnonzero(rows.offsets == 0)
    row_of = np.cumsum(rows.offsets == 0) - 1
    return misses_before == misses_before[row_first][row_of]


def draft_states(states: list[SamplingState], rows: DraftRows) -> list[SamplingState]:
    """The state each sampling position samples with: its request's own at a row's input,
    a copy followed by the drafts before it further on."""
    out = list(states)
    for j in np.flatnonzero(rows.offsets).tolist():
        k = int(rows.offsets[j])
        out[j] = states[j].with_drafts(rows.draft_next[j - k:j])
    return out


def kept_rows(out: SamplerOutput, keep: np.ndarray) -> SamplerOutput:
    """The sampler's output at the positions kept (`confirmed`)."""
    top_keep = np.repeat(keep, out.top_counts)
    return SamplerOutput(out.token_ids[keep], out.logprobs[keep], out.top_counts[keep],
                         out.top_token_ids[top_keep], out.top_logprobs[top_keep])
