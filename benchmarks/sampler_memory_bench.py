"""Memory and time of sampling one step's rows, whole or in chunks (executor/sample_chunks.py):
JSON lines on stdout, a table on stderr.

A step with drafts (speculative decoding, predicted outputs) samples at each of a decode
row's 1 + d positions: 256 sequences drafting 4 tokens sample 1,280 rows, drafting 15 (a
prediction's rows) 4,096. Each case runs in a fresh process set up as a CPU executor (one
torch thread, glibc's allocator tuned as executor/host_malloc.py does): the vocabulary
projection of a real model's shape (random float32 weights), `--rows` rows of hidden
states, and the executor's sampling over them (`step_logits` then `launch_sampling`, read
back), whole (`chunk` = rows, as before chunks) or in chunks of `--chunk` rows (the
executor's --max-num-seqs, 256 by default). Two steps: the first's peak resident memory
above what the process held before it (`peak_mib`: logits and the sampler's work copies)
and what it still holds after it (`kept_mib`: a CPU sampler keeps its work buffers for the
next step, and the tuned allocator keeps freed heap up to 1 GiB); the second's time (`ms`).

Modes: `greedy` (plain argmax: no work copy), `sampled` (temperature 0.7, top-p 0.95: the
tempered copy), `costliest` (the memory profile's rows: logprobs, penalties, a bias, top-k,
top-p, min-p).

    .venv/bin/python benchmarks/sampler_memory_bench.py [--shape smollm2-135m]
        [--rows 256,1280,4096] [--modes greedy,sampled,costliest] [--chunk 256]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

BENCH = "sampler_memory_bench"
SHAPES = {"smollm2-135m": (576, 49152), "qwen2.5-0.5b": (896, 151936)}  # hidden, vocab


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def child(shape: str, rows: int, chunk: int, mode: str, as_executor: bool = True) -> dict:
    """One case in this process (a fresh one: its peak is the step's). ``as_executor``: one
    torch thread and the allocator tuned as a CPU executor's (process-wide: a test says
    False)."""
    import torch

    if as_executor:
        from pagedserve.executor.host_malloc import tune_host_malloc

        torch.set_num_threads(1)
        tune_host_malloc()
    from pagedserve.executor import sample_chunks
    from pagedserve.executor.sample_chunks import launch_sampling, step_logits
    from pagedserve.executor.sampler import Sampler
    from pagedserve.executor.sampling_state import SamplingState
    from pagedserve.protos.wire import SamplingParams

    hidden_size, vocab = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    # In place (no freed temporary the step could reuse unseen); logits of standard
    # deviation 4: a peaked distribution, as a trained model's.
    weight = torch.empty(vocab, hidden_size).normal_(0, 4 * hidden_size ** -0.5,
                                                      generator=gen)
    hidden = torch.empty(rows, hidden_size).normal_(generator=gen)
    index = torch.arange(rows)
    params = {"greedy": SamplingParams(temperature=0.0),
              "sampled": SamplingParams(temperature=0.7, top_p=0.95, seed=1),
              "costliest": sample_chunks._COSTLIEST}[mode]
    states = [SamplingState(params, i, prompt_token_ids=(2, 3)) for i in range(rows)]
    sampler = Sampler()

    def step():
        logits = step_logits(lambda h: torch.nn.functional.linear(h, weight), hidden, index,
                             chunk)
        return launch_sampling(sampler, logits, states).result()

    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here (Linux >= 4.0)
    first = step()
    peak = _status_kib("VmHWM") - before
    kept = _status_kib("VmRSS") - before
    t0 = time.perf_counter()
    second = step()
    ms = (time.perf_counter() - t0) * 1e3
    assert (first.token_ids == second.token_ids).all()
    return {"bench": BENCH, "case": f"{mode}_{rows}_by_{chunk}", "shape": shape,
            "mode": mode, "rows": rows, "chunk": chunk,
            "peak_mib": round(peak / 1024, 1), "kept_mib": round(kept / 1024, 1),
            "ms": round(ms, 1), "tokens_digest": int(first.token_ids.astype("int64").sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    ap.add_argument("--rows", default="256,1280,4096")
    ap.add_argument("--modes", default="greedy,sampled,costliest")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--child", nargs=4, metavar=("SHAPE", "ROWS", "CHUNK", "MODE"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        shape, rows, chunk, mode = args.child
        print(json.dumps(child(shape, int(rows), int(chunk), mode)), flush=True)
        return
    results = []
    for mode in args.modes.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            digests = set()
            for chunk in sorted({rows, min(rows, args.chunk)}, reverse=True):
                out = subprocess.run(
                    [sys.executable, __file__, "--child", args.shape, str(rows), str(chunk),
                     mode], check=True, capture_output=True, text=True).stdout
                result = json.loads(out.splitlines()[-1])
                digests.add(result["tokens_digest"])
                print(json.dumps(result), flush=True)
                results.append(result)
            if len(digests) != 1:
                raise SystemExit(f"{mode} at {rows} rows: chunks sampled other tokens")
    print(f"{'mode':>10} {'rows':>6} {'chunk':>6} {'peak MiB':>9} {'kept MiB':>9} "
          f"{'ms':>8}", file=sys.stderr)
    for r in results:
        print(f"{r['mode']:>10} {r['rows']:>6} {r['chunk']:>6} {r['peak_mib']:>9} "
              f"{r['kept_mib']:>9} {r['ms']:>8}", file=sys.stderr)


if __name__ == "__main__":
    main()
