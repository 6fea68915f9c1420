"""Beam search in a real cluster (router, one API worker, a CPU executor on a random Llama):
the beams equal transformers' `generate(num_beams=n, num_return_sequences=n)` token for
token, through gRPC (unary and stream) and the OpenAI API; beams forked mid-generation run
on the executor's real KV cache (their shared blocks copied on write); every block comes
back."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from cluster_harness import Cluster, HFReference, concurrently, request
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb

from pagedserve.tinymodels import build_model

PROMPTS = ["Once upon a time there was", "The router owns the block tables", "a b c d e"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("beam_cluster") / "llama", "llama")


@pytest.fixture(scope="module")
def hf(model_dir):
    return HFReference(model_dir)


@pytest.fixture(scope="module")
def cluster(model_dir):
    c = Cluster(model_dir, num_executors=1,
                router_args=["--api-workers", "1", "--served-model-name", "beam",
                             "--block-size", "8"],
                executor_args=["--block-size", "8"])
    with c.running():
        yield c


def _hf_beams(hf, prompt_ids, width, max_tokens, *, ignore_eos=False, length_penalty=1.0,
              early_stopping=False, stop_ids=()):
    ids = torch.tensor([prompt_ids])
    eos = None if ignore_eos else hf.model.generation_config.eos_token_id
    if stop_ids:
        eos = [*([eos] if isinstance(eos, int) else eos or []), *stop_ids]
    with torch.no_grad():
        out = hf.model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width,
                                num_return_sequences=width, max_new_tokens=max_tokens,
                                do_sample=False, eos_token_id=eos,
                                pad_token_id=hf.tokenizer.pad_token_id,
                                length_penalty=length_penalty, early_stopping=early_stopping)
    stops = set([eos] if isinstance(eos, int) else eos or [])
    beams = []
    for row in out[:, len(prompt_ids):].tolist():
        cut = next((i for i, t in enumerate(row) if t in stops), None)
        beams.append(row[: cut + 1] if cut is not None else row)
    return beams


def _beam_request(prompt, width, max_tokens, **kw):
    req = request(prompt, max_tokens=max_tokens, n=width, **kw.pop("params", {}))
    req.params.beam_search.SetInParent()
    for k, v in kw.items():
        setattr(req.params.beam_search, k, v)
    return req


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_beams_equal_transformers(cluster, hf, ignore_eos):
    cases = [(p, w, 10) for p, w in zip(PROMPTS, (2, 3, 4), strict=True)]
    resps = concurrently(lambda c: cluster.stub.Generate(_beam_request(
        c[0], c[1], c[2], params={"ignore_eos": ignore_eos}), timeout=120), cases)
    for (prompt, width, max_tokens), resp in zip(cases, resps, strict=True):
        want = _hf_beams(hf, hf.encode(prompt), width, max_tokens, ignore_eos=ignore_eos)
        got = [list(c.token_ids) for c in resp.completions]
        assert [c.index for c in resp.completions] == list(range(width))
        assert got == want, prompt
        assert resp.usage.completion_tokens == sum(map(len, want))
        for c, tokens in zip(resp.completions, want, strict=True):
            assert c.text == hf.tokenizer.decode(
                tokens[:-1] if c.finish_reason == pb.STOP else tokens,
                skip_special_tokens=True)
    cluster.wait_blocks_free()


def test_length_penalty_and_early_stopping(cluster, hf):
    prompt = PROMPTS[0]
    for lp, early, enum in ((0.0, "never", pb.EARLY_STOPPING_NEVER),
                            (2.0, True, pb.EARLY_STOPPING_WHEN_FULL)):
        resp = cluster.stub.Generate(_beam_request(prompt, 3, 8, length_penalty=lp,
                                                   early_stopping=enum), timeout=120)
        want = _hf_beams(hf, hf.encode(prompt), 3, 8, length_penalty=lp, early_stopping=early)
        assert [list(c.token_ids) for c in resp.completions] == want
    cluster.wait_blocks_free()


def test_stream_and_openai_api(cluster):
    prompt = PROMPTS[1]
    full = cluster.stub.Generate(_beam_request(prompt, 3, 10), timeout=120)
    chunks = list(cluster.stub.Stream(_beam_request(prompt, 3, 10), timeout=120))
    for c in full.completions:
        mine = [x for x in chunks if x.index == c.index]
        assert [t for x in mine for t in x.token_ids] == list(c.token_ids)
        assert "".join(x.text for x in mine) == c.text
    body = {"model": "beam", "prompt": prompt, "max_tokens": 10, "n": 3,
            "use_beam_search": True, "temperature": 0.7}  # (no effect on beams)
    req = urllib.request.Request(f"http://{cluster.http_address}/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        out = json.loads(resp.read())
    assert [ch["text"] for ch in out["choices"]] == [c.text for c in full.completions]
    assert out["usage"]["completion_tokens"] == full.usage.completion_tokens
    cluster.wait_blocks_free()



def test_beams_ended_by_stop_ids(cluster, hf):
    """A stop id that the beams meet (taken from the search without it): hypotheses end
    there ("stop", the id in their tokens), others go on; transformers' eos_token_id list."""
    prompt = PROMPTS[2]
    ids = hf.encode(prompt)
    free = _hf_beams(hf, ids, 3, 12, ignore_eos=True)
    stop_ids = sorted({b[8] for b in free})  # (earlier ones: the search avoids them)
    want = _hf_beams(hf, ids, 3, 12, ignore_eos=True, stop_ids=stop_ids)
    resp = cluster.stub.Generate(_beam_request(
        prompt, 3, 12, params={"ignore_eos": True, "stop_token_ids": stop_ids}), timeout=120)
    assert [list(c.token_ids) for c in resp.completions] == want
    ended = [c for c in resp.completions if c.finish_reason == pb.STOP]
    assert ended and all(c.stop_token_id == c.token_ids[-1] in stop_ids for c in ended)
    cluster.wait_blocks_free()


