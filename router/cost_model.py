"""An executor's measured speed, learned from its StepResults: what routing and preemption
price work with.

A step's forward time is modelled as

    forward_s = fixed_s + prefill tokens x s_per_token + decoding sequences x s_per_seq

and the three are fitted per executor by exponentially weighted least squares: each step
is one observation, every older one weighs FORGET times less per step since (about the last
20 steps count), plus a weak ridge towards the priors. The fit works in units where a
step's three terms are of order one (1, tokens / PREFILL_SCALE, sequences / DECODE_SCALE),
so the one ridge weight means the same for each; where the steps seen cannot tell two terms
apart (only single-sequence decodes so far: fixed cost and per-sequence cost move together)
the ridge keeps the rest at the prior, and the fixed cost takes what is common.

Why not a ratio of seconds to tokens: it folds the step's fixed cost into the per-token
rate, so a short prompt teaches a low rate. On a 2-core CPU the built-in model took 226 ms
for a 37-token prompt and 443 ms for a 100-token one on the same executor: 164 against 226
tokens per second as ratios, one rate (~3.5 ms per token) after a fixed ~95 ms (the
single-sequence decode step). With ratios, an executor whose only prefill was a short
prompt looked a third slower than its twin, routing sent it nothing, and it never learned
better (benchmarks/README, routing_sim: "noise in the measured prefill rates").

Swaps keep a ratio (seconds per block moved, exponential average): a swap's fixed cost is
small next to its copies.

Chooses swap or recompute for a victim in `auto` mode:
    swap cost      = 2 x (blocks the group holds) x seconds per block moved (out, then in)
    recompute cost = (tokens the group has computed) x seconds per token of prefill
Swap needs free CPU blocks; without them it is recompute. Routing reads the prefill and
decode rates and the fixed cost (`Scheduler.prefill_tokens_per_s`, `decode_s_per_seq`,
`step_fixed_s`).
"""

from __future__ import annotations

# Priors of an executor's rates before its first measurement: 0.2 ms per prefill token
# (5,000 tokens/s, a small model on one CPU core), 0.5 ms per decoding sequence in a step
# and 20 us per block moved by a swap; no fixed cost. Routing compares executors by these,
# so a common prior cancels out; it assumes the measured executors' mean for one not
# measured yet.
DEFAULT_PREFILL_S_PER_TOKEN = 2e-4
DEFAULT_DECODE_S_PER_SEQ = 5e-4
DEFAULT_SWAP_S_PER_BLOCK = 2e-5
# Each swap measurement moves its rate this far towards it.
RATE_EMA_WEIGHT = 0.2
# The step fit: weight of an observation one step older (0.95: ~20 steps), the units of its
# prefill and decode terms, and the ridge weights (in observations of unit size) towards the
# prior: weak for the fixed cost and the per-token cost, which the steps seen soon tell
# apart; stronger for the per-sequence cost. Decode steps of a steady batch cannot tell a
# step's fixed cost from its per-sequence cost, and a step's time hardly grows with the
# sequences decoding (reading the weights dominates), so what is common goes to the fixed
# cost until batches of other sizes say otherwise.
FORGET = 0.95
PREFILL_SCALE = 256.0
DECODE_SCALE = 16.0
RIDGE = (0.01, 1e-4, 0.05)  # fixed, per token, per sequence
# The fitted per-unit costs never go below this share of their prior (noise, or a fit that
# gave the fixed cost too much, must not make prefill look free).
MIN_RATE_SHARE_OF_PRIOR = 1e-3
# Nor does the per-token cost go below MIN_TOKEN_COST_SHARE_OF_RATIO of what a step
# prefilling FLOOR_PROMPT_TOKENS tokens costs a token, fixed cost included: (the prefill
# steps' average seconds, decodes taken out, less the fitted fixed cost) / their average
# tokens, plus the fixed cost / FLOOR_PROMPT_TOKENS. Where a step's fixed cost dwarfs its
# prompt (a small model's short prompts; any prompt of a few hundred tokens on a GPU) the
# marginal cost is a small difference of noisy times and can come out near zero; routing
# would then think moving a tenant's prefix free. The floor is priced at one prompt length
# for every executor. The earlier floor, half the plain ratio of the prompts an executor
# happened to see, priced an executor whose prefills were short prompts up to F / T
# higher than its twin: on a 2-core VM computing in bfloat16 (68 ms steps) a 37-token
# prompt's floor read 1.28 ms a token where a 403-token prompt's executor priced 0.68 (its
# fit), the same true 0.7, and routing sent every new tenant to the second executor
# (benchmarks/README "The prefill cost's floor").
MIN_TOKEN_COST_SHARE_OF_RATIO = 0.5
FLOOR_PROMPT_TOKENS = int(PREFILL_SCALE)
# A step that prefills fewer tokens does not make the prefill rate "measured" for routing
# (it still enters the fit).
MIN_PREFILL_TOKENS_OBSERVED = 32


