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

The router never needs the matcher otherwise: a sample's cursor is made at its first
drafting decode and follows only tokens already received (a sample about to draft has no
token in flight). Compiling a grammar (0.5-2 ms for a JSON schema, and its first
fast-forward as much again) happens once per grammar text, in a worker thread, never on
the event loop: until it is done the sample does not draft (its cursor is `pending`), and
afterwards each cursor is a copy of the compiled matcher (a few microseconds), so the
thousand requests of an application sending one schema compile it once.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from ..grammar_vocab import GrammarVocab

log = logging.getLogger(__name__)

MAX_COMPILED = 64  # grammars whose compiled matcher is kept (least recently used dropped)


class _Compiled:
    """One grammar's matcher at its start, compiled in the worker thread (`done` is set
    after `matcher`; None then: it does not compile here)."""

    __slots__ = ("matcher", "done")

    def __init__(self) -> None:
        self.matcher = None  # llguidance.LLMatcher, never fed: cursors copy it
        self.done = False


class FormatCursor:
    """One constrained sample's place in its format, as of the tokens received. While its
    grammar compiles the cursor is `pending` and follows nothing; then it copies the
    compiled matcher and feeds it the whole output at the next `follow`."""

    __slots__ = ("compiled", "matcher", "consumed")

    def __init__(self, compiled: _Compiled) -> None:
        self.compiled = compiled
        self.matcher = None  # llguidance.LLMatcher, this sample's own copy
        self.consumed = 0  # output tokens fed so far

    @property
    def pending(self) -> bool:
        """Its grammar is still compiling."""
        return not self.compiled.done

    @property
    def failed(self) -> bool:
        """Its grammar does not compile here (the executor reports the error)."""
        return self.compiled.done and self.compiled.matcher is None

    def _own(self):
        if self.matcher is None and self.compiled.matcher is not None:
            self.matcher = self.compiled.matcher.deep_copy()
        return self.matcher

    def follow(self, tokens: Sequence[int], start: int = 0) -> None:
        """Feed the output tokens not yet fed (the sample's output: `tokens` from `start`,
        its prompt's length; only the new ones are copied). Nothing while pending."""
        fed = start + self.consumed
        if len(tokens) > fed and self._own() is not None:
            self.matcher.consume_tokens([int(t) for t in tokens[fed:]])
            self.consumed = len(tokens) - start

    def forced(self) -> list[int]:
        """The tokens the format forces next ([]: a choice to make, it has ended, or the
        grammar is not compiled)."""
        matcher = self._own()
        if matcher is None or matcher.is_stopped() or matcher.is_error():
            return []
        return matcher.compute_ff_tokens()

    def allowed(self, drafts: list[int]) -> list[int]:
        """`drafts` up to the first the format refuses (none while not compiled)."""
        matcher = self._own()
        if not drafts or matcher is None or matcher.is_error():
            return []
        return drafts[:matcher.validate_tokens(drafts)]


class FormatDrafts:
    """Cursors over one model's vocabulary; the index is built in a thread when first
    asked for (`ready`), and constrained samples draft only once it is there. Grammars
    compile in one worker thread, each text once while it is among the `MAX_COMPILED`
    used last."""

    def __init__(self, vocab: GrammarVocab, eos_token_ids: Sequence[int]) -> None:
        self.vocab = vocab
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self._compiled: OrderedDict[str, _Compiled] = OrderedDict()
        self._worker: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # the worker is made once

    def ready(self) -> bool:
        return self.vocab.ready(self.eos_token_ids) is not None

    def cursor(self, grammar: str) -> FormatCursor | None:
        """A cursor at the start of `grammar`, pending until it has compiled (None: the
        index is not built yet)."""
        tok = self.vocab.ready(self.eos_token_ids)
        if tok is None:
            return None
        compiled = self._compiled.get(grammar)
        if compiled is not None:
            self._compiled.move_to_end(grammar)
            return FormatCursor(compiled)
        compiled = self._compiled[grammar] = _Compiled()
        if len(self._compiled) > MAX_COMPILED:
            self._compiled.popitem(last=False)  # its cursors keep their own reference
        with self._lock:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-drafts")
        self._worker.submit(_compile, compiled, tok, grammar)
        return FormatCursor(compiled)

    def close(self) -> None:
        """Stop the worker (compiles queued are dropped; their cursors stay pending)."""
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.shutdown(wait=False, cancel_futures=True)


def _compile(compiled: _Compiled, tok, grammar: str) -> None:
    """The worker's job: compile, and compute the start's forced tokens once (llguidance
    builds its lexer on the first computation, which the copies then share)."""
    import llguidance

    try:
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        if matcher.is_error():
            matcher = None
        else:
            matcher.compute_ff_tokens()
    except Exception:  # noqa: BLE001 - never the worker's end; the sample just won't draft
        log.exception("compiling a grammar for drafts failed")
        matcher = None
    compiled.matcher = matcher
    compiled.done = True
