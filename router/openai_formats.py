"""OpenAI (and vLLM) body fields that shape the logits or the search: logit_bias, the
structured-output formats, beam search and the predicted output, read into the gRPC
SamplingParams fields (logit_bias, structured_output, beam_search, prediction) so both APIs
share validation.py's checks and router/structured.py's compilation.

Structured output may be asked for in any one of the ways clients send it:

* OpenAI `response_format`: {"type": "text"} (nothing), {"type": "json_object"},
  {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}};
* vLLM's `structured_outputs`: {"json": schema | str} / {"regex": str} / {"choice": [str]} /
  {"grammar": str} / {"json_object": true};
* vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

Two at once is a 400 (they would disagree on what the output is).

Tool calls (`tools`, `tool_choice`): the tools reach the chat template; tool_choice
"required" or a named function constrains the output with a JSON schema built from the tools'
parameter schemas (as vLLM does), and openai_responses.py turns the output into the reply's
`tool_calls`. "auto" leaves the output free and needs a parser for the model family's own
tool-call syntax (--tool-call-parser; tool_parsers.py): without one it is a 400.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb

from .openai_fields import UINT32_MAX, bad, json_type, number, optional_bool, token_ids
from .structured import build_grammar
from .tool_parsers import keeps_special_tokens

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


def token_restrictions(body: dict, params: pb.SamplingParams) -> None:
    """vLLM's `allowed_token_ids` (an array of token ids) and `bad_words` (an array of
    strings) into params; ids against the vocabulary and the words' count and blankness are
    checked by validation.py. null or [] asks for nothing."""
    allowed = body.get("allowed_token_ids")
    if allowed:
        ids = token_ids(allowed, "allowed_token_ids")
        if ids is None:
            raise bad("allowed_token_ids", "must be an array of token ids")
        params.allowed_token_ids.extend(ids)
    words = body.get("bad_words")
    if isinstance(words, str):
        words = [words]
    if words is not None and not (isinstance(words, list)
                                  and all(isinstance(w, str) for w in words)):
        raise bad("bad_words", f"must be an array of strings, got {json_type(words)}")
    params.bad_words.extend(words or ())


def prediction(body: dict, params: pb.SamplingParams) -> None:
    """OpenAI's Predicted Outputs, `prediction`: {"type": "content", "content": text or
    an array of text parts (joined)} into params (router/predicted_outputs.py drafts from
    it; validation.py tokenizes it). null: none."""
    value = body.get("prediction")
    if value is None:
        return
    if not isinstance(value, dict):
        raise bad("prediction", f"must be an object, got {json_type(value)}")
    if value.get("type") != "content":
        raise bad("prediction.type", f"must be \"content\", got {value.get('type')!r}")
    content = value.get("content")
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise bad(f"prediction.content[{i}]",
                          "must be a text part ({\"type\": \"text\", \"text\": string})")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise bad("prediction.content", f"must be a string or an array of text parts, "
                                        f"got {json_type(content)}")
    params.prediction.text = content


def beam_search(body: dict, params: pb.SamplingParams) -> None:
    """vLLM's `use_beam_search`, `length_penalty` and `early_stopping` (true, false or
    "never", transformers' values) into params.beam_search; `n` is the beam width. The
    two scoring fields at other than their defaults without beam search are refused, as
    vLLM refuses them (they would do nothing)."""
    use = optional_bool(body, "use_beam_search")
    length_penalty = number(body, "length_penalty")
    early = body.get("early_stopping")
    if early is not None and not isinstance(early, bool) and early != "never":
        raise bad("early_stopping", f"must be true, false or \"never\", got {early!r}")
    if not use:
        if length_penalty is not None and length_penalty != 1.0:
            raise bad("length_penalty", "only applies to beam search (use_beam_search)")
        if early:
            raise bad("early_stopping", "only applies to beam search (use_beam_search)")
        return
    params.beam_search.SetInParent()
    if length_penalty is not None:
        params.beam_search.length_penalty = length_penalty
    params.beam_search.early_stopping = (
        pb.EARLY_STOPPING_NEVER if early == "never" else
        pb.EARLY_STOPPING_WHEN_FULL if early else pb.EARLY_STOPPING_HEURISTIC)


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


@dataclass(frozen=True, slots=True)
class ToolMode:
    """How a chat reply carries its tool calls. `name` set (tool_choice names a function):
    the output is that function's arguments, one call. `name` None (tool_choice "required"):
    the output is a JSON array of {"name", "parameters"} objects, one call each (one only
    when `parallel` is false). `parser` set (tool_choice "auto"): the output is free, content
    and calls in the model's own syntax (tool_parsers.py)."""

    name: str | None
    parallel: bool = True
    parser: str = ""  # tool_choice "auto": the --tool-call-parser that splits the output
    # function name -> its parameters schema (a parser's value types: qwen3_coder)
    schemas: dict | None = field(default=None, compare=False)
    # the calls' id style (tool_parsers.tool_call_id): --tool-call-parser's
    ids: str = field(default="", compare=False)


