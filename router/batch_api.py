"""The OpenAI Batch API on the HTTP edge (`--batch-dir DIR`): what OpenAI's SDK calls as
`client.files.create(purpose="batch")` and `client.batches.create(...)`.

    POST   /v1/files                   multipart `file` + `purpose=batch` -> File
    GET    /v1/files[?purpose=]        GET /v1/files/{id}     GET /v1/files/{id}/content
    DELETE /v1/files/{id}
    POST   /v1/batches                 {input_file_id, endpoint, completion_window: "24h",
                                        metadata} -> Batch (validating, then in_progress)
    GET    /v1/batches[?limit=&after=]  GET /v1/batches/{id}
    POST   /v1/batches/{id}/cancel     -> cancelling, then cancelled

A batch runs in the process that created it, one at a time a process (the others wait in
`validating`): its lines go through this process's own HTTP app on a private Unix socket
(no key, no TLS: the creator was checked), the same routes and answers as online requests
(pagedserve/run_batch.run_lines: a bounded window, input order, 429 retried). Each line
without a `priority` of its own is sent with BATCH_PRIORITY, so the scheduler runs online
requests first and a batch fills what they leave (a running batch request may be
preempted by an online one). Answers with status 200 go to the output file, the others
(and lines that are not requests, or name another endpoint than the batch's) to the error
file, each in input order; `request_counts` and cancellation are checked every
SAVE_EVERY_S. Files and batches live in DIR (batch_store.py), shared by the router and its
API workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
import time
from pathlib import Path

from aiohttp import web

from pagedserve.batch_file import URLS, BadLine, BatchRequest
from pagedserve.run_batch import BatchStats, JsonlOut, run_lines

from .batch_store import ACTIVE, LIST_LIMIT, BatchStore, public
from .errors import InvalidRequest
from .http_errors import answered, dumps_json, query_int, read_json
from .openai_fields import metadata_of

log = logging.getLogger("pagedserve.batches")

MAX_FILE_BYTES = 200 << 20  # OpenAI's limit for a batch input file
MAX_LINES = 50_000  # OpenAI's limit of requests a batch
BATCH_PRIORITY = 1 << 20  # after every online request (default priority 0)
SAVE_EVERY_S = 1.0


class SplitOut:
    """A batch's output lines: answered 200 to the output file, the rest to the error file
    (each opened when its first line comes)."""

    def __init__(self, store: BatchStore) -> None:
        self.store = store
        self.ids = {True: store.new_file_id(), False: store.new_file_id()}
        self.files: dict[bool, JsonlOut] = {}

    def write(self, line: dict) -> None:
        ok = (line.get("response") or {}).get("status_code") == 200
        out = self.files.get(ok)
        if out is None:
            out = self.files[ok] = JsonlOut(open(  # noqa: SIM115 - closed in close()
                self.store.data_path(self.ids[ok]), "w", encoding="utf-8"))
        out.write(line)

    def flush(self) -> None:
        for out in self.files.values():
            out.flush()

    def close(self, batch_id: str) -> dict[str, str | None]:
        """The File ids of what was written (None: nothing of that kind)."""
        ids: dict[str, str | None] = {"output_file_id": None, "error_file_id": None}
        for ok, out in self.files.items():
            out.out.close()
            key = "output_file_id" if ok else "error_file_id"
            name = f"{batch_id}_{'output' if ok else 'error'}.jsonl"
            ids[key] = self.store.add_file(self.ids[ok], name, "batch_output")["id"]
        return ids


class BatchApi:
    """The routes over a BatchStore, and the batches this process runs."""

    def __init__(self, store: BatchStore, window: int) -> None:
        self.store = store
        self.window = max(1, window)
        self.queue: asyncio.Queue[str] = asyncio.Queue()
        self.running: dict[str, asyncio.Task] = {}
        self._socket_dir = tempfile.mkdtemp(prefix="pagedserve-batch-")  # 0700
        self.socket_path = str(Path(self._socket_dir) / "http.sock")
        self._worker: asyncio.Task | None = None
        self._private: web.AppRunner | None = None

    def add_routes(self, app: web.Application) -> None:
        r = app.router
        r.add_post("/v1/files", self.upload)
        r.add_get("/v1/files", self.list_files)
        r.add_get("/v1/files/{id}", self.get_file)
        r.add_get("/v1/files/{id}/content", self.file_content)
        r.add_delete("/v1/files/{id}", self.delete_file)
        r.add_post("/v1/batches", self.create)
        r.add_get("/v1/batches", self.list_batches)
        r.add_get("/v1/batches/{id}", self.get_batch)
        r.add_post("/v1/batches/{id}/cancel", self.cancel)

    async def start(self, private_app: web.Application) -> None:
        """Serve ``private_app`` (the HTTP app without key or TLS, no batch routes) on the
        private socket the batches' lines go to; fail the batches a restart cut."""
        self._private = web.AppRunner(private_app, handle_signals=False, access_log=None,
                                      handler_cancellation=True)  # a cancel aborts lines
        await self._private.setup()
        await web.UnixSite(self._private, self.socket_path).start()
        for batch_id in self.store.fail_orphans():
            log.warning("batch %s was cut by a restart: failed", batch_id)
        self._worker = asyncio.get_running_loop().create_task(self._run_queue())

    async def stop(self) -> None:
        """The batches this process runs or queued fail (`server_stopped`): nothing runs
        them any more (create them again)."""
        queued = [self.queue.get_nowait() for _ in range(self.queue.qsize())]
        for batch_id in [*self.running, *queued]:
            with contextlib.suppress(Exception):
                batch = self.store.batch(batch_id)
                if batch["status"] in ACTIVE:
                    self._fail(batch, "server_stopped", "the server stopped before the "
                               "batch was done; create it again")
        if self._worker is not None:
            self._worker.cancel()
        for task in list(self.running.values()):
            task.cancel()
        for task in [self._worker, *self.running.values()]:
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._private is not None:
            await self._private.cleanup()
        shutil.rmtree(self._socket_dir, ignore_errors=True)

    # ------------------------------------------------------------------ files

    @answered
    async def upload(self, request: web.Request) -> web.Response:
        if not request.content_type.startswith("multipart/"):
            raise InvalidRequest("the body must be multipart/form-data with `file` and "
                                 "`purpose`")
        reader = await request.multipart()
        purpose, filename, file_id = None, None, None
        try:
            while (part := await reader.next()) is not None:
                if part.name == "purpose":
                    purpose = (await part.text()).strip()
                elif part.name == "file" and file_id is None:
                    filename = part.filename or "upload.jsonl"
                    file_id = self.store.new_file_id()
                    await self._save_part(part, self.store.data_path(file_id))
            if file_id is None:
                raise InvalidRequest("file: a file part is required", field="file")
            if purpose != "batch":
                raise InvalidRequest(f"purpose: must be 'batch' (the purpose this server "
                                     f"serves), got {purpose!r}", field="purpose")
        except BaseException:
            if file_id is not None:
                self.store.data_path(file_id).unlink(missing_ok=True)
            raise
        return _json(self.store.add_file(file_id, filename, purpose))

    @staticmethod
    async def _save_part(part, path: Path) -> None:
        size = 0
        with open(path, "wb") as f:
            while chunk := await part.read_chunk(1 << 16):
                size += len(chunk)
                if size > MAX_FILE_BYTES:
                    raise InvalidRequest(f"file: larger than {MAX_FILE_BYTES >> 20} MiB",
                                         field="file")
                f.write(chunk)

    @answered
    async def list_files(self, request: web.Request) -> web.Response:
        limit, after = _paging(request, default=10_000, most=10_000)
        return _json(self.store.list_files(request.query.get("purpose"), limit, after))

    @answered
    async def get_file(self, request: web.Request) -> web.Response:
        return _json(self.store.file(request.match_info["id"]))

    @answered
    async def file_content(self, request: web.Request) -> web.StreamResponse:
        file_id = request.match_info["id"]
        self.store.file(file_id)
        return web.FileResponse(self.store.data_path(file_id),
                                headers={"Content-Type": "application/jsonl"})

    @answered
    async def delete_file(self, request: web.Request) -> web.Response:
        return _json(self.store.delete_file(request.match_info["id"]))

    # ------------------------------------------------------------------ batches

    @answered
    async def create(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        endpoint = body.get("endpoint")
        if endpoint not in URLS:
            raise InvalidRequest(f"endpoint: must be one of {', '.join(URLS)}, got "
                                 f"{endpoint!r}", field="endpoint")
        window = body.get("completion_window")
        if window != "24h":
            raise InvalidRequest(f"completion_window: must be '24h', got {window!r}",
                                 field="completion_window")
        input_file_id = body.get("input_file_id")
        if not isinstance(input_file_id, str):
            raise InvalidRequest("input_file_id: a file id is required",
                                 field="input_file_id")
        batch = self.store.new_batch(input_file_id, endpoint, window,
                                     _metadata(body.get("metadata")))
        self.queue.put_nowait(batch["id"])
        return _json(public(batch))

    @answered
    async def list_batches(self, request: web.Request) -> web.Response:
        limit, after = _paging(request, default=20, most=LIST_LIMIT[1])
        return _json(self.store.list_batches(limit, after))

    @answered
    async def get_batch(self, request: web.Request) -> web.Response:
        return _json(public(self.store.batch(request.match_info["id"])))

    @answered
    async def cancel(self, request: web.Request) -> web.Response:
        """In any process: the batch is marked cancelling; the process running it stops
        sending its lines (at once when it is this one, else within SAVE_EVERY_S) and marks
        it cancelled, its output so far kept."""
        batch = self.store.batch(request.match_info["id"])
        if batch["status"] in ("validating", "in_progress"):
            batch.update(status="cancelling", cancelling_at=int(time.time()))
            self.store.save_batch(batch)
            task = self.running.get(batch["id"])
            if task is not None:
                task.cancel()
        elif batch["status"] != "cancelling":
            raise InvalidRequest(f"Cannot cancel a batch with status {batch['status']!r}")
        return _json(public(batch))

    # ------------------------------------------------------------------ running

    async def _run_queue(self) -> None:
        while True:
            batch_id = await self.queue.get()
            try:
                await self._run(batch_id)
            except Exception:  # one batch's failure never stops the next
                log.exception("batch %s failed", batch_id)
                with contextlib.suppress(Exception):
                    self._fail(self.store.batch(batch_id), "server_error",
                               "the server failed the batch (see its log)")

    def _fail(self, batch: dict, code: str, message: str, line: int | None = None) -> None:
        batch.update(status="failed", failed_at=int(time.time()), errors={
            "object": "list",
            "data": [{"code": code, "message": message, "param": None, "line": line}]})
        self.store.save_batch(batch)

    async def _run(self, batch_id: str) -> None:
        store = self.store
        batch = store.batch(batch_id)
        if batch["status"] != "validating":  # cancelled while it waited
            if batch["status"] == "cancelling":
                batch.update(status="cancelled", cancelled_at=int(time.time()))
                store.save_batch(batch)
            return
        path = store.data_path(batch["input_file_id"])
        try:
            total = await asyncio.to_thread(_count_lines, path)
        except FileNotFoundError:
            self._fail(batch, "missing_file", "the input file was deleted")
            return
        if total > MAX_LINES:
            self._fail(batch, "too_many_requests",
                       f"the input file has {total} requests; a batch takes {MAX_LINES}")
            return
        batch["request_counts"]["total"] = total
        batch.update(status="in_progress", in_progress_at=int(time.time()))
        store.save_batch(batch)
        out, stats = SplitOut(store), BatchStats()
        task = asyncio.ensure_future(self._send(path, out, stats, batch["endpoint"]))
        self.running[batch_id] = task
        try:
            cancelled = await self._watch(batch, task, stats)
        finally:
            self.running.pop(batch_id, None)
        now = int(time.time())
        batch.update(status="finalizing", finalizing_at=now)
        batch.update(out.close(batch_id))
        _count(batch, stats)
        if cancelled:
            batch.update(status="cancelled", cancelled_at=now, cancelling_at=batch[
                "cancelling_at"] or store.batch(batch_id)["cancelling_at"])
        else:
            batch.update(status="completed", completed_at=now)
        store.save_batch(batch)
        log.info("batch %s %s: %d requests, %d answered 200", batch_id, batch["status"],
                 stats.lines, stats.ok)

    async def _watch(self, batch: dict, task: asyncio.Task, stats: BatchStats) -> bool:
        """Until the batch's lines are done (False) or it is cancelled (True): its counts
        saved and its status read back every SAVE_EVERY_S."""
        while True:
            done, _ = await asyncio.wait([task], timeout=SAVE_EVERY_S)
            if done:
                if task.cancelled():
                    return True
                task.result()  # its error, if any
                return False
            on_disk = self.store.batch(batch["id"])
            if on_disk["status"] == "cancelling":  # (another process's cancel)
                batch.update(status="cancelling", cancelling_at=on_disk["cancelling_at"])
                task.cancel()
                continue
            if _count(batch, stats):
                self.store.save_batch(batch)

    async def _send(self, path: Path, out: SplitOut, stats: BatchStats, endpoint: str) -> None:
        import aiohttp

        def prepare(req: BatchRequest) -> BatchRequest | BadLine:
            if req.url != endpoint:
                return BadLine(req.index, req.custom_id, f"url must be the batch's endpoint "
                                                         f"{endpoint}, got {req.url!r}")
            if "priority" not in req.body:
                return BatchRequest(req.index, req.custom_id, req.url,
                                    {**req.body, "priority": BATCH_PRIORITY})
            return req

        connector = aiohttp.UnixConnector(path=self.socket_path, limit=0)
        async with aiohttp.ClientSession("http://batch", connector=connector,
                                         timeout=aiohttp.ClientTimeout(total=None)) as http:
            with open(path, encoding="utf-8", errors="replace") as source:
                try:
                    await run_lines(source, out, http, self.window, prepare, stats)
                finally:
                    out.flush()


def _count(batch: dict, stats: BatchStats) -> bool:
    """Update the batch's request counts from `stats`; whether they changed."""
    counts = batch["request_counts"]
    new = {"total": counts["total"], "completed": stats.ok, "failed": stats.failed}
    changed = new != counts
    batch["request_counts"] = new
    return changed


def _count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def _metadata(value) -> dict | None:
    """A batch's metadata (None when it has none: OpenAI's Batch object says null)."""
    return None if value is None else metadata_of(value)


def _paging(request: web.Request, default: int, most: int) -> tuple[int, str | None]:
    return query_int(request, "limit", default, 1, most), request.query.get("after")


def _json(obj: dict) -> web.Response:
    return web.json_response(obj, dumps=dumps_json)

