"""The flag table of DESIGN §4, shared by `serve`, `router` and `executor`.

Every flag's default can come from the environment as PAGEDSERVE_<FLAG> (upper case, dashes
to underscores), so one environment file configures a whole cluster. The three server
commands accept every flag; one that does not apply to a command is ignored by it.
"""

from __future__ import annotations

import argparse
import os
import re


class FlagError(ValueError):
    """A bad flag value (reported as one line on stderr, non-zero exit)."""


def parse_bool(value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes"):
        return True
    if text in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected 1/true/yes or 0/false/no, got {value!r}")


def _choice(*allowed: str):
    def check(value: str) -> str:
        if value not in allowed:
            raise argparse.ArgumentTypeError(f"{value!r} is not one of {', '.join(allowed)}")
        return value
    return check


def _block_size(value: str) -> int:
    n = int(value)
    if n not in (8, 16, 32, 64, 128):
        raise argparse.ArgumentTypeError(f"{n} is not one of 8, 16, 32, 64, 128")
    return n


# --kv-cache-dtype (vLLM's names): "auto" is the model's dtype; "fp8" is e4m3
# (pagedserve/kernels/kv_dtypes.py resolves them).
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


# Deeper than this, each request that ends would cost more dropped samples and blocks held
# (one a level) for no gain: depth 3 already hides a round trip behind two forwards, and 4
# behind three (for short forwards, e.g. a small batch on a GPU).
MAX_PIPELINE_DEPTH = 4


def _pipeline_depth(value: str) -> int:
    n = int(value)
    if not 1 <= n <= MAX_PIPELINE_DEPTH:
        raise argparse.ArgumentTypeError(f"{n} is not 1 to {MAX_PIPELINE_DEPTH}")
    return n


def _positive_float(value: str) -> float:
    x = float(value)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"{x} must be positive")
    return x


def _positive_int(value: str) -> int:
    n = int(value)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{n} must be positive")
    return n


def _port(value: str) -> int:
    n = int(value)
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"{n} is not a port (0-65535; 0: any free port)")
    return n


def _port_or_off(value: str) -> int:
    n = int(value)
    if not -1 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"{n} is not a port (0-65535; 0: any free port; "
                                         "-1: off)")
    return n


def _non_negative_float(value: str) -> float:
    x = float(value)
    if not x >= 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"{x} must be 0 or more")
    return x


def _non_negative_int(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n} must be 0 or more")
    return n


def _api_workers(value: str) -> int | str:
    """`auto` (resolved when the router starts: router/api_workers.resolve_api_workers) or a
    count."""
    if value == "auto":
        return value
    try:
        return _non_negative_int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not auto or a count") from None


