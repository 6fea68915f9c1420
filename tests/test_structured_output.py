"""Structured output and logit_bias without a cluster: the formats' compilation and errors
(router/structured.py), the OpenAI forms (openai_formats.py), the validation rules, the
executor's grammar matchers and masks (executor/grammar.py) and the sampler's bias, with exact
expectations on a locally trained byte-level BPE tokenizer."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from pagedserve.executor.grammar import GrammarCompiler
from pagedserve.executor.plan_inputs import PlanLimits, precompute
from pagedserve.executor.sampler import Sampler
from pagedserve.executor.sampling_state import SamplingState
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
from pagedserve.protos.wire import NewRequest, SamplingParams, StepPlan
from pagedserve.router.errors import InvalidRequest
from pagedserve.router.openai_protocol import chat_request, completion_request
from pagedserve.router.structured import MAX_FORMAT_CHARS, build_grammar
from pagedserve.router.validation import Limits, sampling_from_pb

from pagedserve.tinymodels import build_tokenizer

torch.set_num_threads(1)
VOCAB = 512
EOS = 1  # </s> in the tiny tokenizer (SPECIAL_TOKENS: <s>, </s>, <pad>)
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}},
          "required": ["ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    tok = build_tokenizer(path, vocab_size=VOCAB)
    assert tok.eos_token_id == EOS
    return path


@pytest.fixture(scope="module")
def compiler(tokenizer_dir):
    return GrammarCompiler(tokenizer_dir / "tokenizer.json", VOCAB, num_threads=1)


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as in the vocab."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


@pytest.fixture(scope="module")
def vocab_bytes(tokenizer_dir):
    """Each token's bytes (b"" for the special tokens)."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    byte_of = _byte_of_char()
    special = {tok.token_to_id(t) for t in ("<s>", "</s>", "<pad>")}
    return [b"" if t in special else bytes(byte_of[c] for c in tok.id_to_token(t))
            for t in range(VOCAB)]


def allowed_ids(compiler, matcher) -> set[int]:
    bits = compiler.fill_masks([matcher])[0].view(np.uint8)
    return set(np.flatnonzero(np.unpackbits(bits, bitorder="little")[:VOCAB]).tolist())


def encode(tokenizer_dir, text: str) -> list[int]:
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).encode(
        text, add_special_tokens=False).ids


def expect_invalid(fn, *args, where: str | None = None, match: str | None = None):
    """fn(*args) raises InvalidRequest matching `match`, naming the field `where`."""
    with pytest.raises(InvalidRequest, match=match) as info:
        fn(*args)
    if where is not None:
        assert info.value.field == where, info.value
    return info.value


# --------------------------------------------------------------------------- router: formats


def test_every_format_compiles_and_bad_ones_name_the_field():
    for kind, value in [("json_schema", json.dumps(SCHEMA)), ("json_object", True),
                        ("regex", "[0-9]{3}"), ("choice", ["a", "b"]),
                        ("grammar", 'start: "x" | "y" start')]:
        assert build_grammar(kind, value)
    for kind, value, match in [
        ("json_schema", "{", "not JSON"), ("json_schema", "[1]", "an object"),
        ("json_schema", '{"type": "nope"}', "does not compile"),
        ("regex", "[a-", "does not compile"), ("grammar", "start: undefined_rule", "compile"),
        ("choice", [], "at least one"), ("choice", ["a", ""], "choice 1"),
        ("json_object", False, "must be true"), ("regex", "", "empty"),
        ("regex", "a" * (MAX_FORMAT_CHARS + 1), "at most"), ("xml", "<a/>", "unknown format"),
    ]:
        expect_invalid(build_grammar, kind, value, "f", where="f", match=match)


def test_grpc_structured_output_and_logit_bias_are_validated():
    limits = Limits(vocab_size=VOCAB, max_model_len=128)
    params = pb.SamplingParams(logit_bias={5: 100.0, 3: -2.5})
    params.structured_output.choice.choices.extend(["yes", "no"])
    spec = sampling_from_pb(params, limits)
    assert spec.logit_bias == ((3, -2.5), (5, 100.0))  # id order
    assert spec.grammar == build_grammar("choice", ["yes", "no"])
    assert sampling_from_pb(pb.SamplingParams(), limits).grammar == ""
    for bias, match in [({VOCAB: 1.0}, "vocab size"), ({1: 100.5}, r"\[-100, 100\]"),
                        ({1: float("nan")}, r"\[-100, 100\]"),
                        ({i: 1.0 for i in range(1025)}, "at most 1024")]:
        expect_invalid(sampling_from_pb, pb.SamplingParams(logit_bias=bias), limits,
                       where="logit_bias", match=match)
    for extra, field in [(dict(ignore_eos=True), "ignore_eos"), (dict(min_tokens=2), "min_tokens")]:
        p = pb.SamplingParams(**extra)
        p.structured_output.regex = "a+"
        expect_invalid(sampling_from_pb, p, limits, where=field, match="structured output")
    p = pb.SamplingParams()
    p.structured_output.regex = "(unclosed"
    expect_invalid(sampling_from_pb, p, limits, where="structured_output.regex")


