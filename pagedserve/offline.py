"""`pagedserve.LLM`: offline generation from Python, the way vLLM's `LLM` is used in scripts,
notebooks and evaluation harnesses.

    from pagedserve import LLM, SamplingParams

    with LLM("default", executors=2) as llm:                  # any serve flag as a keyword
        outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
        print(outs[0].outputs[0].text)
        answers = llm.chat([[{"role": "user", "content": "Hi!"}]], SamplingParams(temperature=0))

An `LLM` starts what `serve` starts (the router, `executors` executor processes) on loopback
ports of its own (gRPC and HTTP on free ports, metrics off, a free executor socket), its
event loop in a thread of this process, and talks to it over gRPC (`embed`: HTTP's
/v1/embeddings, which gRPC has no method for): the same validation,
routing, prefix cache and answers as any client gets. `generate` and `chat` send every
prompt at once (at most the router's queue length in flight; more wait their turn) and
return one `RequestOutput` per prompt, in the prompts' order. A request the server refuses
raises `GenerateError` with its status and message. `close()` (or leaving the `with`) drains
and stops the cluster; so does the interpreter's exit.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_TIMEOUT_S = 600.0
START_TIMEOUT_S = 600.0
# serve.PRIVATE_CLUSTER (HTTP for embed), the edges in the router, and not
# $PAGEDSERVE_API_KEY's keys: the cluster is this process's own
LLM_CLUSTER = dict(api_workers=0, api_key=(), api_key_file=None)


class GenerateError(RuntimeError):
    """A request the server refused or could not finish: `code` (the gRPC status name)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass
class SamplingParams:
    """The sampling of every prompt of a call (the gRPC API's SamplingParams; None: its
    default). Greedy is `temperature=0`."""

    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    n: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def to_pb(self):
        from .protos.generated.pagedserve.v1 import generate_pb2 as pb
        set_fields = {k: v for k, v in vars(self).items()
                      if v is not None and k not in ("stop", "stop_token_ids")}
        return pb.SamplingParams(stop=list(self.stop), stop_token_ids=list(self.stop_token_ids),
                                 **set_fields)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "length" or "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None  # the text prompt (None for token ids or messages)
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of them, served from the prefix cache


