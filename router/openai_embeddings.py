"""POST /v1/embeddings (OpenAI's embeddings API, as vLLM serves it for a decoder model):
each input's embedding is the final hidden state of its last token (last-token pooling, as
decoder embedding models such as Qwen3-Embedding and E5-Mistral are trained for),
L2-normalized.

An input runs as a request of its own through the same engine as generation: admitted,
routed to the executor whose prefix cache holds most of it, computed in prefill chunks,
with one greedy token sampled and dropped (``SamplingSpec.embed``); the executor returns
the hidden state of the prompt's last token with the step that computes it
(executor/prompt_scores.py). So embeddings share the prefix cache with generation (a
document embedded, then asked about, is computed once) and every scheduling rule applies.
An input holds at most max_model_len - 1 tokens (the dropped token's place).

Fields: ``input`` (a string, an array of strings, an array of token ids or an array of such
arrays; none empty), ``model``, ``encoding_format`` ("float", the default, or "base64":
little-endian float32 bytes), ``dimensions`` (the first N components, normalized again:
Matryoshka-trained models are read this way; any N up to the hidden size), ``user``; and
vLLM's ``add_special_tokens``, ``truncate_prompt_tokens``, ``priority``, ``cache_salt``
and ``normalize`` (false: the raw hidden state).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, replace

import numpy as np
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb

from .errors import InvalidRequest
from .openai_fields import bad, optional_bool, optional_int, optional_str, prompt_requests
from .openai_protocol import common_fields
from .types import RequestOutput, RequestSpec, Usage

ENCODING_FORMATS = ("float", "base64")


@dataclass
class EmbeddingCall:
    """A validated /v1/embeddings body: one GenerateRequest an input."""

    requests: list[pb.GenerateRequest]
    encoding_format: str
    dimensions: int | None
    normalize: bool


def embedding_call(body: dict) -> EmbeddingCall:
    """The body → EmbeddingCall (raises InvalidRequest naming the field)."""
    encoding = optional_str(body, "encoding_format") or "float"
    if encoding not in ENCODING_FORMATS:
        raise bad("encoding_format", f"must be one of {', '.join(ENCODING_FORMATS)}, "
                  f"got {encoding!r}")
    dimensions = optional_int(body, "dimensions")
    if dimensions is not None and dimensions < 1:
        raise bad("dimensions", f"must be at least 1, got {dimensions}")
    normalize = optional_bool(body, "normalize")
    common = common_fields(body)
    # one greedy token, dropped: the prompt's last token is computed in the step that
    # samples it, and its hidden state comes back with that step's result
    params = pb.SamplingParams(max_tokens=1, temperature=0.0)
    requests = prompt_requests(body.get("input"), "input", params, common)
    return EmbeddingCall(requests, encoding, dimensions, True if normalize is None else normalize)


def as_embedding(spec: RequestSpec) -> RequestSpec:
    """The request an input's GenerateRequest became, made an embedding request."""
    return replace(spec, sampling=replace(spec.sampling, embed=True))


def input_field(exc: InvalidRequest, index: int, of: int) -> InvalidRequest:
    """A prompt error (its length, a token id) renamed to the input the client sent."""
    field = exc.field or ""
    if field not in ("prompt", "prompt_token_ids"):
        return exc
    new = "input" if of == 1 else f"input[{index}]"
    message = str(exc)
    if message.startswith(field):
        message = new + message[len(field):]
    return InvalidRequest(message, field=new)


def embedding_vector(out: RequestOutput, call: EmbeddingCall) -> np.ndarray:
    """The embedding an input's last output carries, cut to ``dimensions`` and normalized
    as asked (raises InvalidRequest when ``dimensions`` exceeds the model's size)."""
    vector = np.asarray(out.embedding, dtype=np.float32)
    if call.dimensions is not None:
        if call.dimensions > vector.shape[0]:
            raise bad("dimensions", f"must be at most the model's {vector.shape[0]}, "
                      f"got {call.dimensions}")
        vector = vector[:call.dimensions]
    if call.normalize:
        norm = float(np.linalg.norm(vector.astype(np.float64)))
        if norm > 0:
            vector = (vector / norm).astype(np.float32)
    return vector


def embedding_response(vectors: list[np.ndarray], usages: list[Usage], model: str,
                       encoding: str) -> dict:
    """OpenAI's response object: one ``embedding`` item an input, in input order."""
    data = []
    for i, vector in enumerate(vectors):
        if encoding == "base64":
            value = base64.b64encode(vector.astype("<f4").tobytes()).decode()
        else:
            value = vector.tolist()
        data.append({"object": "embedding", "index": i, "embedding": value})
    prompt_tokens = sum(u.prompt_tokens for u in usages)
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
