"""vLLM's /tokenize and /detokenize on the HTTP edge: the ids generation would see (text with
its BOS, token ids as given, a conversation rendered as chat renders it, the special-token and
truncation fields), their text back, and bad bodies as 400/404 naming the field."""

from __future__ import annotations

import pytest
from fake_engine import make_tokenizer
from http_rig import MODEL, _post, _run, serve
from pagedserve.router.chat_template import render_chat_ids
from pagedserve.router.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return make_tokenizer(tmp_path_factory)


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

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=6)
_FIELDS = ["prompt", "messages", "add_special_tokens", "truncate_prompt_tokens", "tools",
           "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
           "return_token_strs", "model", "tokens"]


@settings(max_examples=200, deadline=None)
@given(body=st.dictionaries(st.sampled_from(_FIELDS), _JSON, max_size=4))
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
