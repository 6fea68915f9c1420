"""Structured output's cost on the executor (DESIGN §8): JSON lines on stdout, a table on stderr.

What a constrained step adds to sampling, on the built-in model's tokenizer (SmolLM2, 49,152
tokens; `--model DIR` for another):

* case `mask_<format>_b<B>`: B matchers in different states (each advanced by `--advance`
  random allowed tokens from its start, so the batch is not B copies of one state), then
  per step: llguidance fills the B bitmask rows (`fill_us_p50`, its thread pool; threads from
  `--threads`, default 1 as a CPU executor gives it) and the mask is unpacked and applied to
  fp32 logits [B, V] into the sampler's work buffer (`apply_us_p50`, the copy the sampler
  makes anyway included); `per_row_us` = (fill + apply) / B;
* case `sampler_<format>_b<B>`: the whole `Sampler` call on [B, V] random logits, greedy,
  with every row constrained (`constrained_us_p50`) and with none (`plain_us_p50`),
  alternated; `added_us` is the difference, what a step of B constrained rows pays.

Formats: `json_schema` (an object of 4 typed fields), `json_object` (any object), `regex`
(a date-and-code pattern), `choice` (8 strings). Batches: `--batches` (default 1,16,64,256).

With `--http HOST:PORT` (a running `pagedserve serve` with the built-in model), case
`e2e_c<C>` instead: C concurrent chat requests ("Where is <landmark>?", greedy, max_tokens
64) with a JSON-schema `response_format` (city, country) and without, in `--rounds`
alternated rounds; output tokens per second of wall time for each (`*_tok_per_s`) and their
ratio.

    .venv/bin/python benchmarks/structured_bench.py [--model DIR] [--batches 1,16,64,256]
        [--reps 30] [--threads 1]
    .venv/bin/python benchmarks/structured_bench.py --http 127.0.0.1:8000 [--concurrency 8]
        [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

BENCH = "structured_bench"
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "email", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
                         "tags": {"type": "array", "items": {"type": "string"},
                                  "maxItems": 5}}}
FORMATS = {
    "json_schema": ("json_schema", json.dumps(SCHEMA)),
    "json_object": ("json_object", True),
    "regex": ("regex", "[0-9]{4}-[0-9]{2}-[0-9]{2} [A-Z]{3}-[0-9]{3,6}"),
    "choice": ("choice", ["positive", "negative", "neutral", "mixed", "unknown",
                          "very positive", "very negative", "not applicable"]),
}


def emit(case: str, **figures) -> None:
    print(json.dumps({"bench": BENCH, "case": case, **figures}), flush=True)


def p50_us(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e6, 1)


def model_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    from pagedserve.models import ensure_builtin_model
    return ensure_builtin_model()


def eos_ids(directory: Path) -> list[int]:
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = directory / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids += [eos] if isinstance(eos, int) else list(eos or [])
    return sorted(set(ids))


def advanced_matchers(compiler, grammar: str, eos: list[int], batch: int, advance: int,
                      rng: random.Random):
    """`batch` matchers, each moved `rng.randint(0, advance)` random allowed tokens (never
    EOS) from the start, so the batch holds different states."""
    matchers = []
    for _ in range(batch):
        m = compiler.matcher(grammar, eos)
        for _ in range(rng.randint(0, advance)):
            bits = compiler.fill_masks([m])[0].view(np.uint8)
            allowed = [t for t in np.flatnonzero(np.unpackbits(bits, bitorder="little"))
                       if t not in eos and t < compiler.vocab_size]
            if not allowed or m.done:
                break
            m.consume(int(rng.choice(allowed)))
        matchers.append(m)
    return matchers


LANDMARKS = ["the Eiffel Tower", "the Colosseum", "the Statue of Liberty", "Big Ben",
             "the Sydney Opera House", "the Taj Mahal", "the Brandenburg Gate",
             "the Golden Gate Bridge", "the Acropolis", "the Sagrada Familia",
             "Machu Picchu", "the Kremlin", "the Forbidden City", "Mount Fuji",
             "the Louvre", "the CN Tower"]
PLACE = {"type": "object", "required": ["city", "country"], "additionalProperties": False,
         "properties": {"city": {"type": "string"}, "country": {"type": "string"}}}


def e2e(address: str, concurrency: int, rounds: int) -> None:
    """Constrained vs free chat requests against a running server, alternated rounds."""
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int, constrained: bool) -> int:
        body = {"model": None, "max_tokens": 64, "temperature": 0,
                "messages": [{"role": "user",
                              "content": f"Where is {LANDMARKS[i % len(LANDMARKS)]}?"}]}
        if constrained:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "place", "schema": PLACE}}
        req = urllib.request.Request(f"http://{address}/v1/chat/completions",
                                     json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as resp:
            reply = json.loads(resp.read())
        if constrained:
            json.loads(reply["choices"][0]["message"]["content"])  # must parse
        return reply["usage"]["completion_tokens"]

    totals = {True: [0, 0.0], False: [0, 0.0]}
    with ThreadPoolExecutor(concurrency) as pool:
        for _ in range(rounds):
            for constrained in (True, False):
                t = time.perf_counter()
                tokens = sum(pool.map(one, range(concurrency), [constrained] * concurrency))
                totals[constrained][0] += tokens
                totals[constrained][1] += time.perf_counter() - t
    c_rate = totals[True][0] / totals[True][1]
    f_rate = totals[False][0] / totals[False][1]
    emit(f"e2e_c{concurrency}", constrained_tok_per_s=round(c_rate, 1),
         free_tok_per_s=round(f_rate, 1), ratio=round(c_rate / f_rate, 3),
         constrained_tokens=totals[True][0], free_tokens=totals[False][0], rounds=rounds)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the built-in model)")
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--advance", type=int, default=12)
    p.add_argument("--threads", type=int, default=1, help="llguidance mask threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--http", default=None, help="HOST:PORT of a running server: the e2e case")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if args.http:
        e2e(args.http, args.concurrency, args.rounds)
        return 0
    torch.set_num_threads(1)

    from pagedserve.executor.grammar import (
        GrammarCompiler,
        apply_grammar_masks_,
        fill_grammar_masks,
    )
    from pagedserve.executor.sampler import Sampler
    from pagedserve.executor.sampling_state import SamplingState
    from pagedserve.protos.wire import SamplingParams
    from pagedserve.router.structured import build_grammar

    directory = model_dir(args.model)
    vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
    eos = eos_ids(directory)
    compiler = GrammarCompiler(directory / "tokenizer.json", vocab, num_threads=args.threads)
    t0 = time.perf_counter()
    compiler.matcher(build_grammar("regex", "a"), eos)  # builds the vocabulary index
    emit("vocab_index", vocab=vocab, build_s=round(time.perf_counter() - t0, 3),
         model=directory.name)
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    sampler = Sampler()
    rows = []
    for name in args.formats.split(","):
        kind, value = FORMATS[name]
        grammar = build_grammar(kind, value)
        for batch in (int(b) for b in args.batches.split(",")):
            matchers = advanced_matchers(compiler, grammar, eos, batch, args.advance, rng)
            logits = torch.randn(batch, vocab, generator=gen) * 3
            fill, apply = [], []
            x = torch.empty_like(logits)  # the sampler's work buffer, reused across steps
            for _ in range(args.reps):
                t = time.perf_counter()
                bits = fill_grammar_masks(matchers, [eos] * batch)
                fill.append(time.perf_counter() - t)
                t = time.perf_counter()
                apply_grammar_masks_(logits, list(range(batch)), bits, out=x)
                apply.append(time.perf_counter() - t)
            fill_us, apply_us = p50_us(fill), p50_us(apply)
            emit(f"mask_{name}_b{batch}", fill_us_p50=fill_us, apply_us_p50=apply_us,
                 per_row_us=round((fill_us + apply_us) / batch, 1), threads=args.threads)
            params = SamplingParams(temperature=0.0, grammar=grammar, eos_token_ids=tuple(eos))
            constrained = []
            for m in matchers:
                s = SamplingState(params, 0, np.zeros(0, np.int64))
                s.grammar = m
                constrained.append(s)
            plain = [SamplingState(SamplingParams(temperature=0.0), 0,
                                   np.zeros(0, np.int64)) for _ in range(batch)]
            times = {"c": [], "p": []}
            for _ in range(args.reps):  # alternated: the machine's drift hits both alike
                for key, states in (("c", constrained), ("p", plain)):
                    t = time.perf_counter()
                    sampler(logits, states)
                    times[key].append(time.perf_counter() - t)
            c_us, p_us = p50_us(times["c"]), p50_us(times["p"])
            emit(f"sampler_{name}_b{batch}", constrained_us_p50=c_us, plain_us_p50=p_us,
                 added_us=round(c_us - p_us, 1))
            rows.append((name, batch, fill_us, apply_us, c_us, p_us))
    print(f"{'format':<12} {'B':>4} {'fill us':>9} {'apply us':>9} {'sampler us':>11} "
          f"{'plain us':>9}", file=sys.stderr)
    for name, batch, fill_us, apply_us, c_us, p_us in rows:
        print(f"{name:<12} {batch:>4} {fill_us:>9.1f} {apply_us:>9.1f} {c_us:>11.1f} "
              f"{p_us:>9.1f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
