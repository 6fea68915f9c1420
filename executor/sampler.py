"""Batched sampling on the device (pure torch): one call per step for the R rows that sample.

Hot path: per-request Python work is O(R) attribute reads and a few small tensors per step.
Do not add per-token Python loops, per-row device syncs or anything that walks the vocabulary.

Pipeline (vLLM's order), on fp32 copies of the logits [R, V]:

0. logit_bias: the request's bias added to its tokens' logits (OpenAI; HF's sequence_bias of
   single tokens, which transformers also applies before the penalties);
1. penalties on the raw logits (DESIGN §2; vLLM's and HF's semantics). Repetition counts
   the PROMPT and the output: each distinct token of prompt ∪ output has its logit divided by
   the penalty when positive, multiplied when negative, once (a token in both, or repeated,
   is penalised once). Frequency and presence count the OUTPUT only (OpenAI: subtract
   ``frequency * count + presence * (count > 0)``, count = occurrences in the output);
   repetition is applied first;
2. min_tokens: while a request has fewer than ``min_tokens`` output tokens, its EOS ids
   (unless ``ignore_eos``) and ``stop_token_ids`` are set to -inf; bad words (vLLM's): the
   last token of each bad word whose other tokens end the output (every step, for a
   one-token word) is set to -inf; allowed_token_ids: every other token is set to -inf
   (where the masks above would leave none of them, they are not applied to the row);
2b. structured output: every token the request's grammar cannot take next is set to -inf
   (grammar.py; one bitmask for all constrained rows); where the grammar and the
   allowed_token_ids leave no token, the grammar wins (the row as it was before the allowed
   mask, the grammar's applied), so the output still matches its format;
3. greedy rows (temperature < 1e-5, or top_k == 1) take the exact argmax (first index on
   ties) and stop here;
4. the other rows: divide by the temperature, keep the top-k logits, then the top-p nucleus
   (the smallest prefix of the descending order whose mass reaches top_p, computed on the
   top-k-renormalised distribution), softmax, then drop probabilities below
   ``min_p * max_prob``. Filters work as thresholds on the value, so tokens tied with the
   last kept one are kept too; a probability below exp(-86.5) times the best one is 0.
   The nucleus is read from the best 256 tokens; a row whose nucleus reaches past them is
   sorted whole on a CPU, and thresholded whole on a GPU by a kernel that needs no host
   read (kernels/sampling_ops.py: the same nucleus up to float rounding at its edge);
5. keyed inverse-CDF sampling (below); the softmax, min-p and the draw are
   ``ops.keyed_draw_``: on a GPU three launches that read the row twice and write only
   the tokens (kernels/draw_ops.py), the same tokens as the twin's passes up to the float
   rounding of a cumulative sum at a token's edge.

Randomness. Each sampling row draws ONE uniform, a counter-based hash of
(seed, sample_index, output position) where position = number of output tokens the
request already has:

    h = splitmix64(splitmix64(splitmix64(seed) ^ sample_index) ^ position)
    u = ((h >> 11) + 0.5) / 2**53                       # in (0, 1)
    token = first i with cumsum(probs)[i] > u * sum(probs)

No generator state exists anywhere, so the same seed gives the same tokens whatever else
is in the batch, in whatever row order, after preemption, migration or on another executor
(bitwise on the same device kind; across device kinds up to float rounding of the cdf at a
bin edge). Every operation is per row, and a token of probability 0 can never be drawn (its
cdf step is empty). Inverse-CDF is exact in distribution; it is used rather than a
per-vocabulary-entry Gumbel/exponential race because hashing R*V counters costs ~50 ms on a
2-core CPU at R=128, V=32000, against ~2 ms for one softmax and one cumsum.

Logprobs are the log-softmax of the RAW logits (before penalties and temperature).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from pagedserve.executor.device_copy import to_device, to_device_many
from pagedserve.executor.grammar import apply_grammar_masks_, fill_grammar_masks
from pagedserve.executor.host_pool import HostPool
from pagedserve.executor.penalties import has_penalty, penalise_rows_
from pagedserve.executor.sampled import SampledOnDevice, SamplerOutput
from pagedserve.executor.sampling_state import SamplingState, is_greedy
from pagedserve.kernels import ops, reference
from pagedserve.protos.wire import SamplingParams

_TOP_P_FIRST_K = 256  # top-p first looks at this many best tokens, sorts fully only if needed
_MASK64 = (1 << 64) - 1


# --------------------------------------------------------------------------- randomness


def _splitmix64(z: np.ndarray) -> np.ndarray:
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _low_64_bits(values: Sequence[int]) -> np.ndarray:
    """uint64 [N]: each value's low 64 bits (two's complement for a negative one). In one
    conversion when every value is in [0, 2^64), as a step's seeds, indices and positions
    are (numpy raises OverflowError otherwise); a Python pass a value only then (256 rows:
    the three conversions took ~110 us a step that way)."""
    try:
        return np.array(values, dtype=np.uint64)
    except OverflowError:
        return np.array([int(v) & _MASK64 for v in values], dtype=np.uint64)


def keyed_uniform(seeds: Sequence[int], sample_indices: Sequence[int],
                  positions: Sequence[int]) -> np.ndarray:
    """float64 [N] in (0, 1), a pure function of each (seed, sample_index, position)."""
    seed = _low_64_bits(seeds)
    index = _low_64_bits(sample_indices)
    pos = _low_64_bits(positions)
    with np.errstate(over="ignore"):
        h = _splitmix64(_splitmix64(_splitmix64(seed) ^ index) ^ pos)
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0 ** -53


# --------------------------------------------------------------------------- logit processors


def apply_top_k_(logits: torch.Tensor, top_k: torch.Tensor,
                 k_max: int | None = None) -> torch.Tensor:
    """In place: keep logits >= the k-th largest of their row (1 <= top_k[i] <= V).
    ``k_max``: max(top_k) when the caller knows it (no device-to-host read)."""
    values = logits.topk(int(top_k.max()) if k_max is None else k_max, dim=-1).values
    kth = values.gather(1, (top_k - 1).unsqueeze(1))
    return logits.masked_fill_(logits < kth, float("-inf"))


def top_p_thresholds(logits: torch.Tensor, top_p: torch.Tensor, *,
                     backend: str = "auto") -> torch.Tensor:
    """[R, 1]: each row's nucleus threshold, the value of the last token kept (the tokens in
    descending order while the probability mass strictly before them is < top_p, so at
    least the best token; ties with it kept too). ``backend``: of the whole-row threshold
    (kernels.ops.top_p_thresholds_)."""
    vocab = logits.shape[1]
    lse = torch.logsumexp(logits, -1, keepdim=True)
    first_k = min(vocab, _TOP_P_FIRST_K)
    desc = logits.topk(first_k, dim=-1).values
    thresholds, n_keep = reference.top_p_threshold(desc, lse, top_p)
    if first_k < vocab:
        # The nucleus may reach past the first_k best tokens: those rows' threshold over
        # the whole row (on a GPU, computed for the rows that need it with no host read).
        unresolved = (n_keep == first_k) & (desc[:, -1] > float("-inf"))
        ops.top_p_thresholds_(logits, lse, top_p, thresholds, unresolved, backend=backend)
    return thresholds


def _on_rows_(x: torch.Tensor, rows: list[int], fn, *row_params: list) -> None:
    """``fn(x[rows], *params)`` written back in place; no gather when every row takes part."""
    params = [to_device(p, x.device) for p in row_params]
    if len(rows) == x.shape[0]:
        fn(x, *params)
    else:
        idx = to_device(rows, x.device)
        x[idx] = fn(x[idx], *params)


def _row_token_pairs(rows, id_lists: Sequence[Sequence[int]],
                     vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, token) index arrays of every id of ``id_lists[i]`` for ``rows[i]``, and which
    pairs to keep (ids past the vocabulary are skipped: the router checked them against
    the same one)."""
    r = np.repeat(np.asarray(rows, dtype=np.int64), [len(ids) for ids in id_lists])
    t = np.fromiter((t for ids in id_lists for t in ids), np.int64, r.shape[0])
    return r, t, (t >= 0) & (t < vocab)


