"""The HTTP edge's token routes: vLLM's /tokenize and /detokenize, and the Messages API's
/v1/messages/count_tokens (what Anthropic clients ask before they send a long context)."""

from __future__ import annotations

from aiohttp import web

from .anthropic_messages import chat_body as messages_chat_body
from .anthropic_messages import messages_field
from .errors import InvalidRequest, PagedServeError
from .http_errors import dumps_json, error_response, read_json
from .http_generation_routes import messages_error_response
from .openai_fields import optional_bool
from .openai_protocol import chat_request, detokenize_ids, tokenize_request


def add_tokenizer_routes(app: web.Application, openai_app) -> None:
    routes = TokenizerRoutes(openai_app)
    app.router.add_post("/tokenize", routes.tokenize)
    app.router.add_post("/detokenize", routes.detokenize)
    app.router.add_post("/v1/messages/count_tokens", routes.count_tokens)


class TokenizerRoutes:
    """The routes, over the OpenAIApp's tokenizer, limits and model names."""

    def __init__(self, openai_app) -> None:
        self.app = openai_app

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: the prompt's token ids as generation would see them."""
        app = self.app
        try:
            body = await read_json(request)
            app.adapter_named(body)
            ids = await app.prompt_ids(tokenize_request(body))
            reply = {"count": len(ids), "max_model_len": app.max_model_len,
                     "tokens": list(ids)}
            if optional_bool(body, "return_token_strs"):
                reply["token_strs"] = [app.token_text(t) for t in ids]
        except PagedServeError as exc:
            return error_response(exc)
        return web.json_response(reply, dumps=dumps_json)

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: the text of token ids."""
        app = self.app
        try:
            body = await read_json(request)
            app.adapter_named(body)
            ids = detokenize_ids(body, app.frontend.limits.vocab_size)
        except PagedServeError as exc:
            return error_response(exc)
        return web.json_response({"prompt": app.token_text.decode(ids)}, dumps=dumps_json)

    async def count_tokens(self, request: web.Request) -> web.Response:
        """The Messages API's count: `{"input_tokens"}` of the prompt a Messages body
        (without max_tokens) renders to, its tools included; errors in its shape."""
        app = self.app
        try:
            try:
                body = await read_json(request)
                app.adapter_named(body)
                chat = messages_chat_body(body, counting=True)
                if chat.get("tools"):  # rendered whatever the choice; no output format
                    chat["tool_choice"] = "none"
                [pb_request] = chat_request(chat).requests
                ids = await app.prompt_ids(pb_request)
            except InvalidRequest as exc:
                raise messages_field(exc) from None
        except PagedServeError as exc:
            return messages_error_response(exc)
        return web.json_response({"input_tokens": len(ids)})
