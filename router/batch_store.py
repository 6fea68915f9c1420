"""The files and batches of the OpenAI Batch API (`--batch-dir DIR`; router/batch_routes.py
serves them), kept on disk so that every process serving HTTP (the router, its API
workers) sees the same ones:

    DIR/files/<file id>.jsonl     a file's bytes (an uploaded input, a batch's output)
    DIR/files/<file id>.json      its File object
    DIR/batches/<batch id>.json   a Batch object, rewritten as the batch runs

Every JSON document is written whole to a temporary name and renamed over the old one
(atomic on one filesystem), so a reader in another process sees the old or the new one,
never a part. A batch records the process running it (`owner`, kept out of what clients
see): a batch whose owner is gone when a server starts was cut by a restart, and is marked
failed (its output so far is not kept: the batch can be created again).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from pathlib import Path

from .errors import InvalidRequest, NotFound

FILE_PURPOSES = ("batch",)  # what a client may upload
OUTPUT_PURPOSES = ("batch_output",)
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
LIST_LIMIT = (1, 100)


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, separators=(",", ":")))
    os.replace(tmp, path)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def _owner() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname()}


def _alive(owner: dict | None) -> bool:
    if not owner or owner.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(owner["pid"]), 0)
    except (OSError, ValueError, KeyError):
        return False
    return True


def _page(items: list[dict], limit: int, after: str | None) -> dict:
    """OpenAI's list object over ``items`` (newest first), ``limit`` from past ``after``."""
    if after is not None:
        ids = [i["id"] for i in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


class BatchStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.files = self.root / "files"
        self.batches = self.root / "batches"
        self.files.mkdir(parents=True, exist_ok=True)
        self.batches.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ files

    def data_path(self, file_id: str) -> Path:
        return self.files / f"{file_id}.jsonl"

    def new_file_id(self) -> str:
        return f"file-{uuid.uuid4().hex[:24]}"

    def add_file(self, file_id: str, filename: str, purpose: str) -> dict:
        """Record the file whose bytes are at `data_path(file_id)` already."""
        obj = {"id": file_id, "object": "file", "bytes": self.data_path(file_id).stat().st_size,
               "created_at": int(time.time()), "filename": filename, "purpose": purpose,
               "status": "processed", "expires_at": None, "status_details": None}
        _write_json(self.files / f"{file_id}.json", obj)
        return obj

    def file(self, file_id: str) -> dict:
        obj = _read_json(self.files / f"{file_id}.json") if _is_id(file_id, "file-") else None
        if obj is None:
            raise NotFound(f"No such File object: {file_id}")
        return obj

    def list_files(self, purpose: str | None, limit: int, after: str | None) -> dict:
        items = [f for f in (_read_json(p) for p in self.files.glob("file-*.json")) if f]
        if purpose:
            items = [f for f in items if f.get("purpose") == purpose]
        items.sort(key=lambda f: (f["created_at"], f["id"]), reverse=True)
        return _page(items, limit, after)

    def delete_file(self, file_id: str) -> dict:
        self.file(file_id)
        for path in (self.files / f"{file_id}.json", self.data_path(file_id)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        return {"id": file_id, "object": "file", "deleted": True}

    # ------------------------------------------------------------------ batches

    def new_batch(self, input_file_id: str, endpoint: str, completion_window: str,
                  metadata: dict | None) -> dict:
        source = self.file(input_file_id)
        if source["purpose"] != "batch":
            raise InvalidRequest(f"input_file_id: {input_file_id} has purpose "
                                 f"{source['purpose']!r}, not 'batch'", field="input_file_id")
        now = int(time.time())
        batch = {"id": f"batch_{uuid.uuid4().hex[:24]}", "object": "batch",
                 "endpoint": endpoint, "errors": None, "input_file_id": input_file_id,
                 "completion_window": completion_window, "status": "validating",
                 "output_file_id": None, "error_file_id": None, "created_at": now,
                 "in_progress_at": None, "expires_at": now + 24 * 3600, "finalizing_at": None,
                 "completed_at": None, "failed_at": None, "expired_at": None,
                 "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": 0, "completed": 0, "failed": 0},
                 "metadata": metadata, "owner": _owner()}
        self.save_batch(batch)
        return batch

    def save_batch(self, batch: dict) -> None:
        _write_json(self.batches / f"{batch['id']}.json", batch)

    def batch(self, batch_id: str) -> dict:
        obj = _read_json(self.batches / f"{batch_id}.json") \
            if _is_id(batch_id, "batch_") else None
        if obj is None:
            raise NotFound(f"No such Batch object: {batch_id}")
        return obj

    def list_batches(self, limit: int, after: str | None) -> dict:
        items = [b for b in (_read_json(p) for p in self.batches.glob("batch_*.json")) if b]
        items.sort(key=lambda b: (b["created_at"], b["id"]), reverse=True)
        return _page([public(b) for b in items], limit, after)

    def fail_orphans(self) -> list[str]:
        """Batches left active by a process that is gone (a restart cut them): failed."""
        failed = []
        for path in self.batches.glob("batch_*.json"):
            batch = _read_json(path)
            if batch and batch["status"] in ACTIVE and not _alive(batch.get("owner")):
                batch["status"] = "failed"
                batch["failed_at"] = int(time.time())
                batch["errors"] = {"object": "list", "data": [{
                    "code": "server_restarted", "line": None, "param": None,
                    "message": "the server stopped while the batch ran; create it again"}]}
                self.save_batch(batch)
                failed.append(batch["id"])
        return failed


def public(batch: dict) -> dict:
    """A Batch object as clients see it."""
    return {k: v for k, v in batch.items() if k != "owner"}


def _is_id(value: str, prefix: str) -> bool:
    """Only ids this store makes name its files (no path in a client's id)."""
    rest = value[len(prefix):] if value.startswith(prefix) else ""
    return len(rest) == 24 and all(c in "0123456789abcdef" for c in rest)
