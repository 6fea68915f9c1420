"""vLLM's routes for LoRA adapters while serving (``--max-loras N``; router/lora_registry.py
does the work):

    POST /v1/load_lora_adapter    {"lora_name": NAME, "lora_path": DIR}
        200 "Success: LoRA adapter 'NAME' added successfully." once every executor serves
        it (the OpenAI API's `model` and gRPC's `lora_adapter` may name it from then on);
        400 a bad or taken name, no free slot, or an executor that cannot load it (its
        reason: the path as that executor sees it, the adapter's format or rank);
        503 no executor up.
    POST /v1/unload_lora_adapter  {"lora_name": NAME}
        200 "Success: LoRA adapter 'NAME' removed successfully." at once: no new request may
        name it; the executors free its slot when its running requests have finished;
        404 an adapter not loaded; 400 a --lora-modules one.

Both are 404 without --max-loras. They load files the executors can read from paths a
client names: behind --api-key (a key is needed as on every route), and only on a cluster
started with --max-loras.
"""

from __future__ import annotations

import logging

from aiohttp import web

from .errors import InvalidRequest, PagedServeError
from .frontend import Frontend
from .http_errors import error_response, read_json

log = logging.getLogger(__name__)


def add_lora_routes(app: web.Application, frontend: Frontend,
                    served_names: tuple[str, ...]) -> None:
    routes = LoraRoutes(frontend, served_names)
    app.router.add_post("/v1/load_lora_adapter", routes.load)
    app.router.add_post("/v1/unload_lora_adapter", routes.unload)


def _name(body: dict, key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{key}: a non-empty string is required", field=key)
    return value


class LoraRoutes:
    def __init__(self, frontend: Frontend, served_names: tuple[str, ...]) -> None:
        self.frontend = frontend
        self.served_names = served_names

    async def load(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
            name, path = _name(body, "lora_name"), _name(body, "lora_path")
            if name in self.served_names:
                raise InvalidRequest(f"lora_name: {name!r} is the served model's name",
                                     field="lora_name")
            await self.frontend.engine.load_lora_adapter(name, path)
        except PagedServeError as exc:
            return error_response(exc)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        try:
            name = _name(await read_json(request), "lora_name")
            await self.frontend.engine.unload_lora_adapter(name)
        except PagedServeError as exc:
            return error_response(exc)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
