"""`pagedserve bench --backend openai`: the bench's workloads as streamed
`POST /v1/completions` (with `stream_options.include_usage`), against pagedserve's HTTP API or
any OpenAI-compatible server (vLLM, SGLang, TGI). An SSE chunk carries no token count: each
chunk with text counts as one token for TTFT/ITL (vLLM's client counts the same way); output
tokens come from the final usage chunk.

`--backend openai-chat`: the same as streamed `POST /v1/chat/completions`, each prompt one
user message (rendered with the server's chat template; text prompts only: `--dataset file`);
a chunk with `delta.content` (or `reasoning_content`) counts as one token.

`--backend openai-embeddings`: each prompt as one `POST /v1/embeddings` (vLLM's and TEI's
route too): TTFT and e2e are the whole reply's latency, no output tokens; input tokens and
the prefix cache as for completions."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from .bench import BenchConfig, BenchRequest, RequestOutcome, drive, sample_requests
from .router.edge_security import http_headers


async def run_openai(cfg: BenchConfig, requests: list[BenchRequest] | None) -> dict:
    base = cfg.address if "://" in cfg.address else f"http://{cfg.address}"
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    connector = aiohttp.TCPConnector(limit=0)  # as many connections as requests in flight
    async with aiohttp.ClientSession(base, timeout=timeout, connector=connector,
                                     headers=http_headers(cfg.api_key)) as http:
        model = cfg.model
        if model is None:
            async with http.get("/v1/models") as reply:
                models = (await reply.json())["data"]
            model = models[0]["id"]
        if requests is None:
            text = cfg.dataset in ("file", "sharegpt")
            if cfg.backend == "openai-chat" and not text:
                raise ValueError("--backend openai-chat sends text: it needs --dataset file "
                                 "or sharegpt")
            if not text and cfg.vocab_size is None:
                raise ValueError(f"--backend {cfg.backend} with token-id prompts needs "
                                 "--vocab-size")
            requests = sample_requests(cfg, cfg.vocab_size or 0)
        send = one_embedding if cfg.backend == "openai-embeddings" else one_request
        return await drive(cfg, requests, lambda req: send(http, req, cfg, model))


async def one_embedding(http, req: BenchRequest, cfg: BenchConfig,
                        model: str) -> RequestOutcome:
    """One POST /v1/embeddings of the request's prompt."""
    out = RequestOutcome(prompt_tokens=req.prompt_len)
    body = {"model": req.lora or model, "input": list(req.prompt_token_ids)
            if req.prompt_token_ids is not None else req.prompt}
    start = time.perf_counter()
    try:
        async with http.post("/v1/embeddings", json=body) as reply:
            payload = await reply.json(content_type=None)
        if reply.status != 200 or not payload.get("data"):
            message = (payload.get("error") or {}).get("message", payload)
            out.error = f"HTTP {reply.status}: {str(message)[:200]}"
            return out
        out.ttft_s = out.e2e_s = time.perf_counter() - start
        out.prompt_tokens = (payload.get("usage") or {}).get("prompt_tokens", out.prompt_tokens)
        out.ok = True
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


def _openai_body(req: BenchRequest, cfg: BenchConfig, model: str) -> dict:
    body = {"model": req.lora or model, "max_tokens": req.max_tokens, "temperature": cfg.temperature,
            "seed": cfg.seed, "ignore_eos": cfg.ignore_eos, "stream": True,
            "stream_options": {"include_usage": True}}
    if cfg.backend == "openai-chat":  # the prompt as one user message (text prompts only)
        body["messages"] = [{"role": "user", "content": req.prompt}]
        return body
    body["prompt"] = list(req.prompt_token_ids) if req.prompt_token_ids is not None \
        else req.prompt
    return body


async def one_request(http, req: BenchRequest, cfg: BenchConfig, model: str) -> RequestOutcome:
    """One streamed POST /v1/completions (/v1/chat/completions with --backend openai-chat);
    times every chunk that carries text."""
    out = RequestOutcome(prompt_tokens=req.prompt_len)
    start = time.perf_counter()
    usage_tokens = None
    chat = cfg.backend == "openai-chat"
    route = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        async with http.post(route, json=_openai_body(req, cfg, model)) as reply:
            if reply.status != 200:
                body = await reply.text()
                out.error = f"HTTP {reply.status}: {body[:200]}"
                return out
            async for raw in reply.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = str(chunk["error"].get("message", chunk["error"]))
                    return out
                for choice in chunk.get("choices") or ():
                    delta = choice.get("delta") or {}
                    if choice.get("text") or (chat and (delta.get("content")
                                                        or delta.get("reasoning_content"))):
                        out.record_tokens(1, start)  # an SSE chunk carries no token count
                    if choice.get("finish_reason") == "abort":
                        out.finish_reason = 3  # as the gRPC enum's ABORT
                usage = chunk.get("usage")
                if usage:
                    out.prompt_tokens = usage.get("prompt_tokens", out.prompt_tokens)
                    usage_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    out.cached_prompt_tokens = details.get("cached_tokens") or 0
        out.e2e_s = time.perf_counter() - start
        if usage_tokens is not None:
            out.output_tokens = usage_tokens
        out.ok = out.last_token_at is not None
        if not out.ok:
            out.error = "no tokens"
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out
