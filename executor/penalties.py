"""Repetition, presence and frequency penalties on the sampler's float32 logits (step 1 of
its pipeline, executor/sampler.py; DESIGN §2's semantics): repetition counts the prompt and
the output, each distinct token once; presence and frequency count the output only.

Two forms with the same arithmetic in the same order, bit for bit: the sparse one (work in
the number of tokens listed; its `torch.unique` and boolean selections read from the
device) on a CPU, the dense one (counts over the whole vocabulary, no device-to-host read)
on a GPU, where the executor launches sampling behind a forward still running.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from pagedserve.executor.device_copy import to_device
from pagedserve.executor.sampling_state import SamplingState


def penalise_rows_(x: torch.Tensor, pen_rows: list[int],
                   states: Sequence[SamplingState]) -> None:
    """In place on logits x [R, V]: the penalties of rows ``pen_rows`` (``states``: every
    row's), the sparse form on a CPU, the dense one elsewhere."""
    device = x.device
    params = [s.params for s in states]
    pen_index = to_device(pen_rows, device)
    rows, token_ids = flatten_output_tokens([states[i] for i in pen_rows], device)
    rep_rows = [i for i in pen_rows if params[i].repetition_penalty != 1.0]
    prompt_rows, prompt_ids = flatten_prompt_tokens([states[i] for i in rep_rows], device)
    penalise = apply_penalties_ if device.type == "cpu" else apply_penalties_dense_
    penalise(x, pen_index[rows], token_ids,
             to_device([p.repetition_penalty for p in params], device),
             to_device([p.presence_penalty for p in params], device),
             to_device([p.frequency_penalty for p in params], device),
             to_device(rep_rows, device, torch.int64)[prompt_rows], prompt_ids)


def has_penalty(state: SamplingState) -> bool:
    p = state.params
    if p.repetition_penalty != 1.0 and (state.num_output_tokens or state.prompt_token_ids.size):
        return True
    return state.num_output_tokens > 0 and (
        p.presence_penalty != 0.0 or p.frequency_penalty != 0.0)


def _flatten(arrays: Sequence[np.ndarray],
             device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = [a.shape[0] for a in arrays]
    token_ids = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
    rows = np.repeat(np.arange(len(arrays), dtype=np.int64), lengths)
    return to_device(rows, device), to_device(token_ids, device, torch.int64)


def flatten_output_tokens(states: Sequence[SamplingState],
                          device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, token_ids), int64 [sum of output lengths]: row i repeated once per output token."""
    return _flatten([s.output_token_ids for s in states], device)


def flatten_prompt_tokens(states: Sequence[SamplingState],
                          device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, token_ids), int64: row i once per DISTINCT token of its prompt."""
    return _flatten([s.prompt_distinct_ids for s in states], device)


def apply_penalties_(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                     repetition: torch.Tensor, presence: torch.Tensor,
                     frequency: torch.Tensor, prompt_rows: torch.Tensor | None = None,
                     prompt_token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """In place on logits [N, V]; repetition/presence/frequency are per row [N].

    (rows, token_ids) list every OUTPUT token once per occurrence; (prompt_rows,
    prompt_token_ids) list prompt tokens (any multiplicity), which count for repetition
    only. Repetition first, once per distinct token of prompt ∪ output (a seen token's
    logit / penalty when > 0, * penalty otherwise), then ``- frequency * count - presence``
    over the output tokens. Work is O(number of tokens listed), not O(N * V)."""
    vocab = logits.shape[1]
    keep = (token_ids >= 0) & (token_ids < vocab)
    out_keys, counts = torch.unique(rows[keep] * vocab + token_ids[keep], return_counts=True)
    rep_keys = out_keys
    if prompt_rows is not None and prompt_rows.numel():
        keep = (prompt_token_ids >= 0) & (prompt_token_ids < vocab)
        rep_keys = torch.unique(torch.cat(
            [out_keys, prompt_rows[keep] * vocab + prompt_token_ids[keep]]))
    r, t = rep_keys // vocab, rep_keys % vocab
    values = logits[r, t]
    rep = repetition[r]
    logits[r, t] = torch.where(values > 0, values / rep, values * rep)
    if out_keys.numel():
        r, t = out_keys // vocab, out_keys % vocab
        logits[r, t] = logits[r, t] - frequency[r] * counts.to(logits.dtype) - presence[r]
    return logits


def apply_penalties_dense_(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                           repetition: torch.Tensor, presence: torch.Tensor,
                           frequency: torch.Tensor, prompt_rows: torch.Tensor | None = None,
                           prompt_token_ids: torch.Tensor | None = None,
                           chunk_rows: int = 16) -> torch.Tensor:
    """`apply_penalties_` with no device-to-host read (its `torch.unique` and boolean
    selections wait for the device): for ``chunk_rows`` rows at a time (bounded scratch),
    per-row counts over the whole vocabulary by one scatter-add, then the same arithmetic
    in the same order over every logit of those rows (a token with no count gets
    x - 0 - 0 = x, exactly). O(N * V) work: the GPU path, where the executor launches
    sampling behind a forward still running."""
    num_rows, vocab = logits.shape
    dtype, device = logits.dtype, logits.device
    has_prompt = prompt_rows is not None and prompt_rows.numel() > 0
    for lo in range(0, num_rows, chunk_rows):
        hi = min(num_rows, lo + chunk_rows)
        x = logits[lo:hi]
        counts = _row_counts(rows, token_ids, lo, hi, vocab, dtype, device)
        seen = counts > 0
        if has_prompt:
            seen |= _row_counts(prompt_rows, prompt_token_ids, lo, hi, vocab, dtype, device) > 0
        rep = repetition[lo:hi].to(dtype).unsqueeze(1)
        positive = x > 0
        torch.where(seen & positive, x / rep, x, out=x)
        torch.where(seen & ~positive, x * rep, x, out=x)
        x.sub_(frequency[lo:hi].to(dtype).unsqueeze(1) * counts)
        x.sub_(presence[lo:hi].to(dtype).unsqueeze(1) * (counts > 0).to(dtype))
    return logits


def _row_counts(rows: torch.Tensor, token_ids: torch.Tensor, lo: int, hi: int, vocab: int,
                dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[hi - lo, vocab] occurrences of each token in rows lo..hi-1 (others weigh 0)."""
    counts = torch.zeros((hi - lo) * vocab, dtype=dtype, device=device)
    valid = (rows >= lo) & (rows < hi) & (token_ids >= 0) & (token_ids < vocab)
    counts.scatter_add_(0, torch.where(valid, (rows - lo) * vocab + token_ids, 0),
                        valid.to(dtype))
    return counts.view(hi - lo, vocab)
