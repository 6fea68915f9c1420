"""The router's internal request and output types, and the `Engine` interface the gRPC edge calls.

No protobuf type crosses into the engine: grpc_server.py converts a GenerateRequest into a
validated `RequestSpec` (validation.py) and converts `RequestOutput`s back into responses.
Everything here that crosses the edge/engine boundary is a frozen dataclass.

Flow of one request::

    servicer: spec = validate(pb)                      # InvalidRequest → INVALID_ARGUMENT
    servicer: outputs = await engine.submit(spec)      # AlreadyExists / QueueFull / Unavailable
    engine:   per step, per sample: TextAssembler.append(token) → CompletionDelta
    servicer: async for out in outputs: → GenerateStreamResponse chunks (or one GenerateResponse)
    Abort RPC / client cancel / deadline → engine.abort(request_id)
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import numpy as np

FinishReason = Literal["length", "stop", "abort"]
"""Why a sample ended: max_tokens/max_model_len, EOS/stop id/stop string, abort/drain."""

DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class BeamSpec:
    """Beam search's scoring and stopping (router/beam_search.py), as transformers'
    generate defines them: `early_stopping` False (the heuristic), True or "never"."""

    length_penalty: float = 1.0
    early_stopping: bool | str = False


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """Validated sampling parameters, every default applied (DESIGN §3 SamplingParams).

    `seed` is always set (the edge draws a random 63-bit seed when the client sent none).
    `top_k` ≤ 0 means off (the edge normalises 0 to -1); `logprobs` None means none asked.
    `logit_bias` entries are checked (ids < vocab, biases in [-100, 100]); `grammar` compiles.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    include_stop_str_in_output: bool = False
    keep_special_tokens: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending
    grammar: str = ""  # structured output: an llguidance grammar (structured.py); "" = free text
    prompt_logprobs: int | None = None  # score the prompt: top-k per prompt token
    allowed_token_ids: tuple[int, ...] = ()  # only these may be sampled (ascending); () = any
    # bad words as token sequences (validation.bad_words_token_ids): the last token of one
    # is masked while the output ends with the rest of it
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # beam search with n beams (router/beam_search.py); None: sampling
    beam: BeamSpec | None = None
    # an embedding request (/v1/embeddings): one greedy token, dropped; the prompt's last
    # token's final hidden state comes back (RequestOutput.embedding)
    embed: bool = False
    # Predicted Outputs: the token ids the output is expected to repeat for the most part;
    # the router drafts from them (router/predicted_outputs.py); () = none
    prediction: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One validated request, as the engine takes it.

    `prompt_token_ids` are final (text already tokenized, BOS added as HF adds it) and every id
    is < vocab size; len(prompt_token_ids) + sampling.max_tokens ≤ max_model_len.
    `arrival_time` and `deadline` are `time.monotonic()` seconds; `deadline` is None when the
    client set none (the edge aborts the request when it passes; the engine may also use it).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    prompt_text: str | None = None
    priority: int = 0
    cache_salt: str = ""  # the prefix cache's: the client's, the adapter's, or a private one
    lora_adapter: str = ""  # "" = the base model
    arrival_time: float = 0.0
    deadline: float | None = None


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The sampled token's logprob and the top-k alternatives [(token_id, logprob), ...],
    most likely first; `rank` (1 + tokens more likely) where it was computed (a prompt
    token's score), else None."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


# The two per-token types below are plain (not frozen) slotted dataclasses, read-only by
# convention once made: a frozen dataclass's __init__ sets each field through
# object.__setattr__ (0.70 µs for a CompletionDelta against 0.15), and the router makes one of
# each per stream per step (256 streams: ~0.25 ms of every step in the router process).
@dataclass(slots=True)
class CompletionDelta:
    """What one sample produced since its previous delta.

    `text` is new, final text (never retracted later: the TextAssembler holds back partial
    UTF-8 and possible stop-string prefixes); `token_ids` are the new token ids, including the
    one that stopped the sample. The finish fields are set on the sample's last delta only
    (`finish_reason` None before). A sample's deltas concatenate to its whole completion.
    """

    index: int
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    stop_string: str | None = None
    stop_token_id: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts for a whole request (completion_tokens summed over its samples)."""

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0
    # with a prediction: its tokens drafted and confirmed / drafted and rejected
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


@dataclass(slots=True)
class RequestOutput:
    """One item of a request's output stream: deltas of any of its samples (at most one per
    sample index per item), in sample order.

    The last item of every request has `usage` set and comes after (or with) the last delta of
    every sample; `finished` is True exactly then, and the iterator ends after it.
    """

    request_id: str
    deltas: tuple[CompletionDelta, ...] = ()
    usage: Usage | None = None
    # With prompt_logprobs: on the last item (with usage), one entry per prompt token from
    # the second on.
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    # An embedding request's (SamplingSpec.embed), on the last item: the prompt's last
    # token's final hidden state, float32, as the executor computed it (not normalized)
    embedding: np.ndarray | None = None

    @property
    def finished(self) -> bool:
        return self.usage is not None


@dataclass(frozen=True, slots=True)
class ModelInfoData:
    """The served model (ModelInfo in the API)."""

    model: str
    architecture: str
    max_model_len: int
    vocab_size: int
    block_size: int
    dtype: str
    eos_token_ids: tuple[int, ...]
    lora_adapters: tuple[str, ...] = ()  # served beside the model (--lora-modules)


@dataclass(frozen=True, slots=True)
class ExecutorStatusData:
    """One executor as the router sees it (ExecutorStatus in the API)."""

    id: str
    device: str
    healthy: bool
    num_gpu_blocks: int
    num_free_gpu_blocks: int
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    running: int
    waiting: int
    swapped: int


@dataclass(frozen=True, slots=True)
class ClusterStatusData:
    """Every executor known to the router and prefix-cache totals (tokens)."""

    executors: tuple[ExecutorStatusData, ...] = ()
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


@runtime_checkable
class Engine(Protocol):
    """What the gRPC edge needs from the router core. Implemented by the engine (router core);
    tests use a fake. All methods are called on the server's event loop.

    Contract:

    * `submit(spec)` admits the request and returns its output stream. It raises, before
      returning, `AlreadyExists` when `spec.request_id` is live, `QueueFull` when the waiting
      queue is full, `Unavailable` when no executor is up or the router is draining, and
      `InvalidRequest` for a request that could never fit one executor's KV cache. Once it
      returns, the id is live (abort() finds it) until the stream's final item is produced.
    * The stream yields `RequestOutput`s; the last one has `usage` set and every sample has
      had its finishing delta by then. It may raise `Unavailable` later (the executor running
      the request died and no live executor could take it over); the request is then no
      longer live.
    * `abort(request_id)` returns False for an id that is not live. For a live one it returns
      True and makes the stream end soon (within a step) with a final item whose unfinished
      samples have `finish_reason="abort"`; the request's blocks are freed. The edge calls it
      for the Abort RPC, for client cancellation and for a passed deadline (then it stops
      reading the stream), so the engine must not block on a consumer that went away.
    * Text assembly: the engine produces `CompletionDelta.text` with one
      `pagedserve.router.detokenizer.TextAssembler` per sample (stop strings end generation,
      so they are checked where tokens are appended, after every step). In an API worker the
      RemoteEngine does it, from the router engine's token deltas.
    * Optional: `reserve_slot()` / `release_slot()`. When the engine has them the edge
      reserves a waiting-queue place before tokenizing (QueueFull / Unavailable raised
      there) and calls `submit(spec, reserved=True)`, which consumes the place whatever it
      raises; `release_slot()` gives it back when the request fails before submit.
    * `is_serving()` is True while at least one executor is registered and heartbeating and the
      router is not draining (it drives the health status of "pagedserve.v1.Generator").
    * In an API worker (`--api-workers`, remote_engine.py) the engine is in another process:
      `cluster_status()` is a coroutine there (the edge awaits what it returns when it is
      awaitable), `abort()` knows only this worker's requests, and the Abort RPC uses the
      optional `abort_anywhere(request_id)` coroutine when the engine has one.
    * An edge leaving a request early (client gone, deadline) calls the optional
      `abort_stream(request_id, stream)` when the engine has one: `stream` is what `submit`
      returned, and a request that already ended and whose id a new request took since is
      not aborted.
    * Optional (``--max-loras``, router/lora_registry.py): the `lora_adapters` the requests
      may name now, and the coroutines `load_lora_adapter(name, path)` (returns once every
      executor serves it) and `unload_lora_adapter(name)`; they raise the domain errors
      (InvalidRequest, NotFound, Unavailable) the HTTP routes answer with.
    """

    async def submit(self, spec: RequestSpec) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> bool: ...

    def model_info(self) -> ModelInfoData: ...

    def cluster_status(self) -> ClusterStatusData: ...

    def is_serving(self) -> bool: ...
