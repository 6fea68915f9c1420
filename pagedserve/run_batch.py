"""`pagedserve run-batch -i IN.jsonl -o OUT.jsonl [--model M] [server flags]`: an OpenAI batch
file through a cluster of its own, offline (the format: batch_file.py).

It starts what `serve` starts (the router in this process, `--executors` executor
processes), on loopback ports of its own (gRPC and HTTP on free ports, metrics off, the
executor socket on a free port: a running `serve` is not disturbed), and sends every line to
the router's OpenAI HTTP edge: the same validation, routing, prefix cache and answers as
online requests, so a batch's outputs are what the server would give each request. Then it
drains and stops the cluster.

Flow: a reader takes lines from the file (in a thread: a slow pipe never stalls the router
on this event loop), each valid line is POSTed as soon as the window has room, and a writer
puts the output lines out in input order. The window (`--max-concurrency`, default:
min(--max-queue-len, 2 x --max-num-seqs x --executors)) bounds the requests in flight plus
the answers waiting for an earlier line: enough to keep every executor's batch full, never
more than the router queues (so no 429), and memory that does not grow with the file. A 429
all the same (another client of the same ports) is retried after a short wait; any other
status is the line's answer. An interrupted run leaves a valid prefix of the output.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
from dataclasses import dataclass

from .batch_file import BadLine, BatchRequest, error_line, parse_line, response_line, usage_of
from .router.edge_security import http_headers

log = logging.getLogger("pagedserve.run_batch")

READ_CHUNK_BYTES = 1 << 20
PROGRESS_EVERY_S = 10.0
RETRY_429_S = (0.05, 2.0)  # first wait, longest wait (doubling)


@dataclass
class BatchStats:
    lines: int = 0
    ok: int = 0  # answered 200
    failed: int = 0  # another status, or no response
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0

    def count(self, line: dict) -> None:
        self.lines += 1
        response = line.get("response")
        if response is not None and response["status_code"] == 200:
            self.ok += 1
        else:
            self.failed += 1
        prompt, cached, output = usage_of(line)
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        self.output_tokens += output

    def summary(self, seconds: float) -> str:
        rate = f"{self.lines / seconds:.1f} requests/s, " if seconds > 0 else ""
        tok_s = f"{self.output_tokens / seconds:,.0f} output tokens/s, " if seconds > 0 else ""
        hit = (f" ({100 * self.cached_tokens / self.prompt_tokens:.0f}% from the prefix cache)"
               if self.prompt_tokens else "")
        return (f"{self.lines} lines ({self.ok} answered 200, {self.failed} not) in "
                f"{seconds:.2f} s: {rate}{tok_s}{self.prompt_tokens:,} prompt tokens{hit}, "
                f"{self.output_tokens:,} output tokens")


class JsonlOut:
    """Output lines to a text file, one JSON object a line."""

    def __init__(self, out) -> None:
        self.out = out

    def write(self, line: dict) -> None:
        self.out.write(json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n")

    def flush(self) -> None:
        self.out.flush()


class OrderedWriter:
    """Output lines in input order: line i is written (to `out`: write(line), flush()) once
    lines 0..i-1 are; each written line frees one place of the window."""

    def __init__(self, out, window: asyncio.Semaphore, stats: BatchStats) -> None:
        self.out = out
        self.window = window
        self.stats = stats
        self.ready: dict[int, dict] = {}
        self.next = 0

    def put(self, index: int, line: dict) -> None:
        self.ready[index] = line
        while self.next in self.ready:
            done = self.ready.pop(self.next)
            self.out.write(done)
            self.stats.count(done)
            self.next += 1
            self.window.release()
        self.out.flush()


async def post(http, req: BatchRequest) -> dict:
    """The output line of one request (its answer, whatever the status)."""
    import aiohttp
    wait = RETRY_429_S[0]
    while True:
        try:
            async with http.post(req.url, json=req.body) as reply:
                status = reply.status
                text = await reply.text()
        except aiohttp.ClientError as exc:
            return error_line(req.custom_id, "server_error", f"no answer from the server: {exc}")
        if status != 429:
            break
        await asyncio.sleep(wait)
        wait = min(2 * wait, RETRY_429_S[1])
    try:
        body = json.loads(text)
    except ValueError:
        body = {"error": {"message": text[:2000], "type": "server_error", "param": None,
                          "code": None}}
    return response_line(req, status, body)


async def read_lines(source):
    """The non-blank lines of `source` (a text file), read in a thread a chunk at a time."""
    while True:
        chunk = await asyncio.to_thread(source.readlines, READ_CHUNK_BYTES)
        if not chunk:
            return
        for text in chunk:
            if text.strip():
                yield text


async def run_file(source, out, base_url: str, window_size: int,
                   api_key: str | None = None) -> BatchStats:
    """Every line of `source` through the HTTP API at `base_url`, output lines to `out`."""
    import aiohttp
    connector = aiohttp.TCPConnector(limit=0)  # the window bounds the connections
    async with aiohttp.ClientSession(base_url, connector=connector,
                                     headers=http_headers(api_key),
                                     timeout=aiohttp.ClientTimeout(total=None)) as http:
        return await run_lines(source, JsonlOut(out), http, window_size)


async def run_lines(source, out, http, window_size: int, prepare=None,
                    stats: BatchStats | None = None) -> BatchStats:
    """Every line of `source` POSTed with `http` (an aiohttp session), output lines to `out`
    in input order (OrderedWriter); `prepare(request)`: a BatchRequest as it is sent, or a
    BadLine (the batch API's checks); `stats` counted as lines are written."""
    stats = stats if stats is not None else BatchStats()
    window = asyncio.Semaphore(window_size)
    writer = OrderedWriter(out, window, stats)
    seen: set[str] = set()
    tasks: set[asyncio.Task] = set()
    last_note = time.monotonic()

    async def one(req: BatchRequest) -> None:
        writer.put(req.index, await post(http, req))

    try:
        index = 0
        async for text in read_lines(source):
            await window.acquire()
            item = parse_line(index, text, seen)
            if prepare is not None and not isinstance(item, BadLine):
                item = prepare(item)
            if isinstance(item, BadLine):
                writer.put(index, error_line(item.custom_id, "invalid_request", item.message))
            else:
                task = asyncio.ensure_future(one(item))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            index += 1
            if time.monotonic() - last_note >= PROGRESS_EVERY_S:
                last_note = time.monotonic()
                log.info("batch: %d lines read, %d written, %d in flight",
                         index, stats.lines, len(tasks))
        if tasks:
            await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    return stats


# --------------------------------------------------------------------------- the command


def build_parser() -> argparse.ArgumentParser:
    from .cli import _Parser
    from .flags import add_server_flags
    from .serve import PRIVATE_CLUSTER
    p = _Parser(prog="pagedserve run-batch", allow_abbrev=False,
                description="Run an OpenAI batch file (JSONL: "
                "custom_id, method, url, body) through a local cluster; one output line "
                "per input line, in order.")
    p.add_argument("-i", "--input-file", required=True, help="the batch file ('-': stdin)")
    p.add_argument("-o", "--output-file", required=True, help="where the results go ('-': "
                   "stdout); overwritten")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight plus answers waiting for an earlier line "
                   "(default: min(--max-queue-len, 2 x --max-num-seqs x --executors))")
    add_server_flags(p)
    p.set_defaults(**PRIVATE_CLUSTER)  # the command line may still say otherwise
    return p


