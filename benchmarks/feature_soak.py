"""Feature soak: every request kind at once against a real cluster (router + CPU executors on
the tiny random model), with every ending, then check that nothing is lost or leaked.

soak.py runs the router against fake executors for a long time (memory, accounting); this one
runs the executors' own per-request state — grammar matchers, prompt scoring, logit bias,
forks — for a few minutes, through aborts, client cancels and deadlines:

* kinds, drawn uniformly: plain, a JSON schema, a regex, a choice, logit_bias (5 random
  entries in [-100, 100]), prompt_logprobs (k 0-3), allowed_token_ids (20 random ids),
  bad_words (the text of 3 random tokens) (the last two added 2026-11-28) and beam search
  (n 2-4, length_penalty 0/1/2, each early_stopping; added 2026-11-28, twenty-third
  session); n = 2 for 30% of the others; greedy or sampled; prompts of 5-120 random token
  ids, max_tokens 4-48;
* endings, in turn: run to the end (then checked: a constrained sample that stopped parses /
  matches, prompt scores have one entry per prompt token but the first, every token of an
  allowed_token_ids sample allowed, no bad word's tokens whole in a sample's output, n
  distinct beams each ended by EOS or max_tokens), client
  cancel after
  2 chunks, a deadline of 10-300 ms, the Abort RPC after 2 chunks.

At the end: every device block free on every executor, `pagedserve_kv_blocks_leaked` 0, no
traceback or ERROR line in any log, no failed check. JSON lines (DESIGN §8): one `summary`
with the counts; exit 1 when a check fails.

    .venv/bin/python benchmarks/feature_soak.py [--duration 90] [--executors 2] [--clients 8]
        [--num-gpu-blocks 96] [--api-workers 0] [--router-args "..."] [--kill-at S]
        [--weight-updates S] [--prefill-executors N]

(the options http_soak.py takes too: soak_report.py).
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))  # soak_report, also under PYTHONSAFEPATH

import grpc  # noqa: E402
from cluster_harness import Cluster, request  # noqa: E402
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb  # noqa: E402
from soak_report import (  # noqa: E402
    CHOICES,
    REGEX,
    SCHEMA,
    Tally,
    constrained_error,
    run_soak,
    soak_arguments,
)

KINDS = ("plain", "json", "regex", "choice", "bias", "prompt_logprobs", "allowed",
         "bad_words", "beam")
ENDINGS = ("run", "cancel", "deadline", "abort")


class Load(Tally):
    def __init__(self, cluster: Cluster, model_dir: Path) -> None:
        super().__init__()
        self.cluster = cluster
        from pagedserve.router.tokenizer import Tokenizer

        self.tokenizer = Tokenizer.from_dir(model_dir)

    shared_prefixes: list[list[int]] = []  # `--shared-prefixes`: prompts start with one

    def make(self, rng: random.Random) -> tuple[str, pb.GenerateRequest]:
        ids = [rng.randrange(3, 500) for _ in range(rng.randrange(5, 121))]
        if self.shared_prefixes:
            ids = rng.choice(self.shared_prefixes) + ids
        req = request(token_ids=ids, max_tokens=rng.randrange(4, 49),
                      temperature=rng.choice([0.0, 1.0]), seed=rng.randrange(1000))
        if rng.random() < 0.3:
            req.params.n = 2
        kind = rng.choice(KINDS)
        so = req.params.structured_output
        if kind == "json":
            so.json_schema = json.dumps(SCHEMA)
        elif kind == "regex":
            so.regex = REGEX
        elif kind == "choice":
            so.choice.choices.extend(CHOICES)
        elif kind == "bias":
            req.params.logit_bias.update({rng.randrange(500): rng.uniform(-100, 100)
                                          for _ in range(5)})
        elif kind == "prompt_logprobs":
            req.params.prompt_logprobs = rng.randrange(0, 4)
        elif kind == "allowed":
            req.params.allowed_token_ids.extend(rng.sample(range(3, 500), 20))
        elif kind == "bad_words":
            words = (self.tokenizer.decode([rng.randrange(3, 500)]) for _ in range(3))
            req.params.bad_words.extend(w for w in words if w.strip())
        elif kind == "beam":
            req.params.n = rng.choice([2, 3, 4])
            req.params.beam_search.length_penalty = rng.choice([0.0, 1.0, 2.0])
            req.params.beam_search.early_stopping = rng.choice(
                [pb.EARLY_STOPPING_HEURISTIC, pb.EARLY_STOPPING_WHEN_FULL,
                 pb.EARLY_STOPPING_NEVER])
        return kind, req

    def check(self, kind: str, req: pb.GenerateRequest, resp: pb.GenerateResponse) -> None:
        for c in resp.completions:
            if c.finish_reason != pb.STOP:
                continue
            error = constrained_error(kind, c.text)
            if error:
                self.fail(error)
        if kind == "allowed":
            allowed = set(req.params.allowed_token_ids)
            for c in resp.completions:
                if not set(c.token_ids) <= allowed:
                    self.fail(f"allowed: tokens {sorted(set(c.token_ids) - allowed)} not "
                              f"allowed")
        if kind == "bad_words":
            from pagedserve.router.validation import bad_words_token_ids

            for word in bad_words_token_ids(req.params.bad_words, self.tokenizer):
                for c in resp.completions:
                    out = list(c.token_ids)
                    if any(out[j:j + len(word)] == list(word)
                           for j in range(len(out) - len(word) + 1)):
                        self.fail(f"bad_words: {word} in the output {out}")
        if kind == "beam":  # n distinct beams, each ended by EOS or max_tokens
            beams = [tuple(c.token_ids) for c in resp.completions]
            if len(set(beams)) != req.params.n or any(
                    not (c.finish_reason == pb.STOP or len(c.token_ids)
                         == req.params.max_tokens) for c in resp.completions):
                self.fail(f"beam: {len(set(beams))} distinct of {req.params.n}, endings "
                          f"{[(c.finish_reason, len(c.token_ids)) for c in resp.completions]}")
        if kind == "prompt_logprobs" and (
                len(resp.prompt_logprobs) != len(req.prompt_token_ids.ids) - 1):
            self.fail(f"prompt_logprobs: {len(resp.prompt_logprobs)} scores for "
                      f"{len(req.prompt_token_ids.ids)} prompt tokens")

    def client(self, cid: int, until: float) -> None:
        rng = random.Random(cid)
        stub = self.cluster.stub
        turn = cid
        while time.monotonic() < until:
            kind, req = self.make(rng)
            ending = ENDINGS[turn % len(ENDINGS)]
            turn += 1
            req.request_id = f"c{cid}-{turn}"
            try:
                if ending == "run":
                    self.check(kind, req, stub.Generate(req, timeout=120))
                elif ending == "deadline":
                    stub.Generate(req, timeout=rng.uniform(0.01, 0.3))
                else:
                    stream = stub.Stream(req, timeout=120)
                    for i, _ in enumerate(stream):
                        if i == 2:
                            if ending == "cancel":
                                stream.cancel()
                            else:
                                stub.Abort(pb.AbortRequest(request_id=req.request_id),
                                           timeout=10)
                            break
                self.count(f"{kind}/{ending}/ok")
            except grpc.RpcError as exc:
                code = exc.code()
                expected = ({grpc.StatusCode.DEADLINE_EXCEEDED} if ending == "deadline" else
                            {grpc.StatusCode.CANCELLED} if ending == "cancel" else
                            {grpc.StatusCode.NOT_FOUND} if ending == "abort" else set())
                if code not in expected:
                    self.fail(f"{kind}/{ending}: {code.name}: {exc.details()}")
                self.count(f"{kind}/{ending}/{code.name}")
            except Exception as exc:  # noqa: BLE001 - a failed check, reported
                self.fail(f"{kind}/{ending}: {type(exc).__name__}: {exc}")


def main(argv: list[str] | None = None) -> int:
    ap = soak_arguments(__doc__)
    ap.add_argument("--shared-prefixes", type=int, default=0,
                    help="prompts start with one of this many fixed 64-token prefixes (0: "
                    "none; with --router-args=\"--kv-pull auto\" requests pull them)")
    args = ap.parse_args(argv)
    rng = random.Random(1234)
    Load.shared_prefixes = [[rng.randrange(3, 500) for _ in range(64)]
                            for _ in range(args.shared_prefixes)]
    return run_soak("feature_soak", args, Load)


if __name__ == "__main__":
    sys.exit(main())
