"""The OpenAI Batch API on the HTTP edge (`--batch-dir`, router/batch_api.py) over a fake
engine, driven by OpenAI's own SDK: files uploaded, listed, read and deleted; a batch's
lines answered as online requests are (200s in the output file, the rest in the error
file, each in input order), sent after online requests (their priority), counted,
cancelled, listed; a batch cut by a restart found failed, one cut by a stop failed at once;
every bad call a clear 4xx."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os

import aiohttp
import openai
import pytest
from fake_engine import eventually, make_tokenizer
from http_rig import MODEL, http_edge
from pagedserve.router.batch_api import BATCH_PRIORITY
from pagedserve.router.batch_store import BatchStore


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory)


def _line(custom_id, url="/v1/completions", **body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"model": MODEL, "prompt": "hi", "max_tokens": 3, **body}})


LINES = [_line("a"), _line("b", priority=3), _line("c", max_tokens=0),
         _line("d", url="/v1/embeddings"), "not json", _line("e", temperature=0)]


async def _finished(client, batch_id, statuses=("completed", "failed", "cancelled")):
    for _ in range(500):
        batch = await client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        await asyncio.sleep(0.02)
    raise AssertionError(f"batch {batch_id} still {batch.status}")


def _client(base, key="k"):
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)


@contextlib.asynccontextmanager
async def _batch_edge(tok, tmp_path, key="k", **server):
    """The HTTP edge with --batch-dir over a fake engine, and an SDK client of it:
    (engine, base URL, client)."""
    async with http_edge(tok, batch_dir=str(tmp_path / "b"), **server) as (engine, _, _, base):
        client = _client(base, key)
        try:
            yield engine, base, client
        finally:
            await client.close()


def test_a_batch_answers_every_line_as_the_api_does(tok, tmp_path):
    async def main():
        async with _batch_edge(tok, tmp_path) as (engine, base, client):
            upload = await client.files.create(
                file=("in.jsonl", ("\n".join(LINES) + "\n\n").encode()), purpose="batch")
            assert (upload.object, upload.purpose, upload.filename) == ("file", "batch",
                                                                        "in.jsonl")
            assert upload.bytes == len("\n".join(LINES)) + 2
            created = await client.batches.create(
                input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h",
                metadata={"team": "eval"})
            assert created.status == "validating" and created.metadata == {"team": "eval"}
            batch = await _finished(client, created.id)
            assert batch.status == "completed"
            counts = batch.request_counts
            assert (counts.total, counts.completed, counts.failed) == (6, 3, 3)
            assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
            out = [json.loads(x) for x in
                   (await client.files.content(batch.output_file_id)).text.splitlines()]
            err = [json.loads(x) for x in
                   (await client.files.content(batch.error_file_id)).text.splitlines()]
            assert [x["custom_id"] for x in out] == ["a", "b", "e"]
            assert [x["custom_id"] for x in err] == ["c", "d", None]
            # each answer is what the same body online gets
            async with aiohttp.ClientSession(base) as http:
                body = json.loads(LINES[0])["body"]
                async with http.post("/v1/completions", json=body) as reply:
                    online = await reply.json()
            assert out[0]["response"]["status_code"] == 200
            assert out[0]["response"]["body"]["choices"] == online["choices"]
            assert err[0]["response"]["status_code"] == 400
            assert err[1]["error"]["message"] == ("url must be the batch's endpoint "
                                                  "/v1/completions, got '/v1/embeddings'")
            assert err[2]["error"]["code"] == "invalid_request"
            # sent behind online requests, unless the line gives its own priority
            assert sorted(s.priority for s in engine.submitted[:3]) == [  # a, b, e
                3, BATCH_PRIORITY, BATCH_PRIORITY]
            assert len(engine.submitted) == 4 and engine.submitted[-1].priority == 0
            outputs = await client.files.list(purpose="batch_output")
            assert {f.id for f in outputs.data} == {batch.output_file_id, batch.error_file_id}
            assert (await client.files.retrieve(batch.output_file_id)).filename == \
                f"{batch.id}_output.jsonl"
    asyncio.run(main())


def test_files_and_bad_calls(tok, tmp_path):
    async def main():
        async with _batch_edge(tok, tmp_path) as (_, base, client):
            first = await client.files.create(file=("a.jsonl", b"{}\n"), purpose="batch")
            second = await client.files.create(file=("b.jsonl", b"{}\n"), purpose="batch")
            listed = await client.files.list()
            assert {f.id for f in listed.data} == {first.id, second.id}
            deleted = await client.files.delete(first.id)
            assert deleted.deleted and deleted.id == first.id
            with pytest.raises(openai.NotFoundError):
                await client.files.retrieve(first.id)
            with pytest.raises(openai.NotFoundError):
                await client.files.content(first.id)
            with pytest.raises(openai.BadRequestError) as err:
                await client.files.create(file=("a.jsonl", b"{}\n"), purpose="fine-tune")
            assert "purpose: must be 'batch'" in err.value.message
            with pytest.raises(openai.NotFoundError):
                await client.batches.create(input_file_id="file-" + "0" * 24,
                                            endpoint="/v1/completions",
                                            completion_window="24h")
            for kwargs, field in ((dict(endpoint="/v1/nope"), "endpoint"),
                                  (dict(completion_window="1h"), "completion_window"),
                                  (dict(metadata={"k": "v" * 600}), "metadata")):
                call = dict(input_file_id=second.id, endpoint="/v1/completions",
                            completion_window="24h") | kwargs
                with pytest.raises(openai.BadRequestError) as err:
                    await client.batches.create(**call)
                assert err.value.body["param"] == field
            with pytest.raises(openai.NotFoundError):
                await client.batches.retrieve("batch_../../etc")
            async with aiohttp.ClientSession(base) as http:
                async with http.post("/v1/files", json={"purpose": "batch"}) as reply:
                    assert reply.status == 400
                async with http.get("/v1/batches", params={"limit": "0"}) as reply:
                    assert reply.status == 400
            # what was refused left no file behind
            names = sorted(os.listdir(tmp_path / "b" / "files"))
            assert names == sorted([f"{second.id}.json", f"{second.id}.jsonl"])
    asyncio.run(main())


def test_cancel_keeps_what_was_answered_and_list_pages(tok, tmp_path):
    async def main():
        async with _batch_edge(tok, tmp_path, step_s=0.05) as (engine, _, client):
            lines = [_line(f"r{i}", max_tokens=4) for i in range(400)]
            upload = await client.files.create(file=("in.jsonl", "\n".join(lines).encode()),
                                               purpose="batch")
            first = await client.batches.create(input_file_id=upload.id,
                                                endpoint="/v1/completions",
                                                completion_window="24h")
            second = await client.batches.create(input_file_id=upload.id,
                                                 endpoint="/v1/completions",
                                                 completion_window="24h")
            await _finished(client, first.id, ("in_progress",))
            cancelling = await client.batches.cancel(second.id)  # still waiting its turn
            assert cancelling.status == "cancelling"
            await asyncio.sleep(0.3)
            assert (await client.batches.cancel(first.id)).status == "cancelling"
            first = await _finished(client, first.id)
            assert first.status == "cancelled" and first.cancelled_at and first.cancelling_at
            counts = first.request_counts
            assert counts.total == 400 and counts.completed + counts.failed < 400
            if counts.completed:
                done = (await client.files.content(first.output_file_id)).text.splitlines()
                assert [json.loads(x)["custom_id"] for x in done] == [
                    f"r{i}" for i in range(counts.completed)]
            assert (await _finished(client, second.id)).status == "cancelled"
            with pytest.raises(openai.BadRequestError):
                await client.batches.cancel(first.id)
            page = await client.batches.list(limit=1)
            assert len(page.data) == 1 and page.has_more
            everything = [b.id async for b in client.batches.list(limit=1)]
            assert sorted(everything) == sorted([first.id, second.id])
            await eventually(lambda: not engine.live)
            assert not engine.live  # every request sent for the cancelled batch ended
    asyncio.run(main())


def test_a_batch_cut_by_a_restart_is_failed(tok, tmp_path):
    store = BatchStore(tmp_path / "b")
    (store.data_path("file-" + "1" * 24)).write_text(_line("a") + "\n")
    store.add_file("file-" + "1" * 24, "in.jsonl", "batch")
    batch = store.new_batch("file-" + "1" * 24, "/v1/completions", "24h", None)
    batch.update(status="in_progress", owner={"pid": 2 ** 22 + 7, "host": "gone"})
    store.save_batch(batch)
    mine = store.new_batch("file-" + "1" * 24, "/v1/completions", "24h", None)
    mine["status"] = "in_progress"  # this process owns it: alive
    store.save_batch(mine)

    async def main():
        async with _batch_edge(tok, tmp_path) as (_, base, client):
            cut = await client.batches.retrieve(batch["id"])
            assert cut.status == "failed" and cut.errors.data[0].code == "server_restarted"
            assert (await client.batches.retrieve(mine["id"])).status == "in_progress"
            assert "owner" not in (await client.batches.retrieve(mine["id"])).model_extra
    asyncio.run(main())


def test_a_server_stopping_fails_its_batches(tok, tmp_path):
    """Stopped mid-batch (and with a batch queued behind it): both are failed at once
    (`server_stopped`), not left in progress."""
    async def main():
        async with _batch_edge(tok, tmp_path, step_s=0.05) as (_, _, client):
            lines = "\n".join(_line(f"r{i}") for i in range(50)).encode()
            upload = await client.files.create(file=("in.jsonl", lines), purpose="batch")
            ids = [(await client.batches.create(input_file_id=upload.id,
                                                endpoint="/v1/completions",
                                                completion_window="24h")).id
                   for _ in range(2)]
            await _finished(client, ids[0], ("in_progress",))
        store = BatchStore(tmp_path / "b")
        for batch_id in ids:
            batch = store.batch(batch_id)
            assert batch["status"] == "failed", batch
            assert batch["errors"]["data"][0]["code"] == "server_stopped"
    asyncio.run(main())


def test_keys_guard_the_routes_and_not_the_lines(tok, tmp_path):
    """With --api-key every Batch API call needs the key; the batch's lines go through the
    private socket without one and are answered."""
    from pagedserve.router.edge_security import ApiKeys

    async def main():
        async with _batch_edge(tok, tmp_path, "sk-1", api_keys=ApiKeys(("sk-1",))) as (
                _, base, client):
            async with _client(base) as keyless:
                with pytest.raises(openai.AuthenticationError):
                    await keyless.files.list()
            upload = await client.files.create(file=("in.jsonl", _line("a").encode()),
                                               purpose="batch")
            batch = await client.batches.create(input_file_id=upload.id,
                                                endpoint="/v1/completions",
                                                completion_window="24h")
            batch = await _finished(client, batch.id)
            assert batch.request_counts.completed == 1
    asyncio.run(main())
