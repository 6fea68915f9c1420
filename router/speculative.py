"""Speculative decoding by n-gram lookup ("prompt lookup decoding"), drafted by the router.

The router holds every token of every request, so it can guess a decode's next tokens
without a draft model: before a sample decodes, look for the latest earlier place in its
prompt and output where its last n tokens occurred (n from ``prompt_lookup_max`` down to
``prompt_lookup_min``) and propose the (up to ``num_speculative_tokens``) tokens that
followed there. Code, quotes of the prompt, JSON and edits of a given text repeat their
context; such outputs are where this pays.

The decode's row then carries its input token and the d drafts (1 + d positions, computed
as a prompt chunk is, `StepPlan.num_draft_tokens`). The executor samples at every position
with the randomness key the token there would have had anyway (seed, sample index, output
position; the penalties, min_tokens and bad words seeing the drafts before it as output),
and keeps the sampled tokens up to and including the first that differs from the draft
after it. A kept token is exactly the token one-at-a-time decoding samples at its position,
so outputs are token for token those of decoding without speculation (greedy or sampled);
only the number of steps changes. One-hot drafts make this the usual rejection rule: a
draft is kept with the probability the model gives it, and where it is not, the token
comes from the model's distribution without it.

A row whose tokens are not known before its result cannot be followed by a plan built
before that result, so a plan with a drafted row, or with a sample whose next decode will
look for drafts, is the only plan in flight to its executor (`PlanRows.speculating`).
Samples backing off after misses (`Drafter`) and those that never speculate (beams,
n > 1 before its fork) pipeline as before, except beside speculating ones. Under a
grammar (structured output) the drafts are first the tokens the format forces, else the
lookup's up to the first the format refuses (grammar_drafts.py). With
``disable_by_batch_size`` N, an executor running N requests or more drafts nothing and
pipelines as without speculation (busy, its steps are full without drafts).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from .grammar_drafts import FormatCursor, FormatDrafts
from .predicted_outputs import PredictedDrafts, PredictionCursor
from .sequence import RequestGroup, Sequence

MAX_SPECULATIVE_TOKENS = 15  # drafts a row (the wire's counts; more rarely pay)
MAX_LOOKUP = 64  # longest n-gram matched
# Without --speculative-config, a predicted sample whose output left its prediction looks
# up its own tokens with these n-gram lengths (min, max): spec_decode_bench's
PREDICTION_LOOKUP_N = (1, 3)


class SpeculativeConfigError(ValueError):
    """A --speculative-config this router cannot use (one line, for the flag's error)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``--speculative-config`` for the ngram method (the one served here)."""

    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    method: str = "ngram"
    # no drafts while this many requests (or more) run on the executor (None: always);
    # their decodes pipeline as without speculation
    disable_by_batch_size: int | None = None

    def to_json(self) -> str:
        return json.dumps({"method": self.method,
                           "num_speculative_tokens": self.num_speculative_tokens,
                           "prompt_lookup_max": self.prompt_lookup_max,
                           "prompt_lookup_min": self.prompt_lookup_min,
                           "disable_by_batch_size": self.disable_by_batch_size})

    def drafts_at(self, num_running: int) -> bool:
        """Whether an executor running this many requests drafts."""
        limit = self.disable_by_batch_size
        return limit is None or num_running < limit


_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "disable_by_batch_size")


def parse_speculative_config(text: str | None) -> SpeculativeConfig | None:
    """The flag's JSON object (None or "" -> off). vLLM's keys and defaults for ngram: a
    missing bound takes the other's value, both missing -> 5."""
    if text is None or not text.strip():
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpeculativeConfigError(f"not a JSON object: {exc}") from None
    if not isinstance(obj, dict):
        raise SpeculativeConfigError("not a JSON object")
    unknown = sorted(set(obj) - set(_KEYS))
    if unknown:
        raise SpeculativeConfigError(
            f"unsupported key(s) {', '.join(unknown)} (supported: {', '.join(_KEYS)})")
    method = obj.get("method", "ngram")
    if method != "ngram":
        raise SpeculativeConfigError(
            f"method {method!r} is not served (only \"ngram\": drafts by prompt lookup)")

    def count(key: str, default: int | None, high: int) -> int | None:
        value = obj.get(key, default)
        if value is None:
            return None
        if type(value) is not int or not 1 <= value <= high:
            raise SpeculativeConfigError(f"{key} must be an integer in [1, {high}]")
        return value

    k = count("num_speculative_tokens", None, MAX_SPECULATIVE_TOKENS)
    if k is None:
        raise SpeculativeConfigError("num_speculative_tokens is required")
    hi = count("prompt_lookup_max", None, MAX_LOOKUP)
    lo = count("prompt_lookup_min", None, MAX_LOOKUP)
    if hi is None and lo is None:
        hi = lo = 5
    hi = lo if hi is None else hi
    lo = hi if lo is None else lo
    if lo > hi:
        raise SpeculativeConfigError("prompt_lookup_min must not exceed prompt_lookup_max")
    return SpeculativeConfig(k, hi, lo, disable_by_batch_size=count(
        "disable_by_batch_size", None, 1 << 20))