# --------------------------------------------------------------------------- router: OpenAI


def _structured(body: dict, chat: bool = False) -> pb.StructuredOutput:
    base = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    api = (chat_request if chat else completion_request)({**base, **body})
    return api.requests[0].params.structured_output


def test_openai_forms_map_onto_one_structured_output():
    js = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}
    assert json.loads(_structured({"response_format": js}, chat=True).json_schema) == SCHEMA
    assert _structured({"response_format": {"type": "json_object"}}).json_object
    assert _structured({"response_format": {"type": "text"}}).WhichOneof("format") is None
    assert json.loads(_structured({"structured_outputs": {"json": SCHEMA}}).json_schema) == SCHEMA
    assert list(_structured({"structured_outputs": {"choice": ["a", "b"]}}).choice.choices) == [
        "a", "b"]
    assert _structured({"guided_regex": "[0-9]+"}).regex == "[0-9]+"
    assert _structured({"guided_grammar": 'start: "x"'}).grammar == 'start: "x"'
    assert json.loads(_structured({"guided_json": json.dumps(SCHEMA)}).json_schema) == SCHEMA
    assert list(_structured({"guided_choice": ["x"]}).choice.choices) == ["x"]
    bad_bodies = [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
         "one output format"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "must be"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema", "required"),
        ({"response_format": "json"}, "response_format", "an object"),
        ({"guided_choice": "a"}, "guided_choice", "array of strings"),
        ({"guided_regex": "[a-"}, "guided_regex", "does not compile"),  # the client's name
        ({"structured_outputs": {"json": 3}}, "structured_outputs.json", "JSON schema"),
    ]
    for body, field, match in bad_bodies:
        expect_invalid(_structured, body, where=field, match=match)


def test_openai_logit_bias_and_auto_tools_without_a_parser():
    api = completion_request({"prompt": "hi", "logit_bias": {"7": 5, "300": -100}})
    assert dict(api.requests[0].params.logit_bias) == {7: 5.0, 300: -100.0}
    for bias, match in [({"a": 1}, "not a token id"), ({"-1": 1}, "not a token id"),
                        ({"1": True}, "must be a number"), ([1], "must be an object")]:
        expect_invalid(completion_request, {"prompt": "hi", "logit_bias": bias},
                       where="logit_bias", match=match)
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for choice in (None, "auto"):  # without --tool-call-parser
        body = {"messages": messages, "tools": tools}
        if choice is not None:
            body["tool_choice"] = choice
        expect_invalid(chat_request, body, where="tool_choice", match="parser")
    chat_request({"messages": messages, "tools": tools, "tool_choice": "none"})
    chat_request({"messages": messages, "tools": []})
    expect_invalid(chat_request, {"messages": messages, "functions": [{"name": "f"}]},
                   where="functions")


# --------------------------------------------------------------------------- executor: masks


def test_choice_mask_allows_exactly_the_tokens_that_continue_a_choice(compiler, vocab_bytes,
                                                                     tokenizer_dir):
    """First mask: every token whose bytes are a non-empty prefix of a choice's UTF-8 bytes
    (a token may hold the first byte of "ü"). After the full text of one choice: EOS only."""
    choices = ["yes", 'no "quoted"', "a\\b\nc", "ünï"]
    matcher = compiler.matcher(build_grammar("choice", choices), [EOS])
    encoded = [c.encode() for c in choices]
    expected = {t for t, b in enumerate(vocab_bytes)
                if b and any(c.startswith(b) for c in encoded)}
    assert allowed_ids(compiler, matcher) == expected
    for choice in choices:
        m = compiler.matcher(build_grammar("choice", choices), [EOS])
        for token in encode(tokenizer_dir, choice):
            assert token in allowed_ids(compiler, m)
            m.consume(token)
        assert allowed_ids(compiler, m) == {EOS} and m.done  # complete: only EOS follows
        m.consume(EOS)
        m.consume(EOS)  # a pipelined step's extra EOS: ignored
        assert m.done and allowed_ids(compiler, m) == {EOS}


