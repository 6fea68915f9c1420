"""The child process that makes model directories (it imports torch; the router never does).

    python -m pagedserve.modelprep gguf FILE.gguf OUT_DIR [--name NAME] [--source TEXT]
                                       [--dtype float32|bfloat16] [--quiet]
    python -m pagedserve.modelprep tiny OUT_DIR

`gguf`: transformers' GGUF loader dequantizes the file to float32; the result is saved as an
ordinary Hugging Face directory: config.json, model.safetensors (in `--dtype`),
tokenizer.json + tokenizer_config.json + chat_template.jinja, and generation_config.json
whose `eos_token_id` lists the file's EOS and the chat template's end-of-turn token
(`<|im_end|>` for ChatML), so a chat answer stops where the template ends a turn.
`tiny`: the random-weight demo Llama of `pagedserve.tinymodels`.

Called by `pagedserve.models`, which owns the lock, the temporary directory and the rename.
A refusal (an architecture or quantization we cannot run) is one line on stdout and exit 2;
progress bars go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# general.architecture values whose models the executor runs (transformers converts them
# to LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM).
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# End-of-turn tokens of common chat templates; the ones a template uses become EOS ids.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|eom_id|>")
# bfloat16: rounding the dequantized weights to bfloat16 changed no greedy token of 8 chat
# prompts computed in float32 (the rounding, at most 2^-9 relative, is far below the 4-bit
# quantization step), halves the checkpoint (269 MB instead of 538 MB), and makes
# `--dtype auto` compute in bfloat16, 1.4x (decode) to 2.8x (prefill) faster than float32 on
# a CPU with AVX-512 BF16 (benchmarks/dtype_bench.py; README "Models").
STORE_DTYPE = "bfloat16"


class Refusal(ValueError):
    """A GGUF file we do not convert (one line)."""


def dequantizable_types() -> set[str]:
    """GGML tensor types transformers' loader can turn into floats (via gguf.quants)."""
    from gguf import quants

    return {"F32", "F16", "BF16", "F64"} | {t.name for t in quants._type_traits}


def check_gguf(path: Path) -> dict:
    """Refuse an architecture or a quantization we cannot run, before any conversion work;
    returns a few metadata fields for the log."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - not a GGUF file / truncated
        raise Refusal(f"not a readable GGUF file ({type(exc).__name__}: {exc})") from None
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else "(none)"
    if arch not in GGUF_ARCHITECTURES:
        raise Refusal(f"GGUF architecture {arch!r} is not supported "
                      f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    ok = dequantizable_types()
    bad = sorted({t.tensor_type.name for t in reader.tensors} - ok)
    if bad:
        first = next(t.name for t in reader.tensors if t.tensor_type.name in bad)
        raise Refusal(f"quantization {', '.join(bad)} (tensor {first}) cannot be dequantized; "
                      f"supported: {', '.join(sorted(ok))}")
    return {"architecture": arch, "tensors": len(reader.tensors)}


def end_of_turn_ids(tokenizer, chat_template: str | None) -> list[int]:
    if not chat_template:
        return []
    ids = []
    for token in END_OF_TURN_TOKENS:
        tid = tokenizer.convert_tokens_to_ids(token)
        if token in chat_template and isinstance(tid, int) and tid != tokenizer.unk_token_id:
            ids.append(tid)
    return ids


def convert_gguf(src: Path, out: Path, *, name: str | None = None, source: str | None = None,
                 dtype: str = STORE_DTYPE, quiet: bool = False) -> None:
    meta = check_gguf(src)
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    if quiet:  # --log-format json: stderr stays one JSON object per line
        transformers.utils.logging.disable_progress_bar()
    else:
        print(f"converting {src.name}: {meta['architecture']}, {meta['tensors']} tensors, "
              f"dequantized and stored as {dtype}", file=sys.stderr, flush=True)
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                 dtype=torch.float32)
    # The weights are plain float tensors now; forget they came quantized so that
    # save_pretrained writes an ordinary checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model = model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    eos = _as_list(model.config.eos_token_id) + _as_list(tokenizer.eos_token_id)
    eos += end_of_turn_ids(tokenizer, tokenizer.chat_template)
    eos = sorted(set(eos))
    model.generation_config.eos_token_id = eos if len(eos) > 1 else eos[0]
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    config["_name_or_path"] = name or src.stem
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "pagedserve-source.json").write_text(json.dumps({
        "converted_from": source or str(src), "gguf_file": src.name, "dtype": dtype,
        "eos_token_id": eos, "transformers": transformers.__version__}, indent=2) + "\n")
    for needed in ("config.json", "model.safetensors", "tokenizer.json",
                   "generation_config.json"):
        if not (out / needed).is_file():
            raise Refusal(f"the conversion wrote no {needed}")


def _as_list(value) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int)]
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedserve.modelprep")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("gguf", help="convert a GGUF file into a Hugging Face directory")
    g.add_argument("src", type=Path)
    g.add_argument("out", type=Path)
    g.add_argument("--name")
    g.add_argument("--source")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default=STORE_DTYPE)
    g.add_argument("--quiet", action="store_true")
    t = sub.add_parser("tiny", help="build the random-weight demo Llama")
    t.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "gguf":
            convert_gguf(args.src, args.out, name=args.name, source=args.source,
                         dtype=args.dtype, quiet=args.quiet)
        else:
            from .tinymodels import build_demo_model
            build_demo_model(args.out)
    except Refusal as exc:
        print(exc, flush=True)
        return 2
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises: one line
        text = " ".join(str(exc).split())[:400]
        print(f"cannot convert ({type(exc).__name__}: {text})", flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
