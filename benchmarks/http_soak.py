"""HTTP soak: the OpenAI API of a real cluster (router, optionally with API workers, and CPU
executors on the tiny random model) under every request kind and every way a client ends a
request, then check that nothing is lost or leaked.

feature_soak.py does this over gRPC; this one goes through the edge most clients use, one
fresh connection per request (so a client that goes away closes its socket, as a browser or
an SDK with a timeout does):

* endpoints, drawn uniformly: /v1/completions (a prompt of 5-120 random token ids) and
  /v1/chat/completions (a system and a user message of random words);
* kinds, drawn uniformly: plain, `response_format` json_schema, `structured_outputs.regex`,
  `guided_choice`, `logit_bias` (5 entries in [-100, 100]), logprobs (completions: `logprobs`
  2, with `echo` when unary; chat: `logprobs` + `top_logprobs` 2), beam search
  (`use_beam_search`, n 2-3, `length_penalty` 0/1/2, each `early_stopping`; added
  2026-11-28, twenty-third session), tools (chat: one function, `tool_choice` "required",
  named or "auto" with the hermes parser); n = 2 for 30% of the others; greedy or sampled;
  max_tokens 4-48;
* endings, in turn: a unary request read whole and checked; a stream read to `[DONE]` and
  checked (choices complete, the usage chunk of `stream_options.include_usage`); a stream
  the client drops after two events; a unary request the client gives up on after 10-300 ms.
  Checked: status 200, n choices with a finish reason, constrained choices that stopped
  parse / match, forced tool calls name the function with arguments of its schema, logprobs
  present where asked for, usage counts.

At the end: every device block free on every executor, `pagedserve_kv_blocks_leaked` 0, no
traceback or ERROR line in any process's whole log, no failed check. One JSON line (DESIGN
§8), `summary`, with the counts; exit 1 when a check fails.

    .venv/bin/python benchmarks/http_soak.py [--duration 90] [--executors 2] [--clients 8]
        [--api-workers 0] [--num-gpu-blocks 96] [--shared-prefixes K] [--kill-at S]
        [--responses N]

`--shared-prefixes K`: prompts start with one of K long prefixes (prefix-cache hits,
requests waiting for a prefix being computed); `--kill-at S`: SIGKILL the first executor S
seconds in (its requests move; the survivors are checked); `--responses N`: N more clients
run stored and background Responses (soak_responses.py: chains by previous_response_id,
polled, cancelled, resumed and deleted background responses; added 2026-11-29,
twenty-ninth session; 0 by default: the other clients' workload is unchanged).
"""

from __future__ import annotations

import http.client
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))  # soak_report, also under PYTHONSAFEPATH

from soak_report import (  # noqa: E402
    CHOICES,
    REGEX,
    SCHEMA,
    Tally,
    constrained_error,
    run_soak,
    soak_arguments,
)
from soak_responses import ENDINGS as RESPONSE_ENDINGS  # noqa: E402
from soak_responses import ResponsesClient  # noqa: E402

KINDS = ("plain", "json", "regex", "choice", "bias", "logprobs", "beam", "tools")  # (tools: chat)
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                   "required": ["city"], "additionalProperties": False}}}
TOOL_CHOICES = ("required", {"type": "function", "function": {"name": "get_weather"}}, "auto")
ENDINGS = ("unary", "stream", "drop", "timeout")
WORDS = ("paged", "cache", "block", "prefix", "token", "stream", "router", "kernel", "ünï", "🙂")


