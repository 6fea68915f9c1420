"""http_soak.py's `--responses N` clients: stored and background Responses under the load
(router/http_responses.py), each client in turn:

* ``chain``: a turn (unary), its GET (the same Response), a second turn naming it
  (`previous_response_id`; unary or streamed), whose input_items are the first turn's
  input, its output and the new input; then the first is deleted and the second still
  reads back;
* ``poll``: a background response read with GET until it has finished;
* ``cancel``: a background response cancelled 10-300 ms after its creation: cancelled, or
  finished before the cancel came;
* ``resume``: a background stream the client leaves after 3 events, read again from
  sequence number 2 to its end (numbers continuous, the last event the end);
* ``delete``: a background response deleted while it may run (then a 404);
* ``conversation`` (added with the Conversations API): a conversation of one item, two
  responses in it at once (one streamed), then its items: the first, each response's input
  and output (both added, whichever finished first), and the conversation deleted.

Every answer's status is checked, each outcome counted (`responses/<ending>/ok`); the
soak's end checks (every block free, nothing leaked) cover the requests these abort.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time

ENDINGS = ("chain", "poll", "cancel", "resume", "delete", "conversation")
FINISHED = ("completed", "incomplete", "failed", "cancelled")
WORDS = ("paged", "cache", "block", "prefix", "token", "stream", "router", "kernel", "ünï", "🙂")


class ResponsesClient:
    """One soak client's Responses calls over fresh connections (`tally`: the soak's)."""

    def __init__(self, tally, host: str, port: int, model: str) -> None:
        self.tally, self.host, self.port, self.model = tally, host, port, model

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        try:
            conn.request(method, path, json.dumps(body) if body is not None else None,
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())
        finally:
            conn.close()

    def events(self, method: str, path: str, body: dict | None,
               leave_after: int | None = None) -> list[dict]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        events: list[dict] = []
        try:
            conn.request(method, path, json.dumps(body) if body is not None else None,
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise AssertionError(f"{path}: HTTP {resp.status} {resp.read()[:300]!r}")
            for raw in resp:
                if raw.startswith(b"data: "):
                    events.append(json.loads(raw[6:]))
                    if leave_after is not None and len(events) == leave_after:
                        break  # the connection closes: this client leaves
        finally:
            conn.close()
        return events

    def body(self, rng: random.Random, **extra) -> dict:
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 30)))
        return {"model": self.model, "input": words, "max_output_tokens": rng.randrange(4, 25),
                "temperature": rng.choice([0.0, 1.0]), **extra}

    def expect(self, what: str, got, want) -> None:
        if got != want:
            raise AssertionError(f"{what}: {got!r}, expected {want!r}")

    def run(self, rng: random.Random, ending: str) -> None:
        getattr(self, ending)(rng)
        self.tally.count(f"responses/{ending}/ok")

    def chain(self, rng: random.Random) -> None:
        status, first = self.call("POST", "/v1/responses", self.body(rng))
        self.expect("first turn", status, 200)
        self.expect("GET", self.call("GET", f"/v1/responses/{first['id']}"), (200, first))
        second = self.body(rng, previous_response_id=first["id"])
        if rng.random() < 0.5:
            status, reply = self.call("POST", "/v1/responses", second)
            self.expect("second turn", status, 200)
        else:
            reply = self.events("POST", "/v1/responses", {**second, "stream": True})[-1][
                "response"]
        self.expect("previous_response_id", reply["previous_response_id"], first["id"])
        status, page = self.call("GET", f"/v1/responses/{reply['id']}/input_items"
                                        "?order=asc&limit=100")
        self.expect("input items", len(page["data"]), 2 + len(first["output"]))
        self.expect("delete", self.call("DELETE", f"/v1/responses/{first['id']}")[0], 200)
        self.expect("GET after", self.call("GET", f"/v1/responses/{reply['id']}")[0], 200)

    def _background(self, rng: random.Random) -> str:
        status, queued = self.call("POST", "/v1/responses", self.body(rng, background=True))
        self.expect("background", (status, queued.get("status")), (200, "queued"))
        return queued["id"]

    def poll(self, rng: random.Random) -> None:
        rid = self._background(rng)
        deadline = time.monotonic() + 60
        while (now := self.call("GET", f"/v1/responses/{rid}")[1])["status"] in (
                "queued", "in_progress"):
            if time.monotonic() > deadline:
                raise AssertionError(f"{rid} still {now['status']} after 60 s")
            time.sleep(0.02)
        if now["status"] not in ("completed", "incomplete"):
            raise AssertionError(f"{rid} ended {now['status']}: {now.get('error')}")

    def cancel(self, rng: random.Random) -> None:
        rid = self._background(rng)
        time.sleep(rng.uniform(0.01, 0.3))
        status, reply = self.call("POST", f"/v1/responses/{rid}/cancel")
        self.expect("cancel", status, 200)
        if reply["status"] not in ("cancelled", "completed", "incomplete"):
            raise AssertionError(f"cancel: {reply['status']}")
        self.expect("after cancel", self.call("GET", f"/v1/responses/{rid}")[1]["status"],
                    reply["status"])

    def resume(self, rng: random.Random) -> None:
        head = self.events("POST", "/v1/responses",
                           self.body(rng, background=True, stream=True), leave_after=3)
        rid = head[0]["response"]["id"]
        rest = self.events("GET", f"/v1/responses/{rid}?stream=true&starting_after=2", None)
        numbers = [e["sequence_number"] for e in rest]
        self.expect("sequence numbers", numbers, list(range(3, 3 + len(rest))))
        if rest[-1]["type"] not in ("response.completed", "response.incomplete"):
            raise AssertionError(f"resumed stream ended with {rest[-1]['type']}")

    def delete(self, rng: random.Random) -> None:
        rid = self._background(rng)
        time.sleep(rng.uniform(0.0, 0.2))
        self.expect("delete", self.call("DELETE", f"/v1/responses/{rid}")[0], 200)
        self.expect("GET deleted", self.call("GET", f"/v1/responses/{rid}")[0], 404)

    def conversation(self, rng: random.Random) -> None:
        status, conv = self.call("POST", "/v1/conversations", {
            "items": [{"role": "user", "content": "Remember the word paged."}]})
        self.expect("conversation", status, 200)
        outputs: list[int] = []
        errors: list[str] = []

        def turn(stream: bool) -> None:
            body = self.body(rng, conversation=conv["id"])
            try:
                if stream:
                    final = self.events("POST", "/v1/responses", {**body, "stream": True})[-1]
                    reply = final["response"]
                else:
                    status, reply = self.call("POST", "/v1/responses", body)
                    if status != 200:
                        raise AssertionError(f"HTTP {status}: {reply}")
                if reply["status"] in ("completed", "incomplete"):
                    outputs.append(1 + len(reply["output"]))
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(f"{type(exc).__name__}: {exc}")
        threads = [threading.Thread(target=turn, args=(s,)) for s in (False, True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise AssertionError("; ".join(errors))
        status, page = self.call("GET", f"/v1/conversations/{conv['id']}/items?limit=100")
        self.expect("conversation items", len(page["data"]), 1 + sum(outputs))
        self.expect("delete", self.call("DELETE", f"/v1/conversations/{conv['id']}")[0], 200)
