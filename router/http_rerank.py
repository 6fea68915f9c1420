"""Scores of text pairs by the served model's embeddings: vLLM's score API and the rerank
API of Jina and Cohere, as vLLM serves them for an embedding model. A pair's score is the
cosine similarity of its two texts' embeddings (router/openai_embeddings.py: last-token
pooling, normalized), each distinct text embedded once however many pairs it is in, all of
them submitted at once (a query against N documents: N + 1 requests, their shared prefixes
found in the prefix cache as any request's).

    POST /v1/score, /score        {"text_1": str | [str], "text_2": str | [str], "model"}
        text_1 one text: it against each text_2; two lists of one length: pair by pair
        -> {"id": "score-...", "object": "list", "created", "model",
            "data": [{"index", "object": "score", "score"}],
            "usage": {"prompt_tokens", "total_tokens"}}
    POST /v1/rerank, /rerank, /v2/rerank
                                  {"query": str, "documents": [str | {"text"}], "top_n",
                                   "return_documents": true, "model"}
        -> {"id": "rerank-...", "model", "usage": {"total_tokens"},
            "results": [{"index", "relevance_score", "document": {"text"}}]} best first,
           the top_n of them (default: all)

The model is used as it is: an embedding model (E5-Mistral, Qwen3-Embedding, gte-Qwen2)
gives meaningful scores, a chat model only what its hidden states happen to give. Cross-
encoders (a classification head scoring a pair in one pass) are not served. Errors name the
field the text came from (`text_2[3]`, `documents[0]`); `add_special_tokens`,
`truncate_prompt_tokens`, `priority` and `cache_salt` apply to every text.
"""

from __future__ import annotations

import time

import numpy as np
from aiohttp import web

from .errors import InvalidRequest, PagedServeError
from .http_errors import dumps_json, error_response, read_json
from .http_request_ids import answer_id, request_base
from .openai_embeddings import embedding_call
from .openai_fields import bad, json_type, optional_bool, optional_int

API = "http"
_PASSED = ("add_special_tokens", "truncate_prompt_tokens", "priority", "cache_salt")


class _Ended(Exception):
    """An error that ended a text's request: its session counted it already."""

    def __init__(self, exc: PagedServeError) -> None:
        super().__init__(exc.message)
        self.exc = exc


def add_rerank_routes(app: web.Application, openai_app) -> None:
    routes = RerankRoutes(openai_app)
    for path in ("/v1/score", "/score"):
        app.router.add_post(path, routes.score)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.router.add_post(path, routes.rerank)


def _texts(value, field: str, single_ok: bool) -> list[tuple[str, str]]:
    """(text, the field it came from) of a string or a list of strings (rerank documents:
    {"text": ...} objects too)."""
    if isinstance(value, str) and single_ok:
        return [(value, field)]
    if not isinstance(value, list) or not value:
        kind = "a string or " if single_ok else ""
        raise bad(field, f"must be {kind}a non-empty array of texts, got {json_type(value)}")
    texts = []
    for i, item in enumerate(value):
        text = item.get("text") if isinstance(item, dict) else item
        if not isinstance(text, str):
            raise bad(f"{field}[{i}]", f"must be a string, got {json_type(text)}")
        texts.append((text, f"{field}[{i}]"))
    return texts


class RerankRoutes:
    """The routes, over the OpenAIApp's embedding path (its sessions, its model names)."""

    def __init__(self, openai_app) -> None:
        self.app = openai_app

    async def _similarities(self, request: web.Request, body: dict, prefix: str,
                            pairs: list[tuple[tuple[str, str], tuple[str, str]]],
                            arrival: float) -> tuple[dict, list[float], int]:
        """(the reply's id and model, each pair's cosine similarity, prompt tokens in
        all)."""
        app = self.app
        distinct: dict[str, str] = {}  # text -> the first field that gave it
        for (a, fa), (b, fb) in pairs:
            distinct.setdefault(a, fa)
            distinct.setdefault(b, fb)
        texts = list(distinct)
        call = embedding_call({"input": texts, **{k: body[k] for k in _PASSED if k in body}})
        adapter = app.adapter_named(body)
        response_id = prefix + request_base(request)
        answer_id(request, response_id)
        fields = [distinct[t] for t in texts]

        def field_of(exc: InvalidRequest, index: int) -> InvalidRequest:
            if (exc.field or "") not in ("prompt", "prompt_token_ids"):
                return exc
            message = str(exc)
            if message.startswith(exc.field):
                message = fields[index] + message[len(exc.field):]
            return InvalidRequest(message, field=fields[index])
        try:
            outputs, vectors = await app.embed(call, adapter, response_id, arrival, field_of)
        except PagedServeError as exc:
            raise _Ended(exc) from None
        at = {t: i for i, t in enumerate(texts)}
        scores = [float(np.dot(vectors[at[a]].astype(np.float64),
                               vectors[at[b]].astype(np.float64)))
                  for (a, _), (b, _) in pairs]
        head = {"id": response_id, "model": adapter or app.served_as(body)}
        return head, scores, sum(out.usage.prompt_tokens for out in outputs)

    async def _answer(self, request: web.Request, work) -> web.Response:
        arrival = time.monotonic()
        try:
            body = await read_json(request)
            return web.json_response(await work(body, arrival), dumps=dumps_json)
        except _Ended as ended:
            return error_response(ended.exc)
        except PagedServeError as exc:
            self.app.frontend.refused(exc, API, arrival)
            return error_response(exc)
        except ConnectionError:
            return web.Response(status=499)

    async def score(self, request: web.Request) -> web.Response:
        async def work(body: dict, arrival: float) -> dict:
            first = _texts(body.get("text_1"), "text_1", single_ok=True)
            second = _texts(body.get("text_2"), "text_2", single_ok=True)
            if len(first) == 1:
                pairs = [(first[0], b) for b in second]
            elif len(first) == len(second):
                pairs = list(zip(first, second, strict=True))
            else:
                raise bad("text_2", f"must have one text per text_1 ({len(first)}), got "
                          f"{len(second)}")
            head, scores, tokens = await self._similarities(request, body, "score-", pairs,
                                                            arrival)
            return {**head, "object": "list", "created": int(time.time()),
                    "data": [{"index": i, "object": "score", "score": s}
                             for i, s in enumerate(scores)],
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
        return await self._answer(request, work)

    async def rerank(self, request: web.Request) -> web.Response:
        async def work(body: dict, arrival: float) -> dict:
            query = body.get("query")
            if not isinstance(query, str) or not query:
                raise bad("query", f"must be a non-empty string, got {json_type(query)}")
            documents = _texts(body.get("documents"), "documents", single_ok=False)
            top_n = optional_int(body, "top_n")
            if top_n is not None and top_n < 1:
                raise bad("top_n", f"must be at least 1, got {top_n}")
            give_back = optional_bool(body, "return_documents") is not False
            head, scores, tokens = await self._similarities(
                request, body, "rerank-", [((query, "query"), d) for d in documents], arrival)
            order = sorted(range(len(scores)), key=lambda i: -scores[i])[:top_n]
            results = []
            for i in order:
                result = {"index": i, "relevance_score": scores[i]}
                if give_back:
                    result["document"] = {"text": documents[i][0]}
                results.append(result)
            return {**head, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                    "results": results}
        return await self._answer(request, work)
