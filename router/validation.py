"""GenerateRequest (protobuf) → validated `RequestSpec`: every INVALID_ARGUMENT case of
DESIGN §3 is checked here, before any work (parameters first, then the prompt).

This is the edge's from_pb: nothing past it sees a protobuf type. Each failure raises
`InvalidRequest` whose message starts with the field's name and whose `field` attribute names
it too.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from dataclasses import dataclass, replace

from .chat_template import render_chat
from .errors import InvalidRequest
from .lora_registry import resolvable
from .structured import grammar_from_pb
from .tokenizer import Tokenizer
from .types import DEFAULT_MAX_TOKENS, BeamSpec, RequestSpec, SamplingSpec

MAX_REQUEST_ID_CHARS = 256
MAX_TEMPERATURE = 100.0
PENALTY_RANGE = (-2.0, 2.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's
MAX_LOGIT_BIAS = 1024  # entries per request
MAX_BAD_WORDS = 128  # words per request
MAX_BAD_WORD_CHARS = 1000  # the sampler compares a word's tokens with the output every step
MAX_CHARS_PER_TOKEN = 64  # a prediction's text beyond max_model_len x this is refused untokenized


@dataclass(frozen=True, slots=True)
class Limits:
    """Request limits: the model's, and --max-n / --max-logprobs / --max-stop."""

    vocab_size: int
    max_model_len: int
    max_n: int = 16
    max_logprobs: int = 20
    max_stop: int = 16
    lora_adapters: tuple[str, ...] = ()  # the names a request may pick (--lora-modules)
    lora_dir: str | None = None  # and those loaded on demand from here (--lora-dir)

    def serves_adapter(self, name: str) -> bool:
        """May a request name LoRA adapter ``name`` (served now, or one of --lora-dir's,
        loaded when the request is submitted)?"""
        return name in self.lora_adapters or resolvable(self.lora_dir, name)