def test_beam_search_bench_quick(model_dir):
    """benchmarks/beam_search_bench.py in its smallest setting on this model: its JSON
    line, and the router's beams the same as those of the client-driven search."""
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "beam_search_bench.py"), "--model",
         str(model_dir), "--widths", "2", "--concurrency", "1", "--max-tokens", "6",
         "--dtype", "float32"], cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [json.loads(x) for x in proc.stdout.splitlines() if x.strip()]
    assert line["bench"] == "beam_search_bench" and line["case"] == "w2_c1"
    for mode in ("router", "client"):
        assert line[mode]["seconds"] > 0 and line[mode]["tok_per_s"] > 0
        assert line[mode]["peak_blocks"] >= 1
    assert line["client"]["requests_sent"] > line["router"]["requests_sent"] == 4
    assert line["same_outputs"] is True


def test_beams_survive_an_executor_killed_mid_search(model_dir, hf):
    """Two executors; beam searches running on both; one is SIGKILLed mid-search: its
    searches move to the other (recomputing every beam, the answers they had kept still
    valid) and every search still equals transformers'."""
    c = Cluster(model_dir, num_executors=2, router_args=["--block-size", "8"],
                executor_args=["--block-size", "8"])
    cases = [(f"{p} again {i}", 3, 40) for i, p in enumerate(PROMPTS * 2)]
    with c.running():
        c.wait_executors(2)
        results: list = []

        def search(case):
            return c.stub.Generate(_beam_request(*case, params={"ignore_eos": True}),
                                   timeout=120)
        runner = threading.Thread(target=lambda: results.extend(concurrently(search, cases)))
        runner.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # both running searches, some steps in
            running = {e.id: e.running for e in c.status().executors}
            if all(running.values()):
                break
            time.sleep(0.02)
        time.sleep(0.3)
        victim = next(e.id for e in c.status().executors if e.running)
        c.executors[victim].send_signal(signal.SIGKILL)
        runner.join(180)
        migrated = sum(float(line.rsplit(" ", 1)[1]) for line in c.metrics().splitlines()
                       if line.startswith("pagedserve_migrations_total"))
        c.wait_blocks_free()
    assert migrated >= 1
    for (prompt, width, max_tokens), resp in zip(cases, results, strict=True):
        assert not isinstance(resp, Exception), resp
        want = _hf_beams(hf, hf.encode(prompt), width, max_tokens, ignore_eos=True)
        assert [list(x.token_ids) for x in resp.completions] == want, prompt
