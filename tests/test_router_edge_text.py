"""Router edge: tokenizer, incremental detokenizer, stop strings (TextAssembler), validation."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
from pagedserve.router.detokenizer import IncrementalDetokenizer, TextAssembler
from pagedserve.router.errors import InvalidRequest
from pagedserve.router.tokenizer import Tokenizer, read_eos_token_ids
from pagedserve.router.types import SamplingSpec
from pagedserve.router.validation import Limits, request_from_pb, sampling_from_pb

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from pagedserve.tinymodels import build_tokenizer

    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


class CharTokenizer:
    """A fake tokenizer whose tokens are given strings (for exact stop-string tests)."""

    def __init__(self, pieces, special=(), eos=()):
        self.pieces = list(pieces)
        self.special_token_ids = frozenset(special)
        self.eos_token_ids = tuple(eos)

    def is_special(self, t):
        return t in self.special_token_ids

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.pieces[i] for i in ids)

    def token_text(self, t):
        return self.decode([t])

    def ids(self, *pieces):
        return [self.pieces.index(p) for p in pieces]


def run(assembler, ids):
    """Feed ids until finished; return (chunks, last update, number fed)."""
    chunks, update, fed = [], None, 0
    for t in ids:
        update = assembler.append(t)
        fed += 1
        chunks.append(update.text)
        if update.finished:
            break
    else:
        chunks.append(assembler.finish("abort"))
    return chunks, update, fed


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_matches_transformers(tok, tok_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    for text in ["Hello, world!", "日本語のテキスト 🙂🚀", " leading space", "a\nb\tc"]:
        assert tok.encode(text) == hf.encode(text)
        assert tok.encode(text)[0] == tok.bos_token_id == 0  # BOS as HF adds it
    assert tok.vocab_size == len(hf)
    assert tok.eos_token_ids == (1,)
    assert tok.special_token_ids == {0, 1, 2}
    ids = tok.encode("Hello 🙂")
    assert tok.decode(ids, skip_special_tokens=True) == "Hello 🙂"
    assert tok.decode(ids).startswith("<s>")


def test_eos_union_and_add_bos_flag(tok_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tok_dir / name).read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert read_eos_token_ids(tmp_path) == (1, 2, 5)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = False
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer.from_dir(tmp_path)
    assert t.eos_token_ids == (1, 2, 5)
    assert t.encode("Hello")[0] != 0


def test_missing_model_dir_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nope")
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        Tokenizer.from_dir(tmp_path)


# --------------------------------------------------------------------------- detokenizer


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_stream_equals_decode_for_random_ids(tok, data):
    ids = data.draw(st.lists(st.integers(3, tok.vocab_size - 1), min_size=1, max_size=40))
    detok = IncrementalDetokenizer(tok, [0])
    chunks = [detok.push(t) for t in ids]
    for c in chunks:
        assert not c.endswith(REPLACEMENT) or c.count(REPLACEMENT) < len(c)
    chunks.append(detok.flush())
    assert "".join(chunks) == tok.decode(ids)


class _Undecorated:
    """`tok` decoding every window afresh: no remembered token texts, no concatenation."""

    decodes_by_concatenation = False

    def __init__(self, tok):
        self._tok = tok
        self.special_token_ids = tok.special_token_ids
        self.num_decodes = 0

    def decode(self, ids, skip_special_tokens=False):
        self.num_decodes += 1
        return self._tok._backend.decode(list(ids), skip_special_tokens=False)

    def is_special(self, t):
        return self._tok.is_special(t)

    def token_text(self, t):
        return self.decode([t])


class _Counting(_Undecorated):
    """`tok`'s own shortcuts, counting the decodes they leave."""

    decodes_by_concatenation = True

    def token_text(self, t):
        return self._tok.token_text(t)


