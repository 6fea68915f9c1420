"""The router's side of LoRA adapters: `--lora-modules` parsing, the edge's checks and the
prefix-cache salt of an adapter, the served model's name kept apart, registration."""

from __future__ import annotations

import argparse

import pytest
from pagedserve.protos import wire
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
from pagedserve.router.errors import InvalidRequest
from pagedserve.router.tokenizer import Tokenizer
from pagedserve.router.validation import Limits, request_from_pb

from pagedserve.flags import FlagError, add_server_flags, flatten_lora_modules
from pagedserve.tinymodels import build_model


def _args(argv, env=None, monkeypatch=None):
    if env is not None:
        monkeypatch.setenv("PAGEDSERVE_LORA_MODULES", env)
    parser = argparse.ArgumentParser()
    add_server_flags(parser)
    args = parser.parse_args(argv)
    flatten_lora_modules(args)
    return args.lora_modules


def test_lora_modules_flag_forms(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_LORA_MODULES", raising=False)
    assert _args([]) == ()
    assert _args(["--lora-modules", "a=/x", "b=/y,c=/z"]) == (
        ("a", "/x"), ("b", "/y"), ("c", "/z"))
    assert _args([], env="a=/x, b=/y", monkeypatch=monkeypatch) == (("a", "/x"), ("b", "/y"))
    assert _args(["--lora-modules", "c=/z"], env="a=/x",  # the flag replaces the env
                 monkeypatch=monkeypatch) == (("c", "/z"),)
    with pytest.raises(FlagError, match="--lora-modules: a given twice"):
        _args(["--lora-modules", "a=/x", "a=/y"])
    for bad in ("a", "=/x", "a=", "a b=/x"):
        with pytest.raises(SystemExit):
            _args(["--lora-modules", bad])


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer.from_dir(build_model(tmp_path_factory.mktemp("m") / "llama", "llama"))


def _spec(tok, **fields):
    request = pb.GenerateRequest(prompt="Once upon a time",
                                 params=pb.SamplingParams(max_tokens=4), **fields)
    limits = Limits(vocab_size=tok.vocab_size, max_model_len=512, lora_adapters=("sql",))
    return request_from_pb(request, tokenizer=tok, limits=limits)


def test_the_edge_checks_the_adapter_and_salts_its_cache(tok):
    spec = _spec(tok, lora_adapter="sql")
    assert spec.lora_adapter == "sql" and spec.cache_salt == "\x00lora:sql"
    assert _spec(tok, lora_adapter="sql", cache_salt="t1").cache_salt == "t1\x00lora:sql"
    assert _spec(tok, cache_salt="t1").cache_salt == "t1"
    assert _spec(tok).lora_adapter == ""
    with pytest.raises(InvalidRequest, match="^lora_adapter: unknown LoRA adapter 'x' "
                       r"\(served: sql\)$"):
        _spec(tok, lora_adapter="x")
    # a client salt cannot spell an adapter's
    with pytest.raises(InvalidRequest, match="^cache_salt: must not contain a NUL"):
        _spec(tok, cache_salt="\x00lora:sql")


def test_an_adapter_cannot_take_the_served_models_name(tmp_path):
    from pagedserve.router.app import ModelDirError, model_info_from_args

    model = build_model(tmp_path / "m", "llama")
    args = argparse.Namespace(model=str(model), block_size=16, max_model_len=None,
                              dtype="auto", served_model_name="m",
                              lora_modules=(("sql", "/a"), ("code", "/b")))
    info, _ = model_info_from_args(args)
    assert info.lora_adapters == ("sql", "code")
    args.lora_modules = (("m", "/a"),)
    with pytest.raises(ModelDirError, match="^--lora-modules: 'm' is a served model's name"):
        model_info_from_args(args)
    args.served_model_name, args.lora_modules = "m,gpt-4o-mini", (("gpt-4o-mini", "/a"),)
    with pytest.raises(ModelDirError, match="'gpt-4o-mini' is a served model's name"):
        model_info_from_args(args)  # an alias too


def test_registration_compares_the_adapters():
    from types import SimpleNamespace

    from pagedserve.router.engine import EngineConfig
    from pagedserve.router.membership import Membership

    cfg = EngineConfig(model_fingerprint="f", lora_adapters=("sql", "chat"))
    membership = Membership(SimpleNamespace(config=cfg, executors={}))

    def hello(*names):
        return wire.Hello(executor_id="e", model_fingerprint="f", device="cpu",
                          dtype="float32", block_size=16, num_gpu_blocks=8, num_cpu_blocks=0,
                          max_model_len=2048, lora_adapters=names)

    assert membership.refusal(hello("chat", "sql")) == ""
    assert membership.refusal(hello()) == (
        "LoRA adapters none, the router serves chat, sql (start both with the same "
        "--lora-modules)")
    assert "LoRA adapters sql, the router" in membership.refusal(hello("sql"))
    slots = wire.Hello(**{**{f: getattr(hello("chat", "sql"), f)
                             for f in wire.Hello.__struct_fields__}, "max_loras": 4})
    assert membership.refusal(slots) == ("--max-loras 4, the router's is 0 (start both with "
                                         "the same --max-loras)")


def test_bench_draws_an_adapter_per_request_apart_from_the_prompts():
    from pagedserve.bench import BenchConfig, _grpc_request
    from pagedserve.bench_datasets import sample_requests
    from pagedserve.bench_openai import _openai_body

    plain = sample_requests(BenchConfig("x", num_prompts=12, seed=4), 512)
    cfg = BenchConfig("x", num_prompts=12, seed=4, lora_modules=("sql", "chat"))
    reqs = sample_requests(cfg, 512)
    assert [r.prompt_token_ids for r in reqs] == [r.prompt_token_ids for r in plain]
    assert {r.lora for r in reqs} == {"sql", "chat"} and {r.lora for r in plain} == {""}
    assert [r.lora for r in sample_requests(cfg, 512)] == [r.lora for r in reqs]
    assert _grpc_request(reqs[0], cfg).lora_adapter == reqs[0].lora
    assert _openai_body(reqs[0], cfg, "base")["model"] == reqs[0].lora
    assert _openai_body(plain[0], cfg, "base")["model"] == "base"