class _Ratio:
    """Exponential averages of seconds and of units; the rate is their ratio. The first
    observation replaces the prior."""

    __slots__ = ("seconds", "units", "measured", "prior")

    def __init__(self, prior: float) -> None:
        self.prior = prior
        self.seconds = 0.0
        self.units = 0.0
        self.measured = False

    def observe(self, units: float, seconds: float) -> None:
        w = RATE_EMA_WEIGHT if self.measured else 1.0
        self.seconds = (1 - w) * self.seconds + w * seconds
        self.units = (1 - w) * self.units + w * units
        self.measured = True

    @property
    def s_per_unit(self) -> float:
        return self.seconds / self.units if self.measured else self.prior


class StepTimeFit:
    """forward_s ~ fixed + tokens x per_token + seqs x per_seq, weighted least squares with
    forgetting and a ridge towards the prior (see the module docstring). The normal
    equations are kept as sums (6 + 3 numbers) and solved when a value is asked for."""

    __slots__ = ("_xx", "_xy", "_prior", "_theta")

    def __init__(self, s_per_token: float, s_per_seq: float) -> None:
        self._prior = (0.0, s_per_token * PREFILL_SCALE, s_per_seq * DECODE_SCALE)
        self._xx = [0.0] * 6  # upper triangle of sum w x x^T: 00 01 02 11 12 22
        self._xy = [0.0] * 3
        self._theta: tuple[float, float, float] | None = self._prior

    def observe(self, num_prefill_tokens: int, num_decode_seqs: int, seconds: float) -> None:
        x1, x2 = num_prefill_tokens / PREFILL_SCALE, num_decode_seqs / DECODE_SCALE
        xx, xy, g = self._xx, self._xy, FORGET
        xx[0] = g * xx[0] + 1.0
        xx[1] = g * xx[1] + x1
        xx[2] = g * xx[2] + x2
        xx[3] = g * xx[3] + x1 * x1
        xx[4] = g * xx[4] + x1 * x2
        xx[5] = g * xx[5] + x2 * x2
        xy[0] = g * xy[0] + seconds
        xy[1] = g * xy[1] + x1 * seconds
        xy[2] = g * xy[2] + x2 * seconds
        self._theta = None

    def _solve(self) -> tuple[float, float, float]:
        """The ridge-regularised normal equations, a symmetric 3 x 3 system, solved by its
        cofactors (a few microseconds: read on every step for the plan's deadline)."""
        if self._theta is None:
            a, b, c, d, e, f = self._xx
            a, d, f = a + RIDGE[0], d + RIDGE[1], f + RIDGE[2]
            p0, p1, p2 = self._prior
            y0 = self._xy[0] + RIDGE[0] * p0
            y1 = self._xy[1] + RIDGE[1] * p1
            y2 = self._xy[2] + RIDGE[2] * p2
            c00, c01, c02 = d * f - e * e, c * e - b * f, b * e - c * d
            c11, c12, c22 = a * f - c * c, b * c - a * e, a * d - b * b
            det = a * c00 + b * c01 + c * c02
            self._theta = ((c00 * y0 + c01 * y1 + c02 * y2) / det,
                           (c01 * y0 + c11 * y1 + c12 * y2) / det,
                           (c02 * y0 + c12 * y1 + c22 * y2) / det)
        return self._theta

    @property
    def fixed_s(self) -> float:
        return max(self._solve()[0], 0.0)

    @property
    def s_per_token(self) -> float:
        floor = MIN_RATE_SHARE_OF_PRIOR * self._prior[1]
        return max(self._solve()[1], floor) / PREFILL_SCALE

    @property
    def s_per_seq(self) -> float:
        floor = MIN_RATE_SHARE_OF_PRIOR * self._prior[2]
        return max(self._solve()[2], floor) / DECODE_SCALE


