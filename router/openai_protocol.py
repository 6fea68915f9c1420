"""OpenAI API bodies ↔ the router's own request and output types (the HTTP edge's from/to).

A JSON body is type-checked here and turned into `GenerateRequest`s, the same message the gRPC
edge receives, so both APIs share one validation path (validation.py: ranges, vocab, lengths,
the chat template) and one set of error rules. What is OpenAI-specific stays here:

* field names and shapes: `max_completion_tokens` over `max_tokens`, `stop` as a string or a
  list, chat `logprobs` (bool) + `top_logprobs`, completions `logprobs` (int), vLLM's extra
  sampling fields (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids,
  skip_special_tokens, include_stop_str_in_output, priority, cache_salt); `logit_bias`,
  `allowed_token_ids`, `bad_words`, the structured-output formats, beam search
  (`use_beam_search`, `length_penalty`, `early_stopping`) and the predicted output
  (`prediction`) (openai_formats.py);
* a completions `prompt` may be a list of prompts: each is its own engine request, and choice
  `index` = prompt index × n + sample index (as OpenAI and vLLM number them);
* `max_tokens` omitted → the rest of the context (validation computes it once the prompt is
  tokenized), as vLLM does;
* unknown fields are ignored; a known field of the wrong type is an InvalidRequest naming it.

Responses are built from RequestOutputs as OpenAI's API reference defines them (`id`,
`object`, `created`, `model`, choices with `finish_reason`, usage with
`prompt_tokens_details.cached_tokens` and `completion_tokens_details`' accepted and rejected
prediction tokens); vLLM's `stop_reason` (the stop string or token id that
ended a choice) is added to each choice.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import astuple, dataclass
from typing import Any

from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb

from .fill_in_middle import MARKERS_NAMED, FillInMiddle
from .openai_fields import (
    INT32_RANGE,
    SEED_RANGE,
    bad,
    json_type,
    number,
    optional_bool,
    optional_int,
    optional_str,
    present,
    prompt_requests,
    token_ids,
)
from .openai_formats import (
    ToolMode,
    beam_search,
    logit_bias,
    prediction,
    structured_output,
    token_restrictions,
    tool_calls,
)
from .reasoning_parsers import keeps_special_tokens
from .types import CompletionDelta, Usage

# --------------------------------------------------------------------------- requests


@dataclass
class ApiRequest:
    """A checked OpenAI body: the engine requests to run and how to answer."""

    chat: bool
    model: str | None
    requests: list[pb.GenerateRequest]  # one per prompt (chat: exactly one)
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None  # top-k asked for (chat: top_logprobs when logprobs is true)
    tools: ToolMode | None = None  # chat: the reply carries tool calls (tool_choice)
    echo: bool = False  # completions: the prompt leads each choice's text (and logprobs)
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (its token dropped)
    prompt_logprobs: int | None = None  # vLLM's: the prompt's scores in the reply, top-k
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs' "token_id:N"
    reasoning: str = ""  # chat: the --reasoning-parser that splits the output ("": none)
    include_reasoning: bool = True  # vLLM's include_reasoning: false drops the reasoning
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids


def _sampling(body: dict, *, chat: bool) -> tuple[pb.SamplingParams, int | None]:
    """The body's sampling fields → (SamplingParams, logprobs k).
    Ranges are validation.py's; only types and representability are checked here."""
    params = pb.SamplingParams()
    max_tokens = optional_int(body, "max_tokens")
    if chat and present(body, "max_completion_tokens"):
        max_tokens = optional_int(body, "max_completion_tokens")
    if max_tokens is not None:
        params.max_tokens = max_tokens
    for key in ("temperature", "top_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty", "min_p"):
        value = number(body, key)
        if value is not None:
            setattr(params, key, value)
    top_k = optional_int(body, "top_k", *INT32_RANGE)
    if top_k is not None:
        params.top_k = top_k
    seed = optional_int(body, "seed", *SEED_RANGE)
    if seed is not None:
        params.seed = seed % 2**64
    n = optional_int(body, "n")
    if n is not None:
        params.n = n
    min_tokens = optional_int(body, "min_tokens")
    if min_tokens is not None:
        params.min_tokens = min_tokens
    for key in ("ignore_eos", "include_stop_str_in_output"):
        value = optional_bool(body, key)
        if value is not None:
            setattr(params, key, value)
    skip_special = optional_bool(body, "skip_special_tokens")
    params.keep_special_tokens = skip_special is False
    stop = body.get("stop")
    if isinstance(stop, str):
        params.stop.append(stop)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        params.stop.extend(stop)
    elif stop is not None:
        raise bad("stop", f"must be a string or an array of strings, got {json_type(stop)}")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        ids = token_ids(stop_ids, "stop_token_ids") if stop_ids else []
        if ids is None:
            raise bad("stop_token_ids", "must be an array of token ids")
        params.stop_token_ids.extend(ids)
    if chat:
        want = optional_bool(body, "logprobs")
        top = optional_int(body, "top_logprobs")
        if top is not None and not want:
            raise bad("top_logprobs", "needs logprobs set to true")
        logprobs = (top or 0) if want else None
    else:
        logprobs = optional_int(body, "logprobs")
    if logprobs is not None:
        params.logprobs = logprobs
    prompt_k = optional_int(body, "prompt_logprobs")
    if prompt_k is not None:
        if optional_bool(body, "stream"):
            raise bad("prompt_logprobs", "prompt_logprobs is not supported in a stream")
        params.prompt_logprobs = prompt_k
    logit_bias(body, params)
    token_restrictions(body, params)
    structured_output(body, params)
    beam_search(body, params)
    prediction(body, params)
    return params, logprobs


