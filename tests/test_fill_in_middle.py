"""Fill-in-the-middle (`suffix` on /v1/completions, router/fill_in_middle.py): each model
family's frame found in its tokenizer, the exact prompt ids it makes (the prompt and the
suffix tokenized apart, markers by id), and the HTTP route's answers and refusals."""

from __future__ import annotations

import pytest
from pagedserve.router.fill_in_middle import FORMATS, FillInMiddle
from pagedserve.router.tokenizer import Tokenizer

PREFIX_TEXT = "def add(a, b):\n    "
SUFFIX_TEXT = "\n\nprint(add(1, 2))"


def fim_tokenizer(folder, markers: tuple[str, ...]) -> Tokenizer:
    """The test tokenizer (tinymodels: byte-level BPE, BOS <s> on every text) with
    `markers` added as special tokens."""
    from tokenizers import Tokenizer as HFTokenizer

    from pagedserve.tinymodels import build_tokenizer
    build_tokenizer(folder)
    raw = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    raw.add_special_tokens(list(markers))
    raw.save(str(folder / "tokenizer.json"))
    return Tokenizer.from_dir(folder)


@pytest.mark.parametrize("form", FORMATS, ids=[f.name for f in FORMATS])
def test_each_frame_is_found_and_makes_the_exact_ids(tmp_path, form):
    tok = fim_tokenizer(tmp_path, form.markers)
    fim = FillInMiddle.of(tok)
    assert fim is not None and fim.name == form.name
    bos = tok.bos_token_id
    m = [tok.token_id(x) for x in form.markers]
    assert None not in m and all(tok.is_special(t) for t in m)
    p = tok.encode(PREFIX_TEXT, add_special_tokens=False)
    s = tok.encode(SUFFIX_TEXT, add_special_tokens=False)
    want = [m[0], *s, m[1], *p] if form.name == "mistral" else [m[0], *p, m[1], *s, m[2]]
    assert fim.token_ids(PREFIX_TEXT, SUFFIX_TEXT) == [bos, *want]
    assert fim.token_ids(PREFIX_TEXT, SUFFIX_TEXT, add_special_tokens=False) == want


def test_a_sentencepiece_tokenizer_frames_as_mistral_common_encodes(tmp_path):
    """Metaspace (SentencePiece's space, prepended to a text's start only): the prompt is
    a text of its own, with its leading space, and the suffix is the text after its marker,
    without one: mistral-common's ``<s>[SUFFIX]return▁a▁+▁b[PREFIX]▁def▁f(``."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers
    raw = HFTokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    raw.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    raw.train_from_iterator(["def f(a, b): return a + b", "print(f(1, 2))"] * 20,
                            trainers.BpeTrainer(vocab_size=200, show_progress=False,
                                                special_tokens=["<unk>", "<s>", "</s>",
                                                                "[SUFFIX]", "[PREFIX]"]))
    raw.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", raw.token_to_id("<s>"))])
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    tok = Tokenizer.from_dir(tmp_path)
    fim = FillInMiddle.of(tok)
    assert fim.name == "mistral"
    ids = fim.token_ids("def f(", "return a + b")
    pieces = [raw.id_to_token(t) for t in ids]
    cut = pieces.index("[PREFIX]")
    assert pieces[:2] == ["<s>", "[SUFFIX]"] and not pieces[2].startswith("▁")
    assert pieces[cut + 1].startswith("▁")  # the prompt's own leading space
    assert "".join(pieces[2:cut]).replace("▁", " ") == "return a + b"
    assert "".join(pieces[cut + 1:]).replace("▁", " ") == " def f("


def test_a_tokenizer_without_every_marker_has_no_frame(tmp_path):
    assert FillInMiddle.of(fim_tokenizer(tmp_path / "a", ())) is None
    assert FillInMiddle.of(fim_tokenizer(tmp_path / "b", ("<|fim_prefix|>",
                                                          "<|fim_suffix|>"))) is None
    both = fim_tokenizer(tmp_path / "c", ("[SUFFIX]", "[PREFIX]", "<fim_prefix>",
                                          "<fim_suffix>", "<fim_middle>"))
    assert FillInMiddle.of(both).name == "starcoder"  # the first of FORMATS found


# ------------------------------------------------------------------ the HTTP API

from http_rig import MODEL, _post, _run, scripted  # noqa: E402

QWEN = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
ANSWER = "return a + b"


@pytest.fixture(scope="module")
def qwen_tok(tmp_path_factory):
    return fim_tokenizer(tmp_path_factory.mktemp("fim"), QWEN)


def test_a_suffix_frames_the_prompt_and_the_middle_comes_back(qwen_tok):
    tok = qwen_tok
    fim = FillInMiddle.of(tok)

    async def main():
        async with scripted(tok, ANSWER) as (engine, session):
            body = {"model": MODEL, "prompt": PREFIX_TEXT, "suffix": SUFFIX_TEXT,
                    "max_tokens": 16}
            status, reply = await _post(session, "/v1/completions", body)
            assert status == 200, reply
            assert reply["choices"][0]["text"] == ANSWER
            spec = engine.submitted[-1]
            assert list(spec.prompt_token_ids) == fim.token_ids(PREFIX_TEXT, SUFFIX_TEXT)
            assert reply["usage"]["prompt_tokens"] == len(spec.prompt_token_ids)
            # an array of prompts: each framed with the suffix; an empty suffix frames too
            status, reply = await _post(session, "/v1/completions",
                                        {**body, "prompt": ["x = ", "y = "], "suffix": ""})
            assert status == 200 and len(reply["choices"]) == 2
            assert [list(s.prompt_token_ids) for s in engine.submitted[-2:]] == [
                fim.token_ids("x = ", ""), fim.token_ids("y = ", "")]
            status, _ = await _post(session, "/v1/completions",
                                    {**body, "add_special_tokens": False})
            assert status == 200
            assert list(engine.submitted[-1].prompt_token_ids) == fim.token_ids(
                PREFIX_TEXT, SUFFIX_TEXT, add_special_tokens=False)
            # a null suffix is none: the prompt as it is
            status, _ = await _post(session, "/v1/completions", {**body, "suffix": None})
            assert status == 200
            assert list(engine.submitted[-1].prompt_token_ids) == tok.encode(PREFIX_TEXT)
            for extra, param in (({"echo": True}, "echo"),
                                 ({"prompt": [1, 2, 3]}, "prompt"),
                                 ({"prompt": ["a", [1, 2]]}, "prompt"),
                                 ({"suffix": 7}, "suffix"),
                                 ({"truncate_prompt_tokens": 4}, "truncate_prompt_tokens")):
                status, reply = await _post(session, "/v1/completions", {**body, **extra})
                assert status == 400 and reply["error"]["param"] == param, (extra, reply)

    _run(main())


def test_a_model_without_fim_tokens_refuses_a_suffix(tmp_path):
    tok = fim_tokenizer(tmp_path, ())

    async def main():
        async with scripted(tok, ANSWER) as (_, session):
            status, reply = await _post(session, "/v1/completions", {
                "model": MODEL, "prompt": PREFIX_TEXT, "suffix": SUFFIX_TEXT})
            assert status == 400 and reply["error"]["param"] == "suffix"
            assert "<|fim_prefix|>" in reply["error"]["message"]

    _run(main())
