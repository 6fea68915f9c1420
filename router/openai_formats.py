"""OpenAI (and vLLM) body fields that shape the logits: logit_bias and the structured-output
formats, read into the gRPC SamplingParams fields (logit_bias, structured_output) so both APIs
share validation.py's checks and router/structured.py's compilation.

Structured output may be asked for in any one of the ways clients send it:

* OpenAI `response_format`: {"type": "text"} (nothing), {"type": "json_object"},
  {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}};
* vLLM's `structured_outputs`: {"json": schema | str} / {"regex": str} / {"choice": [str]} /
  {"grammar": str} / {"json_object": true};
* vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

Two at once is a 400 (they would disagree on what the output is). Tool calling is not
implemented: a request that offers tools and lets the model call them (`tool_choice` other
than "none") is a 400 rather than a reply that silently ignores them.
"""

from __future__ import annotations

import json
from typing import Any

from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb

from .openai_fields import UINT32_MAX, bad, json_type
from .structured import build_grammar

_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                       "grammar": "grammar", "json_object": "json_object"}


def logit_bias(body: dict, params: pb.SamplingParams) -> None:
    """`logit_bias` ({"token id": bias}) into params; ranges are checked by validation.py."""
    bias = body.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise bad("logit_bias", f"must be an object mapping token ids to numbers, "
                                f"got {json_type(bias)}")
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and int(key) <= UINT32_MAX):
            raise bad("logit_bias", f"key {key!r} is not a token id")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("logit_bias", f"bias of token {key} must be a number, "
                                    f"got {json_type(value)}")
        params.logit_bias[int(key)] = float(value)


def structured_output(body: dict, params: pb.SamplingParams) -> None:
    """The one structured-output format the body asks for (if any) into params."""
    found: list[tuple[str, str, Any]] = []  # (client field, format, value)
    response_format = body.get("response_format")
    if response_format is not None:
        found += _response_format(response_format)
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad("structured_outputs", f"must be an object, got {json_type(so)}")
        for key, value in so.items():
            if key in _STRUCTURED_OUTPUTS and value is not None:
                found.append((f"structured_outputs.{key}", _STRUCTURED_OUTPUTS[key], value))
    for key, kind in _GUIDED.items():
        if body.get(key) is not None:
            found.append((key, kind, body[key]))
    if not found:
        return
    if len(found) > 1:
        raise bad(found[1][0], f"only one output format at a time (also {found[0][0]})")
    field, kind, value = found[0]
    target = params.structured_output
    if kind == "json_object":
        if value is not True:
            raise bad(field, "must be true when set")
        target.json_object = True
    elif kind == "json_schema":
        if isinstance(value, (dict, bool)):
            value = json.dumps(value)
        elif not isinstance(value, str):
            raise bad(field, f"must be a JSON schema (an object), got {json_type(value)}")
        target.json_schema = value
    elif kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise bad(field, "must be an array of strings")
        target.choice.choices.extend(value)
    else:  # regex, grammar
        if not isinstance(value, str):
            raise bad(field, f"must be a string, got {json_type(value)}")
        setattr(target, kind, value)
    # Compiled here too, so an error names the client's field (validation.py compiles it
    # again from the cache).
    build_grammar(kind, value, field)


def _response_format(rf: Any) -> list[tuple[str, str, Any]]:
    if not isinstance(rf, dict):
        raise bad("response_format", f"must be an object, got {json_type(rf)}")
    kind = rf.get("type")
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", "json_object", True)]
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise bad("response_format.json_schema", "is required (an object with a schema)")
        schema = spec.get("schema")
        if schema is None:
            raise bad("response_format.json_schema.schema", "is required")
        return [("response_format.json_schema.schema", "json_schema", schema)]
    raise bad("response_format.type", f"must be 'text', 'json_object' or 'json_schema', "
                                      f"got {kind!r}")


def check_tools(body: dict) -> None:
    """Refuse a request that lets the model call tools (not implemented here)."""
    for key, choice_key in (("tools", "tool_choice"), ("functions", "function_call")):
        offered = body.get(key)
        if offered is None or offered == []:
            continue
        if not isinstance(offered, list):
            raise bad(key, f"must be an array, got {json_type(offered)}")
        if body.get(choice_key) != "none":
            raise bad(key, f"tool calling is not supported by this server (send no {key}, or "
                           f"{choice_key}: \"none\")")
