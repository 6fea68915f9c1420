"""What the router checks of an executor's StepResult beyond its shapes (wire.StepResult.
validate, at decode): that every sampled token is in the model's vocabulary, and that every
sample the plan asked for is answered. An executor
only sends one that is not through a bug (a sampling kernel's, say, on a row of NaN
logits); without this check the token reached the text stage, whose tokenizer raises on a
negative id, and the step loop's failure dropped every request of that executor. With it,
the requests that got such a token fail alone, with the token named, and the rest of the
step is applied as usual. A sample answered with neither a token nor an error (a bug too)
fails its request: the scheduler would otherwise wait for that token forever (the request
never planned again, never ended).

HOT PATH (every result): one reduction over the step's tokens when all are good; the
unanswered samples are looked for only when the result has fewer rows than the plan sampled
or its rows are not the plan's samples in order.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from ..protos import wire
from .errors import Unavailable

if TYPE_CHECKING:
    from .engine import RouterEngine
    from .sequence import Sequence

log = logging.getLogger("pagedserve.router")


def _outside(ids: np.ndarray, vocab_size: int) -> bool:
    """Is any id outside [0, vocab_size)? One reduction for int32 ids (seen as uint32, a
    negative one is larger than any vocabulary)."""
    if ids.dtype == np.int32:
        return int(ids.view(np.uint32).max()) >= vocab_size
    return bool(((ids < 0) | (ids >= vocab_size)).any())


def bad_token_rows(result: wire.StepResult, vocab_size: int) -> np.ndarray | None:
    """The indices of the result's rows whose token, or one of whose top-k token ids, is
    outside [0, vocab_size) (None: none, the usual case, found with one reduction, two
    when the step has top-k entries)."""
    tokens = result.token_ids
    if not result.request_ids or tokens is None:
        return None
    top_ids = result.top_token_ids
    has_top = top_ids is not None and top_ids.shape[0] > 0 and result.top_counts is not None
    if not _outside(tokens, vocab_size) and not (has_top and _outside(top_ids, vocab_size)):
        return None
    bad = (tokens < 0) | (tokens >= vocab_size)
    if has_top:  # each top entry's row (validated: the counts sum to the entries)
        wrong = (top_ids < 0) | (top_ids >= vocab_size)
        owners = np.repeat(np.arange(len(result.request_ids)), result.top_counts)
        bad[owners[wrong]] = True
    found = np.flatnonzero(bad)
    return found if found.shape[0] else None


_TIMINGS = ("forward_s", "sample_s", "swap_s", "gap_s")
_warned_timings: set[str] = set()  # executors whose non-finite timings were logged once


def sane_timings(result: wire.StepResult) -> wire.StepResult:
    """``result`` with every timing that is not a finite number >= 0 (NaN, inf, negative:
    an executor's bug) set to 0, which the metrics count as nothing waited and the cost
    model does not learn from (an inf forward_s would have made every learned rate inf)."""
    times = (result.forward_s, result.sample_s, result.swap_s, result.gap_s)
    if all(0.0 <= t < math.inf for t in times):
        return result
    if result.executor_id not in _warned_timings:
        _warned_timings.add(result.executor_id)
        log.warning("executor %s sent timings %s (step %d): taken as 0 (logged once)",
                    result.executor_id, dict(zip(_TIMINGS, times, strict=True)),
                    result.step_id)
    return msgspec.structs.replace(result, **{
        name: (t if 0.0 <= t < math.inf else 0.0)
        for name, t in zip(_TIMINGS, times, strict=True)})


def prompt_scores_wrong(first: int, count: int, prompt_len: int, top_ids: np.ndarray,
                        vocab_size: int, ranks: np.ndarray | None = None) -> str:
    """Why one request's prompt scores (tokens ``first`` .. ``first + count - 1``, their
    top-k ids, their ranks when sent) cannot be its prompt's ("": they can)."""
    if first < 0 or first + count > prompt_len:
        return f"positions {first}..{first + count - 1} of a {prompt_len}-token prompt"
    if top_ids.shape[0] and _outside(top_ids, vocab_size):
        return f"top-k ids outside the vocabulary of {vocab_size}"
    if ranks is not None and ranks.shape[0] and (ranks.min() < 1 or ranks.max() > vocab_size):
        return f"ranks outside 1..{vocab_size}"
    return ""


def without_rows(result: wire.StepResult, rows: np.ndarray) -> wire.StepResult:
    """``result`` less the samples at ``rows``: their ids, tokens, logprobs and top-k
    entries (the errors and every other field as they are)."""
    keep = np.ones(len(result.request_ids), dtype=bool)
    keep[rows] = False
    changes: dict = {
        "request_ids": [r for r, k in zip(result.request_ids, keep.tolist(), strict=True)
                        if k],
        "token_ids": result.token_ids[keep],
    }
    if result.logprobs is not None:
        changes["logprobs"] = result.logprobs[keep]
    counts = result.top_counts
    if counts is not None:
        changes["top_counts"] = counts[keep]
        owner_kept = np.repeat(keep, counts)  # each top-k entry's row, kept or not
        for name in ("top_token_ids", "top_logprobs"):
            values = getattr(result, name)
            if values is not None and values.shape[0] == owner_kept.shape[0]:
                changes[name] = values[owner_kept]
    return msgspec.structs.replace(result, **changes)


def out_of_vocab_errors(result: wire.StepResult, rows: np.ndarray,
                        vocab_size: int) -> list[wire.RequestError]:
    """One error for each request at ``rows``, naming its token."""
    return [wire.RequestError(result.request_ids[i],
                              f"the executor sampled token {int(result.token_ids[i])} (or "
                              f"top-k ids) outside the vocabulary of {vocab_size}")
            for i in rows.tolist()]


def fail_unanswered(engine: RouterEngine, executor_id: str, result: wire.StepResult,
                    sampled: list[Sequence]) -> None:
    """Fail the requests of the samples in ``sampled`` that ``result`` answers neither with
    a token nor with an error and that are still live on that executor."""
    answered = set(result.request_ids)
    answered.update(e.request_id for e in result.errors)
    live = engine.live
    for seq in sampled:
        group = seq.group
        if seq.seq_id in answered or seq.finished \
                or live.get(group.request_id) is not group or group.executor_id != executor_id:
            continue
        log.error("executor %s answered step %d with neither a token nor an error for %s",
                  executor_id, result.step_id, seq.seq_id)
        engine.delivery.fail(group, Unavailable(
            f"the executor answered no token for {seq.seq_id} in step {result.step_id}"))
