"""A model directory's chat template, rendered as transformers' `apply_chat_template` does.

Torch-free: transformers' own renderer (`render_jinja_template`: a sandboxed jinja2 with
`raise_exception`, `strftime_now` and its `tojson`) is imported without its model code, and
the template sees the special tokens of tokenizer_config.json (`bos_token`, `eos_token`, ...)
as apply_chat_template passes them. The template is `chat_template.jinja` (transformers 5),
else tokenizer_config.json's `chat_template` (a string, or a list of named templates of
which `default` is used).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
            "mask_token")


class ChatTemplate:
    def __init__(self, template: str, special_tokens: dict[str, str]) -> None:
        self.template = template
        self.special_tokens = special_tokens

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The directory's template, or None when it has none."""
        model_dir = Path(model_dir)
        config = _read_json(model_dir / "tokenizer_config.json")
        template = None
        jinja = model_dir / "chat_template.jinja"
        if jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        else:
            value = config.get("chat_template")
            if isinstance(value, list):
                named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
                value = named.get("default")
            template = value if isinstance(value, str) else None
        if not template:
            return None
        special = {}
        for key in _SPECIAL:
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                special[key] = value
        return cls(template, special)

    def render(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
               **kwargs) -> str:
        """The prompt text for `messages` ({"role", "content"} dicts), with the assistant's
        generation prompt appended unless asked otherwise."""
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template(
            conversations=[list(messages)], chat_template=self.template,
            add_generation_prompt=add_generation_prompt, **{**self.special_tokens, **kwargs})
        return rendered[0]


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
