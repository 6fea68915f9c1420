"""A generated token's text work, in one process: `IncrementalDetokenizer.push` and
`TextAssembler.append` (detokenizing, stop strings, what the router's text stage and an API
worker run for every token of a text request) on a real tokenizer.

Text: fixed, made here from a seeded generator (the same every run and every commit): ~3,000
words of English, code and numbers with punctuation and newlines, one in ten words accented,
CJK or emoji, encoded without special tokens, then pushed token by token after a 6-token
prompt context. Cases:
  push            IncrementalDetokenizer.push
  append          TextAssembler.append, no stop strings
  append_stops2   TextAssembler.append with two stop strings that never match (the search
                  and the held-back suffix run every token)
Each case runs `--reps` times over the text; prints µs a token (median and every run) and
a CRC of the text produced (equal across code versions means the same chunks).

Tokenizer: `--model-dir`, else the built-in model's (SmolLM2-135M-Instruct, byte-level BPE)
when `pagedserve demo` has converted it, else the tiny byte-level tokenizer the tests build.

Usage: .venv/bin/python benchmarks/detok_bench.py [--model-dir DIR] [--reps 9]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

from pagedserve.router.detokenizer import IncrementalDetokenizer, TextAssembler
from pagedserve.router.tokenizer import Tokenizer
from pagedserve.router.types import SamplingSpec

BENCH = "detok_bench"
_WORDS = ("the", "model", "serves", "a", "request", "with", "its", "cached", "prefix", "and",
          "streams", "tokens", "to", "client", "def", "return", "x", "=", "(", ")", "{",
          "}", "1,024", "3.14", "if", "not", "None:", "of", "in", "router", "executor")
_OTHER = ("héllo", "wörld", "naïve", "café", "你好", "世界", "日本語", "🙂", "🚀", "Ünïcödé")


def bench_text(num_words: int = 3000) -> str:
    """The benchmark's fixed text (see the module docstring)."""
    rng = random.Random(20261127)
    words = []
    for _ in range(num_words):
        words.append(rng.choice(_OTHER) if rng.random() < 0.1 else rng.choice(_WORDS))
        if rng.random() < 0.08:
            words[-1] += rng.choice((".", ",", ":", "\n", "\n\n"))
    return " ".join(words)
CONTEXT = 6


def _tokenizer(model_dir: str | None) -> tuple[Tokenizer, str]:
    if model_dir:
        return Tokenizer.from_dir(model_dir), model_dir
    from pagedserve.models import builtin_model_dir

    builtin = builtin_model_dir()
    if (builtin / "tokenizer.json").is_file():
        return Tokenizer.from_dir(builtin), builtin.name
    from pagedserve.tinymodels import build_tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="detok-bench-"))
    build_tokenizer(tmp)
    return Tokenizer.from_dir(tmp), "tiny"


def _cases(tok: Tokenizer, context: list[int]):
    def push():
        detok = IncrementalDetokenizer(tok, context)
        return lambda t: detok.push(t)

    def append(stops: tuple[str, ...]):
        def make():
            asm = TextAssembler(tok, SamplingSpec(max_tokens=10**9, stop=stops,
                                                  ignore_eos=True),
                                context, max_model_len=10**9)
            return lambda t: asm.append(t).text
        return make

    return {"push": push, "append": append(()),
            "append_stops2": append(("<<never>>", "zzqq"))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir")
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args(argv)
    tok, name = _tokenizer(args.model_dir)
    text = bench_text()
    ids = tok.encode(text, add_special_tokens=False)
    context, ids = ids[:CONTEXT], ids[CONTEXT:]
    for case, make in _cases(tok, context).items():
        runs, crc = [], 0
        for _ in range(args.reps):
            step = make()
            t0 = time.perf_counter()
            out = [step(t) for t in ids]
            runs.append((time.perf_counter() - t0) / len(ids) * 1e6)
            crc = zlib.crc32("".join(out).encode())
        r = {"bench": BENCH, "case": case, "tokenizer": name, "tokens": len(ids),
             "concatenating_decoder": getattr(tok, "decodes_by_concatenation", False),
             "us_per_token_p50": round(statistics.median(runs), 3),
             "us_per_token_runs": [round(x, 3) for x in runs], "text_crc32": f"{crc:08x}"}
        print(json.dumps(r), flush=True)
        print(f"{case:<14} {r['us_per_token_p50']} us a token ({name}, {len(ids)} tokens, "
              f"crc {r['text_crc32']})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