def _chunks(detok, ids):
    return [detok.push(t) for t in ids] + [detok.flush()]


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_detokenizer_shortcuts_change_no_chunk(tok, data):
    # The detokenizer takes a one-token window's text from the tokenizer's memory
    # (`Tokenizer.token_text`) and, with a concatenating decoder, a whole token's text after
    # a whole window without decoding; the chunks are those of decoding the window every
    # time. Random ids (byte tokens that split characters, special tokens, held windows)
    # and token streams of real text.
    vocab = st.integers(0, tok.vocab_size - 1)
    prompt = data.draw(st.lists(vocab, max_size=8))
    if data.draw(st.booleans()):
        ids = data.draw(st.lists(vocab, min_size=1, max_size=60))
    else:
        ids = tok.encode(data.draw(_TEXT), add_special_tokens=False)
    skip = data.draw(st.booleans())
    assert tok.decodes_by_concatenation
    fast = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    plain = IncrementalDetokenizer(_Undecorated(tok), prompt, skip_special_tokens=skip)
    assert _chunks(fast, ids) == _chunks(plain, ids)
    for t in ids:
        assert tok.token_text(t) == tok.decode([t])
    assert len(tok._token_texts) <= tok.vocab_size


def test_whole_tokens_of_a_concatenating_decoder_decode_nothing(tok):
    ids = tok.encode("Hello, world! Paris is the capital of France.", add_special_tokens=False)
    counting, plain = _Counting(tok), _Undecorated(tok)
    prompt = tok.encode("The", add_special_tokens=False)
    chunks = _chunks(IncrementalDetokenizer(counting, prompt), ids)
    assert chunks == _chunks(IncrementalDetokenizer(plain, prompt), ids)
    assert "".join(chunks) == tok.decode(ids)
    assert counting.num_decodes == 1  # the prompt context's, once
    assert plain.num_decodes == 1 + 2 * len(ids)


def test_only_byte_level_decoders_count_as_concatenating(tmp_path):
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "\u2581Hello": 1, "\u2581world": 2}
    cases = {"ByteLevel": decoders.ByteLevel(), "Metaspace": decoders.Metaspace(),
             "none": None}
    for name, decoder in cases.items():
        rust = RustTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        if decoder is not None:
            rust.decoder = decoder
        rust.save(str(tmp_path / "tokenizer.json"))
        loaded = Tokenizer.from_dir(tmp_path)
        assert loaded.decodes_by_concatenation is (name == "ByteLevel"), name
    # Metaspace strips the first token's space: decode([1, 2]) is not decode([1]) +
    # decode([2]), and the detokenizer still gives the text of the whole.
    rust.decoder = decoders.Metaspace()
    rust.save(str(tmp_path / "tokenizer.json"))
    meta = Tokenizer.from_dir(tmp_path)
    assert meta.decode([1]) + meta.decode([2]) == "Helloworld" != meta.decode([1, 2])
    assert "".join(_chunks(IncrementalDetokenizer(meta), [1, 2])) == "Hello world"


def test_a_byte_level_decoder_that_does_not_concatenate_is_found_at_load():
    # The rule is checked on the tokenizer as loaded, not taken from the decoder's type:
    # a backend announcing ByteLevel whose decode joins tokens with spaces keeps the
    # general path.
    from tokenizers import decoders

    class Spaced:
        decoder = decoders.ByteLevel()

        def get_vocab_size(self, with_added_tokens=True):
            return 300

        def decode(self, ids, skip_special_tokens=False):
            return " ".join(f"t{i}" for i in ids)

    assert Tokenizer(Spaced()).decodes_by_concatenation is False
    Spaced.decode = lambda self, ids, skip_special_tokens=False: "".join(f"t{i}" for i in ids)
    assert Tokenizer(Spaced()).decodes_by_concatenation is True


_TEXT = st.text(alphabet="ab c日本語🙂🚀éx\n", min_size=1, max_size=30)


