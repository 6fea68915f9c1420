"""What stored Responses cost and save (router/response_store.py, router/http_responses.py):
the built-in model under `pagedserve serve` (one executor, float32, one torch thread). One
JSON line a case (DESIGN §8):

* ``store_ops``: the store alone (this process): a put and a get of a record the size of a
  TURNS-turn conversation's, p50 over ``--ops`` of each, and a put that drops the least
  recently used entry; with `--responses-dir` (added with it): a put (the file's write
  queued to its thread), the writes a second the file's thread keeps up, and a restarted
  store loading all ``--ops`` records.
* ``conversation_<how>[_workers]``: one TURNS-turn conversation (each user turn a sentence,
  each answer OUTPUT_TOKENS greedy tokens, streamed), sent two ways: ``chained`` (each turn
  names the previous response: `previous_response_id`, the client sends only its new turn)
  and ``resent`` (each turn sends the whole conversation so far, `store: false`), in the
  router process and (``_workers``) through `--api-workers 2` (the store is then the router
  core's, a round trip from the worker). Figures per turn: time to the first text delta and
  to the completed event, p50 and max over the turns after the first; the request bytes the
  client sent in all, the last turn's; the prompt tokens the last turn's prompt had and
  how many came from the prefix cache.
* ``background``: BACKGROUND background responses created at once, each read with GET
  every 20 ms until finished, against the same requests in the foreground at once: the
  wall time of each set.

    .venv/bin/python benchmarks/responses_bench.py [--model default] [--ops 2000]
        [--cases store_ops,conversation,background]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from lora_load_bench import serve_process
from pagedserve.router.response_persistence import ResponseFile
from pagedserve.router.response_store import ResponseStore

BENCH = "responses_bench"
TURNS, OUTPUT_TOKENS, BACKGROUND = 8, 24, 8
QUESTIONS = ["Tell me about the moon.", "Why is it bright?", "How far away is it?",
             "Who walked on it first?", "What did they bring back?", "Could we live there?",
             "What would we eat?", "Sum it up in one line."]


def emit(case: str, **figures) -> None:
    print(json.dumps({"bench": BENCH, "case": case, **figures}), flush=True)


def ms(values: list[float]) -> dict:
    return {"p50_ms": round(statistics.median(values) * 1e3, 3),
            "max_ms": round(max(values) * 1e3, 3)}


def store_ops(ops: int) -> None:
    turn = {"type": "message", "id": "msg_" + "0" * 32, "role": "user",
            "content": [{"type": "input_text", "text": "x" * 200}]}
    record = json.dumps({"response": {"status": "completed", "output": [turn]},
                         "input_items": [turn] * (2 * TURNS)}).encode()

    async def run() -> None:
        store = ResponseStore(1 << 30)
        puts, gets = [], []
        for i in range(ops):
            t0 = time.perf_counter()
            await store.put(f"r{i}", record)
            puts.append(time.perf_counter() - t0)
        for i in range(ops):
            t0 = time.perf_counter()
            await store.get(f"r{i}")
            gets.append(time.perf_counter() - t0)
        full = ResponseStore(len(record) * 8)
        drops = []
        for i in range(ops):
            t0 = time.perf_counter()
            await full.put(f"r{i}", record)
            drops.append(time.perf_counter() - t0)
        with tempfile.TemporaryDirectory() as folder:  # --responses-dir: written through
            on_disk = ResponseStore(1 << 30, file=ResponseFile(folder))
            writes = []
            start = time.perf_counter()
            for i in range(ops):
                t0 = time.perf_counter()
                await on_disk.put(f"r{i}", record)
                writes.append(time.perf_counter() - t0)
            on_disk.close()  # every write done
            written_s = time.perf_counter() - start
            t0 = time.perf_counter()
            loaded = ResponseStore(1 << 30, file=ResponseFile(folder))
            load_s = time.perf_counter() - t0
            assert len(loaded) == ops
            loaded.close()
        emit("store_ops", record_bytes=len(record), ops=ops, put=ms(puts), get=ms(gets),
             put_dropping_one=ms(drops[8:]), put_with_file=ms(writes),
             file_writes_per_s=round(ops / written_s), load_all_s=round(load_s, 3))
    asyncio.run(run())


def _post_stream(http: str, body: dict) -> tuple[float, float, dict, int]:
    """A streamed Responses request: (seconds to the first text delta, to the end, the
    final Response, the request's bytes)."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(f"http://{http}/v1/responses", data=data,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first, final = None, None
    with urllib.request.urlopen(req, timeout=300) as resp:
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "response.output_text.delta" and first is None:
                first = time.perf_counter() - t0
            elif event["type"] in ("response.completed", "response.incomplete"):
                final = event["response"]
    return first, time.perf_counter() - t0, final, len(data)


def conversation(http: str, how: str, case: str) -> list[str]:
    """One conversation sent `how`; its answers."""
    _post(http, "/reset_prefix_cache", {})  # each run from a cold cache
    base = {"max_output_tokens": OUTPUT_TOKENS,
            "temperature": 0, "stream": True, "ignore_eos": True}
    history: list[dict] = []
    previous = None
    firsts, totals, sent = [], [], []
    final = None
    for question in QUESTIONS[:TURNS]:
        turn = {"role": "user", "content": question}
        if how == "chained":
            body = {**base, "input": [turn]}
            if previous:
                body["previous_response_id"] = previous
        else:
            body = {**base, "input": [*history, turn], "store": False}
        first, total, final, size = _post_stream(http, body)
        firsts.append(first)
        totals.append(total)
        sent.append(size)
        previous = final["id"]
        history += [turn, {"role": "assistant", "content": final["output"][0]["content"][0]
                           ["text"]}]
    usage = final["usage"]
    emit(case, turns=TURNS, output_tokens=OUTPUT_TOKENS, first_delta=ms(firsts[1:]),
         turn=ms(totals[1:]), bytes_sent=sum(sent), last_turn_bytes=sent[-1],
         last_prompt_tokens=usage["input_tokens"],
         last_cached_tokens=usage["input_tokens_details"]["cached_tokens"])
    return [m["content"] for m in history[1::2]]


def _post(http: str, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(f"http://{http}{path}", headers={"Content-Type":
                                                                  "application/json"},
                                 data=json.dumps(body).encode() if body is not None else None)
    with urllib.request.urlopen(req, timeout=300) as resp:
        data = resp.read()
        return json.loads(data) if data else {}


def background(http: str) -> None:
    body = {"max_output_tokens": OUTPUT_TOKENS,
            "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    ids = [_post(http, "/v1/responses", {**body, "input": q, "background": True})["id"]
           for q in QUESTIONS[:BACKGROUND]]
    pending = set(ids)
    while pending:
        for rid in list(pending):
            if _post(http, f"/v1/responses/{rid}")["status"] not in ("queued", "in_progress"):
                pending.discard(rid)
        time.sleep(0.02)
    polled = time.perf_counter() - t0
    t0 = time.perf_counter()
    threads = [threading.Thread(target=_post, args=(http, "/v1/responses",
                                                    {**body, "input": q}))
               for q in QUESTIONS[:BACKGROUND]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    emit("background", responses=BACKGROUND, output_tokens=OUTPUT_TOKENS,
         background_polled_s=round(polled, 3),
         foreground_s=round(time.perf_counter() - t0, 3))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--cases", default="store_ops,conversation,background")
    args = parser.parse_args(argv)
    cases = args.cases.split(",")
    if "store_ops" in cases:
        store_ops(args.ops)
    with tempfile.TemporaryDirectory() as tmp:
        for workers in ([], ["--api-workers", "2"]):
            if "conversation" not in cases and (workers or "background" not in cases):
                continue
            with serve_process(args.model, Path(tmp),
                               workers or ["--api-workers", "0"]) as (http, _):
                suffix = "_workers" if workers else ""
                if "conversation" in cases:
                    answers = [conversation(http, how, f"conversation_{how}{suffix}")
                               for how in ("chained", "resent")]
                    emit(f"conversation_answers{suffix}", same=answers[0] == answers[1])
                if "background" in cases and not workers:
                    background(http)
    return 0


if __name__ == "__main__":
    sys.exit(main())