# vLLM's fields this server does not implement: a request that sets one is refused rather
# than served as if it had not (its output would not be what the client asked for).
_REFUSED = {"logits_processors": "logits_processors"}


def common_fields(body: dict) -> dict:
    """The request fields every route shares (priority, cache_salt, add_special_tokens, ...)."""
    for key, what in _REFUSED.items():
        if body.get(key):  # null, false and [] ask for nothing
            raise bad(key, f"{what} is not supported")
    common: dict[str, Any] = {}
    priority = optional_int(body, "priority", *INT32_RANGE)
    if priority is not None:
        common["priority"] = priority
    salt = optional_str(body, "cache_salt")
    if salt is not None:
        common["cache_salt"] = salt
    optional_str(body, "user")  # accepted (type-checked), not used
    add_special = optional_bool(body, "add_special_tokens")
    if add_special is not None:
        common["add_special_tokens"] = add_special
    truncate = optional_int(body, "truncate_prompt_tokens", -1)
    # -1 (vLLM): to the model's length, which a longer prompt would exceed with its first
    # output token anyway: no truncation, the length check refuses it as before
    if truncate is not None and truncate != -1:
        common["truncate_prompt_tokens"] = truncate
    return common


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = bool(optional_bool(body, "stream"))
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise bad("stream_options", f"must be an object, got {json_type(options)}")
        if not stream:
            raise bad("stream_options", "is only allowed with stream set to true")
        include_usage = bool(optional_bool(options, "include_usage"))
    return stream, include_usage