@settings(max_examples=150, deadline=None)
@given(text=_TEXT)
def test_multibyte_split_across_tokens_never_emits_half_a_char(tok, text):
    # Byte tokens: every multi-byte character is split across tokens.
    byte_ids = [tok._backend.token_to_id(_byte_token(b)) for b in text.encode("utf-8")]
    assert None not in byte_ids
    detok = IncrementalDetokenizer(tok, [0])
    chunks = [detok.push(t) for t in byte_ids]
    assert all(REPLACEMENT not in c for c in chunks)
    chunks.append(detok.flush())
    assert "".join(chunks) == text


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_ids_without_text_keep_the_window_bounded_and_the_text_exact(tok, data):
    """Ids that decode to nothing (past the tokenizer's vocabulary: a random model's, or a
    logit_bias target) between real text: the text comes out exactly, and the window holds
    fewer than _MAX_HELD_TOKENS unread tokens and at most twice that in all, however long
    the run (it used to grow, each token decoding the whole run again)."""
    from pagedserve.router.detokenizer import _MAX_HELD_TOKENS

    text = data.draw(st.text(alphabet="ab cxyz.,\n", min_size=1, max_size=30))
    ids = []
    for t in tok.encode(text):
        ids.append(t)
        run_len = data.draw(st.sampled_from([0, 0, 1, 15, 16, 17, 40]))
        ids += [tok.vocab_size + data.draw(st.integers(0, 1000)) for _ in range(run_len)]
    detok = IncrementalDetokenizer(tok, [0])
    chunks = []
    for t in ids:
        chunks.append(detok.push(t))
        assert len(detok._ids) - detok._read < _MAX_HELD_TOKENS
        assert len(detok._ids) <= 2 * _MAX_HELD_TOKENS
    chunks.append(detok.flush())
    assert "".join(chunks) == text


def test_bytes_that_never_form_a_character_are_emitted_as_replacements(tok):
    lead = tok._backend.token_to_id(_byte_token(0xE6))  # starts a 3-byte character
    lone = tok._backend.token_to_id(_byte_token(0x80))  # a continuation byte on its own
    a = tok.encode("a")
    detok = IncrementalDetokenizer(tok, [0])
    chunks = [detok.push(t) for t in [lead] + [tok.vocab_size + 7] * 20 + a]
    assert "".join(chunks) + detok.flush() == REPLACEMENT + "a"
    detok = IncrementalDetokenizer(tok, [0])
    chunks = [detok.push(lone) for _ in range(40)]
    assert "".join(chunks) == REPLACEMENT * 32  # two cuts of 16; the rest held
    assert "".join(chunks) + detok.flush() == tok.decode([lone] * 40) == REPLACEMENT * 40


def _byte_token(b: int) -> str:
    # GPT-2 byte-to-unicode map, as ByteLevel uses.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    cs = bs[:]
    n = 0
    for x in range(256):
        if x not in bs:
            bs.append(x)
            cs.append(256 + n)
            n += 1
    return chr(dict(zip(bs, cs, strict=True))[b])


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("Hello") + [2] + tok.encode(" world")[1:]  # BOS, text, <pad>, text
    skip = TextAssembler(tok, SamplingSpec(max_tokens=100), [0])
    keep = TextAssembler(tok, SamplingSpec(max_tokens=100, keep_special_tokens=True), [0])
    assert "".join(run(skip, ids)[0]) == "Hello world"
    assert "".join(run(keep, ids)[0]) == "<s>Hello<pad> world"


def test_eos_stops_and_is_not_in_text(tok):
    ids = tok.encode("Hi there")[1:] + [1] + tok.encode(" more")[1:]
    a = TextAssembler(tok, SamplingSpec(max_tokens=100, keep_special_tokens=True))
    chunks, update, fed = run(a, ids)
    assert "".join(chunks) == "Hi there"
    assert (update.finish_reason, update.stop_token_id, update.stop_string) == ("stop", 1, None)
    assert fed == len(tok.encode("Hi there"))  # the EOS token was consumed
    ignoring = TextAssembler(tok, SamplingSpec(max_tokens=100, ignore_eos=True))
    assert "".join(run(ignoring, ids)[0]) == "Hi there more"


