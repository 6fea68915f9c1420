"""Logprobs as the OpenAI API writes them: a token id's text (`TokenText`, or the id itself
with `return_tokens_as_token_ids`), chat's `logprobs.content` entries, completions'
parallel arrays, echo's prompt entries and vLLM's `prompt_logprobs`; -inf and NaN as the
JSON-safe numbers clients parse."""

from __future__ import annotations

import math
from collections.abc import Sequence

from .tokenizer import Tokenizer
from .types import TokenLogprob


class TokenText:
    """Token id → its text (the tokenizer remembers it), for logprobs; and the tokenizer's
    whole-text calls echo needs."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer

    def decode(self, token_ids) -> str:
        return self._tokenizer.decode(list(token_ids))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def __call__(self, token_id: int) -> str:
        return self._tokenizer.token_text(token_id)


class TokenIdText(TokenText):
    """vLLM's return_tokens_as_token_ids: each logprob's token written "token_id:{id}" (a
    token that is not whole UTF-8 alone, part of a character, stays identifiable)."""

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}"


def chat_logprobs_json(logprobs: Sequence[TokenLogprob], text: TokenText) -> list[dict]:
    """One chat `logprobs.content` entry per token."""
    def entry(token_id: int, logprob: float) -> dict:
        s = text(token_id)
        return {"token": s, "logprob": _finite(logprob), "bytes": list(s.encode())}

    return [{**entry(lp.token_id, lp.logprob),
             "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs]


def completion_logprobs_json(logprobs: Sequence[TokenLogprob], text: TokenText,
                             offset: int) -> dict:
    """The legacy completions `logprobs` object for a run of tokens starting at text `offset`.
    Each `top_logprobs` entry holds the `logprobs` most likely tokens and, as OpenAI's
    reference says ("up to logprobs+1 elements"), the chosen token when it is not among them."""
    tokens, offsets, tops = [], [], []
    for lp in logprobs:
        s = text(lp.token_id)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        top = {text(t): _finite(v) for t, v in lp.top}
        top.setdefault(s, _finite(lp.logprob))
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": [_finite(lp.logprob) for lp in logprobs],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def echo_logprobs_json(first_token_id: int, prompt: Sequence[TokenLogprob],
                       text: TokenText, k: int) -> dict:
    """The legacy `logprobs` object of an echoed prompt: its first token has no score
    (null), the others their prompt logprobs (top `k`); offsets from 0."""
    scored = completion_logprobs_json([lp if len(lp.top) <= k else
                                       TokenLogprob(lp.token_id, lp.logprob, lp.top[:k])
                                       for lp in prompt], text, len(text(first_token_id)))
    return {
        "tokens": [text(first_token_id), *scored["tokens"]],
        "token_logprobs": [None, *scored["token_logprobs"]],
        "top_logprobs": [None, *scored["top_logprobs"]],
        "text_offset": [0, *scored["text_offset"]],
    }


def prompt_logprobs_json(prompt: Sequence[TokenLogprob], text: TokenText,
                         k: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: null for the first prompt token (nothing scores it), then per
    token {token id: {logprob, rank, decoded_token}} for the prompt's own token and the `k`
    most likely. rank: the top's place (1: the most likely); the prompt token's own, 1 + the
    tokens more likely (null where the executor did not compute it)."""
    out: list[dict | None] = [None]
    for lp in prompt:
        entries: dict[str, dict] = {}
        top = lp.top[:k]
        for rank, (token_id, logprob) in enumerate(top, 1):
            entries[str(token_id)] = {"logprob": _finite(logprob), "rank": rank,
                                      "decoded_token": text(token_id)}
        own = str(lp.token_id)
        if own in entries:
            if lp.rank is not None:
                entries[own]["rank"] = lp.rank
        else:
            entries = {own: {"logprob": _finite(lp.logprob), "rank": lp.rank,
                             "decoded_token": text(lp.token_id)}, **entries}
        out.append(entries)
    return out


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -inf (vLLM writes -9999.0 too)
