"""OpenAI's Conversations API (router/http_conversations.py) over a fake engine: a
conversation's CRUD and items' pages; a Responses request naming it is given its items
first (the same prompt as the conversation sent whole) and adds its input and output to it;
a background one adds them when it finishes, a cancelled one nothing; the OpenAI SDK's
calls; every refusal's status and field."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from fake_engine import eventually, make_tokenizer
from http_rig import MODEL, _post, _run, http_edge


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory)


async def _call(session, method, path, body=None):
    async with session.request(method, path, json=body) as r:
        return r.status, await r.json()


def test_a_conversation_and_its_items(tok):
    async def main():
        async with http_edge(tok) as (_, _f, _m, base), aiohttp.ClientSession(base) as s:
            status, conv = await _call(s, "POST", "/v1/conversations", {
                "metadata": {"topic": "demo"},
                "items": [{"role": "user", "content": "Hello"},
                          {"type": "message", "role": "assistant",
                           "content": [{"type": "output_text", "text": "Hi!"}]}]})
            assert status == 200 and conv["id"].startswith("conv_")
            assert conv["object"] == "conversation" and conv["metadata"] == {"topic": "demo"}
            cid = conv["id"]
            assert await _call(s, "GET", f"/v1/conversations/{cid}") == (200, conv)
            status, page = await _call(s, "GET", f"/v1/conversations/{cid}/items?order=asc")
            first, second = page["data"]
            assert first["content"] == [{"type": "input_text", "text": "Hello"}]
            assert second["role"] == "assistant" and not page["has_more"]
            status, added = await _call(s, "POST", f"/v1/conversations/{cid}/items", {
                "items": [{"role": "user", "content": "More"}]})
            assert status == 200 and len(added["data"]) == 1
            new_id = added["data"][0]["id"]
            assert added["first_id"] == added["last_id"] == new_id
            status, page = await _call(s, "GET", f"/v1/conversations/{cid}/items?limit=2")
            assert [i["id"] for i in page["data"]] == [new_id, second["id"]]
            assert page["has_more"]  # newest first, two of three
            assert await _call(s, "GET", f"/v1/conversations/{cid}/items/{new_id}") == (
                200, added["data"][0])
            status, after = await _call(s, "DELETE", f"/v1/conversations/{cid}/items/{new_id}")
            assert status == 200 and after["id"] == cid
            assert (await _call(s, "GET", f"/v1/conversations/{cid}/items/{new_id}"))[0] == 404
            status, updated = await _call(s, "POST", f"/v1/conversations/{cid}",
                                          {"metadata": {"topic": "other"}})
            assert status == 200 and updated["metadata"] == {"topic": "other"}
            assert await _call(s, "DELETE", f"/v1/conversations/{cid}") == (
                200, {"id": cid, "object": "conversation.deleted", "deleted": True})
            status, err = await _call(s, "GET", f"/v1/conversations/{cid}")
            assert status == 404 and err["error"]["param"] == "conversation_id"
            # a response id is not a conversation, nor the reverse
            status, reply = await _post(s, "/v1/responses", {"model": MODEL, "input": "x",
                                                             "max_output_tokens": 2})
            assert (await _call(s, "GET", f"/v1/conversations/{reply['id']}"))[0] == 404
            for method, path, body, param in [
                ("POST", "/v1/conversations", {"metadata": {"k": 1}}, "metadata"),
                ("POST", "/v1/conversations", {"metadata": {str(i): "v" for i in range(17)}},
                 "metadata"),
                ("POST", "/v1/conversations", {"items": [{"type": "input_image"}]},
                 "items[0].type"),
                ("POST", "/v1/conversations", {"items": "x"}, "items"),
                ("POST", f"/v1/conversations/{cid}", {"metadata": {}}, "conversation_id"),
            ]:
                status, err = await _call(s, method, path, body)
                assert err["error"]["param"] == param, (body, err)
                assert status == (404 if param == "conversation_id" else 400)
    _run(main())


def test_responses_in_a_conversation(tok):
    async def main():
        async with http_edge(tok, max_model_len=1024) as (engine, _f, _m, base), \
                aiohttp.ClientSession(base) as s:
            status, conv = await _call(s, "POST", "/v1/conversations", {
                "items": [{"role": "user", "content": "First question"}]})
            cid = conv["id"]
            status, reply = await _post(s, "/v1/responses", {
                "model": MODEL, "input": "Second question", "conversation": cid,
                "instructions": "Be terse.", "max_output_tokens": 4})
            assert status == 200 and reply["conversation"] == {"id": cid}
            in_conversation = engine.submitted[-1].prompt_text
            status, _ = await _post(s, "/v1/responses", {
                "model": MODEL, "store": False, "instructions": "Be terse.",
                "max_output_tokens": 1,
                "input": [{"role": "user", "content": "First question"},
                          {"role": "user", "content": "Second question"}]})
            assert in_conversation == engine.submitted[-1].prompt_text  # the items first
            status, page = await _call(s, "GET", f"/v1/conversations/{cid}/items?order=asc")
            assert [i["type"] for i in page["data"]] == ["message"] * 3
            assert page["data"][1]["content"][0]["text"] == "Second question"
            assert page["data"][2] == reply["output"][0]  # the answer, as the Response has it
            # streamed, {"id": ...} form: added too
            async with s.post("/v1/responses", json={
                    "model": MODEL, "input": "Third", "conversation": {"id": cid},
                    "max_output_tokens": 3, "stream": True}) as r:
                assert r.status == 200
                await r.read()
            status, page = await _call(s, "GET", f"/v1/conversations/{cid}/items")
            assert len(page["data"]) == 5
            # background: added when it finishes; cancelled: nothing
            status, bg = await _post(s, "/v1/responses", {
                "model": MODEL, "input": "Fourth", "conversation": cid, "background": True,
                "max_output_tokens": 3})
            assert status == 200
            for _ in range(300):
                if (await _call(s, "GET", f"/v1/responses/{bg['id']}"))[1]["status"] in (
                        "completed", "incomplete"):
                    break
                await asyncio.sleep(0.01)
            assert len((await _call(s, "GET", f"/v1/conversations/{cid}/items"))[1]["data"]) \
                == 7
            engine.step_s = 0.05
            status, bg = await _post(s, "/v1/responses", {
                "model": MODEL, "input": "Fifth", "conversation": cid, "background": True,
                "max_output_tokens": 40})
            await eventually(lambda: engine.live)
            assert engine.live
            status, cancelled = await _call(s, "POST", f"/v1/responses/{bg['id']}/cancel")
            assert (status, cancelled["status"]) == (200, "cancelled")
            await eventually(lambda: not engine.live)
            await asyncio.sleep(0.1)
            assert len((await _call(s, "GET", f"/v1/conversations/{cid}/items"))[1]["data"]) \
                == 7
            for body, param, code in [
                ({"conversation": "conv_nope"}, "conversation", 404),
                ({"conversation": cid, "previous_response_id": reply["id"]}, "conversation",
                 400),
                ({"conversation": {"id": 5}}, "conversation", 400),
            ]:
                status, err = await _post(s, "/v1/responses",
                                          {"model": MODEL, "input": "x", **body})
                assert (status, err["error"]["param"]) == (code, param), (body, err)
    _run(main())


def test_the_store_off_keeps_no_conversation(tok):
    async def main():
        async with http_edge(tok, responses_store_mb=0) as (_, _f, _m, base), \
                aiohttp.ClientSession(base) as s:
            status, err = await _call(s, "POST", "/v1/conversations", {})
            assert status == 400 and "--responses-store-mb 0" in err["error"]["message"]
            status, err = await _post(s, "/v1/responses", {"model": MODEL, "input": "x",
                                                           "conversation": "conv_1"})
            assert status == 400 and err["error"]["param"] == "conversation"
    _run(main())


def test_items_past_the_store_are_a_400_and_the_conversation_stays(tok):
    async def main():
        async with http_edge(tok, responses_store_mb=0.002) as (_, _f, _m, base), \
                aiohttp.ClientSession(base) as s:  # a store of ~2 KiB
            status, conv = await _call(s, "POST", "/v1/conversations",
                                       {"items": [{"role": "user", "content": "Hello"}]})
            assert status == 200
            cid = conv["id"]
            status, err = await _call(s, "POST", f"/v1/conversations/{cid}/items", {
                "items": [{"role": "user", "content": "x" * 4000}]})
            assert status == 400 and err["error"]["param"] == "items"
            assert "not changed" in err["error"]["message"]
            assert await _call(s, "GET", f"/v1/conversations/{cid}") == (200, conv)
            status, page = await _call(s, "GET", f"/v1/conversations/{cid}/items")
            assert [i["content"][0]["text"] for i in page["data"]] == ["Hello"]
    _run(main())


def test_the_openai_sdk_drives_a_conversation(tok):
    openai = pytest.importorskip("openai")

    async def main():
        async with http_edge(tok) as (engine, _f, _m, base):
            client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
            conv = await client.conversations.create(metadata={"user": "u1"})
            reply = await client.responses.create(model=MODEL, input="Hi", conversation=conv.id,
                                                  max_output_tokens=3)
            items = await client.conversations.items.list(conv.id, order="asc")
            assert [i.type for i in items.data] == ["message", "message"]
            assert items.data[1].id == reply.output[0].id
            await client.conversations.items.create(
                conv.id, items=[{"type": "message", "role": "user", "content": "More"}])
            got = await client.conversations.retrieve(conv.id)
            assert got.metadata == {"user": "u1"}
            deleted = await client.conversations.delete(conv.id)
            assert deleted.deleted and deleted.id == conv.id
            with pytest.raises(openai.NotFoundError):
                await client.conversations.retrieve(conv.id)
    _run(main())
