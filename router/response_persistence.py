"""The response store on disk (`--responses-dir DIR`): stored Responses and conversations
kept across router restarts, in one SQLite file (DIR/responses.sqlite3).

The store (response_store.py) keeps serving from memory; this file follows it, written
on every change of an entry (its record put, a cancel, a conversation changed) and on
every drop, so what a restarted router loads is what the old one held (a background
stream's events are not kept: they are the live part). One row an entry, `seq` rising with
each write: loading in `seq` order gives the least recently changed first, the store's
eviction order. The writes go, in order, to a thread of their own: the event loop that
runs the engine only queues them (a write is a small transaction in WAL mode with
synchronous=NORMAL, ~35 us, but a WAL checkpoint every few MB fsyncs for milliseconds,
benchmarks/responses_bench.py). They are durable across a router crash once written
(milliseconds after the change; a machine losing power may lose the last ones, as its page
cache would). One router per folder.
"""

from __future__ import annotations

import logging
import queue
import sqlite3
import threading
from pathlib import Path

log = logging.getLogger(__name__)

FILE = "responses.sqlite3"
SCHEMA = """CREATE TABLE IF NOT EXISTS entries (
    id TEXT PRIMARY KEY, kind TEXT NOT NULL, status TEXT NOT NULL,
    background INTEGER NOT NULL, record BLOB NOT NULL, seq INTEGER NOT NULL)"""


class ResponseFile:
    """The SQLite file of a store."""

    def __init__(self, folder: str | Path) -> None:
        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / FILE
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(SCHEMA)
        self._seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM entries").fetchone()[0]
        self._writes: queue.SimpleQueue = queue.SimpleQueue()  # (sql, args); None: stop
        self._writer = threading.Thread(target=self._write_all, name="responses-file",
                                        daemon=True)
        self._writer.start()

    def _write_all(self) -> None:
        while (write := self._writes.get()) is not None:
            try:
                self._db.execute(*write)
            except sqlite3.Error:  # a full disk: memory still serves; said, not raised
                log.exception("writing the response store to %s failed", self.path)

    def load(self) -> list[tuple[str, str, str, bool, bytes]]:
        """Every entry (id, kind, status, background, record), least recently changed
        first."""
        rows = self._db.execute("SELECT id, kind, status, background, record FROM entries "
                                "ORDER BY seq").fetchall()
        return [(rid, kind, status, bool(background), bytes(record))
                for rid, kind, status, background, record in rows]

    def save(self, entry_id: str, kind: str, status: str, background: bool,
             record: bytes) -> None:
        self._seq += 1
        self._writes.put(("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?)",
                          (entry_id, kind, status, int(background), record, self._seq)))

    def delete(self, entry_id: str) -> None:
        self._writes.put(("DELETE FROM entries WHERE id = ?", (entry_id,)))

    def close(self) -> None:
        """Every queued write done, then the file closed."""
        self._writes.put(None)
        self._writer.join()
        self._db.close()