def completion_request(body: dict, fim: FillInMiddle | None = None) -> ApiRequest:
    """POST /v1/completions body → ApiRequest (raises InvalidRequest). A `suffix` frames
    the prompt in the model's fill-in-the-middle tokens (`fim`, fill_in_middle.py; None:
    the model has none, and a suffix is refused)."""
    echo = bool(optional_bool(body, "echo"))
    suffix = optional_str(body, "suffix")
    if suffix is not None:
        if fim is None:
            raise bad("suffix", "this model has no fill-in-the-middle tokens (a suffix needs "
                                f"one of: {MARKERS_NAMED})")
        if echo:
            raise bad("echo", "echo cannot be combined with suffix")
    # max_tokens 0 with echo (the legacy API's scoring request): one token, never shown
    echo_only = echo and body.get("max_tokens") == 0 and type(body["max_tokens"]) is int
    params, logprobs = _sampling({**body, "max_tokens": 1} if echo_only else body, chat=False)
    if echo and logprobs is not None:
        if optional_bool(body, "stream"):
            raise bad("echo", "echo with logprobs is not supported in a stream")
        # the prompt's tokens are scored too (top-k: the larger of the two asks)
        params.prompt_logprobs = max(logprobs, params.prompt_logprobs)
    best_of = optional_int(body, "best_of")
    if best_of is not None and best_of != (params.n if params.HasField("n") else 1):
        raise bad("best_of", "best_of other than n is not supported")
    stream, include_usage = _stream_flags(body)
    common = common_fields(body)
    if echo and common.get("truncate_prompt_tokens"):
        raise bad("echo", "echo with truncate_prompt_tokens is not supported")
    if suffix is not None:
        assert fim is not None
        requests = fim.requests(body.get("prompt"), suffix, params, common)
    else:
        requests = prompt_requests(body.get("prompt"), "prompt", params, common)
    n = params.n if params.HasField("n") else 1
    return ApiRequest(False, optional_str(body, "model"), requests, n, stream, include_usage,
                      logprobs, echo=echo, echo_only=echo_only, **_api_extras(body))


def tokenize_request(body: dict) -> pb.GenerateRequest:
    """POST /tokenize body (vLLM's and SGLang's): `prompt` (text or token ids) or `messages`
    (rendered as /v1/chat/completions renders them: the template fields and `tools` apply),
    `add_special_tokens` and `truncate_prompt_tokens` as on those routes → the
    GenerateRequest whose prompt validation.prompt_from_pb tokenizes."""
    common = common_fields(body)
    if present(body, "messages"):
        chat = messages_to_pb(chat_messages(body))
        _template_options(body, chat)
        tools = body.get("tools")
        if tools is not None:
            if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
                raise bad("tools", "must be an array of tool definitions")
            chat.tools_json = json.dumps(tools, ensure_ascii=False)
        return pb.GenerateRequest(messages=chat, **common)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return pb.GenerateRequest(prompt=prompt, **common)
    ids = token_ids(prompt, "prompt")
    if ids is None:
        raise bad("prompt", "is required: a string or an array of token ids (or send messages)")
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), **common)


def detokenize_ids(body: dict, vocab_size: int) -> list[int]:
    """POST /detokenize body: `tokens`, the ids to decode (each < the vocabulary)."""
    ids = token_ids(body.get("tokens"), "tokens")
    if ids is None:
        raise bad("tokens", "is required: a non-empty array of token ids")
    for t in ids:
        if t >= vocab_size:
            raise bad("tokens", f"token id {t} ≥ vocab size {vocab_size}")
    return ids


def chat_messages(body: dict) -> list[dict]:
    """The `messages` array, shape-checked (roles, text content); the template checks more."""
    messages = body.get("messages")
    if messages is None:
        raise bad("messages", "is required")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty array of messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad(f"messages[{i}]", "must be an object with role and content")
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise bad(f"messages[{i}].role", "is required (a string)")
    return messages


def chat_request(body: dict, tool_call_parser: str = "none",
                 reasoning_parser: str = "none") -> ApiRequest:
    """POST /v1/chat/completions body → ApiRequest (raises InvalidRequest). The reasoning
    parser splits the output unless an output format constrains it from its first token
    (structured output, a forced tool call): there is no free reasoning to split then."""
    messages = chat_messages(body)
    params, logprobs = _sampling(body, chat=True)
    stream, include_usage = _stream_flags(body)
    chat = messages_to_pb(messages)
    _template_options(body, chat)
    tools = tool_calls(body, params, chat, tool_call_parser)
    reasoning = ("" if reasoning_parser == "none" or params.HasField("structured_output")
                 else reasoning_parser)
    if keeps_special_tokens(reasoning) and body.get("skip_special_tokens") is None:
        params.keep_special_tokens = True  # (its tags are special tokens)
    request = pb.GenerateRequest(messages=chat, params=params, **common_fields(body))
    n = params.n if params.HasField("n") else 1
    include = optional_bool(body, "include_reasoning")
    return ApiRequest(True, optional_str(body, "model"), [request], n, stream, include_usage,
                      logprobs, tools, reasoning=reasoning, include_reasoning=include is not False,
                      **_api_extras(body))