def test_greedy_sampling_follows_the_grammar_and_ends_on_eos(compiler, tokenizer_dir,
                                                            vocab_bytes):
    """Logits that prefer tokens outside the format: the sampler takes the best allowed
    token each step (exact), the text is one full match, then EOS."""
    gen = torch.Generator().manual_seed(0)
    step_logits = torch.randn(20, VOCAB, generator=gen) * 3
    grammar = build_grammar("regex", "[0-9]{2}-(ab|cd)")
    params = SamplingParams(temperature=0.0, grammar=grammar, eos_token_ids=(EOS,))
    state = SamplingState.from_new_request(NewRequest(
        request_id="r", prompt_token_ids=np.array([1], np.int32),
        output_token_ids=np.zeros(0, np.int32), sampling=params), compiler)
    reference = compiler.matcher(grammar, [EOS])
    sampler, out_ids = Sampler(), []
    for logits in step_logits:
        allowed = sorted(allowed_ids(compiler, reference))
        best = allowed[int(logits[allowed].argmax())]
        token = int(sampler(logits.unsqueeze(0), [state]).token_ids[0])
        assert token == best
        if token == EOS:
            break
        state.append(token)
        reference.consume(token)
        out_ids.append(token)
    else:
        pytest.fail("no EOS within 20 steps")
    text = b"".join(vocab_bytes[t] for t in out_ids).decode()
    assert len(text) == 5 and text[:2].isdigit() and text[2:] in ("-ab", "-cd")
    assert step_logits.argmax(-1)[0] not in allowed_ids(compiler, compiler.matcher(grammar, [EOS]))


def test_rebuilt_state_replays_the_output_and_forks_are_independent(compiler, tokenizer_dir):
    grammar = build_grammar("choice", ["yes", "no"])
    yes = encode(tokenizer_dir, "yes")
    params = SamplingParams(grammar=grammar, eos_token_ids=(EOS,))
    rebuilt = SamplingState.from_new_request(NewRequest(
        request_id="r", prompt_token_ids=np.array([1], np.int32),
        output_token_ids=np.array(yes, np.int32), sampling=params), compiler)
    assert allowed_ids(compiler, rebuilt.grammar) == {EOS}  # "yes" is complete
    fresh = SamplingState.from_new_request(NewRequest(
        request_id="s", prompt_token_ids=np.array([1], np.int32),
        output_token_ids=np.zeros(0, np.int32), sampling=params), compiler)
    before = allowed_ids(compiler, fresh.grammar)
    child = fresh.fork(1)
    for token in encode(tokenizer_dir, "no"):
        child.append(token)
    assert allowed_ids(compiler, child.grammar) == {EOS}
    assert allowed_ids(compiler, fresh.grammar) == before  # the parent did not move


def test_a_grammar_text_compiles_once_and_each_request_gets_its_own_copy(
        tokenizer_dir, monkeypatch):
    """Matchers of one grammar copy one compiled start (the least recently used of more
    than MAX_COMPILED texts dropped); their places are their own; a grammar that does not
    compile raises every time and is not kept."""
    from pagedserve.executor import grammar as grammar_mod

    monkeypatch.setattr(grammar_mod, "MAX_COMPILED", 2)
    compiler = GrammarCompiler(tokenizer_dir / "tokenizer.json", VOCAB, num_threads=1)
    yes_no = build_grammar("choice", ["yes", "no"])
    first, second = compiler.matcher(yes_no, [EOS]), compiler.matcher(yes_no, [EOS])
    assert list(compiler._compiled) == [(yes_no, (EOS,))]
    start = compiler._compiled[(yes_no, (EOS,))]
    assert first.inner is not start and second.inner is not start
    before = allowed_ids(compiler, second)
    for token in encode(tokenizer_dir, "yes"):
        first.consume(token)
    assert allowed_ids(compiler, first) == {EOS}
    assert allowed_ids(compiler, second) == before  # untouched by the first's tokens
    assert allowed_ids(compiler, compiler.matcher(yes_no, [EOS])) == before
    digits, letters = build_grammar("regex", "[0-9]+"), build_grammar("regex", "[a-z]+")
    compiler.matcher(digits, [EOS])
    compiler.matcher(yes_no, [EOS])  # used again: now the newest
    compiler.matcher(letters, [EOS])  # drops digits, the least recently used
    assert [g for g, _ in compiler._compiled] == [yes_no, letters]
    assert compiler._compiled[(yes_no, (EOS,))] is start
    for _ in range(2):
        with pytest.raises(ValueError, match="does not compile"):
            compiler.matcher("start: /[/", [EOS])
    assert len(compiler._compiled) == 2


