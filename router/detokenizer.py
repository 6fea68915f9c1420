"""Incremental detokenization and stop conditions for one sample: `TextAssembler`.

Hot path (runs for every generated token): no logging, no allocation beyond small windows,
nothing that grows with the sequence length.

Algorithm (vLLM's prefix/read offsets). The detokenizer keeps a short window of token ids
seeded with the last prompt tokens (so a first output token decodes with its leading space
as in context). `prefix` marks the start of the window, `read` the end of what has been
turned into text. For each new token, text = decode(window[prefix:]) minus
decode(window[prefix:read]); if the decoded text ends in U+FFFD (half a UTF-8 character)
nothing is emitted and the window grows until the character completes; otherwise the new
text is emitted and prefix/read move forward. With a concatenating decoder
(`Tokenizer.decodes_by_concatenation`: byte-level BPE) a token whose own text is whole,
arriving when nothing is held, is that text without any decode (its one-token text is
remembered by the tokenizer); the window's other one-token decodes come from the same
memory. Special tokens are dropped before decoding unless keep_special_tokens. A window
that has held `_MAX_HELD_TOKENS` tokens without a character completing is cut anyway (what
it decodes to is emitted, U+FFFD included, and only the last few tokens stay as context):
ids that decode to nothing (unused vocabulary entries, e.g. a random model's or a
logit_bias target) or bytes that never form a character would otherwise grow it for ever,
and every token would decode the whole run again (quadratic router CPU in the stream's
length). A UTF-8 character spans at most 4 byte tokens, so text that can complete always
does before.

Stop strings are searched in the text not yet emitted plus, with include_stop_str_in_output,
the tail of emitted text, for a match that ends in the newest text. Without
include_stop_str_in_output, text that could be the start of a stop string is held back, so a
stream never emits text that a later match would cut. Among matches in the same token the one
that ends first wins (ties: the longer one), as if text arrived character by character.

Because unary responses are the concatenation of the same deltas, a sample's stream chunks
always equal its Generate text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from .tokenizer import Tokenizer
from .types import FinishReason, SamplingSpec

# Prompt tokens that seed the window (vLLM uses 5 plus the read token).
_PROMPT_CONTEXT_TOKENS = 6
_MAX_HELD_TOKENS = 16  # tokens read into the window without text before it is cut anyway
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns token ids into text one token at a time without ever emitting half a character."""

    __slots__ = ("_tok", "_decode", "_token_text", "_by_concatenation", "_skip_special",
                 "_ids", "_read", "_prefix_text")

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
    ):
        self._tok = tokenizer
        self._decode = tokenizer.decode  # (bound once: once or twice a token)
        self._token_text = tokenizer.token_text
        self._by_concatenation = getattr(tokenizer, "decodes_by_concatenation", False)
        self._skip_special = skip_special_tokens
        context = list(prompt_token_ids)
        if skip_special_tokens:
            context = [t for t in context if not tokenizer.is_special(t)]
        self._ids: list[int] = context[-_PROMPT_CONTEXT_TOKENS:]  # window: [prefix, ...)
        self._read = len(self._ids)
        self._prefix_text = tokenizer.decode(self._ids) if self._ids else ""

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final (possibly "")."""
        if self._skip_special and self._tok.is_special(token_id):
            return ""
        ids = self._ids
        if self._by_concatenation and self._read == len(ids):
            text = self._token_text(token_id)
            if text and _REPLACEMENT not in text:
                # Nothing held and the token's own text is whole: with a concatenating
                # decoder that text is what decoding the window with the token would add,
                # and the window is then the token alone (what `_advance` leaves) -- no
                # decode at all.
                ids.clear()
                ids.append(token_id)
                self._read = 1
                self._prefix_text = text
                return text
        ids.append(token_id)
        full = self._decode(ids)
        prefix_len = len(self._prefix_text)
        if len(full) <= prefix_len or full.endswith(_REPLACEMENT):
            if len(ids) - self._read < _MAX_HELD_TOKENS:
                return ""  # nothing new yet, or half a character: wait for more tokens
            # Held too long to be half a character: cut the window (see the module doc).
            new_text = full[prefix_len:]
            del ids[:-_PROMPT_CONTEXT_TOKENS]
            self._read = len(ids)
            self._prefix_text = self._decode(ids)
            return new_text
        return self._advance(full)

    def flush(self) -> str:
        """Return whatever is still held (an incomplete character decodes to U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        full = self._decode(self._ids)
        return self._advance(full)

    def _advance(self, full: str) -> str:
        new_text = full[len(self._prefix_text) :]
        # The window now starts at the old read offset (a character boundary) and is read up to
        # its end; tokens before it are dropped, so the window never grows with the sequence.
        ids = self._ids
        del ids[: self._read]
        self._read = len(ids)
        # (Usually one token is left: the one just read. Its text is the tokenizer's
        # remembered one-token decode, which spares the second decode a token.)
        self._prefix_text = self._token_text(ids[0]) if len(ids) == 1 else self._decode(ids)
        return new_text


class TextUpdate(NamedTuple):
    """What one appended token did to a sample: `text` is new, final text to hand out; the
    finish fields are set when this token ended the sample. (A named tuple: made for
    most tokens of a text request, in 0.2 us; a frozen dataclass took 0.9.)"""

    text: str = ""
    finish_reason: FinishReason | None = None
    stop_string: str | None = None
    stop_token_id: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


_NOTHING = TextUpdate()  # most tokens of a text=False assembler, and held-back text


class TextAssembler:
    """One sample's text and stop conditions. The engine makes one per sample when a request is
    admitted and calls `append(token_id)` for every token the executor samples for it, in
    order; when the returned update is finished the sample is done (free it). `finish()` ends a
    sample for a reason decided elsewhere (abort, drain) and returns the text still held back.

    Stop rules (vLLM's order): before `min_tokens` tokens no stop applies; then EOS (unless
    ignore_eos) or a stop token id ends it with "stop" (that token is in token_ids, its text is
    not); then a stop string ends it with "stop" (cut from the text unless
    include_stop_str_in_output); then max_tokens (or `max_model_len` counting the prompt) ends
    it with "length".
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        sampling: SamplingSpec,
        prompt_token_ids: Sequence[int] = (),
        *,
        eos_token_ids: Sequence[int] | None = None,
        max_model_len: int | None = None,
        text: bool = True,
    ):
        self._sampling = sampling
        self.tokens_only = not text  # an API worker's sample: the worker makes its text
        # text=False: the token rules only (stop ids, EOS, lengths), no text and no stop
        # strings; an API worker assembles the text (router/remote_engine.py).
        self._detok = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=not sampling.keep_special_tokens
        ) if text else None
        eos = tokenizer.eos_token_ids if eos_token_ids is None else eos_token_ids
        stop_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids.update(eos)
        self.stop_token_ids = frozenset(stop_ids)  # (the router's apply_tokens reads it too)
        self._stops = tuple(sampling.stop) if text else ()
        self._include_stop = sampling.include_stop_str_in_output
        self._tail_len = max((len(s) for s in self._stops), default=1) - 1
        self._max_len = (
            None if max_model_len is None else max(1, max_model_len - len(prompt_token_ids))
        )
        self._pending = ""  # final text not yet handed out (held: may start a stop string)
        self._tail = ""  # last _tail_len characters handed out
        self.num_tokens = 0
        self.finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_id: int) -> TextUpdate:
        """Account for one sampled token; return the new text and, if it ended, why."""
        if self.finish_reason is not None:
            raise RuntimeError("append() on a finished sample")
        self.num_tokens += 1
        sp = self._sampling
        checks = self.num_tokens >= sp.min_tokens
        if checks and token_id in self.stop_token_ids:
            return self._end("stop", self._flush_all(), stop_token_id=token_id)
        at_length = self.num_tokens >= sp.max_tokens or (
            self._max_len is not None and self.num_tokens >= self._max_len
        )
        if self._detok is None:  # text=False: the token rules only, no text to hold
            return self._end("length", "") if at_length else _NOTHING
        new = self._detok.push(token_id)
        if not self._stops and not at_length:  # nothing is held back: out as it is
            return TextUpdate(new) if new else _NOTHING
        if new and checks and self._stops:
            update = self._match_stop(new)
            if update is not None:
                return update
        else:
            self._pending += new
        if at_length:
            return self._end("length", self._flush_all())
        text = self._release()
        return TextUpdate(text) if text else _NOTHING

    def finish(self, reason: FinishReason = "abort") -> str:
        """End the sample for a reason decided outside (abort, drain); return held-back text."""
        if self.finish_reason is not None:
            return ""
        text = self._flush_all()
        self.finish_reason = reason
        return text

    # ------------------------------------------------------------------ internals

    def _end(self, reason: FinishReason, text: str, **fields) -> TextUpdate:
        self.finish_reason = reason
        return TextUpdate(text=text, finish_reason=reason, **fields)

    def _flush_all(self) -> str:
        text = self._pending + (self._detok.flush() if self._detok is not None else "")
        self._pending = ""
        return text

    def _match_stop(self, new: str) -> TextUpdate | None:
        """Add `new` to the pending text and look for a stop string ending inside it."""
        tail = self._tail if self._include_stop else ""
        buffer = tail + self._pending + new
        prev_len = len(buffer) - len(new)
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = buffer.find(stop, max(0, prev_len - len(stop) + 1))
            if start == -1:
                continue
            end = start + len(stop)
            if best is None or (end, start) < (best[0], best[1]):
                best = (end, start, stop)
        if best is None:
            self._pending += new
            return None
        end, start, stop = best
        cut = end if self._include_stop else start
        text = buffer[len(tail) : cut]
        self._pending = ""
        return self._end("stop", text, stop_string=stop)

    def _release(self) -> str:
        """Hand out pending text except a suffix that could start a stop string."""
        pending = self._pending
        if not pending:
            return ""
        hold = 0  # the longest suffix of pending that begins a stop string
        if self._stops and not self._include_stop:
            n = len(pending)
            for stop in self._stops:
                # Such a suffix starts with the stop's first character, in its last
                # len(stop) - 1 characters: look only where that character is (usually
                # nowhere), longest first.
                first = stop[0]
                i = pending.find(first, max(0, n - len(stop) + 1))
                while i != -1 and n - i > hold:
                    if stop.startswith(pending[i:]):
                        hold = n - i
                        break
                    i = pending.find(first, i + 1)
        out = pending[: len(pending) - hold]
        self._pending = pending[len(pending) - hold :]
        if self._tail_len and out:
            self._tail = (self._tail + out)[-self._tail_len :]
        return out