def apply_logit_bias_(logits: torch.Tensor, rows: list[int],
                      params: Sequence[SamplingParams]) -> torch.Tensor:
    """In place: row rows[i] gets params[i]'s bias added to its tokens' logits."""
    r, t, keep = _row_token_pairs(rows, [p.logit_bias_ids for p in params], logits.shape[1])
    v = np.fromiter((v for p in params for v in p.logit_bias_values), np.float32, r.shape[0])
    device = logits.device
    logits[to_device(r[keep], device), to_device(t[keep], device)] += to_device(
        v[keep], device)  # ids distinct per row
    return logits


def _min_tokens_masked_ids(state: SamplingState, vocab: int) -> list[int]:
    """Token ids forced to -inf this step: EOS (unless ignore_eos) and stop ids."""
    p = state.params
    if state.num_output_tokens >= p.min_tokens:
        return []
    ids = p.stop_token_ids if p.ignore_eos else p.eos_token_ids + p.stop_token_ids
    return [t for t in ids if 0 <= t < vocab]


def _bad_word_ids(state: SamplingState, vocab: int) -> list[int]:
    """The last token of every bad word whose other tokens end the output (a one-token
    word's always): the tokens this step may not sample."""
    out = state.output_token_ids
    banned = []
    for word in state.params.bad_words_token_ids:
        head = len(word) - 1
        if head <= out.shape[0] and (head == 0 or out[-head:].tolist() == list(word[:-1])) \
                and 0 <= word[-1] < vocab:
            banned.append(word[-1])
    return banned


