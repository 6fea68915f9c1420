"""The router <-> executor step protocol (DESIGN §2).

The messages: typed structs (msgspec, tagged by ``type``) in MessagePack, their integer and
float arrays as raw little-endian buffers in frames beside the header; `codec.Codec` turns a
message into its ZeroMQ frames and back (the frame layout is described there). Nothing is
pickled. A message whose tag, version, array reference or shapes do not check out raises
``WireError`` and is never executed.

Arrays are numpy arrays on both sides (the router imports no torch); the executor wraps them
with ``torch.from_numpy`` without a copy.

HOT PATH: ``codec.Codec.encode``/``decode`` and ``StepPlan.validate`` run on every step at both ends
(~60 us of a ~180 us round trip for 256 decodes). No logging, no Python loops over array
elements, no decoder/encoder built per call, no check that could be a combined numpy call.
Never drop a check to go faster: every message is validated before anything acts on it.

Step protocol in one picture::

    router  --Hello?--  executor           executor connects, sends Hello
    router  --Welcome-> executor           accepted (or refused, with a reason)
    router  <-Heartbeat executor           every heartbeat interval, from a thread
    router  --StepPlan-> executor          one per step, in order; up to --pipeline-depth
                                           plans may be out before the first is answered
    router  <-StepResult executor          one per plan, same step_id, in plan order
    router  --Shutdown-> executor          drain/exit
"""

from __future__ import annotations

import msgspec
import numpy as np

# 2: pipelined steps (feed_sampled, deadline_s, gap_s); 3: logit_bias, grammar; 4: small arrays
# share frame 1 (references carry a byte offset); 5: allowed_token_ids, bad_words_token_ids
# (an executor that ignored them would sample what the request forbids); 6: LoRA adapters
# (NewRequest.lora, Hello.lora_adapters); 7: speculative decoding (StepPlan.num_draft_tokens;
# a result row per emitted token); 8: LoRA adapters loaded and unloaded while serving
# (StepPlan.lora_ops, StepResult.lora_failed, Hello.max_loras); 9: weight updates while serving
# (StepPlan.weight_op, StepResult.weight_failed, Hello.weights_path); 10: KV blocks moved
# between executors (StepPlan.kv_export, kv_import, kv_import_data, StepResult.kv_export_data,
# Hello.disaggregation_mode, kv_format)
PROTOCOL_VERSION = 10

_INT_KINDS = "iu"  # StepPlan arrays are integers (signed or unsigned), never floats


class WireError(ValueError):
    """A message that is malformed, of an unknown type or of another protocol version."""


class _Message(msgspec.Struct, tag_field="type", kw_only=True, frozen=True):
    version: int = PROTOCOL_VERSION


# --------------------------------------------------------------------------- registration


class Hello(_Message, tag="hello", frozen=True):
    """Executor -> router, first message after connecting (and after a router restart)."""

    executor_id: str
    model_fingerprint: str  # sha256 of config.json
    device: str
    dtype: str
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    max_model_len: int
    protocol_version: int = PROTOCOL_VERSION
    pid: int = 0
    hostname: str = ""
    lora_adapters: tuple[str, ...] = ()  # the LoRA adapters it serves (--lora-modules names)
    max_loras: int = 0  # adapter slots, --lora-modules' included (0: no loading at runtime)
    weights_path: str = ""  # the weights it runs: a directory loaded since start ("": --model's)
    # Prefill/decode disaggregation (--disaggregation-mode): "null" (both), "prefill" or
    # "decode" (router/handoff.py)
    disaggregation_mode: str = "null"
    # What one KV block is, byte for byte: KV blocks move only between executors whose
    # formats are equal ("": it moves none). kv_block_bytes: the size of one block.
    kv_format: str = ""
    kv_block_bytes: int = 0


class Welcome(_Message, tag="welcome", frozen=True):
    """Router -> executor: registration accepted or refused (then ``reason`` says why)."""

    executor_id: str
    accepted: bool
    reason: str = ""


class Heartbeat(_Message, tag="heartbeat", frozen=True):
    """Executor -> router from the heartbeat thread, independent of step work."""

    executor_id: str
    time_s: float
    steps_done: int = 0


