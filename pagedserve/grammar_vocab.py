"""The vocabulary index that structured output's matchers run over (llguidance's LLTokenizer).

A matcher needs to know, for every token id of the model, the bytes it stands for; llguidance
builds that index from tokenizer.json (~0.2-0.35 s for a 49k vocabulary), once per set of EOS
ids (the tokens a completed format allows). The executor's matchers mask its samples
(executor/grammar.py); the router's follow a constrained sample's output to draft the tokens
its format forces (router/grammar_drafts.py). Both build their indexes here, from the same
file and vocabulary size, so token ids mean the same on both sides. No torch: the router
imports it.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

log = logging.getLogger(__name__)


class GrammarError(ValueError):
    """A request's grammar cannot be used here (message says why)."""


class GrammarVocab:
    """LLTokenizers for one model's vocabulary, by EOS ids (thread-safe; built on first use,
    or ahead in a thread with `ready`)."""

    def __init__(self, tokenizer_json: str | Path | None, vocab_size: int) -> None:
        self.tokenizer_json = Path(tokenizer_json) if tokenizer_json else None
        self.vocab_size = int(vocab_size)
        self._lock = threading.Lock()
        self._tokenizers: dict[tuple[int, ...], object] = {}
        self._building: set[tuple[int, ...]] = set()
        self.words = 0  # int32 words in one bitmask row (set with the first index)

    def tokenizer(self, eos_token_ids: tuple[int, ...]):
        """The index for these EOS ids, built now if it is not yet (GrammarError when
        llguidance or tokenizer.json is missing)."""
        with self._lock:
            tok = self._tokenizers.get(eos_token_ids)
            if tok is not None:
                return tok
            tok = self._build(eos_token_ids)
            self.words = max(self.words, (tok.vocab_size + 31) // 32)
            self._tokenizers[eos_token_ids] = tok
            return tok

    def ready(self, eos_token_ids: tuple[int, ...]):
        """The index if it is built, else None, having started building it in a thread
        (the router's event loop must not wait ~0.3 s for it). A build that fails leaves
        it None for good (logged)."""
        tok = self._tokenizers.get(eos_token_ids)
        if tok is not None:
            return tok
        with self._lock:
            if eos_token_ids in self._building:
                return None
            self._building.add(eos_token_ids)

        def build() -> None:
            try:
                self.tokenizer(eos_token_ids)
            except Exception as exc:  # noqa: BLE001 - logged; the executor reports it too
                log.warning("no vocabulary index for structured output here: %s", exc)

        threading.Thread(target=build, name="grammar-vocab", daemon=True).start()
        return None

    def _build(self, eos_token_ids: tuple[int, ...]):
        try:
            import llguidance
        except ImportError as exc:
            raise GrammarError("structured output needs the llguidance package") from exc
        if self.tokenizer_json is None or not self.tokenizer_json.is_file():
            raise GrammarError("structured output needs the model's tokenizer.json")
        text = self.tokenizer_json.read_text(encoding="utf-8")
        eos = list(eos_token_ids) or None
        try:
            return llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=eos)
        except Exception:  # a tokenizer with more entries than the model's vocab
            return llguidance.LLTokenizer(text, eos_token=eos)
