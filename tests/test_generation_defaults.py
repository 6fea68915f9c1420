"""The model's sampling defaults for the OpenAI API (`--generation-config`,
router/generation_defaults.py): read from generation_config.json, filled into the fields a
request leaves out (never over one it sets, never into beam search), off with `vllm`."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest
from fake_engine import make_tokenizer
from http_rig import http_edge
from pagedserve.router.generation_defaults import generation_defaults, with_defaults

QWEN_LIKE = {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "temperature": 0.7,
             "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 7}
DEFAULTS = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
            "max_tokens": 7}


def _write(folder, config) -> str:
    (folder / "generation_config.json").write_text(json.dumps(config))
    return str(folder)


def test_read_from_the_file_or_a_folder_or_not_at_all(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="pagedserve.router")
    model = _write(tmp_path, QWEN_LIKE)
    assert generation_defaults(model, "auto") == DEFAULTS
    assert isinstance(generation_defaults(model, "auto")["top_k"], int)
    assert generation_defaults(model, None) == DEFAULTS
    assert generation_defaults(model, "vllm") == {}
    assert "temperature=0.7, top_p=0.8" in caplog.text
    other = tmp_path / "other"
    other.mkdir()
    assert generation_defaults(model, _write(other, {"temperature": 0.3})) == {"temperature": 0.3}
    assert generation_defaults(tmp_path / "nothing-here", "auto") == {}
    bad = tmp_path / "bad"
    bad.mkdir()
    caplog.clear()
    assert generation_defaults(_write(bad, {"temperature": -1, "top_p": 0, "top_k": 2.5,
                                            "max_new_tokens": True, "min_p": 0.05}),
                               "auto") == {"min_p": 0.05}
    assert caplog.text.count("is not a value the API takes") == 4
    (bad / "generation_config.json").write_text("{not json")
    assert generation_defaults(str(bad), "auto") == {}


def test_with_defaults_fills_only_what_is_left_out():
    body = {"prompt": "x"}
    assert with_defaults(body, DEFAULTS) == {"prompt": "x", **DEFAULTS}
    assert body == {"prompt": "x"}  # not changed in place
    mine = {"prompt": "x", "temperature": 0, "top_k": None, "max_completion_tokens": 3}
    assert with_defaults(mine, DEFAULTS) == {**mine, "top_k": 20, "top_p": 0.8,
                                             "repetition_penalty": 1.05}
    assert with_defaults({"max_output_tokens": 5}, {"max_tokens": 7}) == {"max_output_tokens": 5}
    beams = {"prompt": "x", "use_beam_search": True, "n": 2}
    assert with_defaults(beams, DEFAULTS) is beams
    assert with_defaults(body, {}) is body


def test_http_requests_get_them(tmp_path_factory):
    tok = make_tokenizer(tmp_path_factory)

    async def main():
        async with http_edge(tok, sampling_defaults=DEFAULTS) as (engine, _, _m, base), \
                aiohttp.ClientSession(base) as s:
            for path, body in [
                    ("/v1/completions", {"prompt": "Once upon"}),
                    ("/v1/chat/completions", {"messages": [{"role": "user",
                                                            "content": "hi"}]}),
                    ("/v1/completions", {"prompt": "Once", "temperature": 0,
                                         "max_tokens": 2}),
                    ("/v1/responses", {"input": "hi", "max_output_tokens": 3,
                                       "top_p": 0.5})]:
                async with s.post(path, json=body) as r:
                    assert r.status == 200, await r.text()
        return [spec.sampling for spec in engine.submitted]
    got = asyncio.run(asyncio.wait_for(main(), 30))
    first = got[0]
    assert (first.temperature, first.top_p, first.top_k, first.repetition_penalty,
            first.max_tokens) == (pytest.approx(0.7), pytest.approx(0.8), 20,
                                  pytest.approx(1.05), 7)
    explicit = next(s for s in got if s.max_tokens == 2)
    assert explicit.temperature == 0.0 and explicit.top_k == 20  # greedy kept, rest filled
    assert len(got) == 4 and got[1].max_tokens == 7 and got[1].top_k == 20  # chat
    (responses,) = [s for s in got if s.max_tokens == 3]  # max_output_tokens kept
    assert responses.top_p == pytest.approx(0.5) and responses.temperature == pytest.approx(0.7)