def _open(path: str, mode: str):
    if path == "-":
        return contextlib.nullcontext(sys.stdin if "r" in mode else sys.stdout)
    return open(path, mode, encoding="utf-8")  # noqa: SIM115 - closed by the caller's with


def main(argv: list[str]) -> int:
    from .cli import _resolve_model, setup_logging
    from .flags import flatten_lora_modules
    parser = build_parser()
    args = parser.parse_args(argv)
    flatten_lora_modules(args)
    if args.http_port < 0:
        parser.error("--http-port -1: run-batch sends the batch through the HTTP API")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error("--max-concurrency must be 1 or more")
    window = args.max_concurrency or min(args.max_queue_len,
                                         2 * args.max_num_seqs * args.executors)
    setup_logging(args.log_format)
    try:
        source = _open(args.input_file, "r")
    except OSError as exc:
        return _file_error(exc)
    with source as src:
        _resolve_model(args, "pagedserve run-batch", default="default")
        try:  # truncated only once the input and the model are known good
            sink = _open(args.output_file, "w")
        except OSError as exc:
            return _file_error(exc)
        with sink as out:
            return _run_cluster(args, argv, src, out, window)


def _file_error(exc: OSError) -> int:
    print(f"pagedserve run-batch: {exc.strerror or exc}: {exc.filename}", file=sys.stderr)
    return 2


def _run_cluster(args, argv: list[str], src, out, window: int) -> int:
    from . import event_loop
    from .router.app import ModelDirError, ServerBindError, ServerConfigError
    from .router.executor_link import ExecutorLinkError
    from .serve import INTERRUPTED, run_cluster_job, serve_children

    async def job(engine, ready) -> int:
        api_key = args.api_key[0] if args.api_key else None
        started = time.monotonic()
        stats = await run_file(src, out, f"http://{ready.http}", window, api_key)
        print(f"pagedserve run-batch: {stats.summary(time.monotonic() - started)}",
              file=sys.stderr)
        return 0

    async def run() -> int:
        children, on_gpu = serve_children(args, executor_argv(argv))
        # the router's ready line to stderr: stdout may be the output file
        with contextlib.redirect_stdout(sys.stderr):
            rc = await run_cluster_job(args, children, job, executors_on_gpu=on_gpu)
        if children.startup_failure is not None:
            print(f"pagedserve run-batch: {children.startup_failure}", file=sys.stderr)
        elif rc == INTERRUPTED:
            print("pagedserve run-batch: interrupted; the output holds the lines before",
                  file=sys.stderr)
        return rc

    try:
        return event_loop.run(run())
    except (ModelDirError, ExecutorLinkError, ServerBindError, ServerConfigError) as exc:
        print(f"pagedserve run-batch: {exc}", file=sys.stderr)
        return 2


def executor_argv(argv: list[str]) -> list[str]:
    """run-batch's own flags taken out of what the executors are started with (the parser
    takes no abbreviations, so these spellings are all there are; ExecutorChildren takes
    out --api-key)."""
    out, skip = [], False
    for arg in argv:
        name, eq, _ = arg.partition("=")
        if skip:
            skip = False
        elif name in ("--input-file", "--output-file", "--max-concurrency"):
            skip = not eq
        elif arg in ("-i", "-o"):
            skip = True
        elif arg[:2] in ("-i", "-o") and not arg.startswith("--"):
            pass  # -iFILE
        else:
            out.append(arg)
    return out