class Shutdown(_Message, tag="shutdown", frozen=True):
    """Router -> executor: stop serving (``exit``) or just forget all state.
    Executor -> router (``executor_id`` set): "I am stopping" (SIGTERM, scale-down); the
    router moves the executor's requests elsewhere at once."""

    reason: str = ""
    exit: bool = True
    executor_id: str = ""


# --------------------------------------------------------------------------- StepPlan


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the executor needs to sample a request's tokens, already validated."""

    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 -> off
    min_p: float = 0.0
    seed: int = 0  # randomness is keyed on (seed, sample_index, output position)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0  # EOS and stop ids are masked until this many tokens are out
    logprobs: int | None = None  # None -> none; k -> sampled token's logprob plus top-k
    stop_token_ids: tuple[int, ...] = ()  # masked with EOS while below min_tokens
    eos_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logit_bias_ids: tuple[int, ...] = ()  # added to these tokens' logits before penalties
    logit_bias_values: tuple[float, ...] = ()  # same length and order
    grammar: str = ""  # structured output: an llguidance grammar; "" = free text
    prompt_logprobs: int | None = None  # score the prompt tokens computed: top-k of each
    allowed_token_ids: tuple[int, ...] = ()  # only these may be sampled; () = any
    # the last token of each is masked while the output ends with the tokens before it
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # return the final hidden state (after the model's last norm) of the prompt's last
    # token with the step that computes it (/v1/embeddings)
    embed: bool = False

    @property
    def has_logit_bias(self) -> bool:
        return bool(self.logit_bias_ids)


class NewRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A request's full data, sent once, the first time it is scheduled on an executor.

    ``output_token_ids`` is non-empty after preemption by recompute or a migration; the
    executor rebuilds the sampling state (penalty counts, output position) from it.
    """

    request_id: str
    prompt_token_ids: np.ndarray  # int32
    output_token_ids: np.ndarray  # int32
    sampling: SamplingParams
    sample_index: int = 0
    lora: str = ""  # the LoRA adapter its tokens run with ("" = the base model)


class Fork(msgspec.Struct, frozen=True):
    """The child starts with a copy of the parent's sampling state (output tokens so far);
    its own randomness comes from its own ``sample_index``."""

    parent_id: str
    child_id: str
    sample_index: int


class LoraOp(msgspec.Struct, frozen=True, kw_only=True):
    """Load LoRA adapter ``name`` from the PEFT directory ``path`` into a free slot, or
    unload it (``load`` false). A plan's ops are applied in order, before its new requests
    (executor/lora_ops.py)."""

    name: str
    load: bool
    path: str = ""


class LoraFailure(msgspec.Struct, frozen=True, kw_only=True):
    """A load of the plan that did not take effect, and why (one line)."""

    name: str
    message: str


class WeightOp(msgspec.Struct, frozen=True, kw_only=True):
    """Check (``load`` false) or load (``load`` true) the model weights of directory
    ``path`` (``*.safetensors``, maybe a config.json; "": the executor's own --model's)
    into the running model, in place:
    applied before anything else of the plan (executor/weight_ops.py; the router sends it
    only when no request runs: router/weight_sync.py)."""

    path: str
    load: bool


class StepPlan(_Message, tag="plan", frozen=True):
    """What one executor does in one step. Per-request arrays are in batch order
    (``request_ids``); per-token arrays are the requests' new tokens packed back to back.

    Block tables travel as changes: for request i, ``table[block_table_starts[i]:]`` is
    replaced by the next ``block_table_lens[i]`` ids of ``block_table_ids`` (an append has
    start == current length; copy-on-write of the last block has start == length - 1; a
    request new to the executor or swapped back in has start 0).

    The executor applies swap_out, then swap_in, then copy, then creates forks, then runs
    the forward pass. No block is both a source and a destination within one plan.

    Pipelining: the router may send this plan before the result of step ``step_id - 1`` is
    back. A decode whose input is the token being sampled in that step is marked in
    ``feed_sampled`` (its ``token_ids`` entry is -1, a placeholder, never a token): the
    executor feeds it the token it sampled for that request in step ``step_id - 1``. If it
    sampled none there (that step failed, or the request errored in it), the request is
    left out of this step and reported as an error of this step; no made-up token is fed.
    ``deadline_s`` (0: none) is how long the step may take once the executor starts it: an
    executor still inside the step after that stops heartbeating, so the router declares
    it dead (a hung kernel) and moves its requests.

    KV blocks between executors (prefill/decode disaggregation, router/handoff.py): the
    executor writes ``kv_import_data`` (``len(kv_import)`` blocks of its ``kv_block_bytes``,
    back to back) into CPU blocks ``kv_import`` before the swaps, so a swap-in of this plan
    may read them; after the forward it reads device blocks ``kv_export`` into its result's
    ``kv_export_data``, in that order.

    Speculative decoding: a row with ``num_draft_tokens[i] = d > 0`` is a decode whose
    input is followed by d draft tokens (its ``num_new_tokens`` is 1 + d, it samples, it
    is never marked). The executor samples at each of its 1 + d positions and answers
    with the tokens up to and including the first that differs from the draft after it.
    """

    step_id: int
    new_requests: list[NewRequest] = []
    forks: list[Fork] = []
    request_ids: list[str] = []
    num_computed_tokens: np.ndarray | None = None  # int32 [S]
    num_new_tokens: np.ndarray | None = None  # int32 [S]; the query length this step
    do_sample: np.ndarray | None = None  # uint8 [S]; 0 for a prefill chunk not ending the prompt
    feed_sampled: np.ndarray | None = None  # uint8 [S]; 1: input = own sample of step_id - 1
    token_ids: np.ndarray | None = None  # int32 [T]
    positions: np.ndarray | None = None  # int32 [T]
    slot_mapping: np.ndarray | None = None  # int64 [T]
    block_table_starts: np.ndarray | None = None  # int32 [S]
    block_table_lens: np.ndarray | None = None  # int32 [S]
    block_table_ids: np.ndarray | None = None  # int32 [sum(lens)]
    swap_out: np.ndarray | None = None  # int64 [P, 2] (device block, cpu block)
    swap_in: np.ndarray | None = None  # int64 [P, 2] (cpu block, device block)
    copy: np.ndarray | None = None  # int64 [P, 2] (src device block, dst device block)
    finished_ids: list[str] = []  # drop their state (finished, aborted, preempted, moved)
    deadline_s: float = 0.0  # seconds the step may run on the executor (0: no deadline)
    num_draft_tokens: np.ndarray | None = None  # [S]; speculative drafts after the input
    lora_ops: list[LoraOp] = []  # adapter loads and unloads, applied first, in order
    weight_op: WeightOp | None = None  # new weights, applied before everything else
    kv_import: np.ndarray | None = None  # int64 [I]: cpu blocks written from kv_import_data
    kv_import_data: np.ndarray | None = None  # uint8 [I * kv_block_bytes]
    kv_export: np.ndarray | None = None  # int64 [X]: device blocks read after the forward

    @property
    def num_seqs(self) -> int:
        return len(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return 0 if self.token_ids is None else int(self.token_ids.shape[0])

    def validate(self) -> None:
        """Check shapes, integer dtypes and internal consistency; raises WireError.

        Hot path (every plan, on the executor): a handful of numpy calls in all. Reductions
        over the per-request arrays are combined (one ``min`` over the bitwise OR of the four
        count arrays finds any negative entry) instead of one call per array.
        """
        s = len(self.request_ids)
        step = self.step_id
        seq_arrays = (self.num_computed_tokens, self.num_new_tokens, self.block_table_starts,
                      self.block_table_lens)
        token_arrays = (self.token_ids, self.positions, self.slot_mapping)
        do_sample = self.do_sample
        if s == 0:
            for arr in (*seq_arrays, do_sample, self.feed_sampled, *token_arrays,
                        self.block_table_ids):
                if arr is not None and (arr.ndim != 1 or arr.shape[0] != 0):
                    raise WireError(f"plan {step}: per-request arrays given without requests")
        else:
            for arr in seq_arrays:
                if arr is None or arr.shape != (s,) or arr.dtype.kind not in _INT_KINDS:
                    raise WireError(f"plan {step}: per-request arrays must be {s} integers")
            if do_sample is None or do_sample.shape != (s,) or do_sample.dtype.kind not in "iub":
                raise WireError(f"plan {step}: do_sample must have {s} entries")
            feed = self.feed_sampled
            if feed is not None and (feed.shape != (s,) or feed.dtype.kind not in "iub"):
                raise WireError(f"plan {step}: feed_sampled must have {s} entries")
            computed, num_new, starts, lens = seq_arrays
            if (computed | num_new | starts | lens).min() < 0:
                raise WireError(f"plan {step}: negative token count or block table change")
            t = int(num_new.sum())
            for arr in token_arrays:
                if arr is None or arr.shape != (t,) or arr.dtype.kind not in _INT_KINDS:
                    raise WireError(f"plan {step}: per-token arrays must be {t} integers")
            ids = self.block_table_ids
            n_ids = int(lens.sum())
            if ids is None:
                if n_ids:
                    raise WireError(f"plan {step}: block_table_ids must have {n_ids} entries")
            elif ids.shape != (n_ids,) or ids.dtype.kind not in _INT_KINDS:
                raise WireError(f"plan {step}: block_table_ids must be {n_ids} integers")
            if len(set(self.request_ids)) != s:
                raise WireError(f"plan {step}: a request is scheduled twice")
            drafts = self.num_draft_tokens
            if drafts is not None:
                if drafts.shape != (s,) or drafts.dtype.kind not in _INT_KINDS:
                    raise WireError(f"plan {step}: num_draft_tokens must be {s} integers")
                has = drafts > 0
                if drafts.min() < 0 or (drafts[has] >= num_new[has]).any() \
                        or not do_sample[has].all() \
                        or (feed is not None and feed[has].any()):
                    raise WireError(f"plan {step}: a row's drafts must be fewer than its "
                                    "tokens, and the row sampling and not fed")
        for pairs in (self.swap_out, self.swap_in, self.copy):
            if pairs is not None and (
                pairs.ndim != 2 or pairs.shape[1] != 2 or pairs.dtype.kind not in _INT_KINDS
            ):
                raise WireError(f"plan {step}: swap_out, swap_in and copy must be [P, 2] "
                                "integers")
        for name in ("kv_import", "kv_export"):
            ids = getattr(self, name)
            if ids is not None and (ids.ndim != 1 or ids.dtype.kind not in _INT_KINDS):
                raise WireError(f"plan {step}: {name} must be a list of block ids")
        data = self.kv_import_data
        if (data is None) != (self.kv_import is None) or (
                data is not None and (data.ndim != 1 or data.dtype != np.uint8)):
            raise WireError(f"plan {step}: kv_import_data must be bytes beside kv_import")
        copy = self.copy
        if copy is not None and copy.shape[0] and not set(copy[:, 0].tolist()).isdisjoint(
            copy[:, 1].tolist()
        ):
            raise WireError(f"plan {step}: a block is both copy source and target")


# --------------------------------------------------------------------------- StepResult


class RequestError(msgspec.Struct, frozen=True):
    """An error confined to one request (``request_id``) or to the whole step (empty id)."""

    request_id: str
    message: str


class StepResult(_Message, tag="result", frozen=True):
    """One per StepPlan. ``request_ids[i]`` sampled ``token_ids[i]``. A row with draft
    tokens answers with one entry per token it emits, consecutive and in order (the
    drafts the sampler confirmed, then the token sampled where it stopped confirming).

    ``logprobs[i]`` is the sampled token's log-softmax of the raw logits (NaN when that
    request asked for none). Top-k logprobs are flat: request i owns the next
    ``top_counts[i]`` entries of ``top_token_ids``/``top_logprobs``.
    """

    step_id: int
    executor_id: str = ""
    request_ids: list[str] = []
    token_ids: np.ndarray | None = None  # int32 [R]
    logprobs: np.ndarray | None = None  # float32 [R]
    top_counts: np.ndarray | None = None  # int32 [R]
    top_token_ids: np.ndarray | None = None  # int32 [sum(top_counts)]
    top_logprobs: np.ndarray | None = None  # float32 [sum(top_counts)]
    errors: list[RequestError] = []
    forward_s: float = 0.0  # the model forward and logits only
    sample_s: float = 0.0
    swap_s: float = 0.0
    # From the end of sampling of the executor's previous step to the start of this step's
    # forward: waiting for the plan, decoding it, block moves, preparing inputs.
    gap_s: float = 0.0
    # Prompt scores (requests with prompt_logprobs whose prompt was computed this step):
    # request prompt_ids[q] scored prompt tokens prompt_starts[q] ... + prompt_counts[q] - 1
    # (token t given tokens < t); each owns prompt_counts[q] entries of prompt_logprobs and
    # prompt_counts[q] * prompt_ks[q] of the top arrays (best first per token).
    prompt_ids: list[str] = []
    prompt_starts: np.ndarray | None = None  # int32 [Q]
    prompt_counts: np.ndarray | None = None  # int32 [Q]
    prompt_ks: np.ndarray | None = None  # int32 [Q]
    prompt_logprobs: np.ndarray | None = None  # float32 [sum(counts)]
    prompt_ranks: np.ndarray | None = None  # int32 [sum(counts)]: 1 + tokens more likely
    prompt_top_token_ids: np.ndarray | None = None  # int32 [sum(counts * ks)]
    prompt_top_logprobs: np.ndarray | None = None  # float32 [sum(counts * ks)]
    # Embeddings (requests with SamplingParams.embed whose prompt's last token was computed
    # this step): row e of `embeddings` is request embed_ids[e]'s final hidden state there.
    embed_ids: list[str] = []
    embeddings: np.ndarray | None = None  # float32 [E, hidden size]
    # The plan's adapter loads that failed (every other op of the plan took effect)
    lora_failed: list[LoraFailure] = []
    # Why the plan's weight_op failed ("" when it took effect or there was none)
    weight_failed: str = ""
    # The plan's kv_export blocks, back to back (None: the plan had none, or the step failed)
    kv_export_data: np.ndarray | None = None  # uint8 [X * kv_block_bytes]

    def validate(self) -> None:
        e = len(self.embed_ids)
        if e or self.embeddings is not None:
            arr = self.embeddings
            if arr is None or arr.ndim != 2 or arr.shape[0] != e or arr.dtype != np.float32:
                raise WireError(f"result {self.step_id}: embeddings must be float32 [{e}, H]")
        q = len(self.prompt_ids)
        if q:
            for name in ("prompt_starts", "prompt_counts", "prompt_ks"):
                arr = getattr(self, name)
                if arr is None or arr.ndim != 1 or arr.shape[0] != q or (q and arr.min() < 0):
                    raise WireError(f"result {self.step_id}: {name} must be {q} counts")
            n = int(self.prompt_counts.sum())
            k = int((self.prompt_counts * self.prompt_ks).sum())
            for name, size in (("prompt_logprobs", n), ("prompt_top_token_ids", k),
                               ("prompt_top_logprobs", k), ("prompt_ranks", n)):
                arr = getattr(self, name)
                if name == "prompt_ranks" and arr is None:
                    continue  # optional: an executor may leave the ranks out
                if arr is None or arr.ndim != 1 or arr.shape[0] != size:
                    raise WireError(f"result {self.step_id}: {name} must have {size} entries")
        r = len(self.request_ids)
        for name in ("token_ids", "logprobs", "top_counts"):
            arr = getattr(self, name)
            wrong = arr is None or arr.ndim != 1 or arr.shape[0] != r
            if r and wrong and (name == "token_ids" or arr is not None):
                raise WireError(f"result {self.step_id}: {name} must have {r} entries")
        if self.top_counts is not None and r:
            if int(self.top_counts.min()) < 0:
                raise WireError(f"result {self.step_id}: a negative top count")
            n = int(self.top_counts.sum())
            for name in ("top_token_ids", "top_logprobs"):
                arr = getattr(self, name)
                if (n if arr is None else arr.ndim != 1 or arr.shape[0] != n):
                    raise WireError(f"result {self.step_id}: {name} must have {n} entries")
        data = self.kv_export_data
        if data is not None and (data.ndim != 1 or data.dtype != np.uint8):
            raise WireError(f"result {self.step_id}: kv_export_data must be bytes")


class ErrorReport(_Message, tag="error", frozen=True):
    """Either side: a message was rejected, or a whole step failed (``step_id`` set)."""

    message: str
    step_id: int | None = None
    executor_id: str = ""


Message = Hello | Welcome | Heartbeat | Shutdown | StepPlan | StepResult | ErrorReport


# --------------------------------------------------------------------------- helpers


def int32(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


def int64_pairs(pairs) -> np.ndarray:
    """[(a, b), ...] -> int64 [P, 2] (empty gives shape [0, 2])."""
    arr = np.asarray(pairs, dtype=np.int64)
    return arr.reshape(-1, 2)
