"""`pagedserve bench`'s workloads: the request list of a run (`sample_requests`), seeded.

Datasets: ``random`` (token-id prompts and output lengths drawn from ranges),
``shared-prefix`` (tenants, each a system prompt shared by its questions, interleaved as
real traffic interleaves them) and ``file`` (one prompt a line: text, or a JSON object with
``prompt`` and optionally ``max_tokens``) and ``sharegpt`` (a ShareGPT JSON file, the
conversations people benchmark serving engines with: each conversation's first turn is the
prompt, its second turn's token count the output length, counted with ``--tokenizer``; the
conversations drawn in a seeded order and filtered as vLLM's benchmark filters them). With
``--lora-modules`` each request also runs
one of the named LoRA adapters, drawn apart, so the prompts are those of a run without.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .bench import BenchConfig

DATASETS = ("random", "shared-prefix", "file", "sharegpt")
# ShareGPT's filter, as vLLM's benchmark applies it: prompt and reply of at least 4 tokens, a
# prompt of at most 1024 and both together at most 2048.
SHAREGPT_MIN_TOKENS, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048


@dataclass(frozen=True)
class BenchRequest:
    """One request of the workload: text or token ids, and its output length."""

    prompt: str | None
    prompt_token_ids: tuple[int, ...] | None
    max_tokens: int
    prompt_len: int  # token count when known (ids), else 0 until usage says
    lora: str = ""  # the LoRA adapter it runs ("": the model)


# ---------------------------------------------------------------------------------------
# Datasets


def parse_range(text: str) -> tuple[int, int]:
    parts = text.split(":")
    if len(parts) == 1:
        lo = hi = int(parts[0])
    elif len(parts) == 2:
        lo, hi = int(parts[0]), int(parts[1])
    else:
        raise argparse.ArgumentTypeError(f"expected A:B, got {text!r}")
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"need 1 <= A <= B, got {text!r}")
    return lo, hi


def _random_ids(rng: np.random.Generator, n: int, vocab_size: int, low: int) -> tuple:
    return tuple(int(x) for x in rng.integers(low, vocab_size, size=n))


def sample_requests(cfg: BenchConfig, vocab_size: int) -> list[BenchRequest]:
    """The workload, deterministic for cfg.seed; each request given one of
    ``cfg.lora_modules`` (drawn apart: the prompts are those of a run without them)."""
    reqs = _workload(cfg, vocab_size)
    if cfg.lora_modules:
        picks = np.random.default_rng(cfg.seed + 31).integers(len(cfg.lora_modules),
                                                              size=len(reqs))
        reqs = [dataclasses.replace(req, lora=cfg.lora_modules[i])
                for req, i in zip(reqs, picks.tolist(), strict=True)]
    return reqs


def _workload(cfg: BenchConfig, vocab_size: int) -> list[BenchRequest]:
    """Token ids avoid the lowest ids (special tokens in the tiny models) when the
    vocabulary is large enough."""
    rng = np.random.default_rng(cfg.seed)
    low = 3 if vocab_size > 16 else 0
    out_lo, out_hi = cfg.output_len_range
    if cfg.dataset == "random":
        in_lo, in_hi = cfg.input_len_range
        in_lens = rng.integers(in_lo, in_hi + 1, size=cfg.num_prompts)
        out_lens = rng.integers(out_lo, out_hi + 1, size=cfg.num_prompts)
        return [BenchRequest(None, _random_ids(rng, int(n), vocab_size, low), int(m), int(n))
                for n, m in zip(in_lens, out_lens, strict=True)]
    if cfg.dataset == "shared-prefix":
        reqs = []
        for _ in range(cfg.tenants):
            prefix = _random_ids(rng, cfg.prefix_len, vocab_size, low)
            for _ in range(cfg.questions_per_tenant):
                ids = prefix + _random_ids(rng, cfg.question_len, vocab_size, low)
                reqs.append(BenchRequest(None, ids, int(rng.integers(out_lo, out_hi + 1)),
                                         len(ids)))
        order = rng.permutation(len(reqs))  # tenants interleave, as real traffic does
        return [reqs[i] for i in order]
    if cfg.dataset == "file":
        if not cfg.file:
            raise ValueError("--dataset file needs --file PATH")
        reqs = []
        for line in Path(cfg.file).read_text().splitlines():
            if not line.strip():
                continue
            max_tokens = int(rng.integers(out_lo, out_hi + 1))
            if line.lstrip().startswith("{"):
                obj = json.loads(line)
                prompt = obj["prompt"]
                max_tokens = int(obj.get("max_tokens", max_tokens))
            else:
                prompt = line
            reqs.append(BenchRequest(prompt, None, max_tokens, 0))
        if not reqs:
            raise ValueError(f"{cfg.file} holds no prompts")
        # --num-prompts: cycle through the file (in order) up to that many.
        return [reqs[i % len(reqs)] for i in range(cfg.num_prompts)]
    if cfg.dataset == "sharegpt":
        return _sharegpt(cfg, rng)
    raise ValueError(f"unknown dataset {cfg.dataset!r}; known: {', '.join(DATASETS)}")


def _sharegpt(cfg: BenchConfig, rng: np.random.Generator) -> list[BenchRequest]:
    """`--num-prompts` requests of a ShareGPT file (module docstring)."""
    if not cfg.file:
        raise ValueError('--dataset sharegpt needs --file PATH (ShareGPT JSON: [{"conversations"'
                         ': [{"from": ..., "value": ...}, ...]}, ...])')
    if not cfg.tokenizer:
        raise ValueError("--dataset sharegpt needs --tokenizer (the served model's directory "
                         "or hub id: each reply's token count is its output length)")
    from .models import resolve_model
    from .router.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(resolve_model(cfg.tokenizer, progress=False))
    data = json.loads(Path(cfg.file).read_text())
    pairs = []
    for entry in data if isinstance(data, list) else ():
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if isinstance(turns, list) and len(turns) >= 2 and all(
                isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns[:2]):
            pairs.append((turns[0]["value"], turns[1]["value"]))
    reqs = []
    for i in rng.permutation(len(pairs)).tolist():
        prompt, reply = pairs[i]
        n_in, n_out = len(tok.encode(prompt)), len(tok.encode(reply, add_special_tokens=False))
        if min(n_in, n_out) < SHAREGPT_MIN_TOKENS or n_in > SHAREGPT_MAX_PROMPT \
                or n_in + n_out > SHAREGPT_MAX_TOTAL:
            continue
        reqs.append(BenchRequest(prompt, None, n_out, n_in))
        if len(reqs) == cfg.num_prompts:
            break
    if not reqs:
        raise ValueError(f"{cfg.file} holds no ShareGPT conversation that passes the filter")
    return reqs
