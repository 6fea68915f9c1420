"""`pagedserve run-batch` against transformers `generate` on the same batch of chat requests.

Workload (fixed before the first run): the built-in SmolLM2-135M-Instruct; 4 tenants, each
with its own system prompt of ~250 tokens (seeded sentences), 16 questions each (64 chat
requests, ~15-token questions); greedy, 32 output tokens each (EOS ignored on both sides,
so both produce the same number of tokens). The model's dtype as pagedserve's `auto` picks
it on this CPU, on both sides; one torch thread on both sides (`--executors 1
--cpu-threads 1`; HF `torch.set_num_threads(1)`).

- run_batch: `pagedserve run-batch -i FILE -o OUT` as a user runs it: `wall_s` is the whole
  command (the cluster's start and stop included), `batch_s` the batch alone (its summary
  line); greedy answers are checked against HF's where both sides' first tokens agree.
- hf_generate_b16: the same chat texts (the model's chat template, `add_generation_prompt`)
  through `model.generate` in padded batches of 16 in file order (left padding), 32 new
  tokens each (no EOS id: not masked, never an end, as `ignore_eos`).
- summary: output tokens/s of each and their ratio (batch alone and whole command); how
  many answers agree on their first 8 words with HF's batched answers and with HF run one
  prompt at a time (the first 8 requests; the reference the project's equivalence tests
  use), and HF's batched answers with HF's own one-at-a-time ones.

    .venv/bin/python benchmarks/run_batch_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BENCH = "run_batch_bench"
TENANTS, QUESTIONS, OUTPUT_TOKENS, HF_BATCH = 4, 16, 32, 16
ALONE_CHECKS = 8  # requests HF also answers one at a time (the equivalence reference)
WORDS_TEXT = ("customer account order refund policy shipping invoice support agent reply "
         "politely always never confirm identity before sharing details escalate issues "
         "within hours business days warranty product return label tracking number "
         "priority premium members discount code expire monthly annual plan")
WORDS = WORDS_TEXT.split()
SUMMARY = re.compile(r"in ([\d.]+) s: .*?([\d,]+) prompt tokens(?: \((\d+)% from the "
                     r"prefix cache\))?, ([\d,]+) output tokens")


def emit(case: str, **figures) -> None:
    print(json.dumps({"bench": BENCH, "case": case, **figures}), flush=True)


def workload(tenants: int, questions: int) -> list[list[dict]]:
    rng = np.random.default_rng(0)
    out = []
    for t in range(tenants):
        system = f"You are the assistant of tenant {t}. " + " ".join(
            " ".join(rng.choice(WORDS, size=12)) + "." for _ in range(18))
        for q in range(questions):
            question = f"Question {q}: " + " ".join(rng.choice(WORDS, size=10)) + "?"
            out.append([{"role": "system", "content": system},
                        {"role": "user", "content": question}])
    return out


def run_pagedserve(model: str, chats: list[list[dict]], work: Path) -> tuple[dict, list[str]]:
    infile, outfile = work / "in.jsonl", work / "out.jsonl"
    with infile.open("w") as f:
        for i, messages in enumerate(chats):
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST",
                                "url": "/v1/chat/completions",
                                "body": {"messages": messages, "max_tokens": OUTPUT_TOKENS,
                                         "temperature": 0, "ignore_eos": True}}) + "\n")
    cmd = [sys.executable, "-m", "pagedserve.cli", "run-batch", "-i", str(infile),
           "-o", str(outfile), "--model", model, "--executors", "1", "--cpu-threads", "1"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    start = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"run-batch failed ({result.returncode}):\n{result.stderr[-3000:]}")
    m = SUMMARY.search(result.stderr)
    rows = [json.loads(x) for x in outfile.read_text().splitlines()]
    texts = [r["response"]["body"]["choices"][0]["message"]["content"] for r in rows]
    output = int(m.group(4).replace(",", ""))
    figures = dict(wall_s=round(wall, 2), batch_s=float(m.group(1)), requests=len(rows),
                   prompt_tokens=int(m.group(2).replace(",", "")),
                   prefix_cache_pct=int(m.group(3) or 0), output_tokens=output,
                   output_tok_s_batch=round(output / float(m.group(1)), 1),
                   output_tok_s_wall=round(output / wall, 1))
    return figures, texts


def run_hf(model: str, chats: list[list[dict]]) -> tuple[dict, list[str]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from pagedserve.cpu_dtypes import auto_dtype, checkpoint_dtype
    torch.set_num_threads(1)
    config = json.loads((Path(model) / "config.json").read_text())
    dtype, _ = auto_dtype(checkpoint_dtype(config), on_cpu=True)
    tok = AutoTokenizer.from_pretrained(model)
    tok.padding_side = "left"
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    hf.generation_config.eos_token_id = None  # else merged back into `gen` below
    # EOS ignored as pagedserve's ignore_eos does: not masked (min_new_tokens would mask
    # it), just not an end: no EOS id at all, every row runs its 32 tokens
    gen = GenerationConfig(max_new_tokens=OUTPUT_TOKENS, do_sample=False, eos_token_id=None,
                           pad_token_id=tok.pad_token_id if tok.pad_token_id is not None
                           else tok.eos_token_id)
    texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
             for c in chats]
    answers: list[str] = []
    start = time.perf_counter()
    prompt_tokens = 0
    for i in range(0, len(texts), HF_BATCH):
        batch = tok(texts[i:i + HF_BATCH], return_tensors="pt", padding=True,
                    add_special_tokens=False)
        prompt_tokens += int(batch["attention_mask"].sum())
        with torch.inference_mode():
            out = hf.generate(**batch, generation_config=gen)
        new = out[:, batch["input_ids"].shape[1]:]
        assert new.shape[1] == OUTPUT_TOKENS
        answers += tok.batch_decode(new, skip_special_tokens=True)
    seconds = time.perf_counter() - start
    output = len(texts) * OUTPUT_TOKENS
    # The reference the project holds itself to: one prompt at a time (a padded batch's
    # own answers differ from it where the top two logits are close; see README).
    alone = []
    for text in texts[:ALONE_CHECKS]:
        one = tok(text, return_tensors="pt", add_special_tokens=False)
        with torch.inference_mode():
            out = hf.generate(**one, generation_config=gen)
        alone.append(tok.decode(out[0, one["input_ids"].shape[1]:], skip_special_tokens=True))
    return dict(seconds=round(seconds, 2), dtype=dtype, batch=HF_BATCH,
                prompt_tokens=prompt_tokens, output_tokens=output,
                output_tok_s=round(output / seconds, 1)), answers, alone


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="1 tenant, 4 questions (a smoke run)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from pagedserve.models import resolve_model
    model = str(resolve_model("default"))
    chats = workload(1, 4) if args.quick else workload(TENANTS, QUESTIONS)
    with tempfile.TemporaryDirectory() as work:
        ours, our_texts = run_pagedserve(model, chats, Path(work))
    emit("run_batch", **ours)
    hf, hf_texts, hf_alone = run_hf(model, chats)
    emit(f"hf_generate_b{HF_BATCH}", **hf)

    def same(ours_: list[str], theirs: list[str]) -> str:
        # answers agreeing word for word on their first 8 words (a near tie flips a token
        # and the rest of its answer)
        n = sum(a.split()[:8] == b.split()[:8] for a, b in zip(ours_, theirs, strict=False))
        return f"{n}/{len(theirs)}"
    emit("summary", ratio_batch=round(ours["output_tok_s_batch"] / hf["output_tok_s"], 2),
         ratio_wall=round(ours["output_tok_s_wall"] / hf["output_tok_s"], 2),
         same_first_8_words_as_hf_batched=same(our_texts, hf_texts),
         same_first_8_words_as_hf_alone=same(our_texts, hf_alone),
         hf_batched_same_as_hf_alone=same(hf_texts, hf_alone))
    return 0


if __name__ == "__main__":
    sys.exit(main())
