"""How a prompt becomes token ids: GenerateRequest's add_special_tokens and
truncate_prompt_tokens in validation, and vLLM's /tokenize and /detokenize on the HTTP edge
(the ids generation would see: text with its BOS, token ids as given, a conversation rendered
as chat renders it, those two fields), their text back, and bad bodies as 400/404 naming the
field; and /version."""

from __future__ import annotations

import pytest
from fake_engine import make_tokenizer
from http_rig import ANY_JSON, MODEL, _post, _run, serve
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
from pagedserve.router.chat_template import render_chat_ids
from pagedserve.router.tokenizer import Tokenizer
from pagedserve.router.validation import Limits, request_from_pb

LIMITS = Limits(vocab_size=512, max_model_len=64)


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return make_tokenizer(tmp_path_factory)


def test_special_tokens_and_left_truncation_of_the_prompt(tok):
    """GenerateRequest.add_special_tokens (unset: BOS as HF adds it to text, none to a
    rendered chat) and truncate_prompt_tokens (the last k tokens, whatever the input form)."""
    def spec(**fields):
        ids = fields.pop("ids", None)
        request = pb.GenerateRequest(request_id="r", **fields)
        if ids is not None:
            request.prompt_token_ids.ids.extend(ids)
        else:
            request.prompt = "Hello there"
        return request_from_pb(request, tokenizer=tok, limits=LIMITS)

    with_bos = tok.encode("Hello there")
    bare = tok.encode("Hello there", add_special_tokens=False)
    assert with_bos == [tok.bos_token_id, *bare]
    assert spec().prompt_token_ids == tuple(with_bos)
    assert spec(add_special_tokens=True).prompt_token_ids == tuple(with_bos)
    assert spec(add_special_tokens=False).prompt_token_ids == tuple(bare)
    cut = spec(truncate_prompt_tokens=2)
    assert cut.prompt_token_ids == tuple(with_bos[-2:]) and cut.prompt_text is None
    assert spec(truncate_prompt_tokens=99).prompt_token_ids == tuple(with_bos)
    assert spec(ids=[5, 6, 7, 8], truncate_prompt_tokens=3).prompt_token_ids == (6, 7, 8)
    assert spec(ids=[5, 6], add_special_tokens=True).prompt_token_ids == (5, 6)  # ids as given
    chat = pb.GenerateRequest(messages=pb.ChatMessages(
        messages=[pb.ChatMessage(role="user", content="Hi")]))
    rendered = request_from_pb(chat, tokenizer=tok, limits=LIMITS).prompt_token_ids
    assert rendered[0] != tok.bos_token_id
    chat.add_special_tokens = True
    assert request_from_pb(chat, tokenizer=tok, limits=LIMITS).prompt_token_ids == \
        (tok.bos_token_id, *rendered)
    # a prompt longer than the model, kept to its end: served
    long = spec(ids=list(range(1, 200)), truncate_prompt_tokens=40)
    assert long.prompt_token_ids == tuple(range(160, 200))


def test_tokenize_gives_the_ids_generation_sees(tok):
    messages = [{"role": "user", "content": "Hi there"}]

    async def main():
        async with serve(tok, max_model_len=256) as (engine, _, http, _):
            async def tokens(**body):
                status, reply = await _post(http, "/tokenize", {"model": MODEL, **body})
                assert status == 200, reply
                assert reply["count"] == len(reply["tokens"]) and reply["max_model_len"] == 256
                return reply["tokens"]

            text = "Once upon a time"
            assert await tokens(prompt=text) == tok.encode(text)
            assert await tokens(prompt=text, add_special_tokens=False) == \
                tok.encode(text, add_special_tokens=False)
            assert await tokens(prompt=text, truncate_prompt_tokens=2) == tok.encode(text)[-2:]
            assert await tokens(prompt=[5, 6, 7]) == [5, 6, 7]
            chat = render_chat_ids(tok, messages)
            assert await tokens(messages=messages) == chat
            assert await tokens(messages=messages, add_generation_prompt=False) == \
                render_chat_ids(tok, messages, add_generation_prompt=False)
            status, reply = await _post(http, "/tokenize", {"prompt": text,
                                                            "return_token_strs": True})
            assert reply["token_strs"] == [tok.token_text(t) for t in tok.encode(text)]
            # the same ids a generation request gets
            await _post(http, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
            assert list(engine.submitted[-1].prompt_token_ids) == chat
            assert not engine.submitted[:-1]  # tokenizing submits nothing

            async with http.get("/version") as r:
                from pagedserve import __version__
                assert r.status == 200 and await r.json() == {"version": __version__}
            status, reply = await _post(http, "/detokenize", {"tokens": tok.encode(text)})
            assert status == 200 and reply["prompt"] == tok.decode(tok.encode(text))
            for path, body, code, param in (
                    ("/tokenize", {}, 400, "prompt"),
                    ("/tokenize", {"prompt": "x", "model": "other"}, 404, None),
                    ("/tokenize", {"prompt": [10**9]}, 400, "prompt_token_ids"),
                    ("/tokenize", {"messages": []}, 400, "messages"),
                    ("/tokenize", {"messages": messages, "tools": "x"}, 400, "tools"),
                    ("/detokenize", {"tokens": []}, 400, "tokens"),
                    ("/detokenize", {"tokens": [tok.vocab_size]}, 400, "tokens")):
                status, reply = await _post(http, path, body)
                assert status == code and reply["error"]["param"] == param, (body, reply)

    _run(main())


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_FIELDS = ["prompt", "messages", "add_special_tokens", "truncate_prompt_tokens", "tools",
           "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
           "return_token_strs", "model", "tokens"]


@settings(max_examples=200, deadline=None)
@given(body=st.dictionaries(st.sampled_from(_FIELDS), ANY_JSON, max_size=4))
def test_any_json_body_is_tokenized_or_a_400(tok, body):
    """Whatever /tokenize and /detokenize are sent: their ids or an InvalidRequest naming the
    field, never another exception (a 500)."""
    from pagedserve.router.errors import InvalidRequest
    from pagedserve.router.openai_protocol import detokenize_ids, tokenize_request
    from pagedserve.router.validation import Limits, prompt_from_pb
    limits = Limits(vocab_size=tok.vocab_size, max_model_len=256)
    for route in (lambda: prompt_from_pb(tokenize_request(body), tokenizer=tok, limits=limits),
                  lambda: tok.decode(detokenize_ids(body, tok.vocab_size))):
        try:
            route()
        except InvalidRequest as exc:
            assert exc.field and str(exc).startswith(exc.field), exc
