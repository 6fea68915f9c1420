"""The router's tokenizer: a model directory's tokenizer loaded with `tokenizers` (no torch).

`tokenizer.json` is loaded with `tokenizers` directly; transformers' AutoTokenizer is only the
fallback for a model without one. Encoding adds special tokens the way Hugging Face does
(BOS per the post-processor, or per tokenizer_config's explicit add_bos_token/add_eos_token,
which transformers applies by rebuilding the post-processor). EOS ids are the union of
generation_config.json's and config.json's `eos_token_id` (an int or a list). The model's chat
template (router/chat_template.py) loads with the tokenizer, as `Tokenizer.chat_template`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .chat_template import ChatTemplate


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def read_eos_token_ids(model_dir: str | Path) -> tuple[int, ...]:
    """EOS ids of a model directory: generation_config.json's `eos_token_id` ∪ config.json's
    (each an int or a list; config.json's text_config is looked at too), sorted."""
    model_dir = Path(model_dir)
    config = _read_json(model_dir / "config.json")
    ids = set(_as_ids(_read_json(model_dir / "generation_config.json").get("eos_token_id")))
    ids.update(_as_ids(config.get("eos_token_id")))
    text_config = config.get("text_config")
    if isinstance(text_config, dict):
        ids.update(_as_ids(text_config.get("eos_token_id")))
    return tuple(sorted(ids))


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class Tokenizer:
    """Encode/decode for one model. Thread-safe for concurrent encode/decode (the Rust
    tokenizer is immutable after loading)."""

    def __init__(
        self,
        backend: Any,
        *,
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
        special_token_ids: Sequence[int] = (),
        is_hf: bool = False,
        chat_template: ChatTemplate | None = None,
    ):
        self._backend = backend  # tokenizers.Tokenizer, or a transformers tokenizer if is_hf
        self._is_hf = is_hf
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(set(eos_token_ids)))
        self.bos_token_id = bos_token_id
        self.special_token_ids: frozenset[int] = frozenset(special_token_ids)
        self.chat_template = chat_template  # None: the model has none (chat is rejected)
        self._token_texts: dict[int, str] = {}  # token id -> decode([id]) (`token_text`)
        # decode(a + b) == decode(a) + decode(b) whenever decode(b) holds no U+FFFD: true of
        # the ByteLevel decoder (GPT-2, Llama 3, Qwen, SmolLM2), which joins the tokens'
        # bytes and decodes them as UTF-8 with replacement -- b's bytes then start a
        # character, so an incomplete one at a's end is replaced as it is at the end of
        # the input. The detokenizer skips decoding by it. Not true of SentencePiece's
        # Metaspace (it strips the first token's space), nor of no decoder at all (tokens
        # joined with spaces). Checked on pairs of this tokenizer's tokens as it loads
        # (`_concatenates`), not taken from the decoder's type alone.
        if is_hf:
            self.vocab_size: int = len(backend)
        else:
            self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.decodes_by_concatenation = not is_hf and _is_byte_level(backend.decoder) \
            and self._concatenates(_CONCAT_CHECK_PAIRS)

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_dir(cls, model_dir: str | Path, chat_template: str | None = None) -> Tokenizer:
        """Load `model_dir`'s tokenizer (tokenizer.json with `tokenizers`, else AutoTokenizer)
        and its chat template, or `chat_template` in its place (--chat-template: a file or
        the template; ValueError when it is neither or does not compile)."""
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise ValueError(f"model directory {model_dir} does not exist")
        eos = set(read_eos_token_ids(model_dir))
        tok_config = _read_json(model_dir / "tokenizer_config.json")
        chat_template = ChatTemplate.given(chat_template, model_dir) if chat_template \
            else ChatTemplate.from_dir(model_dir)
        path = model_dir / "tokenizer.json"
        if path.is_file():
            from tokenizers import Tokenizer as RustTokenizer

            backend = RustTokenizer.from_file(str(path))
            _apply_hf_post_processor(backend, tok_config)
            special = {
                tid for tid, tok in backend.get_added_tokens_decoder().items() if tok.special
            }
            bos = _token_content(tok_config.get("bos_token"))
            bos_id = backend.token_to_id(bos) if bos is not None else None
            eos_tok = _token_content(tok_config.get("eos_token"))
            if not eos and eos_tok is not None and backend.token_to_id(eos_tok) is not None:
                eos.add(backend.token_to_id(eos_tok))
            return cls(backend, eos_token_ids=eos, bos_token_id=bos_id, special_token_ids=special,
                       chat_template=chat_template)
        try:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - any loader failure is one clear message
            raise ValueError(f"cannot load a tokenizer from {model_dir}: {exc}") from exc
        if not eos and hf.eos_token_id is not None:
            eos.add(hf.eos_token_id)
        return cls(
            hf,
            eos_token_ids=eos,
            bos_token_id=hf.bos_token_id,
            special_token_ids=hf.all_special_ids,
            is_hf=True,
            chat_template=chat_template,
        )

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with the tokenizer's default special tokens (BOS as HF adds it)
        unless `add_special_tokens` is False (a rendered chat template: it wrote its own).
        Special tokens written in the text are recognised either way, as HF does."""
        if self._is_hf:
            return list(self._backend.encode(text, add_special_tokens=add_special_tokens))
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `token_ids` (incomplete UTF-8 at the ends decodes to U+FFFD). The
        detokenizer calls this once or twice a generated token: a list is passed on as it
        is."""
        if skip_special_tokens:
            token_ids = [t for t in token_ids if t not in self.special_token_ids]
        elif type(token_ids) is not list:
            token_ids = list(token_ids)
        return self._backend.decode(token_ids, skip_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        """`decode([token_id])`, remembered: the detokenizer decodes its one-token window
        after nearly every token, and logprobs name tokens one by one. Decoding is a pure
        function of the ids, so the cache is exact; it holds at most the vocabulary."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.decode([token_id])
        return text

    def _concatenates(self, num_pairs: int) -> bool:
        """Whether decode([a, b]) == decode([a]) + decode([b]) for `num_pairs` pairs spread
        over the vocabulary (the special tokens among them) wherever decode([b]) holds no
        U+FFFD: the ByteLevel decoder's rule, checked on this tokenizer as loaded before
        the detokenizer relies on it (~2 ms for a 49k vocabulary)."""
        n = self.vocab_size
        if n < 2:
            return True
        ids = sorted(self.special_token_ids)[:64]
        step = max(1, n // num_pairs)
        ids += list(range(0, n, step))[:num_pairs]
        for a, b in zip(ids, ids[1:] + ids[:1], strict=True):
            for first, second in ((a, b), (b, a)):
                tail = self.decode([second])
                if "\ufffd" in tail:
                    continue
                if self.decode([first, second]) != self.decode([first]) + tail:
                    return False
        return True

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_token_ids

    def token_id(self, token: str) -> int | None:
        """The id of the token whose text is `token` (an added token's content, or a
        vocabulary entry as the model stores it); None when there is none."""
        if self._is_hf:
            tid = self._backend.convert_tokens_to_ids(token)
            return None if tid is None or tid == self._backend.unk_token_id else tid
        return self._backend.token_to_id(token)


def _is_byte_level(decoder: Any) -> bool:
    from tokenizers import decoders

    return isinstance(decoder, decoders.ByteLevel)


_CONCAT_CHECK_PAIRS = 512


def _apply_hf_post_processor(backend: Any, tok_config: dict[str, Any]) -> None:
    """Mirror transformers: when tokenizer_config.json sets add_bos_token/add_eos_token
    explicitly (or tokenizer.json has no post-processor), the post-processor is rebuilt as
    `[BOS] $A [EOS]` from those flags (each defaulting to False)."""
    from tokenizers import processors

    explicit = "add_bos_token" in tok_config or "add_eos_token" in tok_config
    if not explicit:
        return  # no post-processor and no flags: the rebuilt template adds nothing either
    bos = _token_content(tok_config.get("bos_token"))
    eos = _token_content(tok_config.get("eos_token"))
    add_bos = bool(tok_config.get("add_bos_token", False)) and bos is not None
    add_eos = bool(tok_config.get("add_eos_token", False)) and eos is not None
    add_bos = add_bos and backend.token_to_id(bos) is not None
    add_eos = add_eos and backend.token_to_id(eos) is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    special = []
    if add_bos:
        special.append((bos, backend.token_to_id(bos)))
    if add_eos:
        special.append((eos, backend.token_to_id(eos)))
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=special
    )
