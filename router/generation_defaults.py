"""The model's own sampling defaults for the OpenAI API (`--generation-config`, vLLM's flag).

Model authors ship recommended sampling settings in `generation_config.json` (Qwen2.5
Instruct: temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05; Llama 3 Instruct:
temperature 0.6, top_p 0.9), and transformers' `generate` and vLLM's OpenAI server use them
for whatever a request leaves out. So does the HTTP API here with `--generation-config auto`
(the default): a request that omits `temperature`, `top_p`, `top_k`, `min_p`,
`repetition_penalty` or its token limit gets the model's value (`max_new_tokens` is the
token limit), one that sets a field keeps its own, and a beam search request gets none of
them (beams are ranked, not sampled). `--generation-config vllm` turns this off (the OpenAI
defaults: temperature 1, no top-p/top-k), and a folder path reads that folder's file
instead. The gRPC API keeps the defaults its proto documents (unset temperature is 1.0).

A value the API would refuse (a negative temperature, top_p outside (0, 1]) is left out at
start with a warning, so a bad file never turns every request into a 400.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger("pagedserve.router")

FILE = "generation_config.json"
# generation_config.json key -> (body field, accepted when)
_FIELDS = {
    "temperature": ("temperature", lambda v: 0 <= v <= 100),
    "top_p": ("top_p", lambda v: 0 < v <= 1),
    "top_k": ("top_k", lambda v: v == int(v) and v >= -1),
    "min_p": ("min_p", lambda v: 0 <= v <= 1),
    "repetition_penalty": ("repetition_penalty", lambda v: 0 < v <= 100),
    "max_new_tokens": ("max_tokens", lambda v: v == int(v) and v >= 1),
}
# Body fields that already set the token limit (chat's and the Responses API's names too).
_TOKEN_LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def generation_defaults(model_dir: str | Path, mode: str | None) -> dict:
    """The body fields to fill in from `mode`'s generation_config.json ("auto": the model
    directory's; "vllm": none; else a folder holding one). Missing file: none."""
    if mode == "vllm":
        return {}
    folder = Path(model_dir) if mode in (None, "auto") else Path(mode)
    path = folder / FILE
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        log.warning("%s: cannot read it (%s); no sampling defaults from it", path, exc)
        return {}
    defaults = {}
    for key, (field, ok) in _FIELDS.items():
        value = config.get(key) if isinstance(config, dict) else None
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
            log.warning("%s: %s %r is not a value the API takes; left out", path, key, value)
            continue
        defaults[field] = int(value) if field in ("top_k", "max_tokens") else float(value)
    if defaults:
        log.info("sampling defaults from %s for HTTP requests that leave them out: %s "
                 "(--generation-config vllm: none)", path,
                 ", ".join(f"{k}={v}" for k, v in defaults.items()))
    return defaults


def with_defaults(body: dict, defaults: dict) -> dict:
    """`body` with the fields it leaves out taken from `defaults` (a new dict; the body
    itself when there is nothing to add or it asks for beam search)."""
    if not defaults or body.get("use_beam_search") is True:
        return body
    added = {k: v for k, v in defaults.items() if body.get(k) is None and not (
        k == "max_tokens" and any(body.get(f) is not None for f in _TOKEN_LIMITS))}
    return {**body, **added} if added else body
