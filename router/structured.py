"""Structured output formats → one llguidance grammar, checked at the edge.

Every format a client can ask for (gRPC `StructuredOutput`, OpenAI `response_format`, vLLM's
`structured_outputs` / `guided_*` fields) becomes one grammar string in llguidance's format
here, at validation time; the executor builds a matcher from that string and masks, before
each sample, every token that cannot continue it (executor/grammar.py). The executor owns the
tokens it samples, so a grammar works the same with pipelined steps, forks, preemption and
migration (the executor replays the output so far). The router runs a matcher of its own
only with speculative decoding on, to draft the tokens a format forces
(router/grammar_drafts.py).

The formats:

* json_schema: a JSON Schema (text) → llguidance's JSON compiler. Output JSON is written
  with Python's separators (", " and ": ") and no other whitespace, so a model cannot spend
  its tokens on indentation; a schema's own ``x-guidance`` options override that;
* json_object: the schema ``{"type": "object"}``;
* regex: the whole output matches it (llguidance's Rust-regex syntax);
* choice: exactly one of the strings (a Lark rule of string literals);
* grammar: a Lark grammar as llguidance reads it.

A grammar that does not compile raises InvalidRequest naming the field, with llguidance's
own message. The grammar travels to executors inside the plan, so its size is capped.
"""

from __future__ import annotations

import json
from functools import lru_cache

from .errors import InvalidRequest

MAX_FORMAT_CHARS = 128 * 1024  # a schema, regex or grammar as the client sent it
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FORMATS = ("json_schema", "json_object", "regex", "choice", "grammar")


def _bad(field: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{field}: {message}", field=field)


def _llguidance():
    try:
        import llguidance
    except ImportError as exc:  # a dependency; missing only in a hand-made environment
        raise InvalidRequest("structured output needs the llguidance package, which is not "
                             "installed on this server", field="structured_output") from exc
    return llguidance


def build_grammar(kind: str, value, field: str = "structured_output") -> str:
    """One format (kind in FORMATS; value a str, a dict/str schema, a bool or a list of
    str) → a checked llguidance grammar string. `field` names the client's field in errors."""
    llg = _llguidance().LLMatcher
    if kind == "json_object":
        if value is not True:
            raise _bad(field, "json_object must be true when set")
        return _checked(_json_grammar('{"type": "object"}', field), field)
    if kind == "choice":
        choices = list(value)
        if not choices:
            raise _bad(field, "choice needs at least one string")
        for i, c in enumerate(choices):
            if not isinstance(c, str) or not c:
                raise _bad(field, f"choice {i} must be a non-empty string")
        _check_size(field, sum(len(c) for c in choices))
        # JSON string literals are valid Lark literals (same escapes).
        return _checked(llg.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)), field)
    if not isinstance(value, str):
        raise _bad(field, f"{kind} must be a string")
    if not value:
        raise _bad(field, f"{kind} is empty")
    _check_size(field, len(value))
    if kind == "json_schema":
        return _checked(_json_grammar(value, field), field)
    if kind == "regex":
        return _checked(llg.grammar_from_regex(value), field)
    if kind == "grammar":
        return _checked(llg.grammar_from_lark(value), field)
    raise _bad(field, f"unknown format {kind!r} (one of {', '.join(FORMATS)})")


def _check_size(field: str, num_chars: int) -> None:
    if num_chars > MAX_FORMAT_CHARS:
        raise _bad(field, f"at most {MAX_FORMAT_CHARS} characters, got {num_chars}")


def _json_grammar(schema_text: str, field: str) -> str:
    try:
        return _schema_grammar(schema_text)
    except ValueError as exc:
        raise _bad(field, str(exc)) from exc


@lru_cache(maxsize=64)
def _schema_grammar(schema_text: str) -> str:
    try:
        schema = json.loads(schema_text)
    except ValueError as exc:
        raise ValueError(f"the JSON schema is not JSON: {exc}") from exc
    if not isinstance(schema, (dict, bool)):
        raise ValueError("a JSON schema is an object (or a boolean)")
    return _llguidance().LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)


@lru_cache(maxsize=64)
def _validation_error(grammar: str) -> str:
    is_error, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0] if is_error else ""


def _checked(grammar: str, field: str) -> str:
    """The grammar when llguidance compiles it (validation is cached per grammar: clients
    repeat the same schema), else InvalidRequest with llguidance's message."""
    error = _validation_error(grammar)
    if error:
        raise _bad(field, f"does not compile: {error.strip()}")
    return grammar


def grammar_from_pb(structured) -> str:
    """A StructuredOutput protobuf → grammar string ("" when no format is set)."""
    kind = structured.WhichOneof("format")
    if kind is None:
        return ""
    value = getattr(structured, kind)
    if kind == "choice":
        value = list(value.choices)
    return build_grammar(kind, value, field=f"structured_output.{kind}")
