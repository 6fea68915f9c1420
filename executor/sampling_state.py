"""One request's sampling state on an executor (what the sampler reads per row): its
params, sample index, output tokens so far (the randomness key's position and the
penalties' counts), prompt token ids (the repetition penalty counts them) and, for
structured output, its grammar matcher. Kept across steps by the model runner; rebuilt from
a NewRequest after preemption or migration."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pagedserve.executor.grammar import GrammarCompiler, GrammarError, GrammarMatcher
from pagedserve.protos.wire import NewRequest, SamplingParams

GREEDY_EPS = 1e-5  # a temperature below this is greedy


def is_greedy(params: SamplingParams) -> bool:
    """Does a request with these params take its row's argmax (whatever else applies)?"""
    return params.temperature < GREEDY_EPS or params.top_k == 1


def is_plain_greedy(params: SamplingParams) -> bool:
    """Does a request with these params take its row's argmax and nothing else (no
    penalties, bias, min_tokens mask, allowed or bad tokens, or logprobs)? The sampler's
    fast path when every row of a step does (a grammar is the state's, checked apart)."""
    return (is_greedy(params) and params.repetition_penalty == 1.0 and not params.presence_penalty
            and not params.frequency_penalty and not params.min_tokens
            and not params.logit_bias_ids and params.logprobs is None
            and not params.allowed_token_ids and not params.bad_words_token_ids)


class SamplingState:
    """One request's sampling state on an executor: params, sample index, output tokens,
    the prompt's token ids (the repetition penalty counts them; nothing else does) and, for
    structured output, its grammar matcher (advanced by every appended token)."""

    __slots__ = ("params", "sample_index", "_tokens", "_num_tokens", "_prompt",
                 "_prompt_distinct", "grammar", "_plain_params")

    def __init__(
        self,
        params: SamplingParams,
        sample_index: int = 0,
        output_token_ids: Sequence[int] | np.ndarray = (),
        prompt_token_ids: Sequence[int] | np.ndarray = (),
    ) -> None:
        ids = np.asarray(output_token_ids, dtype=np.int64).reshape(-1)
        self.params = params
        self.sample_index = int(sample_index)
        self._tokens = np.empty(max(16, 2 * ids.shape[0]), dtype=np.int64)
        self._tokens[: ids.shape[0]] = ids
        self._num_tokens = int(ids.shape[0])
        prompt = np.array(prompt_token_ids, dtype=np.int64).reshape(-1)  # always a copy
        prompt.flags.writeable = False
        self._prompt = prompt
        self._prompt_distinct: np.ndarray | None = None  # computed on first use
        self.grammar: GrammarMatcher | None = None
        self._plain_params = is_plain_greedy(params)

    @property
    def plain(self) -> bool:
        """Greedy with nothing else to apply: params (`is_plain_greedy`) and no grammar."""
        return self._plain_params and self.grammar is None

    @classmethod
    def from_new_request(cls, req: NewRequest,
                         grammars: GrammarCompiler | None = None) -> SamplingState:
        """Rebuild the state from the plan: prompt and output tokens so far (replayed into
        a fresh grammar matcher for structured output). Raises GrammarError when the
        request's grammar cannot be used here."""
        state = cls(req.sampling, req.sample_index, req.output_token_ids, req.prompt_token_ids)
        if req.sampling.grammar:
            if grammars is None:
                raise GrammarError("structured output is not available on this executor")
            state.grammar = grammars.matcher(req.sampling.grammar, req.sampling.eos_token_ids,
                                             req.output_token_ids.tolist())
        return state

    @property
    def prompt_token_ids(self) -> np.ndarray:
        """int64 [prompt length], read-only."""
        return self._prompt

    @property
    def prompt_distinct_ids(self) -> np.ndarray:
        """The prompt's distinct token ids, sorted (int64, read-only; cached)."""
        distinct = self._prompt_distinct
        if distinct is None:
            distinct = self._prompt_distinct = np.unique(self._prompt)
            distinct.flags.writeable = False
        return distinct

    @property
    def num_output_tokens(self) -> int:
        """The output position of the next token (the randomness key)."""
        return self._num_tokens

    @property
    def output_token_ids(self) -> np.ndarray:
        """int64 [num_output_tokens], a read-only view."""
        view = self._tokens[: self._num_tokens]
        view.flags.writeable = False
        return view

    def append(self, token_id: int) -> None:
        if self._num_tokens == self._tokens.shape[0]:
            grown = np.empty(2 * self._tokens.shape[0], dtype=np.int64)
            grown[: self._num_tokens] = self._tokens[: self._num_tokens]
            self._tokens = grown
        self._tokens[self._num_tokens] = token_id
        self._num_tokens += 1
        if self.grammar is not None:
            self.grammar.consume(token_id)

    def with_drafts(self, drafts: np.ndarray) -> SamplingState:
        """A copy whose output goes on with ``drafts`` (speculative decoding: the state the
        position after them samples with), sharing the prompt. Under a grammar the copy's
        matcher has consumed the drafts too (the request's own follows confirmed tokens
        only, appended from the result)."""
        copy = self._copy(self.sample_index, np.concatenate([self.output_token_ids, drafts]))
        if self.grammar is not None:
            copy.grammar = self.grammar.after_drafts(drafts)
        return copy

    def _copy(self, sample_index: int, output_token_ids: np.ndarray) -> SamplingState:
        """A state with these outputs and index, sharing this one's (read-only) prompt."""
        copy = SamplingState(self.params, sample_index, output_token_ids)
        copy._prompt, copy._prompt_distinct = self._prompt, self._prompt_distinct
        return copy

    def fork(self, sample_index: int) -> SamplingState:
        """A child with a copy of this state's output tokens, the same prompt (read-only,
        so shared rather than copied) and its own sample index."""
        child = self._copy(sample_index, self.output_token_ids)
        if self.grammar is not None:
            child.grammar = self.grammar.fork()
        return child

    def __repr__(self) -> str:
        return (f"SamplingState(sample_index={self.sample_index}, "
                f"num_output_tokens={self._num_tokens}, params={self.params!r})")