class HttpLoad(Tally):
    def __init__(self, address: str, model: str, shared_prefixes: int = 0,
                 clients: int = 0) -> None:
        super().__init__()
        host, port = address.rsplit(":", 1)
        self.host, self.port, self.model = host, int(port), model
        self.clients = clients  # the clients from this index on run Responses (--responses)
        self.responses = ResponsesClient(self, self.host, self.port, model)
        # Prompts that start with one of a few long prefixes: prefix-cache hits, requests
        # waiting for a prefix another one is computing, preempted and aborted sharers.
        rng = random.Random(7)
        self.prefixes = [[rng.randrange(3, 500) for _ in range(rng.randrange(40, 90))]
                         for _ in range(shared_prefixes)]
        self.system_prompts = [" ".join(rng.choice(WORDS) for _ in range(len(p) // 2))
                               for p in self.prefixes]

    def make(self, rng: random.Random) -> tuple[str, str, dict]:
        chat = rng.random() < 0.5
        body: dict = {"model": self.model, "max_tokens": rng.randrange(4, 49),
                      "temperature": rng.choice([0.0, 1.0]), "seed": rng.randrange(1000)}
        if chat:
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 40)))
            system = rng.choice(self.system_prompts) if self.prefixes else "Answer briefly."
            body["messages"] = [{"role": "system", "content": system},
                                {"role": "user", "content": words}]
        elif self.prefixes:
            body["prompt"] = rng.choice(self.prefixes) + [
                rng.randrange(3, 500) for _ in range(rng.randrange(1, 40))]
        else:
            body["prompt"] = [rng.randrange(3, 500) for _ in range(rng.randrange(5, 121))]
        if rng.random() < 0.3:
            body["n"] = 2
        kind = rng.choice(KINDS if chat else KINDS[:-1])
        if kind == "tools":
            body["tools"] = [TOOL]
            body["tool_choice"] = rng.choice(TOOL_CHOICES)
        elif kind == "json":
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "a", "schema": SCHEMA}}
        elif kind == "regex":
            body["structured_outputs"] = {"regex": REGEX}
        elif kind == "choice":
            body["guided_choice"] = CHOICES
        elif kind == "bias":
            body["logit_bias"] = {str(rng.randrange(500)): rng.uniform(-100, 100)
                                  for _ in range(5)}
        elif kind == "logprobs":
            body.update({"logprobs": True, "top_logprobs": 2} if chat else
                        {"logprobs": 2, "echo": True})
        elif kind == "beam":
            body.update(use_beam_search=True, n=rng.choice([2, 3]),
                        length_penalty=rng.choice([0.0, 1.0, 2.0]),
                        early_stopping=rng.choice([False, True, "never"]))
        path = "/v1/chat/completions" if chat else "/v1/completions"
        return kind, path, body

    def check(self, kind: str, path: str, body: dict, choices: list[dict],
              usage: dict | None) -> None:
        chat = path.endswith("chat/completions")
        n = body.get("n", 1)
        if sorted(c["index"] for c in choices) != list(range(n)):
            self.fail(f"{kind}{path}: choice indices {[c['index'] for c in choices]}, n={n}")
            return
        forced = kind == "tools" and body["tool_choice"] != "auto"
        for c in choices:
            text = (c["message"]["content"] or "") if chat else c["text"]
            if c.get("finish_reason") not in ("stop", "length", "tool_calls"):
                self.fail(f"{kind}{path}: finish_reason {c.get('finish_reason')!r}")
            if forced and c.get("finish_reason") != "length":
                calls = c["message"].get("tool_calls") or []
                if not calls or any(call["function"]["name"] != "get_weather"
                                    or set(json.loads(call["function"]["arguments"]))
                                    != {"city"} for call in calls):
                    self.fail(f"tools{path}: {c['message']!r}")
            if kind == "logprobs" and not c.get("logprobs"):
                self.fail(f"{kind}{path}: no logprobs")
            if c.get("finish_reason") != "stop":
                continue
            error = constrained_error(kind, text)
            if error:
                self.fail(f"{path}: {error}")
        if usage is None or usage["completion_tokens"] <= 0 or usage["prompt_tokens"] <= 0:
            self.fail(f"{kind}{path}: usage {usage!r}")

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def unary(self, kind: str, path: str, body: dict, timeout: float) -> None:
        conn = self._connect(timeout)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = json.loads(resp.read())
        finally:
            conn.close()
        if resp.status != 200:
            self.fail(f"{kind}{path}: HTTP {resp.status}: {data}")
            return
        self.check(kind, path, body, data["choices"], data.get("usage"))

    def stream(self, kind: str, path: str, body: dict, drop_after: int | None) -> None:
        chat = path.endswith("chat/completions")
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        body.pop("echo", None)  # echo with logprobs is unary only (a clear 400 in a stream)
        conn = self._connect(120)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                self.fail(f"{kind}{path} stream: HTTP {resp.status}: {resp.read()[:300]!r}")
                return
            choices: dict[int, dict] = {}
            usage, events, done = None, 0, False
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                events += 1
                if drop_after is not None and events > drop_after:
                    return  # the connection closes in `finally`: the client is gone
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self.fail(f"{kind}{path} stream: error event {chunk['error']}")
                    return
                usage = chunk.get("usage") or usage
                for c in chunk["choices"]:
                    acc = choices.setdefault(c["index"], {"index": c["index"], "text": "",
                                                          "logprobs": None, "calls": {}})
                    piece = (c["delta"].get("content") or "") if chat else c["text"]
                    acc["text"] += piece
                    for call in (c["delta"].get("tool_calls") or []) if chat else ():
                        whole = acc["calls"].setdefault(call["index"], {
                            "function": {"name": "", "arguments": ""}})
                        fn = call.get("function") or {}
                        whole["function"]["name"] += fn.get("name") or ""
                        whole["function"]["arguments"] += fn.get("arguments") or ""
                    acc["logprobs"] = acc["logprobs"] or c.get("logprobs")
                    if c.get("finish_reason"):
                        acc["finish_reason"] = c["finish_reason"]
        finally:
            conn.close()
        if drop_after is not None:
            return
        if not done:
            self.fail(f"{kind}{path} stream: ended without [DONE]")
            return
        for acc in choices.values():
            by_index = acc.pop("calls")
            calls = [by_index[i] for i in sorted(by_index)]
            if chat:
                acc["message"] = {"content": acc.pop("text"), "tool_calls": calls}
        self.check(kind, path, body, list(choices.values()), usage)

    def client(self, cid: int, until: float) -> None:
        rng = random.Random(cid)
        turn = cid
        if cid >= self.clients:
            return self.responses_client(rng, turn, until)
        while time.monotonic() < until:
            kind, path, body = self.make(rng)
            ending = ENDINGS[turn % len(ENDINGS)]
            turn += 1
            try:
                if ending == "unary":
                    self.unary(kind, path, body, timeout=120)
                elif ending == "stream":
                    self.stream(kind, path, body, drop_after=None)
                elif ending == "drop":
                    self.stream(kind, path, body, drop_after=2)
                else:
                    try:
                        self.unary(kind, path, body, timeout=rng.uniform(0.01, 0.3))
                    except TimeoutError:
                        self.count(f"{kind}/{ending}/gave-up")
                        continue
                self.count(f"{kind}/{ending}/ok")
            except Exception as exc:  # noqa: BLE001 - a failed check, reported
                self.fail(f"{kind}{path}/{ending}: {type(exc).__name__}: {exc}")


    def responses_client(self, rng: random.Random, turn: int, until: float) -> None:
        """--responses: stored and background Responses (soak_responses.py), each ending
        in turn."""
        while time.monotonic() < until:
            ending = RESPONSE_ENDINGS[turn % len(RESPONSE_ENDINGS)]
            turn += 1
            try:
                self.responses.run(rng, ending)
            except Exception as exc:  # noqa: BLE001 - a failed check, reported
                self.fail(f"responses/{ending}: {type(exc).__name__}: {exc}")


def main(argv: list[str] | None = None) -> int:
    ap = soak_arguments(__doc__)
    ap.add_argument("--shared-prefixes", type=int, default=0,
                    help="prompts start with one of this many long prefixes (0: all random)")
    ap.add_argument("--responses", type=int, default=0,
                    help="more clients running stored and background Responses")
    args = ap.parse_args(argv)
    clients = args.clients
    args.clients += args.responses
    return run_soak("http_soak", args, lambda cluster, model_dir: HttpLoad(
        cluster.http_address, model_dir.name, args.shared_prefixes, clients),
        router_args=("--tool-call-parser", "hermes"))


if __name__ == "__main__":
    sys.exit(main())