def tool_calls(body: dict, params: pb.SamplingParams, chat: pb.ChatMessages,
               parser: str = "none") -> ToolMode | None:
    """`tools` and `tool_choice` of a chat body: the tools go to the chat template
    (chat.tools_json); a tool_choice that makes the model call one becomes the output's
    JSON schema (params.structured_output). "auto" (the default with tools) leaves the output
    free for `parser` (--tool-call-parser) to split; with none, a 400 saying what to send."""
    if body.get("functions") is not None:
        raise bad("functions", "the deprecated functions field is not supported; send tools")
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad("tool_choice", "needs tools")
        return None
    names = _check_tools(tools)
    chat.tools_json = json.dumps(tools, ensure_ascii=False)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", f"must be a boolean, got {json_type(parallel)}")
    if choice in (None, "auto"):
        if parser != "none":
            if keeps_special_tokens(parser) and body.get("skip_special_tokens") is None:
                params.keep_special_tokens = True  # (its markers are special tokens)
            return ToolMode(None, parallel, parser, names, ids=parser)
        raise bad("tool_choice", '"auto" (the default with tools) needs a parser for the '
                  'model\'s own tool-call format (--tool-call-parser hermes, for models whose '
                  'template uses <tool_call> tags): send tool_choice "required", a named '
                  'function or "none"')
    if choice == "none":
        return None
    if choice == "required":
        mode = ToolMode(None, parallel, ids=parser)
        calls = [{"type": "object", "additionalProperties": False,
                  "required": ["name", "parameters"],
                  "properties": {"name": {"const": name}, "parameters": schema}}
                 for name, schema in names.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not parallel:
            schema["maxItems"] = 1
    elif (isinstance(choice, dict) and choice.get("type") == "function"
          and isinstance(choice.get("function"), dict)):
        name = choice["function"].get("name")
        if name not in names:
            raise bad("tool_choice", f"names function {name!r}, which is not in tools")
        mode, schema = ToolMode(name, ids=parser), names[name]
    else:
        raise bad("tool_choice", 'must be "none", "auto", "required" or '
                                 '{"type": "function", "function": {"name": ...}}')
    if params.HasField("structured_output"):
        raise bad("tool_choice", "a tool call is already an output format: it cannot be "
                                 "combined with response_format or structured outputs")
    params.structured_output.json_schema = json.dumps(schema)
    build_grammar("json_schema", params.structured_output.json_schema, "tools")
    return mode


def _check_tools(tools: Any) -> dict[str, Any]:
    """The tools array's functions: name → parameters schema ({"type": "object"} when none)."""
    if not isinstance(tools, list):
        raise bad("tools", f"must be an array, got {json_type(tools)}")
    names: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad(f"{where}.type", 'must be "function"')
        function = tool.get("function")
        if not isinstance(function, dict):
            raise bad(f"{where}.function", "is required (an object with a name)")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise bad(f"{where}.function.name", "is required (a non-empty string)")
        if name in names:
            raise bad(f"{where}.function.name", f"{name!r} is defined twice")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object"}
        elif not isinstance(parameters, dict):
            raise bad(f"{where}.function.parameters", "must be a JSON schema (an object)")
        names[name] = parameters
    return names