class CostModel:
    """An executor's measured rates (see the module docstring)."""

    def __init__(self, s_per_block: float = DEFAULT_SWAP_S_PER_BLOCK,
                 s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN,
                 s_per_seq: float = DEFAULT_DECODE_S_PER_SEQ) -> None:
        self._swap = _Ratio(s_per_block)
        self._steps = StepTimeFit(s_per_token, s_per_seq)
        self._prefill_ratio = _Ratio(s_per_token)  # steps of MIN_PREFILL_TOKENS_OBSERVED
        self.decode_measured = False  # a step with a decoding sequence seen

    @property
    def prefill_measured(self) -> bool:
        """A step that prefilled at least MIN_PREFILL_TOKENS_OBSERVED tokens was seen."""
        return self._prefill_ratio.measured

    @property
    def s_per_block(self) -> float:
        return self._swap.s_per_unit

    @property
    def s_per_token(self) -> float:
        """Seconds one more prefill token adds to a step (at least
        MIN_TOKEN_COST_SHARE_OF_RATIO of a FLOOR_PROMPT_TOKENS-token prefill's cost a token,
        fixed cost included: see the constants)."""
        fit = self._steps.s_per_token
        ratio = self._prefill_ratio
        if not ratio.measured:
            return fit
        fixed = self._steps.fixed_s
        marginal = max(ratio.seconds - fixed, 0.0) / ratio.units
        floor = MIN_TOKEN_COST_SHARE_OF_RATIO * (marginal + fixed / FLOOR_PROMPT_TOKENS)
        return max(fit, floor)

    @property
    def s_per_seq(self) -> float:
        """Seconds one more decoding sequence adds to a step."""
        return self._steps.s_per_seq

    @property
    def fixed_s(self) -> float:
        """Seconds of a step whatever it computes."""
        return self._steps.fixed_s

    def observe_swap(self, num_blocks: int, seconds: float) -> None:
        if num_blocks > 0 and seconds > 0:
            self._swap.observe(num_blocks, seconds)

    def observe_step(self, num_prefill_tokens: int, num_decode_seqs: int,
                     seconds: float) -> None:
        """`seconds` of forward for a step of `num_prefill_tokens` tokens in prefill chunks
        and `num_decode_seqs` sequences computing one token."""
        if seconds <= 0 or (num_prefill_tokens == 0 and num_decode_seqs == 0):
            return
        self._steps.observe(num_prefill_tokens, num_decode_seqs, seconds)
        if num_prefill_tokens >= MIN_PREFILL_TOKENS_OBSERVED:
            decode_s = num_decode_seqs * self.s_per_seq
            self._prefill_ratio.observe(num_prefill_tokens, max(seconds - decode_s,
                                                                0.1 * seconds))
        if num_decode_seqs > 0:
            self.decode_measured = True

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A step that only prefilled `num_tokens` tokens in `seconds`."""
        self.observe_step(num_tokens, 0, seconds)

    def prefer_swap(self, num_blocks: int, num_tokens: int) -> bool:
        return 2 * num_blocks * self.s_per_block < num_tokens * self.s_per_token
