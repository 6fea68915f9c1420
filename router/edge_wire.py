"""Messages between the router core and its API workers (`--api-workers N`), on one ZeroMQ
ROUTER (core) / DEALER (worker) pair over an ipc:// socket of the machine.

    worker -> core   EdgeHello (on connect), Submit / AbortCall / StatusCall / LoraCall /
                     WeightCall / ResponseCall (answered by a Reply with the same `call`), Forget (a request the worker gave up: no
                     answer), StopSample (a stop string in a sample's text: no answer),
                     MetricsBatch (the worker's request metrics, replayed in the core)
    core -> worker   Reply, Outputs (every output of a step for this worker's requests, in one
                     message: token ids, logprobs and the token stops; no text), EdgeStatus
                     (serving, draining, the dtype executors run, the LoRA adapters; sent on
                     hello and when it changes), EdgeStop (drain done: close and exit)

MessagePack through msgspec, typed on both sides; the router's request and output types
(frozen dataclasses, router/types.py) travel as they are. Never pickle. A frame that does not
decode is logged and dropped by the receiver.
"""

from __future__ import annotations

import msgspec

from .types import ClusterStatusData, RequestSpec, TokenLogprob, Usage

EDGE_PROTOCOL_VERSION = 12  # 4: SamplingSpec.logit_bias, grammar; 5: Outputs' token columns;
# 6: SamplingSpec.allowed_token_ids, bad_words_token_ids; 7: RequestSpec.lora_adapter;
# 8: SamplingSpec.embed, OutputItem.embedding; 9: LoraCall, EdgeStatus.lora_adapters;
# 10: WeightCall, Reply.count; 11: ResponseCall, Reply.data and frames; 12:
# SamplingSpec.prediction, Usage's prediction counts


class EdgeHello(msgspec.Struct, tag=True):
    worker: int
    pid: int
    grpc_port: int
    http_port: int  # -1: HTTP off
    version: int = EDGE_PROTOCOL_VERSION


class Submit(msgspec.Struct, tag=True):
    call: int
    spec: RequestSpec


class AbortCall(msgspec.Struct, tag=True):
    call: int
    request_id: str


class StatusCall(msgspec.Struct, tag=True):
    call: int


class LoraCall(msgspec.Struct, tag=True):
    """Load LoRA adapter `name` from `path` or, with no `path`, from --lora-dir if it is
    one of its adapters (a request naming it: RemoteEngine.submit); or unload it (`load`
    false: the HTTP routes of router/http_lora_routes.py). Answered once the core's
    registry has (EdgeStatus with the new names first)."""

    call: int
    name: str
    load: bool
    path: str = ""


class WeightCall(msgspec.Struct, tag=True):
    """One of the weight routes (router/http_weight_routes.py) for the core's WeightSync:
    `action` "update" (`path`, `abort_all`, `version`), "pause" (`mode`), "resume",
    "version", "is_paused", "flush" (`idle_only`). Answered when the core's call returns:
    Reply.count (an update's requests that waited, a flush's blocks kept, 1 when paused),
    Reply.message (the version)."""

    call: int
    action: str
    path: str = ""
    mode: str = ""
    abort_all: bool = False
    version: str | None = None
    idle_only: bool = False


class ResponseCall(msgspec.Struct, tag=True):
    """The core's stored Responses and conversations (router/response_store.py), `action`:
    "put" (`record`, `background`, `request_ids`, `update`; Reply.found: kept), "get"
    (`kind`; Reply.data: the record, found), "delete" (`kind`; found), "cancel"
    (Reply.data), "add_events" (`frames`), "events" (`after`, waiting up to `wait_s`;
    Reply.frames, Reply.found: the stream is over), "put_conversation" (`record`; found),
    "edit_conversation" (`items`, `item_id`, `metadata`: JSON; Reply.data)."""

    call: int
    action: str
    response_id: str
    record: bytes = b""
    background: bool = False
    request_ids: tuple[str, ...] = ()
    update: bool = False
    frames: list[bytes] = []
    after: int = -1
    wait_s: float = 0.0
    kind: str = "response"
    items: bytes = b""  # JSON: the items to append
    item_id: str = ""
    metadata: bytes = b""  # JSON: the new metadata


class Forget(msgspec.Struct, tag=True):
    """The worker's client went away (or the worker stopped reading): abort, no answer."""

    request_id: str


class StopSample(msgspec.Struct, tag=True):
    """The worker's text for sample `index` hit a stop string: end that sample (no answer)."""

    request_id: str
    index: int


class MetricsBatch(msgspec.Struct, tag=True):
    """RouterMetrics calls made by the worker's edges since the last batch:
    (method name, positional args, api label or "")."""

    calls: list[tuple[str, list[int | float | str], str]]


class Reply(msgspec.Struct, tag=True):
    call: int
    error: str = ""  # the PagedServeError class name; "" = ok
    message: str = ""
    field: str = ""  # the error's field (InvalidRequest, NotFound), if it names one
    found: bool = False  # AbortCall
    status: ClusterStatusData | None = None  # StatusCall
    count: int = 0  # WeightCall
    data: bytes = b""  # ResponseCall: a stored record
    frames: list[bytes] = []  # ResponseCall: a background stream's events


class TokenDelta(msgspec.Struct, array_like=True):
    """A sample's new tokens as the engine sends them to an API worker: no text (the worker
    assembles it), and the finish decided in the engine (token stops, abort) if any."""

    index: int
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    stop_token_id: int | None = None


class OutputItem(msgspec.Struct, array_like=True):
    """One request's outputs since the last Outputs: deltas, then `usage` when it finished,
    or `error` (a PagedServeError class name) when the engine failed it."""

    request_id: str
    deltas: list[TokenDelta]
    usage: Usage | None = None
    error: str = ""
    message: str = ""
    prompt_logprobs: list[TokenLogprob] = []  # with usage, when the request asked for them
    embedding: bytes = b""  # with usage, an embedding request's: float32 little-endian


class Outputs(msgspec.Struct, tag=True):
    """A loop turn's outputs for one worker. `token_*` are the steady decode's tokens as
    three columns (one token of one sample a row, no finish, no logprobs: most of a step,
    without an object a token); the worker applies them before `items`. A sample's tokens
    stay in order: one that comes after an item of its request in the turn goes into that
    item."""

    items: list[OutputItem]
    token_request_ids: list[str] = []
    token_indexes: list[int] = []
    token_ids: list[int] = []


class EdgeStatus(msgspec.Struct, tag=True):
    serving: bool
    draining: bool
    dtype: str
    lora_adapters: tuple[str, ...] = ()  # what requests may name now (lora_registry.py)


class EdgeStop(msgspec.Struct, tag=True):
    pass


ToCore = (EdgeHello | Submit | AbortCall | StatusCall | LoraCall | WeightCall | ResponseCall
          | Forget | StopSample | MetricsBatch)
ToWorker = Reply | Outputs | EdgeStatus | EdgeStop


class EdgeCodec:
    """Encoder/decoder for one direction's messages (`to_core` picks which)."""

    def __init__(self, *, to_core: bool) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ToCore if to_core else ToWorker)

    def encode(self, msg) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, data: bytes | memoryview):
        """Raises msgspec.DecodeError / ValidationError for a frame that is not a message."""
        return self._decoder.decode(data)
