"""Predicted Outputs (router/predicted_outputs.py): JSON lines on stdout, a table on stderr.

Two parts:

1. `replay` (no server): code edits replayed through the router's own `Drafter`
   decode by decode, the edited text standing for the model's greedy output (a draft is
   confirmed when it is the output's next token), tokenized with the built-in model's
   tokenizer. Three snippets of Python (`SNIPPETS`), each under five edits (`EDITS`):
   `identity` (the output is the prediction), `rename` (an identifier renamed throughout),
   `insert` (a comment line after every 8th line), `delete` (lines 10-14 gone) and
   `annotate` (every 5th line gets a trailing comment). The prompt holds the original
   code (as an edit request does) and the prediction is the original code. Modes: `none`
   (one token a decode), `lookup` (--speculative-config ngram, `--k` drafts, lookup 1..3,
   no prediction), `prediction` (no --speculative-config) and `both` (the two: a predicted
   sample falls back on the lookup either way, so `both` shows what the config changes).
   Per (edit, mode): decodes, output tokens a decode, drafts confirmed and rejected
   (positions computed for nothing). ~1 s.

2. `serve` (`--serve`, a few minutes): the built-in SmolLM2-135M-Instruct (float32, one
   CPU executor, no --speculative-config), greedy chat requests one at a time, each run
   without and with a prediction: the `edit` requests of spec_decode_bench (a rename,
   a docstring, ... of a short function) predicted by the function itself, the `echo`
   requests predicted by their paragraph, and the `open` ones predicted by the paragraph
   too (a prediction that has nothing to do with the output: the unfavourable case).
   Per workload: output tokens per second without and with, the speedup, the prediction
   tokens accepted and rejected (usage), and whether every output is the same. Then the
   plain outputs are replayed as in part 1 (`serve_replay`: decodes and drafts rejected
   by mode, on the model's own outputs).

    .venv/bin/python benchmarks/predicted_outputs_bench.py [--serve] [--model default]
        [--k 4] [--max-tokens 160]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pagedserve.router.speculative import Drafter, SpeculativeConfig  # noqa: E402
from pagedserve.router.types import RequestSpec, SamplingSpec  # noqa: E402
from spec_decode_bench import CODE, PARAGRAPH, WORKLOADS, Server  # noqa: E402

BENCH = "predicted_outputs_bench"

SNIPPETS = {
    "blocks": '''class BlockPool:
    """Fixed-size blocks of the KV cache, handed out and taken back."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    def allocate(self) -> int:
        if not self.free:
            raise MemoryError("no free block")
        block = self.free.pop()
        self.ref_counts[block] = 1
        return block

    def share(self, block: int) -> int:
        self.ref_counts[block] += 1
        return block

    def release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free.append(block)

    def num_free(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size
''',
    "parser": '''def parse_config(text: str) -> dict:
    """Parse `key = value` lines; `#` starts a comment; values are ints when they can be."""
    config = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if "=" not in line:
            raise ValueError(f"line {number}: expected key = value")
        key, value = (part.strip() for part in line.split("=", 1))
        if not key.isidentifier():
            raise ValueError(f"line {number}: bad key {key!r}")
        if key in config:
            raise ValueError(f"line {number}: {key} set twice")
        try:
            config[key] = int(value)
        except ValueError:
            config[key] = value
    return config


def merge_configs(base: dict, override: dict) -> dict:
    merged = dict(base)
    for key, value in override.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    return merged
''',
    "stats": '''import math


def summarize(samples: list[float]) -> dict:
    """Count, mean, standard deviation and percentiles of the samples."""
    if not samples:
        return {"count": 0}
    ordered = sorted(samples)
    count = len(ordered)
    mean = sum(ordered) / count
    variance = sum((x - mean) ** 2 for x in ordered) / count
    return {
        "count": count,
        "mean": mean,
        "std": math.sqrt(variance),
        "p50": percentile(ordered, 50),
        "p90": percentile(ordered, 90),
        "p99": percentile(ordered, 99),
        "max": ordered[-1],
    }


def percentile(ordered: list[float], q: float) -> float:
    """The q-th percentile of sorted samples, interpolating between neighbours."""
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
''',
}
RENAMES = {"blocks": ("block", "page"), "parser": ("config", "settings"),
           "stats": ("ordered", "values")}


def _lines(text: str, edit) -> str:
    return "\n".join(edit(text.split("\n")))


EDITS = {
    "identity": lambda name, text: text,
    "rename": lambda name, text: text.replace(*RENAMES[name]),
    "insert": lambda name, text: _lines(text, lambda ls: [
        x for i, line in enumerate(ls) for x in (
            [line, "    # reviewed"] if i % 8 == 7 else [line])]),
    "delete": lambda name, text: _lines(text, lambda ls: ls[:9] + ls[14:]),
    "annotate": lambda name, text: _lines(text, lambda ls: [
        line + "  # noted" if i % 5 == 4 and line.strip() else line
        for i, line in enumerate(ls)]),
}


def emit(case: str, **figures) -> None:
    print(json.dumps({"bench": BENCH, "case": case, **figures}), flush=True)


class _Sample:
    """What the drafter reads of a sample (router/sequence.py's fields)."""

    def __init__(self, seq_id: str, prompt: list[int], prediction: list[int]) -> None:
        self.seq_id, self.token_ids, self.num_pending = seq_id, list(prompt), 0
        self.num_prompt_tokens = len(prompt)
        self.group = SimpleNamespace(spec=RequestSpec(
            seq_id, tuple(prompt), SamplingSpec(prediction=tuple(prediction))))


def replay(drafter: Drafter, seq_id: str, prompt: list[int], prediction: list[int],
           output: list[int]) -> dict:
    """Walk `output` as the scheduler would: its first token from the prompt's step,
    then decode after decode, each with the drafter's drafts (limited to what is left)."""
    sample = _Sample(seq_id, prompt, prediction)
    sample.token_ids.append(output[0])
    counts = {"decodes": 0, "drafted": 0, "confirmed": 0}
    i = 1
    while i < len(output):
        drafts = drafter.decode(sample, len(output) - i - 1)
        confirmed = 0
        while confirmed < len(drafts) and drafts[confirmed] == output[i + confirmed]:
            confirmed += 1
        if drafts:
            drafter.confirmed(sample, len(drafts), confirmed)
            counts["drafted"] += len(drafts)
            counts["confirmed"] += confirmed
        step = confirmed + 1
        sample.token_ids.extend(output[i:i + step])
        i += step
        counts["decodes"] += 1
    drafter.forget(seq_id)
    return counts


def replay_modes(runs: list[tuple[list[int], list[int], list[int]]], k: int) -> dict:
    """(prompt, prediction, output) runs replayed under each mode: {mode: figures}."""
    lookup = SpeculativeConfig(k, 3, 1)
    modes = {"none": None, "lookup": lookup, "prediction": None, "both": lookup}
    figures = {}
    for mode, config in modes.items():
        total = {"decodes": 0, "drafted": 0, "confirmed": 0, "tokens": 0}
        for n, (prompt, pred, output) in enumerate(runs):
            if mode == "none":
                counts = {"decodes": len(output) - 1, "drafted": 0, "confirmed": 0}
            else:
                counts = replay(Drafter(config), f"r{n}#0", prompt,
                                pred if mode in ("prediction", "both") else [], output)
            for key, value in counts.items():
                total[key] += value
            total["tokens"] += len(output)
        figures[mode] = dict(mode=mode, output_tokens=total["tokens"], decodes=total["decodes"],
                             tokens_per_decode=round((total["tokens"] - len(runs))
                                                     / total["decodes"], 2),
                             drafts_confirmed=total["confirmed"],
                             drafts_rejected=total["drafted"] - total["confirmed"])
    return figures


def run_replay(encode, k: int) -> list[dict]:
    rows = []
    for edit, change in EDITS.items():
        runs = [(encode(f"Apply the change to this code:\n\n{code}\n"), encode(code),
                 encode(change(name, code))) for name, code in SNIPPETS.items()]
        for figures in replay_modes(runs, k).values():
            row = dict(edit=edit, **figures)
            emit("replay", **row)
            rows.append(row)
    return rows


def post(server: Server, body: dict) -> tuple[dict, float]:
    data = json.dumps({"model": server.model, **body}).encode()
    req = urllib.request.Request(f"http://{server.http}/v1/chat/completions", data=data,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    return out, time.perf_counter() - t0


def run_serve(model: str, max_tokens: int, encode, k: int) -> list[dict]:
    cases = {"edit": CODE, "echo": PARAGRAPH, "open": PARAGRAPH}
    server = Server(model, ["--dtype", "float32"])
    rows = []
    outputs: dict[str, list] = {w: [] for w in cases}
    try:
        post(server, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8})
        for workload, prediction in cases.items():
            tokens = {"plain": 0, "predicted": 0}
            seconds = {"plain": 0.0, "predicted": 0.0}
            accepted = rejected = 0
            same = True
            for prompt in WORKLOADS[workload]:
                body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0,
                        "max_tokens": max_tokens, "return_token_ids": True}
                plain, t_plain = post(server, body)
                outputs[workload].append((plain["prompt_token_ids"], encode(prediction),
                                          plain["choices"][0]["token_ids"]))
                predicted, t_pred = post(server, {**body, "prediction": {
                    "type": "content", "content": prediction}})
                same &= plain["choices"][0]["message"]["content"] == \
                    predicted["choices"][0]["message"]["content"]
                tokens["plain"] += plain["usage"]["completion_tokens"]
                tokens["predicted"] += predicted["usage"]["completion_tokens"]
                seconds["plain"] += t_plain
                seconds["predicted"] += t_pred
                details = predicted["usage"]["completion_tokens_details"]
                accepted += details["accepted_prediction_tokens"]
                rejected += details["rejected_prediction_tokens"]
            plain_rate = tokens["plain"] / seconds["plain"]
            pred_rate = tokens["predicted"] / seconds["predicted"]
            row = dict(workload=workload, requests=len(WORKLOADS[workload]),
                       output_tokens=tokens["plain"],
                       plain_tok_per_s=round(plain_rate, 1),
                       predicted_tok_per_s=round(pred_rate, 1),
                       speedup_ratio=round(pred_rate / plain_rate, 2),
                       accepted_prediction_tokens=accepted,
                       rejected_prediction_tokens=rejected, same_outputs=same)
            emit("serve", **row)
            rows.append(row)
    finally:
        server.stop()
    for workload, runs in outputs.items():
        for figures in replay_modes(runs, k).values():
            emit("serve_replay", workload=workload, **figures)
            print(f"{workload:6} replayed {figures['mode']:11} decodes {figures['decodes']:5} "
                  f"tok/dec {figures['tokens_per_decode']:5} rejected "
                  f"{figures['drafts_rejected']}", file=sys.stderr)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--serve", action="store_true", help="also the end-to-end part")
    args = ap.parse_args()
    from tokenizers import Tokenizer

    from pagedserve.models import resolve_model

    tok = Tokenizer.from_file(str(resolve_model(args.model, progress=False)
                                  / "tokenizer.json"))

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    rows = run_replay(encode, args.k)
    print(f"{'edit':10} {'mode':11} {'tokens':>6} {'decodes':>7} {'tok/dec':>7} "
          f"{'confirmed':>9} {'rejected':>8}", file=sys.stderr)
    for r in rows:
        print(f"{r['edit']:10} {r['mode']:11} {r['output_tokens']:6} {r['decodes']:7} "
              f"{r['tokens_per_decode']:7} {r['drafts_confirmed']:9} "
              f"{r['drafts_rejected']:8}", file=sys.stderr)
    if args.serve:
        for r in run_serve(args.model, args.max_tokens, encode, args.k):
            print(f"{r['workload']:6} plain {r['plain_tok_per_s']:6} tok/s  predicted "
                  f"{r['predicted_tok_per_s']:6} tok/s  x{r['speedup_ratio']}  accepted "
                  f"{r['accepted_prediction_tokens']} rejected "
                  f"{r['rejected_prediction_tokens']} same {r['same_outputs']}",
                  file=sys.stderr)


if __name__ == "__main__":
    main()