def test_a_grammar_the_executor_cannot_use_fails_that_request_only(compiler):
    params = SamplingParams(grammar=build_grammar("regex", "a+"), eos_token_ids=(EOS,))
    new = [NewRequest(request_id=rid, prompt_token_ids=np.array([1, 5], np.int32),
                      output_token_ids=np.zeros(0, np.int32),
                      sampling=params if rid == "g" else SamplingParams())
           for rid in ("plain", "g")]
    plan = StepPlan(step_id=1, new_requests=new, request_ids=["plain", "g"],
                    num_computed_tokens=np.zeros(2, np.int32),
                    num_new_tokens=np.array([2, 2], np.int32), do_sample=np.ones(2, np.uint8),
                    token_ids=np.array([1, 5, 1, 5], np.int32),
                    positions=np.array([0, 1, 0, 1], np.int32),
                    slot_mapping=np.array([0, 1, 16, 17], np.int64),
                    block_table_starts=np.zeros(2, np.int32),
                    block_table_lens=np.ones(2, np.int32),
                    block_table_ids=np.array([0, 1], np.int32))
    plan.validate()
    for grammars, bad in ((None, {1}), (compiler, set())):
        limits = PlanLimits(16, 8, 0, 128, VOCAB, torch.device("cpu"), grammars)
        inputs = precompute(plan, limits)
        assert set(inputs.bad) == bad
        if bad:
            assert "not available" in inputs.bad[1]
        assert len(inputs.new_states) == 2
    missing = GrammarCompiler(None, VOCAB)
    limits = PlanLimits(16, 8, 0, 128, VOCAB, torch.device("cpu"), missing)
    assert "tokenizer.json" in precompute(plan, limits).bad[1]


# --------------------------------------------------------------------------- sampler: bias


def test_logit_bias_bans_forces_and_shifts():
    logits = torch.tensor([[3.0, 2.9, 2.0, 1.0]] * 4)

    def st(**params):
        return SamplingState(SamplingParams(**params), 0, np.zeros(0, np.int64))

    states = [st(temperature=0.0, logit_bias_ids=(0,), logit_bias_values=(-100.0,)),
              st(temperature=0.0, logit_bias_ids=(3,), logit_bias_values=(2.5,)),
              st(temperature=0.0, logit_bias_ids=(0, 1), logit_bias_values=(-1.0, 0.05)),
              st(temperature=0.0)]
    out = Sampler()(logits, states)
    assert out.token_ids.tolist() == [1, 3, 1, 0]
    banned = [st(seed=s, logit_bias_ids=(0, 1, 2), logit_bias_values=(-100.0,) * 3)
              for s in range(50)]
    draws = Sampler()(torch.tensor([[3.0, 2.9, 2.0, 1.0]] * 50), banned).token_ids
    assert set(draws.tolist()) == {3}
    assert logits[0, 0] == 3.0  # the caller's logits are left alone


def test_logit_bias_then_repetition_penalty_matches_hf_over_a_greedy_run():
    """transformers' SequenceBiasLogitsProcessor (single-token sequences) then its
    RepetitionPenaltyLogitsProcessor — its order — pick the same tokens as our sampler."""
    from transformers.generation.logits_process import (
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )
    gen = torch.Generator().manual_seed(5)
    vocab, prompt = 64, [3, 9, 17]
    step_logits = torch.randn(12, vocab, generator=gen) * 2
    bias = {9: 4.0, 20: -3.0, 33: 2.5, 40: -100.0}
    hf = [SequenceBiasLogitsProcessor({(t,): v for t, v in bias.items()}),
          RepetitionPenaltyLogitsProcessor(1.6)]
    ours = SamplingState(SamplingParams(temperature=0.0, repetition_penalty=1.6,
                                        logit_bias_ids=tuple(bias),
                                        logit_bias_values=tuple(bias.values())),
                         0, np.zeros(0, np.int64), np.asarray(prompt, np.int64))
    ids, sampler = list(prompt), Sampler()
    for logits in step_logits:
        ref = logits.unsqueeze(0).clone()
        for proc in hf:
            ref = proc(torch.tensor([ids]), ref)
        token = int(sampler(logits.unsqueeze(0), [ours]).token_ids[0])
        assert token == int(ref.argmax(-1))
        ours.append(token)
        ids.append(token)
    assert ours.output_token_ids.tolist() != step_logits.argmax(-1).tolist()  # bias mattered


