"""Fill-in-the-middle: `suffix` on POST /v1/completions. The prompt is the code before the
cursor, `suffix` the code after it, and the completion is what goes between, as code
models trained for it (Qwen2.5-Coder, Codestral, DeepSeek-Coder, StarCoder) write it when
the two are framed by their FIM tokens.

The frame is the model's, found in its tokenizer's vocabulary when the server starts: the
first of `FORMATS` whose tokens are all there. A model with none refuses `suffix` with a
400 naming the field (vLLM refuses `suffix` whatever the model).

* `qwen`: ``<|fim_prefix|>`` prompt ``<|fim_suffix|>`` suffix ``<|fim_middle|>``
  (Qwen2.5-Coder and later Qwen coders);
* `starcoder`: the same with ``<fim_prefix>`` ``<fim_suffix>`` ``<fim_middle>``
  (StarCoder, Granite Code, and models trained on their tokenizer);
* `deepseek`: ``<｜fim▁begin｜>`` prompt ``<｜fim▁hole｜>`` suffix ``<｜fim▁end｜>``
  (DeepSeek-Coder);
* `mistral`: ``[SUFFIX]`` suffix ``[PREFIX]`` prompt, the suffix first (Codestral, as
  mistral-common encodes a FIM request).

The prompt and the suffix are tokenized apart and the frame's tokens go in by id. The
prompt is a text of its own (a SentencePiece tokenizer gives it its leading space);
mistral-common encodes the suffix without that space (``[SUFFIX]return▁a[PREFIX]▁def``):
for `mistral` the suffix is tokenized as the text after its marker (`infill_suffix`),
which a byte-level tokenizer encodes the same either way. Within the two texts, special
tokens written out are recognised, as in every prompt here (and in transformers'
tokenizers). The first marker is encoded with the tokenizer's own special tokens (BOS
where the model has one) unless the request sends `add_special_tokens: false`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb

from .openai_fields import bad
from .tokenizer import Tokenizer

PROMPT, SUFFIX = "{prompt}", "{suffix}"  # the two texts' places in a frame


@dataclass(frozen=True)
class FimFormat:
    name: str
    frame: tuple[str, ...]  # marker tokens' texts, PROMPT and SUFFIX, in order
    infill_suffix: bool = False  # the suffix tokenized as the text after its marker

    @property
    def markers(self) -> tuple[str, ...]:
        return tuple(p for p in self.frame if p not in (PROMPT, SUFFIX))


FORMATS = (
    FimFormat("qwen", ("<|fim_prefix|>", PROMPT, "<|fim_suffix|>", SUFFIX, "<|fim_middle|>")),
    FimFormat("starcoder", ("<fim_prefix>", PROMPT, "<fim_suffix>", SUFFIX, "<fim_middle>")),
    FimFormat("deepseek", ("<｜fim▁begin｜>", PROMPT, "<｜fim▁hole｜>", SUFFIX,
                           "<｜fim▁end｜>")),
    FimFormat("mistral", ("[SUFFIX]", SUFFIX, "[PREFIX]", PROMPT), infill_suffix=True),
)
MARKERS_NAMED = "; ".join(" ".join(f.markers) for f in FORMATS)  # for the 400's message


class FillInMiddle:
    """One tokenizer's FIM frame (`of`), and the prompt token ids it makes."""

    def __init__(self, tokenizer: Tokenizer, form: FimFormat, ids: dict[str, int]) -> None:
        self.tokenizer = tokenizer
        self.form = form
        self._ids = ids  # marker text -> token id

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> FillInMiddle | None:
        """The first format whose markers are all tokens of `tokenizer`; None: none is."""
        for form in FORMATS:
            ids = {m: tokenizer.token_id(m) for m in form.markers}
            if None not in ids.values():
                return cls(tokenizer, form, ids)
        return None

    @property
    def name(self) -> str:
        return self.form.name

    def token_ids(self, prompt: str, suffix: str, add_special_tokens: bool = True) -> list[int]:
        """The prompt's token ids: `prompt` and `suffix` in the frame."""
        tok = self.tokenizer
        ids: list[int] = []
        for i, piece in enumerate(self.form.frame):
            if piece == PROMPT:
                ids += tok.encode(prompt, add_special_tokens=False)
            elif piece == SUFFIX and self.form.infill_suffix and i > 0:
                marker = self._ids[self.form.frame[i - 1]]
                after = tok.encode(self.form.frame[i - 1] + suffix, add_special_tokens=False)
                ids += after[1:] if after[:1] == [marker] else \
                    tok.encode(suffix, add_special_tokens=False)
            elif piece == SUFFIX:
                ids += tok.encode(suffix, add_special_tokens=False)
            elif i == 0 and add_special_tokens:  # the tokenizer's own head (BOS) before it
                head = tok.encode(piece, add_special_tokens=True)
                marker = self._ids[piece]
                ids += head[:head.index(marker) + 1] if marker in head else [marker]
            else:
                ids.append(self._ids[piece])
        return ids

    def requests(self, prompt, suffix: str, params: pb.SamplingParams,
                 common: dict) -> list[pb.GenerateRequest]:
        """A completions body's text prompt (a string or an array of strings) framed with
        `suffix`: one request each, by token ids (InvalidRequest naming the field)."""
        if common.get("truncate_prompt_tokens"):  # (it would cut the frame's head off)
            raise bad("truncate_prompt_tokens", "cannot be combined with suffix")
        texts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(texts, list) or not texts \
                or not all(isinstance(t, str) for t in texts):
            raise bad("prompt", "with suffix, must be a string or an array of strings")
        special = common.get("add_special_tokens", True)
        return [pb.GenerateRequest(prompt_token_ids=pb.TokenIds(
                    ids=self.token_ids(text, suffix, special)), params=params, **common)
                for text in texts]
