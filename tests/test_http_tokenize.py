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
