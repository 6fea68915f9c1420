"""`pagedserve run-batch` (pagedserve/run_batch.py, batch_file.py): the lines of an OpenAI
batch file in and out, the ordered writer and its window, a batch through the HTTP edge over
a fake engine (a full queue retried), and the command on a real cluster: every line answered
in input order as the HTTP API answers it alone, stdout as output, bad files refused in one
line, and an interrupted run leaving a valid prefix."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from fake_engine import make_tokenizer
from http_rig import http_edge
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.batch_file import URLS, BadLine, BatchRequest, parse_line, response_line, usage_of
from pagedserve.run_batch import (
    BatchStats,
    JsonlOut,
    OrderedWriter,
    executor_argv,
    run_file,
)

CLI = [sys.executable, "-m", "pagedserve.cli"]


def _line(custom_id="q", url="/v1/completions", **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": body or {"prompt": "Once upon", "max_tokens": 3}})


# ------------------------------------------------------------------------------ the lines


def test_parse_line_takes_requests_and_names_what_is_wrong():
    seen: set[str] = set()
    ok = parse_line(0, _line("q1", "/v1/chat/completions", messages=[]), seen)
    assert ok == BatchRequest(0, "q1", "/v1/chat/completions", {"messages": []})
    no_method = json.dumps({"custom_id": "q2", "url": "/v1/embeddings", "body": {"input": "x"}})
    assert isinstance(parse_line(1, no_method, seen), BatchRequest)  # POST by default
    cases = [
        ("{oops", None, "line 3 is not JSON"),
        ("[1, 2]", None, "line 3 is not a JSON object"),
        (json.dumps({"url": "/v1/completions", "body": {}}), None, "custom_id must be"),
        (json.dumps({"custom_id": 7, "body": {}}), None, "custom_id must be"),
        (json.dumps({"custom_id": "x" * 513}), None, "longer than 512"),
        (_line("q1"), "q1", "used by an earlier line"),
        (json.dumps({"custom_id": "g", "method": "GET", "url": "/v1/models"}), "g",
         "method must be POST"),
        (json.dumps({"custom_id": "u", "url": "/v1/models", "body": {}}), "u", "url must be"),
        (json.dumps({"custom_id": "b", "url": "/v1/completions", "body": "x"}), "b",
         "body must be a JSON object"),
        (_line("s", prompt="x", stream=True), "s", "stream is not supported"),
    ]
    for text, custom_id, message in cases:
        bad = parse_line(2, text, seen)
        assert isinstance(bad, BadLine) and bad.index == 2, text
        assert bad.custom_id == custom_id and message in bad.message, (text, bad)
    assert seen == {"q1", "q2", "g", "u", "b", "s"}


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200) | st.builds(
    lambda cid, url, body: json.dumps({"custom_id": cid, "url": url, "body": body}),
    st.one_of(st.none(), st.integers(), st.text(max_size=8)),
    st.sampled_from((*URLS, "/x", None)),
    st.one_of(st.none(), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))))
def test_any_line_is_a_request_or_a_reason(text):
    item = parse_line(0, text, set())
    assert isinstance(item, (BatchRequest, BadLine))
    if isinstance(item, BatchRequest):
        assert item.url in URLS and isinstance(item.body, dict) and item.custom_id


def test_response_line_and_usage():
    req = BatchRequest(0, "q", "/v1/completions", {})
    body = {"id": "cmpl-1", "usage": {"prompt_tokens": 10, "completion_tokens": 3,
                                      "prompt_tokens_details": {"cached_tokens": 8}}}
    line = response_line(req, 200, body)
    assert line["custom_id"] == "q" and line["error"] is None
    assert line["id"].startswith("batch_req_")
    assert line["response"] == {"status_code": 200, "request_id": "cmpl-1", "body": body}
    assert usage_of(line) == (10, 8, 3)
    responses = {"id": "resp_1", "usage": {"input_tokens": 4, "output_tokens": 2,
                                          "input_tokens_details": {"cached_tokens": 0}}}
    assert usage_of(response_line(req, 200, responses)) == (4, 0, 2)
    error = response_line(req, 400, {"error": {"message": "no"}})
    assert error["response"]["request_id"].startswith("req_") and usage_of(error) == (0, 0, 0)


@settings(max_examples=50, deadline=None)
@given(st.permutations(list(range(12))))
def test_ordered_writer_writes_in_input_order_and_frees_the_window(order):
    async def main():
        window = asyncio.Semaphore(12)
        for _ in range(12):
            await window.acquire()
        out, stats = io.StringIO(), BatchStats()
        writer = OrderedWriter(JsonlOut(out), window, stats)
        for i in order:
            done_before = writer.next
            writer.put(i, {"custom_id": str(i), "response": {"status_code": 200}})
            written = out.getvalue().splitlines()
            assert [json.loads(x)["custom_id"] for x in written] == \
                [str(k) for k in range(len(written))]
            assert window._value == writer.next and writer.next >= done_before
        assert writer.next == 12 and stats.ok == stats.lines == 12 and not writer.ready
    asyncio.run(main())


def test_executor_argv_drops_run_batch_flags():
    argv = ["-i", "in.jsonl", "--output-file", "out", "--max-concurrency=8", "-oX",
            "--input-file=a", "--executors", "2", "--model", "m", "--max-concurrency", "3"]
    assert executor_argv(argv) == ["--executors", "2", "--model", "m"]


# ------------------------------------------------------------- through the HTTP edge (fake)


def test_run_file_over_the_http_edge_retries_a_full_queue(tmp_path_factory):
    tok = make_tokenizer(tmp_path_factory)

    async def main():
        async with http_edge(tok) as (engine, _, _metrics, base):
            return engine, await run_lines(engine, base)

    async def run_lines(engine, base):
        lines = [_line(f"q{i}", prompt=f"Once upon {i}", max_tokens=1 + i % 3)
                 for i in range(20)]
        lines[5] = _line("bad", prompt="x", max_tokens=-1)  # a 400, answered in its place
        lines.insert(9, "\n")  # blank: skipped
        engine.queue_full = True  # every request 429 until the queue frees

        async def free_queue():
            await asyncio.sleep(0.3)
            engine.queue_full = False
        freer = asyncio.ensure_future(free_queue())
        out = io.StringIO()
        try:
            stats = await run_file(io.StringIO("\n".join(lines) + "\n"), out, base,
                                   window_size=4)
        finally:
            await freer
        return stats, [json.loads(x) for x in out.getvalue().splitlines()]
    engine, (stats, rows) = asyncio.run(asyncio.wait_for(main(), 30))
    ids = [f"q{i}" for i in range(20)]
    ids[5] = "bad"
    assert [r["custom_id"] for r in rows] == ids
    assert rows[5]["response"]["status_code"] == 400
    assert rows[5]["response"]["body"]["error"]["param"] == "max_tokens"
    for i, row in enumerate(rows):
        if i != 5:
            assert row["response"]["status_code"] == 200, row
            assert row["response"]["body"]["usage"]["completion_tokens"] == 1 + i % 3
    assert (stats.lines, stats.ok, stats.failed) == (20, 19, 1)
    assert len(engine.submitted) == 19  # each answered request ran once


# ------------------------------------------------------------------- the command, for real


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from pagedserve.tinymodels import build_model
    return str(build_model(tmp_path_factory.mktemp("batch") / "tiny", hidden_size=64,
                           num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128))


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}


def _batch(model_dir, *args, stdin=None):
    return subprocess.run(CLI + ["run-batch", "--model", model_dir, "--num-gpu-blocks", "64",
                                 *args], input=stdin, capture_output=True, text=True,
                          env=_env(), timeout=120)


def test_run_batch_answers_every_line_as_the_http_api_does(model_dir, tmp_path):
    prompts = [f"Once upon a time {i}" for i in range(6)]
    lines = [_line(f"c{i}", prompt=p, max_tokens=6, temperature=0) for i, p in enumerate(prompts)]
    lines += [_line("emb", "/v1/embeddings", input=["hello", "world"]),
              _line("bad", prompt="x", max_tokens=-1), "not json",
              _line("resp", "/v1/responses", input="Hi", max_output_tokens=4, temperature=0)]
    # stdin in, stdout out (the output file is the interrupted run's), the request log on
    result = _batch(model_dir, "-i", "-", "-o", "-", "--executors", "2", "--log-requests",
                    "--log-format", "json", stdin="\n".join(lines) + "\n")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(x) for x in result.stdout.splitlines()]  # nothing else on stdout
    assert [r["custom_id"] for r in rows] == [f"c{i}" for i in range(6)] + \
        ["emb", "bad", None, "resp"]
    assert [r["response"]["status_code"] if r["response"] else None for r in rows] == \
        [200] * 7 + [400, None, 200]
    assert rows[8]["error"]["code"] == "invalid_request"
    assert len(rows[6]["response"]["body"]["data"]) == 2
    assert rows[9]["response"]["body"]["object"] == "response"
    assert "10 lines (8 answered 200, 2 not)" in result.stderr
    assert "pagedserve ready" in result.stderr  # the router's line never reaches the output
    # --log-requests: each request's line in the router's log (JSON keys of their own)
    logged = {x["request_id"]: x for x in map(json.loads, (
        line for line in result.stderr.splitlines()
        if line.startswith("{") and '"pagedserve.requests"' in line))}
    first = logged[rows[0]["response"]["request_id"] + "-0"]
    assert (first["status"], first["output_tokens"], first["finish"]) == ("OK", 6, "length")
    # 6 completions, 2 embedding inputs, the response, and the 400 (refused while its body
    # was read: no id yet); the line that is not JSON never reached the server
    assert len(logged) == 10 and logged["-"]["status"] == "INVALID_ARGUMENT"

    # the same requests to a running server's HTTP API, one by one: the same completions
    proc = subprocess.Popen(CLI + ["serve", "--model", model_dir, "--num-gpu-blocks", "64",
                                   "--port", "0", "--http-port", "0", "--metrics-port", "-1",
                                   "--executor-bind", "tcp://127.0.0.1:*"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env())
    try:
        http = None
        for text in proc.stdout:
            if text.startswith("pagedserve ready"):
                http = text.split("http=")[1].strip()
                break
        assert http, "serve did not start"
        for i, prompt in enumerate(prompts):
            body = json.dumps({"prompt": prompt, "max_tokens": 6, "temperature": 0}).encode()
            req = urllib.request.Request(f"http://{http}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as reply:
                alone = json.loads(reply.read())
            assert rows[i]["response"]["body"]["choices"][0]["text"] == \
                alone["choices"][0]["text"], i
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)


def test_run_batch_bad_files_are_one_line(model_dir, tmp_path):
    out = tmp_path / "keep.jsonl"
    out.write_text("previous results\n")
    missing = _batch(model_dir, "-i", str(tmp_path / "nope.jsonl"), "-o", str(out))
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert missing.stderr.strip().splitlines() == [
        f"pagedserve run-batch: No such file or directory: {tmp_path / 'nope.jsonl'}"]
    assert out.read_text() == "previous results\n"  # not truncated
    no_http = _batch(model_dir, "-i", "-", "-o", "-", "--http-port", "-1", stdin="")
    assert no_http.returncode == 2 and "--http-port -1" in no_http.stderr


def test_interrupted_run_leaves_a_valid_prefix(model_dir, tmp_path):
    infile, outfile = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    infile.write_text("".join(_line(f"r{i}", prompt=f"story {i}", max_tokens=200,
                                    ignore_eos=True) + "\n" for i in range(400)))
    proc = subprocess.Popen(CLI + ["run-batch", "--model", model_dir, "--num-gpu-blocks", "64",
                                   "-i", str(infile), "-o", str(outfile),
                                   "--max-concurrency", "8"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=_env())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not outfile.exists() or
                                           outfile.read_text().count("\n") < 2):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted; the output holds the lines before" in err
    rows = [json.loads(x) for x in outfile.read_text().splitlines()]  # each line whole
    assert 2 <= len(rows) < 400
    assert [r["custom_id"] for r in rows] == [f"r{i}" for i in range(len(rows))]
    assert all(r["response"]["status_code"] == 200 for r in rows)