def test_min_tokens_defers_stops_and_max_tokens_is_length(tok):
    ids = [1] + tok.encode("abc")[1:]
    a = TextAssembler(tok, SamplingSpec(max_tokens=100, min_tokens=2))
    update = a.append(1)
    assert not update.finished  # EOS before min_tokens is an ordinary (skipped) token
    b = TextAssembler(tok, SamplingSpec(max_tokens=2))
    chunks, update, fed = run(b, tok.encode("Hello world again")[1:])
    assert update.finish_reason == "length" and fed == 2
    c = TextAssembler(tok, SamplingSpec(max_tokens=2, stop_token_ids=(ids[1],)))
    assert c.append(ids[1]).finish_reason == "stop"


@settings(max_examples=200, deadline=None)
@given(text=_TEXT, data=st.data(), include=st.booleans())
def test_stop_string_cut_and_never_retracted(tok, text, data, include):
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start : data.draw(st.integers(start + 1, min(len(text), start + 6)))]
    ids = tok.encode(text)[1:]
    a = TextAssembler(
        tok, SamplingSpec(max_tokens=1000, stop=(stop,), include_stop_str_in_output=include), [0]
    )
    chunks, update, _ = run(a, ids)
    # The stop string ends in the token where it first completes: the earliest occurrence.
    idx = text.find(stop)
    expected = text[: idx + len(stop)] if include else text[:idx]
    assert update.finish_reason == "stop" and update.stop_string == stop
    assert "".join(chunks) == expected
    emitted = ""
    for c in chunks:  # every prefix handed out is a prefix of the final text
        emitted += c
        assert expected.startswith(emitted)


def test_stop_across_token_boundaries_exact():
    t = CharTokenizer(["He", "llo", " wo", "rld", "!", "<eos>"], special=[5], eos=[5])
    a = TextAssembler(t, SamplingSpec(max_tokens=10, stop=("lo wor",)))
    updates = [a.append(i) for i in t.ids("He", "llo", " wo", "rld")]
    assert [u.text for u in updates] == ["He", "l", "", ""]  # "lo" and "lo wo" held back
    assert updates[-1].finish_reason == "stop" and updates[-1].stop_string == "lo wor"
    a = TextAssembler(t, SamplingSpec(max_tokens=10, stop=("lo wor",), include_stop_str_in_output=True))
    updates = [a.append(i) for i in t.ids("He", "llo", " wo", "rld")]
    assert "".join(u.text for u in updates) == "Hello wor"
    assert [u.text for u in updates][:2] == ["He", "llo"]  # nothing held back when included
    # A held-back prefix that does not complete is released.
    a = TextAssembler(t, SamplingSpec(max_tokens=10, stop=("lo!",)))
    assert [a.append(i).text for i in t.ids("He", "llo", " wo")] == ["He", "l", "lo wo"]


def test_earliest_ending_stop_wins():
    t = CharTokenizer(["x", "abcd", "y"])
    a = TextAssembler(t, SamplingSpec(max_tokens=10, stop=("abcd", "bc")))
    assert a.append(0).text == "x"
    u = a.append(1)
    assert (u.text, u.stop_string) == ("a", "bc")
    a = TextAssembler(t, SamplingSpec(max_tokens=10, stop=("bcd", "abcd")))
    assert a.append(0).text == "x"
    u = a.append(1)
    assert (u.text, u.stop_string) == ("", "abcd")  # same end: the longer one


def test_finish_flushes_held_text():
    t = CharTokenizer(["ab", "c"])
    a = TextAssembler(t, SamplingSpec(max_tokens=10, stop=("bcd",)))
    assert a.append(0).text == "a"
    assert a.append(1).text == ""
    assert a.finish("abort") == "bc"
    assert a.finished and a.finish_reason == "abort"
    assert a.finish() == ""


# --------------------------------------------------------------------------- validation

LIMITS = Limits(vocab_size=512, max_model_len=64, max_n=4, max_logprobs=5, max_stop=3)


