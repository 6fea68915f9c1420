"""Structured output's forced tokens as drafts, the router's side (router/grammar_drafts.py):
a cursor follows a constrained sample's output and drafts what its format forces, exactly
(the tiny tokenizer's canonical split); n-gram drafts are cut where the format refuses one;
the drafter drafts nothing under a grammar until the vocabulary index is built, and
builds it off the caller's thread; grammars compile in a worker thread, once per text."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest
from pagedserve.router import grammar_drafts
from pagedserve.router.grammar_drafts import FormatDrafts
from pagedserve.router.speculative import (
    MAX_BACKOFF,
    MAX_SPECULATIVE_TOKENS,
    Drafter,
    SpeculativeConfig,
)
from pagedserve.router.structured import build_grammar
from pagedserve.router.types import RequestSpec
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


def _compiled(formats, grammar: str):
    """A cursor of `grammar` once the worker has compiled it."""
    cursor = formats.cursor(grammar)
    deadline = time.monotonic() + 30
    while cursor.pending:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    return cursor


def test_a_cursor_drafts_what_the_schema_forces(formats, tok):
    cursor = _compiled(formats, build_grammar("json_schema", SCHEMA))
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
    cursor = _compiled(formats, build_grammar("choice", ["alpha centauri", "beta"]))
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
        self.group = SimpleNamespace(spec=RequestSpec(seq_id, (1,)))  # (no prediction)


def test_the_drafter_drafts_forced_tokens_then_lookup_within_the_format(formats, tok):
    drafter = Drafter(SpeculativeConfig(8, 3, 1), formats)
    forcing = build_grammar("regex", "(ab|cd)-ab-ab-ab")
    free = build_grammar("regex", "(ab|cd)(-ab|-cd)*")
    _compiled(formats, forcing), _compiled(formats, free)  # (the drafter's cursors copy them)
    seq = _Seq("a#0", _ids(tok, "x"), _ids(tok, "a"))
    forced = drafter.decode(seq, 10, forcing)
    assert tok.decode(forced) == "b-ab-ab-ab"  # forced in full, whatever the draft length
    assert drafter.decode(seq, 2, forcing) == forced[:2]  # the limit binds
    # nothing forced after "ab" (a dash or the end): the lookup finds what followed the
    # latest "-ab" in the prompt, cut before " z", which the format refuses
    seq2 = _Seq("b#0", _ids(tok, "cd-ab-cd-ab-cd z"), _ids(tok, "cd-ab"))
    assert tok.decode(drafter.decode(seq2, 10, free)) == "-cd"
    assert drafter.decode(_Seq("c#0", [5], []), 10, free) == []  # nothing to look up
    seq.num_pending = 1  # a token in flight: its format's place is not known
    assert drafter.decode(seq, 10, forcing) == []
    # a long forced text: at most MAX_SPECULATIVE_TOKENS drafts a row, whatever the limit
    long = build_grammar("regex", "(ab|cd)" + "-ab" * 30)
    _compiled(formats, long)
    seq3 = _Seq("d#0", _ids(tok, "x"), _ids(tok, "cd"))
    drafts = drafter.decode(seq3, 100, long)
    assert len(drafts) == MAX_SPECULATIVE_TOKENS == 15
    assert tok.decode(drafts) == "-ab" * 7 + "-"


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


def test_a_grammar_compiles_once_in_the_worker_and_cursors_copy_it(formats, tok, monkeypatch):
    """Each cursor of one grammar text copies the one compiled matcher (their places are
    their own); the compile runs in the worker thread, and while it does, a sample's
    decode drafts nothing and looks again after one decode (no back-off)."""
    gate, threads = threading.Event(), []
    compile_ = grammar_drafts._compile

    def gated(compiled, lltok, grammar):
        threads.append(threading.current_thread().name)
        gate.wait(30)
        compile_(compiled, lltok, grammar)

    monkeypatch.setattr(grammar_drafts, "_compile", gated)
    grammar = build_grammar("regex", "(ab|cd)=ef=gh")
    drafter = Drafter(SpeculativeConfig(4, 3, 1), formats)
    seq = _Seq("p#0", _ids(tok, "x"), _ids(tok, "ab"))
    assert drafter.decode(seq, 10, grammar) == []  # compiling
    assert not drafter.wants_drafts(seq)  # skips one decode, then looks again
    assert drafter.decode(seq, 10, grammar) == [] and drafter.wants_drafts(seq)
    other = formats.cursor(grammar)
    assert other.pending and other.forced() == [] and other.allowed([5]) == []
    gate.set()
    first = _compiled(formats, grammar)
    assert threads == ["grammar-drafts_0"]  # one compile, in the worker
    assert first.compiled is other.compiled
    assert tok.decode(drafter.decode(seq, 10, grammar)) == "=ef=gh"
    # the drafter's cursor has followed "ab"; the others still stand at the start
    assert first.forced() == [] and not first.failed
    first.follow(_ids(tok, "cd"))
    assert tok.decode(first.forced()) == "=ef=gh"
    assert tok.decode(drafter.decode(seq, 10, grammar)) == "=ef=gh"


def test_a_grammar_that_does_not_compile_backs_off(formats, tok):
    drafter = Drafter(SpeculativeConfig(4, 3, 1), formats)
    broken = "start: /[/"
    assert _compiled(formats, broken).failed
    seq = _Seq("q#0", _ids(tok, "ab ab"), _ids(tok, "ab"))
    assert drafter.decode(seq, 10, broken) == []
    assert drafter._of(seq).skip == MAX_BACKOFF


def test_the_least_recently_used_grammar_is_dropped(formats, monkeypatch):
    monkeypatch.setattr(grammar_drafts, "MAX_COMPILED", 2)
    local = FormatDrafts(formats.vocab, formats.eos_token_ids)
    a, b, c = (build_grammar("regex", r) for r in ("a+", "b+", "c+"))
    kept_a = _compiled(local, a).compiled
    _compiled(local, b)
    assert _compiled(local, a).compiled is kept_a  # used again: now the newest
    _compiled(local, c)  # drops b, the least recently used
    assert list(local._compiled) == [a, c]
    assert _compiled(local, a).compiled is kept_a
    assert _compiled(local, b).compiled is not None and list(local._compiled) == [a, b]
    local.close()


def test_the_benchmark_replay_counts_drafts_by_source(formats, tok):
    """benchmarks/grammar_drafts_bench.py's replay walks an output decode by decode through
    the drafter: exact draft counts by source."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from grammar_drafts_bench import replay

    forcing = build_grammar("regex", "(ab|cd)-ab-ab-(ab|cd)")
    free = build_grammar("regex", "(ab|cd)(-ab|-cd)*")
    _compiled(formats, forcing), _compiled(formats, free)
    drafter = Drafter(SpeculativeConfig(4, 3, 1), formats)
    # "c", "d" (a choice; nothing to look up, then one decode skipped), then "-ab-ab-"
    # forced and confirmed with the "c" after it, then "d" forced
    assert replay(drafter, forcing, "a#0", _ids(tok, "x"), _ids(tok, "cd-ab-ab-cd")) == {
        "forced": [6, 6], "lookup": [0, 0], "decodes": 4}
    # nothing forced: the prompt's "-cd-ab" drafted (cut where the format refuses), the
    # second lookup's last draft rejected
    assert replay(drafter, free, "b#0", _ids(tok, "ab-cd-ab-cd"), _ids(tok, "ab-cd-ab-ab")) \
        == {"forced": [0, 0], "lookup": [5, 4], "decodes": 4}