def _api_extras(body: dict) -> dict:
    """vLLM's reply-shaping fields (after _stream_flags: stream_options is an object or
    absent)."""
    options = body.get("stream_options") or {}
    return {"prompt_logprobs": optional_int(body, "prompt_logprobs"),
            "tokens_as_ids": bool(optional_bool(body, "return_tokens_as_token_ids")),
            "continuous_usage": bool(optional_bool(options, "continuous_usage_stats")),
            "return_token_ids": bool(optional_bool(body, "return_token_ids"))}


def _template_options(body: dict, chat: pb.ChatMessages) -> None:
    """vLLM's chat-template fields: `add_generation_prompt`, `continue_final_message` (an
    assistant prefill continued) and `chat_template_kwargs` (extra template variables, e.g.
    {"enable_thinking": false}); validation.py renders with them."""
    add = optional_bool(body, "add_generation_prompt")
    if add is not None:
        chat.add_generation_prompt = add
    chat.continue_final_message = bool(optional_bool(body, "continue_final_message"))
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise bad("chat_template_kwargs", f"must be an object, got {json_type(kwargs)}")
        chat.chat_template_kwargs_json = json.dumps(kwargs, ensure_ascii=False)


def messages_to_pb(messages: list[dict]) -> pb.ChatMessages:
    """OpenAI messages → the gRPC chat form. Content: a string, null (an assistant turn with
    none) or an array of text parts (another part type is rejected here, named by its JSON
    path; validation.py checks the rest for both APIs); an assistant turn's `tool_calls`, a
    tool turn's `tool_call_id` and a `name` are kept for the template."""
    out = pb.ChatMessages()
    for i, message in enumerate(messages):
        m = out.messages.add(role=message["role"])
        content = message.get("content")
        if content is None or isinstance(content, str):
            m.content = content or ""
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise bad(f"messages[{i}].content[{j}]", "must be an object with a type")
                if part["type"] != "text":
                    raise bad(f"messages[{i}].content[{j}].type",
                               f"content part type {part['type']!r} is not supported "
                               f"(only 'text')")
                text = part.get("text")
                if not isinstance(text, str):
                    raise bad(f"messages[{i}].content[{j}].text", "must be a string")
                m.parts.add(type="text", text=text)
        else:
            raise bad(f"messages[{i}].content",
                       f"must be a string or an array of parts, got {json_type(content)}")
        calls = message.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
                raise bad(f"messages[{i}].tool_calls", "must be an array of tool calls")
            m.tool_calls_json = json.dumps(calls, ensure_ascii=False)
        for key in ("tool_call_id", "name"):
            value = message.get(key)
            if value is not None:
                if not isinstance(value, str):
                    raise bad(f"messages[{i}].{key}", f"must be a string, got {json_type(value)}")
                setattr(m, key, value)
    return out


# --------------------------------------------------------------------------- responses


def usage_json(usage: Usage | None) -> dict | None:
    if usage is None:
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
        "completion_tokens_details": {
            "accepted_prediction_tokens": usage.accepted_prediction_tokens,
            "rejected_prediction_tokens": usage.rejected_prediction_tokens},
    }


def add_usage(total: Usage | None, usage: Usage | None) -> Usage | None:
    if usage is None:
        return total
    if total is None:
        return usage
    return Usage(*(a + b for a, b in zip(astuple(total), astuple(usage), strict=True)))


def stop_reason(delta: CompletionDelta, stop_token_ids: Sequence[int]) -> str | int | None:
    """vLLM's stop_reason: the stop string or the requested stop token id that ended a
    choice; None for the model's EOS or a length ending."""
    if delta.stop_string:
        return delta.stop_string
    return delta.stop_token_id if delta.stop_token_id in stop_token_ids else None
