"""Type checks for OpenAI JSON bodies: each reads one field and raises InvalidRequest naming
it when it has the wrong type (null counts as omitted: clients send either)."""

from __future__ import annotations

import math
from typing import Any

from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb

from .errors import InvalidRequest

UINT32_MAX = 2**32 - 1
INT32_RANGE = (-(2**31), 2**31 - 1)
SEED_RANGE = (-(2**63), 2**64 - 1)  # a negative seed is taken modulo 2**64


def served_names(value: str) -> tuple[str, ...]:
    """`--served-model-name`: one model id, or several separated by commas (the first is the
    model's name; the others are aliases a request's `model` may use too, e.g. the id a
    client has written in). A name keeps its inner spaces (a folder's name may have them)."""
    return tuple(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))


def bad(param: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: {message}", field=param)


def present(body: dict, key: str) -> bool:
    return body.get(key) is not None  # null means omitted (clients send either)


def optional_int(body: dict, key: str, lo: int = 0, hi: int = UINT32_MAX) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise bad(key, f"must be an integer, got {json_type(value)}")
    if not lo <= value <= hi:
        raise bad(key, f"must be in [{lo}, {hi}], got {value}")
    return value


def number(body: dict, key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(key, f"must be a number, got {json_type(value)}")
    if not math.isfinite(value):
        raise bad(key, "must be a finite number")
    return float(value)


def optional_bool(body: dict, key: str) -> bool | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise bad(key, f"must be a boolean, got {json_type(value)}")
    return value


def optional_str(body: dict, key: str) -> str | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad(key, f"must be a string, got {json_type(value)}")
    return value


def json_type(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array", dict: "an object"}.get(type(value), "null")


def token_ids(value: Any, param: str) -> list[int] | None:
    """`value` as a list of token ids, or None when it is not a list of integers."""
    if not isinstance(value, list) or not value:
        return None
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        for t in value:
            if not 0 <= t <= UINT32_MAX:
                raise bad(param, f"token id {t} is out of range")
        return value
    return None


def prompt_requests(value, field: str, params: pb.SamplingParams,
                    common: dict) -> list[pb.GenerateRequest]:
    """A completions `prompt` (an embeddings `input`, ``field``): a string, an array of
    strings, an array of token ids or an array of such arrays → one GenerateRequest each
    (an empty one is refused where it is tokenized, validation.prompt_from_pb)."""
    if isinstance(value, str):
        return [pb.GenerateRequest(prompt=value, params=params, **common)]
    if token_ids(value, field) is not None:
        return [pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=value), params=params,
                                   **common)]
    if value is None:
        raise bad(field, "is required")
    if not isinstance(value, list) or not value:
        raise bad(field, "must be a string, an array of strings, an array of token ids "
                  "or an array of arrays of token ids (and not empty)")
    requests = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            requests.append(pb.GenerateRequest(prompt=item, params=params, **common))
        elif (ids := token_ids(item, f"{field}[{i}]")) is not None:
            requests.append(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids),
                                               params=params, **common))
        else:
            raise bad(field, f"{field}[{i}] must be a string or an array of token ids")
    return requests


MAX_METADATA, MAX_KEY_CHARS, MAX_VALUE_CHARS = 16, 64, 512  # OpenAI's metadata limits


def metadata_of(value: Any) -> dict:
    """A body's `metadata` (InvalidRequest unless at most 16 short string pairs; {} for
    none): OpenAI's rule for batches and conversations."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_METADATA or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= MAX_KEY_CHARS
            and len(v) <= MAX_VALUE_CHARS for k, v in value.items()):
        raise bad("metadata", f"at most {MAX_METADATA} string pairs (keys up to "
                  f"{MAX_KEY_CHARS} characters, values up to {MAX_VALUE_CHARS})")
    return value
