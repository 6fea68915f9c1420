"""Stored and background Responses (router/http_responses.py, responses_turns.py,
response_store.py) over a fake engine: a stored Response read back as it was answered, a
conversation continued by previous_response_id (the prompt holds exactly the earlier turns,
not their instructions), input_items' pages, deletes, background responses polled, cancelled
(their requests aborted) and streamed again from any sequence number; every refusal's
status and field."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from fake_engine import eventually, make_tokenizer
from http_rig import MODEL, _post, _run, http_edge, named_events, scripted


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory)


async def _get(session, path):
    async with session.get(path) as r:
        return r.status, await r.json()


async def _delete(session, path):
    async with session.delete(path) as r:
        return r.status, await r.json()


def _text(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])


def _session(base):
    return aiohttp.ClientSession(base)


def test_a_stored_response_reads_back_and_store_false_keeps_nothing(tok):
    async def main():
        async with http_edge(tok) as (engine, _, _, base), _session(base) as s:
            body = {"model": MODEL, "input": "Hi", "max_output_tokens": 5,
                    "metadata": {"k": "v"}}
            status, reply = await _post(s, "/v1/responses", body)
            assert status == 200 and reply["store"] is True and reply["background"] is False
            assert reply["previous_response_id"] is None
            assert await _get(s, f"/v1/responses/{reply['id']}") == (200, reply)

            status, kept_not = await _post(s, "/v1/responses", {**body, "store": False})
            assert status == 200 and kept_not["store"] is False
            status, err = await _get(s, f"/v1/responses/{kept_not['id']}")
            assert status == 404 and err["error"]["param"] == "response_id"
            assert kept_not["id"] in err["error"]["message"]

            async with s.post("/v1/responses", json={**body, "stream": True}) as r:
                events = await named_events(r)
            final = events[-1]["response"]
            assert final["store"] is True and final["status"] == "incomplete"
            assert await _get(s, f"/v1/responses/{final['id']}") == (200, final)
    _run(main())


def test_previous_response_id_continues_the_conversation(tok):
    async def main():
        async with http_edge(tok) as (engine, _, _, base), _session(base) as s:
            status, first = await _post(s, "/v1/responses", {
                "model": MODEL, "input": "First question", "instructions": "Be terse.",
                "max_output_tokens": 4})
            assert status == 200
            answer = _text(first)
            status, second = await _post(s, "/v1/responses", {
                "model": MODEL, "input": [{"role": "user", "content": "Second question"}],
                "previous_response_id": first["id"], "max_output_tokens": 4})
            assert status == 200 and second["previous_response_id"] == first["id"]
            # exactly the earlier turns, then the new one; the instructions are not carried
            chained = engine.submitted[-1].prompt_text
            status, _ = await _post(s, "/v1/responses", {
                "model": MODEL, "max_output_tokens": 1, "store": False,
                "input": [{"role": "user", "content": "First question"},
                          {"role": "assistant", "content": answer},
                          {"role": "user", "content": "Second question"}]})
            assert chained == engine.submitted[-1].prompt_text and "Be terse." not in chained

            status, page = await _get(s, f"/v1/responses/{second['id']}/input_items")
            assert status == 200 and page["object"] == "list" and not page["has_more"]
            items = page["data"]  # newest first
            assert [(i["type"], i.get("role")) for i in items] == [
                ("message", "user"), ("message", "assistant"), ("message", "user")]
            assert items[0]["content"] == [{"type": "input_text", "text": "Second question"}]
            assert items[1] == first["output"][0]
            assert items[2]["content"] == [{"type": "input_text", "text": "First question"}]
            assert (page["first_id"], page["last_id"]) == (items[0]["id"], items[2]["id"])
            assert len({i["id"] for i in items}) == 3
            url = f"/v1/responses/{second['id']}/input_items?order=asc&limit=2"
            status, asc = await _get(s, url)
            assert asc["data"] == items[::-1][:2] and asc["has_more"]
            status, rest = await _get(s, f"{url}&after={asc['last_id']}")
            assert rest["data"] == [items[0]] and not rest["has_more"]

            # a third turn from the second: the whole chain
            status, third = await _post(s, "/v1/responses", {
                "model": MODEL, "input": "Third", "previous_response_id": second["id"],
                "max_output_tokens": 3})
            assert status == 200
            status, page = await _get(s, f"/v1/responses/{third['id']}/input_items?limit=100")
            assert len(page["data"]) == 5
            # a branch from the first again: the second turn is not in it
            status, branch = await _post(s, "/v1/responses", {
                "model": MODEL, "input": "Other", "previous_response_id": first["id"],
                "max_output_tokens": 3})
            assert "Second question" not in engine.submitted[-1].prompt_text
    _run(main())


def test_a_chain_of_tool_calls_and_their_outputs(tok):
    thought = ('<think>They want weather.</think>Checking. <tool_call>{"name": "get_weather", '
               '"arguments": {"city": "Oslo"}}</tool_call>')
    tools = [{"type": "function", "name": "get_weather",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]

    async def main():
        async with scripted(tok, thought, reasoning_parser="qwen3",
                            tool_call_parser="hermes") as (engine, s):
            status, first = await _post(s, "/v1/responses", {
                "model": MODEL, "input": "Weather?", "tools": tools, "max_output_tokens": 200})
            assert status == 200
            assert [i["type"] for i in first["output"]] == ["reasoning", "message",
                                                           "function_call"]
            call = first["output"][2]
            status, second = await _post(s, "/v1/responses", {
                "model": MODEL, "previous_response_id": first["id"], "tools": tools,
                "max_output_tokens": 3,
                "input": [{"type": "function_call_output", "call_id": call["call_id"],
                           "output": "sunny"}]})
            assert status == 200, second
            chained = engine.submitted[-1].prompt_text  # the reasoning not shown again
            output = {"type": "function_call_output", "call_id": call["call_id"],
                      "output": "sunny"}
            status, _ = await _post(s, "/v1/responses", {
                "model": MODEL, "tools": tools, "max_output_tokens": 1, "store": False,
                "input": [{"role": "user", "content": "Weather?"}, *first["output"][1:],
                          output]})
            assert chained == engine.submitted[-1].prompt_text
            assert "sunny" in chained and "They want weather." not in chained
            status, page = await _get(s, f"/v1/responses/{second['id']}/input_items?order=asc")
            assert [i["type"] for i in page["data"]] == [
                "message", "reasoning", "message", "function_call", "function_call_output"]
            assert page["data"][1:4] == first["output"]
    _run(main())


def test_deletes_and_refusals(tok):
    async def main():
        async with http_edge(tok) as (engine, _, _, base), _session(base) as s:
            status, reply = await _post(s, "/v1/responses", {"model": MODEL, "input": "Hi",
                                                             "max_output_tokens": 2})
            rid = reply["id"]
            assert await _delete(s, f"/v1/responses/{rid}") == (
                200, {"id": rid, "object": "response", "deleted": True})
            assert (await _delete(s, f"/v1/responses/{rid}"))[0] == 404
            assert (await _get(s, f"/v1/responses/{rid}/input_items"))[0] == 404
            status, err = await _post(s, "/v1/responses", {
                "model": MODEL, "input": "x", "previous_response_id": rid})
            assert status == 404 and err["error"]["param"] == "previous_response_id"
            status, reply = await _post(s, "/v1/responses", {"model": MODEL, "input": "Hi",
                                                             "max_output_tokens": 2})
            rid = reply["id"]
            for path, param in [
                (f"/v1/responses/{rid}/input_items?limit=0", "limit"),
                (f"/v1/responses/{rid}/input_items?limit=x", "limit"),
                (f"/v1/responses/{rid}/input_items?order=up", "order"),
                (f"/v1/responses/{rid}/input_items?after=nope", "after"),
                (f"/v1/responses/{rid}?stream=true", "stream"),  # not a background one
                (f"/v1/responses/{rid}?stream=true&starting_after=-2", "starting_after"),
            ]:
                status, err = await _get(s, path)
                assert (status, err["error"]["param"]) == (400, param), (path, err)
            status, err = await _post(s, f"/v1/responses/{rid}/cancel", {})
            assert status == 400 and "background" in err["error"]["message"]
            assert (await _post(s, "/v1/responses/resp_nope/cancel", {}))[0] == 404
            for body, param in [
                ({"background": True, "store": False}, "background"),
                ({"previous_response_id": 7}, "previous_response_id"),
                ({"store": "yes"}, "store"),
                ({"previous_response_id": rid, "input": []}, "input"),
            ]:
                status, err = await _post(s, "/v1/responses",
                                          {"model": MODEL, "input": "x", **body})
                assert (status, err["error"]["param"]) == (400, param), (body, err)
            assert len(engine.submitted) == 2  # no refused body reached the engine
    _run(main())


def test_with_the_store_off_nothing_is_kept(tok):
    async def main():
        async with http_edge(tok, responses_store_mb=0) as (engine, _, _, base), \
                _session(base) as s:
            status, reply = await _post(s, "/v1/responses", {"model": MODEL, "input": "Hi",
                                                             "max_output_tokens": 2})
            assert status == 200 and reply["store"] is False
            assert (await _get(s, f"/v1/responses/{reply['id']}"))[0] == 404
            for field in ("background", "previous_response_id"):
                value = True if field == "background" else reply["id"]
                status, err = await _post(s, "/v1/responses",
                                          {"model": MODEL, "input": "x", field: value})
                assert status == 400 and err["error"]["param"] == field
                assert "--responses-store-mb 0" in err["error"]["message"]
    _run(main())


def test_a_background_response_runs_without_its_client(tok):
    async def main():
        async with http_edge(tok, step_s=0.01) as (engine, _, _, base), _session(base) as s:
            body = {"model": MODEL, "input": "Hi", "max_output_tokens": 12,
                    "temperature": 0}
            status, queued = await _post(s, "/v1/responses", {**body, "background": True})
            assert status == 200 and queued["status"] == "queued" and queued["background"]
            assert queued["output"] == [] and queued["store"] is True
            url = f"/v1/responses/{queued['id']}"
            seen = set()

            async def done():
                status, now = await _get(s, url)
                seen.add(now["status"])
                return now if now["status"] not in ("queued", "in_progress") else None
            final = None
            for _ in range(500):
                final = await done()
                if final:
                    break
                await asyncio.sleep(0.01)
            assert final["status"] == "incomplete" and "in_progress" in seen
            status, foreground = await _post(s, "/v1/responses", body)
            assert _text(final) == _text(foreground) and final["usage"] == foreground["usage"]
            assert final["id"] == queued["id"] and final["background"] is True
    _run(main())


def test_a_cancel_aborts_the_background_requests(tok):
    async def main():
        async with http_edge(tok, step_s=0.05) as (engine, _, _, base), _session(base) as s:
            status, queued = await _post(s, "/v1/responses", {
                "model": MODEL, "input": "Hi", "max_output_tokens": 200,
                "background": True})
            rid = queued["id"]
            await eventually(lambda: engine.live)
            status, cancelled = await _post(s, f"/v1/responses/{rid}/cancel", {})
            assert status == 200 and cancelled["status"] == "cancelled"
            await eventually(lambda: not engine.live)
            assert not engine.live and f"{rid}-0" in engine.aborted
            await asyncio.sleep(0.2)  # the run's end found it cancelled and left it so
            assert (await _get(s, f"/v1/responses/{rid}"))[1]["status"] == "cancelled"
            # idempotent; and a finished background response is returned as it is
            assert (await _post(s, f"/v1/responses/{rid}/cancel", {}))[1] == cancelled
            # a delete of a running one stops it too
            status, queued = await _post(s, "/v1/responses", {
                "model": MODEL, "input": "Hi", "max_output_tokens": 200,
                "background": True})
            await eventually(lambda: engine.live)
            assert (await _delete(s, f"/v1/responses/{queued['id']}"))[0] == 200
            await eventually(lambda: not engine.live)
            assert not engine.live
    _run(main())


def test_a_background_stream_reads_again_from_any_event(tok):
    async def main():
        async with http_edge(tok, step_s=0.02) as (engine, _, _, base), _session(base) as s:
            body = {"model": MODEL, "input": "Hi", "max_output_tokens": 20, "stream": True,
                    "background": True}
            async with s.post("/v1/responses", json=body) as r:
                head = await named_events(r, limit=4)  # then this client leaves
            rid = head[0]["response"]["id"]
            assert [e["sequence_number"] for e in head] == [0, 1, 2, 3]
            async with s.get(f"/v1/responses/{rid}?stream=true&starting_after=1") as r:
                rest = await named_events(r)  # the stored ones, then the live ones to the end
            assert rest[:2] == head[2:]
            assert [e["sequence_number"] for e in rest] == list(range(2, 2 + len(rest)))
            final = rest[-1]["response"]
            assert rest[-1]["type"] == "response.incomplete" and final["background"]
            text = "".join(e["delta"] for e in head + rest[2:]
                           if e["type"] == "response.output_text.delta")
            assert text == _text(final)
            assert (await _get(s, f"/v1/responses/{rid}"))[1] == final
            async with s.get(f"/v1/responses/{rid}?stream=true") as r:
                again = await named_events(r)  # finished: every event at once
            assert again == head + rest[2:]
    _run(main())


def test_a_client_chosen_id_of_a_stored_response_is_a_409(tok):
    async def main():
        async with http_edge(tok) as (engine, _, _, base), _session(base) as s:
            body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2}
            mine = {"X-Request-Id": "mine"}
            async with s.post("/v1/responses", json=body, headers=mine) as r:
                assert r.status == 200 and (await r.json())["id"] == "resp_mine"
            async with s.post("/v1/responses", json=body, headers=mine) as r:
                err = await r.json()
                assert r.status == 409 and "resp_mine" in err["error"]["message"]
            async with s.post("/v1/responses", json={**body, "store": False},
                              headers=mine) as r:
                assert r.status == 200  # not to be stored: no clash
            assert (await _delete(s, "/v1/responses/resp_mine"))[0] == 200
            async with s.post("/v1/responses", json=body, headers=mine) as r:
                assert r.status == 200
            assert len(engine.submitted) == 3
    _run(main())


def test_truncation_auto_drops_the_middle_of_a_long_chain(tok):
    async def main():
        async with http_edge(tok, max_model_len=256) as (engine, _, _, base), \
                _session(base) as s:
            filler = " ".join(["paged cache block"] * 3)
            previous, texts = None, []
            for turn in range(8):  # ~45 tokens a turn: past 256 after 5
                text = f"Turn{turn} {filler}"
                texts.append(text)
                body = {"model": MODEL, "input": text, "max_output_tokens": 8,
                        "truncation": "auto"}
                if previous:
                    body["previous_response_id"] = previous
                status, reply = await _post(s, "/v1/responses", body)
                assert status == 200, reply
                assert reply["truncation"] == "auto"
                spec = engine.submitted[-1]
                assert len(spec.prompt_token_ids) + 8 <= 256
                previous = reply["id"]
            prompt = engine.submitted[-1].prompt_text
            assert "Turn0" in prompt and "Turn7" in prompt and "Turn6" in prompt  # head, tail
            assert "Turn1 " not in prompt  # the middle went
            status, page = await _get(s, f"/v1/responses/{previous}/input_items?limit=100"
                                         "&order=asc")
            users = [i["content"][0]["text"].split()[0] for i in page["data"]
                     if i.get("role") == "user"]
            assert users[0] == "Turn0" and users[-1] == "Turn7" and len(users) < 8
            assert users == sorted(users)  # in order, a contiguous tail after the head
            assert page["data"][1]["role"] == "user"  # the tail starts at a user message
            # without truncation the chain grows until a turn is a 400 naming the input
            long_chain = previous
            for _ in range(3):
                status, reply = await _post(s, "/v1/responses", {
                    "model": MODEL, "input": f"More {filler}", "max_output_tokens": 8,
                    "previous_response_id": long_chain})
                if status == 400:
                    break
                long_chain = reply["id"]
            assert status == 400 and reply["error"]["param"].startswith("input"), reply
            # the request's own input too long: nothing to drop, a 400 as ever
            status, err = await _post(s, "/v1/responses", {
                "model": MODEL, "input": " ".join([filler] * 30), "max_output_tokens": 8,
                "truncation": "auto", "previous_response_id": previous})
            assert status == 400
            status, err = await _post(s, "/v1/responses", {"model": MODEL, "input": "x",
                                                           "truncation": "some"})
            assert status == 400 and err["error"]["param"] == "truncation"
    _run(main())


def test_a_background_response_that_fails_says_why(tok):
    async def main():
        async with http_edge(tok) as (engine, _, _, base), _session(base) as s:
            status, queued = await _post(s, "/v1/responses", {
                "model": MODEL, "input": "Hi", "max_output_tokens": 255, "background": True})
            assert status == 200 and queued["status"] == "queued"
            for _ in range(300):
                status, now = await _get(s, f"/v1/responses/{queued['id']}")
                if now["status"] not in ("queued", "in_progress"):
                    break
                await asyncio.sleep(0.01)
            assert now["status"] == "failed" and not engine.submitted
            assert now["error"]["code"] == "invalid_argument"
            assert now["error"]["message"].startswith("max_output_tokens: prompt (")
    _run(main())
