"""Drafts from a structured-output request's format: the tokens it forces.

With speculative decoding on (router/speculative.py), a constrained sample's next tokens
are often no guess at all: after `{"city": "Paris",` a JSON schema whose next key is
`country` leaves one way to go until that value starts, ` "country": "`. The router follows
each constrained sample's output with a matcher of its own (llguidance, over the grammar
the executor masks with and the same vocabulary index: pagedserve/grammar_vocab.py), fed
the tokens each result brings, and before the sample decodes it drafts the tokens the
format forces from there (llguidance's fast-forward tokens, in the tokenizer's canonical
split). Where nothing is forced, the n-gram lookup's drafts are cut before the first one
the format refuses. SGLang calls skipping forced text "jump-forward decoding"; here it is a
draft like any other, so the executor verifies it: each drafted position is masked as the
format stands after the drafts before it (executor/grammar.py `after_drafts`) and outputs
are those of decoding without drafts. A forced draft is rejected only where the model's
sampled split of the forced text differs from the canonical one.

The router never needs the matcher otherwise: it is built on a constrained sample's first
drafting decode (the grammar compiled once more, ~1 ms for a JSON schema) and follows only
tokens already received (a sample about to draft has no token in flight).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..grammar_vocab import GrammarVocab


class FormatCursor:
    """One constrained sample's place in its format, as of the tokens received."""

    __slots__ = ("matcher", "consumed")

    def __init__(self, matcher) -> None:
        self.matcher = matcher  # llguidance.LLMatcher
        self.consumed = 0  # output tokens fed so far

    def follow(self, tokens: Sequence[int], start: int = 0) -> None:
        """Feed the output tokens not yet fed (the sample's output: `tokens` from `start`,
        its prompt's length; only the new ones are copied)."""
        fed = start + self.consumed
        if len(tokens) > fed:
            self.matcher.consume_tokens([int(t) for t in tokens[fed:]])
            self.consumed = len(tokens) - start

    def forced(self) -> list[int]:
        """The tokens the format forces next ([]: a choice to make, or it has ended)."""
        matcher = self.matcher
        if matcher.is_stopped() or matcher.is_error():
            return []
        return matcher.compute_ff_tokens()

    def allowed(self, drafts: list[int]) -> list[int]:
        """`drafts` up to the first the format refuses."""
        if not drafts or self.matcher.is_error():
            return []
        return drafts[:self.matcher.validate_tokens(drafts)]


class FormatDrafts:
    """Cursors over one model's vocabulary; the index is built in a thread when first
    asked for (`ready`), and constrained samples draft only once it is there."""

    def __init__(self, vocab: GrammarVocab, eos_token_ids: Sequence[int]) -> None:
        self.vocab = vocab
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)

    def ready(self) -> bool:
        return self.vocab.ready(self.eos_token_ids) is not None

    def cursor(self, grammar: str) -> FormatCursor | None:
        """A cursor at the start of `grammar` (None: the index is not built yet, or the
        grammar does not compile here, which the executor reports)."""
        tok = self.vocab.ready(self.eos_token_ids)
        if tok is None:
            return None
        import llguidance

        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        return None if matcher.is_error() else FormatCursor(matcher)
