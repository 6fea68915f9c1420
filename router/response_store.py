"""Stored Responses (OpenAI's `store`, on by default): what `previous_response_id`,
`GET /v1/responses/{id}`, `DELETE`, `input_items` and background responses read.

One store lives in the process that owns the engine (the router; with API workers the
workers reach it through ResponseCalls, remote_engine.RemoteResponses), so a response
created through one worker is found through any other. An entry is the Response's record
as JSON bytes (`{"response": Response, "input_items": [...]}`, the HTTP edge's
http_responses.py writes and reads it), its status, and for a background stream the
stream's events so far (each an encoded event), so a client can read them again
(`GET ...?stream=true&starting_after=N`) while the response runs or after.

Conversations (OpenAI's Conversations API, router/http_conversations.py) live in the same
store, entries of kind "conversation" (`{"conversation": Conversation, "items": [...]}`):
never queued or running, changed only by `edit_conversation` (items appended, one
deleted, the metadata replaced: one step each, so two responses finishing in one
conversation both add theirs). A response id never finds a conversation, nor the reverse.

With `--responses-dir` every change is also written to a file (response_persistence.py)
and a restarted router loads it: a background response the old router was running is
loaded as failed (its requests died with it).

Memory is bounded by `max_bytes` (--responses-store-mb): the records' and events' bytes.
Past it the least recently used finished entries are dropped (a later read: 404); a
queued or running background response is never dropped. A finished entry is never
replaced: the background run that finishes after a cancel finds its record cancelled and
keeps it so. A cancel calls `abort` (the engine's, by request id) for the entry's requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from .errors import InvalidRequest, NotFound
from .response_persistence import ResponseFile

log = logging.getLogger(__name__)

LIVE = ("queued", "in_progress")  # a background response not finished yet
LOCAL = -1  # the owner of an entry put by this process (else: the API worker's index)
RESPONSE, CONVERSATION = "response", "conversation"  # the kinds of entries

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


@dataclass
class StoredEntry:
    record: bytes
    status: str
    background: bool
    request_ids: tuple[str, ...] = ()
    owner: int = LOCAL
    kind: str = RESPONSE
    events: list[bytes] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def size(self) -> int:
        return len(self.record) + sum(len(e) for e in self.events)


def stored_status(record: bytes) -> str:
    return _decode(record)["response"]["status"]


class ResponseStore:
    """The stored Responses of this router (see the module docstring). Its methods are
    coroutines, as RemoteResponses' are."""

    def __init__(self, max_bytes: int, abort: Callable[[str], bool] | None = None,
                 metrics=None, file: ResponseFile | None = None) -> None:
        self.max_bytes = max_bytes
        self.abort = abort  # the engine's abort by request id (a cancel's)
        self.metrics = metrics  # RouterMetrics: the responses_stored* gauges, drops
        self.file = file  # --responses-dir: every change written through
        self._entries: OrderedDict[str, StoredEntry] = OrderedDict()
        self.bytes = 0
        if file is not None:
            self._load(file)

    def _load(self, file: ResponseFile) -> None:
        """What the file holds, least recently changed first; a response that was queued
        or running failed with the router that ran it."""
        for entry_id, kind, status, background, record in file.load():
            entry = self._entries[entry_id] = StoredEntry(record, status, background,
                                                          kind=kind)
            self.bytes += entry.size
            if status in LIVE:
                self._finish_as(entry_id, entry, "failed", {
                    "code": "server_error",
                    "message": "the router restarted before this response finished"})
        self._evict(keep="")
        self._publish()
        if self._entries:
            log.info("loaded %d stored responses and conversations (%d bytes) from %s",
                     len(self._entries), self.bytes, file.path)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def close(self) -> None:
        """The file closed (the router is stopping); the memory is dropped with it."""
        if self.file is not None:
            self.file.close()
            self.file = None

    def __len__(self) -> int:
        return len(self._entries)

    async def put(self, response_id: str, record: bytes, *, background: bool = False,
                  request_ids: tuple[str, ...] = (), owner: int = LOCAL,
                  update: bool = False) -> bool:
        """Store a response's record, or replace a queued or running one's (`update`: only
        that); False when it is not kept: the store is off, the entry finished already (a
        cancelled one stays cancelled), `update` found none (deleted), or it would not fit
        even alone."""
        if not self.enabled:
            return False
        status = stored_status(record)
        old = self._entries.get(response_id)
        if old is not None:
            if old.status not in LIVE or old.kind != RESPONSE:
                return False
            self.bytes -= old.size
            old.record, old.status = record, status
            old.request_ids = request_ids or old.request_ids
            entry = old
            entry.changed.set()
        elif update:
            return False
        else:
            entry = self._entries[response_id] = StoredEntry(record, status, background,
                                                             request_ids, owner)
        return self._kept(response_id, entry)

    def _kept(self, entry_id: str, entry: StoredEntry) -> bool:
        """A put entry, most recently used, the budget kept by dropping others (or this one,
        finished and too large: False)."""
        self._entries.move_to_end(entry_id)
        self.bytes += entry.size
        self._evict(keep=entry_id)
        if self.bytes > self.max_bytes and entry.status not in LIVE:
            log.warning("%s %s (%d bytes) does not fit in the response store "
                        "(--responses-store-mb, %d bytes, %d held by running background "
                        "responses); not stored", entry.kind, entry_id, entry.size,
                        self.max_bytes, self.bytes - entry.size)
            self._drop(entry_id, dropped=True)  # publishes; off the file too
            return False
        self._save(entry_id, entry)
        self._publish()
        return True

    def _background(self, response_id: str, what: str, field: str) -> StoredEntry:
        """A stored background response (NotFound; InvalidRequest naming `field` for one
        that is not background: it cannot be `what`)."""
        entry = self._entry(response_id, RESPONSE)
        if entry is None:
            raise NotFound(f"no stored response has the id {response_id!r}")
        if not entry.background:
            raise InvalidRequest(f"only a response created with background: true can be "
                                 f"{what}", field=field)
        return entry

    def _entry(self, entry_id: str, kind: str) -> StoredEntry | None:
        entry = self._entries.get(entry_id)
        return entry if entry is not None and entry.kind == kind else None

    async def get(self, response_id: str, kind: str = RESPONSE) -> bytes | None:
        entry = self._entry(response_id, kind)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)
        return entry.record

    async def delete(self, response_id: str, kind: str = RESPONSE) -> bool:
        """Forget a response (a running background one is aborted first) or a
        conversation."""
        entry = self._entry(response_id, kind)
        if entry is None:
            return False
        if entry.status in LIVE:
            self._abort(entry)
        self._drop(response_id)
        return True

    async def cancel(self, response_id: str) -> bytes:
        """A background response cancelled: its record with status "cancelled" (a finished
        one's unchanged: cancelling is idempotent); its requests aborted."""
        entry = self._background(response_id, "cancelled", "response_id")
        if entry.status in LIVE:
            self._finish_as(response_id, entry, "cancelled", None)
            self._abort(entry)
            self._evict(keep=response_id)
            self._publish()
        return entry.record

    async def add_events(self, response_id: str, events: list[bytes]) -> None:
        """A background stream's next events (encoded), in order."""
        entry = self._entries.get(response_id)
        if entry is None or entry.status not in LIVE:
            return  # cancelled, deleted or evicted: nobody reads them any more
        entry.events += events
        self.bytes += sum(len(e) for e in events)
        entry.changed.set()
        self._evict(keep=response_id)
        self._publish()

    async def events(self, response_id: str, after: int,
                     wait_s: float) -> tuple[list[bytes], bool]:
        """A background stream's events with a sequence number above `after` (-1: all),
        waiting up to `wait_s` for one when there is none yet; and whether the stream is
        over (every event it will have is in the store). NotFound when it is not stored,
        InvalidRequest when it was not streamed in the background."""
        entry = self._background(response_id, "streamed again", "stream")
        if len(entry.events) <= after + 1 and entry.status in LIVE and wait_s > 0:
            entry.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(entry.changed.wait(), wait_s)
        return entry.events[after + 1:], entry.status not in LIVE

    # ------------------------------------------------------------------ conversations

    async def put_conversation(self, conversation_id: str, record: bytes) -> bool:
        """Store a new conversation's record (False: the store is off, or it does not
        fit)."""
        if not self.enabled or conversation_id in self._entries:
            return False
        entry = self._entries[conversation_id] = StoredEntry(record, "completed", False,
                                                             kind=CONVERSATION)
        return self._kept(conversation_id, entry)

    async def edit_conversation(self, conversation_id: str, append: list[dict] | None = None,
                                drop_item: str = "", metadata: dict | None = None) -> bytes:
        """Change a conversation in one step: `append` items, drop the item `drop_item`,
        replace its `metadata`; its new record. NotFound for no such conversation or
        item; InvalidRequest (the conversation unchanged) when the new record would not fit
        the store even with every other finished entry dropped."""
        entry = self._entry(conversation_id, CONVERSATION)
        if entry is None:
            raise NotFound(f"no conversation has the id {conversation_id!r}",
                           field="conversation_id")
        record = _decode(entry.record)
        if drop_item:
            kept = [item for item in record["items"] if item.get("id") != drop_item]
            if len(kept) == len(record["items"]):
                raise NotFound(f"conversation {conversation_id!r} has no item {drop_item!r}",
                               field="item_id")
            record["items"] = kept
        if append:
            record["items"] += append
        if metadata is not None:
            record["conversation"]["metadata"] = metadata
        new = _encode(record)
        live = sum(e.size for e in self._entries.values() if e.status in LIVE)
        if len(new) + live > self.max_bytes:  # (what _kept would drop it for)
            raise InvalidRequest(
                f"conversation {conversation_id!r} would take {len(new)} bytes, more than "
                f"the response store holds (--responses-store-mb: {self.max_bytes} bytes, "
                f"{live} held by running background responses); it was not changed",
                field="items" if append else "metadata")
        self.bytes -= entry.size
        entry.record = new
        self._kept(conversation_id, entry)
        return entry.record

    def worker_lost(self, owner: int) -> None:
        """The API worker running some background responses is gone: they failed."""
        for entry_id, entry in list(self._entries.items()):
            if entry.owner == owner and entry.status in LIVE:
                self._finish_as(entry_id, entry, "failed", {
                    "code": "server_error",
                    "message": "the API worker running this response stopped"})
        self._evict(keep="")
        self._publish()

    # ------------------------------------------------------------------ internals

    def _finish_as(self, entry_id: str, entry: StoredEntry, status: str,
                   error: dict | None) -> None:
        record = _decode(entry.record)
        record["response"]["status"] = status
        if error is not None:
            record["response"]["error"] = error
        self.bytes -= len(entry.record)
        entry.record, entry.status = _encode(record), status
        self.bytes += len(entry.record)
        entry.changed.set()
        self._save(entry_id, entry)

    def _save(self, entry_id: str, entry: StoredEntry) -> None:
        if self.file is not None:
            self.file.save(entry_id, entry.kind, entry.status, entry.background, entry.record)

    def _abort(self, entry: StoredEntry) -> None:
        if self.abort is not None:
            for request_id in entry.request_ids:
                self.abort(request_id)

    def _drop(self, response_id: str, dropped: bool = False) -> None:
        """Forget an entry (`dropped`: to fit the budget, counted)."""
        entry = self._entries.pop(response_id)
        self.bytes -= entry.size
        entry.changed.set()  # a reader waiting on it finds it gone
        if self.file is not None:
            self.file.delete(response_id)
        if dropped and self.metrics is not None:
            self.metrics.responses_dropped.inc()
        self._publish()

    def _publish(self) -> None:
        if self.metrics is not None:
            self.metrics.responses_stored.set(len(self._entries))
            self.metrics.responses_stored_bytes.set(self.bytes)

    def _evict(self, keep: str) -> None:
        """The least recently used finished entries dropped until the store fits."""
        if self.bytes <= self.max_bytes:
            return
        for response_id in [rid for rid, e in self._entries.items()
                            if rid != keep and e.status not in LIVE]:
            self._drop(response_id, dropped=True)
            if self.bytes <= self.max_bytes:
                return