def _grammar_wins_(x: torch.Tensor, idx: torch.Tensor, before_allowed: torch.Tensor,
                   bits: np.ndarray) -> None:
    """In place: rows ``idx`` of x whose allowed tokens and grammar left none take their
    logits before the allowed mask (``before_allowed``) with only the grammar's (``bits``,
    their bitmask rows) applied. No host read: the choice is a ``torch.where`` per row."""
    grammar_only = apply_grammar_masks_(before_allowed, list(range(idx.shape[0])), bits)
    rows = x[idx]
    x[idx] = torch.where(torch.isneginf(rows).all(-1, keepdim=True), grammar_only, rows)


def apply_allowed_(logits: torch.Tensor, rows: list[int],
                   params: Sequence[SamplingParams]) -> torch.Tensor:
    """In place: row rows[i] keeps the logits of params[i].allowed_token_ids, every other
    token -inf."""
    vocab, device = logits.shape[1], logits.device
    r, t, keep = _row_token_pairs(range(len(rows)), [p.allowed_token_ids for p in params],
                                  vocab)
    allowed = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
    allowed[to_device(r[keep], device), to_device(t[keep], device)] = True
    idx = to_device(rows, device)
    logits[idx] = logits[idx].masked_fill_(~allowed, float("-inf"))
    return logits


class RowWork(NamedTuple):
    """What a step's rows ask the sampler for beyond an argmax (row indices)."""

    greedy: list[bool]
    pen_rows: list[int]  # penalties due (a penalty asked for and something to count)
    mask_rows: list[int]  # (row, token) pairs masked below min_tokens ...
    mask_ids: list[int]
    bias_rows: list[int]
    grammar_rows: list[int]
    allowed_rows: list[int]  # rows restricted to their allowed_token_ids
    plain_greedy: bool  # none of the above and no logprobs: the argmax alone


def row_work(states: Sequence[SamplingState], vocab: int) -> RowWork:
    """One pass over the rows for what only some of them ask for (the usual step: none)."""
    greedy = [is_greedy(s.params) for s in states]
    pen_rows: list[int] = []
    mask_rows: list[int] = []
    mask_ids: list[int] = []
    bias_rows: list[int] = []
    grammar_rows: list[int] = []
    allowed_rows: list[int] = []
    for i, s in enumerate(states):
        p = s.params
        if (p.repetition_penalty != 1.0 or p.presence_penalty
                or p.frequency_penalty) and has_penalty(s):
            pen_rows.append(i)
        masked = _min_tokens_masked_ids(s, vocab) if s.num_output_tokens < p.min_tokens else []
        if p.bad_words_token_ids:
            masked += _bad_word_ids(s, vocab)
        if masked and p.allowed_token_ids and set(p.allowed_token_ids) <= set(masked):
            masked = []  # nothing left to sample: the allowed tokens win
        if masked:
            mask_rows += [i] * len(masked)
            mask_ids += masked
        if p.logit_bias_ids:
            bias_rows.append(i)
        if s.grammar is not None:
            grammar_rows.append(i)
        if p.allowed_token_ids:
            allowed_rows.append(i)
    plain_greedy = (all(greedy) and not pen_rows and not mask_rows and not bias_rows
                    and not grammar_rows and not allowed_rows
                    and all(s.params.logprobs is None for s in states))
    return RowWork(greedy, pen_rows, mask_rows, mask_ids, bias_rows, grammar_rows,
                   allowed_rows, plain_greedy)