def _speculative_config(value: str):
    """vLLM's ``--speculative-config`` JSON (router/speculative.py; "" -> off)."""
    from pagedserve.router.speculative import SpeculativeConfigError, parse_speculative_config
    try:
        return parse_speculative_config(value)
    except SpeculativeConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _api_keys(value: str) -> tuple[str, ...]:
    """``--api-key``: one key or several, comma-separated (router/edge_security.py)."""
    from pagedserve.router.edge_security import parse_api_keys
    try:
        return parse_api_keys(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _allowed_origins(value: str) -> tuple[str, ...]:
    """``--allowed-origins`` (router/http_cors.py)."""
    from pagedserve.router.http_cors import parse_origins
    try:
        return parse_origins(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_LORA_NAME = re.compile(r"[^\s,=]{1,128}")


def _lora_modules(value: str) -> tuple[tuple[str, str], ...]:
    """``NAME=DIR`` pairs, separated by commas or spaces (vLLM's ``--lora-modules``: one
    argument a pair, or several in one)."""
    pairs = []
    for item in value.replace(",", " ").split():
        name, sep, path = item.partition("=")
        if not sep or not path or not _LORA_NAME.fullmatch(name):
            raise argparse.ArgumentTypeError(
                f"{item!r} is not NAME=DIR (a name of 1-128 characters, no space, comma or =)")
        pairs.append((name, path))
    return tuple(pairs)


def flatten_lora_modules(args) -> None:
    """``args.lora_modules`` as one tuple of (name, directory) pairs, from the list of each
    argument's pairs argparse gives; FlagError on a name given twice."""
    pairs = tuple(pair for given in args.lora_modules for pair in given)
    names = [name for name, _ in pairs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise FlagError(f"--lora-modules: {', '.join(twice)} given twice")
    args.lora_modules = pairs


# (flag, type, default, help). None as default: derived at run time (see help).
FLAGS: list[tuple[str, object, object, str]] = [
    ("model", str, None, "a Hugging Face directory, a .gguf file, a hub id, `default` (the "
     "built-in SmolLM2-135M-Instruct; serve's default) or `tiny`"),
    ("executors", _positive_int, 1, "serve: executor processes to start"),
    ("executor-id", str, None, "executor: id (default: host, pid and a random suffix)"),
    ("port", _port, 50051, "gRPC port (0: any free port)"),
    ("host", str, "127.0.0.1", "bind address of gRPC, HTTP and metrics (beyond loopback: "
     "see README security)"),
    ("metrics-port", _port_or_off, 9400, "Prometheus /metrics port (-1 disables; 0: any free port)"),
    ("http-port", _port_or_off, 8000, "OpenAI-compatible HTTP API port (-1 disables; 0: any free port)"),
    ("served-model-name", str, None, "the model id of the HTTP API, or several separated by "
     "commas (the others: aliases a request's model may use; default: the name of "
     "--model)"),
    ("tool-call-parser", _choice("none", "hermes", "qwen3_coder", "llama3_json", "pythonic",
                                 "mistral"),
     "none", "router: how tool_choice \"auto\" finds tool calls in the output (hermes: "
     "<tool_call> JSON </tool_call>, Qwen2.5/3; qwen3_coder: <tool_call><function=...> XML; "
     "llama3_json: an output that is {\"name\", \"parameters\"}, Llama 3.1/3.3; pythonic: "
     "an output that is [f(a=1)], Llama 3.2/4; mistral: [TOOL_CALLS] then a JSON array or "
     "name[ARGS]{...}, Mistral and its successors; none: auto is a 400)"),
    ("generation-config", str, "auto", "router: sampling defaults of the OpenAI API for "
     "fields a request leaves out (temperature, top_p, top_k, min_p, repetition_penalty, "
     "max_new_tokens as max_tokens): auto = the model's generation_config.json, vllm = "
     "none (OpenAI's), or a folder holding one"),
    ("chat-template", str, None, "router: the chat template to render chat requests with, "
     "in place of the model's (a Jinja file, or the template itself on one line): for a "
     "model without one, or to change it (default: the model's)"),
    ("reasoning-parser", _choice("none", "qwen3", "deepseek_r1", "mistral"), "none",
     "router: split a thinking model's <think> text into the chat message's "
     "reasoning_content (qwen3: when the output opens with <think>; deepseek_r1: the output "
     "starts inside it; mistral: [THINK] ... [/THINK], special tokens kept)"),
    ("api-workers", _api_workers, "auto", "router: processes serving the gRPC and HTTP APIs "
     "on shared ports, apart from the engine (0: the router process serves them; auto: 2 "
     "when serve starts its executors on GPUs and the router may use 8 cores or more, "
     "else 0)"),
    ("executor-bind", str, "tcp://127.0.0.1:5557", "router: ZeroMQ address executors join"),
    ("router", str, "tcp://127.0.0.1:5557", "executor: the router's ZeroMQ address"),
    ("device", str, None, "executor: cuda when available, else cpu"),
    ("lora-modules", _lora_modules, None, "LoRA adapters (PEFT directories) served beside "
     "the model, each NAME=DIR; a request picks one by NAME (the OpenAI API's model, gRPC's "
     "lora_adapter); router, executors and serve need the same names"),
    ("max-loras", _non_negative_int, 0, "LoRA adapter slots of each executor, --lora-modules' "
     "included; N > 0 turns on loading and unloading adapters while serving "
     "(POST /v1/load_lora_adapter, /v1/unload_lora_adapter); router and executors need the "
     "same N"),
    ("lora-dir", str, None, "router: a folder of PEFT adapters loaded on demand: a request "
     "naming DIR/<name> loads it (the least recently used idle adapter unloaded when every "
     "--max-loras slot is taken; waiting while all run requests); executors must read the "
     "same paths"),
    ("max-cpu-loras", _non_negative_int, None, "executor: LoRA adapters read from disk kept in "
     "host memory, so that loading one again copies it without reading its files (default: "
     "--max-loras; 0: none)"),
    ("max-lora-rank", _positive_int, 16, "executor: the largest rank an adapter may have "
     "(with --max-loras: every slot is allocated at this rank)"),
    ("enable-weight-updates", parse_bool, False, "router: serve the routes an RL trainer "
     "drives (POST /update_weights_from_disk: the same model's new *.safetensors, read by "
     "every executor from the path given; /pause_generation, /continue_generation, GET "
     "/get_weight_version)"),
    ("weight-version", str, "default", "router: what GET /get_weight_version says until an "
     "update names another"),
    ("dtype", _choice("auto", "float32", "float16", "bfloat16"), "auto",
     "model dtype (auto: the checkpoint's; float32 where a CPU would emulate it)"),
    ("kv-cache-dtype", _choice(*KV_CACHE_DTYPE_CHOICES), "auto",
     "executor: KV cache element type (auto: the model's; fp8 = fp8_e4m3: one byte a value, "
     "twice the blocks of a 16-bit cache, unscaled and saturating)"),
    ("block-size", _block_size, 16, "tokens per KV-cache block (8, 16, 32, 64, 128)"),
    ("num-gpu-blocks", _positive_int, None, "device KV blocks (default: memory profiling)"),
    ("gpu-memory-utilization", float, 0.9, "CUDA: fraction of device memory to use"),
    ("kv-cache-space", float, 1.0, "CPU device: GiB of KV cache"),
    ("cpu-threads", _positive_int, 1, "torch threads of a CPU executor"),
    ("cpu-affinity", str, "auto",
     "CPU executors: cores for compute (serve auto: spare cores; executor: e.g. 2-3; off)"),
    ("swap-space", float, None, "GiB of CPU swap blocks (4 on CUDA, 0.5 on CPU; 0 disables)"),
    ("num-cpu-blocks", int, None, "CPU swap blocks (default: from --swap-space)"),
    ("kv-offloading-size", _non_negative_float, 0.0, "GiB of CPU memory an executor adds to "
     "its swap blocks to keep prefix-cache blocks evicted from the device, swapped back in "
     "when a prompt starts with them (router: >0 turns offloading on, into whatever CPU "
     "blocks each executor has; 0: off)"),
    ("disaggregation-mode", _choice("null", "prefill", "decode"), "null", "executor: its "
     "part in prefill/decode disaggregation: prefill (computes new requests' prompts; each "
     "then moves with its KV blocks to a decode executor), decode (takes them over; new "
     "requests only while no other executor is up), null (both)"),
    ("prefill-executors", _non_negative_int, 0, "serve: of --executors, how many run "
     "--disaggregation-mode prefill, the others decode (0: each does both)"),
    ("max-num-seqs", _positive_int, 256, "sequences per step"),
    ("max-num-batched-tokens", _positive_int, 8192, "tokens per step (chunked prefill)"),
    ("max-model-len", _positive_int, None, "context length (default: the model's)"),
    ("max-queue-len", _positive_int, 1024, "waiting requests before RESOURCE_EXHAUSTED"),
    ("max-n", _positive_int, 16, "cap on SamplingParams.n"),
    ("max-logprobs", int, 20, "cap on SamplingParams.logprobs"),
    ("max-stop", int, 16, "cap on the number of stop strings"),
    ("no-prefix-caching", parse_bool, False, "turn prefix caching off"),
    ("preemption-mode", _choice("auto", "recompute", "swap"), "auto", "how to preempt"),
    ("routing", _choice("prefix", "round-robin", "least-loaded"), "prefix", "routing policy"),
    ("kv-pull", _choice("auto", "off"), "off", "router: prefix pulls: auto (an executor "
     "lacking blocks of a prompt's prefix that another executor's cache holds receives them "
     "through the router when routing prices that quicker than computing them; needs "
     "--swap-space) or off"),
    ("enforce-eager", parse_bool, False, "CUDA: run every step eagerly (no CUDA graphs: "
     "neither for decode steps nor the pieces of steps with prompt tokens)"),
    ("speculative-config", _speculative_config, None, "router: speculative decoding, "
     "vLLM's JSON, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
     "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}': drafts from the request's own "
     "tokens, outputs unchanged (default: off)"),
    ("pipeline-depth", _pipeline_depth, 2, "plans in flight per executor: 1 (one at a time) to 4"),
    ("step-timeout", _positive_float, 30.0, "seconds a plan may go unanswered (plus its work)"),
    ("heartbeat-timeout", float, 2.0, "seconds of executor silence before it counts as dead"),
    ("shutdown-timeout", float, 30.0, "seconds of draining on SIGINT/SIGTERM"),
    ("restart-executors", parse_bool, False, "serve: restart an executor that died"),
    ("seed", int, 0, "random seed"),
    ("log-format", _choice("text", "json"), "text", "log line format"),
    ("log-requests", parse_bool, False, "router: a log line per request that ended (logger "
     "pagedserve.requests: id, API, status, finish reasons, token counts, TTFT and end-to-"
     "end ms; never prompts or outputs)"),
    ("tls-cert", str, None, "gRPC TLS certificate (PEM)"),
    ("tls-key", str, None, "gRPC TLS private key (PEM)"),
    ("tls-client-ca", str, None, "CA for client certificates (mutual TLS)"),
    ("api-key", _api_keys, None, "router: keys the gRPC and HTTP APIs require, sent as "
     "'Authorization: Bearer KEY' (comma-separated to accept several; /health, /version "
     "and gRPC health stay open; default: none needed)"),
    ("batch-dir", str, None, "router: a folder for the OpenAI Batch API's files and batches "
     "(POST /v1/files, /v1/batches; shared by the API workers); unset: the API is off"),
    ("responses-store-mb", _non_negative_float, 128.0, "router: MiB of memory for stored "
     "Responses (store: true, OpenAI's default): what previous_response_id, GET and DELETE "
     "/v1/responses/{id} and background responses read, the least recently used dropped "
     "past it (0: none kept, store ignored)"),
    ("responses-dir", str, None, "router: a folder where the stored Responses and "
     "conversations are also written (SQLite), so a restarted router still has them "
     "(default: memory only)"),
    ("allowed-origins", _allowed_origins, None, "router: web origins whose pages may call the "
     "HTTP API from a browser (CORS), comma-separated scheme://host[:port], or * for any "
     "(default: none)"),
    ("api-key-file", str, None, "router: a file of API keys (one a line, # "
     "comments) besides --api-key, re-read when it changes: keys rotate without a restart "
     "(e.g. a Kubernetes Secret mounted as a file)"),
    ("curve-keys", str, None, "folder from `pagedserve keygen` (ZeroMQ CURVE)"),
    ("allow-insecure", parse_bool, False, "permit a non-loopback bind without CURVE keys"),
    ("parent-pid", int, None, argparse.SUPPRESS),  # set by serve for its executors
    ("debug-checks", parse_bool, False, argparse.SUPPRESS),  # KV invariants every step
]

_BOOLEAN_SWITCHES = {"enforce-eager", "no-prefix-caching", "restart-executors", "allow-insecure",
                     "debug-checks", "log-requests", "enable-weight-updates"}


_SECRETS = {"api-key"}


def env_name(flag: str) -> str:
    return "PAGEDSERVE_" + flag.upper().replace("-", "_")


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """Every flag of the table, each defaulting to its environment variable."""
    for flag, type_, default, help_ in FLAGS:
        env = os.environ.get(env_name(flag))
        if env is not None:
            try:
                default = type_(env)  # type: ignore[operator]
            except (argparse.ArgumentTypeError, ValueError) as exc:
                shown = "(not shown)" if flag in _SECRETS else repr(env)
                raise FlagError(f"{env_name(flag)}={shown}: {exc}") from None
        if flag == "lora-modules":  # each argument's pairs: flatten_lora_modules
            parser.add_argument("--" + flag, type=type_, nargs="+",
                                default=[] if default is None else [default], help=help_)
        elif flag in _BOOLEAN_SWITCHES:
            # `--flag` alone means true; `--flag=0` is accepted too.
            parser.add_argument("--" + flag, type=type_, nargs="?", const=True,
                                default=default, help=help_)
        else:
            secret = flag in _SECRETS  # never printed, not even from the environment
            shown = help_ if help_ is argparse.SUPPRESS or default is None or secret \
                else f"{help_} (default: {default})"
            parser.add_argument("--" + flag, type=type_, default=default, help=shown)
