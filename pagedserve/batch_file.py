"""The lines of an OpenAI batch file, in and out (`pagedserve run-batch`, run_batch.py).

In, one request a line (OpenAI's Batch API input, as vLLM's `run-batch` reads it too):

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

`url` is one of the HTTP API's generation routes (URLS); `body` is what that route takes,
without `stream` (a batch answers whole responses); `model` may be left out (the served
model). Out, one line for every line in, in the same order:

    {"id": "batch_req_…", "custom_id": "q1",
     "response": {"status_code": 200, "request_id": "chatcmpl-…", "body": {...}},
     "error": null}

A request the server answered with an error keeps its status and OpenAI error object in
`response` (as the Batch API does: a 400 is a response, not a lost line). A line that is
not a request at all (not JSON, no custom_id, another method or route, a repeated
custom_id) gets `"response": null` and `"error": {"code": "invalid_request", "message"}`;
a blank line is skipped, as JSONL readers do.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
MAX_CUSTOM_ID_CHARS = 512


@dataclass(frozen=True)
class BatchRequest:
    """One valid line: what to POST where."""
    index: int  # its place among the file's non-blank lines (its output line's place)
    custom_id: str
    url: str
    body: dict


@dataclass(frozen=True)
class BadLine:
    """A line that is not a request: its output line says why."""
    index: int
    custom_id: str | None
    message: str


def parse_line(index: int, text: str, seen: set[str]) -> BatchRequest | BadLine:
    """One non-blank input line (`seen`: the custom_ids of the lines before, updated)."""
    try:
        obj = json.loads(text)
    except ValueError as exc:
        return BadLine(index, None, f"line {index + 1} is not JSON: {exc}")
    if not isinstance(obj, dict):
        return BadLine(index, None, f"line {index + 1} is not a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BadLine(index, None, "custom_id must be a non-empty string")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return BadLine(index, None, f"custom_id is longer than {MAX_CUSTOM_ID_CHARS} "
                                    "characters")
    if custom_id in seen:
        return BadLine(index, custom_id, f"custom_id {custom_id!r} is used by an earlier "
                                         "line (each must be unique)")
    seen.add(custom_id)
    method = obj.get("method", "POST")
    if method != "POST":
        return BadLine(index, custom_id, f"method must be POST, got {method!r}")
    url = obj.get("url")
    if url not in URLS:
        return BadLine(index, custom_id, f"url must be one of {', '.join(URLS)}, got {url!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        return BadLine(index, custom_id, "body must be a JSON object")
    if body.get("stream"):
        return BadLine(index, custom_id, "stream is not supported in a batch (every "
                                         "response is returned whole)")
    return BatchRequest(index, custom_id, url, body)


def _line_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def response_line(req: BatchRequest, status: int, body) -> dict:
    """The output line of a request the server answered (any status)."""
    request_id = body.get("id") if isinstance(body, dict) else None
    return {"id": _line_id(), "custom_id": req.custom_id,
            "response": {"status_code": status,
                         "request_id": request_id if isinstance(request_id, str)
                         else f"req_{uuid.uuid4().hex}",
                         "body": body},
            "error": None}


def error_line(custom_id: str | None, code: str, message: str) -> dict:
    """The output line of a line that got no response (`code`: invalid_request, or
    server_error when the server could not answer it)."""
    return {"id": _line_id(), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def usage_of(line: dict) -> tuple[int, int, int]:
    """(prompt tokens, of them from the prefix cache, output tokens) of an answered line's
    body (zeros where it has no usage)."""
    response = line.get("response") or {}
    body = response.get("body")
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return 0, 0, 0
    prompt = usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    cached = details.get("cached_tokens", 0) or 0 if isinstance(details, dict) else 0
    output = usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0
    return int(prompt), int(cached), int(output)
