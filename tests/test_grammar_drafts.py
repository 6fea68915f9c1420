"""Structured output's forced tokens as drafts, the router's side (router/grammar_drafts.py):
a cursor follows a constrained sample's output and drafts what its format forces, exactly
(the tiny tokenizer's canonical split); n-gram drafts are cut where the format refuses one;
the drafter drafts nothing under a grammar until the vocabulary index is built, and
builds it off the caller's thread."""

from __future__ import annotations

import json
import time

import pytest
from pagedserve.router.grammar_drafts import FormatDrafts
from pagedserve.router.speculative import Drafter, SpeculativeConfig
from pagedserve.router.structured import build_grammar
from tokenizers import Tokenizer

from pagedserve.grammar_vocab import GrammarVocab
from pagedserve.tinymodels import build_tokenizer

SCHEMA = json.dumps({"type": "object", "additionalProperties": False,
                     "required": ["city", "country"],
                     "properties": {"city": {"type": "string"}, "country": {"type": "string"}}})


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("grammar_drafts") / "tok"
    build_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def formats(tokenizer_dir):
    formats = FormatDrafts(GrammarVocab(tokenizer_dir / "tokenizer.json", 512), (2,))
    deadline = time.monotonic() + 30
    while not formats.ready():  # built in a thread
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return formats


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def test_a_cursor_drafts_what_the_schema_forces(formats, tok):
    cursor = formats.cursor(build_grammar("json_schema", SCHEMA))
    assert tok.decode(cursor.forced()) == '{"city": "'
    out = _ids(tok, '{"city": "Par')
    cursor.follow(out)
    assert cursor.forced() == []  # the string may go on or end: a choice
    out += _ids(tok, 'is"')
    cursor.follow(out)
    forced = cursor.forced()
    assert tok.decode(forced) == ', "country": "'  # the only key left, required
    # llguidance's canonical split of the forced text, token for token
    assert forced == [14, 223, 4, 69, 81, 314, 86, 84, 91, 4, 28, 223, 4]
    cursor.follow(out + forced + _ids(tok, 'France"'))
    assert tok.decode(cursor.forced()) == "}"


def test_allowed_cuts_drafts_at_the_first_the_format_refuses(formats, tok):
    cursor = formats.cursor(build_grammar("choice", ["alpha centauri", "beta"]))
    assert cursor.forced() == []  # alpha or beta
    alpha = _ids(tok, "alpha")
    assert cursor.allowed(alpha + _ids(tok, "!") + alpha) == alpha
    assert cursor.allowed(_ids(tok, "gamma")) == []
    cursor.follow(alpha[:1])
    assert tok.decode(cursor.forced()) == "pha centauri"


class _Seq:
    def __init__(self, seq_id: str, prompt: list[int], output: list[int]) -> None:
        self.seq_id, self.token_ids, self.num_pending = seq_id, prompt + output, 0
        self.num_prompt_tokens = len(prompt)


def test_the_drafter_drafts_forced_tokens_then_lookup_within_the_format(formats, tok):
    drafter = Drafter(SpeculativeConfig(8, 3, 1), formats)
    forcing = build_grammar("regex", "(ab|cd)-ab-ab-ab")
    seq = _Seq("a#0", _ids(tok, "x"), _ids(tok, "a"))
    forced = drafter.decode(seq, 10, forcing)
    assert tok.decode(forced) == "b-ab-ab-ab"  # forced in full, whatever the draft length
    assert drafter.decode(seq, 2, forcing) == forced[:2]  # the limit binds
    # nothing forced after "ab" (a dash or the end): the lookup finds what followed the
    # latest "-ab" in the prompt, cut before " z", which the format refuses
    free = build_grammar("regex", "(ab|cd)(-ab|-cd)*")
    seq2 = _Seq("b#0", _ids(tok, "cd-ab-cd-ab-cd z"), _ids(tok, "cd-ab"))
    assert tok.decode(drafter.decode(seq2, 10, free)) == "-cd"
    assert drafter.decode(_Seq("c#0", [5], []), 10, free) == []  # nothing to look up
    seq.num_pending = 1  # a token in flight: its format's place is not known
    assert drafter.decode(seq, 10, forcing) == []


def test_no_grammar_drafts_until_the_index_is_built(tokenizer_dir):
    vocab = GrammarVocab(tokenizer_dir / "tokenizer.json", 512)
    formats = FormatDrafts(vocab, (2,))
    drafter = Drafter(SpeculativeConfig(4, 3, 1), formats)
    assert not formats.ready()  # the build started in a thread, not done at once
    assert drafter.decode(_Seq("a#0", [1, 2], [3]), 5, "start: /a+/") == []
    deadline = time.monotonic() + 30
    while not formats.ready():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert Drafter(SpeculativeConfig(4, 3, 1)).formats is None
    missing = FormatDrafts(GrammarVocab(tokenizer_dir / "missing.json", 512), (2,))
    assert not missing.ready()
    time.sleep(0.2)
    assert not missing.ready()  # logged, never built
