"""The routes an RL trainer drives between rollouts (router/weight_sync.py does the work):
SGLang's names and replies, and vLLM's prefix-cache reset.

    POST /update_weights_from_disk  {"model_path": DIR, "abort_all_requests": false,
                                     "weight_version": null, "flush_cache": true,
                                     "load_format": null}
        200 {"success": true, "message": ..., "num_paused_requests": N} once every executor
        runs the weights of DIR (the same model's *.safetensors, as the executors see the
        path) and no KV of the old ones can be found; new requests wait meanwhile, running
        ones finish first (or are aborted: abort_all_requests);
        400 {"success": false, "message": why} an executor refused them (nothing changed),
        a field of the wrong type, flush_cache false (the cache always goes with the
        weights), a load_format other than null, "auto" or "safetensors".
    POST /pause_generation          {"mode": "abort" | "retract" | "wait" | "in_place"}
                                    200 once nothing runs (in_place: at once, the running
                                    requests frozen with their KV)
    POST /continue_generation       200: the held (and frozen) requests run
    POST /pause?mode=abort|wait|keep, POST /resume, GET /is_paused   (vLLM's names: keep is
                                    in_place; wait_for_inflight_requests=true is wait)
    GET  /get_weight_version        {"weight_version": V} (--weight-version, then each
                                    update's weight_version)
    POST /reset_prefix_cache        (vLLM) 200: the cached prefixes no request holds are gone
    GET|POST /flush_cache           (SGLang) 200 "Cache flushed." when no request is live,
                                    else 400 and nothing flushed

All but the two cache routes are 404 unless the router runs with --enable-weight-updates
(they load files from paths a client names, and stop everyone's generation): behind
--api-key like every route. Through API workers they go to the serving process
(remote_engine.RemoteWeights).
"""

from __future__ import annotations

from aiohttp import web

from .errors import InvalidRequest, NotFound, PagedServeError
from .frontend import Frontend
from .http_errors import error_for, error_response, read_json

LOAD_FORMATS = (None, "auto", "safetensors")


def add_weight_routes(app: web.Application, frontend: Frontend) -> None:
    routes = WeightRoutes(frontend)
    app.router.add_post("/update_weights_from_disk", routes.update_from_disk)
    app.router.add_post("/pause_generation", routes.pause)
    app.router.add_post("/continue_generation", routes.resume)
    app.router.add_post("/pause", routes.pause_vllm)
    app.router.add_post("/resume", routes.resume_vllm)
    app.router.add_get("/is_paused", routes.is_paused)
    app.router.add_get("/get_weight_version", routes.version)
    app.router.add_post("/reset_prefix_cache", routes.reset_prefix_cache)
    app.router.add_get("/flush_cache", routes.flush_cache)
    app.router.add_post("/flush_cache", routes.flush_cache)


def _field(body: dict, key: str, kind: type, default):
    value = body.get(key, default)
    if value is None and default is None:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidRequest(f"{key}: a {kind.__name__} is required", field=key)
    return value


async def _vllm_reply(work, status: str) -> web.Response:
    """vLLM's reply shapes: {"status": ...} once ``work()`` ran, {"error": ...} when not."""
    try:
        await work()
    except PagedServeError as exc:
        return web.json_response({"error": exc.message}, status=error_for(exc)[0])
    return web.json_response({"status": status})


class WeightRoutes:
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    @property
    def weights(self):
        weights = getattr(self.frontend.engine, "weights", None)
        if weights is None:
            raise NotFound("this engine serves no weight updates")
        return weights

    async def update_from_disk(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
            path = _field(body, "model_path", str, "")
            if not path:
                raise InvalidRequest("model_path: a non-empty string is required",
                                     field="model_path")
            abort_all = _field(body, "abort_all_requests", bool, False)
            version = _field(body, "weight_version", str, None)
            if not _field(body, "flush_cache", bool, True):
                raise InvalidRequest("flush_cache: the prefix cache always goes with the old "
                                     "weights (KV computed by them is never reused)",
                                     field="flush_cache")
            if body.get("load_format") not in LOAD_FORMATS:
                raise InvalidRequest(f"load_format: {body.get('load_format')!r} is not served "
                                     "(null, 'auto' or 'safetensors')", field="load_format")
            waited = await self.weights.update_from_disk(path, abort_all_requests=abort_all,
                                                         weight_version=version)
        except NotFound as exc:
            return error_response(exc)
        except PagedServeError as exc:
            return web.json_response({"success": False, "message": exc.message,
                                      "num_paused_requests": 0}, status=error_for(exc)[0])
        return web.json_response({"success": True,
                                  "message": "Succeeded to update model weights.",
                                  "num_paused_requests": waited})

    async def pause(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request) if request.can_read_body else {}
            mode = _field(body, "mode", str, "abort")
            await self.weights.pause(mode)
        except PagedServeError as exc:
            return error_response(exc)
        return web.json_response({"message": f"Generation paused ({mode})."})

    async def resume(self, request: web.Request) -> web.Response:
        try:
            await self.weights.resume()
        except PagedServeError as exc:
            return error_response(exc)
        return web.json_response({"message": "Generation continues."})

    async def pause_vllm(self, request: web.Request) -> web.Response:
        """vLLM's: the mode in the query (abort by default; the older
        wait_for_inflight_requests=true is wait); {"status": "paused"}."""
        query = request.query
        mode = query.get("mode") or (
            "wait" if query.get("wait_for_inflight_requests", "").lower() == "true"
            else "abort")
        return await _vllm_reply(lambda: self.weights.pause(mode), "paused")

    async def resume_vllm(self, request: web.Request) -> web.Response:
        return await _vllm_reply(lambda: self.weights.resume(), "resumed")

    async def is_paused(self, request: web.Request) -> web.Response:
        try:
            return web.json_response({"is_paused": await self.weights.is_paused()})
        except PagedServeError as exc:
            return error_response(exc)

    async def version(self, request: web.Request) -> web.Response:
        try:
            return web.json_response({"weight_version": await self.weights.current_version()})
        except PagedServeError as exc:
            return error_response(exc)

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        try:
            await self.weights.flush(idle_only=False)
        except PagedServeError as exc:
            return error_response(exc)
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        try:
            await self.weights.flush(idle_only=True)
        except PagedServeError as exc:
            return web.Response(status=error_for(exc)[0], text=f"{exc.message}\n")
        return web.Response(text="Cache flushed.\n")
