"""`--chat-template` (ChatTemplate.given): a Jinja file or the template itself in place of the
model's; a model without a template then serves chat; a bad one fails the router's start in
one line. (The same router shows `--generation-config auto` reading the model's defaults.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest
from cluster_harness import router_alone
from pagedserve.router.chat_template import ChatTemplate
from pagedserve.router.tokenizer import Tokenizer

CLI = [sys.executable, "-m", "pagedserve.cli"]
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
RENDERED = "<system>Be brief.\n<user>Hi\n<assistant>"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny model whose tokenizer has no chat template (the built one's taken away)."""
    from pagedserve.tinymodels import build_model
    path = build_model(tmp_path_factory.mktemp("tmpl") / "tiny", hidden_size=32, num_layers=1,
                       num_heads=2, num_kv_heads=1, intermediate_size=64)
    (path / "chat_template.jinja").unlink()
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.5}))
    assert Tokenizer.from_dir(path).chat_template is None
    return str(path)


def _text(template: ChatTemplate) -> str:
    return template.render(MESSAGES)


def test_given_a_file_or_the_template_itself(model_dir, tmp_path):
    f = tmp_path / "chat.jinja"
    f.write_text(TEMPLATE)
    from_file = ChatTemplate.given(str(f), model_dir)
    assert from_file.origin == str(f) and _text(from_file) == RENDERED
    inline = TEMPLATE.replace("\n", "\\n")  # one line: its escapes decoded
    assert "\n" not in inline
    assert _text(ChatTemplate.given(inline, model_dir)) == RENDERED
    with_bos = ChatTemplate.given("{{ bos_token }}{{ messages[0]['content'] }}", model_dir)
    assert with_bos.render(MESSAGES) == with_bos.special_tokens["bos_token"] + "Be brief."
    for bad, why in [(str(tmp_path / "missing.jinja"), "no such file"),
                     ("{% for m in messages %}", "does not compile")]:
        with pytest.raises(ValueError, match=why):
            ChatTemplate.given(bad, model_dir)


def test_tokenizer_takes_it_in_place_of_the_models(model_dir, tmp_path):
    f = tmp_path / "chat.jinja"
    f.write_text(TEMPLATE)
    tok = Tokenizer.from_dir(model_dir, str(f))
    assert _text(tok.chat_template) == RENDERED
    with pytest.raises(ValueError, match="no such file"):
        Tokenizer.from_dir(model_dir, str(tmp_path / "nope"))


def test_router_serves_chat_with_it_and_refuses_a_bad_one(model_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    f = tmp_path / "chat.jinja"
    f.write_text(TEMPLATE)
    bad = subprocess.run(CLI + ["router", "--model", model_dir, "--chat-template",
                                "{% if %}"], capture_output=True, text=True, env=env,
                         timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    (line,) = bad.stderr.strip().splitlines()
    assert line.startswith("pagedserve router: chat template (--chat-template) does not compile")
    with router_alone(model_dir, "--chat-template", str(f), env=env) as (ready, lines, _):
        # --generation-config auto (the default) read the model's sampling defaults
        assert any("sampling defaults from" in x and "temperature=0.5" in x for x in lines), \
            "".join(lines)
        body = json.dumps({"messages": MESSAGES}).encode()
        req = urllib.request.Request(f"http://{ready.group(4)}/tokenize", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as reply:
            tokens = json.loads(reply.read())["tokens"]
    tok = Tokenizer.from_dir(model_dir)
    assert tokens == tok.encode(RENDERED, add_special_tokens=False)