# --------------------------------------------------------------------------- sampler


class Sampler:
    """``Sampler()(logits [R, V], states) -> SamplerOutput``; does not modify the states
    (the executor appends the sampled tokens with ``state.append``).

    On CPU it keeps up to three [R, V] fp32 work buffers between calls (fresh 16 MB allocations
    cost more than the arithmetic there), so one Sampler serves one thread at a time.
    """

    def __init__(self) -> None:
        self._buffers: dict[int, torch.Tensor] = {}
        # Of the device kernels the sampler calls (kernels.ops): "torch" after the executor's
        # start-up check found one failing (kernel_checks.py).
        self.kernel_backend = "auto"
        # 16-bit logits widened to a float32 copy before anything reads them? None: on a
        # CPU (its argmax and arithmetic over bf16 are slow) and wherever a row asks for
        # logprobs or a grammar; a GPU otherwise reads them as they are (widening is exact,
        # so every value is the same) and skips a pass over [R, V]. Tests set False to run
        # the GPU's path on a CPU.
        self.widen_logits: bool | None = None
        # The read-backs' events and host buffers, used again (the runner's, which gives
        # them back; host_pool.py). None: made fresh every launch.
        self.pool: HostPool | None = None

    def _buffer(self, slot: int, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
        if device.type != "cpu":  # the caching allocator makes fresh tensors cheap there
            return torch.empty(shape, dtype=torch.float32, device=device)
        size = shape[0] * shape[1]
        buf = self._buffers.get(slot)
        if buf is None or buf.numel() < size:
            buf = self._buffers[slot] = torch.empty(size, dtype=torch.float32)
        return buf[:size].view(shape)

    @staticmethod
    def grammar_masks(states: Sequence[SamplingState]) -> np.ndarray | None:
        """The bitmask of the constrained rows among `states`, in their order (None: none
        is constrained). Host work that needs no logits: the executor calls it while the
        forward runs on a GPU and hands it to ``__call__``."""
        rows = [s for s in states if s.grammar is not None]
        if not rows:
            return None
        return fill_grammar_masks([s.grammar for s in rows],
                                  [s.params.eos_token_ids for s in rows])

    def __call__(self, logits: torch.Tensor, states: Sequence[SamplingState],
                 grammar_bits: np.ndarray | None = None) -> SamplerOutput:
        """`grammar_bits`: `grammar_masks(states)` computed ahead (else computed here)."""
        return self.launch(logits, states, grammar_bits).result()

    def launch(self, logits: torch.Tensor, states: Sequence[SamplingState],
               grammar_bits: np.ndarray | None = None,
               argmax: torch.Tensor | None = None,
               plain: bool | None = None) -> SampledOnDevice:
        """`__call__` without waiting: the tokens stay on the device and their copies to
        the host are queued (the executor launches its next step before reading them).
        ``argmax``: every row's greedy token, already computed from these ``logits`` (a
        decode graph's, cuda_graphs.py): when every row is plain greedy, they are the
        tokens, and nothing is launched but their copy. ``plain``: whether every row is plain
        greedy, when the caller has looked already (None: looked at here)."""
        num_rows, vocab = logits.shape
        if num_rows != len(states):
            raise ValueError(f"{num_rows} rows of logits for {len(states)} states")
        device = logits.device
        if plain is None:
            plain = all(s.plain for s in states)
        if plain and argmax is not None:
            if argmax.shape != (num_rows,):
                raise ValueError(f"argmax of {tuple(argmax.shape)} for {num_rows} rows")
            # The device tokens stay the graph's buffer (the next step's input ids read it
            # before the next replay overwrites it); their host copy must be a copy: a
            # GPU's is (queued now, in stream order), a CPU's is made here.
            return self._plain_output(argmax, own_host_copy=not argmax.is_cuda)
        if plain and device.type != "cpu":
            # Fast path on a GPU (the usual decode step): argmax of the 16-bit logits as
            # they are (widening to float32 is exact, so the same token, first index on
            # ties); the float32 copy and an argmax over it cost ~0.17 ms a step at 256
            # rows x 152k vocabulary on an H200, and torch's argmax alone 63 us
            # (kernels/sampling_ops.py splits the rows). One flag a row: the per-row
            # checks below cost ~0.1 ms of host time at 256 rows.
            return self._plain_output(ops.argmax_rows(logits, backend=self.kernel_backend))
        params = [s.params for s in states]
        (greedy, pen_rows, mask_rows, mask_ids, bias_rows, grammar_rows, allowed_rows,
         plain_greedy) = row_work(states, vocab)
        if plain_greedy and device.type != "cpu":  # min_tokens met, penalties not yet due
            return self._plain_output(ops.argmax_rows(logits, backend=self.kernel_backend))
        raw = logits
        widen = self.widen_logits
        if widen is None:
            widen = (device.type == "cpu" or bool(grammar_rows)
                     or any(p.logprobs is not None for p in params))
        if logits.dtype != torch.float32 and widen:  # once, for every reader below
            raw = self._buffer(2, logits.shape, device).copy_(logits)
        if plain_greedy:
            return self._output(raw, raw.argmax(-1), params)  # fast path

        x = raw
        if pen_rows or mask_rows or bias_rows or allowed_rows:
            x = self._buffer(0, raw.shape, device).copy_(raw)
        if bias_rows:
            apply_logit_bias_(x, bias_rows, [params[i] for i in bias_rows])
        if pen_rows:
            penalise_rows_(x, pen_rows, states)
        if mask_rows:
            x[to_device(mask_rows, device), to_device(mask_ids, device)] = float("-inf")
        both = [i for i in allowed_rows if states[i].grammar is not None] \
            if allowed_rows and grammar_rows else []
        if both:  # the rows before the allowed mask, in case the grammar must win
            both_idx = to_device(both, device)
            before_allowed = x[both_idx]
        if allowed_rows:
            apply_allowed_(x, allowed_rows, [params[i] for i in allowed_rows])
        if grammar_rows:
            if grammar_bits is None:
                grammar_bits = self.grammar_masks(states)
            # Nothing copied yet: the masked copy is the copy (one pass over [R, V]).
            out = self._buffer(0, raw.shape, device) if x is raw else None
            x = apply_grammar_masks_(x, grammar_rows, grammar_bits, out=out)
        if both:
            _grammar_wins_(x, both_idx, before_allowed,
                           grammar_bits[[grammar_rows.index(i) for i in both]])

        if all(greedy):
            tokens = x.argmax(-1)
        elif not any(greedy):
            tokens = self._sample_random(x, None, states)
        else:
            tokens = torch.empty(num_rows, dtype=torch.int64, device=device)
            g_idx = to_device([i for i, g in enumerate(greedy) if g], device)
            tokens[g_idx] = x[g_idx].argmax(-1)
            rand_rows = [i for i, g in enumerate(greedy) if not g]
            tokens[to_device(rand_rows, device)] = self._sample_random(
                x, rand_rows, [states[i] for i in rand_rows])
        return self._output(raw, tokens, params)

    def _sample_random(self, logits: torch.Tensor, rows: list[int] | None,
                       states: Sequence[SamplingState]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, keyed draw for ``logits[rows]`` (all rows when
        None); ``logits`` is not modified."""
        device, vocab = logits.device, logits.shape[1]
        params = [s.params for s in states]
        k_rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
        p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
        u = keyed_uniform([p.seed for p in params], [s.sample_index for s in states],
                          [s.num_output_tokens for s in states])
        # The rows' figures in one copy to the device (a GPU: one pinned buffer, one launch)
        wanted = {"temps": ([p.temperature for p in params], torch.float32),
                  "u": (u, torch.float64)}
        if rows is not None:
            wanted["rows"] = (rows, torch.int64)
        if any(p.min_p > 0.0 for p in params):
            wanted["min_p"] = ([p.min_p for p in params], torch.float32)
        on_device = dict(zip(wanted, to_device_many(list(wanted.values()), device),
                             strict=True))
        temps, u = on_device["temps"], on_device["u"]
        row_idx, min_p = on_device.get("rows"), on_device.get("min_p")
        x = self._buffer(1, (len(states), vocab), device)
        backend = self.kernel_backend
        # Softmax, min-p and the keyed draw: one kernel set on a GPU (draw_ops.py), the
        # twin's in-place passes over x elsewhere. With no top-k or top-p row the division
        # by the temperature is the draw's too: a GPU writes no tempered copy.
        if not k_rows and not p_rows:
            return ops.keyed_draw_(logits, min_p, u, temperature=temps, rows=row_idx, out=x,
                                   backend=backend)
        reference.tempered(logits, temps, row_idx, out=x)
        if k_rows:
            ks = [params[i].top_k for i in k_rows]
            _on_rows_(x, k_rows, functools.partial(apply_top_k_, k_max=max(ks)), ks)
        floor = None
        if p_rows:
            # The nucleus as a floor a row the draw applies as it reads (no fill written
            # over [R, V]; the twin fills)
            top_p = to_device([params[i].top_p for i in p_rows], device)
            if len(p_rows) == len(params):
                floor = top_p_thresholds(x, top_p, backend=backend).view(-1)
            else:
                p_idx = to_device(p_rows, device)
                floor = torch.full((len(params),), float("-inf"), device=device)
                floor[p_idx] = top_p_thresholds(x[p_idx], top_p, backend=backend).view(-1)
        return ops.keyed_draw_(x, min_p, u, floor=floor, backend=backend)

    def _plain_output(self, tokens: torch.Tensor,
                      own_host_copy: bool = False) -> SampledOnDevice:
        """The tokens alone (no row asks for logprobs); ``own_host_copy``: a CPU's host
        side a copy of them, not the tensor itself."""
        num_rows = tokens.shape[0]

        # The int64 tokens go to the host as they are: narrowed there (a few hundred
        # values), not by a cast launched on the device (~20 us of host time a step on a
        # GPU's host, 2026-11-27 trace).
        def plain(token_ids: np.ndarray) -> SamplerOutput:
            return SamplerOutput(token_ids.astype(np.int32),
                                 np.full(num_rows, np.nan, dtype=np.float32),
                                 np.zeros(num_rows, dtype=np.int32),
                                 np.zeros(0, np.int32), np.zeros(0, np.float32))
        return SampledOnDevice(tokens, [tokens], plain, self.pool, copy_on_cpu=own_host_copy)

    def _output(self, raw: torch.Tensor, tokens: torch.Tensor,
                params: Sequence[SamplingParams]) -> SampledOnDevice:
        """The tokens and, for the rows that ask, their logprobs and top-k, computed on the
        device and queued for the host (no read here: boolean selections are done there)."""
        num_rows = raw.shape[0]
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not lp_rows:
            return self._plain_output(tokens)
        chosen = tokens
        if len(lp_rows) < num_rows:
            idx = to_device(lp_rows, raw.device)
            raw, chosen = raw[idx], tokens[idx]
        lp = torch.log_softmax(raw, -1)
        chosen_lp = lp.gather(1, chosen.unsqueeze(1)).squeeze(1)
        ks = [min(params[i].logprobs, raw.shape[1]) for i in lp_rows]
        k_max = max(ks)
        host = [tokens.to(torch.int32), chosen_lp]
        if k_max:
            top = lp.topk(k_max, dim=-1)
            host += [top.indices.to(torch.int32), top.values]

        def finish(token_ids, chosen_lp, top_ids=None, top_lps=None) -> SamplerOutput:
            logprobs = np.full(num_rows, np.nan, dtype=np.float32)
            logprobs[lp_rows] = chosen_lp
            top_counts = np.zeros(num_rows, dtype=np.int32)
            top_counts[lp_rows] = ks
            token_ids = token_ids.copy()  # a view of a host buffer that goes back
            if not k_max:
                return SamplerOutput(token_ids, logprobs, top_counts,
                                     np.zeros(0, np.int32), np.zeros(0, np.float32))
            want = np.arange(k_max) < np.asarray(ks)[:, None]  # row i keeps its first ks[i]
            return SamplerOutput(token_ids, logprobs, top_counts, top_ids[want],
                                 top_lps[want].astype(np.float32))

        return SampledOnDevice(tokens, host, finish, self.pool)