def lookup(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> np.ndarray:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
    suffix of ``tokens`` of ``n_min`` .. ``n_max`` tokens (empty: none occurs).

    The candidates are the earlier places of the last token (one vectorised compare);
    each longer n keeps those whose n - 1 tokens before match too, so the work is the
    history's length once plus the few candidates times n."""
    length = tokens.shape[0]
    if length <= n_min or k <= 0:
        return tokens[:0]
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    if ends.shape[0] == 0:
        return tokens[:0]
    n_top = min(n_max, length - 1)
    ok = np.ones(ends.shape[0], dtype=bool)
    matched = []  # matched[n - 1]: the candidates whose last n tokens match
    for n in range(1, n_top + 1):
        if n > 1:
            back = ends - (n - 1)
            ok &= back >= 0
            ok[ok] &= tokens[back[ok]] == tokens[length - n]
            if not ok.any():
                break
        matched.append(ok.copy())
    for n in range(len(matched), n_min - 1, -1):
        hits = np.flatnonzero(matched[n - 1])
        if hits.shape[0]:
            end = int(ends[hits[-1]])
            return tokens[end + 1: end + 1 + k]
    return tokens[:0]


MAX_BACKOFF = 15  # decodes a sample skips drafting after repeated misses, at most


class Drafter:
    """The drafts of one scheduler's samples: each sample's tokens as a numpy array grown
    in place (only the tokens since its last search are copied), searched by `lookup`.
    An entry belongs to one `Sequence` object (a new request taking an ended one's id
    starts afresh) and goes when the scheduler releases the sample (`forget`).

    Back-off: a drafted decode whose drafts are all rejected is a miss; after m misses in
    a row the sample skips drafting for its next 2**(m - 1) - 1 decodes (0, 1, 3, 7, then
    `MAX_BACKOFF`: a single miss in text that copies its context costs nothing), and a
    confirmed draft ends the run. A lookup that finds nothing skips
    the next decode only (it cost no compute). Skipping decodes pipeline as any other
    (only a sample about to look for drafts needs its plan answered before the next is
    built: `wants_drafts`), so text that does not repeat itself pays for a few rejected
    drafts and a plan at a time every other step, not for every step.

    Draft length: a row whose drafts were all rejected makes the sample's next one a
    single draft, one that confirmed c of its d drafts (0 < c < d) c + 1, one that
    confirmed all of them twice as many; never more than num_speculative_tokens. Text that
    copies its context keeps drafting k; elsewhere a rejected row wastes one position,
    not k."""

    def __init__(self, config: SpeculativeConfig | None,
                 formats: FormatDrafts | None = None) -> None:
        self.config = config  # None: only samples with a prediction draft
        # the lookup's n-gram lengths (without a config: a predicted sample's, where its
        # prediction has no place for the output)
        self._lookup_n = (config.prompt_lookup_min, config.prompt_lookup_max) \
            if config is not None else PREDICTION_LOOKUP_N
        self.formats = formats  # structured output's forced tokens (None: no drafts there)
        self._samples: dict[str, _SampleDrafts] = {}

    def drafts_at(self, num_running: int) -> bool:
        """Whether an executor running this many requests drafts (`disable_by_batch_size`
        applies to predictions too)."""
        return self.config is None or self.config.drafts_at(num_running)

    def may_draft(self, group: RequestGroup) -> bool:
        """Whether the group's samples decode with drafts: not beams (each step's inputs
        are chosen from the last step's answers: router/beam_search.py), not sample 0 of
        n > 1 before the fork, only with a prediction when the lookup is off, and under
        a grammar only once the router can follow it (grammar_drafts.py: its vocabulary
        index built)."""
        if not group.forked or group.beam is not None:
            return False
        sampling = group.spec.sampling
        if self.config is None and not sampling.prediction:
            return False
        return not sampling.grammar or (self.formats is not None and self.formats.ready())

    def _record(self, seq: Sequence) -> _SampleDrafts | None:
        """The sample's record, if this `Sequence` object has one (not an ended one's)."""
        mine = self._samples.get(seq.seq_id)
        return mine if mine is not None and mine.seq is seq else None

    def _of(self, seq: Sequence) -> _SampleDrafts:
        mine = self._record(seq)
        if mine is None:
            prediction = seq.group.spec.sampling.prediction
            # a prediction is the client's word that the output repeats it: its rows
            # draft up to the most a row drafts (rejections shorten them as any)
            mine = self._samples[seq.seq_id] = _SampleDrafts(
                seq, MAX_SPECULATIVE_TOKENS if prediction or self.config is None
                else self.config.num_speculative_tokens)
            if prediction:
                mine.prediction = PredictionCursor(prediction)
        return mine

    def for_decode(self, group: RequestGroup, seq: Sequence, budget: int,
                   max_model_len: int) -> list[int] | None:
        """The scheduler's call: drafts for a decode of `seq` within the token budget and
        so that every token the row may emit fits max_tokens and max_model_len (None:
        none)."""
        if not self.may_draft(group):
            return None
        tokens = seq.token_ids
        limit = min(budget - 1,
                    group.spec.sampling.max_tokens - (len(tokens) - seq.num_prompt_tokens) - 1,
                    max_model_len - len(tokens) - 1)
        return self.decode(seq, limit, group.spec.sampling.grammar) or None

    def decode(self, seq: Sequence, limit: int, grammar: str = "") -> list[int]:
        """The drafts for this decode of `seq` ([]: none), unless the sample is backing
        off or has a token in flight: under a grammar, the tokens it forces, up to
        ``limit`` and `MAX_SPECULATIVE_TOKENS` (grammar_drafts.py); else up to ``limit``
        and the sample's draft length, from its prediction (predicted_outputs.py) or,
        without one there, found by `search` (under a grammar, cut where it refuses one)."""
        mine = self._of(seq)
        if mine.skip:
            mine.skip -= 1
            return []
        if limit <= 0 or seq.num_pending:
            return []
        cursor = self._cursor(mine, seq, grammar) if grammar else None
        if cursor is not None and not (cursor.pending or cursor.failed):
            forced = cursor.forced()
            if forced:  # at most what a row drafts: its every position is sampled, and
                # [positions, vocabulary] logits are not what the cache was sized beside
                return forced[:min(limit, MAX_SPECULATIVE_TOKENS)]
        elif grammar:
            # compiling in the worker: look again after one decode; else its format
            # cannot be followed here: back off as after misses
            mine.skip = 1 if cursor is not None and cursor.pending else MAX_BACKOFF
            return []
        place = mine.prediction
        if place is not None and place.follow(seq.token_ids, seq.num_prompt_tokens):
            mine.length = mine.cap  # surely back on the prediction: a full row
        k = min(limit, mine.length)
        drafts = place.drafts(k) if place is not None else []
        predicted = bool(drafts)
        if not drafts:  # (a sample is here with a prediction or a config)
            drafts = self.search(seq, k)
        if cursor is not None:
            drafts = cursor.allowed(drafts)
        if predicted and drafts:  # (their result counts in the request's usage)
            return PredictedDrafts(drafts)
        if not drafts:  # nothing to draft from yet: look again after one decode (lost on
            # its prediction: at the next one, then after 1, 3, 7, 15: predicted_outputs.py)
            mine.skip = 1 if place is None or place.at >= 0 else \
                min((1 << place.lost_for - 1) - 1, MAX_BACKOFF)
        return drafts

    def _cursor(self, mine: _SampleDrafts, seq: Sequence, grammar: str) -> FormatCursor | None:
        """The sample's format cursor, fed its output so far (made on first use; its
        grammar compiles in a worker thread meanwhile: grammar_drafts.py)."""
        if mine.cursor is None and self.formats is not None:
            mine.cursor = self.formats.cursor(grammar)
        if mine.cursor is not None:
            mine.cursor.follow(seq.token_ids, seq.num_prompt_tokens)
        return mine.cursor

    def search(self, seq: Sequence, k: int) -> list[int]:
        """`lookup` over the sample's tokens, copying into its buffer only those added
        since the last search (no back-off)."""
        mine = self._of(seq)
        tokens = seq.token_ids
        n = len(tokens)
        have = mine.filled
        if mine.tokens.shape[0] < n:
            grown = np.empty(max(64, 2 * n), dtype=np.int64)
            grown[:have] = mine.tokens[:have]
            mine.tokens = grown
        if have < n:
            mine.tokens[have:n] = tokens[have:n]
            mine.filled = n
        return lookup(mine.tokens[:n], k, *self._lookup_n).tolist()

    def confirmed(self, seq: Sequence, num_drafted: int, num_confirmed: int) -> None:
        """A drafted decode's result: how many of its drafts the sampler confirmed."""
        mine = self._record(seq)
        if mine is None:
            return
        mine.length = min(mine.cap, 2 * num_drafted if num_confirmed == num_drafted
                          else num_confirmed + 1)
        if num_confirmed:
            mine.misses = 0
        else:
            mine.misses += 1
            mine.skip = min(2 ** (mine.misses - 1) - 1, MAX_BACKOFF)

    def wants_drafts(self, seq: Sequence) -> bool:
        """Will the sample's next decode look for drafts (no back-off left)?"""
        mine = self._record(seq)
        return mine is None or not mine.skip

    def forget(self, seq_id: str) -> None:
        self._samples.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._samples)


class _SampleDrafts:
    """What a `Drafter` keeps of one sample."""

    __slots__ = ("seq", "tokens", "filled", "misses", "skip", "length", "cap", "cursor",
                 "prediction")

    def __init__(self, seq: Sequence, length: int) -> None:
        self.seq = seq  # the Sequence object it belongs to
        self.tokens = np.empty(0, dtype=np.int64)  # its tokens, grown in place ...
        self.filled = 0  # ... this many copied so far
        self.misses = 0  # drafted decodes in a row with every draft rejected
        self.skip = 0  # decodes left without drafting
        self.length = length  # drafts its next drafted row may have ...
        self.cap = length  # ... at most
        self.cursor: FormatCursor | None = None  # its format, under a grammar
        self.prediction: PredictionCursor | None = None  # its place in its prediction
