"""Speculative decoding by n-gram lookup, end to end (DESIGN §8): JSON lines on stdout, a
table on stderr.

Starts `pagedserve serve` (the built-in SmolLM2-135M-Instruct unless `--model DIR`; one CPU
executor) twice, without and with `--speculative-config` (ngram, `--k` drafts, lookup 1..3
tokens by default), and sends the same chat requests to each over the OpenAI API: greedy,
`--max-tokens` 128, `--concurrency` requests at a time (each list of 4 requests repeated to
fill it). Workloads, each a different share of output that repeats its context:

* `echo`: "Repeat the following text exactly" with a paragraph (the output copies the
  prompt: the case prompt lookup is for);
* `edit`: "Rewrite this Python function, renaming ..." with a short function (partly copied);
* `open`: short stories and explanations (nothing to copy: the unfavourable case);
* `json` (added 2026-11-29, thirty-fourth session): a city described under a JSON schema
  (`response_format`, six required keys, no others): the drafts are mostly the tokens
  the format forces (keys, separators: router/grammar_drafts.py), not in the default
  list (`--workloads echo,edit,open,json`).

Per (workload, concurrency) and mode: output tokens per second of wall time
(`output_tok_per_s`), the mean time per output token of the requests (`tpot_ms`), and with
speculation the share of draft tokens the sampler confirmed (`acceptance_ratio`, from the
router's spec_decode counters) and drafts per output token. `speedup_ratio` = spec / plain
output rate. Outputs are compared: greedy tokens are the same with and without drafts
(`same_outputs`), up to rounding: in bfloat16 a near tie can go either way between a
decode step and a drafted row's computation, as between batch sizes (`--dtype float32`:
identical).

    .venv/bin/python benchmarks/spec_decode_bench.py [--model DIR] [--concurrency 1,4]
        [--workloads echo,edit,open,json] [--k 4] [--rounds 2] [--dtype auto]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request

BENCH = "spec_decode_bench"
READY = re.compile(r"pagedserve ready grpc=(\S+) metrics=(\S+) executors=(\d+) http=(\S+)")

PARAGRAPH = ("The paged KV cache stores the keys and values of every request in fixed-size "
             "blocks. A block table maps each request's positions to blocks, so memory is "
             "allocated as the sequence grows and freed as soon as it ends. Requests that share "
             "a prefix share its blocks, and a block is copied only when one of them writes "
             "into it.")
CODE = ("def total(x, prices):\n    result = 0\n    for item in x:\n        if item in prices:\n"
        "            result += prices[item] * x[item]\n    return result\n")
WORKLOADS = {
    "echo": [f"Repeat the following text exactly, word for word:\n\n{PARAGRAPH}",
             f"Copy this paragraph without changing anything:\n\n{PARAGRAPH}",
             f"Please repeat back to me:\n\n{PARAGRAPH}",
             f"Write this text again exactly as it is:\n\n{PARAGRAPH}"],
    "edit": [f"Rewrite this Python function, renaming the variable x to quantities:\n\n{CODE}",
             f"Add a docstring to this Python function and return the code:\n\n{CODE}",
             f"Rename the function total to order_total in this code:\n\n{CODE}",
             f"Rewrite this code with type hints:\n\n{CODE}"],
    "open": ["Write a short story about a lighthouse keeper.",
             "Explain why the sky is blue.",
             "What are three good habits for learning a language?",
             "Describe a walk through a forest in autumn."],
    "json": [f"Describe {city} as JSON." for city in ("Paris", "Tokyo", "Cairo", "Lima")],
}
CITY_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "country", "population", "founded", "is_capital", "landmarks"],
    "properties": {"name": {"type": "string"}, "country": {"type": "string"},
                   "population": {"type": "integer"}, "founded": {"type": "integer"},
                   "is_capital": {"type": "boolean"},
                   "landmarks": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}}
FORMATS = {"json": {"type": "json_schema",
                    "json_schema": {"name": "city", "schema": CITY_SCHEMA}}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def emit(case: str, **figures) -> None:
    print(json.dumps({"bench": BENCH, "case": case, **figures}), flush=True)


class Server:
    def __init__(self, model: str, extra: list[str]) -> None:
        cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--model", model,
               "--port", "0", "--http-port", "0", "--metrics-port", "0",
               "--executor-bind", f"tcp://127.0.0.1:{free_port()}", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("serve exited:\n" + "".join(self.lines[-30:]))
            self.lines.append(line)
            m = READY.search(line)
            if m:
                self.metrics, self.http = m.group(2), m.group(4)
                threading.Thread(target=self._drain, daemon=True).start()
                with urllib.request.urlopen(f"http://{self.http}/v1/models", timeout=30) as r:
                    self.model = json.loads(r.read())["data"][0]["id"]
                return
        raise RuntimeError("serve did not become ready")

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def counter(self, name: str) -> float:
        with urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=30) as r:
            text = r.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))

    def chat(self, prompt: str, max_tokens: int,
             response_format: dict | None = None) -> tuple[list[int], float]:
        body = {"model": self.model, "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": prompt}],
                "logprobs": True, "return_tokens_as_token_ids": True}
        if response_format is not None:
            body["response_format"] = response_format
        body = json.dumps(body).encode()
        req = urllib.request.Request(f"http://{self.http}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        elapsed = time.perf_counter() - t0
        tokens = [int(x["token"].removeprefix("token_id:"))
                  for x in out["choices"][0]["logprobs"]["content"]]
        return tokens, elapsed


def run_round(server: Server, prompts: list[str], concurrency: int, max_tokens: int,
              response_format: dict | None = None
              ) -> tuple[list[list[int]], float, list[float]]:
    """All `prompts`, `concurrency` at a time: (outputs, wall seconds, per-request TPOT)."""
    outputs: list = [None] * len(prompts)
    tpots: list[float] = []
    next_i = [0]
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                i = next_i[0]
                next_i[0] += 1
            if i >= len(prompts):
                return
            tokens, elapsed = server.chat(prompts[i], max_tokens, response_format)
            outputs[i] = tokens
            tpots.append(elapsed / max(1, len(tokens)))
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outputs, time.perf_counter() - t0, tpots


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--workloads", default="echo,edit,open")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--lookup-max", type=int, default=3)
    ap.add_argument("--lookup-min", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="the executors' --dtype (auto: bfloat16 "
                    "for the built-in model where the CPU has it natively, else float32)")
    args = ap.parse_args()
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": args.k,
                       "prompt_lookup_max": args.lookup_max,
                       "prompt_lookup_min": args.lookup_min})
    levels = [int(c) for c in args.concurrency.split(",")]
    names = args.workloads.split(",")
    results: dict = {}
    for mode, extra in (("plain", []), ("spec", ["--speculative-config", spec])):
        extra = [*extra, "--dtype", args.dtype]
        server = Server(args.model, extra)
        try:
            server.chat("Hello", 8)  # warm-up
            for name in names:
                for c in levels:
                    prompts = WORKLOADS[name] * max(1, c)
                    best = None
                    drafts0 = server.counter("pagedserve_spec_decode_num_draft_tokens_total")
                    acc0 = server.counter("pagedserve_spec_decode_num_accepted_tokens_total")
                    for _ in range(args.rounds):
                        outs, wall, tpots = run_round(server, prompts, c, args.max_tokens,
                                                      FORMATS.get(name))
                        rate = sum(map(len, outs)) / wall
                        if best is None or rate > best[1]:
                            best = (outs, rate, sum(tpots) / len(tpots))
                    drafts = server.counter("pagedserve_spec_decode_num_draft_tokens_total") \
                        - drafts0
                    accepted = server.counter(
                        "pagedserve_spec_decode_num_accepted_tokens_total") - acc0
                    n_out = sum(map(len, best[0])) * args.rounds
                    results[(name, c, mode)] = (best, drafts, accepted, n_out)
        finally:
            server.stop()
    print(f"{'workload':8} {'conc':>4} {'plain tok/s':>11} {'spec tok/s':>10} {'x':>5} "
          f"{'tpot ms':>13} {'accept':>6}", file=sys.stderr)
    for name in names:
        for c in levels:
            (p_outs, p_rate, p_tpot), *_ = results[(name, c, "plain")]
            (s_outs, s_rate, s_tpot), drafts, accepted, n_out = results[(name, c, "spec")]
            same = p_outs == s_outs
            figures = dict(
                concurrency=c, plain_output_tok_per_s=round(p_rate, 1),
                spec_output_tok_per_s=round(s_rate, 1), speedup_ratio=round(s_rate / p_rate, 3),
                plain_tpot_ms=round(p_tpot * 1e3, 1), spec_tpot_ms=round(s_tpot * 1e3, 1),
                acceptance_ratio=round(accepted / drafts, 3) if drafts else 0.0,
                draft_tokens_per_output_token=round(drafts / n_out, 3) if n_out else 0.0,
                same_outputs=same, output_tokens=sum(map(len, s_outs)))
            emit(f"{name}_c{c}", **figures)
            print(f"{name:8} {c:4} {p_rate:11.1f} {s_rate:10.1f} {s_rate / p_rate:5.2f} "
                  f"{p_tpot * 1e3:6.1f}/{s_tpot * 1e3:6.1f} {figures['acceptance_ratio']:6.2f}"
                  f"{'' if same else '  OUTPUTS DIFFER'}", file=sys.stderr)


if __name__ == "__main__":
    main()
