"""Structured output's drafts, source by source, and what following a format costs the
router: JSON lines on stdout, a summary on stderr.

Speculation under a format drafts two kinds of tokens (router/grammar_drafts.py): those
the format forces (keys, separators), and, where nothing is forced, the n-gram lookup's cut
where the format refuses one. The executor's counters cannot tell them apart, so this
benchmark replays real outputs through the router's own `Drafter`: it starts `pagedserve
serve` (the built-in model unless `--model DIR`; `--dtype float32`, where outputs are the
same with and without drafts, so the model's greedy output stands for the sampler's
verdict), asks for "Describe {city} as JSON." under spec_decode_bench's six-key schema for
`--cities` cities (greedy, 128 tokens), then walks each output as the scheduler would:
before each decode the drafter proposes, the drafts matching the output are confirmed,
the sample advances by those plus one. Per source: draft tokens and the share confirmed;
output tokens per drafted-or-not decode (`tokens_per_decode`, the step count's inverse).

Then the router's cost of following a format, in process on the model's tokenizer: a
grammar compiled as the router did before (`LLMatcher` plus its first fast-forward, on
the event loop), against `FormatDrafts.cursor` for a grammar compiled before (a copy of
the compiled matcher) and for a new one (the call that hands it to the worker thread); and
the executor's: a request's matcher for a grammar seen before (a copy) and a new one.

    .venv/bin/python benchmarks/grammar_drafts_bench.py [--model DIR] [--cities 16] [--k 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pagedserve.router.grammar_drafts import FormatDrafts  # noqa: E402
from pagedserve.router.speculative import Drafter, SpeculativeConfig  # noqa: E402
from pagedserve.router.structured import build_grammar  # noqa: E402
from pagedserve.router.types import RequestSpec  # noqa: E402
from spec_decode_bench import CITY_SCHEMA, FORMATS, Server  # noqa: E402

from pagedserve.grammar_vocab import GrammarVocab  # noqa: E402

BENCH = "grammar_drafts_bench"
CITIES = ("Paris", "Tokyo", "Cairo", "Lima", "Berlin", "Madrid", "Rome", "Oslo", "Lagos",
          "Delhi", "Quito", "Seoul", "Hanoi", "Dublin", "Vienna", "Nairobi")


def emit(case: str, **figures) -> None:
    print(json.dumps({"bench": BENCH, "case": case, **figures}), flush=True)


class _Sample:
    """What the drafter reads of a sample (router/sequence.py's fields)."""

    def __init__(self, seq_id: str, prompt: list[int]) -> None:
        self.seq_id, self.token_ids, self.num_pending = seq_id, list(prompt), 0
        self.num_prompt_tokens = len(prompt)
        self.group = SimpleNamespace(spec=RequestSpec(seq_id, tuple(prompt)))


def replay(drafter: Drafter, grammar: str, seq_id: str, prompt: list[int],
           output: list[int]) -> dict:
    """Walk `output` decode by decode as the scheduler would with speculation on:
    {"forced": [drafted, confirmed], "lookup": [drafted, confirmed], "decodes": n}.
    A draft list is the format's forced tokens when it starts with them (the drafter
    drafts those alone), else the lookup's."""
    sample = _Sample(seq_id, prompt)
    counts = {"forced": [0, 0], "lookup": [0, 0], "decodes": 0}
    i = 0
    while i < len(output):
        drafts = drafter.decode(sample, len(output) - i, grammar)
        confirmed = 0
        while confirmed < len(drafts) and drafts[confirmed] == output[i + confirmed]:
            confirmed += 1
        if drafts:
            cursor = drafter._of(sample).cursor
            forced = cursor.forced() if cursor is not None else []
            kind = "forced" if forced and forced[:len(drafts)] == drafts else "lookup"
            counts[kind][0] += len(drafts)
            counts[kind][1] += confirmed
            drafter.confirmed(sample, len(drafts), confirmed)
        step = min(confirmed + 1, len(output) - i)
        sample.token_ids.extend(output[i:i + step])
        i += step
        counts["decodes"] += 1
    return counts


def _await_compiled(formats: FormatDrafts, grammar: str) -> None:
    cursor = formats.cursor(grammar)
    while cursor.pending:
        time.sleep(0.001)


def compile_costs(formats: FormatDrafts, grammar: str, repeats: int = 30) -> dict:
    """Medians in microseconds: the old on-loop compile (+ first fast-forward), a cursor of
    a grammar compiled before (+ its first fast-forward), a cursor of a new grammar."""
    import llguidance

    tok = formats.vocab.tokenizer(formats.eos_token_ids)
    old, cached, new = [], [], []
    for r in range(repeats):
        t0 = time.perf_counter()
        llguidance.LLMatcher(tok, grammar, log_level=0).compute_ff_tokens()
        old.append(time.perf_counter() - t0)
        _await_compiled(formats, grammar)
        t0 = time.perf_counter()
        formats.cursor(grammar).forced()
        cached.append(time.perf_counter() - t0)
        fresh = _variant(r)
        t0 = time.perf_counter()
        formats.cursor(fresh)
        new.append(time.perf_counter() - t0)
        _await_compiled(formats, fresh)
    return {"loop_compile_us": _us(old), "cached_cursor_us": _us(cached),
            "new_grammar_call_us": _us(new)}


def _us(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1e6, 1)


def _variant(r: int) -> str:
    """The schema's grammar with one bound changed: a text never compiled before."""
    props = {**CITY_SCHEMA["properties"],
             "landmarks": {"type": "array", "maxItems": 4 + r, "items": {"type": "string"}}}
    return build_grammar("json_schema", json.dumps({**CITY_SCHEMA, "properties": props}))


def executor_costs(model_dir: Path, vocab_size: int, eos: list[int], grammar: str,
                   repeats: int = 30) -> dict:
    """Medians in microseconds of the executor's `GrammarCompiler.matcher` (a request's
    matcher, built on the I/O thread as it arrives): a grammar text seen before (a copy of
    its compiled start) and a new one (compiled)."""
    from pagedserve.executor.grammar import GrammarCompiler

    compiler = GrammarCompiler(model_dir / "tokenizer.json", vocab_size, num_threads=1)
    compiler.matcher(grammar, eos)
    seen, new = [], []
    for r in range(repeats):
        t0 = time.perf_counter()
        compiler.matcher(grammar, eos)
        seen.append(time.perf_counter() - t0)
        fresh = _variant(100 + r)
        t0 = time.perf_counter()
        compiler.matcher(fresh, eos)
        new.append(time.perf_counter() - t0)
    return {"repeated_grammar_matcher_us": _us(seen), "new_grammar_matcher_us": _us(new)}


def tokenize_chat(server: Server, prompt: str) -> list[int]:
    body = json.dumps({"model": server.model,
                       "messages": [{"role": "user", "content": prompt}]}).encode()
    req = urllib.request.Request(f"http://{server.http}/tokenize", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--cities", type=int, default=len(CITIES))
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    server = Server(args.model, ["--dtype", "float32"])
    try:
        prompts = [f"Describe {city} as JSON." for city in CITIES[:args.cities]]
        runs = [(tokenize_chat(server, p), server.chat(p, args.max_tokens,
                                                       FORMATS["json"])[0]) for p in prompts]
    finally:
        server.stop()
    from pagedserve.models import resolve_model

    model_dir = resolve_model(args.model, progress=False)
    config = json.loads((model_dir / "config.json").read_text())
    eos = config.get("eos_token_id", [])
    eos = eos if isinstance(eos, list) else [eos]
    formats = FormatDrafts(GrammarVocab(model_dir / "tokenizer.json", config["vocab_size"]),
                           eos)
    while not formats.ready():
        time.sleep(0.01)
    grammar = build_grammar("json_schema", json.dumps(CITY_SCHEMA))
    _await_compiled(formats, grammar)
    drafter = Drafter(SpeculativeConfig(args.k, 3, 1), formats)
    total = {"forced": [0, 0], "lookup": [0, 0], "decodes": 0}
    num_out = 0
    for n, (prompt, output) in enumerate(runs):
        counts = replay(drafter, grammar, f"r{n}#0", prompt, output)
        for key in ("forced", "lookup"):
            total[key] = [a + b for a, b in zip(total[key], counts[key], strict=True)]
        total["decodes"] += counts["decodes"]
        num_out += len(output)
    for key in ("forced", "lookup"):
        drafted, confirmed = total[key]
        emit(f"drafts_{key}", draft_tokens=drafted, confirmed_tokens=confirmed,
             confirmed_ratio=round(confirmed / drafted, 3) if drafted else 0.0,
             draft_tokens_per_output_token=round(drafted / num_out, 3))
    emit("decodes", requests=len(runs), output_tokens=num_out, decodes=total["decodes"],
         tokens_per_decode=round(num_out / total["decodes"], 3))
    costs = compile_costs(formats, grammar)
    emit("router_costs", **costs)
    formats.close()
    executor = executor_costs(model_dir, config["vocab_size"], eos, grammar)
    emit("executor_costs", **executor)
    f, lk = total["forced"], total["lookup"]
    print(f"{len(runs)} requests, {num_out} output tokens in {total['decodes']} decodes; "
          f"forced drafts {f[1]}/{f[0]} confirmed, lookup drafts {lk[1]}/{lk[0]}; "
          f"compile on the loop {costs['loop_compile_us']} us, cached cursor "
          f"{costs['cached_cursor_us']} us, new grammar {costs['new_grammar_call_us']} us; "
          f"executor matcher {executor['repeated_grammar_matcher_us']} us for a grammar "
          f"seen before, {executor['new_grammar_matcher_us']} us for a new one",
          file=sys.stderr)


if __name__ == "__main__":
    main()