def _req(**params):
    prompt = params.pop("prompt", "Hello")
    ids = params.pop("ids", None)
    r = pb.GenerateRequest(request_id="r", params=pb.SamplingParams(**params))
    if ids is not None:
        r.prompt_token_ids.ids.extend(ids)
    else:
        r.prompt = prompt
    return r


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(prompt=""), "prompt"),
        (dict(ids=[]), "prompt_token_ids"),
        (dict(ids=[1, 512]), "prompt_token_ids"),
        (dict(ids=[1] * 60, max_tokens=5), "max_tokens"),
        (dict(ids=[1] * 64), "prompt_token_ids"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=100.5), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_p=math.nan), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=-0.01), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_p=math.nan), "min_p"),
        (dict(stop=["a", "b", "c", "d"]), "stop"),
        (dict(stop=["a", ""]), "stop"),
        (dict(stop_token_ids=[512]), "stop_token_ids"),
        (dict(min_tokens=17), "min_tokens"),
        (dict(max_tokens=4, min_tokens=5), "min_tokens"),
        (dict(n=0), "n"),
        (dict(n=5), "n"),
        (dict(logprobs=6), "logprobs"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(repetition_penalty=math.nan), "repetition_penalty"),
        (dict(repetition_penalty=math.inf), "repetition_penalty"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(presence_penalty=math.nan), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(frequency_penalty=math.inf), "frequency_penalty"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_invalid_requests_name_the_field(tok, kwargs, field):
    with pytest.raises(InvalidRequest) as info:
        request_from_pb(_req(**kwargs), tokenizer=tok, limits=LIMITS)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_defaults_applied(tok):
    spec = request_from_pb(_req(), tokenizer=tok, limits=LIMITS)
    s = spec.sampling
    assert spec.prompt_token_ids == tuple(tok.encode("Hello")) and spec.prompt_text == "Hello"
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.min_p, s.n) == (16, 1.0, 1.0, -1, 0.0, 1)
    assert (s.logprobs, s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (
        None, 1.0, 0.0, 0.0)
    assert 0 <= s.seed < 2**63
    other = sampling_from_pb(pb.SamplingParams(), LIMITS)
    assert other.seed != s.seed  # unset seed → random
    assert sampling_from_pb(pb.SamplingParams(seed=7), LIMITS).seed == 7


def test_valid_edges_accepted(tok):
    ok = dict(max_tokens=4, min_tokens=4, temperature=0.0, top_p=1.0, top_k=0, min_p=1.0, n=4,
              logprobs=0, repetition_penalty=0.01, presence_penalty=-2.0, frequency_penalty=2.0,
              stop=["a", "b", "c"], stop_token_ids=[511])
    spec = request_from_pb(_req(ids=[1] * 60, **ok), tokenizer=tok, limits=LIMITS)
    assert spec.sampling.top_k == -1 and spec.sampling.logprobs == 0 and spec.sampling.greedy
    assert spec.prompt_text is None and spec.prompt_token_ids == (1,) * 60


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 5), min_size=1, max_size=30),
       min_tokens=st.integers(0, 6), max_tokens=st.integers(1, 25),
       stop_ids=st.lists(st.integers(0, 5), max_size=2), ignore_eos=st.booleans(),
       max_model_len=st.one_of(st.none(), st.integers(4, 40)))
def test_a_tokens_only_assembler_ends_where_the_full_one_does(ids, min_tokens, max_tokens,
                                                               stop_ids, ignore_eos,
                                                               max_model_len):
    """text=False (the engine's side of an API worker's request): the token rules alone --
    stop ids, EOS, min_tokens, max_tokens, max_model_len -- end a sample at the same token
    and with the same reason and stop id as the assembler that also makes the text."""
    tok = CharTokenizer(["a", "b", "c", "d", "<eos>", "e"], special=(4,), eos=(4,))
    sp = SamplingSpec(min_tokens=min_tokens, max_tokens=max_tokens,
                      stop_token_ids=tuple(stop_ids), ignore_eos=ignore_eos)
    prompt = (0, 1, 2)
    full = TextAssembler(tok, sp, prompt, max_model_len=max_model_len)
    tokens_only = TextAssembler(tok, sp, prompt, max_model_len=max_model_len, text=False)
    _, a, n_a = run(full, ids)
    _, b, n_b = run(tokens_only, ids)
    assert n_a == n_b
    assert (a.finish_reason, a.stop_token_id) == (b.finish_reason, b.stop_token_id)
    assert b.text == "" and tokens_only.finished == full.finished