def _bad(field: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{field}: {message}", field=field)


def _check_float(field: str, value: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    if math.isnan(value):
        raise _bad(field, "must be a number, got NaN")
    below = value <= lo if lo_open else value < lo
    if below or value > hi:
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise _bad(field, f"must be in {interval}, got {value:g}")
    return float(value)


def random_seed() -> int:
    """A random 63-bit seed for a request that set none."""
    return secrets.randbits(63)


def sampling_from_pb(params, limits: Limits,
                     default_max_tokens: int = DEFAULT_MAX_TOKENS) -> SamplingSpec:
    """SamplingParams (protobuf, may be the default instance) → SamplingSpec, every range checked."""
    max_tokens = params.max_tokens if params.HasField("max_tokens") else default_max_tokens
    if max_tokens == 0:
        raise _bad("max_tokens", "must be at least 1")
    temperature = params.temperature if params.HasField("temperature") else 1.0
    _check_float("temperature", temperature, 0.0, MAX_TEMPERATURE)
    top_p = params.top_p if params.HasField("top_p") else 1.0
    _check_float("top_p", top_p, 0.0, 1.0, lo_open=True)
    if params.top_k < -1:
        raise _bad("top_k", f"must be -1 or 0 (off) or positive, got {params.top_k}")
    top_k = -1 if params.top_k <= 0 else params.top_k
    _check_float("min_p", params.min_p, 0.0, 1.0)
    seed = params.seed if params.HasField("seed") else random_seed()
    stop = tuple(params.stop)
    if len(stop) > limits.max_stop:
        raise _bad("stop", f"at most {limits.max_stop} stop strings (--max-stop), got {len(stop)}")
    for i, s in enumerate(stop):
        if not s:
            raise _bad("stop", f"stop string {i} is empty")
    stop_token_ids = tuple(params.stop_token_ids)
    for t in stop_token_ids:
        if t >= limits.vocab_size:
            raise _bad("stop_token_ids", f"token id {t} ≥ vocab size {limits.vocab_size}")
    if params.min_tokens > max_tokens:
        raise _bad("min_tokens", f"must be ≤ max_tokens ({max_tokens}), got {params.min_tokens}")
    n = params.n if params.HasField("n") else 1
    if n == 0 or n > limits.max_n:
        raise _bad("n", f"must be in [1, {limits.max_n}] (--max-n), got {n}")
    logprobs = params.logprobs if params.HasField("logprobs") else None
    if logprobs is not None and logprobs > limits.max_logprobs:
        raise _bad(
            "logprobs", f"must be ≤ {limits.max_logprobs} (--max-logprobs), got {logprobs}"
        )
    repetition_penalty = (
        params.repetition_penalty if params.HasField("repetition_penalty") else 1.0
    )
    _check_float("repetition_penalty", repetition_penalty, 0.0, math.inf, lo_open=True)
    if math.isinf(repetition_penalty):
        raise _bad("repetition_penalty", "must be finite")
    _check_float("presence_penalty", params.presence_penalty, *PENALTY_RANGE)
    _check_float("frequency_penalty", params.frequency_penalty, *PENALTY_RANGE)
    prompt_logprobs = params.prompt_logprobs if params.HasField("prompt_logprobs") else None
    if prompt_logprobs is not None and prompt_logprobs > limits.max_logprobs:
        raise _bad("prompt_logprobs",
                   f"must be ≤ {limits.max_logprobs} (--max-logprobs), got {prompt_logprobs}")
    logit_bias = _logit_bias(params.logit_bias, limits.vocab_size)
    allowed = tuple(sorted(set(params.allowed_token_ids)))
    if allowed and allowed[-1] >= limits.vocab_size:
        raise _bad("allowed_token_ids", f"token id {allowed[-1]} ≥ vocab size "
                   f"{limits.vocab_size}")
    if len(params.bad_words) > MAX_BAD_WORDS:
        raise _bad("bad_words", f"at most {MAX_BAD_WORDS} words, got {len(params.bad_words)}")
    for i, word in enumerate(params.bad_words):
        if not word.strip():
            raise _bad("bad_words", f"word {i} is blank")
        if len(word) > MAX_BAD_WORD_CHARS:
            raise _bad("bad_words", f"word {i} has {len(word)} characters (at most "
                       f"{MAX_BAD_WORD_CHARS})")
    grammar = ""
    if params.HasField("structured_output"):
        grammar = grammar_from_pb(params.structured_output)
        if grammar and params.ignore_eos:
            raise _bad("ignore_eos", "cannot be combined with structured output (the format "
                       "decides where the output ends)")
        if grammar and params.min_tokens:
            raise _bad("min_tokens", "cannot be combined with structured output (the format "
                       "decides where the output ends)")
    beam = _beam_spec(params) if params.HasField("beam_search") else None
    if beam is not None and n == 1:  # one beam is greedy decoding (transformers' num_beams=1)
        beam, temperature = None, 0.0
    return SamplingSpec(
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=top_k,
        min_p=float(params.min_p),
        seed=seed,
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens,
        n=n,
        logprobs=logprobs,
        repetition_penalty=float(repetition_penalty),
        presence_penalty=float(params.presence_penalty),
        frequency_penalty=float(params.frequency_penalty),
        include_stop_str_in_output=params.include_stop_str_in_output,
        keep_special_tokens=params.keep_special_tokens,
        logit_bias=logit_bias,
        grammar=grammar,
        prompt_logprobs=prompt_logprobs,
        allowed_token_ids=allowed,
        beam=beam,
    )


_EARLY_STOPPING = {0: False, 1: True, 2: "never"}  # EarlyStopping → transformers' value
MAX_LENGTH_PENALTY = 10.0
# A beam's row answers its top (1 + stop ids) x n logprobs (transformers' count)
MAX_BEAM_STOP_IDS = 16


def _beam_spec(params) -> BeamSpec:
    """SamplingParams.beam_search → BeamSpec. Beam search ranks beams by their logprobs:
    what would reshape the distribution it ranks by, or end a beam on its text, is refused
    (temperature and seed have no effect: documented, not refused)."""
    conflicts = (
        ("top_p", params.HasField("top_p") and params.top_p != 1.0),
        ("top_k", params.top_k > 0),
        ("min_p", params.min_p > 0),
        ("repetition_penalty",
         params.HasField("repetition_penalty") and params.repetition_penalty != 1.0),
        ("presence_penalty", params.presence_penalty != 0),
        ("frequency_penalty", params.frequency_penalty != 0),
        ("logit_bias", bool(params.logit_bias)),
        ("allowed_token_ids", bool(params.allowed_token_ids)),
        ("bad_words", bool(params.bad_words)),
        ("stop", bool(params.stop)),
        ("structured_output", params.HasField("structured_output")),
        ("prediction", params.HasField("prediction")),  # (beams draft nothing)
    )
    for name, set_ in conflicts:
        if set_:
            raise _bad(name, "cannot be combined with beam search")
    if len(set(params.stop_token_ids)) > MAX_BEAM_STOP_IDS:  # each adds n to a row's top-K
        raise _bad("stop_token_ids", f"at most {MAX_BEAM_STOP_IDS} with beam search, got "
                   f"{len(set(params.stop_token_ids))}")
    bs = params.beam_search
    length_penalty = bs.length_penalty if bs.HasField("length_penalty") else 1.0
    _check_float("length_penalty", length_penalty, -MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY)
    if bs.early_stopping not in _EARLY_STOPPING:
        raise _bad("early_stopping", f"unknown value {bs.early_stopping}")
    return BeamSpec(float(length_penalty), _EARLY_STOPPING[bs.early_stopping])


def _logit_bias(bias, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """The logit_bias map, checked, as (token id, bias) pairs in id order."""
    if len(bias) > MAX_LOGIT_BIAS:
        raise _bad("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
    for token_id, value in bias.items():
        if token_id >= vocab_size:
            raise _bad("logit_bias", f"token id {token_id} ≥ vocab size {vocab_size}")
        if not math.isfinite(value) or not LOGIT_BIAS_RANGE[0] <= value <= LOGIT_BIAS_RANGE[1]:
            raise _bad("logit_bias", f"bias of token {token_id} must be in [-100, 100], "
                       f"got {value:g}")
    return tuple(sorted((int(t), float(v)) for t, v in bias.items()))


def messages_from_pb(chat) -> list[dict]:
    """ChatMessages (protobuf) → the OpenAI-shaped messages render_chat takes: content a string,
    or a list of {"type", "text"} parts (checked there; "text" is the only type), and an
    assistant turn's `tool_calls`, a tool turn's `tool_call_id`, a `name` when set."""
    messages = []
    for i, m in enumerate(chat.messages):
        if not m.role:
            raise _bad(f"messages[{i}].role", "required (a non-empty string)")
        if m.content and m.parts:
            raise _bad(f"messages[{i}]", "set content or parts, not both")
        for j, part in enumerate(m.parts):
            if part.type != "text":
                raise _bad(f"messages[{i}].parts[{j}].type",
                           f"content part type {part.type!r} is not supported (only 'text')")
        content = [{"type": p.type, "text": p.text} for p in m.parts] if m.parts else m.content
        message = {"role": m.role, "content": content}
        if m.tool_calls_json:
            message["tool_calls"] = _json_list(f"messages[{i}].tool_calls_json",
                                               m.tool_calls_json)
            # An assistant turn that only calls tools has content "" (OpenAI's null): a
            # template that reads message['content'] of every turn still renders it.
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.name:
            message["name"] = m.name
        messages.append(message)
    return messages


def tools_from_pb(chat) -> list[dict] | None:
    """ChatMessages.tools_json → the tool definitions for the template (None: none)."""
    if not chat.tools_json:
        return None
    return _json_list("tools_json", chat.tools_json) or None


def template_kwargs_from_pb(chat) -> dict | None:
    """ChatMessages.chat_template_kwargs_json → the template's extra variables (None: none)."""
    if not chat.chat_template_kwargs_json:
        return None
    try:
        value = json.loads(chat.chat_template_kwargs_json)
    except ValueError as exc:
        raise _bad("chat_template_kwargs_json", f"is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise _bad("chat_template_kwargs_json", "must be a JSON object")
    return value


def _json_list(field: str, text: str) -> list[dict]:
    """JSON text of an array of objects."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise _bad(field, f"is not JSON: {exc}") from None
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise _bad(field, "must be a JSON array of objects")
    return value


def prompt_from_pb(request, *, tokenizer: Tokenizer,
                   limits: Limits) -> tuple[tuple[int, ...], str | None]:
    """A GenerateRequest's prompt token ids (its text tokenized, its conversation rendered,
    special tokens and left truncation as it asks) and its text where the ids are all of it.
    Raises InvalidRequest naming the field: an empty prompt, an id ≥ the vocabulary, a
    conversation the template refuses. The length against max_model_len is the caller's."""
    which = request.WhichOneof("input")
    prompt_text: str | None = None
    if which == "prompt_token_ids":
        ids = tuple(request.prompt_token_ids.ids)
        if not ids:
            raise _bad("prompt_token_ids", "empty prompt")
        for t in ids:
            if t >= limits.vocab_size:
                raise _bad("prompt_token_ids", f"token id {t} ≥ vocab size {limits.vocab_size}")
    elif which == "messages":
        form = request.messages
        cont = form.continue_final_message
        chat = render_chat(tokenizer, messages_from_pb(form), tools=tools_from_pb(form),
                           continue_final_message=cont,
                           add_generation_prompt=(form.add_generation_prompt
                                                  if form.HasField("add_generation_prompt")
                                                  else not cont),
                           template_kwargs=template_kwargs_from_pb(form))
        prompt_text = chat.text
        ids = tuple(tokenizer.encode(chat.text) if request.add_special_tokens
                    else chat.token_ids)
        if not ids:
            raise _bad("messages", "the conversation renders to no tokens")
        bad = [t for t in ids if t >= limits.vocab_size]
        if bad:
            raise _bad("messages", f"token id {bad[0]} ≥ vocab size {limits.vocab_size}")
    else:
        if not request.prompt:
            raise _bad("prompt", "empty prompt")
        prompt_text = request.prompt
        ids = tuple(tokenizer.encode(prompt_text, add_special_tokens=(
            request.add_special_tokens if request.HasField("add_special_tokens") else True)))
        if not ids:
            raise _bad("prompt", "the prompt tokenizes to no tokens")
        bad = [t for t in ids if t >= limits.vocab_size]
        if bad:
            raise _bad("prompt", f"token id {bad[0]} ≥ vocab size {limits.vocab_size}")
    if 0 < request.truncate_prompt_tokens < len(ids):
        ids = ids[-request.truncate_prompt_tokens:]  # the last k: left truncation, as vLLM's
        prompt_text = None  # no longer the text of the ids
    return ids, prompt_text


def bad_words_token_ids(words, tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token ids as the model would write it: the word as given (its leading
    spaces dropped: at the start of the text) and after a space (inside a text, where a
    word-initial token usually carries the space), without special tokens; distinct
    sequences in first-seen order. What vLLM bans for its bad_words."""
    seen: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                seen.setdefault(ids, None)
    return tuple(seen)


def prediction_from_pb(prediction, tokenizer: Tokenizer, limits: Limits) -> tuple[int, ...]:
    """SamplingParams.prediction → its token ids: text tokenized without special tokens
    (as the output writes it), ids checked against the vocabulary; at most max_model_len
    (no output is longer)."""
    if prediction.WhichOneof("content") == "token_ids":
        ids = tuple(prediction.token_ids.ids)
        bad = [t for t in ids if t >= limits.vocab_size]
        if bad:
            raise _bad("prediction", f"token id {bad[0]} ≥ vocab size {limits.vocab_size}")
    else:
        if len(prediction.text) > limits.max_model_len * MAX_CHARS_PER_TOKEN:
            raise _bad("prediction", f"{len(prediction.text)} characters is longer than any "
                       f"output (max_model_len {limits.max_model_len} tokens)")
        ids = tuple(tokenizer.encode(prediction.text, add_special_tokens=False))
    if len(ids) > limits.max_model_len:
        raise _bad("prediction", f"{len(ids)} tokens is longer than any output "
                   f"(max_model_len {limits.max_model_len})")
    return ids


def request_from_pb(
    request,
    *,
    tokenizer: Tokenizer,
    limits: Limits,
    request_id: str | None = None,
    arrival_time: float | None = None,
    deadline: float | None = None,
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
) -> RequestSpec:
    """GenerateRequest → RequestSpec. `request_id` overrides the request's (the edge passes the
    server-assigned id when the request's is empty). `default_max_tokens` applies when the
    request sets none; None means the rest of the context (max_model_len − prompt tokens,
    the OpenAI API's default as vLLM serves it)."""
    rid = request.request_id if request_id is None else request_id
    if len(rid) > MAX_REQUEST_ID_CHARS:
        raise _bad("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters, got {len(rid)}")
    to_context = default_max_tokens is None and not request.params.HasField("max_tokens")
    sampling = sampling_from_pb(request.params, limits,
                                limits.max_model_len if to_context else default_max_tokens)
    ids, prompt_text = prompt_from_pb(request, tokenizer=tokenizer, limits=limits)
    if request.params.bad_words:
        sampling = replace(sampling, bad_words_token_ids=bad_words_token_ids(
            request.params.bad_words, tokenizer))
    if request.params.HasField("prediction"):
        sampling = replace(sampling, prediction=prediction_from_pb(
            request.params.prediction, tokenizer, limits))
    field = request.WhichOneof("input") or "prompt"
    if to_context and len(ids) < limits.max_model_len:
        sampling = replace(sampling, max_tokens=limits.max_model_len - len(ids))
        if sampling.min_tokens > sampling.max_tokens:
            raise _bad("min_tokens", f"must be ≤ the {sampling.max_tokens} tokens left in the "
                       f"context, got {sampling.min_tokens}")
    if len(ids) + sampling.max_tokens > limits.max_model_len:
        culprit = field if len(ids) >= limits.max_model_len else "max_tokens"
        raise _bad(
            culprit,
            f"prompt ({len(ids)} tokens) + max_tokens ({sampling.max_tokens}) > "
            f"max_model_len ({limits.max_model_len})",
        )
    cache_salt, adapter = request.cache_salt, request.lora_adapter
    if "\x00" in cache_salt:  # the separator of the salts the router adds below
        raise _bad("cache_salt", "must not contain a NUL character")
    if adapter:
        if not limits.serves_adapter(adapter):
            served = ", ".join(limits.lora_adapters) or "none"
            raise _bad("lora_adapter", f"unknown LoRA adapter {adapter!r} (served: {served})")
        # An adapter's keys and values are its own: its blocks are shared only within it.
        cache_salt = f"{cache_salt}\x00lora:{adapter}"
    if sampling.prompt_logprobs is not None:
        # Every prompt token must be computed to be scored: a salt of its own keeps the
        # prefix cache from serving any of them (its samples still share its blocks).
        cache_salt = f"{cache_salt}\x00prompt-logprobs:{secrets.token_hex(8)}"
    return RequestSpec(
        request_id=rid,
        prompt_token_ids=ids,
        sampling=sampling,
        prompt_text=prompt_text,
        priority=request.priority,
        cache_salt=cache_salt,
        lora_adapter=adapter,
        arrival_time=time.monotonic() if arrival_time is None else arrival_time,
        deadline=deadline,
    )