def test_a_spec_with_bias_and_grammar_crosses_the_api_worker_wire():
    """With --api-workers the validated spec travels worker -> core as msgspec."""
    from pagedserve.router.edge_wire import EdgeCodec, Submit
    from pagedserve.router.types import RequestSpec, SamplingSpec

    spec = RequestSpec("r", (1, 2, 3), SamplingSpec(
        logit_bias=((3, -2.5), (9, 100.0)), grammar=build_grammar("regex", "[a-z]+")))
    got = EdgeCodec(to_core=True).decode(EdgeCodec(to_core=False).encode(Submit(1, spec)))
    assert got.spec == spec


def test_device_unpack_equals_the_numpy_unpack():
    """The GPU path unpacks the words with torch ops: run here on CPU tensors, it gives what
    numpy's unpack (the CPU path) gives, the sign bit and a vocab that is not a multiple of
    32 included."""
    from pagedserve.executor.grammar import refused_tokens, unpack_words
    rng = np.random.default_rng(3)
    bits = rng.integers(-2**31, 2**31 - 1, (5, 4), dtype=np.int64).astype(np.int32)
    bits[0] = -1
    bits[1] = 0
    for vocab in (128, 101):
        on_cpu = refused_tokens(bits, vocab, torch.device("cpu"))
        words = torch.from_numpy(np.invert(bits))
        assert torch.equal(unpack_words(words, vocab), on_cpu)
        assert not on_cpu[0].any() and on_cpu[1].all()


@pytest.mark.gpu
def test_constrained_sampling_on_cuda_equals_cpu(compiler, tokenizer_dir):
    """The same constrained rows (greedy and sampled, mixed with a plain row) sample the same
    tokens on CUDA as on the CPU."""
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(4, VOCAB, generator=gen) * 3
    grammar = build_grammar("regex", "[0-9]{2}-(ab|cd)")

    def states():
        out = []
        for i, params in enumerate([dict(temperature=0.0), dict(seed=4), dict(seed=5)]):
            s = SamplingState(SamplingParams(grammar=grammar, eos_token_ids=(EOS,), **params),
                              i, np.zeros(0, np.int64))
            s.grammar = compiler.matcher(grammar, [EOS])
            out.append(s)
        return out[:2] + [SamplingState(SamplingParams(seed=1), 0, np.zeros(0, np.int64))] + out[2:]

    cpu = Sampler()(logits, states()).token_ids
    cuda = Sampler()(logits.cuda(), states()).token_ids
    assert cpu.tolist() == cuda.tolist()


def test_the_grammar_wins_where_allowed_tokens_leave_none(compiler):
    """A row with a grammar and allowed_token_ids: where they share tokens the best shared
    one is taken; where they share none (every allowed token outside the format here) the
    grammar wins, not a token of an all -inf row; a row beside it keeps its own masks."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, VOCAB, generator=gen) * 3
    grammar = build_grammar("regex", "[0-9]{2}-(ab|cd)")
    legal = sorted(allowed_ids(compiler, compiler.matcher(grammar, [EOS])))
    outside = [t for t in range(3, 40) if t not in legal][:5]

    def state(allowed, grammar_on=True, seed=None):
        params = SamplingParams(temperature=0.0 if seed is None else 1.0, seed=seed or 0,
                                grammar=grammar if grammar_on else "",
                                eos_token_ids=(EOS,), allowed_token_ids=tuple(allowed))
        s = SamplingState(params, 0, np.zeros(0, np.int64))
        if grammar_on:
            s.grammar = compiler.matcher(grammar, [EOS])
        return s

    shared = [legal[3], legal[5], *outside]
    tokens = Sampler()(logits, [state(shared), state(outside), state(outside, False)]).token_ids
    assert int(tokens[0]) == max(shared[:2], key=lambda t: float(logits[0, t]))
    assert int(tokens[1]) == legal[int(logits[1, legal].argmax())]
    assert int(tokens[2]) == outside[int(logits[2, outside].argmax())]
    drawn = Sampler()(logits[:1], [state(outside, seed=7)]).token_ids
    assert int(drawn[0]) in legal