class LLM:
    """A local cluster for offline generation (module docstring). `model`: what `serve
    --model` takes; `executors`: executor processes; other keywords: serve's flags
    (`max_num_seqs=64`, `dtype="float32"`, `num_gpu_blocks=512`, ...)."""

    def __init__(self, model: str = "default", executors: int = 1, **flags) -> None:
        self.args, self._argv = _cluster_args(model, executors, flags)
        self._started = threading.Event()
        self._failure: BaseException | str | None = None
        self._loop = self._stop = None
        self.children = None
        self.address: str | None = None  # the cluster's gRPC HOST:PORT
        self.http_address: str | None = None  # its OpenAI HTTP API (None: http_port=-1)
        self._thread = threading.Thread(target=self._run, name="pagedserve-llm", daemon=True)
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S) or self.address is None:
            self.close()
            raise RuntimeError(f"pagedserve.LLM: the cluster did not start: {self._failure}")
        import grpc

        from .protos.generated.pagedserve.v1 import generate_pb2_grpc as pb_grpc
        from .router.edge_security import grpc_metadata, http_headers
        self._channel = grpc.insecure_channel(self.address, options=[
            ("grpc.max_receive_message_length", 64 * 1024 * 1024)])
        self._stub = pb_grpc.GeneratorStub(self._channel)
        self._window = max(1, self.args.max_queue_len)
        key = self.args.api_key[0] if self.args.api_key else None  # an api_key= given
        self._metadata, self._headers = grpc_metadata(key), http_headers(key)
        atexit.register(self.close)

    # ------------------------------------------------------------------ the cluster

    def _run(self) -> None:
        import asyncio

        from .serve import run_cluster_job, serve_children

        async def job(engine, ready) -> int:
            self.http_address = ready.http
            self.address = ready.grpc
            self._stop = asyncio.Event()
            self._loop = asyncio.get_running_loop()
            self._started.set()
            await self._stop.wait()
            return 0

        async def run() -> int:
            children, on_gpu = serve_children(self.args, self._argv)
            self.children = children  # its executor processes (children.procs)
            return await run_cluster_job(self.args, children, job, executors_on_gpu=on_gpu)
        try:
            # asyncio's own loop: uvloop starts child processes from the main thread only
            rc = asyncio.run(run())
            if rc != 0 and self._failure is None:
                self._failure = f"the cluster exited with code {rc} (see its log)"
        except BaseException as exc:  # noqa: BLE001 - reported by __init__ or close
            self._failure = exc
        finally:
            self._started.set()

    def close(self) -> None:
        """Drain and stop the cluster (idempotent)."""
        channel = getattr(self, "_channel", None)
        if channel is not None:
            channel.close()
            self._channel = None
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=60)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | None = None, *, lora_adapter: str = "",
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> list[RequestOutput]:
        """One output per prompt (a text, or a list of token ids), in order; `lora_adapter`:
        a `lora_modules` name every prompt runs with ("": the model alone)."""
        from .protos.generated.pagedserve.v1 import generate_pb2 as pb
        if isinstance(prompts, str):
            prompts = [prompts]
        params = (sampling_params or SamplingParams()).to_pb()
        requests = []
        for p in prompts:
            if isinstance(p, str):
                requests.append((p, pb.GenerateRequest(prompt=p, params=params,
                                                       lora_adapter=lora_adapter)))
            else:
                requests.append((None, pb.GenerateRequest(
                    prompt_token_ids=pb.TokenIds(ids=list(p)), params=params,
                    lora_adapter=lora_adapter)))
        return self._run_all(requests, timeout_s)

    def chat(self, conversations: Sequence[Sequence[dict]],
             sampling_params: SamplingParams | None = None, *, lora_adapter: str = "",
             timeout_s: float = DEFAULT_TIMEOUT_S) -> list[RequestOutput]:
        """One answer per conversation (OpenAI-style `{"role", "content"}` messages, rendered
        with the model's chat template by the router), in order."""
        from .protos.generated.pagedserve.v1 import generate_pb2 as pb
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # one conversation given bare
        params = (sampling_params or SamplingParams()).to_pb()
        requests = []
        for messages in conversations:
            chat = pb.ChatMessages(messages=[
                pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages])
            requests.append((None, pb.GenerateRequest(messages=chat, params=params,
                                                      lora_adapter=lora_adapter)))
        return self._run_all(requests, timeout_s)

    def embed(self, texts: str | Sequence[str], *, dimensions: int | None = None,
              normalize: bool = True, batch: int = 64,
              timeout_s: float = DEFAULT_TIMEOUT_S) -> list[list[float]]:
        """One vector per text, in order: the prompt's last token's final hidden state,
        L2-normalized (POST /v1/embeddings, README "Embeddings"); `dimensions`: the first N
        components, normalized again; `normalize=False`: the raw hidden state."""
        import json
        if isinstance(texts, str):
            texts = [texts]
        vectors: list[list[float]] = []
        for start in range(0, len(texts), batch):
            body = {"input": list(texts[start:start + batch]), "normalize": normalize}
            if dimensions is not None:
                body["dimensions"] = dimensions
            data = json.loads(self._post("/v1/embeddings", body, timeout_s))["data"]
            vectors += [item["embedding"] for item in sorted(data, key=lambda d: d["index"])]
        return vectors

    def load_lora_adapter(self, name: str, path: str,
                          timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Load a PEFT adapter directory as `name` on every executor (`max_loras=N` given:
        README "Loading adapters while serving"); `lora_adapter=name` runs it from then on.
        GenerateError with the reason when it cannot be loaded."""
        self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)},
                   timeout_s)

    def unload_lora_adapter(self, name: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Stop serving a loaded adapter (its running requests finish with it)."""
        self._post("/v1/unload_lora_adapter", {"lora_name": name}, timeout_s)

    def update_weights_from_disk(self, path: str, *, abort_all_requests: bool = False,
                                 weight_version: str | None = None,
                                 timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
        """Load the same model's new weights from directory `path` on every executor
        (`enable_weight_updates=True` given: README "Updating weights while serving");
        returns how many requests waited for it. GenerateError with the reason when an
        executor refuses them (nothing changed then)."""
        import json
        body = {"model_path": str(path), "abort_all_requests": abort_all_requests,
                "weight_version": weight_version}
        reply = json.loads(self._post("/update_weights_from_disk", body, timeout_s))
        return int(reply["num_paused_requests"])

    def pause_generation(self, mode: str = "abort",
                         timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Hold new requests (`enable_weight_updates=True` given): "abort" ends the running
        ones, "retract" takes them off keeping their tokens, "wait" lets them finish,
        "keep" freezes them where they are (README "Updating weights while serving")."""
        self._post("/pause_generation", {"mode": mode}, timeout_s)

    def continue_generation(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """The held (and frozen) requests run again."""
        self._post("/continue_generation", {}, timeout_s)

    def _post(self, path: str, body: dict, timeout_s: float) -> bytes:
        """POST to the cluster's HTTP API: the reply's body, or GenerateError (the error
        object's code and message)."""
        import json
        import urllib.error
        import urllib.request
        if self._channel is None:
            raise RuntimeError("pagedserve.LLM is closed")
        if self.http_address is None:
            raise RuntimeError(f"pagedserve.LLM: {path} needs the HTTP API (http_port=-1 "
                               "was given)")
        req = urllib.request.Request(f"http://{self.http_address}{path}",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              **self._headers})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as reply:
                return reply.read()
        except urllib.error.HTTPError as exc:
            reply = json.loads(exc.read() or b"{}")
            error = reply.get("error") or {}  # (SGLang's routes answer a top-level message)
            raise GenerateError(str(error.get("code") or exc.code),
                                error.get("message") or reply.get("message") or str(exc)) from None

    def _run_all(self, requests: list, timeout_s: float) -> list[RequestOutput]:
        """Every request through Generate, at most the router's queue length in flight."""
        import grpc
        if self._channel is None:
            raise RuntimeError("pagedserve.LLM is closed")
        results: list[RequestOutput | None] = [None] * len(requests)
        pending: dict[int, grpc.Future] = {}
        nxt = 0
        while nxt < len(requests) or pending:
            while nxt < len(requests) and len(pending) < self._window:
                pending[nxt] = self._stub.Generate.future(requests[nxt][1], timeout=timeout_s,
                                                          metadata=self._metadata)
                nxt += 1
            done = next(iter(pending))  # oldest first: results arrive in any order anyway
            future = pending.pop(done)
            try:
                reply = future.result()
            except grpc.RpcError as exc:
                for f in pending.values():
                    f.cancel()
                raise GenerateError(exc.code().name, exc.details() or "") from None
            results[done] = _output(requests[done][0], reply)
        return results  # type: ignore[return-value]


def _output(prompt: str | None, reply) -> RequestOutput:
    from .protos.generated.pagedserve.v1 import generate_pb2 as pb
    reasons = {pb.STOP: "stop", pb.LENGTH: "length", pb.ABORT: "abort"}
    outs = []
    for c in reply.completions:
        stop = c.stop_string or (c.stop_token_id if c.HasField("stop_token_id") else None)
        outs.append(CompletionOutput(c.index, c.text, list(c.token_ids),
                                     reasons.get(c.finish_reason, "abort"), stop))
    return RequestOutput(reply.request_id, prompt, outs, reply.usage.prompt_tokens,
                         reply.usage.cached_prompt_tokens)


def _cluster_args(model: str, executors: int, flags: dict):
    """(the parsed server flags, the argv its executors are started with)."""
    import argparse

    from .cli import _resolve_model
    from .flags import _BOOLEAN_SWITCHES, add_server_flags, flatten_lora_modules
    from .serve import PRIVATE_CLUSTER
    argv = ["--model", model, "--executors", str(executors)]
    for key, value in flags.items():
        name = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv += [f"{name}={int(value)}"] if name[2:] in _BOOLEAN_SWITCHES \
                else [name, str(value)]
        elif isinstance(value, (list, tuple)):
            argv += [name, ",".join(str(v) for v in value)]
        else:
            argv += [name, str(value)]
    parser = argparse.ArgumentParser(prog="pagedserve.LLM", exit_on_error=False)
    add_server_flags(parser)
    parser.set_defaults(**PRIVATE_CLUSTER, **LLM_CLUSTER)
    try:
        args = parser.parse_args(argv)
    except (argparse.ArgumentError, SystemExit) as exc:
        raise ValueError(f"pagedserve.LLM: {exc}") from None
    flatten_lora_modules(args)
    try:
        _resolve_model(args, "pagedserve.LLM", default="default")  # its error: on stderr
    except SystemExit:
        raise ValueError(f"pagedserve.LLM: cannot use the model {model!r}") from None
    return args, argv
